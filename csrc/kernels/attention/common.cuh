// What every attention kernel shares (the mma.sync kernel of mma_sync.cuh and the Hopper kernel of
// attention_sm90.cuh): which sequence, rows and kv range a CTA owns, the kv limit of a row under the
// causal mask, the online-softmax pieces, and the query-row addressing.
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
