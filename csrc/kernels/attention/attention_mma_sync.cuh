// Absorbed MLA attention over the latent cache, one kernel for decode, multi-token decode and
// prefill. A CTA owns up to kBlockM query rows (row = (query token, head)) of one sequence and one KV
// split. Each KV tile of kBlockN cache rows is read from memory once into shared memory and used by
// all of the CTA's rows for both products, so decode reads the latent once per sequence for all
// heads (up to 64 rows per CTA) instead of once per head.
//
// Per tile: S = Q.K^T (576-d) on tensor cores -> online softmax in fp32 (log2 domain) -> P (in the
// input dtype) -> O += P.V with V = the tile's 512 latent columns. Loads run ahead of the math on
// every arch: a cp.async ring of 2-3 tiles where shared memory allows (Sm80 on an A100), else the
// next tile staged in registers (Volta, which has no cp.async, Turing, and the 99 KB Sm80 GPUs);
// tile_config.h has the configurations.
// Reference: python/mla_kv/reference/attention.py (decode, prefill).
#pragma once

#include "../arch/mma.cuh"
#include "../dequant.cuh"
#include "attention_launch.h"
#include "common.cuh"
#include "tile_config.h"

namespace mla_kv {
namespace attention_detail {

// Configuration kConfig of tag A (tile_config.h), as the kernel's compile-time constants.
//  - kN cache rows per tile: every tile costs four block barriers and a softmax pass whatever its
//    size; the register-staged path and the configurations that fit 99-163 KB take 32.
//  - kStages tiles in flight: a cp.async ring on Sm80+; 1 stages the next tile in registers.
//  - Q.K^T: a warp computes kQkTilesM x kQkTilesN 16x16 score tiles over one of kSplitK slices of
//    the 576-d contraction, which meet in shared memory. Bigger warp tiles reuse each loaded
//    fragment more, more slices cost more partial sums in shared memory.
template <class A, int kConfig>
struct Tiling {
  static constexpr TileConfig kCfg = tile_configs(A::kArch).at[kConfig];
  static_assert(kConfig < tile_configs(A::kArch).count, "no such tile configuration");
  static_assert(kCfg.stages == 1 || A::kMinCudaArch >= 800, "cp.async needs Sm80");
  static_assert(smem_bytes(kCfg) <= size_t(kCfg.meant_for.per_block),
                "the configuration exceeds the shared memory of the GPUs it is meant for");
  static constexpr int kBlockM = kCfg.block_m;
  static constexpr int kN = kCfg.block_n;
  static constexpr int kStages = kCfg.stages;
  static constexpr bool kProbsInScores = kCfg.probs_in_scores;
  static constexpr int kCtasPerSm = kCfg.max_ctas_per_sm;
  static constexpr int kTilesM = kBlockM / 16;
  static constexpr int kQkTilesM = qk_tiles_m(kCfg);
  static constexpr int kQkTilesN = qk_tiles_n(kCfg);
  static constexpr int kQkGroups = qk_groups(kCfg);
  static constexpr int kSplitK = split_k(kCfg);  // warps sharing one group of score tiles
  static constexpr int kScorePitch = score_pitch(kCfg);
  static constexpr int kProbPitch = prob_pitch(kCfg);
  static constexpr int kRowsPerWarp = kN / kWarps;  // tile rows a warp loads
  static constexpr SmemParts kSmem = smem_parts(kCfg);
};

// kFormat: the cache rows' format (layout.h). A quantized tile is staged in registers as read (its
// bytes) and dequantized into T as it is stored to shared memory, so the tensor-core loop is the
// 16-bit one; quantized launches take the register-staged configurations only.
template <class A, class T, int kConfig, class Rows, KvFormat kFormat>
__global__ void __launch_bounds__(kThreads, (Tiling<A, kConfig>::kCtasPerSm)) attention_kernel(const AttentionParams p, const Rows rows) {
  if constexpr (arch::target_supports<A>()) {
    using C = Tiling<A, kConfig>;
    constexpr SmemParts L = C::kSmem;
    constexpr bool kQuant = kFormat != KvFormat::kNone, kTrailer = kFormat == KvFormat::kInt8 || kFormat == KvFormat::kInt4;
    static_assert(!kQuant || C::kStages == 1, "a quantized tile is dequantized from registers");
    static_assert(!C::kProbsInScores || A::kArch != Arch::kSm70, "P over the partials needs a_row(r) == r");
    constexpr int kBlockM = C::kBlockM, kBlockN = C::kN, kStages = C::kStages, kRowsPerWarp = C::kRowsPerWarp;
    constexpr int kScorePitch = C::kScorePitch, kProbPitch = C::kProbPitch;
    using Mma = arch::WarpMma16<A, T>;
    extern __shared__ __align__(16) unsigned char smem[];
    T* q_s = reinterpret_cast<T*>(smem);
    T* kv_s = reinterpret_cast<T*>(smem + L.q);
    float* score_s = reinterpret_cast<float*>(smem + L.q + L.kv);
    T* prob_s = reinterpret_cast<T*>(smem + L.q + L.kv + (C::kProbsInScores ? 0 : L.scores));
    float* alpha_s = reinterpret_cast<float*>(smem + L.q + L.kv + L.scores + L.probs);
    float* max_s = alpha_s + kBlockM;
    float* sum_s = max_s + kBlockM;

    Work w;
    if (!find_work<kBlockM>(p, rows, w)) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int rows_here = min(kBlockM, w.q_len * p.num_heads - w.row0);

    // Q rows -> smem at their A-operand rows (mma.cuh), zero rows past the sequence's last row.
    for (int v = tid; v < kBlockM * kVecsPerRow; v += kThreads) {
      const int r = v / kVecsPerRow, c = v - r * kVecsPerRow;
      *reinterpret_cast<int4*>(q_s + Mma::a_row(r) * kPitch + c * 8) = q_vector<T>(p, w, r, c, rows_here);
    }

    // Tile loads: lane r finds the addresses of tile rows r (and r + 32 in 64-row tiles), one
    // block-table read each, one tile before the data is requested; warp w then moves rows w, w + 8,
    // ..., each lane up to kVecsPerLane 16-byte vectors of a row, taking the row address by shuffle.
    constexpr int kLookups = kBlockN / 32;  // tile rows whose address a lane finds (1 or 2)
    static_assert(kLookups == 1 || kLookups == 2, "tile rows");
    const char* next_row[kLookups];
    const char* next_pair[kLookups];  // int8 / int4: the row's (scale, zero) in its block's trailer
    // Rows that mask missing rows (sparse indices): which of a tile's rows exist, one bit each, for
    // the softmax. Kept in the epilogue's max_s during the main loop, in 4 slots by tile number: a
    // tile's bits are written when its copy is issued (at most 3 tiles ahead) and read in its softmax.
    constexpr bool kMasks = Rows::kMasksMissing;
    uint32_t next_valid[kLookups];
    int next_tile = 0;  // the tile number of next_row
    uint32_t* valid_s = reinterpret_cast<uint32_t*>(max_s);
    static_assert(!kMasks || 4 * kLookups <= kBlockM, "the tile bits' slots fit in max_s");
    auto lookup = [&](int j0) {
      next_tile = (j0 - w.kv_lo) / kBlockN;
#pragma unroll
      for (int i = 0; i < kLookups; ++i) {
        const int pos = j0 + 32 * i + lane;
        RowRef ref{nullptr, 0};
        if (pos < w.kv_hi) ref = rows.locate(w.b, pos);
        next_row[i] = row_at(rows, ref);
        if constexpr (kTrailer) next_pair[i] = ref.block ? trailer_at(rows, ref) : nullptr;
        if constexpr (kMasks) next_valid[i] = __ballot_sync(0xffffffffu, ref.block != nullptr);
      }
    };
    int col_of[kVecsPerLane];  // where this lane's vectors go in a canonical smem row
#pragma unroll
    for (int v = 0; v < kVecsPerLane; ++v) {
      const int c = lane + 32 * v;
      col_of[v] = c < kVecsPerRow ? canonical_column(rows.cache.row, c * 8) : -1;
    }
    // Whether this lane has vector v of a row: a compile-time yes below the partial last pass, which
    // spares the register path's tile moves a divergent branch per vector.
    auto has_vec = [&](int v) { return 32 * (v + 1) <= kVecsPerRow || col_of[v] >= 0; };
    constexpr int kStageElems = kBlockN * kPitch;
    int4 staged[kQuant ? 1 : kRowsPerWarp][kVecsPerLane];  // register path, 16-bit rows
    dequant::Raw8<kFormat> raw[kQuant ? kRowsPerWarp : 1][kVecsPerLane];  // quantized rows' bytes
    float2 row_scales[kQuant ? kRowsPerWarp : 1];  // int8 / int4: (scale, zero); fp8_ds_mla: vectors 0, 1's tile scales
    auto issue = [&](int stage) {
      if constexpr (kMasks) {  // (tiles past the range are never read: their slots stay untouched)
        if (tid == 0 && w.kv_lo + next_tile * kBlockN < w.kv_hi) {
#pragma unroll
          for (int i = 0; i < kLookups; ++i) valid_s[(next_tile & 3) * kLookups + i] = next_valid[i];
        }
      }
#pragma unroll
      for (int k = 0; k < kRowsPerWarp; ++k) {
        const int r = warp + k * kWarps;
        const char* owner = next_row[0];  // (selected, not indexed: keeps next_row in registers)
        if (kLookups > 1 && r >= 32) owner = next_row[kLookups - 1];
        const auto row_bits = reinterpret_cast<unsigned long long>(owner);
        const T* src = reinterpret_cast<const T*>(__shfl_sync(0xffffffffu, row_bits, r % 32));
        if constexpr (kQuant) {
          const char* row = reinterpret_cast<const char*>(src);
          if constexpr (kTrailer) {
            const char* pair = next_pair[0];
            if (kLookups > 1 && r >= 32) pair = next_pair[kLookups - 1];
            pair = reinterpret_cast<const char*>(
                __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(pair), r % 32));
            row_scales[k] = row ? dequant::scale_zero<T>(__ldg(reinterpret_cast<const unsigned*>(pair))) : float2{};
          } else if constexpr (kFormat == KvFormat::kFp8DsMla) {
            row_scales[k] = row ? make_float2(dequant::ds_tile_scale(row, lane * 8), dequant::ds_tile_scale(row, (32 + lane) * 8))
                                : float2{};
          }
#pragma unroll
          for (int v = 0; v < kVecsPerLane; ++v) {
            raw[k][v] = dequant::Raw8<kFormat>{};
            if (has_vec(v) && row) raw[k][v] = dequant::load8<kFormat>(row, (lane + 32 * v) * 8);
          }
        } else {
#pragma unroll
          for (int v = 0; v < kVecsPerLane; ++v) {
            if (!has_vec(v)) continue;
            if constexpr (kStages > 1) {
              arch::cp_async_16(kv_s + stage * kStageElems + r * kPitch + col_of[v],
                                src ? src + (lane + 32 * v) * 8 : static_cast<const T*>(p.q), src != nullptr);
            } else {
              staged[k][v] = make_int4(0, 0, 0, 0);
              if (src) {
                const arch::Vec<T, 8> x = arch::load_stream<A, T, 8>(src + (lane + 32 * v) * 8);
                staged[k][v] = *reinterpret_cast<const int4*>(&x);
              }
            }
          }
        }
      }
    };
    auto stash = [&]() MLA_KV_INLINE_LAMBDA {  // register path: staged tile -> smem
#pragma unroll
      for (int k = 0; k < kRowsPerWarp; ++k)
#pragma unroll
        for (int v = 0; v < kVecsPerLane; ++v) {
          if (!has_vec(v)) continue;
          T* dst = kv_s + (warp + k * kWarps) * kPitch + col_of[v];
          if constexpr (kQuant) {
            float scale = rows.cache.row.kv_scale, zero = 0.f;
            if constexpr (kTrailer) {
              scale = row_scales[k].x;
              zero = row_scales[k].y;
            } else if constexpr (kFormat == KvFormat::kFp8DsMla) {
              scale = v == 0 ? row_scales[k].x : row_scales[k].y;
            }
            float values[8];
            dequant::values8<A, kFormat>(raw[k][v], col_of[v] >= kLatentDim, scale, zero, values);
            arch::store<T, 8>(dst, dequant::to_vec<T>(values));
          } else {
            *reinterpret_cast<int4*>(dst) = staged[k][v];
          }
        }
    };

    // Softmax ownership: consecutive lanes share a row (common.cuh ScoreTiles).
    using Scores = ScoreTiles<kThreads, kBlockM, kBlockN, C::kSplitK, kScorePitch, kProbPitch>;
    const int my_row = Scores::row_of(tid), my_col0 = Scores::col0_of(tid);
    const int row_limit = kv_limit(p, w, my_row, rows_here);  // kv positions < row_limit are visible
    float row_max = -INFINITY, row_sum = 0.f;
    const float scale_log2 = p.softmax_scale * kLog2e;

    // Output accumulators: warp owns 64 latent columns of every row.
    constexpr int kTilesN = kLatentDim / kWarps / 16;  // 4
    float acc[C::kTilesM][kTilesN][8];
#pragma unroll
    for (int mt = 0; mt < C::kTilesM; ++mt)
#pragma unroll
      for (int nt = 0; nt < kTilesN; ++nt)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[mt][nt][i] = 0.f;

    // Score tiles owned by this warp in Q.K^T, and its slice of the 576-d contraction.
    constexpr int kGroupsN = kBlockN / 16 / C::kQkTilesN;
    const int group = warp % C::kQkGroups, ks = warp / C::kQkGroups;
    const int st_m = (group / kGroupsN) * C::kQkTilesM * 16, st_n = (group % kGroupsN) * C::kQkTilesN * 16;
    constexpr int kKSlice = kRowDim / C::kSplitK;

    // Prologue: tiles 0 .. kStages-1 requested (or staged), bases of the next one looked up.
    int stage = 0;
#pragma unroll
    for (int t = 0; t < kStages; ++t) {
      lookup(w.kv_lo + t * kBlockN);
      issue(t);
      if constexpr (kStages > 1) arch::cp_async_commit();
    }
    lookup(w.kv_lo + kStages * kBlockN);
    for (int j0 = w.kv_lo; j0 < w.kv_hi; j0 += kBlockN) {
      if constexpr (kStages > 1) {
        arch::cp_async_wait<kStages - 1>();
      } else {
        stash();
      }
      __syncthreads();  // this tile (and, first time, q) visible to all warps
      const T* kv_tile = kv_s + stage * kStageElems;
      if constexpr (kStages == 1) {
        issue(0);  // the next tile, into registers while this one is computed
        lookup(j0 + 2 * kBlockN);
      }

      // S = Q.K^T partial over this warp's k slice (common.cuh).
      qk_partial_scores<Mma, C::kQkTilesM, C::kQkTilesN, kKSlice, kPitch, kScorePitch>(
          q_s + st_m * kPitch + ks * kKSlice, kv_tile + st_n * kPitch + ks * kKSlice,
          score_s + ks * kBlockM * kScorePitch, st_m, st_n, lane);
      __syncthreads();

      // Online softmax of my row's columns, then O = O * alpha + P.V (common.cuh).
      uint32_t valid = ~0u;  // which of this thread's columns' rows exist, from bit my_col0 % 32 (they share a word)
      if constexpr (kMasks)
        valid = valid_s[(((j0 - w.kv_lo) / kBlockN) & 3) * kLookups + my_col0 / 32] >> (my_col0 % 32);
      const bool rescale = online_softmax_tile<Scores, Mma, C::kProbsInScores>(
          score_s, prob_s, alpha_s, my_row, my_col0, scale_log2, j0, row_limit, valid, row_max, row_sum);
      accumulate_pv<Scores, Mma, kPitch>(acc, rescale, alpha_s, prob_s, kv_tile, warp * (kLatentDim / kWarps), lane);
      __syncthreads();  // this stage and prob_s are rewritten next
      if constexpr (kStages > 1) {  // refill the stage just consumed with the tile kStages ahead
        issue(stage);
        arch::cp_async_commit();
        lookup(j0 + (kStages + 1) * kBlockN);
        stage = stage + 1 == kStages ? 0 : stage + 1;
      }
    }
    if constexpr (kStages > 1) arch::cp_async_wait<0>();

    // Epilogue: normalize, then write out/lse (one split) or the partial state (several).
    if (my_col0 == 0) {
      max_s[my_row] = row_max;
      sum_s[my_row] = row_sum;
    }
    __syncthreads();
    const int64_t part0 = partial_row0<kBlockM>(p, w.b, w.row0);
    const bool split = part0 >= 0;
    const int col0 = warp * (kLatentDim / kWarps);
#pragma unroll
    for (int mt = 0; mt < C::kTilesM; ++mt)
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int r = mt * 16 + Mma::acc_row(lane, i);
        if (r >= rows_here) continue;
        const float l = sum_s[r];
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int row = w.row0 + r, s = row / p.num_heads, h = row - s * p.num_heads;
#pragma unroll
        for (int nt = 0; nt < kTilesN; ++nt) {
          const int col = col0 + nt * 16 + Mma::acc_col(lane, i);
          const float o = acc[mt][nt][i] * inv;
          if (split) {
            static_cast<float*>(p.workspace)[(part0 + r) * kLatentDim + col] = o;
          } else {
            T* dst = static_cast<T*>(p.out) + int64_t(w.b) * p.out_stride_b * (p.cu_q_lens == nullptr) +
                     (w.token_base * (p.cu_q_lens != nullptr) + s) * p.out_stride_t + int64_t(h) * p.out_stride_h;
            dst[col] = arch::from_float<T>(o);
          }
        }
      }
    if (tid < rows_here) {
      const float l = sum_s[tid];
      const float lse = l > 0.f ? (max_s[tid] + log2f(l)) * kLn2 : -INFINITY;
      const int row = w.row0 + tid, s = row / p.num_heads, h = row - s * p.num_heads;
      if (split) {
        float* ws_lse = static_cast<float*>(p.workspace) + partial_rows(p) * kLatentDim;
        ws_lse[part0 + tid] = lse;
      } else {
        p.lse[int64_t(w.b) * p.lse_stride_b * (p.cu_q_lens == nullptr) +
              (w.token_base * (p.cu_q_lens != nullptr) + s) * p.lse_stride_t + int64_t(h) * p.lse_stride_h] = lse;
      }
    }
  } else {
    __trap();  // the host never launches a tag the compiled target cannot run
  }
}

// Launches tile configuration `config` of tag A (dispatch chose one that fits the device).
// A quantized cache takes a cp.async ring configuration's register-staged twin (tile_config.h).
template <class A, class T, class Rows, KvFormat kFormat, int kConfig = 0>
Status launch_tiles(const AttentionParams& p, const Rows& rows, int config, int grid_x, cudaStream_t stream) {
  if constexpr (kConfig < tile_configs(A::kArch).count) {
    if (config != kConfig) return launch_tiles<A, T, Rows, kFormat, kConfig + 1>(p, rows, config, grid_x, stream);
    constexpr int kTwin = register_staged_twin(A::kArch, kConfig);
    if constexpr (kFormat != KvFormat::kNone && kTwin != kConfig) {
      return launch_tiles<A, T, Rows, kFormat, kTwin>(p, rows, kTwin, grid_x, stream);
    } else {
      const auto kernel = attention_kernel<A, T, kConfig, Rows, kFormat>;
      constexpr size_t smem = Tiling<A, kConfig>::kSmem.total();
      if (smem > 48 * 1024 &&
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) != cudaSuccess)
        return Status::kCudaError;
      kernel<<<attention_grid(p, grid_x), kThreads, smem, stream>>>(p, rows);
      return cudaPeekAtLastError() == cudaSuccess ? Status::kOk : Status::kCudaError;
    }
  } else {
    return Status::kInvalidArgument;
  }
}

template <class A, class T, class Rows, KvFormat kFormat>
Status launch_attention(const AttentionParams& p, const Rows& rows, int config, int grid_x, cudaStream_t stream) {
  return launch_tiles<A, T, Rows, kFormat>(p, rows, config, grid_x, stream);
}

}  // namespace attention_detail
}  // namespace mla_kv
