// Definitions shared by the CPU (g++) and CUDA (nvcc) halves of bmtwrap._C.
//
// [Note: tensors crossing into C++]
// The extension never links against torch's C++ library, so that a torch upgrade never needs a rebuild.
// A tensor therefore arrives as three plain values, all checked by the bmtwrap.ops package beforehand:
//   ptr    (uintptr_t)  tensor.data_ptr() of a contiguous tensor, aligned to its element size;
//   numel  (int64_t)    its element count, >= 0;
//   dtype  (DType)      how to read the elements.
// CUDA ops also take the stream to launch on (torch.cuda.current_stream().cuda_stream, as an integer).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#if defined(__CUDACC__)
#define BMT_HOST_DEVICE __host__ __device__
#else
#define BMT_HOST_DEVICE
#endif

namespace bmtwrap {

// The values are part of the Python binding (bmtwrap._C.DType); append, never renumber.
enum class DType : int {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
};

// How to read one element as raw bits. Kernels that only look at bit patterns (inf/nan checks) need
// nothing else, and so need neither cuda_fp16.h nor a host-side half type.
template <DType D>
struct DTypeTraits;

template <>
struct DTypeTraits<DType::kFloat32> {
  using Bits = uint32_t;
  static constexpr Bits kExponentMask = 0x7F800000u;  // 1 sign, 8 exponent, 23 mantissa bits
};

template <>
struct DTypeTraits<DType::kFloat16> {
  using Bits = uint16_t;
  static constexpr Bits kExponentMask = 0x7C00u;  // 1 sign, 5 exponent, 10 mantissa bits
};

template <>
struct DTypeTraits<DType::kBFloat16> {
  using Bits = uint16_t;
  static constexpr Bits kExponentMask = 0x7F80u;  // 1 sign, 8 exponent, 7 mantissa bits
};

// IEEE 754: an element is +-inf or nan exactly when all its exponent bits are set.
template <typename Bits>
BMT_HOST_DEVICE inline bool is_inf_or_nan_bits(Bits bits, Bits exponent_mask) {
  return (bits & exponent_mask) == exponent_mask;
}

// [Note: split master]
// An fp32 master weight w is kept as two 16-bit halves: the bf16 weight the model computes with, RNE(w), and
// the low 16 bits of w. The high 16 bits of w are the weight's bits, less one when rounding went up, which
// the low half tells: rounding went up exactly when it is >= 0x8000. The one case it cannot tell is a tie
// (low half 0x8000) that rounded down to an even weight; that master is stored one fp32 ulp lower
// (0x7FFF), toward its weight, which then still rounds to it. A NaN master is stored as a quiet NaN weight
// with a zero low half. A weight that is zero, inf or NaN is its own master: one written by a user over the
// low half of another value stays as written (a master that rounds to zero becomes zero).
// Any other weight gets a master that rounds to it, whatever low half it meets. So 4 bytes hold both the
// weight and its master, where a separate master costs 6.
struct SplitBits {
  uint16_t weight;
  uint16_t low;
};

BMT_HOST_DEVICE inline SplitBits split_master_bits(uint32_t master) {
  const uint32_t high = master >> 16;
  uint32_t low = master & 0xFFFFu;
  if ((master & 0x7F800000u) == 0x7F800000u && (master & 0x007FFFFFu) != 0u) {
    return {static_cast<uint16_t>((high & 0x8000u) | 0x7FC0u), 0};  // NaN
  }
  const bool up = low > 0x8000u || (low == 0x8000u && (high & 1u) != 0u);
  if (low == 0x8000u && !up) {
    low = 0x7FFFu;
  }
  return {static_cast<uint16_t>(high + (up ? 1u : 0u)), static_cast<uint16_t>(low)};
}

BMT_HOST_DEVICE inline uint32_t join_master_bits(uint16_t weight, uint16_t low) {
  if ((weight & 0x7F80u) == 0x7F80u || (weight & 0x7FFFu) == 0u) {
    return static_cast<uint32_t>(weight) << 16;  // inf, NaN or zero: its own master
  }
  if (low == 0x8000u && (weight & 1u) != 0u) {
    return (static_cast<uint32_t>(weight) << 16) | 0x7FFFu;  // never split so: a written weight, kept
  }
  const uint32_t high = static_cast<uint16_t>(weight - (low >= 0x8000u ? 1u : 0u));
  return (high << 16) | low;
}

// Calls f(DTypeTraits<dtype>{}) so that one template serves every dtype (no copy per dtype).
template <typename F>
decltype(auto) dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      return f(DTypeTraits<DType::kFloat32>{});
    case DType::kFloat16:
      return f(DTypeTraits<DType::kFloat16>{});
    case DType::kBFloat16:
      return f(DTypeTraits<DType::kBFloat16>{});
  }
  throw std::invalid_argument("bmtwrap._C: unknown dtype code " + std::to_string(static_cast<int>(dtype)));
}

// The checks every op repeats on its raw arguments; bmtwrap.ops has already made them, this is the last line.
inline void check_buffer(const char* op, std::uintptr_t ptr, int64_t numel) {
  if (numel < 0) {
    throw std::invalid_argument(std::string(op) + ": numel must be >= 0, got " + std::to_string(numel));
  }
  if (numel > 0 && ptr == 0) {
    throw std::invalid_argument(std::string(op) + ": null data pointer for " + std::to_string(numel) +
                                " elements");
  }
}

}  // namespace bmtwrap
