// Absorbed MLA attention over the latent cache, one kernel for decode, multi-token decode and
// prefill. A CTA owns up to kBlockM query rows (row = (query token, head)) of one sequence and one KV
// split. Each KV tile of kBlockN cache rows is read from memory once into shared memory and used by
// all of the CTA's rows for both products, so decode reads the latent once per sequence for all
// heads (up to 64 rows per CTA) instead of once per head.
//
// Per tile: S = Q.K^T (576-d) on tensor cores -> online softmax in fp32 (log2 domain) -> P (in the
// input dtype) -> O += P.V with V = the tile's 512 latent columns. Loads run ahead of the math on
// every arch: a cp.async ring of 2-3 tiles on Sm80+, the next tile staged in registers on Volta
// and Turing (Volta has no cp.async).
// Reference: python/mla_kv/reference_attention.py (decode, prefill).
#pragma once

#include <cfloat>
#include <cstdint>

#include "../arch/arch.cuh"
#include "../arch/mma.cuh"
#include "../address.cuh"
#include "mla_kv/attention.h"
#include "tile_config.h"

namespace mla_kv {
namespace attention_detail {

constexpr int kVecsPerRow = kRowDim / 8;    // 16-byte vectors of a 16-bit row
constexpr int kVecsPerLane = (kVecsPerRow + 31) / 32;           // 3 (the last pass is partial)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kRescaleLog2 = 8.f;  // see raised_max

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

// Which sequence, query rows and kv range a CTA owns.
struct Work {
  int b;
  int row0;     // first (token, head) row of the sequence handled by this CTA
  int q_len;    // query tokens of the sequence
  int64_t token_base;  // flat token index of the sequence's first query token
  int kv_len;
  int kv_lo, kv_hi;    // this CTA's kv positions
};

template <int kBlockM>
__device__ __forceinline__ bool find_work(const AttentionParams& p, Work& w) {
  const int bx = blockIdx.x;
  if (p.cu_q_lens == nullptr) {
    const int per_seq = (p.q_len * p.num_heads + kBlockM - 1) / kBlockM;
    w.b = bx / per_seq;
    if (w.b >= p.batch) return false;
    w.row0 = (bx - w.b * per_seq) * kBlockM;
    w.q_len = p.q_len;
    w.token_base = int64_t(w.b) * p.q_len;
  } else {
    // Packed sequences: CTAs are handed out in sequence order, ceil(q_len_b * H / kBlockM) each,
    // last rows first: under a causal mask they see the most keys, and starting the longest CTAs
    // first keeps them out of the tail of the grid.
    int first = 0, b = 0, n = 0;
    for (; b < p.batch; ++b) {
      n = ((p.cu_q_lens[b + 1] - p.cu_q_lens[b]) * p.num_heads + kBlockM - 1) / kBlockM;
      if (bx < first + n) break;
      first += n;
    }
    if (b == p.batch) return false;
    w.b = b;
    w.row0 = (n - 1 - (bx - first)) * kBlockM;
    w.q_len = p.cu_q_lens[b + 1] - p.cu_q_lens[b];
    w.token_base = p.cu_q_lens[b];
  }
  w.kv_len = p.kv_lens[w.b];
  const int last_row = min(w.row0 + kBlockM, w.q_len * p.num_heads) - 1;
  const int visible = p.causal ? w.kv_len - w.q_len + last_row / p.num_heads + 1 : w.kv_len;
  w.kv_lo = blockIdx.y * p.tokens_per_split;
  w.kv_hi = min(min(w.kv_lo + p.tokens_per_split, w.kv_len), visible);
  return true;
}

// The kv positions query row r of the CTA sees: [kv_lo, limit) (causal: up to its own token), -1 for
// rows past the sequence's last row.
__device__ __forceinline__ int kv_limit(const AttentionParams& p, const Work& w, int r, int rows_here) {
  int limit = -1;
  if (r < rows_here) {
    const int s = (w.row0 + r) / p.num_heads;
    limit = min(w.kv_hi, p.causal ? w.kv_len - w.q_len + s + 1 : w.kv_len);
  }
  return limit;
}

// Online softmax in the log2 domain: the running max moves only when a tile beats it by more than
// kRescaleLog2, so P stays below 2^kRescaleLog2 (exact in fp32 sums and in 16-bit P) and most tiles
// skip rescaling O. rescale_factor: what O and the row sum are multiplied by when it moves
// (kFlushDenormals: by arch::exp2_ftz, as the caller's probabilities are).
__device__ __forceinline__ float raised_max(float running, float tile_max) {
  return tile_max > running + kRescaleLog2 ? tile_max : running;
}
template <bool kFlushDenormals = false>
__device__ __forceinline__ float rescale_factor(float old_max, float new_max) {
  if (new_max == old_max) return 1.f;
  return kFlushDenormals ? arch::exp2_ftz(old_max - new_max) : exp2f(old_max - new_max);
}

// The CTA's query row r (nullptr past the sequence's last row, rows_here).
template <class T>
__device__ __forceinline__ const T* q_row(const AttentionParams& p, const Work& w, int r, int rows_here) {
  if (r >= rows_here) return nullptr;
  const int row = w.row0 + r, s = row / p.num_heads, h = row - s * p.num_heads;
  return static_cast<const T*>(p.q) + int64_t(w.b) * p.q_stride_b * (p.cu_q_lens == nullptr) +
         (w.token_base * (p.cu_q_lens != nullptr) + s) * p.q_stride_t + int64_t(h) * p.q_stride_h;
}

// 16-byte vector c of the CTA's query row r (zeros past the sequence's last row).
template <class T>
__device__ __forceinline__ int4 q_vector(const AttentionParams& p, const Work& w, int r, int c, int rows_here) {
  const T* src = q_row<T>(p, w, r, rows_here);
  return src ? *reinterpret_cast<const int4*>(src + c * 8) : make_int4(0, 0, 0, 0);
}

template <class A, class T, int kConfig, class Rows>
__global__ void __launch_bounds__(kThreads, (Tiling<A, kConfig>::kCtasPerSm)) attention_kernel(const AttentionParams p, const Rows rows) {
  if constexpr (arch::target_supports<A>()) {
    using C = Tiling<A, kConfig>;
    constexpr SmemParts L = C::kSmem;
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
    if (!find_work<kBlockM>(p, w)) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int rows_here = min(kBlockM, w.q_len * p.num_heads - w.row0);

    // Q rows -> smem (zero rows past the sequence's last row).
    for (int v = tid; v < kBlockM * kVecsPerRow; v += kThreads) {
      const int r = v / kVecsPerRow, c = v - r * kVecsPerRow;
      *reinterpret_cast<int4*>(q_s + r * kPitch + c * 8) = q_vector<T>(p, w, r, c, rows_here);
    }

    // Tile loads: lane r finds the addresses of tile rows r (and r + 32 in 64-row tiles), one
    // block-table read each, one tile before the data is requested; warp w then moves rows w, w + 8,
    // ..., each lane up to kVecsPerLane 16-byte vectors of a row, taking the row address by shuffle.
    constexpr int kLookups = kBlockN / 32;  // tile rows whose address a lane finds (1 or 2)
    static_assert(kLookups == 1 || kLookups == 2, "tile rows");
    const char* next_row[kLookups];
    auto lookup = [&](int j0) {
#pragma unroll
      for (int i = 0; i < kLookups; ++i) {
        const int pos = j0 + 32 * i + lane;
        const char* base = pos < w.kv_hi ? rows.block_base(w.b, pos) : nullptr;
        next_row[i] = base ? rows.row_in_block(base, pos) : nullptr;
      }
    };
    int col_of[kVecsPerLane];  // where this lane's vectors go in a canonical smem row
#pragma unroll
    for (int v = 0; v < kVecsPerLane; ++v) {
      const int c = lane + 32 * v;
      col_of[v] = c < kVecsPerRow ? canonical_column(rows.cache.row, c * 8) : -1;
    }
    constexpr int kStageElems = kBlockN * kPitch;
    int4 staged[kRowsPerWarp][kVecsPerLane];  // register path only
    auto issue = [&](int stage) {
#pragma unroll
      for (int k = 0; k < kRowsPerWarp; ++k) {
        const int r = warp + k * kWarps;
        const char* owner = next_row[0];  // (selected, not indexed: keeps next_row in registers)
        if (kLookups > 1 && r >= 32) owner = next_row[kLookups - 1];
        const auto row_bits = reinterpret_cast<unsigned long long>(owner);
        const T* src = reinterpret_cast<const T*>(__shfl_sync(0xffffffffu, row_bits, r % 32));
#pragma unroll
        for (int v = 0; v < kVecsPerLane; ++v) {
          if (col_of[v] < 0) continue;
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
    };
    auto stash = [&]() {  // register path: staged tile -> smem
#pragma unroll
      for (int k = 0; k < kRowsPerWarp; ++k)
#pragma unroll
        for (int v = 0; v < kVecsPerLane; ++v) {
          if (col_of[v] >= 0) *reinterpret_cast<int4*>(kv_s + (warp + k * kWarps) * kPitch + col_of[v]) = staged[k][v];
        }
    };

    // Softmax ownership: consecutive lanes share a row.
    constexpr int kRowThreads = kThreads / kBlockM;
    constexpr int kRowCols = kBlockN / kRowThreads;
    constexpr int kScoreVec = kRowCols < 4 ? kRowCols : 4;  // floats per shared-memory read
    const int my_row = tid / kRowThreads, my_col0 = (tid % kRowThreads) * kRowCols;
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

      {  // S = Q.K^T partial over this warp's k slice; the next step's fragments load during this
         // step's mma (two fragment buffers, resolved at compile time by the full unroll)
        // A one-tile warp keeps two accumulator sets (even and odd k steps): half as long chains of
        // dependent mma. Bigger warp tiles have independent chains already.
        constexpr int kAccSets = C::kQkTilesM * C::kQkTilesN == 1 ? 2 : 1;
        float s_acc[kAccSets][C::kQkTilesM][C::kQkTilesN][8] = {};
        typename Mma::FragA qa[2][C::kQkTilesM];
        typename Mma::FragB kb[2][C::kQkTilesN];
        const T* q_slice = q_s + st_m * kPitch + ks * kKSlice;
        const T* k_slice = kv_tile + st_n * kPitch + ks * kKSlice;
        auto load = [&](int buf, int k) {
#pragma unroll
          for (int i = 0; i < C::kQkTilesM; ++i) Mma::load_a(qa[buf][i], q_slice + 16 * i * kPitch + k, kPitch, lane);
#pragma unroll
          for (int j = 0; j < C::kQkTilesN; ++j) Mma::load_b_nk(kb[buf][j], k_slice + 16 * j * kPitch + k, kPitch, lane);
        };
        load(0, 0);
#pragma unroll
        for (int k = 0; k < kKSlice; k += 16) {
          const int buf = (k / 16) & 1;
          if (k + 16 < kKSlice) load(buf ^ 1, k + 16);
#pragma unroll
          for (int i = 0; i < C::kQkTilesM; ++i)
#pragma unroll
            for (int j = 0; j < C::kQkTilesN; ++j) Mma::mma(s_acc[buf % kAccSets][i][j], qa[buf][i], kb[buf][j]);
        }
        float* out_s = score_s + ks * kBlockM * kScorePitch;
#pragma unroll
        for (int i = 0; i < C::kQkTilesM; ++i)
#pragma unroll
          for (int j = 0; j < C::kQkTilesN; ++j)
#pragma unroll
            for (int e = 0; e < 8; ++e)
              out_s[(st_m + 16 * i + Mma::acc_row(lane, e)) * kScorePitch + st_n + 16 * j + Mma::acc_col(lane, e)] =
                  s_acc[0][i][j][e] + (kAccSets > 1 ? s_acc[kAccSets - 1][i][j][e] : 0.f);
      }
      __syncthreads();

      bool rescale;
      {  // online softmax of my row's columns (partials read and P written as vectors)
        float sc[kRowCols];
        float tile_max = -INFINITY;
        using ScoreVec = arch::Vec<float, kScoreVec>;
#pragma unroll
        for (int c = 0; c < kRowCols; ++c) sc[c] = 0.f;
#pragma unroll
        for (int part = 0; part < C::kSplitK; ++part)
#pragma unroll
          for (int c = 0; c < kRowCols; c += kScoreVec) {
            const ScoreVec v =
                *reinterpret_cast<const ScoreVec*>(score_s + (part * kBlockM + my_row) * kScorePitch + my_col0 + c);
#pragma unroll
            for (int e = 0; e < kScoreVec; ++e) sc[c + e] += v.v[e];
          }
#pragma unroll
        for (int c = 0; c < kRowCols; ++c) {
          sc[c] = (j0 + my_col0 + c < row_limit) ? sc[c] * scale_log2 : -INFINITY;
          tile_max = fmaxf(tile_max, sc[c]);
        }
#pragma unroll
        for (int m = kRowThreads / 2; m > 0; m >>= 1)
          tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, m));
        const float new_max = raised_max(row_max, tile_max);
        const float alpha = rescale_factor(row_max, new_max);
        float tile_sum = 0.f;
        arch::Vec<T, kRowCols> pv;
#pragma unroll
        for (int c = 0; c < kRowCols; ++c) {
          const float pr = new_max == -INFINITY ? 0.f : exp2f(sc[c] - new_max);
          tile_sum += pr;
          pv.v[c] = arch::from_float<T>(pr);
        }
        // P over the partials (Turing's tile): row r's P overwrites only row r's partials, which the
        // warp's own lanes read above; the warp barrier orders those reads before these stores.
        if constexpr (C::kProbsInScores) __syncwarp();
        arch::store<T, kRowCols>(prob_s + my_row * kProbPitch + my_col0, pv);
#pragma unroll
        for (int m = kRowThreads / 2; m > 0; m >>= 1) tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, m);
        row_sum = row_sum * alpha + tile_sum;
        row_max = new_max;
        if (my_col0 == 0) alpha_s[my_row] = alpha;
        rescale = __syncthreads_or(alpha != 1.f);
      }

      {  // O = O * alpha + P.V; each P fragment is loaded once per k step for all column tiles
        if (rescale) {
#pragma unroll
          for (int mt = 0; mt < C::kTilesM; ++mt)
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              const float a = alpha_s[mt * 16 + Mma::acc_row(lane, i)];
#pragma unroll
              for (int nt = 0; nt < kTilesN; ++nt) acc[mt][nt][i] *= a;
            }
        }
        const int col0 = warp * (kLatentDim / kWarps);
#pragma unroll
        for (int k = 0; k < kBlockN; k += 16) {
          typename Mma::FragA pa[C::kTilesM];
#pragma unroll
          for (int mt = 0; mt < C::kTilesM; ++mt) Mma::load_a(pa[mt], prob_s + mt * 16 * kProbPitch + k, kProbPitch, lane);
#pragma unroll
          for (int nt = 0; nt < kTilesN; ++nt) {
            typename Mma::FragB vb;
            Mma::load_b_kn(vb, kv_tile + k * kPitch + col0 + nt * 16, kPitch, lane);
#pragma unroll
            for (int mt = 0; mt < C::kTilesM; ++mt) Mma::mma(acc[mt][nt], pa[mt], vb);
          }
        }
      }
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
    const bool split = p.num_splits > 1;
    const int64_t total_rows = p.total_q_tokens * p.num_heads;
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
        const int64_t flat = (w.token_base + s) * p.num_heads + h;
#pragma unroll
        for (int nt = 0; nt < kTilesN; ++nt) {
          const int col = col0 + nt * 16 + Mma::acc_col(lane, i);
          const float o = acc[mt][nt][i] * inv;
          if (split) {
            static_cast<float*>(p.workspace)[(blockIdx.y * total_rows + flat) * kLatentDim + col] = o;
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
        float* ws_lse = static_cast<float*>(p.workspace) + size_t(p.num_splits) * total_rows * kLatentDim;
        ws_lse[blockIdx.y * total_rows + (w.token_base + s) * p.num_heads + h] = lse;
      } else {
        p.lse[int64_t(w.b) * p.lse_stride_b * (p.cu_q_lens == nullptr) +
              (w.token_base * (p.cu_q_lens != nullptr) + s) * p.lse_stride_t + int64_t(h) * p.lse_stride_h] = lse;
      }
    }
  } else {
    __trap();  // the host never launches a tag the compiled target cannot run
  }
}

// Merges the per-split partial states of the workspace into out / lse (more than kFewSplits splits;
// fewer go to combine_few_splits_kernel below). CTA (row, chunk) owns kGroups 64-column groups of
// one (token, head) row; its 8 warps fold disjoint sets of splits (each lane two columns per group),
// then add their sums in shared memory. Many splits (one long sequence) spread a row over up to 8
// CTAs; few splits keep one. The kernel is latency-bound (a few KB per CTA): a warp issues the
// loads of up to kInFlight splits at once, the first of them before the split weights are known,
// so that the lse pass and the partial loads share one memory latency.
constexpr int kCombineWarps = 8;
constexpr int kCombineGroups = kLatentDim / 64;  // 64-column groups of a row

inline int combine_chunks(int num_splits) { return num_splits >= 64 ? 8 : num_splits >= 16 ? 2 : 1; }

template <class T, int kGroups>
__global__ void __launch_bounds__(kCombineWarps * 32) combine_splits_kernel(const AttentionParams p) {
  constexpr int kInFlight = kGroups == 1 ? 16 : 32 / kGroups;  // 32-64 registers of loads
  __shared__ float weight_s[kMaxAttentionSplits];
  __shared__ float2 partial_s[kCombineWarps][kGroups][32];
  __shared__ float max_s[kCombineWarps], sum_s[kCombineWarps];
  const int64_t total_rows = p.total_q_tokens * p.num_heads;
  const int64_t flat = blockIdx.x;
  // Packed tokens past cu_q_lens[batch] belong to no sequence: no split wrote them, and their
  // out/lse rows stay untouched.
  if (p.cu_q_lens != nullptr && flat >= int64_t(p.cu_q_lens[p.batch]) * p.num_heads) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* parts = static_cast<const float*>(p.workspace);
  const float* lses = parts + size_t(p.num_splits) * total_rows * kLatentDim;
  const int col0 = blockIdx.y * kGroups * 64 + lane * 2;

  // Warp w folds splits w, w + kCombineWarps, ...; x holds the kInFlight of them in flight. A split
  // whose kv range was empty wrote no partial: its (weight 0) garbage is loaded but never used.
  float2 x[kInFlight][kGroups];
  auto load = [&](int i0) {
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int i = i0 + u * kCombineWarps;
      const float* src = parts + (i * total_rows + flat) * kLatentDim + col0;
#pragma unroll
      for (int g = 0; g < kGroups; ++g)
        x[u][g] = i < p.num_splits ? *reinterpret_cast<const float2*>(src + g * 64) : make_float2(0.f, 0.f);
    }
  };
  load(warp);

  float m = -INFINITY;
  for (int i = tid; i < p.num_splits; i += blockDim.x) m = fmaxf(m, lses[i * total_rows + flat]);
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
  if (lane == 0) max_s[warp] = m;
  __syncthreads();
  m = max_s[0];
#pragma unroll
  for (int w = 1; w < kCombineWarps; ++w) m = fmaxf(m, max_s[w]);
  float denom = 0.f;
  for (int i = tid; i < p.num_splits; i += blockDim.x) {
    const float wgt = m == -INFINITY ? 0.f : __expf(lses[i * total_rows + flat] - m);
    weight_s[i] = wgt;
    denom += wgt;
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) denom += __shfl_xor_sync(0xffffffffu, denom, d);
  if (lane == 0) sum_s[warp] = denom;
  __syncthreads();  // also publishes weight_s
  denom = 0.f;
#pragma unroll
  for (int w = 0; w < kCombineWarps; ++w) denom += sum_s[w];

  float2 o[kGroups];
#pragma unroll
  for (int g = 0; g < kGroups; ++g) o[g] = make_float2(0.f, 0.f);
  for (int i0 = warp; i0 < p.num_splits; i0 += kInFlight * kCombineWarps) {
    if (i0 != warp) load(i0);
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int i = i0 + u * kCombineWarps;
      const float wgt = i < p.num_splits ? weight_s[i] : 0.f;
      if (wgt == 0.f) continue;
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        o[g].x += wgt * x[u][g].x;
        o[g].y += wgt * x[u][g].y;
      }
    }
  }
#pragma unroll
  for (int g = 0; g < kGroups; ++g) partial_s[warp][g][lane] = o[g];
  __syncthreads();
  const int64_t token = flat / p.num_heads;
  const int h = int(flat - token * p.num_heads);
  int64_t b = 0, t = token;
  if (p.cu_q_lens == nullptr) { b = token / p.q_len; t = token - b * p.q_len; }
  T* dst = static_cast<T*>(p.out) + b * p.out_stride_b + t * p.out_stride_t + int64_t(h) * p.out_stride_h + col0;
  const float inv = denom > 0.f ? 1.f / denom : 0.f;
  for (int g = warp; g < kGroups; g += kCombineWarps) {  // warp g writes 64-column group g
    float2 sum = make_float2(0.f, 0.f);
    for (int w = 0; w < kCombineWarps; ++w) {
      sum.x += partial_s[w][g][lane].x;
      sum.y += partial_s[w][g][lane].y;
    }
    dst[g * 64] = arch::from_float<T>(sum.x * inv);
    dst[g * 64 + 1] = arch::from_float<T>(sum.y * inv);
  }
  if (tid == 0 && blockIdx.y == 0)
    p.lse[b * p.lse_stride_b + t * p.lse_stride_t + int64_t(h) * p.lse_stride_h] =
        denom > 0.f ? m + logf(denom) : -INFINITY;
}

// Few splits (batches that nearly fill the GPU split the KV 2-8 ways): one warp per (token, head)
// row, each lane 16 of its 512 columns as four 16-byte pieces. Split weights travel by warp
// shuffle (lane i holds split i's), so there is no shared memory and no barrier, and a lane keeps
// up to 16 loads in flight (4 splits at a time).
constexpr int kFewSplits = 8;

template <class T>
__global__ void __launch_bounds__(kCombineWarps * 32) combine_few_splits_kernel(const AttentionParams p) {
  const int64_t total_rows = p.total_q_tokens * p.num_heads;
  const int lane = threadIdx.x & 31;
  const int64_t flat = int64_t(blockIdx.x) * kCombineWarps + (threadIdx.x >> 5);
  if (flat >= total_rows) return;
  if (p.cu_q_lens != nullptr && flat >= int64_t(p.cu_q_lens[p.batch]) * p.num_heads) return;  // see above
  const float* parts = static_cast<const float*>(p.workspace);
  const float* lses = parts + size_t(p.num_splits) * total_rows * kLatentDim;

  // The first four splits' partials are loaded before the weights are known (one memory latency
  // for both); an empty split's (weight 0) garbage is loaded but never used.
  constexpr int kPieces = kLatentDim / 128;  // float4 pieces per lane: columns 4 lane + 128 g
  float4 x[4][kPieces];
  auto load = [&](int i0) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const float* src = parts + ((i0 + u) * total_rows + flat) * kLatentDim + 4 * lane;
#pragma unroll
      for (int g = 0; g < kPieces; ++g)
        x[u][g] = i0 + u < p.num_splits ? *reinterpret_cast<const float4*>(src + 128 * g) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  load(0);
  const float own_lse = lane < p.num_splits ? lses[lane * total_rows + flat] : -INFINITY;
  float m = own_lse;
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
  const float own_weight = m == -INFINITY ? 0.f : __expf(own_lse - m);
  float denom = own_weight;
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) denom += __shfl_xor_sync(0xffffffffu, denom, d);

  float4 o[kPieces];
#pragma unroll
  for (int g = 0; g < kPieces; ++g) o[g] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int i0 = 0; i0 < p.num_splits; i0 += 4) {
    if (i0 > 0) load(i0);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const float wgt = i0 + u < p.num_splits ? __shfl_sync(0xffffffffu, own_weight, (i0 + u) & 31) : 0.f;
      if (wgt == 0.f) continue;  // (the same for every lane)
#pragma unroll
      for (int g = 0; g < kPieces; ++g) {
        o[g].x += wgt * x[u][g].x;
        o[g].y += wgt * x[u][g].y;
        o[g].z += wgt * x[u][g].z;
        o[g].w += wgt * x[u][g].w;
      }
    }
  }
  const int64_t token = flat / p.num_heads;
  const int h = int(flat - token * p.num_heads);
  int64_t b = 0, t = token;
  if (p.cu_q_lens == nullptr) { b = token / p.q_len; t = token - b * p.q_len; }
  T* dst = static_cast<T*>(p.out) + b * p.out_stride_b + t * p.out_stride_t + int64_t(h) * p.out_stride_h + 4 * lane;
  const float inv = denom > 0.f ? 1.f / denom : 0.f;
#pragma unroll
  for (int g = 0; g < kPieces; ++g) {
    arch::Vec<T, 4> v;
    v.v[0] = arch::from_float<T>(o[g].x * inv);
    v.v[1] = arch::from_float<T>(o[g].y * inv);
    v.v[2] = arch::from_float<T>(o[g].z * inv);
    v.v[3] = arch::from_float<T>(o[g].w * inv);
    arch::store<T, 4>(dst + 128 * g, v);
  }
  if (lane == 0)
    p.lse[b * p.lse_stride_b + t * p.lse_stride_t + int64_t(h) * p.lse_stride_h] =
        denom > 0.f ? m + logf(denom) : -INFINITY;
}

// Merges the splits of a launch (nothing to do for one split).
template <class T>
Status launch_combine(const AttentionParams& p, cudaStream_t stream) {
  if (p.num_splits == 1) return Status::kOk;  // (dispatch checked 1 <= num_splits <= kMaxAttentionSplits)
  const int64_t rows_total = p.total_q_tokens * p.num_heads;
  if (p.num_splits <= kFewSplits) {
    combine_few_splits_kernel<T>
        <<<unsigned((rows_total + kCombineWarps - 1) / kCombineWarps), kCombineWarps * 32, 0, stream>>>(p);
  } else {
    const int chunks = combine_chunks(p.num_splits);
    const dim3 grid(unsigned(rows_total), chunks);
    if (chunks == 8) combine_splits_kernel<T, kCombineGroups / 8><<<grid, kCombineWarps * 32, 0, stream>>>(p);
    else if (chunks == 2) combine_splits_kernel<T, kCombineGroups / 2><<<grid, kCombineWarps * 32, 0, stream>>>(p);
    else combine_splits_kernel<T, kCombineGroups><<<grid, kCombineWarps * 32, 0, stream>>>(p);
  }
  return cudaPeekAtLastError() == cudaSuccess ? Status::kOk : Status::kCudaError;
}

// Launches tile configuration `config` of tag A (dispatch chose one that fits the device).
template <class A, class T, class Rows, int kConfig = 0>
Status launch_tiles(const AttentionParams& p, const Rows& rows, int config, int grid_x, cudaStream_t stream) {
  if constexpr (kConfig < tile_configs(A::kArch).count) {
    if (config != kConfig) return launch_tiles<A, T, Rows, kConfig + 1>(p, rows, config, grid_x, stream);
    const auto kernel = attention_kernel<A, T, kConfig, Rows>;
    constexpr size_t smem = Tiling<A, kConfig>::kSmem.total();
    if (smem > 48 * 1024 &&
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) != cudaSuccess)
      return Status::kCudaError;
    kernel<<<dim3(grid_x, p.num_splits), kThreads, smem, stream>>>(p, rows);
    return cudaPeekAtLastError() == cudaSuccess ? Status::kOk : Status::kCudaError;
  } else {
    return Status::kInvalidArgument;
  }
}

template <class A, class T, class Rows>
Status launch_attention(const AttentionParams& p, const Rows& rows, int config, int grid_x, cudaStream_t stream) {
  const Status s = launch_tiles<A, T, Rows>(p, rows, config, grid_x, stream);
  return s == Status::kOk ? launch_combine<T>(p, stream) : s;
}

}  // namespace attention_detail
}  // namespace mla_kv
