// Fused mixed-precision Adam(W) over one contiguous buffer: kernel first, launcher after.
//
// [Note: Adam kernel layout]
// Four to five buffers of `numel` elements are read and written in step: param, exp_avg, exp_avg_sq (fp32),
// grad (fp32/fp16/bf16) and optionally out (fp16/bf16). With a split master (see [Note: split master] in
// common.h) param is absent: the master is read from, and written back to, the bf16 out and the 16-bit
// low halves. Each grid-stride step of a thread handles a pack of
// kPack = 8 consecutive elements: two 16-byte words of each fp32 buffer, one (or two) of the 16-bit ones.
// The buffers are views that may start anywhere, so the launcher looks for one `head` in [0, kPack) such
// that element `head` of every buffer sits on a 16-byte boundary; then
//   head:    elements [0, head), one per thread,
//   body:    n_packs whole packs from element head, one pack per thread per grid-stride step,
//   tail:    the fewer than kPack elements after the last whole pack, one per thread.
// Buffers whose starting offsets disagree (say a grad view one element further from a boundary than its
// param view) have no common head; then head = numel and every element takes the scalar path: correct,
// slower, and absent from the flat shards the optimizer normally passes.
//
// [Note: Adam arithmetic]
// adam_element follows torch.optim.Adam(W)'s foreach CUDA path operation by operation (torch/optim/adam.py,
// _multi_tensor_adam, and the ATen functors it calls): the host folds the step-dependent scalars in double
// precision and rounds them to float once, as torch does when a Python float meets an fp32 tensor; the
// products that torch rounds separately are rounded separately here (mul_rn), and the a + s * b of its
// functors (addcmul, addcdiv, add with alpha, lerp) are written as fmaf, which is what nvcc's contraction
// makes of them in torch's build. Spelling both out keeps our own compiler's contraction choices from
// moving the result; torch's rounding is an assumption about its build, so the tests allow an ulp.
#include "cuda/adam.h"

#include <cmath>
#include <cstring>
#include <initializer_list>

#include "cuda/kernel_utils.h"

namespace bmtwrap::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kPack = 8;
constexpr const char* kOp = "adam_cuda";

// Scalars of one step, folded on the host (see [Note: Adam arithmetic]).
struct AdamScalars {
  float grad_scale;
  bool decoupled_decay;  // p *= decay_factor
  float decay_factor;    // 1 - lr * weight_decay
  bool l2_decay;         // g += weight_decay * p
  float weight_decay;
  float lerp_weight;  // 1 - beta1
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
};

// A product rounded on its own, never contracted into a following add.
BMT_HOST_DEVICE inline float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

BMT_HOST_DEVICE inline void adam_element(float& p, float& m, float& v, float grad, const AdamScalars& s) {
  float g = mul_rn(grad, s.grad_scale);
  if (s.decoupled_decay) {
    p = mul_rn(p, s.decay_factor);  // torch._foreach_mul_(params, 1 - lr * weight_decay)
  }
  if (s.l2_decay) {
    g = fmaf(s.weight_decay, p, g);  // torch._foreach_add(grads, params, alpha=weight_decay)
  }
  // torch.lerp (ATen/native/Lerp.h) switches formula at weight 0.5 for accuracy.
  const float w = s.lerp_weight;
  m = fabsf(w) < 0.5f ? fmaf(w, g - m, m) : fmaf(-(g - m), 1.0f - w, g);
  v = fmaf(s.one_minus_beta2, mul_rn(g, g), mul_rn(v, s.beta2));  // mul_(beta2).addcmul_(g, g, 1 - beta2)
  const float denom = sqrtf(v) / s.bias_correction2_sqrt + s.eps;
  p = fmaf(s.neg_step_size, m / denom, p);  // addcdiv_(m, denom, value=-step_size)
}

template <typename G, typename O>
struct AdamBuffers {
  float* param;  // nullptr with a split master
  const G* grad;
  float* exp_avg;
  float* exp_avg_sq;
  O* out;  // nullptr: no copy
  uint16_t* low;  // the master's low halves (out holds its weights); nullptr: param is the master
  int64_t numel;
  int64_t head;     // see [Note: Adam kernel layout]
  int64_t n_packs;  // whole packs starting at element head
};

BMT_HOST_DEVICE inline float join_master(__nv_bfloat16 weight, uint16_t low) {
  uint16_t weight_bits;
  memcpy(&weight_bits, &weight, sizeof weight_bits);
  const uint32_t bits = join_master_bits(weight_bits, low);
  float master;
  memcpy(&master, &bits, sizeof master);
  return master;
}

BMT_HOST_DEVICE inline void split_master(float master, __nv_bfloat16& weight, uint16_t& low) {
  uint32_t bits;
  memcpy(&bits, &master, sizeof bits);
  const SplitBits halves = split_master_bits(bits);
  memcpy(&weight, &halves.weight, sizeof weight);
  low = halves.low;
}

// The part of the buffers that thread `thread` of `stride` updates. Host-callable, so that the layout can
// be checked on a machine without a GPU. kSplit: the master is split (O is bfloat16, see AdamBuffers).
template <bool kSplit, typename G, typename O>
BMT_HOST_DEVICE void adam_thread(const AdamBuffers<G, O>& b, const AdamScalars& s, int64_t thread, int64_t stride) {
  for (int64_t i = thread; i < b.n_packs; i += stride) {
    const int64_t first = b.head + i * kPack;
    Pack<float, kPack> p;
    if constexpr (kSplit) {
      const Pack<O, kPack> weights = load_pack<O, kPack>(b.out + first);
      const Pack<uint16_t, kPack> lows = load_pack<uint16_t, kPack>(b.low + first);
#pragma unroll
      for (int k = 0; k < kPack; ++k) {
        p.v[k] = join_master(weights.v[k], lows.v[k]);
      }
    } else {
      p = load_pack<float, kPack>(b.param + first);
    }
    Pack<float, kPack> m = load_pack<float, kPack>(b.exp_avg + first);
    Pack<float, kPack> v = load_pack<float, kPack>(b.exp_avg_sq + first);
    const Pack<G, kPack> g = load_pack<G, kPack>(b.grad + first);
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      adam_element(p.v[k], m.v[k], v.v[k], to_float(g.v[k]), s);
    }
    store_pack(b.exp_avg + first, m);
    store_pack(b.exp_avg_sq + first, v);
    if constexpr (kSplit) {
      Pack<O, kPack> weights;
      Pack<uint16_t, kPack> lows;
#pragma unroll
      for (int k = 0; k < kPack; ++k) {
        split_master(p.v[k], weights.v[k], lows.v[k]);
      }
      store_pack(b.out + first, weights);
      store_pack(b.low + first, lows);
    } else {
      store_pack(b.param + first, p);
      if (b.out != nullptr) {
        Pack<O, kPack> o;
#pragma unroll
        for (int k = 0; k < kPack; ++k) {
          o.v[k] = from_float<O>(p.v[k]);
        }
        store_pack(b.out + first, o);
      }
    }
  }

  const int64_t tail_begin = b.head + b.n_packs * kPack;
  const int64_t n_scalars = b.head + (b.numel - tail_begin);
  for (int64_t j = thread; j < n_scalars; j += stride) {
    const int64_t i = j < b.head ? j : tail_begin + (j - b.head);
    float p;
    if constexpr (kSplit) {
      p = join_master(b.out[i], b.low[i]);
    } else {
      p = b.param[i];
    }
    float m = b.exp_avg[i];
    float v = b.exp_avg_sq[i];
    adam_element(p, m, v, to_float(b.grad[i]), s);
    b.exp_avg[i] = m;
    b.exp_avg_sq[i] = v;
    if constexpr (kSplit) {
      split_master(p, b.out[i], b.low[i]);
    } else {
      b.param[i] = p;
      if (b.out != nullptr) {
        b.out[i] = from_float<O>(p);
      }
    }
  }
}

template <bool kSplit, typename G, typename O>
__global__ void __launch_bounds__(kThreads)
    adam_kernel(AdamBuffers<G, O> buffers, AdamScalars scalars, const uint8_t* __restrict__ skip_flag) {
  // Every thread reads the flag (one cached byte) so that a set flag leaves every buffer untouched.
  if (skip_flag != nullptr && *skip_flag != 0) {
    return;
  }
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  adam_thread<kSplit>(buffers, scalars, thread, stride);
}

// ---------------------------------------------------------------------------------------------------------
// Launcher

struct BufferAddress {
  std::uintptr_t address;
  int64_t elem_bytes;
};

// The common head of [Note: Adam kernel layout], or -1 if the buffers' offsets from a 16-byte boundary
// disagree. A pack spans 16 bytes of the narrowest buffer, so a head beyond kPack is never needed. Null
// addresses (no out buffer) impose nothing.
int64_t common_head(std::initializer_list<BufferAddress> buffers) {
  for (int64_t head = 0; head < kPack; ++head) {
    bool aligned = true;
    for (const BufferAddress& b : buffers) {
      const std::uintptr_t first = b.address + static_cast<std::uintptr_t>(head * b.elem_bytes);
      aligned &= b.address == 0 || first % kVectorBytes == 0;
    }
    if (aligned) {
      return head;
    }
  }
  return -1;
}

AdamScalars fold_scalars(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                         double grad_scale, bool decoupled) {
  // torch computes these from Python floats (doubles) and rounds each to float when it meets the tensors.
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  AdamScalars s{};
  s.grad_scale = static_cast<float>(grad_scale);
  s.decoupled_decay = decoupled && weight_decay != 0.0;
  s.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
  s.l2_decay = !decoupled && weight_decay != 0.0;
  s.weight_decay = static_cast<float>(weight_decay);
  s.lerp_weight = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  return s;
}

// Fills in head and n_packs of [Note: Adam kernel layout] from the buffers' addresses.
template <typename G, typename O>
AdamBuffers<G, O> with_layout(AdamBuffers<G, O> b) {
  const int64_t head = common_head({{reinterpret_cast<std::uintptr_t>(b.param), sizeof(float)},
                                    {reinterpret_cast<std::uintptr_t>(b.exp_avg), sizeof(float)},
                                    {reinterpret_cast<std::uintptr_t>(b.exp_avg_sq), sizeof(float)},
                                    {reinterpret_cast<std::uintptr_t>(b.grad), sizeof(G)},
                                    {reinterpret_cast<std::uintptr_t>(b.out), sizeof(O)},
                                    {reinterpret_cast<std::uintptr_t>(b.low), sizeof(uint16_t)}});
  b.head = head < 0 ? b.numel : std::min(head, b.numel);
  b.n_packs = (b.numel - b.head) / kPack;
  return b;
}

template <bool kSplit, typename G, typename O>
void launch(const AdamBuffers<G, O>& buffers, const AdamScalars& scalars, const uint8_t* skip_flag,
            cudaStream_t stream) {
  const int64_t n_scalars = buffers.numel - buffers.n_packs * kPack;
  const int64_t work = std::max(buffers.n_packs, n_scalars);
  constexpr auto kernel = adam_kernel<kSplit, G, O>;
  const int64_t wanted = (work + kThreads - 1) / kThreads;
  const int64_t blocks = std::clamp<int64_t>(wanted, 1, resident_blocks<kernel>(kOp, kThreads));
  kernel<<<static_cast<int>(blocks), kThreads, 0, stream>>>(buffers, scalars, skip_flag);
  check_cuda(cudaGetLastError(), kOp, "kernel launch");
}

void check_hyperparameters(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step) {
  const auto fail = [](const std::string& what) {
    throw std::invalid_argument(std::string("bmtwrap._C.") + kOp + ": " + what);
  };
  if (step < 1) {
    fail("step must be >= 1 (the bias corrections divide by 1 - beta^step), got " + std::to_string(step));
  }
  if (!(beta1 >= 0.0 && beta1 < 1.0) || !(beta2 >= 0.0 && beta2 < 1.0)) {
    fail("beta1 and beta2 must be in [0, 1), got " + std::to_string(beta1) + " and " + std::to_string(beta2));
  }
  if (!(lr >= 0.0) || !(eps >= 0.0) || !(weight_decay >= 0.0)) {
    fail("lr, eps and weight_decay must be >= 0");
  }
}

// The checks every step makes: no null buffer, sane hyper-parameters, aligned moments. False: nothing to do.
bool check_step(std::initializer_list<std::uintptr_t> buffers, std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq,
                int64_t numel, double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step) {
  for (const std::uintptr_t ptr : buffers) {
    check_buffer(kOp, ptr, numel);
  }
  check_hyperparameters(lr, beta1, beta2, eps, weight_decay, step);
  check_aligned(kOp, "exp_avg", exp_avg, sizeof(float));
  check_aligned(kOp, "exp_avg_sq", exp_avg_sq, sizeof(float));
  return numel > 0;
}

}  // namespace

void adam_cuda(std::uintptr_t param, std::uintptr_t grad, DType grad_dtype, std::uintptr_t exp_avg,
               std::uintptr_t exp_avg_sq, int64_t numel, double lr, double beta1, double beta2, double eps,
               double weight_decay, int64_t step, double grad_scale, bool decoupled, std::uintptr_t out,
               DType out_dtype, std::uintptr_t skip_flag_ptr, std::uintptr_t stream) {
  check_aligned(kOp, "param", param, sizeof(float));
  if (!check_step({param, grad, exp_avg, exp_avg_sq}, exp_avg, exp_avg_sq, numel, lr, beta1, beta2, eps, weight_decay,
                  step)) {
    return;
  }
  const AdamScalars scalars = fold_scalars(lr, beta1, beta2, eps, weight_decay, step, grad_scale, decoupled);
  const uint8_t* skip_flag = reinterpret_cast<const uint8_t*>(skip_flag_ptr);
  cudaStream_t cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  dispatch_dtype(grad_dtype, [&](auto grad_traits) {
    using G = DeviceScalarT<decltype(grad_traits)>;
    check_aligned(kOp, "grad", grad, sizeof(G));
    dispatch_dtype(out_dtype, [&](auto out_traits) {
      using O = DeviceScalarT<decltype(out_traits)>;
      check_aligned(kOp, "out", out, sizeof(O));
      const AdamBuffers<G, O> buffers{reinterpret_cast<float*>(param),   reinterpret_cast<const G*>(grad),
                                      reinterpret_cast<float*>(exp_avg), reinterpret_cast<float*>(exp_avg_sq),
                                      reinterpret_cast<O*>(out),         /*low=*/nullptr,
                                      numel,                             /*head=*/0,
                                      /*n_packs=*/0};
      launch</*kSplit=*/false>(with_layout(buffers), scalars, skip_flag, cuda_stream);
    });
  });
}

void adam_split_cuda(std::uintptr_t weight, std::uintptr_t low, std::uintptr_t grad, DType grad_dtype,
                     std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq, int64_t numel, double lr, double beta1,
                     double beta2, double eps, double weight_decay, int64_t step, double grad_scale, bool decoupled,
                     std::uintptr_t skip_flag_ptr, std::uintptr_t stream) {
  check_aligned(kOp, "weight", weight, sizeof(uint16_t));
  check_aligned(kOp, "low", low, sizeof(uint16_t));
  if (!check_step({weight, low, grad, exp_avg, exp_avg_sq}, exp_avg, exp_avg_sq, numel, lr, beta1, beta2, eps,
                  weight_decay, step)) {
    return;
  }
  const AdamScalars scalars = fold_scalars(lr, beta1, beta2, eps, weight_decay, step, grad_scale, decoupled);
  const uint8_t* skip_flag = reinterpret_cast<const uint8_t*>(skip_flag_ptr);
  cudaStream_t cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  dispatch_dtype(grad_dtype, [&](auto grad_traits) {
    using G = DeviceScalarT<decltype(grad_traits)>;
    using O = __nv_bfloat16;
    check_aligned(kOp, "grad", grad, sizeof(G));
    const AdamBuffers<G, O> buffers{/*param=*/nullptr,                   reinterpret_cast<const G*>(grad),
                                    reinterpret_cast<float*>(exp_avg),   reinterpret_cast<float*>(exp_avg_sq),
                                    reinterpret_cast<O*>(weight),        reinterpret_cast<uint16_t*>(low),
                                    numel,                               /*head=*/0,
                                    /*n_packs=*/0};
    launch</*kSplit=*/true>(with_layout(buffers), scalars, skip_flag, cuda_stream);
  });
}

}  // namespace bmtwrap::cuda
