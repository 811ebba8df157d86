// Tile shapes of the expanded-form attention kernel and their shared memory, for the kernel (its
// layout), the host (which shape a launch takes) and the compile-time checks (every shape a tag
// uses fits the smallest GPU that tag serves). Host and device code, no CUDA headers.
#pragma once

#include <cstddef>

#include "mla_kv/arch.h"

namespace mla_kv {
namespace expanded_detail {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockN = 32;  // keys per tile (K and V tiles of 64 keys do not fit a V100 beside Q)
constexpr int kPad = 8;      // row padding (elements): 16-byte rows shift 4 banks, ldmatrix conflict-free

struct ExpandedShape {
  int d_qk, d_v;   // head dims
  int block_m;     // query rows (tokens of one head) per CTA: 64, or 32
  int qk_tiles_n;  // 16 x 16 score tiles a warp computes side by side (1 or 2; see qk_tiles_n_for)
};

// The warp tiling of S = Q.K^T: (block_m / 16) x 2 score tiles of 16 x 16 in groups of qk_tiles_n
// side by side, each group computed by split_k warps contracting 1 / split_k of d_qk each; the
// slices meet in shared memory.
constexpr int score_groups(const ExpandedShape& s) { return s.block_m / 16 * (kBlockN / 16 / s.qk_tiles_n); }
constexpr int split_k(const ExpandedShape& s) { return kWarps / score_groups(s); }
constexpr int score_pitch() { return kBlockN + 4; }  // fp32
constexpr int prob_pitch() { return kBlockN + kPad; }

// Shared memory in the kernel's order: Q, the K tile, the V tile, the score partials, P, and three
// per-row statistics (alpha, max, sum).
struct ExpandedSmem {
  size_t q, k, v, scores, probs, row_stats;
  constexpr size_t total() const { return q + k + v + scores + probs + 3 * row_stats; }
};
constexpr ExpandedSmem expanded_smem(const ExpandedShape& s) {
  return {size_t(s.block_m) * (s.d_qk + kPad) * 2, size_t(kBlockN) * (s.d_qk + kPad) * 2,
          size_t(kBlockN) * (s.d_v + kPad) * 2, size_t(split_k(s)) * s.block_m * score_pitch() * 4,
          size_t(s.block_m) * prob_pitch() * 2, size_t(s.block_m) * 4};
}

// The smallest shared memory of the GPUs each tag serves: Sm70 the V100, Sm75 the T4 / RTX 20.
constexpr SmemLimits serves(Arch tag) { return tag == Arch::kSm70 ? kSmemV100 : kSmemTuring; }

// The CTA height of tag `tag` at these head dims: 64 rows where they fit the tag's smallest GPU
// (each K / V tile then serves twice the queries), else 32. A launch takes a lower height where the
// device (or the limits the caller imposes) cannot hold it.
constexpr int block_m_for(Arch tag, int d_qk, int d_v) {
  return expanded_smem({d_qk, d_v, 64, 1}).total() <= size_t(serves(tag).per_block) ? 64 : 32;
}

// Two score tiles per warp where the tag's smallest GPU holds the partials of the deeper d_qk split
// this implies: each Q fragment then feeds two mma, which halves Q's shared-memory reads in Q.K^T
// (the Sm70 kernel is bound by shared-memory bandwidth on a V100, bench/RESULTS.md). The lower
// height, for devices (or imposed limits) below the tag's smallest GPU, keeps the smallest footprint.
constexpr int qk_tiles_n_for(Arch tag, int d_qk, int d_v, int block_m) {
  const bool fits = expanded_smem({d_qk, d_v, block_m, 2}).total() <= size_t(serves(tag).per_block);
  return block_m == block_m_for(tag, d_qk, d_v) && fits ? 2 : 1;
}
constexpr ExpandedShape shape_for(Arch tag, int d_qk, int d_v, int block_m) {
  return {d_qk, d_v, block_m, qk_tiles_n_for(tag, d_qk, d_v, block_m)};
}

template <Arch kTag, int kDqk, int kDv>
constexpr bool shapes_fit_their_gpus() {
  for (int block_m = block_m_for(kTag, kDqk, kDv); block_m >= 32; block_m /= 2) {
    const ExpandedShape s = shape_for(kTag, kDqk, kDv, block_m);
    const bool tiling_ok = kWarps % score_groups(s) == 0 && (kDqk / 16) % split_k(s) == 0 &&
                           kDv % (16 * kWarps) == 0 && kThreads % block_m == 0;
    if (!tiling_ok || expanded_smem(s).total() > size_t(serves(kTag).per_block)) return false;
  }
  return true;
}

}  // namespace expanded_detail
}  // namespace mla_kv
