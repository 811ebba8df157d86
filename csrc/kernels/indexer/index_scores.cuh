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
// Loads run ahead of the math. On Sm80+ a ring of kStages cp.async slots (a tile's codes and its positions'
// scales) keeps up to kStages tiles in flight, a slot refilled as soon as its tile is widened: enough bytes
// in flight at 4 CTAs per SM that memory latency no longer paces a chunk (the SM's shared-memory traffic and
// issue rate do). Volta / Turing (no cp.async) stage one tile ahead in registers.
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
constexpr int kChunksPerTile = kTile * kIndexDim / 16;  // 16-byte pieces of a tile's codes
// cp.async ring depth. 3 slots (25 KB) keep Smem at 45.5 KB, under the 48 KB static limit, and the CTAs per
// SM where they were: 4 on H100 and 3 on A100 (registers bound both), 2 on sm_86 / sm_89 (100 KB of shared
// memory). A 4th slot would need dynamic shared memory and leave sm_86 / sm_89 one CTA per SM.
constexpr int kStages = 3;

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

// The cp.async ring: per slot a tile's raw codes (position-major, 128 B rows) and its positions' scales.
// Volta / Turing have none. A row's 16-byte pieces are stored swizzled, piece j at chunk ring_chunk(pos, j),
// so that both the copies (a lane pair per position, pieces 2i and 2i + 1 at step i: 4 positions per
// quarter warp) and the widening (a quarter warp per position) hit 8 distinct chunks: no bank conflict.
template <bool kCpAsync>
struct Ring {
  alignas(16) uint8_t codes[kStages][kTile * kIndexDim];
  float scales[kStages][kTile];
};
template <>
struct Ring<false> {};

template <bool kCpAsync>
struct Smem : Ring<kCpAsync> {
  alignas(16) __half keys[kTile * kPitch];  // the tile's keys in fp16; q before the main loop
  float key_scale[2][kTile];  // by tile parity: emit reads a tile's after its ring slot is refilled
  float row_sums[2][kRows / 16][kTile];  // per 16-row tile and position, by tile parity
  float row_weight[kRows];
};

// A 4-byte asynchronous copy (cp.async.cg takes 16 bytes only); a false `valid` writes 4 zero bytes without
// reading `src`.
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(s), "l"(src), "r"(valid ? 4 : 0));
#endif
}

__device__ __forceinline__ int ring_chunk(int pos, int j) { return j ^ ((pos & 3) << 1); }

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

    // Tile loads: position pos's page base and offset in it; false: a zero key (no page, or past scored_end),
    // whose bytes are not read (the page base is then page 0's). In 32 bits: scored_end <= kv_len is an int,
    // page ids are ints. The table is read at min(pos, scored_end - 1), an entry that exists, so that the
    // lookups are unconditional loads that issue together, not a round trip each.
    const int* table = p.block_table + int64_t(b) * p.block_table_stride;
    const unsigned scored = unsigned(scored_end), page_size = unsigned(cache.page_size);
    const unsigned blocks = unsigned(min(cache.num_blocks, int64_t(1) << 31));
    auto page_of = [&](unsigned pos, const uint8_t*& page_base, unsigned& offset) -> bool {
      const unsigned at = min(pos, scored - 1);
      const unsigned slot = at / page_size;
      offset = at - slot * page_size;
      const int page = __ldg(table + slot);
      const bool live = pos < scored && unsigned(page) < blocks;
      page_base = static_cast<const uint8_t*>(cache.base) + int64_t(live ? page : 0) * cache.block_stride_bytes;
      return live;
    };
    auto piece_address = [&](const uint8_t* page_base, unsigned offset, int part) -> const uint8_t* {
      return page_base + size_t(offset) * kIndexDim + part * 16;
    };
    auto scale_address = [&](const uint8_t* page_base, unsigned offset) -> const uint8_t* {
      return page_base + int64_t(cache.page_size) * kIndexDim + offset * 4;
    };
    constexpr int kPieces = kChunksPerTile / kThreads;  // per thread and tile
    uint4 staged[L::kCpAsync ? 1 : kPieces];
    float next_scale = 0.f;
    // cp.async: tile `tile` -> ring slot tile % kStages, one commit group per tile (empty past the chunk's
    // tiles, so that cp_async_wait's count of pending groups is a count of tiles). A lane pair copies one
    // position (the even lane its scale too): one table lookup per thread and tile. Registers: -> staged,
    // by pieces as the widening reads them.
    auto issue = [&](int tile) MLA_KV_INLINE_LAMBDA {  // tile < tiles: base < scored_end, an int
      const unsigned base = unsigned(chunk_begin) + unsigned(tile) * kTile;
      if constexpr (L::kCpAsync) {
        if (tile < tiles) {
          const int slot = tile % kStages, pos = tid / 2;
          const uint8_t* page_base;
          unsigned offset;
          const bool live = page_of(base + pos, page_base, offset);
#pragma unroll
          for (int i = 0; i < kPieces; ++i) {
            const int j = 2 * i + (tid & 1);
            arch::cp_async_16(s.codes[slot] + pos * kIndexDim + ring_chunk(pos, j) * 16,
                              piece_address(page_base, offset, j), live);
          }
          if ((tid & 1) == 0) cp_async_4(&s.scales[slot][pos], scale_address(page_base, offset), live);
        }
        arch::cp_async_commit();
      } else {
#pragma unroll
        for (int i = 0; i < kPieces; ++i) {
          const int c = tid + i * kThreads;
          const uint8_t* page_base;
          unsigned offset;
          const bool live = page_of(base + c / 8, page_base, offset);
          const uint4* src = reinterpret_cast<const uint4*>(piece_address(page_base, offset, c % 8));
          staged[i] = live ? __ldg(src) : make_uint4(0, 0, 0, 0);
        }
        if (tid < kTile) {
          const uint8_t* page_base;
          unsigned offset;
          const bool live = page_of(base + tid, page_base, offset);
          next_scale = live ? __ldg(reinterpret_cast<const float*>(scale_address(page_base, offset))) : 0.f;
        }
      }
    };
    // The ring's first kStages tiles load while q is staged (q goes through s.keys, not the ring).
    if constexpr (L::kCpAsync) {
#pragma unroll
      for (int tile = 0; tile < kStages; ++tile) issue(tile);
    }

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

    // The landed tile -> fp16 keys; its scales (this thread's, `scale`) -> key_scale[tile & 1].
    auto widen = [&](int tile, float scale) MLA_KV_INLINE_LAMBDA {
#pragma unroll
      for (int i = 0; i < kPieces; ++i) {
        const int c = tid + i * kThreads;
        uint4 w;
        if constexpr (L::kCpAsync) {
          const int pos = c / 8;
          w = *reinterpret_cast<const uint4*>(s.codes[tile % kStages] + pos * kIndexDim + ring_chunk(pos, c % 8) * 16);
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
    // B: its fp16 keys are written. The previous tile's logits go out after A, while this one is widened.
    // cp.async: B also proves every thread's widen done with the tile's ring slot (its codes and scales,
    // copied to key_scale), so tile + kStages goes into the slot right after B: kStages tiles load during
    // the mma, kStages - 1 during the widen. Registers: the next tile loads after the widen frees `staged`.
    if constexpr (!L::kCpAsync) issue(0);
    for (int tile = 0; tile < tiles; ++tile) {
      if constexpr (L::kCpAsync) arch::cp_async_wait<kStages - 1>();  // tile's group; the later kStages - 1 may pend
      __syncthreads();  // A
      if (tile > 0) emit(tile - 1);
      if constexpr (L::kCpAsync) {
        widen(tile, tid < kTile ? s.scales[tile % kStages][tid] : 0.f);
      } else {
        const float scale = next_scale;
        widen(tile, scale);
        if (tile + 1 < tiles) issue(tile + 1);
      }
      __syncthreads();  // B
      if constexpr (L::kCpAsync) issue(tile + kStages);
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
