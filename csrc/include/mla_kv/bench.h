// Ceilings for the benchmarks: the tensor-core throughput the attention kernels' instructions can
// reach on this GPU, measured with the same warp-level tile they use.
#pragma once

#include <cuda_runtime.h>

#include "mla_kv/arch.h"
#include "mla_kv/layout.h"

namespace mla_kv {

// Launches `blocks` CTAs of 8 warps, each warp issuing `iterations` x 4 independent 16x16x16 tiles.
// Returns the FLOPs executed (2 * 16^3 per tile), to divide by the measured time.
double invokeMmaThroughput(Arch arch, DType dtype, int blocks, int iterations, cudaStream_t stream);

}  // namespace mla_kv
