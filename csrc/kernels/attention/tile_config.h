// Tile configurations of the mma.sync attention kernel (the Sm70 / Sm75 / Sm80 tags) and their
// shared-memory footprint, in one place for the kernel (its layout), the host (which configuration
// a launch takes on this device) and the compile-time checks (each configuration against the
// smallest GPU it is meant for). Host and device code, no CUDA headers.
#pragma once

#include <cstddef>

#include "mla_kv/arch.h"
#include "mla_kv/layout.h"

namespace mla_kv {
namespace attention_detail {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kPitch = kRowDim + 8;  // smem row pitch (elements): rows shift 4 banks

struct TileConfig {
  int block_m = 0;       // query rows (token, head) per CTA: 16, 32 or 64
  int block_n = 0;       // cache rows per tile: 32 or 64
  int stages = 0;        // 1: the next tile staged in registers (any tag); 2-3: a cp.async ring (Sm80+)
  bool probs_in_scores = false;  // P overwrites the score partials: Turing's 64 KB (see prob_pitch)
  int max_ctas_per_sm = 0;  // the __launch_bounds__ occupancy (2 caps registers at 128 per thread)
  SmemLimits meant_for;  // the smallest budget of the GPUs that run it (asserted below)
};

// The warp tiling of Q.K^T a configuration implies: a warp computes qk_tiles_m x qk_tiles_n 16x16
// score tiles over one of split_k slices of the 576-d contraction, which meet in shared memory.
constexpr int qk_tiles_m(const TileConfig& c) { return c.block_m >= 64 ? 2 : 1; }
constexpr int qk_tiles_n(const TileConfig& c) { return c.block_n == 64 ? 2 : 1; }
constexpr int qk_groups(const TileConfig& c) {
  return (c.block_m / 16 / qk_tiles_m(c)) * (c.block_n / 16 / qk_tiles_n(c));
}
constexpr int split_k(const TileConfig& c) { return kWarps / qk_groups(c); }
constexpr int score_pitch(const TileConfig& c) { return c.block_n + 4; }  // fp32 score row pitch
// P row pitch (elements). In the score buffer, P row r lies on row r of the first slice of partials,
// which only row r's threads read: lanes of one warp, so a warp barrier (not a block barrier)
// orders their reads before the P stores.
constexpr int prob_pitch(const TileConfig& c) { return c.probs_in_scores ? 2 * score_pitch(c) : c.block_n + 8; }

// Shared memory of a CTA, in the order the kernel lays it out: Q, the KV stages, the score
// partials, P (unless it lives in the score partials), then three per-row statistics.
struct SmemParts {
  size_t q, kv, scores, probs, row_stats;
  constexpr size_t total() const { return q + kv + scores + probs + 3 * row_stats; }
};
constexpr SmemParts smem_parts(const TileConfig& c) {
  return {size_t(c.block_m) * kPitch * 2, size_t(c.stages) * c.block_n * kPitch * 2,
          size_t(split_k(c)) * c.block_m * score_pitch(c) * 4,
          c.probs_in_scores ? 0 : size_t(c.block_m) * prob_pitch(c) * 2, size_t(c.block_m) * 4};
}
constexpr size_t smem_bytes(const TileConfig& c) { return smem_parts(c).total(); }

// Each tag's configurations, best first for each CTA height. A launch takes the first of the
// height it wants that fits the device (else the next lower height): the larger ones run only
// where the device allows them.
//  - Sm70 (V100, 96 KB): register-staged 16- and 32-row CTAs (a 64-row Q tile does not fit).
//  - Sm75 (T4 / RTX 20, 64 KB): a 16-row CTA, P in the score buffer (66,752 B otherwise).
//  - Sm80: an A100 (163 KB) takes cp.async rings (two 32-row tiles in flight for 16-row CTAs,
//    three for 32-row) and a register-staged 64-row CTA; sm86 / sm89 (99 KB) take the
//    register-staged 16- and 32-row CTAs.
constexpr int kMaxTileConfigs = 5;
struct TileConfigs {
  int count = 0;
  TileConfig at[kMaxTileConfigs];
};
constexpr TileConfigs tile_configs(Arch tag) {
  switch (tag) {
    case Arch::kSm70:
      return {2, {{16, 32, 1, false, 1, kSmemV100}, {32, 32, 1, false, 1, kSmemV100}}};
    case Arch::kSm75:
      return {1, {{16, 32, 1, true, 1, kSmemTuring}}};
    case Arch::kSm80:
      return {5,
              {{16, 32, 2, false, 2, kSmemA100},
               {16, 32, 1, false, 1, kSmemAmpereAda},
               {32, 32, 3, false, 1, kSmemA100},
               {32, 32, 1, false, 1, kSmemAmpereAda},
               {64, 32, 1, false, 1, kSmemA100}}};
    default:
      return {0, {}};
  }
}

// The register-staged configuration of config i's CTA and tile shape (i itself when it is one): the
// quantized caches' loads dequantize from registers. Fits wherever config i does (no ring).
constexpr int register_staged_twin(Arch tag, int i) {
  const TileConfigs list = tile_configs(tag);
  for (int j = 0; j < list.count; ++j) {
    const TileConfig& c = list.at[j];
    if (c.stages == 1 && c.block_m == list.at[i].block_m && c.block_n == list.at[i].block_n &&
        smem_bytes(c) <= smem_bytes(list.at[i]))
      return j;
  }
  return -1;
}

template <Arch kTag>
constexpr bool configs_fit_their_gpus() {
  constexpr TileConfigs list = tile_configs(kTag);
  for (int i = 0; i < list.count; ++i) {
    const TileConfig& c = list.at[i];
    const bool async_ok = c.stages == 1 || kTag >= Arch::kSm80;
    const bool shape_ok = (c.block_n == 32 || c.block_n == 64) && c.block_m % 16 == 0 &&
                          kWarps % qk_groups(c) == 0 && (kRowDim / 16) % split_k(c) == 0;
    const bool probs_ok = !c.probs_in_scores || kThreads / c.block_m <= 32;  // a row's threads in one warp
    const bool fits = smem_bytes(c) <= size_t(c.meant_for.per_block) &&
                      smem_bytes(c) + c.meant_for.reserved_per_block <= size_t(c.meant_for.per_sm);
    if (!async_ok || !shape_ok || !probs_ok || !fits || register_staged_twin(kTag, i) < 0) return false;
  }
  return true;
}
static_assert(configs_fit_their_gpus<Arch::kSm70>(), "an Sm70 tile configuration exceeds the V100's 96 KB");
static_assert(configs_fit_their_gpus<Arch::kSm75>(), "an Sm75 tile configuration exceeds the T4's 64 KB");
static_assert(configs_fit_their_gpus<Arch::kSm80>(), "an Sm80 tile configuration exceeds the GPU it is meant for");

}  // namespace attention_detail
}  // namespace mla_kv
