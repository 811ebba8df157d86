// Hopper decode over a quantized cache (fp8, fp8_ds_mla, int8, int4) with the heads on wgmma's N.
//
// The 64-row kernel of attention_sm90.cuh pads a decode step's 16-20 (token, head) rows to wgmma's M
// of 64, so its tensor work is 3-4x what the rows need; with 16-bit tiles the cache's bytes still
// take longer, but a quantized tile arrives in half the time (a quarter for int4), and the padding
// then sets the pace (RESULTS.md, quantized decode). Here the products are transposed:
//   S^T [64 tokens x N rows] = K [64 x 576] . Q^T,   O^T [512 x N] += V^T [512 x 64] . P^T,
// with the cache tile as wgmma's A operand, converted from its raw bytes into registers (the
// mma.sync fragment layout) by the math threads themselves, and Q^T / P^T (N = 16 or 24 rows) as
// the K-major B operand in shared memory. No value is rounded on the way in: e4m3 and int codes are
// exact in fp16, and the scales go where they cost nothing:
//   fp8:  S = kv_scale (Q.C^T), O = kv_scale (P.C);
//   int8 / int4 (code c, row scale s_t, zero z_t): S = s_t (Q.C^T) + z_t sum(q), and
//         O = (P s_t).C + sum_t P z_t, P s_t rounded to fp16 as P is in every kernel. Codes enter
//         biased, as dequant.cuh's magic leaves them without its packed subtraction (one op per pair
//         fewer): int8's as 1024 + c, int4's high nibbles (a block's features 4 s + 2, 4 s + 3) as
//         1024 + 16 c with their q divided by 16 in Q^T (exact: q enters under its power of two for
//         either dtype), its low nibbles as c. The bias leaves in fp32: the scores less 1024 times the
//         biased features' sum of q (as stored), the biased output columns less 1024 sum_t (P s_t) (as
//         rounded), int4's then divided by 16. 1024 is 8 times int8's mean code and 64 times int4's
//         high nibble's (x 16): ~3 of fp32's 24 bits cancel. int4's low nibbles stay unbiased: their
//         1024 would be 137 times a mean nibble, too many bits;
//   fp8_ds_mla (tile scales s_t,k, bf16 rope r): S = sum_k s_t,k (Q.C_k^T) + 2^rho_t (Q.(r 2^-rho_t)^T),
//         each 128-feature tile's codes (exact) and the rope (exact in fp16 under the token's rope
//         power of two rho_t) in a score buffer of its own, folded in fp32; O = (P 2^sigma_t).V with
//         V = fp16(code x fp16(s_t,k 2^-sigma_t)), sigma_t the token's power of two above its largest
//         tile scale (the int formats' row scale with s_t = 2^sigma_t, exact, and no zero): the V
//         product's A element (feature, token) must carry the tile scale, as the shared P^T cannot
//         (a warp's output columns are one tile's). Those values are rounded twice to fp16, the
//         factor's rounding shared by a (token, tile): a bias of at most 2^-12 in a token's share of
//         O, finer than the 64-row kernel's rounding of every value to a bf16 q's dtype.
// The products are fp16 for either q dtype and every format: an e4m3 pair is one cvt away from fp16
// (three more from bf16), an int code pair one lop3 or prmt and one packed op (dequant.cuh; bf16 has
// no exponent under which a byte is exact). A bf16 q row enters as fp16 times 2^-e_n, e_n its own
// power of two putting the row's largest value at 2^14 (exact down to 2^-29 of that), and e_n goes
// back into the row's score scale; P (below 2^8, raised_max) enters as P 2^7, so that fp16's
// subnormals start at P = 2^-21 and the rounding there adds at most 2^-32 per token; the 2^7 leaves
// with the row sum, summed from the same values. For int formats P s_t enters as P s_t 2^-sigma,
// sigma the warpgroup's running power of two above every s_t of its tiles (it only rises, rescaling
// O as a rising max does), so that P s_t stays below 2^15 whatever the scales' range; O is in units
// of 2^sigma until the epilogue.
// Permutations make every fragment a few wide shared-memory loads and byte moves:
//   - the 576 features of a k step: slot k of step s of block j is feature 64 j + 16 c + 4 s + e
//     (c = (k % 8) / 2, e = k % 2 + 2 (k / 8)), so that a thread's 16 features of a block are 16
//     consecutive bytes of its row (8 for int4); Q^T is stored in that order;
//   - the 64 tokens of the O product: slot 2 q + e of k step s is token 16 s + q + 8 e, so a thread's
//     two score rows are one 32-bit P pair and its V tokens are those = c mod 4;
//   - the 512 output columns: row 16 w + g + 8 h of M tile i is column 16 (8 w + g) + 2 i + h, so a
//     thread's 16 columns are consecutive bytes of a row.
// A CTA has two or three math warpgroups taking alternate tiles (each its own online softmax, merged at
// the end; Groups below) and one copy warp that moves each tile's rows, a block's run per bulk copy,
// into a ring of four to ten stages.
#pragma once

#include <type_traits>

#include "../arch/fp8.cuh"
#include "../arch/wgmma.cuh"
#include "../dequant.cuh"
#include "attention_launch.h"
#include "common.cuh"

namespace mla_kv {
namespace attention_detail {
namespace narrow {

constexpr int kTokens = 64;   // cache rows per tile (wgmma's M)
constexpr int kBlocks = kRowDim / 64;  // 64-feature blocks of a row: 8 latent, 1 rope

// Math warpgroups take alternate tiles, each its own online softmax, merged at the end. Each runs
// its tile as one dependent chain (convert, wgmma, softmax over a named barrier, convert, wgmma),
// so the warps per scheduler set the pace (ncu at two: 0.43 instructions issued per scheduler and
// cycle). At N = 16 a third warpgroup fits: (3 x 152 + 56) x 128 = 65,536 registers with the copy
// warpgroup's 56; at N = 24 (96 accumulators) 152 would spill, so two at 224. fp8_ds_mla keeps two at
// N = 16 too: its two more score buffers and per-token powers of two do not fit 152 (a first version
// with neither buffer spilled 12-24 bytes there).
template <KvFormat F, int N>
struct Groups {
  static constexpr int kGroups = N == 16 && F != KvFormat::kFp8DsMla ? 3 : 2;
  static constexpr int kMathThreads = 128 * kGroups;
  static constexpr int kThreads = kMathThreads + 128;  // and a copy warpgroup, of which one warp copies
  // The copy warpgroup hands its registers to the math warpgroups (setmaxnreg).
  static constexpr int kMathRegisters = kGroups == 3 ? 152 : 224, kCopyRegisters = 56;
  static_assert((kGroups * kMathRegisters + kCopyRegisters) * 128 <= (65536 / kThreads) / 8 * 8 * kThreads,
                "the CTA's register pool");
  static constexpr int kEpilogueBarrier = 1 + kGroups;  // named barriers 1 .. kGroups: a warpgroup's own
};

constexpr bool supports(KvFormat f) { return f != KvFormat::kNone; }

template <KvFormat F>
struct Format {
  static constexpr bool kTrailer = F == KvFormat::kInt8 || F == KvFormat::kInt4;  // (scale, zero) pairs
  static constexpr float kCodeBias = 1024.f;  // int codes enter biased (the top of the file)
  // int4's biased columns (half of them) keep sum_t (P s_t) apart until the epilogue; int8's (all)
  // take it into the zero-point term sum_t P z_t as they go (fewer registers: N = 24 spilled)
  static constexpr bool kBiasSum = F == KvFormat::kInt4;
  static constexpr bool kDs = F == KvFormat::kFp8DsMla;
  // A per-token scale on the scores and on P (the top of the file): int8 / int4's s_t, fp8_ds_mla's 2^sigma_t.
  static constexpr bool kRowScaled = kTrailer || kDs;
  static constexpr float kPShift = 7.f;  // P enters the products as P 2^7 (the top of the file)
  // A row's bytes: codes (int8 / int4 / fp8), or fp8_ds_mla's codes, tile scales and bf16 rope.
  static constexpr int kRowBytes = F == KvFormat::kInt4 ? kRowDim / 2 : kDs ? dequant::kDsRopeOffset + 2 * kRopeDim : kRowDim;
  static constexpr int kBlockBytes = F == KvFormat::kInt4 ? 32 : 64;  // a 64-feature latent block's codes
  static constexpr int kThreadBytes = kBlockBytes / 4;  // a thread's 16 values of a block
  static constexpr int kStageBytes = kTokens * kRowBytes + (kTrailer ? kTokens * 4 : 0);
  // fp8_ds_mla: the V pass's per-token tile factors, fp16 [tile][k step][c][4], two tiles' worth per warpgroup
  static constexpr int kFactorHalves = kDs ? 2 * 4 * kTokens : 0;
};

template <KvFormat F, int N>
struct Smem {
  static constexpr int kGroups = Groups<F, N>::kGroups;
  static constexpr size_t kQ = 0;                                         // Q^T: 9 chunks of N rows
  static constexpr size_t kP = kQ + size_t(kBlocks) * N * arch::kSwizzleRowBytes;  // P^T, two per warpgroup
  static constexpr size_t kRing = kP + size_t(kGroups) * 2 * N * arch::kSwizzleRowBytes;  // (two per warpgroup)
  // the softmax's votes [kGroups][2][4], fp8_ds_mla's factors, colmax [kGroups][4][N], qsum / qbias [N]
  // each, l / corr / psum [kGroups][4][N] each, m [kGroups][N], kv limit [N], the tile's
  // largest row scale [kGroups][4], score scale [N]
  static constexpr size_t kStatFloats = size_t(kGroups) * 8 + size_t(kGroups) * Format<F>::kFactorHalves / 2 +
                                        size_t(kGroups) * 4 * N + 2 * N + 3 * size_t(kGroups) * 4 * N + size_t(kGroups) * N +
                                        N + size_t(kGroups) * 4 + N;
  static constexpr size_t kFixedBytes = kRing + kStatFloats * sizeof(float) + 8 + arch::kSwizzleAtomBytes;
  // Tile buffers of the ring: as many as fit beside the rest, up to four per warpgroup; at two
  // warpgroups an even number, so that a stage's tiles are one warpgroup's (at three, the tile loop's
  // barrier guard covers the rest). fp8 / int8: 5 at three warpgroups, 4 at two; int4: 10, 8;
  // fp8_ds_mla: 4.
  static constexpr int kFit = int(std::min<size_t>(4 * kGroups, (size_t(kSmemHopper.per_block) - kFixedBytes) /
                                                                   (Format<F>::kStageBytes + 2 * sizeof(uint64_t))));
  static constexpr int kStages = kGroups == 2 ? kFit / 2 * 2 : kFit;
  static constexpr size_t kRingBytes = size_t(kStages) * Format<F>::kStageBytes;
  static constexpr size_t kStats = kRing + kRingBytes;  // floats
  static constexpr size_t kBarriers = (kStats + kStatFloats * sizeof(float) + 7) / 8 * 8;
  static constexpr size_t kBytes = kBarriers + 2 * kStages * sizeof(uint64_t) + arch::kSwizzleAtomBytes;
  // The epilogue's [N][512] fp32 partials of warpgroups 1 .. kGroups - 1 lie over the ring, and after
  // them a pair launch's exchange: the CTA's [N][512] normalized rows and their [N] lse (merge_pair).
  static constexpr size_t kMergeFloats = size_t(kGroups - 1) * N * kLatentDim;
  static constexpr size_t kExchangeFloats = size_t(N) * kLatentDim + N;
  static_assert(kStages > kGroups, "a tile in flight per warpgroup and one landing");
  static_assert(kRingBytes >= (kMergeFloats + kExchangeFloats) * sizeof(float), "the merge and exchange buffers fit in the ring");
  static_assert(kBytes <= size_t(kSmemHopper.per_block), "Hopper's shared memory per CTA");
};

// Eight values of T (a 16-byte load) times `factor`, as eight of M.
template <class T, class M>
__device__ __forceinline__ uint4 scaled_pairs(uint4 x, float factor) {
  uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const arch::Vec<T, 2> in = *reinterpret_cast<const arch::Vec<T, 2>*>(&w[i]);
    arch::Vec<M, 2> out;
    out.v[0] = arch::from_float<M>(arch::to_float(in.v[0]) * factor);
    out.v[1] = arch::from_float<M>(arch::to_float(in.v[1]) * factor);
    w[i] = *reinterpret_cast<const uint32_t*>(&out);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// A thread's 16 values of one block of a row (the K pass) or of its 16 output columns (the V pass).
template <KvFormat F>
using Raw16 = std::conditional_t<F == KvFormat::kInt4, uint2, uint4>;

template <KvFormat F>
__device__ __forceinline__ uint32_t raw_word(const Raw16<F>& r, int i) {
  if constexpr (F == KvFormat::kInt4) return i == 0 ? r.x : r.y;
  else return i == 0 ? r.x : i == 1 ? r.y : i == 2 ? r.z : r.w;
}

// K pass: k step s of a row's 16 values (features 4 s .. 4 s + 3): lo = features 0, 1, hi = 2, 3.
template <KvFormat F>
__device__ __forceinline__ void k_pairs(const Raw16<F>& raw, int s, uint32_t& lo, uint32_t& hi) {
  if constexpr (F == KvFormat::kFp8 || F == KvFormat::kFp8DsMla) {
    arch::e4m3x4_to_halves(raw_word<F>(raw, s), lo, hi);
  } else if constexpr (F == KvFormat::kInt8) {
    const uint32_t w = raw_word<F>(raw, s);
    lo = dequant::byte_codes_to_biased_halves(w, 0x4140u);
    hi = dequant::byte_codes_to_biased_halves(w, 0x4342u);
  } else {
    // TurboMind's nibble order: nibbles k and k + 4 of a word are its values 2 k and 2 k + 1, so
    // step s takes nibbles (0, 4), (1, 5) of its word, or (2, 6), (3, 7).
    const uint32_t w = raw_word<F>(raw, s / 2) >> (8 * (s % 2));
    lo = dequant::low_nibble_codes_to_halves(w);
    hi = dequant::nibble_codes_to_biased_halves<1>(w);  // 1024 + 16 c (the top of the file)
  }
}

// V pass: output column pair i (columns 2 i, 2 i + 1 of the thread's 16) of tokens a and b:
// c0 = (column 2 i; a, b), c1 = (column 2 i + 1; a, b).
template <KvFormat F>
__device__ __forceinline__ void v_pairs(const Raw16<F>& a, const Raw16<F>& b, int i, uint32_t& c0, uint32_t& c1) {
  if constexpr (F == KvFormat::kInt4) {
    // Bytes k / 2 and k / 2 + 2 of each token's word (nibbles k, k + 4 of each) as x's bytes a, a, b, b.
    const int k = i % 4;
    const uint32_t x = __byte_perm(raw_word<F>(a, i / 4), raw_word<F>(b, i / 4), k / 2 == 0 ? 0x6420u : 0x7531u);
    if (k % 2 == 0) {
      c0 = dequant::low_nibble_codes_to_halves(x);
      c1 = dequant::low_nibble_codes_to_halves(x >> 8);
    } else {
      c0 = dequant::nibble_codes_to_biased_halves<1>(x);
      c1 = dequant::nibble_codes_to_biased_halves<1>(x >> 8);
    }
  } else {
    const uint32_t x = __byte_perm(raw_word<F>(a, i / 2), raw_word<F>(b, i / 2), i % 2 == 0 ? 0x5140u : 0x7362u);
    if constexpr (F == KvFormat::kFp8 || F == KvFormat::kFp8DsMla) {
      arch::e4m3x4_to_halves(x, c0, c1);
    } else {
      c0 = dequant::byte_codes_to_biased_halves(x, 0x4140u);
      c1 = dequant::byte_codes_to_biased_halves(x, 0x4342u);
    }
  }
}

// The power of two sigma with |s| < 2^sigma for a float s >= 0 (its biased exponent less 126; zeros and
// subnormals get the least, -126).
constexpr int kMinScaleExponent = -126;
__device__ __forceinline__ int scale_exponent(float s) { return int(__float_as_uint(s) >> 23) + kMinScaleExponent; }

// fp8_ds_mla: two fp16 values times two fp16 factors.
__device__ __forceinline__ uint32_t times_halves(uint32_t x, uint32_t f) {
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&x), *reinterpret_cast<const __half2*>(&f));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// A bf16 pair's two values (low half first).
__device__ __forceinline__ float2 bf16_pair(uint32_t w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
}

// fp8_ds_mla's rope: a bf16 pair times the power of two `down`, as fp16 (rounded once: the product is
// exact in fp32).
__device__ __forceinline__ uint32_t bf16_pair_to_halves(uint32_t w, float down) {
  const float2 v = bf16_pair(w);
  const __half2 r = __floats2half2_rn(v.x * down, v.y * down);
  return *reinterpret_cast<const uint32_t*>(&r);
}

__device__ __forceinline__ float bf16_pair_amax(uint32_t w) {
  const float2 v = bf16_pair(w);
  return fmaxf(fabsf(v.x), fabsf(v.y));
}

template <KvFormat F>
__device__ __forceinline__ Raw16<F> load_raw(const unsigned char* p) {
  // int codes: one wide load each, or nvcc splits the K pass's into 4-byte ones (fp8's stay whole,
  // and the forced form costs its tile loop some 60 instructions of scheduling)
  if constexpr (F == KvFormat::kInt4) return arch::load_shared_8(p);
  else if constexpr (F == KvFormat::kInt8) return arch::load_shared_16(p);
  else return *reinterpret_cast<const Raw16<F>*>(p);  // sanitize-allow: merge-reads
}

// The warp's sum of x: sm80's redux where the target has it (the kernel runs on sm90 only, but its
// header is compiled for every target of the .cu, sm70's included).
__device__ __forceinline__ uint32_t warp_total(uint32_t x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_add_sync(0xffffffffu, x);
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
#endif
}

// Lane src's pointer p.
__device__ __forceinline__ const char* lane_pointer(const char* p, int src) {
  const auto x = __shfl_sync(0xffffffffu, static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(p)), src);
  return reinterpret_cast<const char*>(static_cast<uintptr_t>(x));
}

// copy_tiles where every tile lies in one block (blocks of a multiple of kTokens rows back to back, the
// CTA's range starting on a tile): a tile is one bulk copy of its rows (and one of its int pairs),
// issued by lane 0. Its block's base comes from a window of 32 tiles' bases in the lanes' registers,
// the next window read a window ahead. The general loop below took ~1.1 us a tile (a timeline probe
// on the H200, int4 at B = 64 ctx 4K): its block-table read, issued after the previous tile's
// copies and waited for at once, and some 150 dependent instructions of run bookkeeping; the math
// warpgroups consume a tile per ~0.6 us, so they waited on landing tiles for a third of their loop
// and the copy warp was never a stage ahead.
template <KvFormat F, int kStages, class Rows>
__device__ __forceinline__ void copy_block_tiles(const Rows& rows, const Work& w, int tiles, unsigned char* ring,
                                                 uint64_t* full, uint64_t* empty, int lane) {
  using Fmt = Format<F>;
  auto tile_block = [&](int t) { return t < tiles ? rows.block_base(w.b, w.kv_lo + t * kTokens) : nullptr; };
  const char* window = tile_block(lane);  // lane l: tile 32 i + l's block, i = t / 32
  const char* ahead = tile_block(32 + lane);
  for (int t = 0; t < tiles; ++t) {
    if (t % 32 == 0 && t > 0) {
      window = ahead;
      ahead = tile_block(t + 32 + lane);
    }
    const char* base = lane_pointer(window, t % 32);
    const int stage = t % kStages, use = t / kStages, first = w.kv_lo + t * kTokens;
    const int n = min(kTokens, w.kv_hi - first);
    unsigned char* dst = ring + stage * Fmt::kStageBytes;
    unsigned char* dst_pairs = dst + kTokens * Fmt::kRowBytes;
    const char* src = base ? rows.row_in_block(base, first) : nullptr;
    const char* pairs = Fmt::kTrailer && base ? trailer_pair(rows, base, first) : nullptr;
    const bool bulk = src != nullptr && (reinterpret_cast<uintptr_t>(src) & 15) == 0;
    const bool bulk_pairs = pairs != nullptr && (reinterpret_cast<uintptr_t>(pairs) & 15) == 0 && n % 4 == 0;
    if (use > 0) arch::mbarrier_wait(&empty[stage], (use - 1) & 1);
    if (lane == 0) {
      arch::mbarrier_arrive_expect(&full[stage], (bulk ? n * Fmt::kRowBytes : 0) + (bulk_pairs ? 4 * n : 0));
      if (bulk) arch::bulk_load(dst, src, n * Fmt::kRowBytes, &full[stage]);
      if (bulk_pairs) arch::bulk_load(dst_pairs, pairs, 4 * n, &full[stage]);
    }
    if (!bulk && src != nullptr) {  // a block not 16-byte aligned (block pointers): the warp copies
      for (int b = lane; b < n * Fmt::kRowBytes; b += 32) dst[b] = static_cast<unsigned char>(src[b]);
    } else if (src == nullptr) {  // in no block: zeros
      for (int b = 16 * lane; b < n * Fmt::kRowBytes; b += 16 * 32) *reinterpret_cast<int4*>(dst + b) = make_int4(0, 0, 0, 0);
    }
    if constexpr (Fmt::kTrailer) {
      if (!bulk_pairs)
        for (int i = lane; i < n; i += 32)
          reinterpret_cast<uint32_t*>(dst_pairs)[i] = pairs ? __ldg(reinterpret_cast<const unsigned*>(pairs) + i) : 0u;
    }
    for (int i = n + lane; i < kTokens; i += 32) {  // past kv_hi
      for (int b = 0; b < Fmt::kRowBytes; b += 16)
        *reinterpret_cast<int4*>(dst + i * Fmt::kRowBytes + b) = make_int4(0, 0, 0, 0);
      if constexpr (Fmt::kTrailer) reinterpret_cast<uint32_t*>(dst_pairs)[i] = 0u;
    }
    arch::mbarrier_arrive(&full[stage]);
  }
}

// The copy warp: tile t's rows into ring stage t % kStages once that stage's readers have freed it, in
// tile order (the math warpgroups' barrier waits rely on it).
// A tile's rows come in runs, one per lane: where a block's rows lie back to back (row stride = the
// row's bytes, and blocks of 4 rows or more), a run is all of the tile's rows in one block, moved by
// one bulk copy (and its int (scale, zero) pairs by another); else a run is one row. Bulk copies of
// single rows ran the tile ring dry (ncu: the math warps waited on it 59% of the time) at a copy per
// ~85 cycles. Rows the CTA does not see (past kv_hi, or in no block) are zeros; a run not 16-byte
// aligned (block pointers) is copied by the lane itself.
template <KvFormat F, int kStages, class Rows>
__device__ __forceinline__ void copy_tiles(const Rows& rows, const Work& w, unsigned char* ring, uint64_t* full,
                                           uint64_t* empty, int lane) {
  using Fmt = Format<F>;
  constexpr int kRunsPerLane = kTokens / 32;  // row by row: two rows a lane
  const int tiles = w.kv_hi > w.kv_lo ? (w.kv_hi - w.kv_lo + kTokens - 1) / kTokens : 0;
  const int per_block = rows.rows_per_block();
  const bool block_runs = rows.cache.row.row_stride_bytes == Fmt::kRowBytes && per_block >= 4;
  if (block_runs && per_block % kTokens == 0 && w.kv_lo % kTokens == 0) {
    copy_block_tiles<F, kStages>(rows, w, tiles, ring, full, empty, lane);
    return;
  }
  for (int t = 0; t < tiles; ++t) {
    const int stage = t % kStages, use = t / kStages, first = w.kv_lo + t * kTokens;
    const int end = min(first + kTokens, w.kv_hi);
    const int block0 = first - block_offset(first, per_block);  // first position of first's block
    unsigned char* dst = ring + stage * Fmt::kStageBytes;
    unsigned char* dst_pairs = dst + kTokens * Fmt::kRowBytes;
    int lo[kRunsPerLane], hi[kRunsPerLane];  // the lane's runs of positions [lo, hi)
    const char* base[kRunsPerLane];
    bool bulk[kRunsPerLane], bulk_pairs[kRunsPerLane];
    uint32_t bytes = 0;
#pragma unroll
    for (int k = 0; k < kRunsPerLane; ++k) {
      const int r = lane + 32 * k;
      lo[k] = block_runs ? max(first, block0 + r * per_block) : first + r;
      hi[k] = block_runs ? min(block0 + (r + 1) * per_block, end) : min(lo[k] + 1, end);
      if (block_runs && k > 0) hi[k] = lo[k];  // (kTokens - 1) / 4 + 2 runs at most: lane r has run r
      base[k] = lo[k] < hi[k] ? rows.block_base(w.b, lo[k]) : nullptr;
      const char* src = base[k] ? rows.row_in_block(base[k], lo[k]) : nullptr;
      const int n = hi[k] - lo[k], at = lo[k] - first;
      bulk[k] = src != nullptr && (reinterpret_cast<uintptr_t>(src) & 15) == 0;
      bulk_pairs[k] = false;
      if constexpr (Fmt::kTrailer) {
        const char* pairs = base[k] ? trailer_pair(rows, base[k], lo[k]) : nullptr;
        bulk_pairs[k] = pairs != nullptr && (reinterpret_cast<uintptr_t>(pairs) & 15) == 0 && n % 4 == 0 && at % 4 == 0;
      }
      bytes += (bulk[k] ? n * Fmt::kRowBytes : 0) + (bulk_pairs[k] ? 4 * n : 0);
    }
    if (use > 0) arch::mbarrier_wait(&empty[stage], (use - 1) & 1);
    bytes = warp_total(bytes);
    if (lane == 0) arch::mbarrier_arrive_expect(&full[stage], bytes);
    __syncwarp();
#pragma unroll
    for (int k = 0; k < kRunsPerLane; ++k) {
      const int n = hi[k] - lo[k], at = lo[k] - first;
      if (n <= 0) continue;
      unsigned char* to = dst + at * Fmt::kRowBytes;
      if (bulk[k]) {
        arch::bulk_load(to, rows.row_in_block(base[k], lo[k]), n * Fmt::kRowBytes, &full[stage]);
      } else if (base[k] != nullptr) {
        const char* src = rows.row_in_block(base[k], lo[k]);  // rows back to back here when n > 1
        for (int b = 0; b < n * Fmt::kRowBytes; ++b) to[b] = static_cast<unsigned char>(src[b]);
      } else {
        for (int b = 0; b < n * Fmt::kRowBytes; b += 16) *reinterpret_cast<int4*>(to + b) = make_int4(0, 0, 0, 0);
      }
      if constexpr (Fmt::kTrailer) {
        if (bulk_pairs[k]) {
          arch::bulk_load(dst_pairs + 4 * at, trailer_pair(rows, base[k], lo[k]), 4 * n, &full[stage]);
        } else {
          for (int i = 0; i < n; ++i)
            reinterpret_cast<uint32_t*>(dst_pairs)[at + i] =
                base[k] ? __ldg(reinterpret_cast<const unsigned*>(trailer_pair(rows, base[k], lo[k] + i))) : 0u;
        }
      }
    }
    for (int i = end - first + lane; i < kTokens; i += 32) {  // past kv_hi
      for (int b = 0; b < Fmt::kRowBytes; b += 16)
        *reinterpret_cast<int4*>(dst + i * Fmt::kRowBytes + b) = make_int4(0, 0, 0, 0);
      if constexpr (Fmt::kTrailer) reinterpret_cast<uint32_t*>(dst_pairs)[i] = 0u;
    }
    arch::mbarrier_arrive(&full[stage]);
  }
}

// A launch of two splits runs each CTA pair of the same rows as a cluster (launch), whose CTAs merge
// their states here rather than leave them to the combine: each CTA has its N rows, normalized, and
// their lse in its shared memory (`rows_s` [N][512], `lse_s` [N]); CTA rank r merges features
// [256 r, 256 r + 256) of every row from both CTAs' and writes them to out, rank 0 the lse. The merge
// reads 16-24 KB of the other CTA's shared memory in 16-byte loads spread over every math thread and
// each CTA writes half the rows: the combine's launch and pass and the fp32 partials' round trip
// through memory are gone (H100, B = 64 ctx 4K: 1.4-3.2 us of ~65 a call). More splits keep the
// combine: pairing 16 splits (the combine then merging 8) gained nothing at B = 8 ctx 32K.
// (Earlier cluster merges, tried on 2026-11-29 (design-notes.md), stored every value remotely or had one CTA
// of the pair merge all rows; both were slower than the combine.)
template <class T, int N>
__device__ __forceinline__ void merge_pair(const AttentionParams& p, const Work& w, int rows_here, const float* rows_s,
                                           const float* lse_s, int tid, int threads) {
  constexpr int kHalf = kLatentDim / 2, kChunks = kHalf / 4;  // a CTA's features of a row, in float4s
  arch::cluster_sync();  // both CTAs' rows and lse are in their shared memory
  const uint32_t rank = arch::cluster_rank(), other = rank ^ 1u;
  for (int i = tid; i < rows_here * kChunks; i += threads) {
    const int col = i / kChunks, feature = int(rank) * kHalf + 4 * (i % kChunks);
    const float la = lse_s[col], lb = arch::load_cluster_shared_f32(lse_s + col, other);
    const float4 a = *reinterpret_cast<const float4*>(rows_s + col * kLatentDim + feature);
    const float4 b = arch::load_cluster_shared_f4(rows_s + col * kLatentDim + feature, other);
    const StateWeights wt = merge_weights(la, lb);
    const float4 o = make_float4((wt.a * a.x + wt.b * b.x) * wt.inv, (wt.a * a.y + wt.b * b.y) * wt.inv,
                                 (wt.a * a.z + wt.b * b.z) * wt.inv, (wt.a * a.w + wt.b * b.w) * wt.inv);
    const float lse = wt.lse();  // for every element: behind the lse write's branch, nvcc rescheduled the kernel
    const int row = w.row0 + col, s = row / p.num_heads, h = row - s * p.num_heads;
    T* dst = static_cast<T*>(p.out) + int64_t(w.b) * p.out_stride_b + int64_t(s) * p.out_stride_t +
             int64_t(h) * p.out_stride_h + feature;
    arch::Vec<T, 4> v;
    v.v[0] = arch::from_float<T>(o.x);
    v.v[1] = arch::from_float<T>(o.y);
    v.v[2] = arch::from_float<T>(o.z);
    v.v[3] = arch::from_float<T>(o.w);
    arch::store<T, 4>(dst, v);
    if (rank == 0 && feature == 0)
      p.lse[int64_t(w.b) * p.lse_stride_b + int64_t(s) * p.lse_stride_t + int64_t(h) * p.lse_stride_h] = lse;
  }
  arch::cluster_sync();  // the other CTA has read this one's rows: its shared memory may go
}

// kPair: a launch of two splits as clusters of two CTAs (merge_pair). Its own instantiation: a runtime
// flag changed the per-split kernel's code throughout (its tile loop rescheduled, the copy warp's loop
// off the uniform datapath) and cost it 0.4-1.8 us a call (H100, B = 8 ctx 32K).
template <class T, class Rows, KvFormat F, int N, bool kPair>
__global__ void __launch_bounds__(Groups<F, N>::kThreads, 1) attention_narrow_kernel(const AttentionParams p, const Rows rows) {
  if constexpr (arch::target_supports<arch::Sm90>()) {
    using Fmt = Format<F>;
    using S = Smem<F, N>;
    constexpr int kGroups = Groups<F, N>::kGroups, kMathThreads = Groups<F, N>::kMathThreads;
    constexpr int kStages = S::kStages, kEpilogueBarrier = Groups<F, N>::kEpilogueBarrier;
    // Three warpgroups' registers (152) hold half the A fragments per commit group (kBatch wgmmas) and
    // no V bytes loaded a k step ahead; the other warpgroups' work hides those latencies instead.
    // fp8_ds_mla's score buffers take those registers at two (N = 24 spilled 16-20 bytes with them).
    constexpr int kBatch = kGroups == 2 && !Fmt::kDs ? 4 : 2;
    constexpr bool kLoadAhead = kGroups == 2 && !Fmt::kDs;
    using M = __half;  // the products' type (the top of the file)
    using Mma = arch::WgmmaRegA<M, N>;
    // int4 divides its high nibbles' q by 16: under the row's power of two, fp16 q too (the top of the file)
    constexpr bool kScaledQ = !std::is_same_v<M, T> || F == KvFormat::kInt4;
    constexpr int kCols = N / 4;  // score columns of a thread
    constexpr bool kZeros = Fmt::kTrailer, kRowScaled = Fmt::kRowScaled;
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = arch::aligned_smem(smem_raw);
    unsigned char* q_s = smem + S::kQ;
    unsigned char* ring = smem + S::kRing;
    int* vote_s = reinterpret_cast<int*>(smem + S::kStats);  // [group][tile parity][warp]: the softmax's votes
    // fp8_ds_mla: [group][tile parity][kFactorHalves / 2] (the V pass's tile factors, written in the K pass)
    __half* factor_s = reinterpret_cast<__half*>(vote_s + kGroups * 8);
    float* colmax_s = reinterpret_cast<float*>(factor_s + kGroups * Fmt::kFactorHalves);  // [group][warp][N]
    float* qsum_s = colmax_s + kGroups * 4 * N;                    // [N]
    float* qbias_s = qsum_s + N;                                   // [N]: 1024 x the biased features' q sum
    float* l_s = qbias_s + N;                                      // [group][warp][N]
    float* corr_s = l_s + kGroups * 4 * N;                         // [group][warp][N]
    float* psum_s = corr_s + kGroups * 4 * N;                      // [group][warp][N]
    float* m_s = psum_s + kGroups * 4 * N;                         // [group][N]
    int* limit_s = reinterpret_cast<int*>(m_s + kGroups * N);      // [N]: a column's kv positions end
    float* smax_s = reinterpret_cast<float*>(limit_s + N);         // [group][warp]
    // [N]: a column's score scale; its q row's power of two goes back in here (read per tile: a
    // register each was one too many at three warpgroups)
    float* score_scale_s = smax_s + kGroups * 4;
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + S::kBarriers);
    uint64_t* empty = full + kStages;

    // The combine's CTAs may be scheduled now (CombineLaunch::kEarly); a pair has no combine after it.
    if constexpr (!kPair) arch::launch_dependents();
    Work w;
    if (!find_work<N>(p, rows, w)) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int rows_here = min(N, w.q_len * p.num_heads - w.row0);
    const int tiles = w.kv_hi > w.kv_lo ? (w.kv_hi - w.kv_lo + kTokens - 1) / kTokens : 0;
    if (tid < kStages) {
      arch::mbarrier_init(&full[tid], 33);  // the copy warp's lanes, and lane 0's byte count
      arch::mbarrier_init(&empty[tid], 128);
      arch::fence_proxy_async();
    }
    __syncthreads();  // the mbarriers are ready
    // The copy warp starts on the tiles at once: the first ones land while the math warpgroups read
    // q (two dependent trips to memory; they had delayed every CTA's first tile by as much).
    if (warp >= kMathThreads / 32) {
      arch::shrink_registers<Groups<F, N>::kCopyRegisters>();
      if (warp == kMathThreads / 32) copy_tiles<F, kStages>(rows, w, ring, full, empty, lane);
      if constexpr (kPair) {  // merge_pair's two cluster barriers, which every thread of the cluster takes
        arch::cluster_sync();
        arch::cluster_sync();
      }
      return;
    }
    arch::grow_registers<Groups<F, N>::kMathRegisters>();
    if (tid < N) limit_s[tid] = kv_limit(p, w, tid, rows_here);  // once: it takes a division
    const RowLayout& layout = rows.cache.row;
    const float kv_scale = F == KvFormat::kFp8 ? layout.kv_scale : 1.f;
    // Q^T in the permuted feature order, in one trip to memory: a warp loads all of its rows first,
    // lane l units l and l + 32 (l < 4) of each, unit 4 j + c being q[n][64 j + 16 c .. + 15]; then
    // each row's power of two (the top of the file) from the row's values in the warp's registers.
    constexpr int kMathWarps = kMathThreads / 32, kUnits = kBlocks * 4;
    constexpr int kRowsPerWarp = (N + kMathWarps - 1) / kMathWarps;
    static_assert(kUnits <= 64, "two units a lane");
    uint4 qx[kRowsPerWarp][2][2];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int n = warp + i * kMathWarps;
      const T* src = n < N ? q_row<T>(p, w, n, rows_here) : nullptr;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int unit = lane + 32 * h;
        const bool here = src != nullptr && unit < kUnits;
        qx[i][h][0] = here ? *reinterpret_cast<const uint4*>(src + 16 * unit) : make_uint4(0, 0, 0, 0);
        qx[i][h][1] = here ? *reinterpret_cast<const uint4*>(src + 16 * unit + 8) : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int n = warp + i * kMathWarps;
      if (n >= N) break;  // warp-uniform
      int q_exp = 0;
      if constexpr (kScaledQ) {
        float amax = 0.f;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            const uint32_t words[4] = {qx[i][h][k].x, qx[i][h][k].y, qx[i][h][k].z, qx[i][h][k].w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const arch::Vec<T, 2> v = *reinterpret_cast<const arch::Vec<T, 2>*>(&words[e]);
              amax = fmaxf(amax, fmaxf(fabsf(arch::to_float(v.v[0])), fabsf(arch::to_float(v.v[1]))));
            }
          }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        q_exp = amax > 0.f && amax <= FLT_MAX ? ilogbf(amax) - 14 : 0;
      }
      if (lane == 0) {
        const float scale_log2 = p.softmax_scale * kLog2e * kv_scale;
        score_scale_s[n] = kScaledQ ? ldexpf(scale_log2, q_exp) : scale_log2;
      }
      const float down = ldexpf(1.f, -q_exp);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int unit = lane + 32 * h, j = unit / 4, c = unit % 4;
        if (unit >= kUnits) break;
        uint4 x[2] = {qx[i][h][0], qx[i][h][1]};
        if constexpr (kScaledQ) {
#pragma unroll
          for (int k = 0; k < 2; ++k) x[k] = scaled_pairs<T, M>(x[k], down);
        }
        uint32_t words[8] = {x[0].x, x[0].y, x[0].z, x[0].w, x[1].x, x[1].y, x[1].z, x[1].w};
        if constexpr (F == KvFormat::kInt4) {  // odd words: the features of high nibbles, q / 16
          const uint32_t sixteenth = 0x2C002C00u;
#pragma unroll
          for (int k = 1; k < 8; k += 2) words[k] = times_halves(words[k], sixteenth);
        }
        unsigned char* chunk = q_s + j * N * arch::kSwizzleRowBytes;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          *reinterpret_cast<uint32_t*>(chunk + arch::swizzled_offset(n, 2 * t) + 4 * c) = words[2 * t];
          *reinterpret_cast<uint32_t*>(chunk + arch::swizzled_offset(n, 2 * t + 1) + 4 * c) = words[2 * t + 1];
        }
      }
    }
    arch::fence_proxy_async();
    arch::named_barrier_sync(kEpilogueBarrier, kMathThreads);  // Q^T is ready
    if constexpr (kZeros) {  // the row sums of q as it enters the products, and of the biased features'
      for (int n = warp; n < N; n += kMathThreads / 32) {
        // the lane's pair is in 16-byte unit lane / 4 of the swizzled row: Q^T's word (lane / 4) ^ (n % 8),
        // odd words int4's high nibbles (stored as q / 16)
        const bool high = F == KvFormat::kInt4 && (((lane / 4) ^ (n & 7)) & 1);
        float sum = 0.f, biased = 0.f;
#pragma unroll
        for (int j = 0; j < kBlocks; ++j) {
          const arch::Vec<M, 2> v =
              *reinterpret_cast<const arch::Vec<M, 2>*>(q_s + j * N * arch::kSwizzleRowBytes + n * arch::kSwizzleRowBytes + 4 * lane);
          const float pair = arch::to_float(v.v[0]) + arch::to_float(v.v[1]);
          sum += high ? 16.f * pair : pair;
          if (F == KvFormat::kInt8 || high) biased += pair;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          sum += __shfl_xor_sync(0xffffffffu, sum, o);
          biased += __shfl_xor_sync(0xffffffffu, biased, o);
        }
        if (lane == 0) qsum_s[n] = sum, qbias_s[n] = Fmt::kCodeBias * biased;
      }
      arch::named_barrier_sync(kEpilogueBarrier, kMathThreads);
    }

    const int group = __shfl_sync(0xffffffffu, warp / 4, 0);
    const int wq = warp % 4, g = lane / 4, c = lane % 4;
    const int r0 = 16 * wq + g;  // the thread's score rows (tokens) r0, r0 + 8
    const int u = 8 * wq + g;    // its output columns 16 u .. 16 u + 15
    const int latent_byte = dequant::vector_byte(F, stored_column(layout, 0));
    const int rope_byte = dequant::vector_byte(F, stored_column(layout, kLatentDim));
    unsigned char* p_base = smem + S::kP + group * 2 * N * arch::kSwizzleRowBytes;  // [tile parity][N] rows
    const uint64_t q_desc = arch::swizzled_desc(q_s, 16, arch::kSwizzleAtomBytes);
    const uint64_t p_desc = arch::swizzled_desc(p_base, 16, arch::kSwizzleAtomBytes);
    auto col_of = [&](int q) { return 8 * (q / 2) + 2 * c + (q % 2); };
    // The V pass's bytes of k step s: the thread's 16 columns of token 16 s + c + {0, 8, 4, 12}[k].
    auto v_raw = [&](const unsigned char* st, int s, int k) {
      const int token = 16 * s + c + (k == 0 ? 0 : k == 1 ? 8 : k == 2 ? 4 : 12);
      return load_raw<F>(st + token * Fmt::kRowBytes + latent_byte + u * Fmt::kThreadBytes);
    };

    float acc[8][N / 2];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int k = 0; k < N / 2; ++k) acc[i][k] = 0.f;
    // int formats: corr_run = sum_t P z_t (int8: less the codes' bias in O), int4: psum_run = sum_t (P s_t) as
    // rounded (the bias in its high nibbles' columns); true units
    float m_run[kCols], l_run[kCols], corr_run[kCols], psum_run[kCols];
#pragma unroll
    for (int q = 0; q < kCols; ++q) m_run[q] = -INFINITY, l_run[q] = 0.f, corr_run[q] = 0.f, psum_run[q] = 0.f;
    // int formats and fp8_ds_mla: O accumulates in units of 2^sigma_run, the warpgroup's running power
    // of two above every row scale of its tiles so far (the top of the file); it moves up only.
    int sigma_run = kMinScaleExponent;
    float scale_down = ldexpf(1.f, -sigma_run), scale_up = ldexpf(1.f, sigma_run);  // 2^-sigma_run, 2^sigma_run

    for (int t = group; t < tiles; t += kGroups) {
      const int stage = t % kStages, first = w.kv_lo + t * kTokens;
      const unsigned char* st = ring + stage * Fmt::kStageBytes;
      // A parity wait is only sound on a barrier at most one phase behind. Where a stage's tiles are
      // not all this warpgroup's (kStages % kGroups != 0), tile t - kStages (another warpgroup's) may
      // not have landed yet, so first wait for it to be read: the in-order copy warp has issued tile
      // t - kGroups, which landed, hence tile t - kStages before it, for which it waited on tile
      // t - 2 kStages being read; the empty barrier is then at most one phase behind, and the full
      // barrier, once tile t - kStages is read, too.
      if constexpr (kStages % kGroups != 0) {
        if (t >= kStages) arch::mbarrier_wait(&empty[stage], (t / kStages - 1) & 1);
      }
      arch::mbarrier_wait(&full[stage], (t / kStages) & 1);
      float row_scale[2] = {1.f, 1.f}, row_zero[2] = {0.f, 0.f};
      if constexpr (kZeros) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float2 sz = dequant::scale_zero<T>(reinterpret_cast<const uint32_t*>(st + kTokens * Fmt::kRowBytes)[r0 + 8 * h]);
          row_scale[h] = sz.x;
          row_zero[h] = sz.y;
        }
      }
      // fp8_ds_mla: the rows' sigma_t and rho_t (the top of the file; rho_t needs the 64 rope values of
      // a row, 16 in each thread of its quad); tile c's factor fp16(s_t,c 2^-sigma_t) of each row to the
      // V pass's slot of that token (each thread reads 16 tokens there), in this tile's half of the
      // warpgroup's factors (its tile before wrote the other).
      float rope_down[2] = {1.f, 1.f};  // 2^-rho_t
      __half* factors = factor_s + (group * 2 + (t / kGroups) % 2) * (Fmt::kFactorHalves / 2);
      if constexpr (Fmt::kDs) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = r0 + 8 * h;
          const unsigned char* at = st + row * Fmt::kRowBytes;
          const float4 s4 = *reinterpret_cast<const float4*>(at + dequant::kDsScalesOffset);
          float amax = 0.f;
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const uint4 r = *reinterpret_cast<const uint4*>(at + rope_byte + 32 * c + 16 * i);
            amax = fmaxf(fmaxf(amax, fmaxf(bf16_pair_amax(r.x), bf16_pair_amax(r.y))),
                         fmaxf(bf16_pair_amax(r.z), bf16_pair_amax(r.w)));
          }
          amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
          amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
          // |r| < 2^e puts r 2^-rho below 2^15 for rho = e - 15, exact down to 2^-24 of 2^rho (no lower
          // than fp32's least normal power, so that 2^-rho stays finite); s_t,k 2^-sigma < 1.
          const int sigma = scale_exponent(fmaxf(fmaxf(s4.x, s4.y), fmaxf(s4.z, s4.w)));
          row_scale[h] = ldexpf(1.f, sigma);
          rope_down[h] = ldexpf(1.f, -max(scale_exponent(amax) - 15, kMinScaleExponent));
          // [tile][k step][c][slot]: token 16 s + c + {0, 8, 4, 12}[slot] (the V pass's order)
          const int rem = row % 16, slot = ((rem / 4) & 1) * 2 + rem / 8;
          const float mine = c == 0 ? s4.x : c == 1 ? s4.y : c == 2 ? s4.z : s4.w;
          factors[((c * 4 + row / 16) * 4 + rem % 4) * 4 + slot] = __float2half_rn(mine * ldexpf(1.f, -sigma));
        }
      }
      // S^T = K . Q^T, a 64-feature block per 4 / kBatch batches of kBatch wgmmas; the next batch converts
      // under each.
      float sc[N / 2];
#pragma unroll
      for (int k = 0; k < N / 2; ++k) sc[k] = 0.f;
      // fp8_ds_mla: the score buffers of alternate tiles (the rope's is tile 4's), each folded into sc
      // once its wgmmas are done (the wait of its next tile's second batch), by its rows' tile scales.
      float tile_sc[Fmt::kDs ? 2 : 1][N / 2];
      auto fold = [&](const float (&buf)[N / 2], float f0, float f1) {
#pragma unroll
        for (int k = 0; k < N / 2; ++k) sc[k] += ((k / 2) % 2 == 0 ? f0 : f1) * buf[k];  // rows r0, r0 + 8
      };
      auto row_scales = [&](int h) {
        return reinterpret_cast<const float*>(st + (r0 + 8 * h) * Fmt::kRowBytes + dequant::kDsScalesOffset);
      };
      Raw16<F> v_next[4];  // kLoadAhead: the V pass's next k step (the first loaded under the softmax)
      {
        auto k_raw = [&](int j, int row) {
          const int byte = (j < 8 ? latent_byte + j * Fmt::kBlockBytes : rope_byte) + c * Fmt::kThreadBytes;
          return load_raw<F>(st + row * Fmt::kRowBytes + byte);
        };
        uint32_t a[2][kBatch][4];
        // Block j + 1's bytes are loaded before block j converts: the load's latency hides under it.
        Raw16<F> n0 = k_raw(0, r0), n1 = k_raw(0, r0 + 8), x0, x1;
        // One flat loop over the batches (block j, part h): nested, nvcc left the block loop rolled at N = 24.
        constexpr int kParts = 4 / kBatch;
        // fp8_ds_mla: a 128-feature tile is two blocks' batches; it is folded at its next tile's second
        // batch, whose wait is the first to cover the tile's last batch (tile 3's: the rope block's second).
        constexpr int kTileBatches = 2 * kParts;
        static_assert(!Fmt::kDs || kParts >= 2, "tile 3 is folded at the rope block's second batch");
#pragma unroll
        for (int batch = 0; batch < kBlocks * kParts; ++batch) {
          const int j = batch / kParts, h = batch % kParts;
          if (h == 0) {
            x0 = n0, x1 = n1;
            if (j + 1 < kBlocks) {
              if (!Fmt::kDs || j + 1 < kBlocks - 1) {  // fp8_ds_mla's rope: read at its batch
                n0 = k_raw(j + 1, r0);
                n1 = k_raw(j + 1, r0 + 8);
              }
            } else if constexpr (kLoadAhead) {
#pragma unroll
              for (int k = 0; k < 4; ++k) v_next[k] = v_raw(st, 0, k);
            }
          }
          if (batch >= 2) arch::wgmma_wait<1>();  // batch - 2's wgmmas have read a[batch % 2]
          if constexpr (Fmt::kDs) {
            if (batch % kTileBatches == 1 && batch > kTileBatches) {
              const int tile = batch / kTileBatches - 1;
              arch::pin_registers(tile_sc[tile % 2]);
              fold(tile_sc[tile % 2], row_scales(0)[tile], row_scales(1)[tile]);
            }
          }
#pragma unroll
          for (int i = 0; i < kBatch; ++i) {
            uint32_t* f = a[batch % 2][i];
            if (Fmt::kDs && j == kBlocks - 1) {  // the thread's rope pair of step s: 8 bytes of each row
              const int s = kBatch * h + i;
              const uint2 w0 = *reinterpret_cast<const uint2*>(st + r0 * Fmt::kRowBytes + rope_byte + 32 * c + 8 * s);
              const uint2 w1 = *reinterpret_cast<const uint2*>(st + (r0 + 8) * Fmt::kRowBytes + rope_byte + 32 * c + 8 * s);
              f[0] = bf16_pair_to_halves(w0.x, rope_down[0]), f[2] = bf16_pair_to_halves(w0.y, rope_down[0]);
              f[1] = bf16_pair_to_halves(w1.x, rope_down[1]), f[3] = bf16_pair_to_halves(w1.y, rope_down[1]);
              continue;
            }
            k_pairs<F>(x0, kBatch * h + i, f[0], f[2]);
            k_pairs<F>(x1, kBatch * h + i, f[1], f[3]);
          }
          arch::wgmma_fence();
#pragma unroll
          for (int i = 0; i < kBatch; ++i) {
            const int s = kBatch * h + i;
            const uint64_t desc = arch::desc_advance(q_desc, j * N * arch::kSwizzleRowBytes + s * 32);
            if constexpr (Fmt::kDs) Mma::mma(tile_sc[(j / 2) % 2], a[batch % 2][i], desc, j % 2 + s > 0);
            else Mma::mma(sc, a[batch % 2][i], desc, j + s > 0);
          }
          arch::wgmma_commit();
        }
        arch::wgmma_wait<0>();
        if constexpr (Fmt::kDs) {
          arch::pin_registers(tile_sc[0]);
          fold(tile_sc[0], 1.f / rope_down[0], 1.f / rope_down[1]);  // the rope's (tile 4's), by 2^rho_t
        }
        arch::pin_registers(sc);
      }
      // Online softmax over the tile's tokens, column by column (a column is a (token, head) row).
      // A column's running max moves only when a tile beats it by kRescaleLog2 (raised_max), and the
      // warpgroup's row-scale power only when a scale exceeds it, so most tiles move neither: P is
      // written under the running ones at once and the warps vote (one barrier). Only a tile where
      // some warp saw a value that moves them (every warpgroup's first) takes the column maxima across
      // the warps and writes P again (two barriers more); its P and O are those of that exchange.
      // P^T and the votes alternate between two buffers: the next tile writes them before any barrier,
      // while other warps may still read this tile's.
      const int parity = (t / kGroups) % 2;
      unsigned char* p_s = p_base + parity * N * arch::kSwizzleRowBytes;
      int* votes = vote_s + (group * 2 + parity) * 4;
      bool moves = false;
#pragma unroll
      for (int q = 0; q < kCols; ++q) {
        const int col = col_of(q);
        const int limit = limit_s[col];
        const float score_scale = score_scale_s[col];
        const float qsum = kZeros ? qsum_s[col] : 0.f, qbias = kZeros ? qbias_s[col] : 0.f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float& x = sc[4 * (q / 2) + 2 * h + (q % 2)];
          if constexpr (kZeros) x = row_scale[h] * (x - qbias) + row_zero[h] * qsum;  // (fp8_ds_mla's are scaled)
          x = first + r0 + 8 * h < limit ? x * score_scale : -INFINITY;
          moves |= raised_max(m_run[q], x) != m_run[q];
        }
      }
      if constexpr (kRowScaled) moves |= scale_exponent(fmaxf(fabsf(row_scale[0]), fabsf(row_scale[1]))) > sigma_run;
      // P^T [col][token slot] under the running max and power: the thread's tokens r0, r0 + 8 are slots
      // 16 wq + 2 g, + 1. Row-scaled formats: P s_t 2^-sigma_run enters the products, below 2^15
      // (P 2^7 <= 2^15, s_t < 2^sigma_run).
      float l_add[kCols], corr_add[kCols], psum_add[kCols];
      auto write_p = [&]() {
#pragma unroll
        for (int q = 0; q < kCols; ++q) {
          float pr[2];
          arch::Vec<M, 2> pv;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float x = sc[4 * (q / 2) + 2 * h + (q % 2)];
            pr[h] = m_run[q] == -INFINITY ? 0.f : arch::exp2_ftz(x - m_run[q] + Fmt::kPShift);
            pv.v[h] = arch::from_float<M>(kRowScaled ? pr[h] * (row_scale[h] * scale_down) : pr[h]);
          }
          l_add[q] = pr[0] + pr[1];
          if constexpr (kZeros) {
            corr_add[q] = pr[0] * row_zero[0] + pr[1] * row_zero[1];
            psum_add[q] = scale_up * (arch::to_float(pv.v[0]) + arch::to_float(pv.v[1]));  // P s_t as it entered
            if constexpr (!Fmt::kBiasSum) corr_add[q] -= Fmt::kCodeBias * psum_add[q];
          }
          *reinterpret_cast<uint32_t*>(p_s + arch::swizzled_offset(col_of(q), 2 * wq + g / 4) + 4 * (g % 4)) =
              *reinterpret_cast<const uint32_t*>(&pv);
        }
        arch::fence_proxy_async();
      };
      write_p();
      moves = __any_sync(0xffffffffu, moves);
      if (lane == 0) votes[wq] = moves;
      arch::named_barrier_sync(1 + group, 128);  // this tile's P^T and votes are complete
      const int4 vote = *reinterpret_cast<const int4*>(votes);
      if (vote.x | vote.y | vote.z | vote.w) {
        float tile_max[kCols];
#pragma unroll
        for (int q = 0; q < kCols; ++q) {
          tile_max[q] = fmaxf(sc[4 * (q / 2) + (q % 2)], sc[4 * (q / 2) + 2 + (q % 2)]);
#pragma unroll
          for (int o = 4; o < 32; o <<= 1) tile_max[q] = fmaxf(tile_max[q], __shfl_xor_sync(0xffffffffu, tile_max[q], o));
          if (g == 0) colmax_s[(group * 4 + wq) * N + col_of(q)] = tile_max[q];
        }
        if constexpr (kRowScaled) {
          float smax = fmaxf(fabsf(row_scale[0]), fabsf(row_scale[1]));
#pragma unroll
          for (int o = 4; o < 32; o <<= 1) smax = fmaxf(smax, __shfl_xor_sync(0xffffffffu, smax, o));
          if (lane == 0) smax_s[group * 4 + wq] = smax;
        }
        arch::named_barrier_sync(1 + group, 128);
        float grow = 1.f;
        if constexpr (kRowScaled) {
          const float smax = fmaxf(fmaxf(smax_s[group * 4], smax_s[group * 4 + 1]), fmaxf(smax_s[group * 4 + 2], smax_s[group * 4 + 3]));
          const int sigma = scale_exponent(smax);
          if (sigma > sigma_run) {
            grow = ldexpf(1.f, sigma_run - sigma);
            sigma_run = sigma;
            scale_down = ldexpf(1.f, -sigma_run);
            scale_up = ldexpf(1.f, sigma_run);
          }
        }
        float alpha[kCols];
#pragma unroll
        for (int q = 0; q < kCols; ++q) {
          const int col = col_of(q);
          float tm = colmax_s[(group * 4) * N + col];
#pragma unroll
          for (int k = 1; k < 4; ++k) tm = fmaxf(tm, colmax_s[(group * 4 + k) * N + col]);
          const float m = raised_max(m_run[q], tm);
          alpha[q] = rescale_factor<true>(m_run[q], m);
          m_run[q] = m;
          l_run[q] *= alpha[q];
          if constexpr (kZeros) corr_run[q] *= alpha[q];  // (else 0, and no registers held for it)
          if constexpr (Fmt::kBiasSum) psum_run[q] *= alpha[q];
        }
        write_p();
        arch::named_barrier_sync(1 + group, 128);  // P^T is rewritten (and colmax_s read)
#pragma unroll
        for (int q = 0; q < kCols; ++q) {
          const float f = alpha[q] * grow;
          if (f != 1.f) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              acc[i][4 * (q / 2) + (q % 2)] *= f;
              acc[i][4 * (q / 2) + 2 + (q % 2)] *= f;
            }
          }
        }
      }
#pragma unroll
      for (int q = 0; q < kCols; ++q) {
        l_run[q] += l_add[q];
        if constexpr (kZeros) corr_run[q] += corr_add[q];
        if constexpr (Fmt::kBiasSum) psum_run[q] += psum_add[q];
      }
      // O^T += V^T . P^T: k step s takes the thread's tokens 16 s + c + {0, 8, 4, 12}; kBatch of the
      // 8 M tiles per batch of wgmmas, the next batch converting under it.
      {
        uint32_t a[2][kBatch][4];
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          // fp8_ds_mla: the tile factors (tile wq, the warp's 128 columns) of the step's tokens 0, 1 / 2, 3
          uint2 fv = make_uint2(0u, 0u);
          if constexpr (Fmt::kDs) fv = *reinterpret_cast<const uint2*>(factors + ((wq * 4 + s) * 4 + c) * 4);
          Raw16<F> x[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            if constexpr (kLoadAhead) {
              x[k] = v_next[k];
              if (s + 1 < 4) v_next[k] = v_raw(st, s + 1, k);
            } else {
              x[k] = v_raw(st, s, k);
            }
          }
          // The tile's last bytes are in registers (A comes from them): the copy warp may refill the
          // stage under the last conversions and wgmmas.
          if (s == 3) arch::mbarrier_arrive(&empty[stage]);
#pragma unroll
          for (int part = 0; part < 8 / kBatch; ++part) {
            const int batch = (8 / kBatch) * s + part;
            if (batch >= 2) arch::wgmma_wait<1>();
#pragma unroll
            for (int ii = 0; ii < kBatch; ++ii) {
              uint32_t* f = a[batch % 2][ii];
              v_pairs<F>(x[0], x[1], kBatch * part + ii, f[0], f[1]);
              v_pairs<F>(x[2], x[3], kBatch * part + ii, f[2], f[3]);
              if constexpr (Fmt::kDs) {
                f[0] = times_halves(f[0], fv.x), f[1] = times_halves(f[1], fv.x);
                f[2] = times_halves(f[2], fv.y), f[3] = times_halves(f[3], fv.y);
              }
            }
            arch::wgmma_fence();
#pragma unroll
            for (int ii = 0; ii < kBatch; ++ii)
              Mma::mma(acc[kBatch * part + ii], a[batch % 2][ii], arch::desc_advance(p_desc, parity * N * arch::kSwizzleRowBytes + s * 32), 1);
            arch::wgmma_commit();
          }
        }
        arch::wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < 8; ++i) arch::pin_registers(acc[i]);
      }
    }

    // Epilogue: the warpgroups' states meet in shared memory; warpgroup 0 writes the rows.
#pragma unroll
    for (int q = 0; q < kCols; ++q) {
      float l = l_run[q], cr = kZeros ? corr_run[q] : 0.f, ps = Fmt::kBiasSum ? psum_run[q] : 0.f;
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
        l += __shfl_xor_sync(0xffffffffu, l, o);
        cr += __shfl_xor_sync(0xffffffffu, cr, o);
        ps += __shfl_xor_sync(0xffffffffu, ps, o);
      }
      if (g == 0) {
        l_s[(group * 4 + wq) * N + col_of(q)] = l;  // sanitize-allow: stats {
        corr_s[(group * 4 + wq) * N + col_of(q)] = cr;
        psum_s[(group * 4 + wq) * N + col_of(q)] = ps;
        if (wq == 0) m_s[group * N + col_of(q)] = m_run[q];  // sanitize-allow: stats }
      }
    }
    arch::named_barrier_sync(kEpilogueBarrier, kMathThreads);  // and every tile is read: the ring is free
    // [kGroups - 1][N][512]: warpgroup k's O (k >= 1) at the merged max. A thread's 16 floats of a row
    // are 4 16-byte chunks, chunk (4 u + i) ^ (col / 2 % 4), so that a quarter warp (2 u x 4 columns)
    // meets 8 chunks mod 8: all 32 banks (unswizzled, its 4 columns of a u hit the same ones).
    float* merge = reinterpret_cast<float*>(ring);
    auto merge_chunk = [&](int k, int col, int i) {
      return reinterpret_cast<float4*>(merge + ((k - 1) * N + col) * kLatentDim) + ((4 * u + i) ^ ((col >> 1) & 3));
    };
    float factor[kCols], total_l[kCols], total_corr[kCols], total_psum[kCols], merged_max[kCols];
#pragma unroll
    for (int q = 0; q < kCols; ++q) {
      const int col = col_of(q);
      float m = m_s[col];  // sanitize-allow: stats
#pragma unroll
      for (int k = 1; k < kGroups; ++k) m = fmaxf(m, m_s[k * N + col]);  // sanitize-allow: stats
      total_l[q] = total_corr[q] = total_psum[q] = 0.f;
#pragma unroll
      for (int k = 0; k < kGroups; ++k) {
        const float mk = m_s[k * N + col], fk = mk == -INFINITY ? 0.f : exp2f(mk - m);  // sanitize-allow: stats
        float l = 0.f, cr = 0.f, ps = 0.f;
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          l += l_s[(4 * k + x) * N + col];  // sanitize-allow: stats {
          cr += corr_s[(4 * k + x) * N + col];
          ps += psum_s[(4 * k + x) * N + col];  // sanitize-allow: stats }
        }
        total_l[q] += l * fk;
        total_corr[q] += cr * fk;
        total_psum[q] += ps * fk;
        if (k == group) factor[q] = fk * (kRowScaled ? ldexpf(1.f, sigma_run) : 1.f);  // O's, in its units
      }
      merged_max[q] = m;
    }
    if (group > 0) {
#pragma unroll
      for (int q = 0; q < kCols; ++q) {
        const int lo = 4 * (q / 2) + (q % 2), hi = lo + 2;  // the column's values of an M tile (h = 0, 1)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          *merge_chunk(group, col_of(q), i) = make_float4(acc[2 * i][lo] * factor[q], acc[2 * i][hi] * factor[q],  // sanitize-allow: merge-reads
                                                          acc[2 * i + 1][lo] * factor[q], acc[2 * i + 1][hi] * factor[q]);
      }
    }
    arch::named_barrier_sync(kEpilogueBarrier, kMathThreads);
    if (!kPair && group > 0) return;
    float* pair_rows = merge + S::kMergeFloats;  // [N][512], then [N] lse (merge_pair)
    float* pair_lse = pair_rows + N * kLatentDim;
    const int64_t part0 = kPair ? -1 : partial_row0<N>(p, w.b, w.row0);
    const bool split = kPair || part0 >= 0;
#pragma unroll
    for (int q = 0; q < kCols; ++q) {
      const int col = col_of(q);
      if ((kPair && group > 0) || col >= rows_here) continue;
      const float l = total_l[q];
      const float inv = l > 0.f ? kv_scale / l : 0.f;
      const int row = w.row0 + col, s = row / p.num_heads, h = row - s * p.num_heads;
      const int lo = 4 * (q / 2) + (q % 2), hi = lo + 2;
      float o[16];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float4 b = *merge_chunk(1, col, i);  // sanitize-allow: merge-reads
#pragma unroll
        for (int k = 2; k < kGroups; ++k) {
          const float4 x = *merge_chunk(k, col, i);  // sanitize-allow: merge-reads
          b = make_float4(b.x + x.x, b.y + x.y, b.z + x.z, b.w + x.w);
        }
        // int4: the codes' bias out of the columns of odd M tiles (high nibbles), then their 16
        const float bias = Fmt::kCodeBias * total_psum[q];
        auto unbiased = [&](float x, bool high) { return Fmt::kBiasSum && high ? (x - bias) * 0.0625f : x; };
        o[4 * i] = (unbiased(acc[2 * i][lo] * factor[q] + b.x, false) + total_corr[q]) * inv;
        o[4 * i + 1] = (unbiased(acc[2 * i][hi] * factor[q] + b.y, false) + total_corr[q]) * inv;
        o[4 * i + 2] = (unbiased(acc[2 * i + 1][lo] * factor[q] + b.z, true) + total_corr[q]) * inv;
        o[4 * i + 3] = (unbiased(acc[2 * i + 1][hi] * factor[q] + b.w, true) + total_corr[q]) * inv;
      }
      if (split) {
        float* dst = kPair ? pair_rows + col * kLatentDim + 16 * u
                          : static_cast<float*>(p.workspace) + (part0 + col) * kLatentDim + 16 * u;
#pragma unroll
        for (int k = 0; k < 16; k += 4) *reinterpret_cast<float4*>(dst + k) = make_float4(o[k], o[k + 1], o[k + 2], o[k + 3]);
      } else {
        T* dst = static_cast<T*>(p.out) + int64_t(w.b) * p.out_stride_b + int64_t(s) * p.out_stride_t +
                 int64_t(h) * p.out_stride_h + 16 * u;
#pragma unroll
        for (int k = 0; k < 16; k += 2) {
          arch::Vec<T, 2> v;
          v.v[0] = arch::from_float<T>(o[k]);
          v.v[1] = arch::from_float<T>(o[k + 1]);
          arch::store<T, 2>(dst + k, v);
        }
      }
      if (u == 0) {
        const float lse = l > 0.f ? (merged_max[q] - Fmt::kPShift + log2f(l)) * kLn2 : -INFINITY;
        if (kPair) {
          pair_lse[col] = lse;
        } else if (split) {
          float* ws_lse = static_cast<float*>(p.workspace) + partial_rows(p) * kLatentDim;
          ws_lse[part0 + col] = lse;
        } else {
          p.lse[int64_t(w.b) * p.lse_stride_b + int64_t(s) * p.lse_stride_t + int64_t(h) * p.lse_stride_h] = lse;
        }
      }
    }
    if constexpr (kPair) merge_pair<T, N>(p, w, rows_here, pair_rows, pair_lse, tid, kMathThreads);
  } else {
    __trap();  // the host never launches a tag the compiled target cannot run
  }
}

// pair: two splits merged by a cluster of the two CTAs of the same rows (attention_launch's pair_merge).
template <class T, class Rows, KvFormat F, int N>
Status launch(const AttentionParams& p, const Rows& rows, bool pair, cudaStream_t stream) {
  const auto kernel = pair ? attention_narrow_kernel<T, Rows, F, N, true> : attention_narrow_kernel<T, Rows, F, N, false>;
  constexpr int kBytes = int(Smem<F, N>::kBytes);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes) != cudaSuccess)
    return Status::kCudaError;
  const int grid_x = p.batch * int((int64_t(p.q_len) * p.num_heads + N - 1) / N);  // (uniform batches only)
  // Two splits: clusters of the two CTAs of the same rows (merge_pair). Pairs keep one CTA on every
  // SM (H200: 66 clusters of two resident, as many CTAs as without clusters; 4 or more fit 120).
  cudaLaunchConfig_t config{};
  config.gridDim = attention_grid(p, grid_x);
  config.blockDim = dim3(Groups<F, N>::kThreads);
  config.dynamicSmemBytes = kBytes;
  config.stream = stream;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 1;
  cluster.val.clusterDim.y = 2;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = pair ? 1 : 0;
  if (cudaLaunchKernelEx(&config, kernel, p, rows) != cudaSuccess) return Status::kCudaError;
  return cudaPeekAtLastError() == cudaSuccess ? Status::kOk : Status::kCudaError;
}

}  // namespace narrow
}  // namespace attention_detail
}  // namespace mla_kv
