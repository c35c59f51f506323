// Fused mixed-precision Adam(W) step over one contiguous device buffer. See [Note: tensors crossing into
// C++] in common.h. Plain C++ on purpose: bind.cpp includes this without the CUDA headers.
#pragma once

#include <cstdint>

#include "common.h"

namespace bmtwrap::cuda {

// Enqueues on `stream` (a cudaStream_t as an integer) one Adam(W) step over `numel` elements, exactly in
// torch.optim.Adam(W)'s order of operations (its foreach CUDA path), all arithmetic in fp32:
//   g   = grad * grad_scale                                     (grad: float32, float16 or bfloat16)
//   decoupled: p = p * (1 - lr * weight_decay)    else: g = g + weight_decay * p     (if weight_decay != 0)
//   m   = lerp(m, g, 1 - beta1)
//   v   = v * beta2 + (1 - beta2) * g * g
//   p   = p - (lr / (1 - beta1^step)) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
// `param` (the fp32 master), `exp_avg` (m) and `exp_avg_sq` (v) are fp32 and updated in place. If `out` is
// not 0, the new parameter is also written there in `out_dtype`, rounded to nearest even. If
// `skip_flag_ptr` is not 0 and the uint8 there is nonzero when the kernel runs, nothing is written at all:
// an overflow found on the device (has_inf_nan_cuda) skips the step without a host synchronisation.
// Buffers must not overlap; any alignment to their element size works (16-byte vectors where the buffers
// allow). Launches on the current device, which must own every buffer and the stream. Throws
// std::invalid_argument on bad arguments and std::runtime_error with CUDA's error string if the launch fails.
void adam_cuda(std::uintptr_t param, std::uintptr_t grad, DType grad_dtype, std::uintptr_t exp_avg,
               std::uintptr_t exp_avg_sq, int64_t numel, double lr, double beta1, double beta2, double eps,
               double weight_decay, int64_t step, double grad_scale, bool decoupled, std::uintptr_t out,
               DType out_dtype, std::uintptr_t skip_flag_ptr, std::uintptr_t stream);

// The same step for a bf16 weight whose fp32 master is split (see [Note: split master] in common.h): the
// master is joined from `weight` (bf16) and `low` (its low halves, uint16), updated, and written back split,
// so `weight` ends as the new master rounded to nearest even. No separate fp32 master exists.
void adam_split_cuda(std::uintptr_t weight, std::uintptr_t low, std::uintptr_t grad, DType grad_dtype,
                     std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq, int64_t numel, double lr, double beta1,
                     double beta2, double eps, double weight_decay, int64_t step, double grad_scale, bool decoupled,
                     std::uintptr_t skip_flag_ptr, std::uintptr_t stream);

}  // namespace bmtwrap::cuda
