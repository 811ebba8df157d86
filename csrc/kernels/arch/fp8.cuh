// e4m3 (OCP FP8 E4M3, torch.float8_e4m3fn) encoding for the quantized caches: round to nearest
// even, saturating to +-448, NaN -> 0x7F. Ada / Hopper convert in hardware (cvt ... e4m3x2); Volta,
// Turing and Ampere have no fp8 instructions, so their tags encode with integer arithmetic on the
// fp32 bits. The two agree on every finite input; the GPU tests run both (the Sm70 tag's path on
// the H200 as well).
#pragma once

#include <cstdint>

#include "arch.cuh"

namespace mla_kv {
namespace arch {

// Integer encoding: ~12 instructions per value.
__device__ __forceinline__ uint32_t e4m3_bits_soft(float x) {
  const uint32_t bits = __float_as_uint(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t mag = bits & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return 0x7Fu;        // NaN
  if (mag >= 0x43E00000u) return sign | 0x7Eu;  // |x| >= 448: saturate
  if (mag < 0x3C800000u) {                      // |x| < 2^-6: subnormal steps of 2^-9 (8 rounds up to 2^-6)
    return sign | uint32_t(__float2int_rn(__uint_as_float(mag) * 512.f));
  }
  // Keep 3 of fp32's 23 mantissa bits, rounding half to even; a carry moves into the exponent.
  const uint32_t rounded = (mag + 0x7FFFFu + ((mag >> 20) & 1u)) >> 20;
  return sign | (rounded - (120u << 3));  // rebias the exponent 127 -> 7; |x| < 448 rounds to <= 0x7E
}

// Two values -> two e4m3 bytes in a 16-bit word, lo in the low byte.
template <class A>
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (A::kMinCudaArch >= 800) {
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
  }
#endif
  return e4m3_bits_soft(lo) | (e4m3_bits_soft(hi) << 8);
}

// e4m3 byte -> float, exactly: the byte's exponent and mantissa bits placed in an fp32 (whose bias is
// 120 more) scaled by 2^120; subnormal codes land on fp32 subnormals, which the multiply keeps.
__device__ __forceinline__ float e4m3_to_float(uint32_t code) {
  const uint32_t mag = code & 0x7Fu;
  if (mag == 0x7Fu) return __uint_as_float(0x7FC00000u);  // NaN
  return __uint_as_float(((code & 0x80u) << 24) | (mag << 20)) * 0x1p120f;
}

// Four e4m3 bytes of `w` (the first in the low byte) as two fp16 pairs, exactly: lo = bytes 0, 1,
// hi = bytes 2, 3. sm89+ converts a pair by one cvt, which takes the register's halves as they are
// (no shift); older targets take the integer path (e4m3 values are all exact in fp16).
__device__ __forceinline__ void e4m3x4_to_halves(uint32_t w, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}"
      : "=r"(lo), "=r"(hi) : "r"(w));
#else
  const __half2 a = __floats2half2_rn(e4m3_to_float(w & 0xFFu), e4m3_to_float((w >> 8) & 0xFFu));
  const __half2 b = __floats2half2_rn(e4m3_to_float((w >> 16) & 0xFFu), e4m3_to_float(w >> 24));
  lo = *reinterpret_cast<const uint32_t*>(&a);
  hi = *reinterpret_cast<const uint32_t*>(&b);
#endif
}

}  // namespace arch
}  // namespace mla_kv
