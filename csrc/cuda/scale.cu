// A scaled, cast copy of a device buffer: kernel first, launcher after.
//
// [Note: scaled copy]
// What torch does as `a.mul_(s).to(dtype)` with `s` a 0-dim tensor on the device (a loss's upstream gradient,
// known only on the GPU) takes two passes, and torch's broadcast multiply is not vectorised: over the fp32 weight
// gradient of a 128k x 2048 output projection, 1.16 ms on an H200. One pass reads each element once and writes it
// once in the output's dtype: 8 elements per thread per step, as 16-byte words, where both buffers start on a
// 16-byte boundary; one element at a time otherwise, and for the tail.
#include "cuda/scale.h"

#include <algorithm>
#include <string>

#include "cuda/kernel_utils.h"

namespace bmtwrap::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kPer = 8;  // elements per step: one or two 16-byte words of each dtype
constexpr const char* kOp = "scaled_copy_cuda";

template <typename In, typename Out>
__global__ void __launch_bounds__(kThreads)
    scaled_copy_kernel(const In* in, Out* out, int64_t numel, bool vectors, const float* __restrict__ scale_ptr) {
  const float scale = *scale_ptr;
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t n_packs = vectors ? numel / kPer : 0;
  for (int64_t pack = thread; pack < n_packs; pack += stride) {
    const Pack<In, kPer> src = load_pack<In, kPer>(in + pack * kPer);
    Pack<Out, kPer> dst;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      dst.v[k] = from_float<Out>(to_float(src.v[k]) * scale);
    }
    store_pack(out + pack * kPer, dst);
  }
  for (int64_t i = n_packs * kPer + thread; i < numel; i += stride) {
    out[i] = from_float<Out>(to_float(in[i]) * scale);
  }
}

}  // namespace

void scaled_copy_cuda(std::uintptr_t in, DType in_dtype, std::uintptr_t out, DType out_dtype, int64_t numel,
                      std::uintptr_t scale_ptr, std::uintptr_t stream) {
  if (numel < 0) {
    throw std::invalid_argument(std::string("bmtwrap._C.") + kOp + ": numel must be >= 0, got " +
                                std::to_string(numel));
  }
  check_buffer(kOp, in, numel);
  check_buffer(kOp, out, numel);
  check_buffer(kOp, scale_ptr, 1);
  check_aligned(kOp, "scale", scale_ptr, sizeof(float));
  if (numel == 0) {
    return;
  }
  cudaStream_t cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  dispatch_dtype(in_dtype, [&](auto in_traits) {
    using In = DeviceScalarT<decltype(in_traits)>;
    dispatch_dtype(out_dtype, [&](auto out_traits) {
      using Out = DeviceScalarT<decltype(out_traits)>;
      check_aligned(kOp, "in", in, sizeof(In));
      check_aligned(kOp, "out", out, sizeof(Out));
      const bool vectors = in % kVectorBytes == 0 && out % kVectorBytes == 0;
      const int64_t work = vectors ? numel / kPer + numel % kPer : numel;
      const int64_t wanted = std::max<int64_t>(1, (work + kThreads - 1) / kThreads);
      constexpr auto kernel = scaled_copy_kernel<In, Out>;
      const int blocks = static_cast<int>(std::min(wanted, resident_blocks<kernel>(kOp, kThreads)));
      kernel<<<blocks, kThreads, 0, cuda_stream>>>(
          reinterpret_cast<const In*>(in), reinterpret_cast<Out*>(out), numel, vectors,
          reinterpret_cast<const float*>(scale_ptr));
      check_cuda(cudaGetLastError(), kOp, "kernel launch");
    });
  });
}

}  // namespace bmtwrap::cuda
