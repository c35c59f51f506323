// What the CUDA kernel files (adam.cu, cross_entropy.cu, inf_nan.cu, scale.cu) share: the device element type
// of each DType, float conversion, 16-byte packs, error checking and the grid size. CUDA only: included by
// .cu files, never by bind.cpp (which sees only the plain C++ launcher headers).
//
// Functions marked BMT_HOST_DEVICE compile for the host as well, so that a kernel's per-thread arithmetic
// can be run and checked on a machine without a GPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "common.h"

namespace bmtwrap::cuda {

// The element type a kernel computes with, for the DTypeTraits that dispatch_dtype (common.h) passes.
template <typename Traits>
struct DeviceScalar;
template <>
struct DeviceScalar<DTypeTraits<DType::kFloat32>> {
  using type = float;
};
template <>
struct DeviceScalar<DTypeTraits<DType::kFloat16>> {
  using type = __half;
};
template <>
struct DeviceScalar<DTypeTraits<DType::kBFloat16>> {
  using type = __nv_bfloat16;
};
template <typename Traits>
using DeviceScalarT = typename DeviceScalar<Traits>::type;

BMT_HOST_DEVICE inline float to_float(float x) { return x; }
BMT_HOST_DEVICE inline float to_float(__half x) { return __half2float(x); }
BMT_HOST_DEVICE inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Round to nearest, ties to even: what torch's .to(dtype) does.
template <typename T>
BMT_HOST_DEVICE inline T from_float(float x);
template <>
BMT_HOST_DEVICE inline float from_float<float>(float x) {
  return x;
}
template <>
BMT_HOST_DEVICE inline __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
BMT_HOST_DEVICE inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

constexpr int64_t kVectorBytes = 16;

// N elements moved as whole 16-byte words (one 128-bit load or store each). The caller guarantees that the
// address is 16-byte aligned; sizeof(T) * N is a multiple of 16.
template <typename T, int N>
struct alignas(16) Pack {
  static_assert(sizeof(T) * N % kVectorBytes == 0, "a Pack is a whole number of 16-byte words");
  static constexpr int kWords = static_cast<int>(sizeof(T) * N / kVectorBytes);
  T v[N];
};

template <typename T, int N>
BMT_HOST_DEVICE inline Pack<T, N> load_pack(const T* src) {
  Pack<T, N> pack;
  const uint4* words = reinterpret_cast<const uint4*>(src);
  uint4* out = reinterpret_cast<uint4*>(&pack);
#pragma unroll
  for (int w = 0; w < Pack<T, N>::kWords; ++w) {
    out[w] = words[w];
  }
  return pack;
}

template <typename T, int N>
BMT_HOST_DEVICE inline void store_pack(T* dst, const Pack<T, N>& pack) {
  uint4* words = reinterpret_cast<uint4*>(dst);
  const uint4* in = reinterpret_cast<const uint4*>(&pack);
#pragma unroll
  for (int w = 0; w < Pack<T, N>::kWords; ++w) {
    words[w] = in[w];
  }
}

// Elements of `elem_bytes` bytes from `address` to the next 16-byte boundary (0 if already on one).
// `address` is a multiple of elem_bytes (the launchers check).
BMT_HOST_DEVICE inline int64_t elements_to_alignment(std::uintptr_t address, int64_t elem_bytes) {
  const int64_t misalignment = static_cast<int64_t>(address % kVectorBytes);
  return misalignment == 0 ? 0 : (kVectorBytes - misalignment) / elem_bytes;
}

// ---------------------------------------------------------------------------------------------------------
// Host side

// Throws std::runtime_error naming the op, the call and CUDA's error string.
inline void check_cuda(cudaError_t err, const char* op, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("bmtwrap._C.") + op + ": " + what + " failed: " + cudaGetErrorName(err) +
                             ": " + cudaGetErrorString(err));
  }
}

inline void check_aligned(const char* op, const char* name, std::uintptr_t ptr, std::size_t elem_bytes) {
  if (ptr % elem_bytes != 0) {
    throw std::invalid_argument(std::string("bmtwrap._C.") + op + ": " + name + " pointer is not aligned to its " +
                                std::to_string(elem_bytes) + "-byte elements");
  }
}

// Blocks of `threads` threads of `Kernel` that the current device holds at once, its registers and shared
// memory counted: a grid-stride loop needs no more. Sized by the device's threads per SM alone, a kernel
// whose registers allow fewer blocks per SM (the Adam kernel: 5 of 8 at 48 registers) ran a second, partial
// wave of blocks, each with a full block's share of the work, on part of the SMs (on an H200, Adam over
// 263 M elements took 1.83 ms that way and 1.75 ms with the grid sized by occupancy). The SM count and the
// occupancy never change, so each device is asked once per kernel (a function-local static per template
// instance; the queries cost about as much as a launch); racing threads store the same value.
template <auto Kernel>
int64_t resident_blocks(const char* op, int threads) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int64_t> cached[kMaxDevices] = {};  // 0: not asked yet
  int device = 0;
  check_cuda(cudaGetDevice(&device), op, "cudaGetDevice");
  int64_t blocks = device < kMaxDevices ? cached[device].load(std::memory_order_relaxed) : 0;
  if (blocks == 0) {
    int sms = 0;
    int per_sm = 0;
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), op, "cudaDeviceGetAttribute");
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, threads, 0), op,
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    blocks = std::max<int64_t>(1, static_cast<int64_t>(sms) * per_sm);
    if (device < kMaxDevices) {
      cached[device].store(blocks, std::memory_order_relaxed);
    }
  }
  return blocks;
}

}  // namespace bmtwrap::cuda
