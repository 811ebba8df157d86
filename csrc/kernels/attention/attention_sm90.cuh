// Hopper variant of the absorbed MLA attention (attention.cuh has the math and the CTA/work split):
// the two products run on wgmma from shared memory, so the operands no longer pass through
// registers and a CTA of 64 query rows holds its whole 64 x 512 output in two warpgroups'
// registers (128 fp32 each per thread).
//
// Per 64-token tile: warpgroup g computes the scores of tile tokens 32 g .. 32 g + 31 for all 64
// rows (S_g = Q . K_g^T, 36 k steps of m64n32k16); the two halves exchange their row maxima through
// shared memory; each writes its half of P; then warpgroup g accumulates output columns
// 256 g .. 256 g + 255 (O_g += P . V_g, 4 k steps of m64n256k16, V read in place from the tile as an
// MN-major operand). Q, the two tile stages and P are kept in the 128-byte swizzled layout wgmma
// reads (arch/wgmma.cuh). Tiles arrive by cp.async, one tile ahead of the math.
#pragma once

#include "../arch/wgmma.cuh"
#include "attention.cuh"

namespace mla_kv {
namespace attention_detail {
namespace sm90 {

constexpr int kRows = 64;                         // query rows per CTA: one wgmma M
constexpr int kTokens = 64;                       // cache rows per tile
constexpr int kThreads = 256;                     // two warpgroups
constexpr int kChunks = kRowDim / 64;             // 64-column chunks of a 576-wide row
constexpr int kChunkBytes = 64 * arch::kSwizzleRowBytes;  // one chunk of 64 rows
constexpr int kTileBytes = kChunks * kChunkBytes;          // 64 rows x 576 (Q or one tile)
constexpr int kStages = 2;
constexpr int kVecsPerTile = kTokens * kVecsPerRow;        // 16-byte vectors of a tile
constexpr int kVecsPerThread = kVecsPerTile / kThreads;    // 18
constexpr int kTokensPerWarp = kTokens / (kThreads / 32);  // 8
constexpr int kScoreCols = kTokens / 2;                    // tile tokens per warpgroup
constexpr int kOutCols = kLatentDim / 2;                   // output columns per warpgroup
static_assert(kVecsPerTile % kThreads == 0 && (kVecsPerThread * 32) % kVecsPerRow == 0, "tile load");

// Shared memory (offsets from a 1024-byte aligned base: swizzle atoms must start on one).
constexpr size_t kQOffset = 0;
constexpr size_t kKvOffset = kTileBytes;
constexpr size_t kProbOffset = kKvOffset + size_t(kStages) * kTileBytes;
constexpr size_t kStatsOffset = kProbOffset + kRows * arch::kSwizzleRowBytes;
constexpr size_t kBytes = kStatsOffset + 2 * 2 * kRows * sizeof(float) + arch::kSwizzleAtomBytes;
static_assert(kBytes <= 227 * 1024, "Hopper's shared memory per CTA");

template <class T, class Rows>
__global__ void __launch_bounds__(kThreads, 1) attention_wgmma_kernel(const AttentionParams p, const Rows rows) {
  if constexpr (arch::target_supports<arch::Sm90>()) {
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = reinterpret_cast<unsigned char*>(
        (reinterpret_cast<uintptr_t>(smem_raw) + arch::kSwizzleAtomBytes - 1) & ~uintptr_t(arch::kSwizzleAtomBytes - 1));
    unsigned char* q_s = smem + kQOffset;
    unsigned char* kv_s = smem + kKvOffset;
    unsigned char* prob_s = smem + kProbOffset;
    float* max_s = reinterpret_cast<float*>(smem + kStatsOffset);  // [2][kRows]: tile max per half
    float* sum_s = max_s + 2 * kRows;                               // [2][kRows]: row sums per half

    Work w;
    if (!find_work<kRows>(p, w)) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // Warpgroup index, broadcast from lane 0 so that the compiler knows it is warp-uniform: the wgmma
    // descriptors derived from it then stay in uniform registers (otherwise each of the 36 score
    // wgmma waits for its descriptor to be rebuilt in vector registers and moved over).
    const int group = __shfl_sync(0xffffffffu, warp / 4, 0);
    const int rows_here = min(kRows, w.q_len * p.num_heads - w.row0);

    // Q rows -> swizzled smem (zero rows past the sequence's last row).
    for (int v = tid; v < kRows * kVecsPerRow; v += kThreads) {
      const int r = v / kVecsPerRow, c = v - r * kVecsPerRow;
      *reinterpret_cast<int4*>(q_s + (c / 8) * kChunkBytes + arch::swizzled_offset(r, c % 8)) =
          q_vector<T>(p, w, r, c, rows_here);
    }

    // Tile loads: lane t < 8 of warp w finds the address of tile row 8 w + t one tile ahead; the
    // warp's 8 rows x 72 vectors are then spread over its lanes (18 each), the row address taken by
    // shuffle, each vector placed at its canonical column in the swizzled tile.
    const char* next_row = nullptr;
    auto lookup = [&](int j0) {
      const int pos = j0 + warp * kTokensPerWarp + lane;
      const char* base = (lane < kTokensPerWarp && pos < w.kv_hi) ? rows.block_base(w.b, pos) : nullptr;
      next_row = base ? rows.row_in_block(base, pos) : nullptr;
    };
    auto issue = [&](int stage) {
      unsigned char* dst0 = kv_s + stage * kTileBytes;
#pragma unroll
      for (int k = 0; k < kVecsPerThread; ++k) {
        const int idx = k * 32 + lane, t = idx / kVecsPerRow, v = idx - t * kVecsPerRow;
        const auto bits = __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(next_row), t);
        const T* src = reinterpret_cast<const T*>(bits);
        const int col = canonical_column(rows.cache.row, v * 8), token = warp * kTokensPerWarp + t;
        arch::cp_async_16(dst0 + (col / 64) * kChunkBytes + arch::swizzled_offset(token, (col / 8) % 8),
                          src ? src + v * 8 : static_cast<const T*>(p.q), src != nullptr);
      }
    };

    // This thread's two rows (of the accumulator layout) and their visible kv limits.
    const int row_of[2] = {16 * (warp % 4) + lane / 4, 16 * (warp % 4) + lane / 4 + 8};
    int row_limit[2];
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      row_limit[hh] = -1;
      if (row_of[hh] < rows_here) {
        const int s = (w.row0 + row_of[hh]) / p.num_heads;
        row_limit[hh] = min(w.kv_hi, p.causal ? w.kv_len - w.q_len + s + 1 : w.kv_len);
      }
    }
    const float scale_log2 = p.softmax_scale * kLog2e;

    using Qk = arch::Wgmma<T, kScoreCols, false>;
    using Pv = arch::Wgmma<T, kOutCols, true>;
    float acc[kOutCols / 2];
#pragma unroll
    for (int i = 0; i < kOutCols / 2; ++i) acc[i] = 0.f;
    const uint64_t q_desc = arch::swizzled_desc(q_s, 16, arch::kSwizzleAtomBytes);
    const uint64_t prob_desc = arch::swizzled_desc(prob_s, 16, arch::kSwizzleAtomBytes);

    lookup(w.kv_lo);
#pragma unroll
    for (int t = 0; t < kStages; ++t) {
      issue(t);
      arch::cp_async_commit();
      lookup(w.kv_lo + (t + 1) * kTokens);
    }
    int stage = 0;
    for (int j0 = w.kv_lo; j0 < w.kv_hi; j0 += kTokens) {
      arch::cp_async_wait<kStages - 1>();
      arch::fence_proxy_async();
      __syncthreads();  // this tile (and, first time, Q) visible to the tensor cores

      const unsigned char* tile = kv_s + stage * kTileBytes;
      float sc[kScoreCols / 2];
      {  // S_g = Q . K_g^T over the 576-wide rows
        const uint64_t k_desc = arch::swizzled_desc(tile + group * kScoreCols * arch::kSwizzleRowBytes, 16,
                                                    arch::kSwizzleAtomBytes);
        arch::wgmma_fence();
#pragma unroll
        for (int k = 0; k < kRowDim / 16; ++k) {
          const uint32_t off = (k / 4) * kChunkBytes + (k % 4) * 32;
          Qk::mma(sc, arch::desc_advance(q_desc, off), arch::desc_advance(k_desc, off), k > 0);
        }
        arch::wgmma_commit();
        arch::wgmma_wait<0>();
        arch::pin_registers(sc);
      }

      // Online softmax (log2 domain), as in attention.cuh: the running max moves only when a tile
      // beats it by more than kRescaleLog2. Row maxima of the two token halves meet in max_s.
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < kScoreCols / 8; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int pos = j0 + group * kScoreCols + 8 * j + 2 * (lane % 4) + e;
            float& x = sc[4 * j + 2 * hh + e];
            x = pos < row_limit[hh] ? x * scale_log2 : -INFINITY;
            tile_max[hh] = fmaxf(tile_max[hh], x);
          }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        tile_max[hh] = fmaxf(tile_max[hh], __shfl_xor_sync(0xffffffffu, tile_max[hh], 1));
        tile_max[hh] = fmaxf(tile_max[hh], __shfl_xor_sync(0xffffffffu, tile_max[hh], 2));
        if (lane % 4 == 0) max_s[group * kRows + row_of[hh]] = tile_max[hh];
      }
      __syncthreads();
      float alpha[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const float m = fmaxf(tile_max[hh], max_s[(group ^ 1) * kRows + row_of[hh]]);
        const float new_max = m > row_max[hh] + kRescaleLog2 ? m : row_max[hh];
        alpha[hh] = new_max == row_max[hh] ? 1.f : exp2f(row_max[hh] - new_max);
        row_max[hh] = new_max;
        row_sum[hh] *= alpha[hh];
      }
#pragma unroll
      for (int j = 0; j < kScoreCols / 8; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          float pr[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            pr[e] = row_max[hh] == -INFINITY ? 0.f : exp2f(sc[4 * j + 2 * hh + e] - row_max[hh]);
            row_sum[hh] += pr[e];
          }
          arch::Vec<T, 2> pv;
          pv.v[0] = arch::from_float<T>(pr[0]);
          pv.v[1] = arch::from_float<T>(pr[1]);
          const int col = group * kScoreCols + 8 * j + 2 * (lane % 4);  // token within the tile
          arch::store<T, 2>(reinterpret_cast<T*>(prob_s + arch::swizzled_offset(row_of[hh], col / 8)) + col % 8, pv);
        }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        if (alpha[hh] != 1.f) {
#pragma unroll
          for (int j = 0; j < kOutCols / 8; ++j) {
            acc[4 * j + 2 * hh] *= alpha[hh];
            acc[4 * j + 2 * hh + 1] *= alpha[hh];
          }
        }
      arch::fence_proxy_async();
      __syncthreads();  // both halves of P written

      {  // O_g += P . V_g, V_g = tile columns 256 g .. 256 g + 255 read as an MN-major operand
        const uint64_t v_desc = arch::swizzled_desc(tile + group * (kOutCols / 64) * kChunkBytes, kChunkBytes,
                                                    arch::kSwizzleAtomBytes);
        arch::wgmma_fence();
#pragma unroll
        for (int k = 0; k < kTokens / 16; ++k)
          Pv::mma(acc, arch::desc_advance(prob_desc, k * 32),
                  arch::desc_advance(v_desc, k * 16 * arch::kSwizzleRowBytes), 1);
        arch::wgmma_commit();
        arch::wgmma_wait<0>();
        arch::pin_registers(acc);
      }
      __syncthreads();  // the stage and P are free
      issue(stage);     // the tile kStages ahead
      arch::cp_async_commit();
      lookup(j0 + (kStages + 1) * kTokens);
      stage ^= 1;
    }
    arch::cp_async_wait<0>();

    // Epilogue: row sums of the two halves meet in sum_s; normalize; write out/lse or the partial.
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      row_sum[hh] += __shfl_xor_sync(0xffffffffu, row_sum[hh], 1);
      row_sum[hh] += __shfl_xor_sync(0xffffffffu, row_sum[hh], 2);
      if (lane % 4 == 0) sum_s[group * kRows + row_of[hh]] = row_sum[hh];
    }
    __syncthreads();
    const bool split = p.num_splits > 1;
    const int64_t total_rows = p.total_q_tokens * p.num_heads;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = row_of[hh];
      if (r >= rows_here) continue;
      const float l = sum_s[r] + sum_s[kRows + r];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const int row = w.row0 + r, s = row / p.num_heads, h = row - s * p.num_heads;
      const int64_t flat = (w.token_base + s) * p.num_heads + h;
      const int col0 = group * kOutCols + 2 * (lane % 4);
      if (split) {
        float* dst = static_cast<float*>(p.workspace) + (blockIdx.y * total_rows + flat) * kLatentDim + col0;
#pragma unroll
        for (int j = 0; j < kOutCols / 8; ++j)
          *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(acc[4 * j + 2 * hh] * inv, acc[4 * j + 2 * hh + 1] * inv);
      } else {
        T* dst = static_cast<T*>(p.out) + int64_t(w.b) * p.out_stride_b * (p.cu_q_lens == nullptr) +
                 (w.token_base * (p.cu_q_lens != nullptr) + s) * p.out_stride_t + int64_t(h) * p.out_stride_h + col0;
#pragma unroll
        for (int j = 0; j < kOutCols / 8; ++j) {
          arch::Vec<T, 2> v;
          v.v[0] = arch::from_float<T>(acc[4 * j + 2 * hh] * inv);
          v.v[1] = arch::from_float<T>(acc[4 * j + 2 * hh + 1] * inv);
          arch::store<T, 2>(dst + 8 * j, v);
        }
      }
      if (group == 0 && lane % 4 == 0) {
        const float lse = l > 0.f ? (row_max[hh] + log2f(l)) * kLn2 : -INFINITY;
        if (split) {
          float* ws_lse = static_cast<float*>(p.workspace) + size_t(p.num_splits) * total_rows * kLatentDim;
          ws_lse[blockIdx.y * total_rows + flat] = lse;
        } else {
          p.lse[int64_t(w.b) * p.lse_stride_b * (p.cu_q_lens == nullptr) +
                (w.token_base * (p.cu_q_lens != nullptr) + s) * p.lse_stride_t + int64_t(h) * p.lse_stride_h] = lse;
        }
      }
    }
  } else {
    __trap();  // the host never launches a tag the compiled target cannot run
  }
}

}  // namespace sm90

template <class T, class Rows>
Status launch_attention_wgmma(const AttentionParams& p, const Rows& rows, int grid_x, cudaStream_t stream) {
  const auto kernel = sm90::attention_wgmma_kernel<T, Rows>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sm90::kBytes)) != cudaSuccess)
    return Status::kCudaError;
  kernel<<<dim3(grid_x, p.num_splits), sm90::kThreads, sm90::kBytes, stream>>>(p, rows);
  if (cudaPeekAtLastError() != cudaSuccess) return Status::kCudaError;
  return launch_combine<T>(p, stream);
}

}  // namespace attention_detail
}  // namespace mla_kv
