// The write kernel: one warp per token. Each lane moves 16-byte vectors of the latent (and the
// rope part on the first lanes); the RMSNorm sum is a warp reduction, so no shared memory and no
// block barrier: a row costs one read and one write of its bytes. q's rope parts are rotated by
// the same warp after the row, several heads per warp instruction.
// Reference: python/mla_kv/reference/write.py (write_kv, fused_write_kv).
#pragma once

#include <type_traits>

#include "../address.cuh"
#include "../arch/arch.cuh"
#include "../arch/fp8.cuh"
#include "mla_kv/write.h"

namespace mla_kv {
namespace write_detail {

constexpr int kWarpsPerBlock = 4;
// Rows in flight per SM bound a copy-like kernel: the 16-byte 16-bit variants (the ones engines
// run) cap registers at 51 so 40 warps fit; the quantizing writes at 56 (36 warps). The others keep
// the compiler's choice.
template <class T, int N, bool kQuant>
constexpr int kMinBlocksPerSm = (sizeof(T) == 2 && N == 8) ? (kQuant ? 9 : 10) : 1;

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// Max over the lanes of each group of `width` (a power of two) consecutive lanes.
template <int kWidth>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
  for (int m = kWidth / 2; m > 0; m >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, m));
  return x;
}
__device__ __forceinline__ float warp_min(float x) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) x = fminf(x, __shfl_xor_sync(0xffffffffu, x, m));
  return x;
}

// e4m3 bytes need e4m3(v / s), the correctly rounded quotient the spec divides out (a division is ~10
// instructions and a branch per value: the quantizing write was instruction-bound on it). A product
// by r = 1 / s gives the same bytes wherever the quotient is farther from a rounding boundary than
// the product's error; a lane that holds any value that close divides all of its values, so the
// bytes stay the spec's. With a power-of-two fp8 scale no lane needs to. int codes are by the spec a
// product, rint(n r) with r = fl(1 / scale) (as TurboMind quantizes): one fma a value.
constexpr float kRoundMagic = 12582912.f;  // 1.5 x 2^23: v + it rounds v to an integer (ties to even) in the low bits

constexpr float kFltMin = 1.17549435e-38f;  // the smallest normal float (fp8_ds_mla's scale floor)

// Whether r (a reciprocal) is normal and finite: e4m3's product error bounds need it, and the int
// spec takes the product only then.
__device__ __forceinline__ bool normal_reciprocal(float r) { return r >= kFltMin && r < INFINITY; }

// The low bytes of a, b, c, d as one word, a's lowest.
__device__ __forceinline__ uint32_t low_bytes(float a, float b, float c, float d) {
  return __byte_perm(__byte_perm(__float_as_uint(a), __float_as_uint(b), 0x0040),
                     __byte_perm(__float_as_uint(c), __float_as_uint(d), 0x0040), 0x5410);
}

// The codes of 8 values as TurboMind stores them: int8 one byte each (8 bytes); int4 nibbles, from the
// low one up, of values 0, 2, 4, 6, 1, 3, 5, 7 (.x; byte j of `even | odd << 4` holds them pairwise).
// A code is min(rint(q), top), q = n r with n = v - zero >= 0 (zero is the row's min) and r = fl(1 /
// scale), rounded once, ties to even: fma(n, r, kRoundMagic) holds kRoundMagic + code (the code in the
// low byte). Where r is not a normal float (a scale near the ends of fp32's range) q = fl(n / scale),
// as the spec (reference/quant.py) has it.
template <bool kByProduct, class T>
__device__ __forceinline__ uint2 int_codes(const arch::Vec<T, 8>& v, float zero, float scale, float r, bool int4) {
  const float top = int4 ? 15.f : 255.f;
  float m[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float n = arch::to_float(v.v[k]) - zero;
    const float c = kByProduct ? fmaf(n, r, kRoundMagic) : rintf(n / scale) + kRoundMagic;
    m[k] = fminf(c, kRoundMagic + top);
  }
  if (int4) return make_uint2(low_bytes(m[0], m[4], m[1], m[5]) | low_bytes(m[2], m[6], m[3], m[7]) << 4, 0u);
  return make_uint2(low_bytes(m[0], m[1], m[2], m[3]), low_bytes(m[4], m[5], m[6], m[7]));
}

// 8 values, each through op (a quotient), -> 8 e4m3 bytes.
template <class A, class T, class Op>
__device__ __forceinline__ uint2 e4m3x8(const arch::Vec<T, 8>& v, Op op) {
  auto e = [&](int k) { return op(arch::to_float(v.v[k])); };
  return make_uint2(arch::e4m3x2<A>(e(0), e(1)) | (arch::e4m3x2<A>(e(2), e(3)) << 16),
                    arch::e4m3x2<A>(e(4), e(5)) | (arch::e4m3x2<A>(e(6), e(7)) << 16));
}
template <class A, class T>
__device__ __forceinline__ uint2 e4m3x8_divided(const arch::Vec<T, 8>& v, float s) {
  return e4m3x8<A>(v, [s](float x) { return x / s; });
}
// e4m3(v / s) of 8 values from products with r ~ 1 / s (fl(1 / s), or rcp_approx's, within 2^-22).
// Where r is exact (s a power of two, as kv_scale 1 is: s r == 1), v r rounds once to fl(v / s), ties
// included. Else two products v r (1 -+ 2^-20) lie on either side of fl(v / s) (r's error, the
// factor's rounding and the product's add up to 2^-22 + 2^-23 at most), and e4m3 rounding is
// monotone, so equal bytes are the quotient's bytes; unequal ones set `near`.
template <class A, class T>
__device__ __forceinline__ uint2 e4m3x8_by_reciprocal(const arch::Vec<T, 8>& v, float r, bool exact, bool& near) {
  if (exact) return e4m3x8<A>(v, [r](float x) { return x * r; });
  const float r_lo = r * (1.f - 0x1p-20f), r_hi = r * (1.f + 0x1p-20f);
  const uint2 lo = e4m3x8<A>(v, [r_lo](float x) { return x * r_lo; });
  const uint2 hi = e4m3x8<A>(v, [r_hi](float x) { return x * r_hi; });
  near |= lo.x != hi.x || lo.y != hi.y;
  return lo;
}
__device__ __forceinline__ bool exact_reciprocal(float s, float r) { return fmaf(s, r, -1.f) == 0.f; }

// The min and max of a row: over the lane's values (lat; pe on lanes < 8), then the warp's. Where the
// target has packed 16-bit min / max (sm80+), on value pairs as they are (no conversion), and the
// warp's min and max in one shuffle chain as the pair (-min, max): 1 instruction a value and 10 for
// the warp, against 3 and 20 in fp32. Both give the spec's values: min and max of values of T are
// values of T, and negation is exact.
template <class A, class T>
__device__ __forceinline__ float2 row_min_max(const arch::Vec<T, 8> (&lat)[2], const arch::Vec<T, 8>& pe,
                                              bool has_pe) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  if constexpr (A::kMinCudaArch >= 800) {
    using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
    const T2* a = reinterpret_cast<const T2*>(&lat[0]);
    const T2* b = reinterpret_cast<const T2*>(&lat[1]);
    const T2* c = reinterpret_cast<const T2*>(&pe);
    T2 lo = __hmin2(a[0], b[0]), hi = __hmax2(a[0], b[0]);
#pragma unroll
    for (int k = 1; k < 4; ++k) {
      lo = __hmin2(lo, __hmin2(a[k], b[k]));
      hi = __hmax2(hi, __hmax2(a[k], b[k]));
    }
    if (has_pe) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        lo = __hmin2(lo, c[k]);
        hi = __hmax2(hi, c[k]);
      }
    }
    lo = __hmin2(lo, __lowhigh2highlow(lo));
    hi = __hmax2(hi, __lowhigh2highlow(hi));
    T2 m;
    m.x = __hneg(lo.x);
    m.y = hi.y;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const uint32_t other = __shfl_xor_sync(0xffffffffu, *reinterpret_cast<const uint32_t*>(&m), o);
      m = __hmax2(m, *reinterpret_cast<const T2*>(&other));
    }
    return make_float2(-arch::to_float(m.x), arch::to_float(m.y));
  }
#endif
  auto f = [](const arch::Vec<T, 8>& v, int k) { return arch::to_float(v.v[k]); };
  float lo = INFINITY, hi = -INFINITY;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    lo = fminf(lo, fminf(f(lat[0], k), f(lat[1], k)));
    hi = fmaxf(hi, fmaxf(f(lat[0], k), f(lat[1], k)));
    if (has_pe) {
      lo = fminf(lo, f(pe, k));
      hi = fmaxf(hi, f(pe, k));
    }
  }
  return make_float2(warp_min(lo), group_max<32>(hi));
}

// The absolute maxima of the lane's two latent vectors, each over its 16-lane half warp (fp8_ds_mla's
// tiles 2 i + lane / 16), both in one shuffle chain: on sm80+ as a packed pair of T (the maxima of
// values of T are values of T), else as fp32 pairs of chains interleaved.
template <class A, class T>
__device__ __forceinline__ float2 tile_amax(const arch::Vec<T, 8> (&lat)[2]) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  if constexpr (A::kMinCudaArch >= 800) {
    using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
    uint32_t both = 0;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const T2* a = reinterpret_cast<const T2*>(&lat[i]);
      T2 m = __hmax2(__hmax2(__habs2(a[0]), __habs2(a[1])), __hmax2(__habs2(a[2]), __habs2(a[3])));
      m = __hmax2(m, __lowhigh2highlow(m));  // both halves hold the vector's maximum
      both = __byte_perm(both, *reinterpret_cast<const uint32_t*>(&m), i == 0 ? 0x3254 : 0x5410);
    }
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) {
      const uint32_t other = __shfl_xor_sync(0xffffffffu, both, o);
      const T2 m = __hmax2(*reinterpret_cast<const T2*>(&both), *reinterpret_cast<const T2*>(&other));
      both = *reinterpret_cast<const uint32_t*>(&m);
    }
    const T2 m = *reinterpret_cast<const T2*>(&both);
    return make_float2(arch::to_float(m.x), arch::to_float(m.y));
  }
#endif
  float m[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int k = 0; k < 8; ++k) m[i] = fmaxf(m[i], fabsf(arch::to_float(lat[i].v[k])));
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) {
    m[0] = fmaxf(m[0], __shfl_xor_sync(0xffffffffu, m[0], o));
    m[1] = fmaxf(m[1], __shfl_xor_sync(0xffffffffu, m[1], o));
  }
  return make_float2(m[0], m[1]);
}

// fp8_ds_mla's tile scale max(fl(amax / 448), FLT_MIN) of a 16-bit amax without a division (its
// range check and branch): the product by fl(1 / 448) and one fma step on its residual give the
// quotient for every finite non-negative half and bfloat16 (tests/test_reference_quant.py checks all
// of them in exact arithmetic); inf and NaN take the product (inf, NaN, as the quotient).
__device__ __forceinline__ float e4m3_tile_scale(float amax) {
  constexpr float kInv448 = 1.f / 448.f;
  const float q = amax * kInv448;
  const float exact = fmaf(fmaf(-q, 448.f, amax), kInv448, q);
  return fmaxf(amax < INFINITY ? exact : q, kFltMin);
}

// The quantized row of one token, from the values the 16-bit row would hold (rounded to T, as the
// reference quantizes them): lat[i] holds latent values (i * 32 + lane) * 8 .. + 8, pe on lanes < 8
// rope values lane * 8 .. + 8. Layouts: mla_kv/layout.h KvFormat and
// python/mla_kv/reference/quant.py, whose quantizer this matches bit for bit (ties to even).
template <class A, class T, class Rows>
__device__ __forceinline__ void store_quantized(const Rows& rows, const RowSlot& slot, const arch::Vec<T, 8> (&lat)[2],
                                                const arch::Vec<T, 8>& pe, int lane) {
  const RowLayout& layout = rows.cache.row;
  char* row = slot.region + slot.offset * layout.row_stride_bytes;
  const bool has_pe = lane < 8;
  // Values convert to fp32 where they are used: rows kept in T are half the registers (occupancy).
  auto f = [](const arch::Vec<T, 8>& v, int k) { return arch::to_float(v.v[k]); };
  // Stored element indices of this lane's vectors (multiples of 8 values).
  const int e_lat[2] = {layout.latent_offset + lane * 8, layout.latent_offset + (32 + lane) * 8};
  const int e_pe = layout.rope_offset + lane * 8;
  // encode(vector, its output) over the lane's vectors: lat[0], lat[1], and pe on lanes < 8.
  auto for_vectors = [&](auto&& encode, uint2 (&out)[3]) {
    encode(lat[0], out[0]);
    encode(lat[1], out[1]);
    if (has_pe) encode(pe, out[2]);
  };

  switch (layout.format) {
    case KvFormat::kFp8: {
      const float s = layout.kv_scale, r = 1.f / s;
      const bool exact = exact_reciprocal(s, r);
      bool near = !exact && !normal_reciprocal(r);
      uint2 w[3];
      for_vectors([&](const arch::Vec<T, 8>& v, uint2& out) { out = e4m3x8_by_reciprocal<A>(v, r, exact, near); }, w);
      if (near) for_vectors([&](const arch::Vec<T, 8>& v, uint2& out) { out = e4m3x8_divided<A>(v, s); }, w);
      *reinterpret_cast<uint2*>(row + e_lat[0]) = w[0];
      *reinterpret_cast<uint2*>(row + e_lat[1]) = w[1];
      if (has_pe) *reinterpret_cast<uint2*>(row + e_pe) = w[2];
      return;
    }
    case KvFormat::kFp8DsMla: {
      // Latent first (checked on the host). Tile of vector i: 2 * i + lane / 16 (tile_amax).
      constexpr int kScales = kLatentDim, kRope = kLatentDim + 16;
      const float2 amax = tile_amax<A>(lat);
      const float scale[2] = {e4m3_tile_scale(amax.x), e4m3_tile_scale(amax.y)};
      uint2 w[2];
      bool near = false;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float r = arch::rcp_approx(scale[i]);  // normal: scale is in [FLT_MIN, FLT_MAX / 448]
        w[i] = e4m3x8_by_reciprocal<A>(lat[i], r, exact_reciprocal(scale[i], r), near);
      }
      if (near) {
        w[0] = e4m3x8_divided<A>(lat[0], scale[0]);
        w[1] = e4m3x8_divided<A>(lat[1], scale[1]);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        *reinterpret_cast<uint2*>(row + lane * 8 + i * 256) = w[i];
        if ((lane & 15) == 0) *reinterpret_cast<float*>(row + kScales + 4 * (2 * i + lane / 16)) = scale[i];
      }
      if (has_pe) {
        arch::Vec<__nv_bfloat16, 8> b;
#pragma unroll
        for (int k = 0; k < 8; ++k) b.v[k] = __float2bfloat16_rn(f(pe, k));
        arch::store<__nv_bfloat16, 8>(reinterpret_cast<__nv_bfloat16*>(row + kRope) + lane * 8, b);
      }
      return;
    }
    case KvFormat::kInt8:
    case KvFormat::kInt4: {
      const bool int4 = layout.format == KvFormat::kInt4;
      const float2 lo_hi = row_min_max<A>(lat, pe, has_pe);
      const float lo = lo_hi.x, hi = lo_hi.y;
      const float top = int4 ? 15.f : 255.f;
      // Codes come from the stored (rounded) scale and zero, so code * scale + zero is what a reader gets.
      const T scale_t = arch::from_float<T>((hi - lo) / top), zero_t = arch::from_float<T>(lo);
      const float scale = arch::to_float(scale_t), zero = arch::to_float(zero_t), r = 1.f / scale;
      // A zero scale (all values equal, or a range that rounds to 0 in T) stores code 0 everywhere, as
      // the reference does.
      const bool flat = !(scale > 0.f);
      uint2 w[3] = {};
      if (normal_reciprocal(r)) {
        for_vectors([&](const arch::Vec<T, 8>& v, uint2& out) { out = int_codes<true>(v, zero, scale, r, int4); }, w);
      } else if (!flat) {
        for_vectors([&](const arch::Vec<T, 8>& v, uint2& out) { out = int_codes<false>(v, zero, scale, r, int4); }, w);
      }
      auto put = [&](const uint2& wv, int e) {
        if (int4) *reinterpret_cast<uint32_t*>(row + e / 2) = wv.x;
        else *reinterpret_cast<uint2*>(row + e) = wv;
      };
      put(w[0], e_lat[0]);
      put(w[1], e_lat[1]);
      if (has_pe) put(w[2], e_pe);
      if (lane == 0) {
        T* pair = reinterpret_cast<T*>(slot.region + int64_t(rows.rows_per_block()) * layout.row_stride_bytes +
                                       slot.offset * 4);
        pair[0] = scale_t;
        pair[1] = zero_t;
      }
      return;
    }
    default:
      return;  // kNone never comes here
  }
}

// Rotates the rope vectors a (vector j) and b (vector j + kRopeVecs / 2) of one 64-d rope part.
// Neox pairs element e with e + 32, which sits at the same place in b. Interleaved pairs (2i, 2i+1)
// sit inside one vector (N is even).
template <class T, class CosT, int N>
__device__ __forceinline__ void rotate_pair(arch::Vec<T, N>& a, arch::Vec<T, N>& b, int j,
                                            const CosT* cos_sin, RopeStyle style) {
  constexpr int kHalf = kRopeDim / 2;
  constexpr int kPairVecs = kRopeDim / N / 2;
  if (style == RopeStyle::kNeox) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const int i = j * N + k;
      const float c = arch::to_float(cos_sin[i]), s = arch::to_float(cos_sin[kHalf + i]);
      const float x = arch::to_float(a.v[k]), y = arch::to_float(b.v[k]);
      a.v[k] = arch::from_float<T>(x * c - y * s);
      b.v[k] = arch::from_float<T>(y * c + x * s);
    }
  } else {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      arch::Vec<T, N>& v = half ? b : a;
      const int first = (j + half * kPairVecs) * N;
#pragma unroll
      for (int k = 0; k < N; k += 2) {
        const int i = (first + k) / 2;
        const float c = arch::to_float(cos_sin[i]), s = arch::to_float(cos_sin[kHalf + i]);
        const float x = arch::to_float(v.v[k]), y = arch::to_float(v.v[k + 1]);
        v.v[k] = arch::from_float<T>(x * c - y * s);
        v.v[k + 1] = arch::from_float<T>(y * c + x * s);
      }
    }
  }
}

// kQuant: the cache is in a quantized KvFormat (16-bit T, 16-byte vectors), else T values.
template <class A, class T, class CosT, int N, bool kFused, bool kQuant, class Rows>
__global__ void __launch_bounds__(kWarpsPerBlock * 32,
                                  (arch::target_min_blocks(kWarpsPerBlock * 32, kMinBlocksPerSm<T, N, kQuant>)))
    write_kv_kernel(const WriteKvParams p, const Rows rows) {
  if constexpr (arch::target_supports<A>()) {
    constexpr int kLatentVecsPerLane = kLatentDim / N / 32;
    constexpr int kPairVecs = kRopeDim / N / 2;  // lanes that rotate one rope part
    static_assert(kLatentVecsPerLane >= 1 && kPairVecs <= 32 && N % 2 == 0, "vector width");
    static_assert(!kQuant || (sizeof(T) == 2 && N == 8), "quantized rows are written from 16-bit vectors of 8");

    const int lane = threadIdx.x & 31;
    const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
    if (t >= p.num_tokens) return;

    // Every independent load first (input row, weight, slot, position): a token then costs one
    // memory round trip, not a chain of them. Inputs are read even for skipped rows; they exist.
    const T* src_c = static_cast<const T*>(p.kv_c) + t * p.kv_c_stride;
    const T* src_pe = static_cast<const T*>(p.k_pe) + t * p.k_pe_stride;
    arch::Vec<T, N> lat[kLatentVecsPerLane];
#pragma unroll
    for (int i = 0; i < kLatentVecsPerLane; ++i)
      lat[i] = arch::load_stream<A, T, N>(src_c + (i * 32 + lane) * N);
    arch::Vec<T, N> pe_a, pe_b;
    if (lane < kPairVecs) {
      pe_a = arch::load_stream<A, T, N>(src_pe + lane * N);
      pe_b = arch::load_stream<A, T, N>(src_pe + (lane + kPairVecs) * N);
    }
    arch::Vec<T, N> weight[kLatentVecsPerLane];
    int64_t pos = 0;
    if constexpr (kFused) {
      const T* w = static_cast<const T*>(p.rms_weight);
#pragma unroll
      for (int i = 0; i < kLatentVecsPerLane; ++i) weight[i] = arch::load_cached<T, N>(w + (i * 32 + lane) * N);
      pos = p.positions[t];
    }
    RowSlot target{};  // quantized rows: also the block's trailer
    char* row = nullptr;
    if constexpr (kQuant) {
      target = rows.slot(t);
      row = target.region;
    } else {
      row = rows.row(t);
    }

    const CosT* cos_sin = nullptr;
    if constexpr (kFused) {
      if (pos < 0 || pos >= p.max_position) return;  // validated on the host; never read out of bounds
      cos_sin = static_cast<const CosT*>(p.cos_sin) + pos * kRopeDim;
    }

    if (row != nullptr) {
      if constexpr (kFused) {
        float sumsq = 0.f;
#pragma unroll
        for (int i = 0; i < kLatentVecsPerLane; ++i)
#pragma unroll
          for (int k = 0; k < N; ++k) {
            const float x = arch::to_float(lat[i].v[k]);
            sumsq += x * x;
          }
        const float inv_rms = rsqrtf(warp_sum(sumsq) / kLatentDim + p.rms_eps);
#pragma unroll
        for (int i = 0; i < kLatentVecsPerLane; ++i)
#pragma unroll
          for (int k = 0; k < N; ++k)
            lat[i].v[k] = arch::from_float<T>(arch::to_float(lat[i].v[k]) * inv_rms *
                                              arch::to_float(weight[i].v[k]));
        if (lane < kPairVecs) rotate_pair<T, CosT, N>(pe_a, pe_b, lane, cos_sin, p.rope_style);
      }

      if constexpr (kQuant) {
        // Rope vector j to lane j (lanes 4..7 take pe_b of lanes 0..3): the quantizing steps then run
        // over one rope vector on 8 lanes, not two on 4, a quarter of the warp's instructions less.
        arch::Vec<T, 8> pe = pe_a;
        uint32_t* pe_words = reinterpret_cast<uint32_t*>(&pe);
        const uint32_t* b_words = reinterpret_cast<const uint32_t*>(&pe_b);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint32_t from_b = __shfl_sync(0xffffffffu, b_words[k], lane & 3);
          if (lane >= 4) pe_words[k] = from_b;
        }
        store_quantized<A, T>(rows, target, lat, pe, lane);
      } else {
        T* dst_c = reinterpret_cast<T*>(row) + rows.cache.row.latent_offset;
        T* dst_pe = reinterpret_cast<T*>(row) + rows.cache.row.rope_offset;
#pragma unroll
        for (int i = 0; i < kLatentVecsPerLane; ++i) arch::store<T, N>(dst_c + (i * 32 + lane) * N, lat[i]);
        if (lane < kPairVecs) {
          arch::store<T, N>(dst_pe + lane * N, pe_a);
          arch::store<T, N>(dst_pe + (lane + kPairVecs) * N, pe_b);
        }
      }
    }

    if constexpr (kFused) {
      // q is rotated even for padded cache slots: the token's attention still needs it.
      if (p.q != nullptr) {
        constexpr int kHeadsPerStep = 32 / kPairVecs;
        const int j = lane % kPairVecs;
        T* q_tok = static_cast<T*>(p.q) + t * p.q_stride_token + (p.q_head_dim - kRopeDim);
        for (int h = lane / kPairVecs; h < p.q_heads; h += kHeadsPerStep) {
          T* qh = q_tok + h * p.q_stride_head;
          arch::Vec<T, N> a = arch::load_cached<T, N>(qh + j * N);
          arch::Vec<T, N> b = arch::load_cached<T, N>(qh + (j + kPairVecs) * N);
          rotate_pair<T, CosT, N>(a, b, j, cos_sin, p.rope_style);
          arch::store<T, N>(qh + j * N, a);
          arch::store<T, N>(qh + (j + kPairVecs) * N, b);
        }
      }
    }
  } else {
    __trap();  // the host never launches a tag the compiled target cannot run
  }
}

// One warp per token.
template <class Rows, class Kernel>
Status launch_per_token(Kernel kernel, const WriteKvParams& p, const Rows& rows, cudaStream_t stream) {
  if (p.num_tokens <= 0) return Status::kOk;
  const dim3 grid(unsigned((p.num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock));
  kernel<<<grid, dim3(kWarpsPerBlock * 32), 0, stream>>>(p, rows);
  return cudaPeekAtLastError() == cudaSuccess ? Status::kOk : Status::kCudaError;
}

// Host side: picks the vector width and fused/plain variant, then launches.
template <class A, class T, class Rows>
Status launch_write_kv(const WriteKvParams& p, const Rows& rows, bool vec16, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  auto go = [&](auto kernel) { return launch_per_token(kernel, p, rows, stream); };
  if (p.rms_weight == nullptr) {
    return vec16 ? go(write_kv_kernel<A, T, float, kVec, false, false, Rows>)
                 : go(write_kv_kernel<A, T, float, 2, false, false, Rows>);
  }
  if (p.cos_sin_fp32) {
    return vec16 ? go(write_kv_kernel<A, T, float, kVec, true, false, Rows>)
                 : go(write_kv_kernel<A, T, float, 2, true, false, Rows>);
  }
  return vec16 ? go(write_kv_kernel<A, T, T, kVec, true, false, Rows>)
               : go(write_kv_kernel<A, T, T, 2, true, false, Rows>);
}

// The quantizing write (16-bit T, 16-byte accesses: the host checks both).
template <class A, class T, class Rows>
Status launch_write_kv_quant(const WriteKvParams& p, const Rows& rows, cudaStream_t stream) {
  auto go = [&](auto kernel) { return launch_per_token(kernel, p, rows, stream); };
  if (p.rms_weight == nullptr) return go(write_kv_kernel<A, T, float, 8, false, true, Rows>);
  if (p.cos_sin_fp32) return go(write_kv_kernel<A, T, float, 8, true, true, Rows>);
  return go(write_kv_kernel<A, T, T, 8, true, true, Rows>);
}

}  // namespace write_detail

}  // namespace mla_kv
