// What every attention kernel shares (the mma.sync kernel of attention_mma_sync.cuh and the Hopper kernel of
// attention_sm90.cuh): which sequence, rows and kv range a CTA owns, the kv limit of a row under the
// causal mask, the online-softmax pieces, and the query-row addressing; and the per-tile Q.K^T, softmax
// and P.V of the mma.sync kernels, which the expanded-form kernel (../expanded/expanded_attention.cuh)
// runs too.
// Reference: python/mla_kv/reference (decode, prefill).
#pragma once

#include <cfloat>
#include <cstdint>

#include "../arch/arch.cuh"
#include "../address.cuh"
#include "mla_kv/attention.h"
#include "plan.h"

namespace mla_kv {
namespace attention_detail {

constexpr int kVecsPerRow = kRowDim / 8;    // 16-byte vectors of a 16-bit row
constexpr int kVecsPerLane = (kVecsPerRow + 31) / 32;           // 3 (the last pass is partial)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kRescaleLog2 = 8.f;  // see raised_max

// Which sequence, query rows and kv range a CTA owns.
struct Work {
  int b;
  int row0;     // first (token, head) row of the sequence handled by this CTA
  int q_len;    // query tokens of the sequence
  int64_t token_base;  // flat token index of the sequence's first query token
  int kv_len;
  int kv_lo, kv_hi;    // this CTA's kv positions
};

// A planned launch: CTA i takes the plan's item i (both int4 halves in flight at once, so the
// lengths cost no second trip to memory).
__device__ __forceinline__ bool find_planned_work(const AttentionParams& p, Work& w) {
  const PlanView plan = plan_view(p.plan, p.plan_sizes);
  if (int(blockIdx.x) >= plan.header[kPlanItems]) return false;
  const int4* item = reinterpret_cast<const int4*>(plan.items + blockIdx.x);
  const int4 a = item[0], c = item[1];
  w.b = a.x;
  w.row0 = a.y;
  w.kv_lo = a.z;
  w.kv_hi = a.w;
  w.kv_len = c.x;
  if (p.cu_q_lens == nullptr) {
    w.q_len = p.q_len;
    w.token_base = int64_t(w.b) * p.q_len;
  } else {
    w.token_base = p.cu_q_lens[w.b];
    w.q_len = p.cu_q_lens[w.b + 1] - int(w.token_base);
  }
  return true;
}

template <int kBlockM, class Rows>
__device__ __forceinline__ bool find_work(const AttentionParams& p, const Rows& rows, Work& w) {
  if (p.plan != nullptr) return find_planned_work(p, w);
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
  w.kv_len = rows.kv_len(p.kv_lens, w.b);
  const int last_row = min(w.row0 + kBlockM, w.q_len * p.num_heads) - 1;
  const int visible = p.causal ? w.kv_len - w.q_len + last_row / p.num_heads + 1 : w.kv_len;
  w.kv_lo = blockIdx.y * p.tokens_per_split;
  w.kv_hi = min(min(w.kv_lo + p.tokens_per_split, w.kv_len), visible);
  return true;
}

// Where a CTA leaves its partial state: workspace row partial_row0() + r holds its row r (and the
// lse array after partial_rows() rows); -1 when the CTA writes out / lse itself. Uniform split:
// rows [split][flat row]; plan: the item's slot of kBlockM rows. Called in the epilogue rather
// than kept from the prologue: the main loops need every register.
template <int kBlockM>
__device__ __forceinline__ int64_t partial_row0(const AttentionParams& p, int b, int row0) {
  if (p.plan != nullptr) {
    const int slot = plan_view(p.plan, p.plan_sizes).items[blockIdx.x].slot;
    return slot < 0 ? -1 : int64_t(slot) * kBlockM;
  }
  if (p.num_splits == 1) return -1;
  const int64_t token_base = p.cu_q_lens == nullptr ? int64_t(b) * p.q_len : p.cu_q_lens[b];
  return int64_t(blockIdx.y) * p.total_q_tokens * p.num_heads + token_base * p.num_heads + row0;
}
__device__ __forceinline__ int64_t partial_rows(const AttentionParams& p) {
  return p.plan != nullptr ? int64_t(p.plan_sizes.max_slots) * p.plan_sizes.block_m
                           : int64_t(p.num_splits) * p.total_q_tokens * p.num_heads;
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

// ---- One KV tile's Q.K^T, softmax and P.V in the mma.sync kernels (attention_mma_sync.cuh, expanded_attention.cuh)
// The tile's scores wait in shared memory as kSplitK partial kBlockM x kBlockN fp32 tiles, one per slice
// of the Q.K^T contraction (partial s from row s * kBlockM, kScorePitch floats a row); P goes back as the
// P.V product's 16-bit A operand (row r at Mma::a_row(r), kProbPitch elements a row). Softmax ownership:
// kRowThreads consecutive threads, lanes of one warp, share a row, each holding kRowCols consecutive
// columns of it.
template <int kThreads, int kBlockM_, int kBlockN_, int kSplitK_, int kScorePitch_, int kProbPitch_>
struct ScoreTiles {
  static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_, kSplitK = kSplitK_;
  static constexpr int kScorePitch = kScorePitch_, kProbPitch = kProbPitch_;
  static constexpr int kRowThreads = kThreads / kBlockM;
  static constexpr int kRowCols = kBlockN / kRowThreads;
  static constexpr int kScoreVec = kRowCols < 4 ? kRowCols : 4;  // floats per shared-memory read
  static_assert(kRowThreads <= 32 && (kRowThreads & (kRowThreads - 1)) == 0 && kRowThreads * kRowCols == kBlockN,
                "a row's threads must be a power-of-two group of one warp's lanes: they reduce by shuffles");
  __device__ __forceinline__ static int row_of(int tid) { return tid / kRowThreads; }
  __device__ __forceinline__ static int col0_of(int tid) { return (tid % kRowThreads) * kRowCols; }
};

// S = Q.K^T partial of this warp's kTilesM x kTilesN 16 x 16 score tiles over one kKSlice-wide slice of the
// contraction: Q rows from q_slice, K rows from k_slice (kPitch elements a row, both at the slice's first
// column), the sums to out_s rows st_m.. and columns st_n.. (kScorePitch floats a row). The next step's
// fragments load during this step's mma (two fragment buffers, resolved at compile time by the full
// unroll). A one-tile warp keeps two accumulator sets (even and odd k steps): half as long chains of
// dependent mma; bigger warp tiles have independent chains already.
template <class Mma, int kTilesM, int kTilesN, int kKSlice, int kPitch, int kScorePitch, class T>
__device__ __forceinline__ void qk_partial_scores(const T* q_slice, const T* k_slice, float* out_s, int st_m, int st_n,
                                                  int lane) {
  constexpr int kAccSets = kTilesM * kTilesN == 1 ? 2 : 1;
  float s_acc[kAccSets][kTilesM][kTilesN][8] = {};
  typename Mma::FragA qa[2][kTilesM];
  typename Mma::FragB kb[2][kTilesN];
  auto load = [&](int buf, int k) MLA_KV_INLINE_LAMBDA {
#pragma unroll
    for (int i = 0; i < kTilesM; ++i) Mma::load_a(qa[buf][i], q_slice + 16 * i * kPitch + k, kPitch, lane);
#pragma unroll
    for (int j = 0; j < kTilesN; ++j) Mma::load_b_nk(kb[buf][j], k_slice + 16 * j * kPitch + k, kPitch, lane);
  };
  load(0, 0);
#pragma unroll
  for (int k = 0; k < kKSlice; k += 16) {
    const int buf = (k / 16) & 1;
    if (k + 16 < kKSlice) load(buf ^ 1, k + 16);
#pragma unroll
    for (int i = 0; i < kTilesM; ++i)
#pragma unroll
      for (int j = 0; j < kTilesN; ++j) Mma::mma(s_acc[buf % kAccSets][i][j], qa[buf][i], kb[buf][j]);
  }
#pragma unroll
  for (int i = 0; i < kTilesM; ++i)
#pragma unroll
    for (int j = 0; j < kTilesN; ++j)
#pragma unroll
      for (int e = 0; e < 8; ++e)
        out_s[(st_m + 16 * i + Mma::acc_row(lane, e)) * kScorePitch + st_n + 16 * j + Mma::acc_col(lane, e)] =
            s_acc[0][i][j][e] + (kAccSets > 1 ? s_acc[kAccSets - 1][i][j][e] : 0.f);
}

// The online softmax of my row's columns of the tile that starts at kv position j0 (partials read and P
// written as vectors): partials summed, keys at or past row_limit or whose bit of valid is clear masked
// to -inf (valid: bit c for my column c, whether its row exists; ~0u unless sparse indices leave rows
// missing), P = 2^(score - running max) stored, row_max / row_sum moved on and the row's rescale factor
// left in alpha_s. Returns whether any row rescales; that block barrier also publishes P and alpha_s.
// The mask takes values, not a predicate functor: with a lambda, clang sank the partials' loads into a
// branch and split their vector loads. kProbsInScores: P overwrites the partials (Turing's tile, where
// a_row is the identity); row r's P overwrites only row r's partials, which the warp's own lanes read
// here, and the warp barrier orders those reads before these stores.
template <class Tiles, class Mma, bool kProbsInScores, class T>
__device__ __forceinline__ bool online_softmax_tile(const float* score_s, T* prob_s, float* alpha_s, int my_row,
                                                    int my_col0, float scale_log2, int j0, int row_limit,
                                                    uint32_t valid, float& row_max, float& row_sum) {
  constexpr int kRowThreads = Tiles::kRowThreads, kRowCols = Tiles::kRowCols, kScoreVec = Tiles::kScoreVec;
  using ScoreVec = arch::Vec<float, kScoreVec>;
  float sc[kRowCols];
#pragma unroll
  for (int c = 0; c < kRowCols; ++c) sc[c] = 0.f;
#pragma unroll
  for (int part = 0; part < Tiles::kSplitK; ++part)
#pragma unroll
    for (int c = 0; c < kRowCols; c += kScoreVec) {
      const float* partial = score_s + (part * Tiles::kBlockM + my_row) * Tiles::kScorePitch + my_col0 + c;
      const ScoreVec x = *reinterpret_cast<const ScoreVec*>(partial);
#pragma unroll
      for (int e = 0; e < kScoreVec; ++e) sc[c + e] += x.v[e];
    }
  float tile_max = -INFINITY;
#pragma unroll
  for (int c = 0; c < kRowCols; ++c) {
    sc[c] = (j0 + my_col0 + c < row_limit && ((valid >> c) & 1)) ? sc[c] * scale_log2 : -INFINITY;
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
  if constexpr (kProbsInScores) __syncwarp();
  arch::store<T, kRowCols>(prob_s + Mma::a_row(my_row) * Tiles::kProbPitch + my_col0, pv);
#pragma unroll
  for (int m = kRowThreads / 2; m > 0; m >>= 1) tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, m);
  row_sum = row_sum * alpha + tile_sum;
  row_max = new_max;
  if (my_col0 == 0) alpha_s[my_row] = alpha;
  return __syncthreads_or(alpha != 1.f);
}

// O = O * alpha + P.V over the tile, after online_softmax_tile: acc holds this warp's kTilesM x kTilesN
// 16 x 16 output tiles (columns col0 + 16 nt of every row), rescaled by alpha_s only when some row's max
// moved; V is the tile's kBlockN rows at v_tile, kVPitch elements apart. Each P fragment is loaded once
// per k step for all column tiles.
template <class Tiles, class Mma, int kVPitch, class T, int kTilesM, int kTilesN>
__device__ __forceinline__ void accumulate_pv(float (&acc)[kTilesM][kTilesN][8], bool rescale, const float* alpha_s,
                                              const T* prob_s, const T* v_tile, int col0, int lane) {
  constexpr int kProbPitch = Tiles::kProbPitch;
  if (rescale) {
#pragma unroll
    for (int mt = 0; mt < kTilesM; ++mt)
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float a = alpha_s[mt * 16 + Mma::acc_row(lane, i)];
#pragma unroll
        for (int nt = 0; nt < kTilesN; ++nt) acc[mt][nt][i] *= a;
      }
  }
#pragma unroll
  for (int k = 0; k < Tiles::kBlockN; k += 16) {
    typename Mma::FragA pa[kTilesM];
#pragma unroll
    for (int mt = 0; mt < kTilesM; ++mt) Mma::load_a(pa[mt], prob_s + mt * 16 * kProbPitch + k, kProbPitch, lane);
#pragma unroll
    for (int nt = 0; nt < kTilesN; ++nt) {
      typename Mma::FragB vb;
      Mma::load_b_kn(vb, v_tile + k * kVPitch + col0 + nt * 16, kVPitch, lane);
#pragma unroll
      for (int mt = 0; mt < kTilesM; ++mt) Mma::mma(acc[mt][nt], pa[mt], vb);
    }
  }
}

// Two attention states over disjoint key sets, merged by their lse (natural log): each state's weight
// before the division by their sum, 1 / that sum, and (on demand) the merged lse. Both empty (lse
// -inf): weights 0 and lse -inf, never NaN.
struct StateWeights {
  float m, a, b, sum, inv;
  __device__ __forceinline__ float lse() const { return sum > 0.f ? m + logf(sum) : -INFINITY; }
};
__device__ __forceinline__ StateWeights merge_weights(float lse_a, float lse_b) {
  const float m = fmaxf(lse_a, lse_b);
  const float wa = m == -INFINITY ? 0.f : __expf(lse_a - m), wb = m == -INFINITY ? 0.f : __expf(lse_b - m);
  const float sum = wa + wb;
  return {m, wa, wb, sum, sum > 0.f ? 1.f / sum : 0.f};
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

}  // namespace attention_detail
}  // namespace mla_kv
