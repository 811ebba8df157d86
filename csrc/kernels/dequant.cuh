// Dequantization of the quantized cache formats (layout.h, KvFormat), shared by the gather of a
// quantized cache and the attention kernels' tile loads. Every value is computed in fp32 as
// mla_kv.reference.quant computes it (an e4m3 value times its scale; an int code times the row's
// scale, then plus its zero, two roundings: no fused multiply-add), then rounded once to the
// compute dtype T. The unit is 8 consecutive values of a row, read as raw bits by the caller.
#pragma once

#include <cstdint>
#include <type_traits>

#include "arch/arch.cuh"
#include "arch/fp8.cuh"
#include "mla_kv/layout.h"

namespace mla_kv {
namespace dequant {

// Byte offset in a stored row of the 8 values starting at element e (a multiple of 8) and the bytes
// they take: 8 (fp8, int8, fp8_ds_mla's latent), 4 (int4), 16 (fp8_ds_mla's bf16 rope, after the 512
// latent bytes and the 4 fp32 tile scales).
constexpr int kDsScalesOffset = kLatentDim;
constexpr int kDsRopeOffset = kLatentDim + 4 * 4;
__device__ __forceinline__ int vector_byte(KvFormat f, int e) {
  switch (f) {
    case KvFormat::kInt4: return e / 2;
    case KvFormat::kFp8DsMla: return e < kLatentDim ? e : kDsRopeOffset + 2 * (e - kLatentDim);
    default: return e;
  }
}

template <class T>
__device__ __forceinline__ arch::Vec<T, 8> to_vec(const float (&v)[8]) {
  arch::Vec<T, 8> r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr bool kPairs = !std::is_same_v<T, float>;  // one cvt per pair (the same roundings)
#else
  constexpr bool kPairs = false;
#endif
  if constexpr (kPairs) {
#pragma unroll
    for (int k = 0; k < 8; k += 2) {
      if constexpr (std::is_same_v<T, __half>) {
        *reinterpret_cast<__half2*>(&r.v[k]) = __floats2half2_rn(v[k], v[k + 1]);
      } else {
        *reinterpret_cast<__nv_bfloat162*>(&r.v[k]) = __floats2bfloat162_rn(v[k], v[k + 1]);
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) r.v[k] = arch::from_float<T>(v[k]);
  }
  return r;
}

// 8 e4m3 bytes (lo: values 0..3) times scale, by integer arithmetic. A code's sign and 7 magnitude bits
// placed as fp32 bits are its value times 2^-120 (arch::e4m3_to_float), so one product with scale 2^120
// rounds the same exact product as e4m3_to_float(code) * scale: three integer instructions and one
// multiply a value, where e4m3_to_float and the scale take five or six, a NaN select and two multiplies
// (the Sm70 decode is issue-bound). NaN codes (magnitude 0x7F, found for all 8 bytes at once) and scales
// of 2^8 or more, whose 2^120 multiple is not finite, take the per-value path. clang keeps that path
// inside the tile loop; scripts/issue-floor --arch 70 leaves it out of the count by its NaN select.
__device__ __forceinline__ void fp8_values_soft(uint2 bytes, float scale, float (&v)[8]) {
  const float wide = scale * 0x1p120f;  // exact while finite
  const uint32_t nan_bytes = (((bytes.x & 0x7F7F7F7Fu) + 0x01010101u) | ((bytes.y & 0x7F7F7F7Fu) + 0x01010101u)) & 0x80808080u;
  if (__builtin_expect(nan_bytes != 0u || !(fabsf(wide) < INFINITY), 0)) {
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = __fmul_rn(arch::e4m3_to_float(((k < 4 ? bytes.x : bytes.y) >> (8 * (k & 3))) & 0xFFu), scale);
    return;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const int32_t top = int32_t((k < 4 ? bytes.x : bytes.y) << (24 - 8 * (k & 3)));  // the code in bits 24..31
    v[k] = __fmul_rn(__uint_as_float(uint32_t(top >> 4) & 0x87F00000u), wide);     // sign, then 20..26
  }
}
// The same values; the Sm90 tag converts pairs to (exact) halves in hardware.
template <class A>
__device__ __forceinline__ void fp8_values(uint2 bytes, float scale, float (&v)[8]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (A::kMinCudaArch >= 900) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint16_t pair = uint16_t((k < 2 ? bytes.x : bytes.y) >> (16 * (k & 1)));
      uint32_t halves;
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(pair));
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&halves));
      v[2 * k] = __fmul_rn(f.x, scale);
      v[2 * k + 1] = __fmul_rn(f.y, scale);
    }
  } else {
    fp8_values_soft(bytes, scale, v);
  }
#else
  fp8_values_soft(bytes, scale, v);
#endif
}

// Int codes as exact fp16 pairs without a conversion instruction: a half whose bits are 0x6400 | c
// is 1024 + c (c < 1024), and one packed subtraction takes the 1024 back out. bf16 has no such
// exponent for a byte (its 7 mantissa bits hold codes below 128 only), so the callers' products
// with codes are fp16.
constexpr uint32_t kHalfMagic = 0x64006400u;
__device__ __forceinline__ uint32_t unbias_halves(uint32_t biased) {
  const uint32_t magic = kHalfMagic;
  const __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&biased), *reinterpret_cast<const __half2*>(&magic));
  return *reinterpret_cast<const uint32_t*>(&r);
}
// Two bytes of `w` as a pair of halves 1024 + c: `selector` (__byte_perm's) puts them in bytes 0 and
// 2 and byte 4 (the magic's 0x64) in bytes 1 and 3, e.g. 0x4140 for bytes 0, 1 and 0x4342 for 2, 3.
__device__ __forceinline__ uint32_t byte_codes_to_biased_halves(uint32_t w, uint32_t selector) {
  return __byte_perm(w, kHalfMagic | (kHalfMagic >> 8), selector);
}
// (x & kMask) | kBits as one lop3: the compiler would split it into a field extract (or an and) and an or.
template <uint32_t kMask, uint32_t kBits>
__device__ __forceinline__ uint32_t masked_or(uint32_t x) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(x), "n"(kMask), "n"(kBits));
  return r;
}
// Nibbles K and K + 4 of `w` (K = 0 or 1: bits 4 K and 16 + 4 K) as a pair of halves, one masking
// lop3: 1024 + c for nibble 0, 1024 + 16 c for nibble 1 (biased; their callers take the bias out).
template <int K>
__device__ __forceinline__ uint32_t nibble_codes_to_biased_halves(uint32_t w) {
  static_assert(K == 0 || K == 1, "the low byte of each half holds nibbles 0 and 1");
  return masked_or<K == 0 ? 0x000F000Fu : 0x00F000F0u, kHalfMagic>(w);
}
// Nibbles 0 and 4 as the pair of halves c, exactly.
__device__ __forceinline__ uint32_t low_nibble_codes_to_halves(uint32_t w) {
  return unbias_halves(nibble_codes_to_biased_halves<0>(w));
}

// An int code (< 2^23) as a float without a conversion instruction: its bits under 2^23's exponent.
__device__ __forceinline__ float code_value(uint32_t code_bits_with_exponent) {
  return __uint_as_float(code_bits_with_exponent) - 8388608.f;
}
__device__ __forceinline__ void int_codes_values(const float (&c)[8], float scale, float zero, float (&v)[8]) {
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = __fadd_rn(__fmul_rn(c[k], scale), zero);
}
// 8 int8 codes times scale plus zero.
__device__ __forceinline__ void int8_values(uint2 bytes, float scale, float zero, float (&v)[8]) {
  float c[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) c[k] = code_value(__byte_perm(k < 4 ? bytes.x : bytes.y, 0x4B000000u, 0x7540u + (k & 3)));
  int_codes_values(c, scale, zero, v);
}
// One int4 word, whose nibbles from the low one up hold values 0, 2, 4, 6, 1, 3, 5, 7; a nibble is a
// shift and one lop3 (under 2^23's exponent).
__device__ __forceinline__ void int4_values(uint32_t word, float scale, float zero, float (&v)[8]) {
  float c[8];
#pragma unroll
  for (int n = 0; n < 8; ++n) c[(n & 3) * 2 + (n >> 2)] = code_value(masked_or<0xFu, 0x4B000000u>(word >> (4 * n)));
  int_codes_values(c, scale, zero, v);
}

// 8 bf16 values (fp8_ds_mla's rope).
__device__ __forceinline__ void bf16_values(uint4 bits, float (&v)[8]) {
  const uint32_t w[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = __uint_as_float((k & 1 ? w[k / 2] >> 16 : w[k / 2] & 0xFFFFu) << 16);
}

// An int8 / int4 row's (scale, zero) pair: two values of T in one 32-bit word, scale first.
template <class T>
__device__ __forceinline__ float2 scale_zero(uint32_t pair) {
  const arch::Vec<T, 2> v = *reinterpret_cast<const arch::Vec<T, 2>*>(&pair);
  return make_float2(arch::to_float(v.v[0]), arch::to_float(v.v[1]));
}

// The raw bits of 8 values of a row, what a tile load stages in registers.
template <KvFormat F>
struct Raw8Of { using type = uint2; };
template <>
struct Raw8Of<KvFormat::kInt4> { using type = uint32_t; };
template <>
struct Raw8Of<KvFormat::kFp8DsMla> { using type = uint4; };  // the rope's 8 bf16 (the latent's 8 e4m3 in x, y)
template <KvFormat F>
using Raw8 = typename Raw8Of<F>::type;

// The 8 values of `row` from stored element e (a multiple of 8), read-only path.
template <KvFormat F>
__device__ __forceinline__ Raw8<F> load8(const char* row, int e) {
  const char* at = row + vector_byte(F, e);
  if constexpr (F == KvFormat::kInt4) {
    return __ldg(reinterpret_cast<const unsigned*>(at));
  } else if constexpr (F == KvFormat::kFp8DsMla) {
    if (e >= kLatentDim) return __ldg(reinterpret_cast<const uint4*>(at));
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(at));
    return make_uint4(u.x, u.y, 0u, 0u);
  } else {
    return __ldg(reinterpret_cast<const uint2*>(at));
  }
}

// fp8_ds_mla: the scale of the latent tile holding element e < 512.
__device__ __forceinline__ float ds_tile_scale(const char* row, int e) {
  return __ldg(reinterpret_cast<const float*>(row + kDsScalesOffset) + e / 128);
}

// Raw bits -> the 8 values. scale: fp8's kv_scale, fp8_ds_mla's tile scale (unused for its rope,
// rope = the values are of stored elements >= 512), the row's scale for int8 / int4 (zero: its zero).
template <class A, KvFormat F>
__device__ __forceinline__ void values8(const Raw8<F>& raw, bool rope, float scale, float zero, float (&v)[8]) {
  if constexpr (F == KvFormat::kFp8) {
    fp8_values<A>(raw, scale, v);
  } else if constexpr (F == KvFormat::kFp8DsMla) {
    if (rope) bf16_values(raw, v); else fp8_values<A>(make_uint2(raw.x, raw.y), scale, v);
  } else if constexpr (F == KvFormat::kInt8) {
    int8_values(raw, scale, zero, v);
  } else {
    int4_values(raw, scale, zero, v);
  }
}

}  // namespace dequant
}  // namespace mla_kv
