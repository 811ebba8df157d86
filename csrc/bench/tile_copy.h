// The copy path of a streaming decode kernel in isolation: how fast one CTA per SM can move a paged
// cache's tiles into a shared-memory ring, by each way Hopper offers, with consumers that only wait
// for a tile and free it. Part of the Python module (mla_kv._C.tile_copy_throughput), not of the
// kernels library engines link.
#pragma once

#include <cuda_runtime.h>

namespace mla_kv {

// How a tile goes from global memory into its ring stage.
enum class TileCopy : int {
  kBulk = 0,         // one cp.async.bulk per tile, issued by one copy warp (the narrow decode's way)
  kBulkPieces = 1,   // `pieces` cp.async.bulk per tile, one per lane of that warp
  kBulkFourWarps = 2,  // one cp.async.bulk per tile, four copy warps taking every fourth tile
  kCpAsync = 3,      // cp.async 16 bytes a thread by a copy warpgroup of 128 threads
};

// `ctas` CTAs each move `tiles` tiles of `tile_bytes` (a multiple of 16, at most 227 KB / stages)
// through a ring of `stages` (even; a multiple of 4 for kBulkFourWarps). Tile t of CTA c is block
// table[c * tiles + t] of `src` (blocks `block_bytes` apart, 16-byte aligned), looked up by the copy
// thread as a decode kernel's block table is. Returns the bytes moved, or -1 (bad arguments, no
// sm_90 device, launch failure). `sink` (4 bytes of device memory) keeps the consumers' reads.
double invokeTileCopyThroughput(TileCopy method, const void* src, const int* table, long long block_bytes,
                                int tile_bytes, int ctas, int tiles, int stages, int pieces, unsigned* sink,
                                cudaStream_t stream);

}  // namespace mla_kv
