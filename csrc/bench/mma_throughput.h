// Ceilings for the benchmarks: the tensor-core throughput the attention kernels' instructions can
// reach on this GPU, measured with the same tile they use (mma.sync, or wgmma on Sm90). Part of the
// Python module (mla_kv._C.mma_throughput), not of the kernels library engines link.
#pragma once

#include <cuda_runtime.h>

#include "mla_kv/arch.h"
#include "mla_kv/layout.h"

namespace mla_kv {

// Launches `blocks` CTAs of 8 warps, each warp issuing `iterations` x 4 independent 16x16x16 tiles
// (Sm90: each of the two warpgroups `iterations` x 16 wgmma m64n256k16). Returns the FLOPs executed,
// to divide by the measured time.
double invokeMmaThroughput(Arch arch, DType dtype, int blocks, int iterations, cudaStream_t stream);

}  // namespace mla_kv
