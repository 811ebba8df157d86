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
// half and stage says when it has landed. Two copy paths:
//   - TMA (paged caches whose tiles are whole boxes of a tensor map, make_tile_map): a third
//     warpgroup hands its registers to the math warpgroups, and one of its threads issues every
//     copy; "freed" mbarriers tell it when a half may be overwritten. Boxes read whole blocks, so
//     rows past the sequence's end are zeroed in shared memory before P.V (zero_tail).
//   - cp.async (block pointers, other paged caches): each math warpgroup copies its own half.
// Q, the tiles and P are kept in the 128-byte swizzled layout wgmma reads (arch/wgmma.cuh).
// A quantized cache takes the cp.async variant's schedule with loads into registers instead of
// cp.async: each math warpgroup reads its half's bytes, dequantizes them into T and stores them
// (copy_half), so the products are the 16-bit ones.
#pragma once

#include <type_traits>
#include <cuda.h>

#include "../arch/wgmma.cuh"
#include "../dequant.cuh"
#include "attention_launch.h"
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
constexpr size_t kBytes = kBarrierOffset + 8 * sizeof(uint64_t) + arch::kSwizzleAtomBytes;
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

// The quantized cache's copy of a warp's share of a tile half (see copy_half): 16-byte unit lane % 8 of
// canonical chunk group * 4 + lane / 8 of the warp's 16 rows and, warpgroup 0, of the rope chunk
// (4 rows per pass), read from rows shuffled from lane t (row_addr: the row; pair: int8 / int4's
// (scale, zero)), dequantized into T and stored swizzled. Loads go out 4 rows at a time before their
// stores wait on them: the raw bits of 8 rows beside the 128 accumulator registers spill (ptxas -v).
template <class T, KvFormat F>
__device__ __forceinline__ void copy_half_dequantized(const RowLayout& layout, unsigned char* dst, const char* row_addr,
                                                      const char* pair_addr, int group, int warp_rows, int lane) {
  constexpr bool kTrailer = F == KvFormat::kInt8 || F == KvFormat::kInt4;
  const int unit = lane % 8;
  auto batch = [&](auto size, bool rope, int t0) {
    constexpr int kN = decltype(size)::value;
    const int chunk = rope ? kRopeChunk : group * 4 + lane / 8;
    const int col = stored_column(layout, chunk * 64) + unit * 8;
    dequant::Raw8<F> raw[kN];
    float2 sz[kN];
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const int t = rope ? 4 * i + lane / 8 : t0 + i;
      const char* row = reinterpret_cast<const char*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(row_addr), t));
      sz[i] = make_float2(layout.kv_scale, 0.f);
      if constexpr (kTrailer) {
        const char* pair = reinterpret_cast<const char*>(
            __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(pair_addr), t));
        sz[i] = row ? dequant::scale_zero<T>(__ldg(reinterpret_cast<const unsigned*>(pair))) : float2{};
      } else if constexpr (F == KvFormat::kFp8DsMla) {
        if (!rope) sz[i].x = row ? dequant::ds_tile_scale(row, col) : 0.f;
      }
      raw[i] = row ? dequant::load8<F>(row, col) : dequant::Raw8<F>{};
    }
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const int t = rope ? 4 * i + lane / 8 : t0 + i;
      float v[8];
      dequant::values8<F>(raw[i], rope, sz[i].x, sz[i].y, v);
      *reinterpret_cast<arch::Vec<T, 8>*>(dst + chunk * kChunkBytes + arch::swizzled_offset(warp_rows + t, unit)) =
          dequant::to_vec<T>(v);
    }
  };
  for (int t0 = 0; t0 < kRowsPerWarp; t0 += 4) batch(std::integral_constant<int, 4>{}, false, t0);
  if (group == 0) batch(std::integral_constant<int, 4>{}, true, 0);
}

// A tile row's addresses as the copies need them: the row, and an int8 / int4 row's (scale, zero).
struct TileRow {
  const char* row;
  const char* pair;
};

// kTma: tiles arrive by TMA through `tile_map` (a 3-D map [num_blocks][block_size][576] of a
// paged cache, 128-byte swizzled boxes of 64 columns x min(64, block_size) rows); otherwise by
// cp.async (kFormat: the cache rows' format; quantized ones by loads) from the math warpgroups.
template <class T, class Rows, bool kTma, KvFormat kFormat>
__global__ void __launch_bounds__(kTma ? kTmaThreads : kThreads, 1)
    attention_wgmma_kernel(const AttentionParams p, const Rows rows, const __grid_constant__ CUtensorMap tile_map) {
  constexpr bool kQuant = kFormat != KvFormat::kNone, kTrailer = kFormat == KvFormat::kInt8 || kFormat == KvFormat::kInt4;
  static_assert(!(kTma && kQuant), "TMA copies 16-bit tiles only");
  if constexpr (arch::target_supports<arch::Sm90>()) {
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = reinterpret_cast<unsigned char*>(
        (reinterpret_cast<uintptr_t>(smem_raw) + arch::kSwizzleAtomBytes - 1) & ~uintptr_t(arch::kSwizzleAtomBytes - 1));
    unsigned char* q_s = smem + kQOffset;
    unsigned char* kv_s = smem + kKvOffset;
    unsigned char* p0_s = smem + kProbOffset;
    unsigned char* p1_s = kv_s + kTileBytes + kRopeChunk * kChunkBytes;
    float* max_s = reinterpret_cast<float*>(smem + kStatsOffset);  // [tile of the pair][kRows]: m0, m1
    float* sum_s = max_s + 2 * kRows;                               // [warpgroup][kRows]: row sums
    uint64_t* landed = reinterpret_cast<uint64_t*>(smem + kBarrierOffset);  // [stage][half]: copied
    uint64_t* freed = landed + 4;  // [stage][half]: read (TMA variant)

    Work w;
    if (!find_work<kRows>(p, w)) return;
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
    if constexpr (kTma) {
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
    const int warp_rows = (warp % 4) * kRowsPerWarp;
    auto row_address = [&](int first) -> TileRow {
      const int pos = first + warp_rows + lane;
      const char* base = (lane < kRowsPerWarp && pos < w.kv_hi) ? rows.block_base(w.b, pos) : nullptr;
      if (base == nullptr) return {nullptr, nullptr};
      return {rows.row_in_block(base, pos), kTrailer ? trailer_pair(rows, base, pos) : nullptr};
    };
    auto copy_half = [&](int stage, const TileRow& row_addr) {
      unsigned char* dst = kv_s + stage * kTileBytes;
      const int unit = lane % 8;
      if constexpr (kQuant) {
        copy_half_dequantized<T, kFormat>(rows.cache.row, dst, row_addr.row, row_addr.pair, group, warp_rows, lane);
        arch::fence_proxy_async();  // the stores are read by wgmma (the async proxy)
        arch::mbarrier_arrive(&landed[2 * stage + group]);
        return;
      }
      // 16-byte unit `unit` of canonical chunk `chunk` (stored at element src_col of a row) of the
      // warp's row t; zeros for a null row.
      auto copy_unit = [&](int t, int chunk, int src_col) {
        const auto bits = __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(row_addr.row), t);
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
    if constexpr (!kTma) {
      if (tiles > 0) copy_half(0, row_address(w.kv_lo));
      if (tiles > 1) copy_half(1, row_address(w.kv_lo + kTokens));
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
      if constexpr (!kTma) arch::fence_proxy_async();  // cp.async writes are generic-proxy ones
      arch::wgmma_fence();
#pragma unroll
      for (int i = 0; i < 5; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint32_t off = (i < 4 ? i : kRopeChunk) * kChunkBytes + k * 32;
          Qk::mma(sc, arch::desc_advance(q_desc, off), arch::desc_advance(k_desc, off), i + k > 0);
        }
      arch::mbarrier_wait(&landed[2 * stage + 1], parity);
      if constexpr (!kTma) arch::fence_proxy_async();
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
#pragma unroll
      for (int jj = 0; jj < kTokens / 8; ++jj)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = sc[4 * jj + 2 * hh + e];
            x = j + 8 * jj + 2 * (lane % 4) + e < row_limit[hh] ? x * scale_log2 : -INFINITY;
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
        *reinterpret_cast<uint32_t*>(at) = probs[4 * (jj / 2) + 2 * (jj % 2)];
        *reinterpret_cast<uint32_t*>(at + 8 * arch::kSwizzleRowBytes) = probs[4 * (jj / 2) + 2 * (jj % 2) + 1];
      }
    };
    // Adopts the running max another warpgroup moved to (max_s row set `tile`): alpha as above.
    auto adopt_max = [&](int tile, float (&alpha)[2]) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) alpha[hh] = move_max(hh, max_s[tile * kRows + row_of[hh]]);
    };
    auto publish_max = [&](int tile) {
      if (lane % 4 == 0) {
        max_s[tile * kRows + row_of[0]] = row_max[0];
        max_s[tile * kRows + row_of[1]] = row_max[1];
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
    auto release = [&](int stage, bool refill, const TileRow& row_addr) {
      if constexpr (kTma) {
        arch::mbarrier_arrive(&freed[2 * stage + group]);
      } else {
        if (refill) copy_half(stage, row_addr);
      }
    };

    for (int pair = 0; 2 * pair < tiles; ++pair) {
      const int j = w.kv_lo + 2 * pair * kTokens;  // the pair's first kv position
      const bool has_tile1 = 2 * pair + 1 < tiles;
      const uint32_t parity = pair & 1;
      // The next pair's row addresses are looked up a while before their copies are issued.
      TileRow next = !kTma && 2 * pair + 2 < tiles ? row_address(j + 2 * kTokens) : TileRow{};
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
        release(0, 2 * pair + 2 < tiles, next);  // the next tile 0's half, as this one is read
        if constexpr (!kTma) next = 2 * pair + 3 < tiles ? row_address(j + 3 * kTokens) : TileRow{};
        arch::named_barrier_sync(kProbs1Ready, kThreads);
        adopt_max(1, alpha);
        rescale(alpha);
        if (has_tile1) {
          arch::mbarrier_wait(&landed[2], parity);  // this warpgroup's half of tile 1
          if constexpr (!kTma) arch::fence_proxy_async();
          zero_tail(1, j + kTokens);
          accumulate_shared(1, p1_s);
          finish_accumulate();
          release(1, 2 * pair + 3 < tiles, next);
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
        if constexpr (!kTma) arch::fence_proxy_async();
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
        release(0, 2 * pair + 2 < tiles, next);
        if constexpr (!kTma) next = 2 * pair + 3 < tiles ? row_address(j + 3 * kTokens) : TileRow{};
        if (has_tile1) {
          rescale(alpha);
          zero_tail(1, j + kTokens);
          accumulate_own(1);
          finish_accumulate();
          release(1, 2 * pair + 3 < tiles, next);
        }
      }
    }

    // Epilogue: row sums of the two warpgroups meet in sum_s; normalize; write out/lse or the partial.
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      row_sum[hh] += __shfl_xor_sync(0xffffffffu, row_sum[hh], 1);
      row_sum[hh] += __shfl_xor_sync(0xffffffffu, row_sum[hh], 2);
      if (lane % 4 == 0) sum_s[group * kRows + row_of[hh]] = row_sum[hh];
    }
    arch::named_barrier_sync(kMathSync, kThreads);
    const bool split = p.num_splits > 1;
    const int64_t total_rows = p.total_q_tokens * p.num_heads;
    // Read again rather than kept: the main loop needs every register (it would be spilled).
    const int64_t token_base = p.cu_q_lens == nullptr ? int64_t(w.b) * p.q_len : p.cu_q_lens[w.b];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = row_of[hh];
      if (r >= rows_here) continue;
      const float l = sum_s[r] + sum_s[kRows + r];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const int row = w.row0 + r, s = row / p.num_heads, h = row - s * p.num_heads;
      const int64_t flat = (token_base + s) * p.num_heads + h;
      const int col0 = group * kOutCols + 2 * (lane % 4);
      if (split) {
        float* dst = static_cast<float*>(p.workspace) + (blockIdx.y * total_rows + flat) * kLatentDim + col0;
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
          float* ws_lse = static_cast<float*>(p.workspace) + size_t(p.num_splits) * total_rows * kLatentDim;
          ws_lse[blockIdx.y * total_rows + flat] = lse;
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
  kernel<<<dim3(grid_x, p.num_splits), kTma ? kTmaThreads : kThreads, kBytes, stream>>>(p, rows, map);
  return cudaPeekAtLastError() == cudaSuccess ? Status::kOk : Status::kCudaError;
}

}  // namespace sm90

template <class T, class Rows, KvFormat F>
Status launch_attention_wgmma(const AttentionParams& p, const Rows& rows, int grid_x, cudaStream_t stream) {
  CUtensorMap map{};
  Status st;
  if constexpr (std::is_same_v<Rows, PagedTableRows> && F == KvFormat::kNone) {
    st = sm90::make_tile_map(p, rows, map) ? sm90::launch<T, Rows, true, F>(p, rows, map, grid_x, stream)
                                               : sm90::launch<T, Rows, false, F>(p, rows, map, grid_x, stream);
  } else {
    st = sm90::launch<T, Rows, false, F>(p, rows, map, grid_x, stream);
  }
  if (st != Status::kOk) return st;
  return launch_combine<T>(p, stream);
}

}  // namespace attention_detail
}  // namespace mla_kv
