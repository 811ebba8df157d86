// The length-aware work plan (invokeAttentionPlan): one CTA reads the step's lengths and cuts the
// batch's work into items of near-equal cost for the attention launch and lists the rows the
// combine merges. Layout of its output: plan.h.
//
// The kernel is latency-bound (a few microseconds, most of them waiting), so it is laid out to wait
// little: the lengths are read once, every thread's loads in flight together (kept in registers, or
// in shared memory where later rounds read them again); each thread owns a contiguous run of units
// for the whole plan, numbered by a serial prefix and one block scan; every block-wide step costs
// one barrier; the output leaves in coalesced stores spread over the CTA. 256 threads, not 1024: a
// block-wide step costs shuffles and shared-memory reads per warp, and batches of up to 256 units
// still get a unit per thread.
#include <algorithm>

#include "../arch/arch.cuh"
#include "attention_launch.h"
#include "plan.h"

namespace mla_kv {
namespace attention_detail {
namespace {

constexpr int kPlanThreads = 256;
constexpr int kPlanWarps = kPlanThreads / 32;
constexpr int kUnitsPerThread = 8;                        // a thread's run of units in one round
constexpr int kRoundUnits = kPlanThreads * kUnitsPerThread;  // beyond it, the plan takes several rounds
constexpr int kSeqsPerThread = 8;                         // a thread's run of packed sequences
constexpr int kCachedBatch = kPlanThreads * kSeqsPerThread;  // packed batches whose lengths stay in shared memory
constexpr int kTileTokens = 64;      // work is counted in 64-token tiles; pieces start on them (TMA boxes)
constexpr int kMinChunkTiles = 4;    // 256 tokens: shorter pieces cost the combine more than they save
constexpr int kCandidates = 32;      // chunks tried at once (a lane's vote each) for the one-wave fit
constexpr int kCachedCosts = 2048;   // units whose cost the search keeps in shared memory
constexpr int kFewSplits = 8;        // combine.cu's: units split at most this many ways are in the few-rows list
constexpr int kSplitRecords = kPlanThreads;  // split units of a round whose writes the CTA shares

static_assert(kCandidates % kPlanWarps == 0 && kCandidates == 32, "a warp tries whole candidates; a ballot picks");
static_assert(3 * kCachedBatch + 1 <= kMaxPlanBatch + 1, "a cached batch's first_unit, q and kv lengths share seq");

// A (sequence, row block) unit: rows [row0, row0 + rows) of sequence b, which see kv positions
// [0, visible) at most (causal: its last row's limit).
struct Unit {
  int b, row0, rows, kv_len, visible;
  __device__ int tiles() const { return max(1, (visible + kTileTokens - 1) / kTileTokens); }  // (an empty unit
  // still takes a CTA: it writes out 0 and lse -inf)
};

// A split unit as the threads that write its pieces and combine rows need it.
struct SplitUnit {
  Unit w;
  int piece_tiles, pieces;
  int item0, slot0, unit;  // its first item, first partial slot and index among split units
  int row_pos;             // its first row in its combine list
};

struct PlanShared {
  // Packed batches: first_unit [batch + 1]; cached ones then q_len and kv_len per sequence (cached_q_lens /
  // cached_kv_lens). Uniform batches of several rounds: kv_len per sequence.
  int seq[kMaxPlanBatch + 1];
  union {
    int cost[kCachedCosts];            // until the chunk is chosen
    SplitUnit split[kSplitRecords];    // then, round by round
  };
  int scan[2][4][kPlanWarps];  // warp sums of consecutive block scans, alternately
  long long work[kPlanWarps];
  int longest[kPlanWarps];
  int items[kCandidates];
};

__device__ int* cached_q_lens(PlanShared& s) { return s.seq + kCachedBatch + 1; }
__device__ int* cached_kv_lens(PlanShared& s) { return s.seq + 2 * kCachedBatch + 1; }

// Exclusive prefix sums of K values over the CTA (in thread order), in place; total[k]: the CTA's
// sum. One barrier: each thread adds up the warps' sums itself. A scan must not reuse the warp_sums
// of the one before it (whose threads may still read them): callers alternate two.
template <int K>
__device__ void block_exclusive_scan(int (&v)[K], int (&total)[K], int (*warp_sums)[kPlanWarps]) {
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
    if (lane == 31) warp_sums[k][warp] = incl[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    int before = 0;
    total[k] = 0;
#pragma unroll
    for (int w = 0; w < kPlanWarps; ++w) {
      const int x = warp_sums[k][w];
      before += w < warp ? x : 0;
      total[k] += x;
    }
    v[k] = before + incl[k] - v[k];
  }
}

// The CTA's total work and longest unit, in every thread (one barrier).
__device__ void block_work(long long& work, int& longest, PlanShared& s) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    work += __shfl_xor_sync(0xffffffffu, work, d);
    longest = max(longest, __shfl_xor_sync(0xffffffffu, longest, d));
  }
  if ((threadIdx.x & 31) == 0) {
    s.work[threadIdx.x >> 5] = work;
    s.longest[threadIdx.x >> 5] = longest;
  }
  __syncthreads();
  work = 0;
  longest = 0;
#pragma unroll
  for (int w = 0; w < kPlanWarps; ++w) {
    work += s.work[w];
    longest = max(longest, s.longest[w]);
  }
}

// A thread's run in the round [start, next) of units (or sequences): [first, first + count). Runs are
// contiguous, so that a serial prefix within the run and one block scan keep the batch's order, and
// as short as fill the CTA: a round of up to kPlanThreads is one each.
struct Run {
  int first, count, next;
};
template <int kMaxPer>
__device__ Run run_of(int start, int end) {
  const int per = min(kMaxPer, (end - start + kPlanThreads - 1) / kPlanThreads);
  const int first = start + int(threadIdx.x) * per;
  return {first, max(0, min(per, end - first)), start + kPlanThreads * per};
}

// Where units' sequences and lengths come from. A uniform batch (cu_q_lens null) has units_per_seq
// units per sequence; a packed one searches first_unit. Lengths cached in shared memory are read from
// there, the rest from global memory (read-only for the plan's lifetime).
struct Batch {
  int units;
  int units_per_seq;       // uniform
  const int* first_unit;   // packed: [batch + 1] in shared memory; nullptr: uniform
  const int* q_cache;      // packed: q_len per sequence in shared memory, or nullptr
  const int* kv_cache;     // kv_len per sequence in shared memory, or nullptr
};

// The row blocks of a sequence of q_len tokens.
__device__ int units_of(const AttentionParams& p, int q_len) {
  return (max(q_len, 0) * p.num_heads + p.plan_sizes.block_m - 1) / p.plan_sizes.block_m;
}

// The batch's units and Batch. Packed batches make first_unit here (and, up to kCachedBatch sequences,
// cache their lengths); a uniform batch caches its kv lengths only when the plan takes several rounds,
// each of which reads them again (one round keeps its units in registers).
__device__ Batch batch_of(const AttentionParams& p, PlanShared& s) {
  Batch batch{0, 0, nullptr, nullptr, nullptr};
  if (p.cu_q_lens == nullptr) {
    batch.units_per_seq = units_of(p, p.q_len);
    batch.units = p.batch * batch.units_per_seq;
    if (batch.units > kRoundUnits) {
#pragma unroll 8
      for (int b = threadIdx.x; b < p.batch; b += kPlanThreads) s.seq[b] = __ldg(p.kv_lens + b);
      __syncthreads();
      batch.kv_cache = s.seq;
    }
    return batch;
  }
  const bool cache = p.batch <= kCachedBatch;
  int carry = 0;
  for (int start = 0, round = 0; start < p.batch; ++round) {
    const Run run = run_of<kSeqsPerThread>(start, p.batch);
    int cu[kSeqsPerThread + 1], kv[kSeqsPerThread], n[kSeqsPerThread], v[1] = {0}, total[1];
#pragma unroll
    for (int k = 0; k <= kSeqsPerThread; ++k)
      cu[k] = run.count > 0 && k <= run.count ? __ldg(p.cu_q_lens + run.first + k) : 0;
#pragma unroll
    for (int k = 0; k < kSeqsPerThread; ++k) kv[k] = cache && k < run.count ? __ldg(p.kv_lens + run.first + k) : 0;
#pragma unroll
    for (int k = 0; k < kSeqsPerThread; ++k) {
      n[k] = k < run.count ? units_of(p, cu[k + 1] - cu[k]) : 0;
      v[0] += n[k];
    }
    block_exclusive_scan<1>(v, total, s.scan[round & 1]);
    int next_unit = carry + v[0];
#pragma unroll
    for (int k = 0; k < kSeqsPerThread; ++k) {
      if (k >= run.count) continue;
      const int b = run.first + k;
      s.seq[b] = next_unit;
      next_unit += n[k];
      if (cache) {
        cached_q_lens(s)[b] = cu[k + 1] - cu[k];
        cached_kv_lens(s)[b] = kv[k];
      }
    }
    carry += total[0];
    start = run.next;
  }
  if (threadIdx.x == 0) s.seq[p.batch] = carry;
  __syncthreads();
  batch.units = carry;
  batch.first_unit = s.seq;
  if (cache) {
    batch.q_cache = cached_q_lens(s);
    batch.kv_cache = cached_kv_lens(s);
  }
  return batch;
}

// Unit j of the n of sequence b (q_len q, kv_len kv); a packed sequence's last row block first (under
// a causal mask it sees the most keys, and a second wave should start with it), as the uniform split
// orders them.
__device__ Unit unit_of(const AttentionParams& p, int b, int j, int n, int q, int kv) {
  const int block_m = p.plan_sizes.block_m;
  Unit w;
  w.b = b;
  w.row0 = (p.cu_q_lens == nullptr ? j : n - 1 - j) * block_m;
  w.rows = min(block_m, q * p.num_heads - w.row0);
  w.kv_len = max(kv, 0);
  const int last = w.row0 + w.rows - 1;
  w.visible = p.causal ? min(w.kv_len, max(0, w.kv_len - q + last / p.num_heads + 1)) : w.kv_len;
  return w;
}

// The units of a thread's run. Every memory step covers the whole run at once: a packed unit's
// sequence (the last b with first_unit[b] <= u) is searched for all of them in step, and their
// lengths are loaded together, without a branch between the loads (past the run's end, k repeats
// the batch's last unit, so that every load is in bounds).
__device__ void load_units(const AttentionParams& p, const Batch& batch, const Run& run, Unit (&w)[kUnitsPerThread]) {
  constexpr int K = kUnitsPerThread;
  int u[K], b[K], first[K], n[K], q[K], kv[K];
#pragma unroll
  for (int k = 0; k < K; ++k) u[k] = min(run.first + k, batch.units - 1);
  if (batch.first_unit == nullptr) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      n[k] = batch.units_per_seq;
      b[k] = u[k] / n[k];
      first[k] = b[k] * n[k];
    }
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) b[k] = 0;
    for (int step = p.batch > 1 ? 1 << (31 - __clz(p.batch - 1)) : 0; step > 0; step >>= 1) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int c = b[k] + step;
        if (c < p.batch && batch.first_unit[c] <= u[k]) b[k] = c;
      }
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      first[k] = batch.first_unit[b[k]];
      n[k] = batch.first_unit[b[k] + 1] - first[k];
    }
  }
  if (batch.q_cache != nullptr) {
#pragma unroll
    for (int k = 0; k < K; ++k) q[k] = batch.q_cache[b[k]];
  } else if (p.cu_q_lens != nullptr) {
#pragma unroll
    for (int k = 0; k < K; ++k) q[k] = __ldg(p.cu_q_lens + b[k] + 1) - __ldg(p.cu_q_lens + b[k]);
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) q[k] = p.q_len;
  }
  if (batch.kv_cache != nullptr) {
#pragma unroll
    for (int k = 0; k < K; ++k) kv[k] = batch.kv_cache[b[k]];
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) kv[k] = __ldg(p.kv_lens + b[k]);
  }
#pragma unroll
  for (int k = 0; k < K; ++k)
    if (k < run.count) w[k] = unit_of(p, b[k], u[k] - first[k], n[k], q[k], kv[k]);
}

// ceil(x / d) by a reciprocal taken once: the chunk search divides every unit's cost by each of 32
// candidates, and a full division apiece would be most of its time. m = floor((2^32 - 1) / d) makes
// umulhi(n, m) floor(n / d) or one less for any n < 2^32, which the remainder corrects.
struct CeilDivisor {
  unsigned d, m;
  __device__ unsigned of(unsigned x) const {
    const unsigned n = x + d - 1, q = __umulhi(n, m);
    return q + (n - q * d >= d ? 1u : 0u);
  }
};

__device__ int candidate_chunk(int lowest, int k) { return lowest + (lowest * k + 7) / 8; }

__device__ bool searches_chunk(int units, int slots) { return units <= slots && units <= kCachedCosts; }

// The chunk: the work over the CTA slots (at least kMinChunkTiles, and few enough pieces for the
// combine), raised by steps of 1/8 while that keeps every item in one wave (the first of the
// candidates that does; warp w counts the items of candidates w * kPerWarp ..). Where it searches
// (units <= slots), lowest <= max(4, the longest cost) and costs are <= 2^25 tiles, so no cost +
// candidate - 1 reaches 2^31: the unsigned division counts what a signed one would.
__device__ int chunk_of(long long work, int longest, int units, int slots, PlanShared& s) {
  const int lowest = max(max(kMinChunkTiles, int((work + slots - 1) / slots)),
                         (longest + kMaxAttentionSplits - 1) / kMaxAttentionSplits);
  if (!searches_chunk(units, slots)) return lowest;
  constexpr int kPerWarp = kCandidates / kPlanWarps;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  CeilDivisor candidate[kPerWarp];
  unsigned items[kPerWarp];
#pragma unroll
  for (int i = 0; i < kPerWarp; ++i) {
    const unsigned c = candidate_chunk(lowest, warp * kPerWarp + i);
    candidate[i] = {c, 0xffffffffu / c};
    items[i] = 0;
  }
  for (int u = lane; u < units; u += 32) {
    const unsigned t = s.cost[u];
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) items[i] += candidate[i].of(t);
  }
#pragma unroll
  for (int i = 0; i < kPerWarp; ++i) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) items[i] += __shfl_xor_sync(0xffffffffu, items[i], d);
    if (lane == 0) s.items[warp * kPerWarp + i] = int(items[i]);
  }
  __syncthreads();
  const unsigned fits = __ballot_sync(0xffffffffu, s.items[lane] <= slots);
  return fits != 0 ? candidate_chunk(lowest, __ffs(fits) - 1) : lowest;
}

struct PlanOut {
  PlanItem* items;
  PlanUnit* units;
  int* few_rows;
  int* many_rows;
};

// Piece i of a unit cut into pieces of piece_tiles tiles, as two 16-byte stores (the attention
// kernels read items as int4 halves: find_planned_work, common.cuh).
__device__ void write_item(PlanItem* dst, const Unit& w, int i, int piece_tiles, int slot, int unit) {
  const int kv_lo = min(i * piece_tiles * kTileTokens, w.visible);
  const int kv_hi = min((i + 1) * piece_tiles * kTileTokens, w.visible);
  int4* halves = reinterpret_cast<int4*>(dst);
  halves[0] = make_int4(w.b, w.row0, kv_lo, kv_hi);
  halves[1] = make_int4(w.kv_len, slot, unit, 0);  // (PlanItem's order)
}

// Pieces and combine rows first, first + stride, .. of a split unit (a group of threads shares it).
__device__ void write_split_unit(const PlanOut& out, const AttentionPlanSizes& sz, const SplitUnit& su, int first,
                                 int stride) {
  for (int i = first; i < su.pieces && su.item0 + i < sz.max_items; i += stride)
    write_item(out.items + su.item0 + i, su.w, i, su.piece_tiles, su.slot0 + i < sz.max_slots ? su.slot0 + i : -1,
               su.unit);
  if (su.unit >= sz.max_units) return;
  int* list = (su.pieces <= kFewSplits ? out.few_rows : out.many_rows) + su.row_pos;
  const int room = sz.max_rows - su.row_pos;
  for (int r = first; r < su.w.rows && r < room; r += stride) list[r] = su.unit * 64 + r;
}

// Items, split units and combine rows, round by round in unit order. A thread writes its unsplit
// units' items and its split units' PlanUnit; its split units' pieces and rows go to s.split, and
// then a group of threads per split unit writes them (coalesced, and a long unit's pieces are not
// one thread's loop). w: the units of a one-round plan, kept from the cost pass.
__device__ void write_plan(const AttentionParams& p, int* plan, PlanShared& s, const Batch& batch, int chunk,
                           Unit (&w)[kUnitsPerThread]) {
  const AttentionPlanSizes& sz = p.plan_sizes;
  const PlanView view = plan_view(plan, sz);
  const PlanOut out{const_cast<PlanItem*>(view.items), const_cast<PlanUnit*>(view.units),
                    const_cast<int*>(view.few_rows), const_cast<int*>(view.many_rows)};
  int done[4] = {0, 0, 0, 0};  // items, split units, few rows, many rows of the rounds before
  for (int start = 0, round = 0; start < batch.units; ++round) {
    const Run run = run_of<kUnitsPerThread>(start, batch.units);
    if (batch.units > kRoundUnits) load_units(p, batch, run, w);
    int piece_tiles[kUnitsPerThread], pieces[kUnitsPerThread], v[4] = {0, 0, 0, 0};
#pragma unroll
    for (int k = 0; k < kUnitsPerThread; ++k) {
      piece_tiles[k] = pieces[k] = 0;
      if (k >= run.count) continue;
      const int t = w[k].tiles();
      piece_tiles[k] = (t + (t + chunk - 1) / chunk - 1) / ((t + chunk - 1) / chunk);  // near-equal pieces
      pieces[k] = (t + piece_tiles[k] - 1) / piece_tiles[k];
      const bool split = pieces[k] > 1;
      v[0] += pieces[k];
      v[1] += split;
      v[2] += split && pieces[k] <= kFewSplits ? w[k].rows : 0;
      v[3] += split && pieces[k] > kFewSplits ? w[k].rows : 0;
    }
    int total[4];
    block_exclusive_scan<4>(v, total, s.scan[round & 1]);
    int at[4], record = v[1];  // record: the round's split units before this one
#pragma unroll
    for (int i = 0; i < 4; ++i) at[i] = done[i] + v[i];
#pragma unroll
    for (int k = 0; k < kUnitsPerThread; ++k) {
      if (k >= run.count) continue;
      const bool split = pieces[k] > 1, few = pieces[k] <= kFewSplits;
      if (!split) {
        if (at[0] < sz.max_items) write_item(out.items + at[0], w[k], 0, piece_tiles[k], -1, -1);
      } else {
        // (its items before it are the earlier split units' slots and one per earlier unsplit unit)
        const int slot0 = at[0] - (run.first + k) + at[1];
        const SplitUnit su{w[k], piece_tiles[k], pieces[k], at[0], slot0, at[1], few ? at[2] : at[3]};
        if (su.unit < sz.max_units) out.units[su.unit] = PlanUnit{w[k].b, w[k].row0, slot0, pieces[k]};
        if (record < kSplitRecords) s.split[record] = su;
        else write_split_unit(out, sz, su, 0, 1);  // (more split units than threads in one round)
        ++record;
      }
      at[0] += pieces[k];
      at[1] += split;
      at[2] += split && few ? w[k].rows : 0;
      at[3] += split && !few ? w[k].rows : 0;
    }
    const int records = min(total[1], kSplitRecords);
    if (records > 0) {
      __syncthreads();  // s.split is written
      const int shift = 31 - __clz(kPlanThreads / records);  // 2^shift threads per split unit
      const int r = threadIdx.x >> shift;
      if (r < records) write_split_unit(out, sz, s.split[r], threadIdx.x & ((1 << shift) - 1), 1 << shift);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) done[i] += total[i];
    start = run.next;
  }
  if (threadIdx.x == 0) {
    // Within the capacities by construction (attention_plan_sizes); clamped so that no launch reads
    // past them whatever the lengths.
    plan[kPlanItems] = min(done[0], sz.max_items);
    plan[kPlanFewRows] = min(done[2], sz.max_rows);
    plan[kPlanManyRows] = min(done[3], sz.max_rows);
    plan[kPlanChunk] = chunk;
    plan[kPlanUnits] = min(done[1], sz.max_units);
  }
}

// (One CTA per launch: without the 1, ptxas budgets registers for two CTAs per SM and spills.)
__global__ void __launch_bounds__(kPlanThreads, 1) attention_plan_kernel(const AttentionParams p, int* plan) {
  __shared__ PlanShared s;
  const Batch batch = batch_of(p, s);
  const int slots = p.plan_sizes.target_ctas;
  const bool search = searches_chunk(batch.units, slots);

  // The batch's work in tiles, and its longest unit (a one-round plan keeps its units for the items).
  Unit w[kUnitsPerThread] = {};
  long long work = 0;
  int longest = 0;
  for (int start = 0; start < batch.units;) {
    const Run run = run_of<kUnitsPerThread>(start, batch.units);
    load_units(p, batch, run, w);
#pragma unroll
    for (int k = 0; k < kUnitsPerThread; ++k) {
      if (k >= run.count) continue;
      const int t = w[k].tiles();
      if (search) s.cost[run.first + k] = t;
      work += t;
      longest = max(longest, t);
    }
    start = run.next;
  }
  block_work(work, longest, s);
  write_plan(p, plan, s, batch, chunk_of(work, longest, batch.units, slots, s), w);
}

}  // namespace

Status launch_attention_plan(const AttentionParams& p, cudaStream_t stream) {
  attention_plan_kernel<<<1, kPlanThreads, 0, stream>>>(p, const_cast<int*>(p.plan));
  return cudaPeekAtLastError() == cudaSuccess ? Status::kOk : Status::kCudaError;
}

}  // namespace attention_detail
}  // namespace mla_kv
