// Host side of the Hopper kernel's TMA tile loads (attention_sm90.cuh): the 3-D tensor map over a
// paged cache's blocks whose 128-byte swizzled boxes are the kernel's tile chunks.
#pragma once

#include <cuda.h>

#include "../address.cuh"
#include "mla_kv/attention.h"

namespace mla_kv {
namespace attention_detail {
namespace sm90 {

constexpr int kTmaBoxTokens = 64;  // cache rows per box: one tile of the kernel

// Whether a launch may take TMA (p.tile_loads is kAuto) with every tile whole boxes of a tensor map:
// splits on 64-token boundaries, blocks of 16, 32 or a multiple of 64 rows, 16-byte aligned base and
// strides (c null: the cache's part unchecked). Else it takes cp.async.
bool tile_map_fits(const AttentionParams& p, const PagedCache* c);
// Encodes `map` over cache c (one tile_map_fits accepts); false if the driver has no encoder or refuses it.
bool make_tile_map(const AttentionParams& p, const PagedCache& c, CUtensorMap& map);

}  // namespace sm90
}  // namespace attention_detail
}  // namespace mla_kv
