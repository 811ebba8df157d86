// The indexer's top-k: a radix select on the order-preserving uint32 image of each logit.
//
// Per row: three rounds of histograms (digits of 11, 11 and 10 bits, most significant first) narrow
// the k-th largest key down to one value T and the count of keys equal to T still to take; a last
// pass then writes every position whose key is above T and the first of those equal to T in position
// order (a block-wide ballot scan, so the tie rule is exact and the output deterministic).
//
// Why split a row over several CTAs: one decode token's 128 K logits take a single CTA about four
// passes over 512 KB, far more than the score kernel's few microseconds. A row is cut into `splits`
// chunks of consecutive positions, one CTA each; each round's per-CTA histograms are added into the
// row's histogram in the workspace (global atomics), and the row's CTAs wait for each other (an
// arrival counter) before reading it back. In the last round each CTA also publishes its own
// histogram as suffix sums and its count of keys above the round's bucket, which tells every CTA,
// once T is known, how many selected keys the chunks before it hold: no further barrier. The CTAs of a
// row must all be resident at once: the host keeps a row's splits within what the device holds at
// once, and the CTAs of a row are consecutive in the grid (blocks start in grid order, so a row's
// first CTAs never wait on CTAs that cannot start). The last CTA of a row to finish zeroes the row's
// counters and histograms, so the next launch (a CUDA-graph replay) starts from zero again.
//
// A chunk of at most kMaxChunk keys stays in shared memory after the first round (kCached); longer
// chunks (many rows: one CTA per row) are read again from global memory (L2) in each round.
#pragma once

#include <climits>
#include <cstdint>

#include "../address.cuh"
#include "mla_kv/indexer.h"

namespace mla_kv {
namespace index_topk_detail {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxChunk = 8192;  // keys a CTA keeps in shared memory: 32 KB
constexpr int kMinChunk = 1024;  // a shorter chunk would spend its CTA on barriers, not on keys
constexpr int kMaxSplits = 128;
constexpr int kRounds = 3;
constexpr int kMaxBins = 2048;
constexpr int kLastBins = 1024;  // the last round's 10-bit digit
constexpr int kUnroll = 4;       // loads each thread has in flight in a histogram pass

// Workspace of a split row, in 32-bit words: the arrival and exit counters (padded to 128 bytes), the
// three rounds' histograms, then per split its count of keys above the last round's bucket and that
// bucket's suffix sums.
constexpr int kCounterWords = 32;
constexpr int kHistWords = kMaxBins + kMaxBins + kLastBins;
constexpr int kSlotWords = 4 + kLastBins;  // [above, pad x 3, suffix sums]

__host__ __device__ constexpr int64_t row_state_words(int splits) {
  return kCounterWords + kHistWords + int64_t(splits) * kSlotWords;
}

__device__ __forceinline__ int digit_shift(int round) { return round == 0 ? 21 : round == 1 ? 10 : 0; }
__device__ __forceinline__ int digit_bits(int round) { return round == kRounds - 1 ? 10 : 11; }
__device__ __forceinline__ int hist_offset(int round) { return round * kMaxBins; }

// Larger float, larger key; NaN maps to -inf's key and -0 to +0's.
__device__ __forceinline__ uint32_t order_key(float v) {
  uint32_t u = __float_as_uint(v);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) u = 0xFF800000u;  // by its bits: fast-math builds keep the rule
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct Launch {
  int splits;                // CTAs per row
  uint32_t* workspace;       // splits > 1: row r's state at workspace + r * row_state_words(splits)
};

// The row's sequence and how many leading positions it sees (clamped to [0, max_kv_len]); false for a
// row outside every sequence.
__device__ __forceinline__ bool locate_row(const IndexTopkParams& p, int64_t row, int& seq, int& visible) {
  int64_t last;
  if (p.cu_q_lens == nullptr) {
    if (row >= p.batch) return false;
    seq = int(row);
    last = int64_t(p.kv_lens[seq]) - 1;
  } else {
    if (row >= p.cu_q_lens[p.batch]) return false;
    seq = sequence_of(p.cu_q_lens, p.batch, row);
    const int first = p.cu_q_lens[seq], q_len = p.cu_q_lens[seq + 1] - first;
    last = int64_t(p.kv_lens[seq]) - q_len + (row - first);
  }
  const int64_t n = last + 1 < 0 ? 0 : (last + 1 > p.max_kv_len ? p.max_kv_len : last + 1);
  visible = int(n);
  return true;
}

// What the row's output names for a position: itself, or its physical slot (-1 where the table has none).
__device__ __forceinline__ int output_index(const IndexTopkParams& p, int seq, int pos) {
  if (p.block_table == nullptr) return pos;
  const int column = pos / p.page_size;
  if (column >= p.max_blocks) return -1;
  const int block = p.block_table[int64_t(seq) * p.block_table_stride + column];
  if (block < 0) return -1;
  const int64_t slot = int64_t(block) * p.page_size + (pos - column * p.page_size);
  return slot > INT_MAX ? -1 : int(slot);
}

// In place: bins[b] <- bins[b] + bins[b + 1] + ... + bins[kThreads * kPerThread - 1]. Thread t owns
// bins [t * kPerThread, (t + 1) * kPerThread).
template <int kPerThread>
__device__ void suffix_sums(int* bins, int* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int* own = bins + threadIdx.x * kPerThread;
  int tail[kPerThread];
  int mine = 0;
#pragma unroll
  for (int i = kPerThread - 1; i >= 0; --i) {
    mine += own[i];
    tail[i] = mine;
  }
  int from_lane = mine;  // this lane's bins and every later lane's of the warp
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int later = __shfl_down_sync(0xffffffffu, from_lane, d);
    if (lane + d < 32) from_lane += later;
  }
  if (lane == 0) warp_sums[warp] = from_lane;
  __syncthreads();
  int after = from_lane - mine;
  for (int w = warp + 1; w < kWarps; ++w) after += warp_sums[w];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) own[i] = tail[i] + after;
  __syncthreads();
}

// The CTA's total of v (every thread gets it).
__device__ __forceinline__ int block_sum(int v, int* warp_sums) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
  __syncthreads();
  int total = 0;
  for (int w = 0; w < kWarps; ++w) total += warp_sums[w];
  __syncthreads();
  return total;
}

// The bucket holding the `remaining`-th largest key, from suffix sums (non-increasing, bins[0] >=
// remaining): the largest b with bins[b] >= remaining. -> (b, keys in the buckets above b).
__device__ __forceinline__ void find_bucket(const int* suffix, int bins, int remaining, int* found) {
  for (int b = threadIdx.x; b < bins; b += kThreads) {
    const int above = b + 1 < bins ? suffix[b + 1] : 0;
    if (suffix[b] >= remaining && above < remaining) {
      found[0] = b;
      found[1] = above;
    }
  }
  __syncthreads();
}

// A load past L1: the row's histograms and slots are written by the row's other CTAs (through L2).
__device__ __forceinline__ int load_from_l2(const uint32_t* address) {
  uint32_t v;
  asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(address) : "memory");
  return int(v);
}

// All CTAs of the row have arrived `count` times.
__device__ __forceinline__ void row_barrier(uint32_t* arrived, uint32_t count) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(arrived, 1u);
    while (*reinterpret_cast<volatile uint32_t*>(arrived) < count) __nanosleep(64);
    __threadfence();
  }
  __syncthreads();
}

template <bool kCached>
__global__ void __launch_bounds__(kThreads) index_topk_kernel(const IndexTopkParams p, const Launch launch) {
  __shared__ uint32_t keys_s[kCached ? kMaxChunk : 1];
  __shared__ int hist_s[kMaxBins];
  __shared__ int warp_s[2][2][kWarps];  // write pass: [tile parity][above, equal][warp]
  __shared__ int found_s[2];
  __shared__ int bases_s[2];
  __shared__ bool last_s;

  const int splits = launch.splits;
  const int64_t row = blockIdx.x / splits;
  const int split = int(blockIdx.x % splits);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int* out = p.indices + row * p.indices_stride;

  int seq = 0, n = 0;
  if (!locate_row(p, row, seq, n)) {
    if (split == 0)
      for (int i = tid; i < p.k; i += kThreads) out[i] = -1;
    return;
  }
  if (n <= p.k) {  // every visible position, the same decision in all the row's CTAs
    if (split == 0)
      for (int i = tid; i < p.k; i += kThreads) out[i] = i < n ? output_index(p, seq, i) : -1;
    return;
  }

  const int chunk = (n + splits - 1) / splits;
  const int begin = split * chunk < n ? split * chunk : n;
  const int len = (begin + chunk < n ? begin + chunk : n) - begin;
  const float* logits = p.logits + row * p.logits_stride + begin;
  uint32_t* state = splits > 1 ? launch.workspace + row * row_state_words(splits) : nullptr;

  uint32_t prefix = 0;  // the digits of T found so far
  int remaining = p.k;  // keys still to take from the bucket of `prefix`
  for (int round = 0; round < kRounds; ++round) {
    const int shift = digit_shift(round), bins = 1 << digit_bits(round);
    const int high = shift + digit_bits(round);  // keys >> high are the digits already fixed
    for (int b = tid; b < bins; b += kThreads) hist_s[b] = 0;
    __syncthreads();
    int above_bucket = 0;  // this thread's keys above the bucket of `prefix` (counted in the last round)
    for (int base = 0; base < len; base += kUnroll * kThreads) {
      uint32_t key[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * kThreads + tid;
        if (i < len) key[u] = (kCached && round > 0) ? keys_s[i] : order_key(__ldg(logits + i));
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * kThreads + tid;
        if (i >= len) continue;
        if (kCached && round == 0) keys_s[i] = key[u];
        const uint32_t fixed = round == 0 ? 0u : key[u] >> high;
        if (fixed == prefix) atomicAdd(&hist_s[(key[u] >> shift) & (bins - 1)], 1);
        else if (fixed > prefix) ++above_bucket;
      }
    }
    __syncthreads();

    if (splits > 1) {
      uint32_t* row_hist = state + kCounterWords + hist_offset(round);
      for (int b = tid; b < bins; b += kThreads)
        if (hist_s[b] != 0) atomicAdd(row_hist + b, uint32_t(hist_s[b]));
      if (round == kRounds - 1) {  // publish this chunk's last-round counts for the CTAs after it
        uint32_t* slot = state + kCounterWords + kHistWords + int64_t(split) * kSlotWords;
        const int above = block_sum(above_bucket, &warp_s[0][0][0]);
        suffix_sums<kLastBins / kThreads>(hist_s, &warp_s[1][0][0]);
        for (int b = tid; b < kLastBins; b += kThreads) slot[4 + b] = uint32_t(hist_s[b]);
        if (tid == 0) slot[0] = uint32_t(above);
      }
      row_barrier(state, uint32_t(splits) * (round + 1));
      for (int b = tid; b < bins; b += kThreads) hist_s[b] = load_from_l2(row_hist + b);
      __syncthreads();
    }
    if (bins == kMaxBins) suffix_sums<kMaxBins / kThreads>(hist_s, &warp_s[0][0][0]);
    else suffix_sums<kLastBins / kThreads>(hist_s, &warp_s[0][0][0]);
    find_bucket(hist_s, bins, remaining, found_s);
    prefix = (prefix << digit_bits(round)) | uint32_t(found_s[0]);
    remaining -= found_s[1];
    __syncthreads();  // found_s is read by all before the next round rewrites hist_s and found_s
  }
  const uint32_t threshold = prefix;
  const int taken_above = p.k - remaining;  // keys above T in the whole row
  // The ranks are exact, so these bounds never cut a correct selection; they keep a workspace that was
  // not zeroed (inconsistent histograms) from writing outside the row.
  const int above_limit = taken_above < p.k ? taken_above : p.k;

  // Selected keys in the chunks before this one: above T, and equal to T.
  if (tid == 0) bases_s[0] = bases_s[1] = 0;
  __syncthreads();
  if (splits > 1 && tid < split) {
    const uint32_t* slot = state + kCounterWords + kHistWords + int64_t(tid) * kSlotWords;
    const int low = int(threshold & (kLastBins - 1));
    const int at = load_from_l2(slot + 4 + low), past = low + 1 < kLastBins ? load_from_l2(slot + 5 + low) : 0;
    atomicAdd(&bases_s[0], load_from_l2(slot) + past);
    atomicAdd(&bases_s[1], at - past);
  }
  __syncthreads();
  int before_above = bases_s[0], before_equal = bases_s[1];

  // The write pass, in tiles of kThreads consecutive positions.
  const uint32_t lanes_before = (1u << lane) - 1u;
  for (int start = 0, tile = 0; start < len; start += kThreads, ++tile) {
    const int i = start + tid;
    uint32_t key = 0;
    if (i < len) key = kCached ? keys_s[i] : order_key(__ldg(logits + i));
    const bool above = i < len && key > threshold, equal = i < len && key == threshold;
    const uint32_t above_mask = __ballot_sync(0xffffffffu, above), equal_mask = __ballot_sync(0xffffffffu, equal);
    int(&counts)[2][kWarps] = warp_s[tile & 1];
    if (lane == 0) {
      counts[0][warp] = __popc(above_mask);
      counts[1][warp] = __popc(equal_mask);
    }
    __syncthreads();
    int rank_above = before_above + __popc(above_mask & lanes_before);
    int rank_equal = before_equal + __popc(equal_mask & lanes_before);
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) {
        rank_above += counts[0][w];
        rank_equal += counts[1][w];
      }
      before_above += counts[0][w];
      before_equal += counts[1][w];
    }
    const int equal_at = taken_above + rank_equal;
    if (above && rank_above < above_limit) out[rank_above] = output_index(p, seq, begin + i);
    if (equal && rank_equal < remaining && equal_at >= 0 && equal_at < p.k)
      out[equal_at] = output_index(p, seq, begin + i);
  }

  if (splits > 1) {  // the row's last CTA to finish leaves its state zeroed for the next launch
    __syncthreads();
    if (tid == 0) {
      __threadfence();
      last_s = atomicAdd(state + 1, 1u) == uint32_t(splits) - 1;
    }
    __syncthreads();
    if (last_s) {
      __threadfence();
      // Histograms and every split's slot: the others have read the slots before they counted out.
      const int64_t words = row_state_words(splits) - kCounterWords;
      for (int64_t w = tid; w < words; w += kThreads) state[kCounterWords + w] = 0;
      if (tid == 0) state[0] = state[1] = 0;
    }
  }
}

}  // namespace index_topk_detail
}  // namespace mla_kv
