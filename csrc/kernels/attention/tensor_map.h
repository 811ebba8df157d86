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

// Encodes `map` and returns true when the launch may take TMA (p.tile_loads is kAuto) and every tile
// of it is whole boxes: splits on 64-token boundaries, blocks of 16, 32 or a multiple of 64 rows,
// 16-byte aligned base and strides, and a driver with the encoder. False: the launch takes cp.async.
bool make_tile_map(const AttentionParams& p, const PagedTableRows& rows, CUtensorMap& map);

}  // namespace sm90
}  // namespace attention_detail
}  // namespace mla_kv
