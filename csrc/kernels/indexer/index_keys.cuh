// The indexer's key write: eight lanes per row, a row being one token's index key (LayerNorm, RoPE,
// Hadamard, e4m3 into the cache) or one head of its index query (RoPE, Hadamard, in place). Lane g of
// a row holds elements 8g .. 8g+7 and 64+8g .. 64+8g+7, so each of its two loads and stores covers
// 128 contiguous bytes of the row, the rope part (dims 0..63) is every lane's first vector, and the
// Hadamard's stages over bits 0-2 and 6 of the element index stay in the lane, those over bits 3-5 are
// lane shuffles. Every sum is taken in a fixed order with IEEE fp32 operations (no contraction), which
// python/mla_kv/reference/index_keys.py repeats, so the reference's bytes are the kernel's.
#pragma once

#include <cstdint>

#include "../address.cuh"
#include "../arch/arch.cuh"
#include "../arch/fp8.cuh"
#include "../write/write_kv.cuh"
#include "mla_kv/indexer.h"

namespace mla_kv {
namespace index_keys_detail {

constexpr int kLanesPerRow = 8;
constexpr int kValuesPerLane = kIndexDim / kLanesPerRow;  // 16: two vectors of 8
constexpr int kRowsPerBlock = 16;
constexpr float kInvSqrtDim = 0.0883883476483184405f;  // fl(1 / sqrt(128))
constexpr float kE4m3Max = 448.f;
constexpr float kAmaxFloor = 1e-4f;

// Element of the row held in slot v (0..15) of lane g.
__device__ __forceinline__ int element_of(int g, int v) { return (v >> 3) * 64 + g * 8 + (v & 7); }

// A small parameter vector (LayerNorm weight or bias, a cos/sin row) read as fp32 or as T.
template <class T>
__device__ __forceinline__ float param(const void* p, bool fp32, int i) {
  return fp32 ? __ldg(static_cast<const float*>(p) + i) : arch::to_float(static_cast<const T*>(p)[i]);
}

// Slot v + w added into slot v for v < w, then the same for w / 2, ..., 1: s[0] holds the sum.
template <int kWidth>
__device__ __forceinline__ void halve(float (&s)[kValuesPerLane]) {
#pragma unroll
  for (int v = 0; v < kWidth; ++v) s[v] = __fadd_rn(s[v], s[v + kWidth]);
  if constexpr (kWidth > 1) halve<kWidth / 2>(s);
}

// The row's sum, identical on its 8 lanes: the lane's 16 values by halving, then the lanes by halving
// (lane g ^ 4, ^ 2, ^ 1).
__device__ __forceinline__ float row_sum(const float (&x)[kValuesPerLane], unsigned mask) {
  float s[kValuesPerLane];
#pragma unroll
  for (int v = 0; v < kValuesPerLane; ++v) s[v] = x[v];
  halve<kValuesPerLane / 2>(s);
  float total = s[0];
#pragma unroll
  for (int m = kLanesPerRow / 2; m > 0; m >>= 1) total = __fadd_rn(total, __shfl_xor_sync(mask, total, m));
  return total;
}

// (x - mean) / sqrt(var + eps) * weight + bias, mean and var over the row's 128 values.
template <class T>
__device__ __forceinline__ void layer_norm(float (&x)[kValuesPerLane], const WriteIndexKeysParams& p, int g,
                                           unsigned mask) {
  const float mean = __fmul_rn(row_sum(x, mask), 1.f / kIndexDim);
  float sq[kValuesPerLane];
#pragma unroll
  for (int v = 0; v < kValuesPerLane; ++v) {
    x[v] = __fsub_rn(x[v], mean);
    sq[v] = __fmul_rn(x[v], x[v]);
  }
  const float var = __fmul_rn(row_sum(sq, mask), 1.f / kIndexDim);
  const float rstd = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(var, p.ln_eps)));
#pragma unroll
  for (int v = 0; v < kValuesPerLane; ++v) {
    const int e = element_of(g, v);
    const float w = param<T>(p.ln_weight, p.ln_fp32, e), b = param<T>(p.ln_bias, p.ln_fp32, e);
    x[v] = __fadd_rn(__fmul_rn(__fmul_rn(x[v], rstd), w), b);
  }
}

// RoPE on dims 0..63, each lane's slots 0..7. Neox pairs (i, i + 32) are lanes g and g ^ 4 at the same
// slot; interleaved pairs (2i, 2i + 1) are adjacent slots of one lane. a' = a c - b s, b' = b c + a s.
template <class T>
__device__ __forceinline__ void rotate(float (&x)[kValuesPerLane], const void* cos_sin, bool fp32, RopeStyle style,
                                       int g, unsigned mask) {
  constexpr int kHalf = kIndexRopeDim / 2;
  if (style == RopeStyle::kNeox) {
    const bool second = g >= 4;
#pragma unroll
    for (int v = 0; v < 8; ++v) {
      const int i = (g & 3) * 8 + v;
      const float c = param<T>(cos_sin, fp32, i), s = param<T>(cos_sin, fp32, kHalf + i);
      const float other = __shfl_xor_sync(mask, x[v], 4);
      x[v] = second ? __fadd_rn(__fmul_rn(x[v], c), __fmul_rn(other, s))
                    : __fsub_rn(__fmul_rn(x[v], c), __fmul_rn(other, s));
    }
  } else {
#pragma unroll
    for (int v = 0; v < 8; v += 2) {
      const int i = (g * 8 + v) / 2;
      const float c = param<T>(cos_sin, fp32, i), s = param<T>(cos_sin, fp32, kHalf + i);
      const float a = x[v], b = x[v + 1];
      x[v] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
      x[v + 1] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    }
  }
}

// y = H x / sqrt(128), H the Sylvester Hadamard matrix: the butterflies (a, b) -> (a + b, a - b) over
// element bits 0, 1, ..., 6 in that order (a the element with the bit clear), then the scale.
__device__ __forceinline__ void hadamard(float (&x)[kValuesPerLane], int g, unsigned mask) {
  auto in_lane = [&](int bit) {
#pragma unroll
    for (int v = 0; v < kValuesPerLane; ++v) {
      if (v & bit) continue;
      const float a = x[v], b = x[v + bit];
      x[v] = __fadd_rn(a, b);
      x[v + bit] = __fsub_rn(a, b);
    }
  };
  in_lane(1);
  in_lane(2);
  in_lane(4);
#pragma unroll
  for (int m = 1; m < kLanesPerRow; m <<= 1) {
    const bool upper = g & m;
#pragma unroll
    for (int v = 0; v < kValuesPerLane; ++v) {
      const float other = __shfl_xor_sync(mask, x[v], m);
      x[v] = upper ? __fsub_rn(other, x[v]) : __fadd_rn(x[v], other);
    }
  }
  in_lane(8);
#pragma unroll
  for (int v = 0; v < kValuesPerLane; ++v) x[v] = __fmul_rn(x[v], kInvSqrtDim);
}

// The token's scale: fl(max(amax, 1e-4) / 448), or that rounded up to a power of two (ue8m0).
__device__ __forceinline__ float key_scale(float amax, IndexScaleFormat format) {
  const float s = __fdiv_rn(fmaxf(amax, kAmaxFloor), kE4m3Max);
  if (format != IndexScaleFormat::kPow2) return s;
  return __uint_as_float((__float_as_uint(s) + 0x7FFFFFu) & 0xFF800000u);  // s is positive and normal
}

// The row's e4m3 codes (two 8-byte words of the lane's two vectors) and, on lane 0, its scale.
template <class A, class Rows>
__device__ __forceinline__ void store_key(const Rows& rows, const RowSlot& slot, const float (&x)[kValuesPerLane],
                                          IndexScaleFormat format, int g, unsigned mask) {
  float amax = 0.f;
#pragma unroll
  for (int v = 0; v < kValuesPerLane; ++v) amax = fmaxf(amax, fabsf(x[v]));
#pragma unroll
  for (int m = kLanesPerRow / 2; m > 0; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(mask, amax, m));
  const float s = key_scale(amax, format);
  arch::Vec<float, 8> half[2];
#pragma unroll
  for (int v = 0; v < kValuesPerLane; ++v) half[v >> 3].v[v & 7] = x[v];
  // codes = e4m3(x / s): by products with 1 / s where they give the quotient's bytes (write_kv.cuh).
  const float r = 1.f / s;
  const bool exact = write_detail::exact_reciprocal(s, r);
  bool near = !exact && !write_detail::normal_reciprocal(r);
  uint2 w[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) w[h] = write_detail::e4m3x8_by_reciprocal<A>(half[h], r, exact, near);
  if (near) {
#pragma unroll
    for (int h = 0; h < 2; ++h) w[h] = write_detail::e4m3x8_divided<A>(half[h], s);
  }
  char* codes = slot.region + slot.offset * kIndexDim;
  *reinterpret_cast<uint2*>(codes + g * 8) = w[0];
  *reinterpret_cast<uint2*>(codes + 64 + g * 8) = w[1];
  if (g == 0) {
    *reinterpret_cast<float*>(slot.region + int64_t(rows.rows_per_block()) * kIndexDim + slot.offset * 4) = s;
  }
}

// Rows 0 .. num_tokens - 1 are the keys, then token t's query head h is row num_tokens + t * q_heads + h:
// a warp's rows are all keys or all queries but at the one boundary. N: elements per load (8: 16 bytes).
template <class A, class T, int N, class Rows>
__global__ void __launch_bounds__(kRowsPerBlock * kLanesPerRow)
    index_keys_kernel(const WriteIndexKeysParams p, const Rows rows) {
  if constexpr (arch::target_supports<A>()) {
    const int lane = threadIdx.x & 31;
    const int g = lane & (kLanesPerRow - 1);
    const unsigned mask = 0xFFu << (lane & ~(kLanesPerRow - 1));  // the row's lanes: they branch together
    const int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanesPerRow;
    const int64_t queries = p.q == nullptr ? 0 : p.num_tokens * p.q_heads;
    if (r >= p.num_tokens + queries) return;
    const bool is_key = r < p.num_tokens;
    int64_t t = r;
    const T* src = static_cast<const T*>(p.k) + t * p.k_stride;
    T* q_row = nullptr;
    if (!is_key) {
      t = (r - p.num_tokens) / p.q_heads;
      const int64_t h = r - p.num_tokens - t * p.q_heads;
      q_row = static_cast<T*>(p.q) + t * p.q_stride_token + h * p.q_stride_head;
      src = q_row;
    }

    // The independent loads first (row, position, slot): one memory round trip a row.
    float x[kValuesPerLane];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < 8 / N; ++i) {
        const T* at = src + h * 64 + g * 8 + i * N;
        const arch::Vec<T, N> v = is_key ? arch::load_stream<A, T, N>(at) : arch::load_cached<T, N>(at);
#pragma unroll
        for (int k = 0; k < N; ++k) x[h * 8 + i * N + k] = arch::to_float(v.v[k]);
      }
    const int64_t pos = p.positions[t];
    const RowSlot slot = is_key ? rows.slot(t) : RowSlot{};
    if (pos < 0 || pos >= p.max_position) return;  // validated on the host; never read out of bounds
    if (is_key && slot.region == nullptr) return;

    if (is_key) layer_norm<T>(x, p, g, mask);
    const char* cos_sin = static_cast<const char*>(p.cos_sin) + pos * kIndexRopeDim * (p.cos_sin_fp32 ? 4 : sizeof(T));
    rotate<T>(x, cos_sin, p.cos_sin_fp32, p.rope_style, g, mask);
    hadamard(x, g, mask);

    if (is_key) {
      store_key<A>(rows, slot, x, p.scale_format, g, mask);
      return;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < 8 / N; ++i) {
        arch::Vec<T, N> v;
#pragma unroll
        for (int k = 0; k < N; ++k) v.v[k] = arch::from_float<T>(x[h * 8 + i * N + k]);
        arch::store<T, N>(q_row + h * 64 + g * 8 + i * N, v);
      }
  } else {
    __trap();  // the host never launches a tag the compiled target cannot run
  }
}

template <class A, class T, class Rows>
Status launch_index_keys(const WriteIndexKeysParams& p, const Rows& rows, bool vec16, cudaStream_t stream) {
  const int64_t total = p.num_tokens * (1 + (p.q == nullptr ? 0 : int64_t(p.q_heads)));
  if (total <= 0) return Status::kOk;
  const int64_t blocks = (total + kRowsPerBlock - 1) / kRowsPerBlock;
  if (blocks > 0x7FFFFFFF) return Status::kInvalidArgument;
  const dim3 grid{unsigned(blocks)}, block{unsigned(kRowsPerBlock * kLanesPerRow)};
  if (vec16) index_keys_kernel<A, T, 8, Rows><<<grid, block, 0, stream>>>(p, rows);
  else index_keys_kernel<A, T, 2, Rows><<<grid, block, 0, stream>>>(p, rows);
  return cudaPeekAtLastError() == cudaSuccess ? Status::kOk : Status::kCudaError;
}

}  // namespace index_keys_detail
}  // namespace mla_kv
