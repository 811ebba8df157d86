// Hopper variant of the absorbed MLA attention (common.cuh has the CTA/work split and softmax pieces):
// both products run on wgmma, and a CTA of 64 query rows holds its 64 x 512 fp32 output in two
// warpgroups' registers, warpgroup g owning columns 256 g .. 256 g + 255 (O_g).
//
// Tiles of 64 tokens come in pairs, one per warpgroup, in a "seesaw" (after FlashMLA's published
// schedule) that keeps one warpgroup's softmax under the other's tensor work:
//   warpgroup 0: S0 = Q.K0^T; softmax (running max m -> m0); P0 to shared memory;
//                O_0 = O_0 a0 + P0.V0_0; then, with m1 from warpgroup 1, O_0 = O_0 a1 + P1.V1_0
//   warpgroup 1: S1 = Q.K1^T (while warpgroup 0 scores); with m0: O_1 = O_1 a0 + P0.V0_1,
//                softmax of S1 (m0 -> m1) under that product; P1 to shared memory;
//                O_1 = O_1 a1 + P1.V1_1
// A warpgroup's own P is the A operand straight from registers; the other's is read from shared
// memory (P0 in its own buffer, P1 over tile 1's rope chunk, which only the scores read).
//
// A tile is copied in two halves, the parts each warpgroup's own products read last: the latent
// chunks 0..3 with the rope chunk (warpgroup 0's), the latent chunks 4..7 (warpgroup 1's). A half
// is refilled with the next pair's tile as soon as its last reader is done, and an mbarrier per
// half and stage says when it has landed. Three copy paths:
//   - TMA (paged caches whose tiles are whole boxes of a tensor map, make_tile_map): a third
//     warpgroup hands its registers to the math warpgroups, and one of its threads issues every
//     copy; "freed" mbarriers tell it when a half may be overwritten. Boxes read whole blocks, so
//     rows past the sequence's end are zeroed in shared memory before P.V (zero_tail).
//   - cp.async (block pointers, other paged caches): each math warpgroup copies its own half.
//   - dequantize (quantized caches): the TMA variant's warpgroups, the third one's 128 threads reading
//     each half's bytes by cp.async and dequantizing them into T in place (dequantize_tiles), so
//     the products are the 16-bit ones and the math warpgroups never wait on a load (loads into
//     their registers spilled beside the accumulators: RESULTS.md, quantized decode).
// Q, the tiles and P are kept in the 128-byte swizzled layout wgmma reads (arch/wgmma.cuh).
#pragma once

#include <type_traits>
#include <cuda.h>

#include "../arch/wgmma.cuh"
#include "../dequant.cuh"
#include "attention_launch.h"
#include "attention_sm90_narrow.cuh"
#include "common.cuh"
#include "tensor_map.h"

namespace mla_kv {
namespace attention_detail {
namespace sm90 {

constexpr int kRows = 64;                         // query rows per CTA: one wgmma M
constexpr int kTokens = 64;                       // cache rows per tile
constexpr int kThreads = 256;                     // two warpgroups
constexpr int kGroupThreads = 128;
constexpr int kChunks = kRowDim / 64;             // 64-column chunks of a 576-wide row
constexpr int kRopeChunk = kLatentDim / 64;       // 8
constexpr int kChunkBytes = 64 * arch::kSwizzleRowBytes;  // one chunk of 64 rows
constexpr int kTileBytes = kChunks * kChunkBytes;          // 64 rows x 576 (Q or one tile)
constexpr int kRowsPerWarp = kTokens / 4;                  // tile rows a warp of a warpgroup copies
constexpr int kOutCols = kLatentDim / 2;                   // output columns per warpgroup
// Named barriers (id, threads). Each shared-memory handoff between the two math warpgroups is ordered
// by one of them; bar.arrive orders the arriving threads' earlier shared-memory accesses before the
// waiting threads' later ones, as bar.sync does (PTX ISA, "bar, barrier"):
//   max_s[0]  written by warpgroup 0 (publish_max(0)) before arrive(kProbs0Ready, 256), read by
//             warpgroup 1 (adopt_max(0)) after sync(kProbs0Ready, 256); warpgroup 0 writes it again
//             (next pair) only after sync(kProbs1Ready, 256), which warpgroup 1 arrives at after its read.
//   max_s[1]  written by warpgroup 1 (publish_max(1)) before arrive(kProbs1Ready, 256), read by
//             warpgroup 0 (adopt_max(1)) after sync(kProbs1Ready, 256); warpgroup 1 writes it again
//             only after sync(kScores0Done, 256) of the next pair, which warpgroup 0 arrives at after
//             its read.
//   sum_s     both warpgroups write their half, then sync(kMathSync, 256), then read both halves.
// compute-sanitizer's racecheck reports these pairs as hazards (scripts/sanitize-allow.txt says
// where); the score-jump tests (a running max that moves in the second tile of a pair, so a stale or
// early-read max_s gives a wrong rescale) are what catches a broken handoff.
constexpr int kProbs0Ready = 1, kProbs1Ready = 2, kScores0Done = 3;
constexpr int kMathSync = 4, kTailZeroed = 5;  // (kTailZeroed + warpgroup: one per warpgroup)

// TMA variant (paged caches whose tiles are whole boxes of a tensor map): a third warpgroup, of
// which one thread issues every tile copy, hands most of its registers to the math warpgroups.
constexpr int kTmaThreads = kThreads + 128;
constexpr int kMathRegisters = 240, kCopyRegisters = 24;
static_assert((2 * kMathRegisters + kCopyRegisters) * 128 <= (65536 / kTmaThreads) / 8 * 8 * kTmaThreads,
              "the CTA's register pool");

// Shared memory (offsets from a 1024-byte aligned base: swizzle atoms must start on one).
constexpr size_t kQOffset = 0;
constexpr size_t kKvOffset = kTileBytes;                    // two tile stages
constexpr size_t kProbOffset = kKvOffset + 2 * size_t(kTileBytes);  // P0
constexpr size_t kStatsOffset = kProbOffset + kChunkBytes;
constexpr size_t kBarrierOffset = kStatsOffset + 4 * kRows * sizeof(float);
// Rows that mask missing rows (sparse indices): which of a tile's 64 rows exist, in 4 slots by tile
// number (a tile's bits are written with its copy, at most 2 tiles ahead of its softmax).
constexpr size_t kValidOffset = kBarrierOffset + 8 * sizeof(uint64_t);
constexpr int kValidSlots = 4;
constexpr size_t kBytes = kValidOffset + kValidSlots * sizeof(uint64_t) + arch::kSwizzleAtomBytes;
static_assert(kBytes <= size_t(kSmemHopper.per_block), "Hopper's shared memory per CTA (H100 / H200)");

template <class T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  arch::Vec<T, 2> v;
  v.v[0] = arch::from_float<T>(lo);
  v.v[1] = arch::from_float<T>(hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ int tiles_of(const Work& w) {
  return w.kv_hi > w.kv_lo ? (w.kv_hi - w.kv_lo + kTokens - 1) / kTokens : 0;
}

// The block of each TMA box (min(64, block_size) rows) of the tile starting at kv position
// `first`, `num_blocks` (past the map's end: TMA reads zeros) for boxes outside the table. Loaded
// a tile ahead, so that the copy thread does not wait on the block table before each copy;
// positions past the sequence's end are checked when a box is issued. (PagedTableRows::block_base
// does the same lookup for a row address; sharing one helper changed the code generated for the
// measured kernels' main loops, so the id is looked up here.)
constexpr int kMaxBoxes = kTokens / 16;  // TMA tiles need blocks of >= 16 rows
__device__ __forceinline__ void tile_blocks(const PagedTableRows& rows, int b, int first, int (&blocks)[kMaxBoxes]) {
  const int block_size = rows.cache.block_size, box_rows = min(kTokens, block_size);
#pragma unroll
  for (int k = 0; k < kMaxBoxes; ++k) {
    blocks[k] = int(rows.cache.num_blocks);
    const int i = block_index(first + k * box_rows, block_size);
    if (k * box_rows < kTokens && i < rows.max_blocks) {
      const int id = rows.block_table[b * rows.block_table_stride + i];
      if (id >= 0 && id < rows.cache.num_blocks) blocks[k] = id;
    }
  }
}

// The TMA variant's copy thread: every tile of the CTA's kv range, half by half (the halves the
// math warpgroups free separately), into its stage once that half's readers have freed it.
// `blocks`: tile_blocks of the first tile.
__device__ __forceinline__ void copy_tiles_tma(const PagedTableRows& rows, const Work& w, const CUtensorMap& map,
                                               unsigned char* kv_s, uint64_t* landed, uint64_t* freed,
                                               int (&blocks)[kMaxBoxes]) {
  const int block_size = rows.cache.block_size, box_rows = min(kTokens, block_size);
  const int past_end = int(rows.cache.num_blocks);
  const int tiles = tiles_of(w);
  for (int t = 0; t < tiles; ++t) {
    const int stage = t & 1, use = t >> 1, first = w.kv_lo + t * kTokens;
#pragma unroll 1
    for (int half = 0; half < 2; ++half) {
      if (use > 0) arch::mbarrier_wait(&freed[2 * stage + half], (use - 1) & 1);
      uint64_t* bar = &landed[2 * stage + half];
      const int chunks = half == 0 ? 5 : 4;
      arch::mbarrier_arrive_expect(bar, chunks * kChunkBytes);
#pragma unroll
      for (int k = 0; k < kMaxBoxes; ++k) {
        const int r = k * box_rows, pos = first + r;
        if (r >= kTokens) break;
        const int block = pos < w.kv_hi ? blocks[k] : past_end;
        const int row = block_offset(pos, block_size);
        for (int c = 0; c < chunks; ++c) {
          const int chunk = half == 1 ? 4 + c : c < 4 ? c : kRopeChunk;
          arch::tma_load_3d(kv_s + stage * kTileBytes + chunk * kChunkBytes + r * arch::kSwizzleRowBytes, &map,
                            stored_column(rows.cache.row, chunk * 64), row, block, bar);
        }
      }
    }
    if (t + 1 < tiles) tile_blocks(rows, w.b, first + kTokens, blocks);  // waited for at the next copy
  }
}

// Quantized caches: the third warpgroup (as TMA's copy warpgroup, with the registers of
// kQuantCopyRegisters) moves every tile, half by half as the math warpgroups free them. A half's bytes
// go by cp.async into the back of the half's own 16-bit region (chunks 4 h .. 4 h + 3, block-major:
// chunk c's 64 rows together; the rope's at the back of the rope chunk), then are dequantized in
// place, each chunk written once the bytes it lands on have been read by every thread (named
// barriers of the copy warpgroup): chunks 0 and 1 below the raw bytes, chunk 2 over chunk 0 and 1's,
// the rope and chunk 3 over their own. Thread i owns tile row i / 2 and values 32 (i % 2) ..
// + 31 of each of its 64-column chunks. The bytes of the next half are in flight while one is
// dequantized when it is free (no further: the math warpgroups free tile t + 2's second half only
// once tile t + 1 has landed). Rows past the sequence's end read as zero bytes with a zero scale:
// their values are 0.
constexpr int kDequantBarrier = kTailZeroed + 2;  // the copy warpgroup's own (kTailZeroed + warpgroup: 5, 6)
constexpr int kQuantMathRegisters = 208, kQuantCopyRegisters = 88;
static_assert((2 * kQuantMathRegisters + kQuantCopyRegisters) * 128 <= (65536 / kTmaThreads) / 8 * 8 * kTmaThreads,
              "the CTA's register pool");

// Bytes of one row's 64 latent values of a chunk, and of its 64 rope values, in format F.
template <KvFormat F>
struct QuantRow {
  static constexpr int kChunkRowBytes = F == KvFormat::kInt4 ? 32 : 64;
  static constexpr int kRopeRowBytes = F == KvFormat::kFp8DsMla ? 128 : kChunkRowBytes;
};

// Raw8 number i of a thread's 32 values of a row (dequant.cuh's units of 8 values) in shared memory.
template <KvFormat F>
__device__ __forceinline__ dequant::Raw8<F> raw8_at(const unsigned char* src, int i, bool rope) {
  if constexpr (F == KvFormat::kInt4) {
    return reinterpret_cast<const uint32_t*>(src)[i];
  } else if constexpr (F == KvFormat::kFp8DsMla) {
    if (rope) return reinterpret_cast<const uint4*>(src)[i];
    const uint2 u = reinterpret_cast<const uint2*>(src)[i];
    return make_uint4(u.x, u.y, 0u, 0u);
  } else {
    return reinterpret_cast<const uint2*>(src)[i];
  }
}

template <class T, KvFormat F, class Rows>
__device__ __forceinline__ void dequantize_tiles(const Rows& rows, const Work& w, unsigned char* kv_s, uint64_t* landed,
                                                 uint64_t* freed, uint16_t* valid_s, const void* zero_src, int thread) {
  using Q = QuantRow<F>;
  constexpr bool kTrailer = F == KvFormat::kInt8 || F == KvFormat::kInt4;
  const RowLayout& layout = rows.cache.row;
  const int r = thread / 2, side = thread % 2;
  auto latent_raw = [&](int stage, int half) {  // chunk c's raw rows start at + c * 64 * Q::kChunkRowBytes
    return kv_s + stage * kTileBytes + (4 * half + 4) * kChunkBytes - 4 * kTokens * Q::kChunkRowBytes;
  };
  auto rope_raw = [&](int stage) {
    return kv_s + stage * kTileBytes + (kRopeChunk + 1) * kChunkBytes - kTokens * Q::kRopeRowBytes;
  };
  // Copies row r's bytes of (tile t, half) (this thread's half of them) and returns what its values
  // are scaled by: int8 / int4's (scale, zero); fp8_ds_mla's tile scales of the half; fp8: kv_scale.
  auto issue = [&](int t, int half) -> float2 {
    const int stage = t & 1, pos = w.kv_lo + t * kTokens + r;
    const RowRef ref = pos < w.kv_hi ? rows.locate(w.b, pos) : RowRef{nullptr, 0};
    const char* row = row_at(rows, ref);
    if constexpr (Rows::kMasksMissing) {
      // The tile's bits, before the arrive on its landed barrier (the waiters' acquire): warp k of
      // the copy warpgroup holds rows 16 k .. 16 k + 15, two lanes (sides) each.
      if (half == 0) {
        uint32_t bits = __ballot_sync(0xffffffffu, row != nullptr) & 0x55555555u;  // side 0's lanes
        bits = (bits | (bits >> 1)) & 0x33333333u;
        bits = (bits | (bits >> 2)) & 0x0f0f0f0fu;
        bits = (bits | (bits >> 4)) & 0x00ff00ffu;
        bits = (bits | (bits >> 8)) & 0x0000ffffu;
        if (thread % 32 == 0) valid_s[4 * (t % kValidSlots) + thread / 32] = uint16_t(bits);
      }
    }
    constexpr int kUnits = 2 * Q::kChunkRowBytes / 16;  // this side's chunks 2 side, 2 side + 1
#pragma unroll
    for (int u = 0; u < kUnits; ++u) {
      const int c = 2 * side + u / (Q::kChunkRowBytes / 16), byte = (u % (Q::kChunkRowBytes / 16)) * 16;
      const int e = stored_column(layout, 256 * half + 64 * c);
      arch::cp_async_16(latent_raw(stage, half) + c * kTokens * Q::kChunkRowBytes + r * Q::kChunkRowBytes + byte,
                        row ? row + dequant::vector_byte(F, e) + byte : zero_src, row != nullptr);
    }
    if (half == 0) {
      const int e = stored_column(layout, kLatentDim);
#pragma unroll
      for (int u = 0; u < Q::kRopeRowBytes / 32; ++u) {
        const int byte = side * (Q::kRopeRowBytes / 2) + u * 16;
        arch::cp_async_16(rope_raw(stage) + r * Q::kRopeRowBytes + byte,
                          row ? row + dequant::vector_byte(F, e) + byte : zero_src, row != nullptr);
      }
    }
    arch::cp_async_commit();
    if (row == nullptr) return make_float2(0.f, 0.f);
    if constexpr (kTrailer) {
      return dequant::scale_zero<T>(__ldg(reinterpret_cast<const unsigned*>(trailer_at(rows, ref))));
    } else if constexpr (F == KvFormat::kFp8DsMla) {
      return __ldg(reinterpret_cast<const float2*>(row + dequant::kDsScalesOffset) + half);
    } else {
      return make_float2(layout.kv_scale, 0.f);
    }
  };
  using Raw = dequant::Raw8<F>[4];
  auto load = [&](const unsigned char* src, bool rope, Raw& raw) {
#pragma unroll
    for (int q = 0; q < 4; ++q) raw[q] = raw8_at<F>(src, q, rope);
  };
  auto store = [&](const Raw& raw, bool rope, float scale, float zero, unsigned char* chunk) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      float v[8];
      dequant::values8<arch::Sm90, F>(raw[q], rope, scale, zero, v);
      *reinterpret_cast<arch::Vec<T, 8>*>(chunk + arch::swizzled_offset(r, 4 * side + q)) = dequant::to_vec<T>(v);
    }
  };
  // Chunk c's scale: int8 / int4's row scale, fp8_ds_mla's tile (2 half + c / 2), fp8's kv_scale.
  auto scale_of = [&](float2 s, int c) { return F == KvFormat::kFp8DsMla && c >= 2 ? s.y : s.x; };
  auto dequantize = [&](int t, int half, float2 s) {
    const int stage = t & 1;
    unsigned char* dst = kv_s + stage * kTileBytes + 4 * half * kChunkBytes;
    const unsigned char* raw_rows = latent_raw(stage, half) + r * Q::kChunkRowBytes + side * (Q::kChunkRowBytes / 2);
    const float zero = kTrailer ? s.y : 0.f;
    arch::named_barrier_sync(kDequantBarrier, kGroupThreads);  // every thread's bytes have landed
    auto chunk = [&](int c) {
      Raw raw;
      load(raw_rows + c * kTokens * Q::kChunkRowBytes, false, raw);
      store(raw, false, scale_of(s, c), zero, dst + c * kChunkBytes);
    };
    chunk(0);
    chunk(1);
    arch::named_barrier_sync(kDequantBarrier, kGroupThreads);  // fp8 / int8: chunk 2 lands on 0 and 1's bytes
    chunk(2);
    // The rope and chunk 3 land on their own bytes: each is held in registers (one at a time) while
    // the other threads read theirs.
    if (half == 0) {
      Raw rope;
      load(rope_raw(stage) + r * Q::kRopeRowBytes + side * (Q::kRopeRowBytes / 2), true, rope);
      arch::named_barrier_sync(kDequantBarrier, kGroupThreads);
      store(rope, true, s.x, zero, kv_s + stage * kTileBytes + kRopeChunk * kChunkBytes);
    }
    Raw last;
    load(raw_rows + 3 * kTokens * Q::kChunkRowBytes, false, last);
    arch::named_barrier_sync(kDequantBarrier, kGroupThreads);
    store(last, false, scale_of(s, 3), zero, dst + 3 * kChunkBytes);
    arch::fence_proxy_async();  // the stores are read by wgmma (the async proxy)
    arch::mbarrier_arrive(&landed[2 * stage + half]);
  };
  // Step k puts half k's bytes in flight and dequantizes half k - 1: half k first if the math
  // warpgroups have freed it already (a per-thread choice), else after half k - 1, so that the
  // dequantization never waits on the math warpgroups.
  const int steps = 2 * tiles_of(w);
  float2 pending = make_float2(0.f, 0.f);
#pragma unroll 1
  for (int k = 0; k <= steps; ++k) {
    const int t = k / 2, half = k % 2, use = t >> 1;
    uint64_t* free_k = &freed[2 * (t & 1) + half];
    const bool early = k < steps && (use == 0 || arch::mbarrier_done(free_k, (use - 1) & 1));
    float2 s = make_float2(0.f, 0.f);
    if (early) s = issue(t, half);
    if (k > 0) {
      if (early) arch::cp_async_wait<1>(); else arch::cp_async_wait<0>();
      dequantize((k - 1) / 2, (k - 1) % 2, pending);
    }
    if (k < steps && !early) {
      arch::mbarrier_wait(free_k, (use - 1) & 1);
      s = issue(t, half);
    }
    pending = s;
  }
}

// A third (copy) warpgroup moves the tiles of the TMA variant and of a quantized cache.
constexpr bool has_copy_group(bool tma, KvFormat f) { return tma || f != KvFormat::kNone; }
constexpr int threads_of(bool tma, KvFormat f) { return has_copy_group(tma, f) ? kTmaThreads : kThreads; }

// kTma: tiles arrive by TMA through `tile_map` (a 3-D map [num_blocks][block_size][576] of a
// paged cache, 128-byte swizzled boxes of 64 columns x min(64, block_size) rows); a quantized cache
// (kFormat) is dequantized by the copy warpgroup (dequantize_tiles); otherwise the math warpgroups
// copy 16-bit rows by cp.async.
template <class T, class Rows, bool kTma, KvFormat kFormat>
__global__ void __launch_bounds__(threads_of(kTma, kFormat), 1)
    attention_wgmma_kernel(const AttentionParams p, const Rows rows, const __grid_constant__ CUtensorMap tile_map) {
  constexpr bool kQuant = kFormat != KvFormat::kNone, kCopyGroup = has_copy_group(kTma, kFormat);
  static_assert(!(kTma && kQuant), "TMA copies 16-bit tiles only");
  if constexpr (arch::target_supports<arch::Sm90>()) {
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = arch::aligned_smem(smem_raw);
    unsigned char* q_s = smem + kQOffset;
    unsigned char* kv_s = smem + kKvOffset;
    unsigned char* p0_s = smem + kProbOffset;
    unsigned char* p1_s = kv_s + kTileBytes + kRopeChunk * kChunkBytes;
    float* max_s = reinterpret_cast<float*>(smem + kStatsOffset);  // [tile of the pair][kRows]: m0, m1
    float* sum_s = max_s + 2 * kRows;                               // [warpgroup][kRows]: row sums
    uint64_t* landed = reinterpret_cast<uint64_t*>(smem + kBarrierOffset);  // [stage][half]: copied
    uint64_t* freed = landed + 4;  // [stage][half]: read (TMA variant)
    uint16_t* valid_s = reinterpret_cast<uint16_t*>(smem + kValidOffset);  // [slot][warp of 16 rows]
    constexpr bool kMasks = Rows::kMasksMissing;

    arch::launch_dependents();  // the combine's CTAs may be scheduled now (CombineLaunch::kEarly)
    Work w;
    if (!find_work<kRows>(p, rows, w)) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // Warpgroup index, broadcast from lane 0 so that the compiler knows it is warp-uniform: the wgmma
    // descriptors derived from it then stay in uniform registers.
    const int group = __shfl_sync(0xffffffffu, warp / 4, 0);
    const int rows_here = min(kRows, w.q_len * p.num_heads - w.row0);
    const int tiles = tiles_of(w);
    // The copy thread's first block-table reads go out next to find_work's (kv_len) ones.
    int first_blocks[kMaxBoxes];
    if constexpr (kTma) {
      if (tid == kThreads) tile_blocks(rows, w.b, w.kv_lo, first_blocks);
    }
    if (tid < 4) {
      arch::mbarrier_init(&landed[tid], kTma ? 1 : kGroupThreads);
      arch::mbarrier_init(&freed[tid], kGroupThreads);
    }
    // Q rows -> swizzled smem by cp.async, zeros past the sequence's last row (one group, waited
    // below; the tile copies after it are tracked by the mbarriers alone).
    if (tid < kThreads) {
      for (int v = tid; v < kRows * kVecsPerRow; v += kThreads) {
        const int r = v / kVecsPerRow, c = v - r * kVecsPerRow;
        const T* src = q_row<T>(p, w, r, rows_here);
        arch::cp_async_16(q_s + (c / 8) * kChunkBytes + arch::swizzled_offset(r, c % 8),
                          src ? src + c * 8 : static_cast<const T*>(p.q), src != nullptr);
      }
      arch::cp_async_commit();
    }
    __syncthreads();  // the mbarriers are initialized
    if constexpr (kQuant) {
      if (warp >= kThreads / 32) {
        arch::shrink_registers<kQuantCopyRegisters>();
        dequantize_tiles<T, kFormat>(rows, w, kv_s, landed, freed, valid_s, p.q, tid - kThreads);
        return;
      }
      arch::grow_registers<kQuantMathRegisters>();
    } else if constexpr (kTma) {
      if (warp >= kThreads / 32) {
        arch::shrink_registers<kCopyRegisters>();
        if (tid == kThreads) copy_tiles_tma(rows, w, tile_map, kv_s, landed, freed, first_blocks);
        return;
      }
      arch::grow_registers<kMathRegisters>();
    }

    // Tile copies. Lane t < 16 of the warpgroup's warp q finds the address of tile row 16 q + t;
    // the rows are then copied one per pass, lane l moving 16-byte unit l % 8 of chunk l / 8 of this
    // warpgroup's half (and, warpgroup 0, the rope chunk: 4 rows per pass).
    // Masked rows: warpgroup 0 writes each tile's bits as it issues its copy; the barriers that order
    // the tile's use (kMathSync first, then kProbs1Ready for warpgroup 0's own tiles and kScores0Done
    // for warpgroup 1's) order them before the softmax reads them.
    const int warp_rows = (warp % 4) * kRowsPerWarp;
    auto row_address = [&](int first) -> const char* {
      const int pos = first + warp_rows + lane;
      return (lane < kRowsPerWarp && pos < w.kv_hi) ? row_at(rows, rows.locate(w.b, pos)) : nullptr;
    };
    auto copy_half = [&](int stage, int tile, const char* row_addr) {
      if constexpr (kMasks) {
        const uint32_t bits = __ballot_sync(0xffffffffu, row_addr != nullptr);
        if (group == 0 && lane == 0) valid_s[4 * (tile % kValidSlots) + warp % 4] = uint16_t(bits);
      }
      unsigned char* dst = kv_s + stage * kTileBytes;
      const int unit = lane % 8;
      // 16-byte unit `unit` of canonical chunk `chunk` (stored at element src_col of a row) of the
      // warp's row t; zeros for a null row.
      auto copy_unit = [&](int t, int chunk, int src_col) {
        const auto bits = __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(row_addr), t);
        const T* src = reinterpret_cast<const T*>(bits);
        arch::cp_async_16(dst + chunk * kChunkBytes + arch::swizzled_offset(warp_rows + t, unit),
                          src ? src + src_col : static_cast<const T*>(p.q), src != nullptr);
      };
      const int chunk = group * 4 + lane / 8;
      const int src_col = stored_column(rows.cache.row, chunk * 64) + unit * 8;
#pragma unroll
      for (int t = 0; t < kRowsPerWarp; ++t) copy_unit(t, chunk, src_col);
      if (group == 0) {
        const int rope_col = stored_column(rows.cache.row, kLatentDim) + unit * 8;
#pragma unroll
        for (int k = 0; k < kRowsPerWarp / 4; ++k) copy_unit(4 * k + lane / 8, kRopeChunk, rope_col);
      }
      arch::cp_async_arrive(&landed[2 * stage + group]);
    };
    if constexpr (!kCopyGroup) {
      if (tiles > 0) copy_half(0, 0, row_address(w.kv_lo));
      if (tiles > 1) copy_half(1, 1, row_address(w.kv_lo + kTokens));
    }
    arch::cp_async_wait<0>();
    arch::fence_proxy_async();
    arch::named_barrier_sync(kMathSync, kThreads);  // Q visible to the tensor cores
    // This thread's two rows (of the accumulator layout) and their visible kv limits.
    const int row_of[2] = {16 * (warp % 4) + lane / 4, 16 * (warp % 4) + lane / 4 + 8};
    int row_limit[2];
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) row_limit[hh] = kv_limit(p, w, row_of[hh], rows_here);
    const float scale_log2 = p.softmax_scale * kLog2e;

    using Qk = arch::Wgmma<T, kTokens, false>;
    using Pv = arch::Wgmma<T, kOutCols, true>;
    float acc[kOutCols / 2];
#pragma unroll
    for (int i = 0; i < kOutCols / 2; ++i) acc[i] = 0.f;
    float sc[kTokens / 2];
    uint32_t probs[kTokens / 4];  // this warpgroup's P as wgmma A fragments: [k step][4]
    const uint64_t q_desc = arch::swizzled_desc(q_s, 16, arch::kSwizzleAtomBytes);

    // sc = Q . K^T of the tile in `stage`, the half warpgroup 0 copies first.
    auto scores = [&](int stage, uint32_t parity) {
      const uint64_t k_desc = arch::swizzled_desc(kv_s + stage * kTileBytes, 16, arch::kSwizzleAtomBytes);
      arch::mbarrier_wait(&landed[2 * stage], parity);
      if constexpr (!kCopyGroup) arch::fence_proxy_async();  // cp.async writes are generic-proxy ones
      arch::wgmma_fence();
#pragma unroll
      for (int i = 0; i < 5; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint32_t off = (i < 4 ? i : kRopeChunk) * kChunkBytes + k * 32;
          Qk::mma(sc, arch::desc_advance(q_desc, off), arch::desc_advance(k_desc, off), i + k > 0);
        }
      arch::mbarrier_wait(&landed[2 * stage + 1], parity);
      if constexpr (!kCopyGroup) arch::fence_proxy_async();
#pragma unroll
      for (int i = 4; i < 8; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint32_t off = i * kChunkBytes + k * 32;
          Qk::mma(sc, arch::desc_advance(q_desc, off), arch::desc_advance(k_desc, off), 1);
        }
      arch::wgmma_commit();
      arch::wgmma_wait<0>();
      arch::pin_registers(sc);
    };
    // Moves row hh's running max to m; returns the factor O must be rescaled by (the sum already is).
    auto move_max = [&](int hh, float m) {
      const float alpha = rescale_factor<true>(row_max[hh], m);
      row_max[hh] = m;
      row_sum[hh] *= alpha;
      return alpha;
    };
    // Online softmax of the tile starting at kv position j (common.cuh's raised_max): probs = P,
    // row sums updated, alpha = the factor O must be rescaled by.
    auto softmax = [&](int j, float (&alpha)[2]) {
      float tile_max[2] = {-INFINITY, -INFINITY};
      uint64_t valid = ~0ull;  // the tile's rows that exist (bit c: row c)
      if constexpr (kMasks)
        valid = *reinterpret_cast<const uint64_t*>(valid_s + 4 * (((j - w.kv_lo) / kTokens) % kValidSlots)) >>
                (2 * (lane % 4));
#pragma unroll
      for (int jj = 0; jj < kTokens / 8; ++jj)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = sc[4 * jj + 2 * hh + e];
            x = j + 8 * jj + 2 * (lane % 4) + e < row_limit[hh] && ((valid >> (8 * jj + e)) & 1) ? x * scale_log2
                                                                                                   : -INFINITY;
            tile_max[hh] = fmaxf(tile_max[hh], x);
          }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        tile_max[hh] = fmaxf(tile_max[hh], __shfl_xor_sync(0xffffffffu, tile_max[hh], 1));
        tile_max[hh] = fmaxf(tile_max[hh], __shfl_xor_sync(0xffffffffu, tile_max[hh], 2));
        alpha[hh] = move_max(hh, raised_max(row_max[hh], tile_max[hh]));
      }
#pragma unroll
      for (int jj = 0; jj < kTokens / 8; ++jj)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          float pr[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            pr[e] = row_max[hh] == -INFINITY ? 0.f : arch::exp2_ftz(sc[4 * jj + 2 * hh + e] - row_max[hh]);
            row_sum[hh] += pr[e];
          }
          probs[4 * (jj / 2) + 2 * (jj % 2) + hh] = pack_pair<T>(pr[0], pr[1]);
        }
    };
    // P into a swizzled 64 x 64 K-major operand (the layout of a tile chunk). The thread's two rows
    // are 8 apart, so they share their swizzle phase.
    auto store_probs = [&](unsigned char* dst) {
      unsigned char* row0 = dst + row_of[0] * arch::kSwizzleRowBytes + 4 * (lane % 4);
#pragma unroll
      for (int jj = 0; jj < kTokens / 8; ++jj) {
        unsigned char* at = row0 + ((jj ^ (row_of[0] & 7)) << 4);
        *reinterpret_cast<uint32_t*>(at) = probs[4 * (jj / 2) + 2 * (jj % 2)];  // sanitize-allow: probs
        *reinterpret_cast<uint32_t*>(at + 8 * arch::kSwizzleRowBytes) = probs[4 * (jj / 2) + 2 * (jj % 2) + 1];  // sanitize-allow: probs
      }
    };
    // Adopts the running max another warpgroup moved to (max_s row set `tile`): alpha as above.
    auto adopt_max = [&](int tile, float (&alpha)[2]) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) alpha[hh] = move_max(hh, max_s[tile * kRows + row_of[hh]]);  // sanitize-allow: max
    };
    auto publish_max = [&](int tile) {
      if (lane % 4 == 0) {
        max_s[tile * kRows + row_of[0]] = row_max[0];  // sanitize-allow: max
        max_s[tile * kRows + row_of[1]] = row_max[1];  // sanitize-allow: max
      }
    };
    auto rescale = [&](const float (&alpha)[2]) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        if (alpha[hh] != 1.f) {
#pragma unroll
          for (int j = 0; j < kOutCols / 8; ++j) {
            acc[4 * j + 2 * hh] *= alpha[hh];
            acc[4 * j + 2 * hh + 1] *= alpha[hh];
          }
        }
    };
    // O_g += P . V_g, V_g = this warpgroup's 256 columns of the tile in `stage`, read in place as an
    // MN-major operand; P from registers (probs) or from shared memory.
    auto v_desc = [&](int stage, int k) {
      return arch::desc_advance(arch::swizzled_desc(kv_s + stage * kTileBytes + group * 4 * kChunkBytes, kChunkBytes,
                                                    arch::kSwizzleAtomBytes),
                                k * 16 * arch::kSwizzleRowBytes);
    };
    auto accumulate_own = [&](int stage) {
      arch::wgmma_fence();
#pragma unroll
      for (int k = 0; k < kTokens / 16; ++k)
        Pv::mma(acc, reinterpret_cast<const uint32_t(&)[4]>(probs[4 * k]), v_desc(stage, k), 1);
      arch::wgmma_commit();
    };
    auto accumulate_shared = [&](int stage, const unsigned char* prob_smem) {
      const uint64_t p_desc = arch::swizzled_desc(prob_smem, 16, arch::kSwizzleAtomBytes);
      arch::wgmma_fence();
#pragma unroll
      for (int k = 0; k < kTokens / 16; ++k) Pv::mma(acc, arch::desc_advance(p_desc, k * 32), v_desc(stage, k), 1);
      arch::wgmma_commit();
    };
    auto finish_accumulate = [&]() {
      arch::wgmma_wait<0>();
      arch::pin_registers(acc);
    };

    // TMA reads whole boxes, so the rows of a sequence's last tile past kv_hi hold whatever the
    // block holds there. Their scores are masked, but 0 x NaN is not 0: each warpgroup zeroes its
    // half of V there before its product (cp.async zero-fills those rows itself).
    auto zero_tail = [&](int stage, int first) {
      if constexpr (kTma) {
        const int valid = w.kv_hi - first;
        if (valid < kTokens) {
          unsigned char* half_v = kv_s + stage * kTileBytes + group * 4 * kChunkBytes;
          for (int v = tid % kGroupThreads; v < (kTokens - valid) * 32; v += kGroupThreads) {
            const int r = valid + v / 32, c = (v / 8) % 4, u = v % 8;
            *reinterpret_cast<int4*>(half_v + c * kChunkBytes + arch::swizzled_offset(r, u)) = make_int4(0, 0, 0, 0);
          }
          arch::fence_proxy_async();
          arch::named_barrier_sync(kTailZeroed + group, kGroupThreads);
        }
      }
    };
    // A half of a stage is no longer read by this warpgroup: the TMA variant frees it for the copy
    // thread, the cp.async variant refills it here.
    auto release = [&](int stage, int tile, bool refill, const char* row_addr) {
      if constexpr (kCopyGroup) {
        arch::mbarrier_arrive(&freed[2 * stage + group]);
      } else {
        if (refill) copy_half(stage, tile, row_addr);
      }
    };

    for (int pair = 0; 2 * pair < tiles; ++pair) {
      const int j = w.kv_lo + 2 * pair * kTokens;  // the pair's first kv position
      const bool has_tile1 = 2 * pair + 1 < tiles;
      const uint32_t parity = pair & 1;
      // The next pair's row addresses are looked up a while before their copies are issued.
      const char* next = !kCopyGroup && 2 * pair + 2 < tiles ? row_address(j + 2 * kTokens) : nullptr;
      float alpha[2];
      if (group == 0) {
        scores(0, parity);
        arch::named_barrier_arrive(kScores0Done, kThreads);
        softmax(j, alpha);
        publish_max(0);
        store_probs(p0_s);
        arch::fence_proxy_async();
        arch::named_barrier_arrive(kProbs0Ready, kThreads);
        rescale(alpha);
        zero_tail(0, j);
        accumulate_own(0);
        finish_accumulate();
        release(0, 2 * pair + 2, 2 * pair + 2 < tiles, next);  // the next tile 0's half, as this one is read
        if constexpr (!kCopyGroup) next = 2 * pair + 3 < tiles ? row_address(j + 3 * kTokens) : nullptr;
        arch::named_barrier_sync(kProbs1Ready, kThreads);
        adopt_max(1, alpha);
        rescale(alpha);
        if (has_tile1) {
          arch::mbarrier_wait(&landed[2], parity);  // this warpgroup's half of tile 1
          if constexpr (!kCopyGroup) arch::fence_proxy_async();
          zero_tail(1, j + kTokens);
          accumulate_shared(1, p1_s);
          finish_accumulate();
          release(1, 2 * pair + 3, 2 * pair + 3 < tiles, next);
        }
      } else {
        // Tile 1's scores wait for tile 0's: the tensor cores then finish S0 first, and warpgroup
        // 0's softmax runs under S1 instead of both warpgroups' softmax after both products.
        arch::named_barrier_sync(kScores0Done, kThreads);
        if (has_tile1) scores(1, parity);
        arch::named_barrier_sync(kProbs0Ready, kThreads);
        adopt_max(0, alpha);
        rescale(alpha);
        arch::mbarrier_wait(&landed[1], parity);
        if constexpr (!kCopyGroup) arch::fence_proxy_async();
        zero_tail(0, j);
        accumulate_shared(0, p0_s);
        if (has_tile1) {  // under the product above
          softmax(j + kTokens, alpha);
          store_probs(p1_s);
        }
        publish_max(1);
        finish_accumulate();  // P0 is no longer read: warpgroup 0 may overwrite it
        arch::fence_proxy_async();
        arch::named_barrier_arrive(kProbs1Ready, kThreads);
        release(0, 2 * pair + 2, 2 * pair + 2 < tiles, next);
        if constexpr (!kCopyGroup) next = 2 * pair + 3 < tiles ? row_address(j + 3 * kTokens) : nullptr;
        if (has_tile1) {
          rescale(alpha);
          zero_tail(1, j + kTokens);
          accumulate_own(1);
          finish_accumulate();
          release(1, 2 * pair + 3, 2 * pair + 3 < tiles, next);
        }
      }
    }

    // Epilogue: row sums of the two warpgroups meet in sum_s; normalize; write out/lse or the partial.
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      row_sum[hh] += __shfl_xor_sync(0xffffffffu, row_sum[hh], 1);
      row_sum[hh] += __shfl_xor_sync(0xffffffffu, row_sum[hh], 2);
      if (lane % 4 == 0) sum_s[group * kRows + row_of[hh]] = row_sum[hh];  // sanitize-allow: sums
    }
    arch::named_barrier_sync(kMathSync, kThreads);
    const int64_t part0 = partial_row0<kRows>(p, w.b, w.row0);
    const bool split = part0 >= 0;
    // Read again rather than kept: the main loop needs every register (it would be spilled).
    const int64_t token_base = p.cu_q_lens == nullptr ? int64_t(w.b) * p.q_len : p.cu_q_lens[w.b];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = row_of[hh];
      if (r >= rows_here) continue;
      const float l = sum_s[r] + sum_s[kRows + r];  // sanitize-allow: sums
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const int row = w.row0 + r, s = row / p.num_heads, h = row - s * p.num_heads;
      const int col0 = group * kOutCols + 2 * (lane % 4);
      if (split) {
        float* dst = static_cast<float*>(p.workspace) + (part0 + r) * kLatentDim + col0;
#pragma unroll
        for (int j = 0; j < kOutCols / 8; ++j)
          *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(acc[4 * j + 2 * hh] * inv, acc[4 * j + 2 * hh + 1] * inv);
      } else {
        T* dst = static_cast<T*>(p.out) + int64_t(w.b) * p.out_stride_b * (p.cu_q_lens == nullptr) +
                 (token_base * (p.cu_q_lens != nullptr) + s) * p.out_stride_t + int64_t(h) * p.out_stride_h + col0;
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
          float* ws_lse = static_cast<float*>(p.workspace) + partial_rows(p) * kLatentDim;
          ws_lse[part0 + r] = lse;
        } else {
          p.lse[int64_t(w.b) * p.lse_stride_b * (p.cu_q_lens == nullptr) +
                (token_base * (p.cu_q_lens != nullptr) + s) * p.lse_stride_t + int64_t(h) * p.lse_stride_h] = lse;
        }
      }
    }
  } else {
    __trap();  // the host never launches a tag the compiled target cannot run
  }
}

}  // namespace sm90

namespace sm90 {

static_assert(kTokens == kTmaBoxTokens, "a TMA box is one tile's rows");

template <class T, class Rows, bool kTma, KvFormat kFormat>
Status launch(const AttentionParams& p, const Rows& rows, const CUtensorMap& map, int grid_x, cudaStream_t stream) {
  const auto kernel = attention_wgmma_kernel<T, Rows, kTma, kFormat>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kBytes)) != cudaSuccess)
    return Status::kCudaError;
  kernel<<<attention_grid(p, grid_x), threads_of(kTma, kFormat), kBytes, stream>>>(p, rows, map);
  return cudaPeekAtLastError() == cudaSuccess ? Status::kOk : Status::kCudaError;
}

}  // namespace sm90

template <class T, class Rows, KvFormat F>
Status launch_attention_wgmma(const AttentionParams& p, const Rows& rows, const AttentionLaunch& launch,
                              const CUtensorMap& map, int grid_x, cudaStream_t stream) {
  if constexpr (narrow::supports(F) && !Rows::kMasksMissing) {
    if (launch.kernel == AttentionKernel::kWgmmaNarrow) {
      return launch.rows_per_cta == 16 ? narrow::launch<T, Rows, F, 16>(p, rows, launch.pair_merge, stream)
                                       : narrow::launch<T, Rows, F, 24>(p, rows, launch.pair_merge, stream);
    }
  }
  if constexpr (std::is_same_v<Rows, PagedTableRows> && F == KvFormat::kNone) {
    if (launch.loads == TileLoadPath::kTma) return sm90::launch<T, Rows, true, F>(p, rows, map, grid_x, stream);
  }
  return sm90::launch<T, Rows, false, F>(p, rows, map, grid_x, stream);
}

}  // namespace attention_detail
}  // namespace mla_kv
