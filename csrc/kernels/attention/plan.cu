// The length-aware work plan (invokeAttentionPlan): one CTA reads the step's lengths and cuts the
// batch's work into items of near-equal cost for the attention launch and lists the rows the
// combine merges. Layout of its output: plan.h.
#include <algorithm>

#include "../arch/arch.cuh"
#include "attention_launch.h"
#include "plan.h"

namespace mla_kv {
namespace attention_detail {
namespace {

constexpr int kPlanThreads = 1024;
constexpr int kTileTokens = 64;      // work is counted in 64-token tiles; pieces start on them (TMA boxes)
constexpr int kMinChunkTiles = 4;    // 256 tokens: shorter pieces cost the combine more than they save
constexpr int kCandidates = 32;      // chunks tried at once (a warp each) for the one-wave fit
constexpr int kCachedCosts = 2048;   // units whose cost the search keeps in shared memory

// Exclusive prefix sums of K values over the CTA, in place; total[k]: the CTA's sum.
template <int K>
__device__ void block_exclusive_scan(int (&v)[K], int (&total)[K]) {
  __shared__ int warp_s[K][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int incl[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    incl[k] = v[k];
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int x = __shfl_up_sync(0xffffffffu, incl[k], d);
      if (lane >= d) incl[k] += x;
    }
    if (lane == 31) warp_s[k][warp] = incl[k];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      int x = warp_s[k][lane];
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, d);
        if (lane >= d) x += y;
      }
      warp_s[k][lane] = x;  // inclusive over warps
    }
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    v[k] = incl[k] - v[k] + (warp > 0 ? warp_s[k][warp - 1] : 0);
    total[k] = warp_s[k][31];
  }
  __syncthreads();  // warp_s is reused by the next scan
}

// A (sequence, row block) unit: rows [row0, row0 + rows) of sequence b, which see kv positions
// [0, visible) at most (causal: its last row's limit).
struct Unit {
  int b, row0, rows, kv_len, visible;
  __device__ int tiles() const { return max(1, (visible + kTileTokens - 1) / kTileTokens); }  // (an empty unit
  // still takes a CTA: it writes out 0 and lse -inf)
};

__device__ int q_len_of(const AttentionParams& p, int b) {
  return p.cu_q_lens == nullptr ? p.q_len : p.cu_q_lens[b + 1] - p.cu_q_lens[b];
}

// Unit u: the sequence whose units hold it (first_unit: [batch + 1] prefix), and its row block; a
// packed sequence's last row block first (under a causal mask it sees the most keys, and a second
// wave should start with it), as the uniform split orders them.
__device__ Unit unit_of(const AttentionParams& p, const int* first_unit, int u, int block_m) {
  int lo = 0, hi = p.batch;  // the last b with first_unit[b] <= u
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (first_unit[mid] <= u) lo = mid; else hi = mid;
  }
  Unit w;
  w.b = lo;
  const int q = q_len_of(p, lo), n = first_unit[lo + 1] - first_unit[lo], j = u - first_unit[lo];
  w.row0 = (p.cu_q_lens == nullptr ? j : n - 1 - j) * block_m;
  w.rows = min(block_m, q * p.num_heads - w.row0);
  w.kv_len = max(p.kv_lens[lo], 0);
  const int last = w.row0 + w.rows - 1;
  w.visible = p.causal ? min(w.kv_len, max(0, w.kv_len - q + last / p.num_heads + 1)) : w.kv_len;
  return w;
}

__global__ void __launch_bounds__(kPlanThreads) attention_plan_kernel(const AttentionParams p, int* plan) {
  __shared__ int first_unit[kMaxPlanBatch + 1];
  __shared__ int cost_s[kCachedCosts];
  __shared__ int items_s[kCandidates];
  __shared__ long long work_s[32];
  __shared__ int max_s[32];
  __shared__ int chunk_s;
  const AttentionPlanSizes& sz = p.plan_sizes;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, block_m = sz.block_m;

  // Units per sequence, and their prefix.
  int carry = 0;
  for (int b0 = 0; b0 < p.batch; b0 += kPlanThreads) {
    const int b = b0 + tid;
    int v[1] = {b < p.batch ? (max(q_len_of(p, b), 0) * p.num_heads + block_m - 1) / block_m : 0}, total[1];
    block_exclusive_scan<1>(v, total);
    if (b < p.batch) first_unit[b] = carry + v[0];
    carry += total[0];
  }
  if (tid == 0) first_unit[p.batch] = carry;
  __syncthreads();
  const int units = carry;

  // The batch's work in tiles, and its longest unit.
  long long work = 0;
  int longest = 0;
  for (int u = tid; u < units; u += kPlanThreads) {
    const int t = unit_of(p, first_unit, u, block_m).tiles();
    if (u < kCachedCosts) cost_s[u] = t;
    work += t;
    longest = max(longest, t);
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    work += __shfl_xor_sync(0xffffffffu, work, d);
    longest = max(longest, __shfl_xor_sync(0xffffffffu, longest, d));
  }
  if (lane == 0) { work_s[warp] = work; max_s[warp] = longest; }
  __syncthreads();
  work = 0;
  longest = 0;
  for (int w = 0; w < 32; ++w) { work += work_s[w]; longest = max(longest, max_s[w]); }

  // The chunk: the work over the CTA slots (at least kMinChunkTiles, and few enough pieces for the
  // combine), raised by steps of 1/8 while that keeps every item in one wave.
  const int slots = sz.target_ctas;
  const int lowest = max(max(kMinChunkTiles, int((work + slots - 1) / slots)),
                         (longest + kMaxAttentionSplits - 1) / kMaxAttentionSplits);
  if (units <= slots && units <= kCachedCosts) {
    const int c = lowest + (lowest * warp + 7) / 8;
    int n = 0;
    for (int u = lane; u < units; u += 32) n += (cost_s[u] + c - 1) / c;
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) n += __shfl_xor_sync(0xffffffffu, n, d);
    if (lane == 0) items_s[warp] = n;
  }
  __syncthreads();
  if (tid == 0) {
    int chosen = lowest;
    if (units <= slots && units <= kCachedCosts) {
      for (int k = 0; k < kCandidates; ++k) {
        if (items_s[k] <= slots) { chosen = lowest + (lowest * k + 7) / 8; break; }
      }
    }
    chunk_s = chosen;
  }
  __syncthreads();
  const int chunk = chunk_s;

  // Items, split units and combine rows, unit by unit in order.
  const PlanView view = plan_view(plan, sz);
  PlanItem* items = const_cast<PlanItem*>(view.items);
  PlanUnit* split_units = const_cast<PlanUnit*>(view.units);
  int* few_rows = const_cast<int*>(view.few_rows);
  int* many_rows = const_cast<int*>(view.many_rows);
  int base[5] = {0, 0, 0, 0, 0};  // items, split units, slots, few rows, many rows so far
  for (int u0 = 0; u0 < units; u0 += kPlanThreads) {
    const int u = u0 + tid;
    Unit w{};
    int pieces = 0, piece_tiles = 0;
    if (u < units) {
      w = unit_of(p, first_unit, u, block_m);
      const int t = w.tiles();
      piece_tiles = (t + (t + chunk - 1) / chunk - 1) / ((t + chunk - 1) / chunk);  // near-equal pieces
      pieces = (t + piece_tiles - 1) / piece_tiles;
    }
    const bool split = pieces > 1;
    int v[5] = {pieces, split, split ? pieces : 0, split && pieces <= 8 ? w.rows : 0, split && pieces > 8 ? w.rows : 0};
    int total[5];
    block_exclusive_scan<5>(v, total);
    if (u < units) {
      const int item0 = base[0] + v[0], unit = base[1] + v[1], slot0 = base[2] + v[2];
      for (int i = 0; i < pieces && item0 + i < sz.max_items; ++i) {
        PlanItem it;
        it.b = w.b;
        it.row0 = w.row0;
        it.kv_lo = min(i * piece_tiles * kTileTokens, w.visible);
        it.kv_hi = min((i + 1) * piece_tiles * kTileTokens, w.visible);
        it.kv_len = w.kv_len;
        it.slot = split && slot0 + i < sz.max_slots ? slot0 + i : -1;
        it.unit = split ? unit : -1;
        it.unused = 0;
        items[item0 + i] = it;
      }
      if (split && unit < sz.max_units) {
        split_units[unit] = PlanUnit{w.b, w.row0, slot0, pieces};
        int* list = pieces <= 8 ? few_rows + base[3] + v[3] : many_rows + base[4] + v[4];
        const int room = sz.max_rows - (pieces <= 8 ? base[3] + v[3] : base[4] + v[4]);
        for (int r = 0; r < w.rows && r < room; ++r) list[r] = unit * 64 + r;
      }
    }
#pragma unroll
    for (int k = 0; k < 5; ++k) base[k] += total[k];
  }
  if (tid == 0) {
    // Within the capacities by construction (attention_plan_sizes); clamped so that no launch reads
    // past them whatever the lengths.
    plan[kPlanItems] = min(base[0], sz.max_items);
    plan[kPlanFewRows] = min(base[3], sz.max_rows);
    plan[kPlanManyRows] = min(base[4], sz.max_rows);
    plan[kPlanChunk] = chunk;
    plan[kPlanUnits] = min(base[1], sz.max_units);
  }
}

}  // namespace

Status launch_attention_plan(const AttentionParams& p, cudaStream_t stream) {
  attention_plan_kernel<<<1, kPlanThreads, 0, stream>>>(p, const_cast<int*>(p.plan));
  return cudaPeekAtLastError() == cudaSuccess ? Status::kOk : Status::kCudaError;
}

}  // namespace attention_detail
}  // namespace mla_kv
