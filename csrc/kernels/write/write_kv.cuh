// The write kernel: one warp per token. Each lane moves 16-byte vectors of the latent (and the
// rope part on the first lanes); the RMSNorm sum is a warp reduction, so no shared memory and no
// block barrier: a row costs one read and one write of its bytes. q's rope parts are rotated by
// the same warp after the row, several heads per warp instruction.
// Reference: python/mla_kv/reference/write.py (write_kv, fused_write_kv).
#pragma once

#include "../address.cuh"
#include "../arch/arch.cuh"
#include "../arch/fp8.cuh"
#include "mla_kv/write.h"

namespace mla_kv {
namespace write_detail {

constexpr int kWarpsPerBlock = 4;
// Rows in flight per SM bound a copy-like kernel: the 16-byte 16-bit variants (the ones engines
// run) cap registers at 51 so 40 warps fit; the others, and the quantizing writes (whose fp32 copy
// of the row would spill under that cap), keep the compiler's choice.
template <class T, int N, bool kQuant>
constexpr int kMinBlocksPerSm = (sizeof(T) == 2 && N == 8 && !kQuant) ? 10 : 1;

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

// The quantized row of one token, from the values the 16-bit row would hold (rounded to T, as the
// reference quantizes them): lat[i] holds latent values (i * 32 + lane) * 8 .. + 8, pe_a / pe_b on
// lanes < 4 the rope values lane * 8 and (lane + 4) * 8. Layouts: mla_kv/layout.h KvFormat and
// python/mla_kv/reference/quant.py, whose quantizer this matches bit for bit (fp32 divisions as
// the reference divides; ties to even).
template <class A, class T, class Rows>
__device__ __forceinline__ void store_quantized(const Rows& rows, const RowSlot& slot, const arch::Vec<T, 8> (&lat)[2],
                                                const arch::Vec<T, 8>& pe_a, const arch::Vec<T, 8>& pe_b, int lane) {
  const RowLayout& layout = rows.cache.row;
  char* row = slot.region + slot.offset * layout.row_stride_bytes;
  const bool has_pe = lane < 4;
  float x[2][8], pa[8], pb[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    x[0][k] = arch::to_float(lat[0].v[k]);
    x[1][k] = arch::to_float(lat[1].v[k]);
    pa[k] = arch::to_float(pe_a.v[k]);
    pb[k] = arch::to_float(pe_b.v[k]);
  }
  // Stored element indices of this lane's vectors (multiples of 8 values).
  const int e_lat[2] = {layout.latent_offset + lane * 8, layout.latent_offset + (32 + lane) * 8};
  const int e_pa = layout.rope_offset + lane * 8, e_pb = layout.rope_offset + (lane + 4) * 8;

  auto fp8_bytes = [](const float (&v)[8], float inv) {  // 8 values / inv -> 8 e4m3 bytes
    uint2 r;
    r.x = arch::e4m3x2<A>(v[0] / inv, v[1] / inv) | (arch::e4m3x2<A>(v[2] / inv, v[3] / inv) << 16);
    r.y = arch::e4m3x2<A>(v[4] / inv, v[5] / inv) | (arch::e4m3x2<A>(v[6] / inv, v[7] / inv) << 16);
    return r;
  };
  switch (layout.format) {
    case KvFormat::kFp8: {
      const float s = layout.kv_scale;
      *reinterpret_cast<uint2*>(row + e_lat[0]) = fp8_bytes(x[0], s);
      *reinterpret_cast<uint2*>(row + e_lat[1]) = fp8_bytes(x[1], s);
      if (has_pe) {
        *reinterpret_cast<uint2*>(row + e_pa) = fp8_bytes(pa, s);
        *reinterpret_cast<uint2*>(row + e_pb) = fp8_bytes(pb, s);
      }
      return;
    }
    case KvFormat::kFp8DsMla: {
      // Latent first (checked on the host). Tile of vector i: 2 * i + lane / 16, so a tile's amax is
      // a reduction over a half warp.
      constexpr float kFltMin = 1.17549435e-38f;
      constexpr int kScales = kLatentDim, kRope = kLatentDim + 16;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float amax = 0.f;
#pragma unroll
        for (int k = 0; k < 8; ++k) amax = fmaxf(amax, fabsf(x[i][k]));
        const float scale = fmaxf(group_max<16>(amax) / 448.f, kFltMin);
        *reinterpret_cast<uint2*>(row + lane * 8 + i * 256) = fp8_bytes(x[i], scale);
        if ((lane & 15) == 0) *reinterpret_cast<float*>(row + kScales + 4 * (2 * i + lane / 16)) = scale;
      }
      if (has_pe) {
        arch::Vec<__nv_bfloat16, 8> a, b;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          a.v[k] = __float2bfloat16_rn(pa[k]);
          b.v[k] = __float2bfloat16_rn(pb[k]);
        }
        arch::store<__nv_bfloat16, 8>(reinterpret_cast<__nv_bfloat16*>(row + kRope) + lane * 8, a);
        arch::store<__nv_bfloat16, 8>(reinterpret_cast<__nv_bfloat16*>(row + kRope) + (lane + 4) * 8, b);
      }
      return;
    }
    case KvFormat::kInt8:
    case KvFormat::kInt4: {
      const bool int4 = layout.format == KvFormat::kInt4;
      float lo = INFINITY, hi = -INFINITY;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        lo = fminf(lo, fminf(x[0][k], x[1][k]));
        hi = fmaxf(hi, fmaxf(x[0][k], x[1][k]));
        if (has_pe) {
          lo = fminf(lo, fminf(pa[k], pb[k]));
          hi = fmaxf(hi, fmaxf(pa[k], pb[k]));
        }
      }
      lo = warp_min(lo);
      hi = group_max<32>(hi);
      const float top = int4 ? 15.f : 255.f;
      // Codes come from the stored (rounded) scale and zero, so code * scale + zero is what a reader gets.
      const T scale_t = arch::from_float<T>((hi - lo) / top), zero_t = arch::from_float<T>(lo);
      const float scale = arch::to_float(scale_t), zero = arch::to_float(zero_t);
      auto code = [&](float v) -> uint32_t {
        return scale > 0.f ? uint32_t(fminf(fmaxf(rintf((v - zero) / scale), 0.f), top)) : 0u;
      };
      auto put = [&](const float (&v)[8], int e) {
        uint32_t c[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) c[k] = code(v[k]);
        if (int4) {  // nibbles from the low one up hold values 0, 2, 4, 6, 1, 3, 5, 7
          *reinterpret_cast<uint32_t*>(row + e / 2) = c[0] | c[2] << 4 | c[4] << 8 | c[6] << 12 | c[1] << 16 |
                                                     c[3] << 20 | c[5] << 24 | c[7] << 28;
        } else {
          *reinterpret_cast<uint2*>(row + e) = make_uint2(c[0] | c[1] << 8 | c[2] << 16 | c[3] << 24,
                                                          c[4] | c[5] << 8 | c[6] << 16 | c[7] << 24);
        }
      };
      put(x[0], e_lat[0]);
      put(x[1], e_lat[1]);
      if (has_pe) {
        put(pa, e_pa);
        put(pb, e_pb);
      }
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
__global__ void __launch_bounds__(kWarpsPerBlock * 32, (kMinBlocksPerSm<T, N, kQuant>))
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
        store_quantized<A, T>(rows, target, lat, pe_a, pe_b, lane);
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
