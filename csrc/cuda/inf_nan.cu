// Inf/nan check over a device buffer, by bit pattern: kernel first, launcher after.
//
// [Note: inf/nan kernel layout]
// The buffer of `numel` elements is read as
//   head:    the elements before the first 16-byte boundary (a view such as t[1:] starts off one),
//   body:    whole 16-byte vectors, one 128-bit load per thread per grid-stride step,
//   tail:    the fewer than 16 / sizeof(Bits) elements after the last whole vector.
// head + tail is at most 2 * (16 / sizeof(Bits) - 1) = 14 elements, read by the first threads of the grid.
// Each block ORs its threads' findings with __syncthreads_or and its thread 0 writes 1 to the flag.
// Blocks that find nothing write nothing, which is what lets the flag accumulate over launches; the
// concurrent writes all store the same value, so they need no atomics.
#include "cuda/inf_nan.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda/kernel_utils.h"

namespace bmtwrap::cuda {
namespace {

constexpr int kThreads = 256;
constexpr const char* kOp = "has_inf_nan_cuda";

// True if any Bits-wide lane of a 32-bit word is +-inf or nan.
template <typename Bits>
__device__ __forceinline__ bool word_has_inf_nan(uint32_t word, Bits exponent_mask) {
  bool found = false;
#pragma unroll
  for (int lane = 0; lane < static_cast<int>(sizeof(uint32_t) / sizeof(Bits)); ++lane) {
    found |= is_inf_or_nan_bits(static_cast<Bits>(word >> (8 * sizeof(Bits) * lane)), exponent_mask);
  }
  return found;
}

template <typename Bits>
__global__ void has_inf_nan_kernel(const Bits* __restrict__ data, int64_t numel, int64_t head,
                                   Bits exponent_mask, uint8_t* __restrict__ flag) {
  constexpr int64_t kPerVector = kVectorBytes / static_cast<int64_t>(sizeof(Bits));
  const int64_t n_vectors = (numel - head) / kPerVector;
  const int64_t tail_begin = head + n_vectors * kPerVector;
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;

  bool found = false;
  const uint4* vectors = reinterpret_cast<const uint4*>(data + head);
  for (int64_t i = thread; i < n_vectors; i += stride) {
    const uint4 v = __ldg(vectors + i);
    found |= word_has_inf_nan(v.x, exponent_mask) | word_has_inf_nan(v.y, exponent_mask) |
             word_has_inf_nan(v.z, exponent_mask) | word_has_inf_nan(v.w, exponent_mask);
  }
  const int64_t n_scalars = head + (numel - tail_begin);
  if (thread < n_scalars) {
    const int64_t i = thread < head ? thread : tail_begin + (thread - head);
    found |= is_inf_or_nan_bits(data[i], exponent_mask);
  }

  if (__syncthreads_or(found) && threadIdx.x == 0) {
    *flag = 1;
  }
}

// ---------------------------------------------------------------------------------------------------------
// Launcher

template <typename Traits>
void launch(std::uintptr_t ptr, int64_t numel, uint8_t* flag, cudaStream_t stream) {
  using Bits = typename Traits::Bits;
  constexpr int64_t kPerVector = kVectorBytes / static_cast<int64_t>(sizeof(Bits));
  if (ptr % sizeof(Bits) != 0) {
    throw std::invalid_argument("bmtwrap._C.has_inf_nan_cuda: data pointer is not aligned to its " +
                                std::to_string(sizeof(Bits)) + "-byte elements");
  }
  const int64_t misalignment = static_cast<int64_t>(ptr % kVectorBytes);
  const int64_t head =
      std::min<int64_t>(numel, misalignment == 0 ? 0 : (kVectorBytes - misalignment) / sizeof(Bits));
  const int64_t n_vectors = (numel - head) / kPerVector;
  // At least one block: the head and tail (<= 14 elements) are read by the first threads.
  const int64_t wanted = std::max<int64_t>(1, (n_vectors + kThreads - 1) / kThreads);
  constexpr auto kernel = has_inf_nan_kernel<Bits>;
  const int blocks = static_cast<int>(std::min(wanted, resident_blocks<kernel>(kOp, kThreads)));
  kernel<<<blocks, kThreads, 0, stream>>>(reinterpret_cast<const Bits*>(ptr), numel, head, Traits::kExponentMask,
                                          flag);
  check_cuda(cudaGetLastError(), kOp, "kernel launch");
}

}  // namespace

void has_inf_nan_cuda(std::uintptr_t ptr, int64_t numel, DType dtype, std::uintptr_t flag_ptr,
                      std::uintptr_t stream) {
  check_buffer("has_inf_nan_cuda", ptr, numel);
  if (flag_ptr == 0) {
    throw std::invalid_argument("bmtwrap._C.has_inf_nan_cuda: null flag pointer");
  }
  if (numel == 0) {
    return;
  }
  uint8_t* flag = reinterpret_cast<uint8_t*>(flag_ptr);
  cudaStream_t cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  dispatch_dtype(dtype, [&](auto traits) { launch<decltype(traits)>(ptr, numel, flag, cuda_stream); });
}

}  // namespace bmtwrap::cuda
