// Adam / AdamW step over host buffers. See [Note: tensors crossing into C++] in common.h.
#pragma once

#include <cstdint>
#include <vector>

#include "common.h"

namespace bmtwrap::cpu {

// The instruction sets the CPU kernels are compiled for. The values are part of the Python binding
// (bmtwrap._C.CpuIsa); append, never renumber.
enum class CpuIsa : int {
  kBest = 0,    // the widest of the others that this CPU (and its OS) supports; chosen once, at first use
  kScalar = 1,  // baseline x86-64 (or whatever the build targets): one float at a time
  kAvx2 = 2,    // AVX2 + FMA + F16C: 8 floats per vector
  kAvx512 = 3,  // AVX-512 F/BW/VL: 16 floats per vector
};

// Whether this CPU can run kernels compiled for `isa` (kBest and kScalar: always).
bool cpu_isa_supported(CpuIsa isa);

// What kBest stands for on this CPU.
CpuIsa cpu_best_isa();

// Every isa this CPU supports, kScalar first, kBest excluded.
std::vector<CpuIsa> cpu_supported_isas();

// Hyper-parameters of one step, exactly as torch.optim.AdamW / torch.optim.Adam take them.
struct AdamHyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  int64_t step;        // 1 for the first step; sets the bias corrections 1 - beta^step
  double grad_scale;   // the gradient is multiplied by this as it is loaded, e.g. 1 / loss_scale
  bool decoupled;      // true: AdamW (param *= 1 - lr * weight_decay); false: Adam (grad += weight_decay * param)
};

// Where a step writes its fp32 results. A zero pointer (the default) means in place, over the input; a non-zero one
// is a buffer of `numel` elements, disjoint from every input, that receives the new values while the input is only
// read. An optimizer that may have to redo a step from the same state writes it elsewhere (see [Note: speculative
// updates] in bmtwrap/optim/speculation.py).
struct AdamTargets {
  std::uintptr_t param = 0;
  std::uintptr_t exp_avg = 0;
  std::uintptr_t exp_avg_sq = 0;
};

// One optimizer step over `numel` elements, in one pass over memory. Reads param (fp32 master weights),
// grad (`grad_dtype`: fp32, fp16 or bf16), exp_avg and exp_avg_sq (fp32); writes param, exp_avg and
// exp_avg_sq (in place, or at `targets`) and, when out_ptr != 0, the updated param rounded to nearest even into `out_dtype`
// (fp16 or bf16) at out_ptr. The results are the same bit for bit whatever `isa` and `num_threads` (0 = one
// thread per hardware thread), and torch.optim.AdamW's (Adam's when !decoupled) up to torch's sqrt (see
// [Note: matching torch bit for bit] in adam.cpp).
// Throws std::invalid_argument on a bad argument, including an `isa` the CPU does not support.
void adam_cpu(std::uintptr_t param_ptr, std::uintptr_t grad_ptr, DType grad_dtype, std::uintptr_t exp_avg_ptr,
              std::uintptr_t exp_avg_sq_ptr, int64_t numel, const AdamHyper& hyper, std::uintptr_t out_ptr,
              DType out_dtype, int num_threads, CpuIsa isa, const AdamTargets& targets = {});

}  // namespace bmtwrap::cpu
