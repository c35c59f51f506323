// CPU Adam / AdamW in one pass over memory: AVX-512 or AVX2 chosen at run time, split over the worker pool.
//
// [Note: matching torch bit for bit]
// torch.optim.AdamW on the CPU (single-tensor and foreach paths alike) runs these fp32 kernels, in order:
//   param.mul_(1 - lr * wd)                     p = p * float(1 - lr*wd)                    (AdamW, wd != 0)
//   grad = grad.add(param, alpha=wd)            g = fma(p, float(wd), g)                     (Adam, wd != 0)
//   exp_avg.lerp_(grad, 1 - beta1)              m = fma(w, g - m, m)      with w = float(1 - beta1), |w| < 0.5
//                                               m = fma(w - 1, g - m, g)  otherwise
//   exp_avg_sq.mul_(beta2)                      v = v * float(beta2)
//       .addcmul_(grad, grad, value=1 - beta2)  v = fma(float(1 - beta2) * g, g, v)   (*)
//   denom = (exp_avg_sq.sqrt() / bc2_sqrt)      d = sqrt(v) / float(bc2_sqrt)  bc2_sqrt = (1 - beta2^step)^0.5
//       .add_(eps)                              d = d + float(eps)
//   param.addcdiv_(exp_avg, denom, -step_size)  p = p + (float(-lr / (1 - beta1^step)) * m) / d
// with every scalar computed in double as Python computes it and rounded once to float. (*) addcmul's source
// says `self + value * t1 * t2`; torch's AVX2 and AVX-512 kernels are compiled with FMA enabled and GCC fuses
// the last multiply and the add, which is what a torch wheel computes on any CPU with AVX2 (checked against
// torch 2.13 on AVX-512 in tests/test_adam_cpu.py; only torch's no-AVX2 fallback differs). We run the same
// operations per element, each a correctly rounded IEEE operation (sqrt and division included) or an explicit
// fused multiply-add. They are the same in every vector lane and in the scalar code, so the result does not
// depend on the ISA path nor on how the buffer is split over threads. That requires the compiler to fuse
// nothing on its own: setup.py builds with -ffp-contract=off.
// Where we differ from torch: its sqrt comes from MKL's vector math (within an ulp, not always correctly
// rounded), ours is IEEE's. About one element in 200 gets a denominator an ulp away, so its parameter moves
// by one rounding less or more; AdamW's moments never go through sqrt and match bit for bit. Both are
// measured by tests/test_adam_cpu.py.
//
// [Note: one source, three instruction sets]
// The kernel body is written once, as templates over a vector type V (Scalar, Avx2 or Avx512) whose
// operations carry V's target attribute. Each ISA has one entry function with the same target attribute and
// `flatten`, which inlines the whole body, V's operations included, into code compiled for that ISA; the rest
// of the file is compiled for the baseline ISA, so the module loads on any x86-64. The best ISA the CPU
// supports is chosen once, with __builtin_cpu_supports (which also checks that the OS saves the registers).
#include "cpu/adam.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "cpu/parallel.h"
#include "cpu/vec.h"

namespace bmtwrap::cpu {
namespace {

using namespace vec;  // the element and vector types of vec.h

// ------------------------------------------------------------------------------------------------ kernel

// The fp32 scalars of one step, each rounded once from the double Python would compute (see
// [Note: matching torch bit for bit]).
struct AdamScalars {
  float grad_scale;
  bool l2;                  // Adam with weight decay: g = fma(p, weight_decay, g)
  float weight_decay;
  float param_decay;        // AdamW: p *= param_decay (1 when weight_decay == 0, which changes nothing)
  bool m_lerp_from_exp_avg;  // torch's lerp: from exp_avg when |1 - beta1| < 0.5, else back from grad
  float m_coeff;
  float beta2;
  float one_minus_beta2;
  float bc2_sqrt;
  float eps;
  float neg_step_size;
};

AdamScalars make_scalars(const AdamHyper& h) {
  const double bias_correction1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
  const double bias_correction2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  const auto lerp_weight = static_cast<float>(1.0 - h.beta1);
  AdamScalars s{};
  s.grad_scale = static_cast<float>(h.grad_scale);
  s.l2 = !h.decoupled && h.weight_decay != 0.0;
  s.weight_decay = static_cast<float>(h.weight_decay);
  s.param_decay = h.decoupled ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  s.m_lerp_from_exp_avg = std::fabs(lerp_weight) < 0.5f;
  s.m_coeff = s.m_lerp_from_exp_avg ? lerp_weight : lerp_weight - 1.0f;
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.bc2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));  // Python's `bc2 ** 0.5` is C's pow
  s.eps = static_cast<float>(h.eps);
  s.neg_step_size = static_cast<float>(-(h.lr / bias_correction1));
  return s;
}

// The buffers of one step, typed. G: the gradient's element type; C: the copy's (or NoCopy). The new param,
// exp_avg and exp_avg_sq go to the *_out pointers, which equal the inputs for a step in place.
template <typename G, typename C>
struct Buffers {
  const float* param;
  const G* grad;
  const float* exp_avg;
  const float* exp_avg_sq;
  C* copy;
  float* param_out;
  float* exp_avg_out;
  float* exp_avg_sq_out;
};

// [Note: memory traffic]
// The step is bound by memory bandwidth: 28 bytes per element (16 read, 12 written) against some 20 flops.
// Two things measurably help (benchmarks/adam_cpu.py, 64 Mi elements, 2 cores of a Xeon 4th gen):
//   - software prefetch of the four input streams kPrefetchElements ahead: +10-13%. The hardware prefetchers
//     alone do not keep enough lines in flight for four read and three write streams per core;
//   - streaming (non-temporal) stores for the low-precision copy: +8-10% with a bf16 copy. Nothing here reads
//     the copy again (the GPU's DMA does), so bypassing the caches saves reading each of its lines before
//     writing it and keeps the caches for the state. Only for large steps (kStreamCopyMinElements): a small
//     copy may well be read back from cache at once.
// Streaming stores for param and the moments made things slower in place (their lines are in cache already, having
// just been read), as did prefetching further ahead (1-4 Ki elements) or less far (256). A step written elsewhere
// (AdamTargets) is the opposite case: its targets' lines are not in cache, and a plain store first reads each line
// it writes (12 bytes per element more, 40 instead of 28); streaming stores write them without reading.
// The same holds on the other development machine, 2 cores of an AMD EPYC (Zen 3, AVX2) under KVM, with 4 KiB
// pages: there one thread moves about 20 GB/s (28 bytes per element) and two about 26-31 GB/s, more than a plain
// copy (16-25 GB/s, its destination's reads counted). Variants of this loop built side by side and timed in turn
// on the same buffers (50 M elements): the same loads and stores with trivial arithmetic in place of Adam's run
// no faster, so the step is at that machine's ceiling for its bytes; without the prefetch it is 5-8% slower at
// one thread, and a loop of eight vectors per turn without prefetch (as DeepSpeed's is written) 7-11% slower at
// one and two threads. Worse there: streaming stores for param and the moments in place (-50%), writing each
// block back early with clwb (-40%), prefetching a whole block of lines at once (-20-30%), prefetching into L2
// only or 1-2 Ki elements ahead (nothing gained). Transparent huge pages for the buffers gain 4-5% (the offload
// optimizer allocates its state on them; a caller's tensors are the caller's to place).
constexpr int64_t kPrefetchElements = 512;
constexpr int64_t kStreamCopyMinElements = int64_t{1} << 20;

// Prefetches element `i + kPrefetchElements` of p into all cache levels. The address is computed as an
// integer: it may lie past the end of the buffer, which is harmless for a prefetch but would be undefined
// behaviour as a pointer. (A free function, not a member of V: GCC 12 silently drops a prefetch inlined from a
// function with its own target attribute.)
template <typename T>
inline void prefetch_ahead(const T* p, int64_t i) {
  const std::uintptr_t address =
      reinterpret_cast<std::uintptr_t>(p) + static_cast<std::uintptr_t>(i + kPrefetchElements) * sizeof(T);
  __builtin_prefetch(reinterpret_cast<const void*>(address), /*rw=*/0, /*locality=*/3);
}

// Elements [begin, end) of the step, kWidth at a time; end - begin must be a multiple of V::kWidth. With
// kStreamCopy the copy is written with streaming stores, so b.copy + begin must be aligned to a whole vector; with
// kStreamState so are the new param and moments, so their targets + begin must be too.
template <typename V, typename G, typename C, bool kL2, bool kStreamCopy = false, bool kStreamState = false>
inline void adam_vectors(const Buffers<G, C>& b, const AdamScalars& s, int64_t begin, int64_t end) {
  using F = typename V::F;
  const F grad_scale = V::set1(s.grad_scale);
  const F weight_decay = V::set1(s.weight_decay);
  const F param_decay = V::set1(s.param_decay);
  const F m_coeff = V::set1(s.m_coeff);
  const F beta2 = V::set1(s.beta2);
  const F one_minus_beta2 = V::set1(s.one_minus_beta2);
  const F bc2_sqrt = V::set1(s.bc2_sqrt);
  const F eps = V::set1(s.eps);
  const F neg_step_size = V::set1(s.neg_step_size);
  for (int64_t i = begin; i < end; i += V::kWidth) {
    if constexpr (V::kWidth > 1) {  // the scalar code only finishes what the vectors leave
      prefetch_ahead(b.grad, i);
      prefetch_ahead(b.param, i);
      prefetch_ahead(b.exp_avg, i);
      prefetch_ahead(b.exp_avg_sq, i);
    }
    F g = V::mul(V::load(b.grad + i), grad_scale);
    F p = V::load(b.param + i);
    if constexpr (kL2) {
      g = V::fmadd(p, weight_decay, g);
    } else {
      p = V::mul(p, param_decay);
    }
    F m = V::load(b.exp_avg + i);
    m = V::fmadd(m_coeff, V::sub(g, m), s.m_lerp_from_exp_avg ? m : g);
    F v = V::load(b.exp_avg_sq + i);
    v = V::fmadd(V::mul(one_minus_beta2, g), g, V::mul(v, beta2));
    const F denom = V::add(V::div(V::sqrt(v), bc2_sqrt), eps);
    p = V::add(p, V::div(V::mul(neg_step_size, m), denom));
    if constexpr (kStreamState) {
      V::stream(b.param_out + i, p);
      V::stream(b.exp_avg_out + i, m);
      V::stream(b.exp_avg_sq_out + i, v);
    } else {
      V::store(b.param_out + i, p);
      V::store(b.exp_avg_out + i, m);
      V::store(b.exp_avg_sq_out + i, v);
    }
    if constexpr (kStreamCopy) {
      V::stream(b.copy + i, p);
    } else if constexpr (!std::is_same_v<C, NoCopy>) {
      V::store(b.copy + i, p);
    }
  }
}

// Elements [begin, end): whole vectors of V, then the rest one at a time. With stream_state (the step writes
// elsewhere: AdamTargets) the new param and moments, and with stream_copy the copy, are written with streaming
// stores where their addresses allow: the elements before the first whole vector of the streamed output go one at a
// time, and a second output streams only if it is aligned there too. Streaming stores are fenced before returning,
// so that the caller's synchronisation also publishes them.
template <typename V, typename G, typename C, bool kL2>
inline void adam_range(const Buffers<G, C>& b, const AdamScalars& s, int64_t begin, int64_t end, bool stream_copy,
                       bool stream_state) {
  constexpr bool kHasCopy = !std::is_same_v<C, NoCopy>;
  if constexpr (V::kWidth > 1) {
    stream_copy = stream_copy && kHasCopy;
    if (stream_copy || stream_state) {
      auto head_of = [&](std::uintptr_t address, std::uintptr_t element) {
        const std::uintptr_t vector_bytes = static_cast<std::uintptr_t>(V::kWidth) * element;
        return static_cast<int64_t>((vector_bytes - address % vector_bytes) % vector_bytes / element);
      };
      const int64_t head = stream_state ? head_of(reinterpret_cast<std::uintptr_t>(b.param_out + begin), 4)
                                        : head_of(reinterpret_cast<std::uintptr_t>(b.copy + begin), sizeof(C));
      const int64_t vector_begin = std::min(end, begin + head);
      const int64_t vector_end = vector_begin + (end - vector_begin) / V::kWidth * V::kWidth;
      if constexpr (kHasCopy) {
        if (stream_copy && stream_state) {
          stream_copy = head_of(reinterpret_cast<std::uintptr_t>(b.copy + vector_begin), sizeof(C)) == 0;
        }
      }
      adam_vectors<Scalar, G, C, kL2>(b, s, begin, vector_begin);
      if (stream_state && stream_copy) {
        adam_vectors<V, G, C, kL2, kHasCopy, true>(b, s, vector_begin, vector_end);
      } else if (stream_state) {
        adam_vectors<V, G, C, kL2, false, true>(b, s, vector_begin, vector_end);
      } else {
        adam_vectors<V, G, C, kL2, kHasCopy, false>(b, s, vector_begin, vector_end);
      }
      adam_vectors<Scalar, G, C, kL2>(b, s, vector_end, end);
      V::fence();
      return;
    }
  }
  const int64_t vector_end = begin + (end - begin) / V::kWidth * V::kWidth;
  adam_vectors<V, G, C, kL2>(b, s, begin, vector_end);
  adam_vectors<Scalar, G, C, kL2>(b, s, vector_end, end);
}

// A step as it crosses threads: untyped pointers and the dtypes that say how to read them.
struct AdamJob {
  std::uintptr_t param, grad, exp_avg, exp_avg_sq, copy;  // copy == 0: no copy
  std::uintptr_t param_out, exp_avg_out, exp_avg_sq_out;  // where the results go (the inputs: in place)
  DType grad_dtype, copy_dtype;
  bool stream_copy;  // write the copy with streaming stores (see [Note: memory traffic])
  bool stream_state;  // write the new param and moments with streaming stores (they go to targets)
  AdamScalars scalars;
};

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<element type>) for a gradient or copy dtype (no copy: TypeTag<NoCopy>).
template <typename Fn>
void with_element_type(DType dtype, bool present, Fn&& f) {
  if (!present) {
    f(TypeTag<NoCopy>{});
    return;
  }
  switch (dtype) {
    case DType::kFloat32:
      f(TypeTag<float>{});
      return;
    case DType::kFloat16:
      f(TypeTag<Half>{});
      return;
    case DType::kBFloat16:
      f(TypeTag<BFloat16>{});
      return;
  }
}

// Elements [begin, end) of `job` with vector type V: picks the template instance for the job's dtypes.
template <typename V>
inline void adam_job_range(const AdamJob& job, int64_t begin, int64_t end) {
  with_element_type(job.grad_dtype, true, [&](auto grad_tag) {
    with_element_type(job.copy_dtype, job.copy != 0, [&](auto copy_tag) {
      using G = typename decltype(grad_tag)::type;
      using C = typename decltype(copy_tag)::type;
      if constexpr (!std::is_same_v<G, NoCopy> && !std::is_same_v<C, float>) {
        const Buffers<G, C> buffers{reinterpret_cast<const float*>(job.param),
                                    reinterpret_cast<const G*>(job.grad),
                                    reinterpret_cast<const float*>(job.exp_avg),
                                    reinterpret_cast<const float*>(job.exp_avg_sq),
                                    reinterpret_cast<C*>(job.copy),
                                    reinterpret_cast<float*>(job.param_out),
                                    reinterpret_cast<float*>(job.exp_avg_out),
                                    reinterpret_cast<float*>(job.exp_avg_sq_out)};
        if (job.scalars.l2) {
          adam_range<V, G, C, true>(buffers, job.scalars, begin, end, job.stream_copy, job.stream_state);
        } else {
          adam_range<V, G, C, false>(buffers, job.scalars, begin, end, job.stream_copy, job.stream_state);
        }
      }
    });
  });
}

// The entry points, one per ISA (see [Note: one source, three instruction sets]).
void adam_job_range_scalar(const AdamJob& job, int64_t begin, int64_t end) { adam_job_range<Scalar>(job, begin, end); }

#if defined(__x86_64__)
BMT_TARGET_AVX2 __attribute__((flatten)) void adam_job_range_avx2(const AdamJob& job, int64_t begin, int64_t end) {
  adam_job_range<Avx2>(job, begin, end);
}

BMT_TARGET_AVX512 __attribute__((flatten)) void adam_job_range_avx512(const AdamJob& job, int64_t begin,
                                                                      int64_t end) {
  adam_job_range<Avx512>(job, begin, end);
}
#endif

using JobRangeFn = void (*)(const AdamJob&, int64_t, int64_t);

JobRangeFn job_range_fn(CpuIsa isa) {
  switch (isa) {
#if defined(__x86_64__)
    case CpuIsa::kAvx512:
      return &adam_job_range_avx512;
    case CpuIsa::kAvx2:
      return &adam_job_range_avx2;
#endif
    default:
      return &adam_job_range_scalar;
  }
}

CpuIsa detect_best_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    return CpuIsa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    return CpuIsa::kAvx2;
  }
#endif
  return CpuIsa::kScalar;
}

// Splitting: each extra thread must have enough elements to pay for waking it (a step over 32 Ki elements
// moves about 0.9 MiB). The threads then take slices in turn, kSlicesPerThread slices per thread of at least
// kMinElementsPerSlice each, so that a thread that runs slower (its core shared with the training loop or
// another process) holds the step up by one slice at most rather than by its whole share. Every slice but the
// last starts on a 64-byte line of `param` and spans a multiple of 64 elements (whole lines of every buffer
// that is aligned like param), so threads never share a line.
constexpr int64_t kMinElementsPerThread = int64_t{1} << 15;
constexpr int64_t kSlicesPerThread = 8;
constexpr int64_t kMinElementsPerSlice = int64_t{1} << 16;
constexpr int64_t kSliceAlign = 64;
constexpr std::uintptr_t kLineBytes = 64;

std::string isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kBest:
      return "best";
    case CpuIsa::kScalar:
      return "scalar";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
  }
  return "CpuIsa(" + std::to_string(static_cast<int>(isa)) + ")";
}

bool is_known_dtype(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

void check_arguments(std::uintptr_t param_ptr, std::uintptr_t grad_ptr, DType grad_dtype,
                     std::uintptr_t exp_avg_ptr, std::uintptr_t exp_avg_sq_ptr, int64_t numel,
                     const AdamHyper& hyper, std::uintptr_t out_ptr, DType out_dtype, int num_threads,
                     CpuIsa isa, const AdamTargets& targets) {
  check_buffer("adam_cpu(param)", param_ptr, numel);
  check_buffer("adam_cpu(grad)", grad_ptr, numel);
  check_buffer("adam_cpu(exp_avg)", exp_avg_ptr, numel);
  check_buffer("adam_cpu(exp_avg_sq)", exp_avg_sq_ptr, numel);
  auto check_aligned = [](const char* name, std::uintptr_t ptr, std::uintptr_t element_bytes) {
    if (ptr % element_bytes != 0) {
      throw std::invalid_argument(std::string("adam_cpu: ") + name + " is not aligned to its " +
                                  std::to_string(element_bytes) + "-byte elements");
    }
  };
  check_aligned("param", param_ptr, 4);
  check_aligned("exp_avg", exp_avg_ptr, 4);
  check_aligned("exp_avg_sq", exp_avg_sq_ptr, 4);
  check_aligned("grad", grad_ptr, grad_dtype == DType::kFloat32 ? 4 : 2);
  check_aligned("out", out_ptr, 2);
  for (auto [name, ptr] : {std::pair{"param", targets.param}, {"exp_avg", targets.exp_avg},
                           {"exp_avg_sq", targets.exp_avg_sq}}) {
    if (ptr != 0) {
      check_buffer((std::string("adam_cpu(") + name + " target)").c_str(), ptr, numel);
      check_aligned((std::string(name) + " target").c_str(), ptr, 4);
    }
  }
  if (!is_known_dtype(grad_dtype)) {
    throw std::invalid_argument("adam_cpu: unknown grad dtype code " + std::to_string(static_cast<int>(grad_dtype)));
  }
  if (out_ptr != 0 && out_dtype != DType::kFloat16 && out_dtype != DType::kBFloat16) {
    throw std::invalid_argument("adam_cpu: out_dtype must be float16 or bfloat16, got dtype code " +
                                std::to_string(static_cast<int>(out_dtype)));
  }
  if (hyper.step < 1) {
    throw std::invalid_argument("adam_cpu: step must be >= 1, got " + std::to_string(hyper.step));
  }
  if (num_threads < 0) {
    throw std::invalid_argument("adam_cpu: num_threads must be >= 0, got " + std::to_string(num_threads));
  }
  if (!cpu_isa_supported(isa)) {
    throw std::invalid_argument("adam_cpu: this CPU does not support isa " + isa_name(isa));
  }
}

}  // namespace

bool cpu_isa_supported(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kBest:
    case CpuIsa::kScalar:
      return true;
    case CpuIsa::kAvx2:
      return cpu_best_isa() == CpuIsa::kAvx2 || cpu_best_isa() == CpuIsa::kAvx512;
    case CpuIsa::kAvx512:
      return cpu_best_isa() == CpuIsa::kAvx512;
  }
  return false;
}

CpuIsa cpu_best_isa() {
  static const CpuIsa best = detect_best_isa();
  return best;
}

std::vector<CpuIsa> cpu_supported_isas() {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (cpu_isa_supported(isa)) {
      isas.push_back(isa);
    }
  }
  return isas;
}

void adam_cpu(std::uintptr_t param_ptr, std::uintptr_t grad_ptr, DType grad_dtype, std::uintptr_t exp_avg_ptr,
              std::uintptr_t exp_avg_sq_ptr, int64_t numel, const AdamHyper& hyper, std::uintptr_t out_ptr,
              DType out_dtype, int num_threads, CpuIsa isa, const AdamTargets& targets) {
  check_arguments(param_ptr, grad_ptr, grad_dtype, exp_avg_ptr, exp_avg_sq_ptr, numel, hyper, out_ptr, out_dtype,
                  num_threads, isa, targets);
  if (numel == 0) {
    return;
  }
  auto or_in_place = [](std::uintptr_t target, std::uintptr_t input) { return target != 0 ? target : input; };
  // Stream the new state where all of it goes elsewhere, its three targets equally aligned (one head fits all).
  const bool stream_state = targets.param != 0 && targets.exp_avg != 0 && targets.exp_avg_sq != 0 &&
                            numel >= kStreamCopyMinElements &&
                            targets.param % kLineBytes == targets.exp_avg % kLineBytes &&
                            targets.param % kLineBytes == targets.exp_avg_sq % kLineBytes;
  const AdamJob job{param_ptr,
                    grad_ptr,
                    exp_avg_ptr,
                    exp_avg_sq_ptr,
                    out_ptr,
                    or_in_place(targets.param, param_ptr),
                    or_in_place(targets.exp_avg, exp_avg_ptr),
                    or_in_place(targets.exp_avg_sq, exp_avg_sq_ptr),
                    grad_dtype,
                    out_dtype,
                    numel >= kStreamCopyMinElements,
                    stream_state,
                    make_scalars(hyper)};
  const JobRangeFn run_range = job_range_fn(isa == CpuIsa::kBest ? cpu_best_isa() : isa);

  const int threads = threads_for(numel, kMinElementsPerThread, num_threads);
  const auto slices = static_cast<int>(
      threads == 1 ? 1 : std::clamp<int64_t>(numel / kMinElementsPerSlice, threads, threads * kSlicesPerThread));
  // Slice t is [start(t), start(t + 1)): `lead` elements reach param's first line boundary, then slices of
  // about numel / slices rounded down to kSliceAlign.
  const auto lead = static_cast<int64_t>(((kLineBytes - param_ptr % kLineBytes) % kLineBytes) / sizeof(float));
  auto start = [&](int t) -> int64_t {
    if (t == 0) {
      return 0;
    }
    if (t == slices) {
      return numel;
    }
    return std::min(numel, lead + numel / slices * t / kSliceAlign * kSliceAlign);
  };
  parallel_for(slices, threads, [&](int t) { run_range(job, start(t), start(t + 1)); });
}

}  // namespace bmtwrap::cpu
