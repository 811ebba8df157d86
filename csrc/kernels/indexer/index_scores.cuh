// Index scores on tensor cores, one kernel for every arch tag: logits[t, s] = sum_h w[t, h] *
// relu(q[t, h] . k[s]) over the paged index-key cache (indexer.h).
//
// A CTA owns kRows = 64 query rows (row = (token, head): 64 / heads tokens of one sequence) and a chunk
// of positions, walked in tiles of 64. Each tile's e4m3 keys are read from memory once for all the
// CTA's rows, widened to fp16 in shared memory (every e4m3 value is exact in fp16) and multiplied by
// the rows' q, held in registers as fp16 A fragments for the whole chunk. The scores' per-position
// scale and the per-row factors come out of the dot product (relu(a x) = a relu(x) for a > 0):
//   logit = k_scale[s] * sum_r w'[r] * relu(q16[r] . codes16[s]),  w'[r] = w[r] * q_factor[r]
// where q16 = q / q_factor exactly: q_factor = 1 for fp16 q, the e4m3 scale for e4m3 q, and a power of
// two that brings the row's amax into [2^14, 2^15) for bf16 q (bf16 values are exact in fp16 within
// 2^24 of the row's amax). So the products are exact and only the fp32 sums round.
// Loads run a tile ahead: cp.async on Sm80+, registers on Volta / Turing.
// Reference: python/mla_kv/reference/indexer.py (index_scores).
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../arch/arch.cuh"
#include "../arch/fp8.cuh"
#include "../arch/mma.cuh"
#include "index_scores_launch.h"

namespace mla_kv {
namespace index_scores_detail {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kRows = 64;   // query rows per CTA
constexpr int kTile = 64;   // positions per tile
constexpr int kPitch = kIndexDim + 8;  // fp16 row pitch in shared memory: 272 B, conflict-free ldmatrix
constexpr int kCodePitch = kIndexDim + 16;  // a code row's pitch in the cp.async stages: 144 B
constexpr int kChunksPerTile = kTile * kIndexDim / 16;  // 16-byte pieces of a tile's codes

// Warp layout of tag A: 32 rows x 32 positions where the A fragments of 32 rows fit in registers
// (Sm75 / Sm80 ldmatrix fragments, 4 registers per 16x16), 16 rows x 64 positions on Volta (8).
template <class A>
struct Layout {
  static constexpr int kWarpRows = A::kArch == Arch::kSm70 ? 16 : 32;
  static constexpr int kWarpsM = kRows / kWarpRows;
  static constexpr int kWarpsN = kWarps / kWarpsM;
  static constexpr int kWarpCols = kTile / kWarpsN;
  static constexpr int kTilesM = kWarpRows / 16;
  static constexpr int kTilesN = kWarpCols / 16;
  static constexpr bool kCpAsync = A::kMinCudaArch >= 800;
};

template <bool kCpAsync>
struct Smem {
  alignas(16) __half keys[kTile * kPitch];  // the tile's keys in fp16; q before the main loop
  alignas(16) uint8_t codes[kCpAsync ? 2 : 1][kTile * kCodePitch];  // cp.async stages of the raw codes
  float key_scale[2][kTile];
  float row_sums[2][kRows / 16][kTile];  // per 16-row tile and position, by tile parity
  float row_weight[kRows];
};

__device__ __forceinline__ float pow2(int e) { return __uint_as_float(uint32_t(e + 127) << 23); }

// The fp16 factor of a bf16 row with this amax: 2^(14 - floor(log2 amax)), 1 for a zero row.
__device__ __forceinline__ float bf16_row_factor(float amax) {
  if (!(amax > 0.f) || !(amax < INFINITY)) return 1.f;
  const int e = int((__float_as_uint(amax) >> 23) & 0xFF) - 127;  // subnormal amax: as 2^-127
  return pow2(max(-126, min(127, 14 - e)));
}

template <class A, int kQ>
__global__ void __launch_bounds__(kThreads) index_scores_kernel(const IndexScoresParams p, const IndexCache cache,
                                                               int tiles_per_cta, int groups) {
  if constexpr (arch::target_supports<A>()) {
    using L = Layout<A>;
    using Mma = arch::WarpMma16<A, __half>;
    constexpr int kK = 16;  // the contraction of one Mma tile
    __shared__ Smem<L::kCpAsync> s;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int warp_m = warp / L::kWarpsN, warp_n = warp % L::kWarpsN;
    const int b = blockIdx.y;
    const int group = blockIdx.x % groups, chunk = blockIdx.x / groups;
    const int tokens_per_cta = kRows / p.heads;
    const int q_begin = p.cu_q_lens ? p.cu_q_lens[b] : b;
    const int q_len = p.cu_q_lens ? p.cu_q_lens[b + 1] - q_begin : 1;
    const int first = group * tokens_per_cta;  // of the sequence's tokens
    if (first >= q_len) return;
    const int tokens = min(tokens_per_cta, q_len - first);
    const int kv_len = p.kv_lens[b];
    const int64_t pos_of_first = int64_t(kv_len) - q_len + first;  // position of token `first`
    const int64_t visible_end = min(pos_of_first + tokens, int64_t(kv_len));  // past the last token's position
    const int64_t chunk_begin = int64_t(chunk) * tiles_per_cta * kTile;
    const int64_t chunk_end = min(chunk_begin + int64_t(tiles_per_cta) * kTile, p.max_kv_len);
    const int64_t scored_end = min(chunk_end, visible_end);  // positions with a key to score
    float* out0 = p.logits + (q_begin + first) * p.logits_stride;

    // Positions past the scored tiles, which no token of the CTA sees: -inf (the tiles write their own).
    const int tiles = scored_end > chunk_begin ? int((scored_end - chunk_begin + kTile - 1) / kTile) : 0;
    for (int64_t col = chunk_begin + int64_t(tiles) * kTile + tid; col < chunk_end; col += kThreads) {
      for (int j = 0; j < tokens; ++j) out0[j * p.logits_stride + col] = -INFINITY;
    }
    if (tiles == 0) return;

    // q rows -> fp16 at their A-operand rows, with the factor folded into the row's weight. Two threads per
    // row (64 dims each); rows past the CTA's tokens are zero with weight 0.
    {
      const int r = tid >> 1, half = tid & 1;
      const int j = r / p.heads, h = r - j * p.heads;
      const bool live = j < tokens;
      const int64_t t = q_begin + first + j;
      float v[64];
      if (live) {
        const char* row = static_cast<const char*>(p.q) + (t * p.q_stride_token + int64_t(h) * p.q_stride_head) *
                                                          (kQ == kQE4m3 ? 1 : 2);
        if constexpr (kQ == kQE4m3) {
          const uint4* src = reinterpret_cast<const uint4*>(row + half * 64);
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const uint4 w = src[c];
            const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int i = 0; i < 16; ++i) v[c * 16 + i] = arch::e4m3_to_float((words[i / 4] >> (8 * (i % 4))) & 0xFFu);
          }
        } else {
          using T = std::conditional_t<kQ == kQBf16, __nv_bfloat16, __half>;
          const T* src = reinterpret_cast<const T*>(row) + half * 64;
#pragma unroll
          for (int c = 0; c < 8; ++c) {
            const auto vec = *reinterpret_cast<const arch::Vec<T, 8>*>(src + c * 8);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[c * 8 + i] = arch::to_float(vec.v[i]);
          }
        }
      } else {
#pragma unroll
        for (int i = 0; i < 64; ++i) v[i] = 0.f;
      }
      float factor = 1.f;
      if constexpr (kQ == kQBf16) {
        float amax = 0.f;
#pragma unroll
        for (int i = 0; i < 64; ++i) amax = fmaxf(amax, fabsf(v[i]));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        factor = bf16_row_factor(amax);
      }
      const float inv = kQ == kQBf16 ? 1.f / factor : 1.f;  // exact: a power of two
      __half* dst = s.keys + Mma::a_row(r) * kPitch + half * 64;
#pragma unroll
      for (int i = 0; i < 64; i += 2) {
        *reinterpret_cast<__half2*>(dst + i) = __floats2half2_rn(v[i] * inv, v[i + 1] * inv);
      }
      if (half == 0) {
        float w = 0.f;
        if (live) {
          w = p.weights[t * p.weights_stride + h];
          if constexpr (kQ == kQE4m3) w *= p.q_scale[t * p.heads + h];
          if constexpr (kQ == kQBf16) w *= factor;
        }
        s.row_weight[r] = w;
      }
    }
    __syncthreads();
    typename Mma::FragA qa[L::kTilesM][kIndexDim / kK];
#pragma unroll
    for (int m = 0; m < L::kTilesM; ++m) {
#pragma unroll
      for (int k = 0; k < kIndexDim / kK; ++k) {
        Mma::load_a(qa[m][k], s.keys + (warp_m * L::kWarpRows + m * 16) * kPitch + k * kK, kPitch, lane);
      }
    }
    float weight[L::kTilesM][8];  // of this lane's accumulator rows
#pragma unroll
    for (int m = 0; m < L::kTilesM; ++m) {
#pragma unroll
      for (int i = 0; i < 8; ++i) weight[m][i] = s.row_weight[warp_m * L::kWarpRows + m * 16 + Mma::acc_row(lane, i)];
    }

    // Tile loads: this thread's 16-byte pieces of the codes (piece c = position c / 8, dims (c % 8) * 16..) and,
    // for threads < kTile, one position's scale.
    const int* table = p.block_table + int64_t(b) * p.block_table_stride;
    auto piece_address = [&](int64_t pos, int part) -> const uint8_t* {
      if (pos >= scored_end) return nullptr;
      const int64_t page = table[pos / cache.page_size];
      if (page < 0 || page >= cache.num_blocks) return nullptr;  // no page: a zero key
      const int64_t offset = pos - (pos / cache.page_size) * cache.page_size;
      return static_cast<const uint8_t*>(cache.base) + page * cache.block_stride_bytes + offset * kIndexDim + part * 16;
    };
    auto scale_of = [&](int64_t pos) -> float {
      if (pos >= scored_end) return 0.f;
      const int64_t page = table[pos / cache.page_size];
      if (page < 0 || page >= cache.num_blocks) return 0.f;
      const int64_t offset = pos - (pos / cache.page_size) * cache.page_size;
      const uint8_t* page_base = static_cast<const uint8_t*>(cache.base) + page * cache.block_stride_bytes;
      return __ldg(reinterpret_cast<const float*>(page_base + int64_t(cache.page_size) * kIndexDim + offset * 4));
    };
    constexpr int kPieces = kChunksPerTile / kThreads;  // per thread and tile
    uint4 staged[L::kCpAsync ? 1 : kPieces];
    float next_scale = 0.f;
    auto issue = [&](int tile) MLA_KV_INLINE_LAMBDA {
      const int64_t base = chunk_begin + int64_t(tile) * kTile;
#pragma unroll
      for (int i = 0; i < kPieces; ++i) {
        const int c = tid + i * kThreads;
        const uint8_t* src = piece_address(base + c / 8, c % 8);
        if constexpr (L::kCpAsync) {
          arch::cp_async_16(s.codes[tile & 1] + (c / 8) * kCodePitch + (c % 8) * 16, src, src != nullptr);
        } else {
          staged[i] = src ? __ldg(reinterpret_cast<const uint4*>(src)) : make_uint4(0, 0, 0, 0);
        }
      }
      if constexpr (L::kCpAsync) arch::cp_async_commit();
      if (tid < kTile) next_scale = scale_of(base + tid);
    };
    // The landed tile -> fp16 keys; its scales (this thread's, `scale`) -> key_scale[tile & 1].
    auto widen = [&](int tile, float scale) MLA_KV_INLINE_LAMBDA {
#pragma unroll
      for (int i = 0; i < kPieces; ++i) {
        const int c = tid + i * kThreads;
        uint4 w;
        if constexpr (L::kCpAsync) {
          w = *reinterpret_cast<const uint4*>(s.codes[tile & 1] + (c / 8) * kCodePitch + (c % 8) * 16);
        } else {
          w = staged[i];
        }
        uint4 lo, hi;
        arch::e4m3x4_to_halves(w.x, lo.x, lo.y);
        arch::e4m3x4_to_halves(w.y, lo.z, lo.w);
        arch::e4m3x4_to_halves(w.z, hi.x, hi.y);
        arch::e4m3x4_to_halves(w.w, hi.z, hi.w);
        __half* dst = s.keys + (c / 8) * kPitch + (c % 8) * 16;
        *reinterpret_cast<uint4*>(dst) = lo;
        *reinterpret_cast<uint4*>(dst + 8) = hi;
      }
      if (tid < kTile) s.key_scale[tile & 1][tid] = scale;
    };
    // Tile `tile`'s logits from the row sums: token j sums its heads' 16-row tiles.
    auto emit = [&](int tile) MLA_KV_INLINE_LAMBDA {
      const int64_t base = chunk_begin + int64_t(tile) * kTile;
      const int tiles_per_token = p.heads / 16;
      for (int e = tid; e < tokens * kTile; e += kThreads) {
        const int j = e / kTile, n = e - j * kTile;
        const int64_t pos = base + n;
        if (pos >= chunk_end) continue;
        float sum = 0.f;
        for (int m = j * tiles_per_token; m < (j + 1) * tiles_per_token; ++m) sum += s.row_sums[tile & 1][m][n];
        out0[j * p.logits_stride + pos] = pos <= pos_of_first + j ? sum * s.key_scale[tile & 1][n] : -INFINITY;
      }
    };

    // Per tile: two barriers. A: the tile's codes have landed (and the last tile's row sums are complete);
    // B: its fp16 keys are written. The previous tile's logits go out after A, while this
    // one is widened; the next tile's loads start before the widening (cp.async) or after it (registers
    // it frees).
    issue(0);
    for (int tile = 0; tile < tiles; ++tile) {
      if constexpr (L::kCpAsync) arch::cp_async_wait<0>();
      __syncthreads();  // A
      if (tile > 0) emit(tile - 1);
      const float scale = next_scale;
      if constexpr (L::kCpAsync) {
        if (tile + 1 < tiles) issue(tile + 1);
        widen(tile, scale);
      } else {
        widen(tile, scale);
        if (tile + 1 < tiles) issue(tile + 1);
      }
      __syncthreads();  // B
      float acc[L::kTilesM][L::kTilesN][8] = {};
#pragma unroll
      for (int k = 0; k < kIndexDim / kK; ++k) {
#pragma unroll
        for (int n = 0; n < L::kTilesN; ++n) {
          typename Mma::FragB kb;
          Mma::load_b_nk(kb, s.keys + (warp_n * L::kWarpCols + n * 16) * kPitch + k * kK, kPitch, lane);
#pragma unroll
          for (int m = 0; m < L::kTilesM; ++m) Mma::mma(acc[m][n], qa[m][k], kb);
        }
      }
      // relu, the rows' weights, then the sum over each 16-row tile: in the lane (elements i, i | 2), then
      // across the lanes that hold the other rows of the same columns.
#pragma unroll
      for (int m = 0; m < L::kTilesM; ++m) {
#pragma unroll
        for (int n = 0; n < L::kTilesN; ++n) {
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            if (i & 2) continue;
            float v = fmaxf(acc[m][n][i], 0.f) * weight[m][i] + fmaxf(acc[m][n][i | 2], 0.f) * weight[m][i | 2];
#pragma unroll
            for (int bit = 1; bit < 32; bit <<= 1) {
              if (Mma::kAccRowLanes & bit) v += __shfl_xor_sync(0xffffffffu, v, bit);
            }
            if ((lane & Mma::kAccRowLanes) == 0) {
              s.row_sums[tile & 1][warp_m * L::kTilesM + m][warp_n * L::kWarpCols + n * 16 + Mma::acc_col(lane, i)] = v;
            }
          }
        }
      }
    }
    __syncthreads();
    emit(tiles - 1);
  }
}

// Grid: x = (position chunk, token group) with the groups of one chunk adjacent, so that they read the
// chunk's keys from L2 after the first; y = sequence.
template <class A, int kQ>
Status launch_index_scores(const IndexScoresParams& p, const IndexCache& cache, int tiles_per_cta,
                           cudaStream_t stream) {
  const int tokens_per_cta = kRows / p.heads;
  const int64_t groups = (p.max_q_len + tokens_per_cta - 1) / tokens_per_cta;
  const int64_t chunk = int64_t(tiles_per_cta) * kTile;
  const int64_t ctas = (p.max_kv_len + chunk - 1) / chunk * groups;
  if (ctas > INT32_MAX || p.batch > 65535) return Status::kInvalidArgument;
  index_scores_kernel<A, kQ><<<dim3(unsigned(ctas), unsigned(p.batch)), kThreads, 0, stream>>>(
      p, cache, tiles_per_cta, int(groups));
  return cudaGetLastError() == cudaSuccess ? Status::kOk : Status::kCudaError;
}

}  // namespace index_scores_detail
}  // namespace mla_kv
