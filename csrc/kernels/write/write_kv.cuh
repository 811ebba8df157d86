// The write kernel: one warp per token. Each lane moves 16-byte vectors of the latent (and the
// rope part on the first lanes); the RMSNorm sum is a warp reduction, so no shared memory and no
// block barrier: a row costs one read and one write of its bytes. q's rope parts are rotated by
// the same warp after the row, several heads per warp instruction.
// Reference: python/mla_kv/reference/write.py (write_kv, fused_write_kv).
#pragma once

#include "../address.cuh"
#include "../arch/arch.cuh"
#include "mla_kv/write.h"

namespace mla_kv {
namespace write_detail {

constexpr int kWarpsPerBlock = 4;
// Rows in flight per SM bound a copy-like kernel: the 16-byte 16-bit variants (the ones engines
// run) cap registers at 51 so 40 warps fit; the others keep the compiler's choice.
template <class T, int N>
constexpr int kMinBlocksPerSm = (sizeof(T) == 2 && N == 8) ? 10 : 1;

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
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

template <class A, class T, class CosT, int N, bool kFused, class Rows>
__global__ void __launch_bounds__(kWarpsPerBlock * 32, (kMinBlocksPerSm<T, N>))
    write_kv_kernel(const WriteKvParams p, const Rows rows) {
  if constexpr (arch::target_supports<A>()) {
    constexpr int kLatentVecsPerLane = kLatentDim / N / 32;
    constexpr int kPairVecs = kRopeDim / N / 2;  // lanes that rotate one rope part
    static_assert(kLatentVecsPerLane >= 1 && kPairVecs <= 32 && N % 2 == 0, "vector width");

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
    char* row = rows.row(t);

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

      T* dst_c = reinterpret_cast<T*>(row) + rows.cache.row.latent_offset;
      T* dst_pe = reinterpret_cast<T*>(row) + rows.cache.row.rope_offset;
#pragma unroll
      for (int i = 0; i < kLatentVecsPerLane; ++i) arch::store<T, N>(dst_c + (i * 32 + lane) * N, lat[i]);
      if (lane < kPairVecs) {
        arch::store<T, N>(dst_pe + lane * N, pe_a);
        arch::store<T, N>(dst_pe + (lane + kPairVecs) * N, pe_b);
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

// Host side: picks the vector width and fused/plain variant, then launches.
template <class A, class T, class Rows>
Status launch_write_kv(const WriteKvParams& p, const Rows& rows, bool vec16, cudaStream_t stream) {
  if (p.num_tokens <= 0) return Status::kOk;
  const dim3 grid(unsigned((p.num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock));
  const dim3 block(kWarpsPerBlock * 32);
  constexpr int kVec = 16 / sizeof(T);
  auto go = [&](auto kernel) {
    kernel<<<grid, block, 0, stream>>>(p, rows);
    return cudaPeekAtLastError() == cudaSuccess ? Status::kOk : Status::kCudaError;
  };
  if (p.rms_weight == nullptr) {
    return vec16 ? go(write_kv_kernel<A, T, float, kVec, false, Rows>)
                 : go(write_kv_kernel<A, T, float, 2, false, Rows>);
  }
  if (p.cos_sin_fp32) {
    return vec16 ? go(write_kv_kernel<A, T, float, kVec, true, Rows>)
                 : go(write_kv_kernel<A, T, float, 2, true, Rows>);
  }
  return vec16 ? go(write_kv_kernel<A, T, T, kVec, true, Rows>)
               : go(write_kv_kernel<A, T, T, 2, true, Rows>);
}

}  // namespace write_detail

}  // namespace mla_kv
