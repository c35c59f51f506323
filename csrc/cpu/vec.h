// The element types, exact roundings and vector types of the CPU Adam kernel (adam.cpp), written once for
// every instruction set: see [Note: one source, three instruction sets] in adam.cpp. Included by adam.cpp
// alone; everything here is inline and internal.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
// GCC 12 warns that the intrinsics' own _mm512_undefined_*() placeholders "may be used uninitialized"
// (GCC bug 105593, fixed in GCC 13); this file has no other use for the warning to guard.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define BMT_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define BMT_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#endif

// Templates below return V::F by value and are compiled for the baseline ISA, where GCC warns that an
// AVX-512 vector return "changes the ABI". They are only ever inlined (see [Note: one source, three
// instruction sets]), so no call crosses the two ABIs.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace bmtwrap::cpu::vec {

// Element types of the 16-bit buffers, as distinct types so that loads and stores overload on them.
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};
struct NoCopy {};  // no low-precision copy of the updated parameters is written

// ----------------------------------------------------------------------------------------- scalar rounding

inline float float_from_bits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline uint32_t bits_from_float(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

inline float bf16_to_float(BFloat16 h) { return float_from_bits(uint32_t{h.bits} << 16); }

// Round to nearest even, as c10::BFloat16 does: nan becomes the canonical quiet nan 0x7FC0.
inline BFloat16 float_to_bf16(float value) {
  const uint32_t bits = bits_from_float(value);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
    return {0x7FC0};
  }
  return {static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16)};
}

// Exact, and bit-identical to F16C's vcvtph2ps: a signalling nan comes back quiet, its payload kept.
inline float half_to_float(Half h) {
  const uint32_t sign = uint32_t{h.bits & 0x8000u} << 16;
  const uint32_t exponent = (h.bits >> 10) & 0x1Fu;
  const uint32_t mantissa = h.bits & 0x3FFu;
  if (exponent == 0x1F) {  // inf, nan
    return float_from_bits(sign | 0x7F800000u | (mantissa << 13) | (mantissa != 0 ? 0x400000u : 0u));
  }
  if (exponent != 0) {  // normal: rebias the exponent from 15 to 127
    return float_from_bits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  }
  // Zero or subnormal: mantissa * 2^-24, exact in float.
  return float_from_bits(sign | bits_from_float(static_cast<float>(mantissa) * 0x1p-24f));
}

// Round to nearest even, bit-identical to F16C's vcvtps2ph with _MM_FROUND_TO_NEAREST_INT.
inline Half float_to_half(float value) {
  const uint32_t bits = bits_from_float(value);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) {  // nan: quiet, top of the payload kept
    return {static_cast<uint16_t>(sign | 0x7E00u | ((magnitude >> 13) & 0x3FFu))};
  }
  if (magnitude >= 0x477FF000u) {  // at least halfway between 65504 (the largest half) and 65536: inf
    return {static_cast<uint16_t>(sign | 0x7C00u)};
  }
  if (magnitude >= 0x38800000u) {  // a normal half (>= 2^-14): round 13 mantissa bits away, rebias 127 -> 15
    const uint32_t rounded = magnitude + 0xFFFu + ((magnitude >> 13) & 1u);
    return {static_cast<uint16_t>(sign | ((rounded - (112u << 23)) >> 13))};
  }
  if (magnitude <= 0x33000000u) {  // at most 2^-25, half the smallest subnormal: rounds to (even) zero
    return {sign};
  }
  // A subnormal half counts units of 2^-24: round (1.mantissa * 2^(exponent - 127)) / 2^-24 to an integer.
  // The result may carry into 0x400, which is the encoding of the smallest normal half.
  const uint32_t exponent = magnitude >> 23;  // 102 ... 112
  const uint32_t significand = (magnitude & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - exponent;  // 14 ... 24
  uint32_t units = significand >> shift;
  const uint32_t rest = significand & ((1u << shift) - 1u);
  const uint32_t half_unit = 1u << (shift - 1u);
  units += (rest > half_unit || (rest == half_unit && (units & 1u))) ? 1u : 0u;
  return {static_cast<uint16_t>(sign | units)};
}

// ------------------------------------------------------------------------------------------- vector types
// Each has F (the register type), kWidth (floats per F) and the same static operations: set1, load, store,
// stream (a store past the caches), fence (orders earlier streaming stores), and arithmetic.

struct Scalar {
  using F = float;
  static constexpr int64_t kWidth = 1;

  static F set1(float x) { return x; }
  static F load(const float* p) { return *p; }
  static F load(const Half* p) { return half_to_float(*p); }
  static F load(const BFloat16* p) { return bf16_to_float(*p); }
  static void store(float* p, F x) { *p = x; }
  static void store(Half* p, F x) { *p = float_to_half(x); }
  static void store(BFloat16* p, F x) { *p = float_to_bf16(x); }
  template <typename T>
  static void stream(T* p, F x) { store(p, x); }
  static void fence() {}
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return std::sqrt(a); }
  static F fmadd(F a, F b, F c) { return std::fma(a, b, c); }  // a * b + c, rounded once
};

#if defined(__x86_64__)

struct Avx2 {
  using F = __m256;
  static constexpr int64_t kWidth = 8;

  BMT_TARGET_AVX2 static F set1(float x) { return _mm256_set1_ps(x); }
  BMT_TARGET_AVX2 static F load(const float* p) { return _mm256_loadu_ps(p); }
  BMT_TARGET_AVX2 static F load(const Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  BMT_TARGET_AVX2 static F load(const BFloat16* p) {  // bf16 is the top half of a float
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  BMT_TARGET_AVX2 static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  BMT_TARGET_AVX2 static void store(Half* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), half_bits(x));
  }
  BMT_TARGET_AVX2 static void store(BFloat16* p, F x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits(x)); }
  // Streaming stores (past the caches) of a copy; p is aligned to 16 bytes.
  BMT_TARGET_AVX2 static void stream(float* p, F x) { _mm256_stream_ps(p, x); }  // p aligned to 32 bytes
  BMT_TARGET_AVX2 static void stream(Half* p, F x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), half_bits(x)); }
  BMT_TARGET_AVX2 static void stream(BFloat16* p, F x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), bf16_bits(x)); }
  BMT_TARGET_AVX2 static void fence() { _mm_sfence(); }
  BMT_TARGET_AVX2 static __m128i half_bits(F x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  BMT_TARGET_AVX2 static __m128i bf16_bits(F x) {  // as float_to_bf16, eight at a time
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
    // Every lane is <= 0xFFFF, so the saturating pack only narrows.
    return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  }
  BMT_TARGET_AVX2 static F add(F a, F b) { return _mm256_add_ps(a, b); }
  BMT_TARGET_AVX2 static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  BMT_TARGET_AVX2 static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  BMT_TARGET_AVX2 static F div(F a, F b) { return _mm256_div_ps(a, b); }
  BMT_TARGET_AVX2 static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  BMT_TARGET_AVX2 static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
};

struct Avx512 {
  using F = __m512;
  static constexpr int64_t kWidth = 16;

  BMT_TARGET_AVX512 static F set1(float x) { return _mm512_set1_ps(x); }
  BMT_TARGET_AVX512 static F load(const float* p) { return _mm512_loadu_ps(p); }
  BMT_TARGET_AVX512 static F load(const Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  BMT_TARGET_AVX512 static F load(const BFloat16* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  BMT_TARGET_AVX512 static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  BMT_TARGET_AVX512 static void store(Half* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), half_bits(x));
  }
  BMT_TARGET_AVX512 static void store(BFloat16* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(x));
  }
  // Streaming stores (past the caches) of a copy; p is aligned to 32 bytes.
  BMT_TARGET_AVX512 static void stream(float* p, F x) { _mm512_stream_ps(p, x); }  // p aligned to 64 bytes
  BMT_TARGET_AVX512 static void stream(Half* p, F x) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), half_bits(x));
  }
  BMT_TARGET_AVX512 static void stream(BFloat16* p, F x) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), bf16_bits(x));
  }
  BMT_TARGET_AVX512 static void fence() { _mm_sfence(); }
  BMT_TARGET_AVX512 static __m256i half_bits(F x) {
    return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  BMT_TARGET_AVX512 static __m256i bf16_bits(F x) {  // as float_to_bf16, sixteen at a time
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(rounded);
  }
  BMT_TARGET_AVX512 static F add(F a, F b) { return _mm512_add_ps(a, b); }
  BMT_TARGET_AVX512 static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  BMT_TARGET_AVX512 static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  BMT_TARGET_AVX512 static F div(F a, F b) { return _mm512_div_ps(a, b); }
  BMT_TARGET_AVX512 static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  BMT_TARGET_AVX512 static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
};

#endif  // defined(__x86_64__)

}  // namespace bmtwrap::cpu::vec
