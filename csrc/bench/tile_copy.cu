// See tile_copy.h. Consumers: two warpgroups taking alternate tiles, as the narrow decode's math
// warpgroups do; each thread reads 16 bytes of its tile (so a tile is read before it is freed).
#include "../kernels/arch/arch.cuh"
#include "../kernels/arch/wgmma.cuh"
#include "mla_kv/arch.h"
#include "tile_copy.h"

namespace mla_kv {
namespace {

constexpr int kConsumerGroups = 2;
constexpr int kThreads = 128 + 128 * kConsumerGroups;  // a copy warpgroup, then the consumers

template <TileCopy M>
__global__ void __launch_bounds__(kThreads, 1)
    tile_copy_kernel(const char* src, const int* table, long long block_bytes, int tile_bytes, int tiles, int stages,
                     int pieces, unsigned* sink) {
  if constexpr (arch::target_supports<arch::Sm90>()) {
    extern __shared__ unsigned char smem_raw[];
    unsigned char* ring = arch::aligned_smem(smem_raw);
    uint64_t* full = reinterpret_cast<uint64_t*>(ring + size_t(stages) * tile_bytes);
    uint64_t* empty = full + stages;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    if (tid < stages) {
      arch::mbarrier_init(&full[tid], M == TileCopy::kCpAsync ? 128 : 1);
      arch::mbarrier_init(&empty[tid], 128);
    }
    arch::fence_proxy_async();
    __syncthreads();
    const int* my_table = table + size_t(blockIdx.x) * tiles;
    if (warp < 4) {  // the copy warpgroup
      const int first = M == TileCopy::kBulkFourWarps ? warp : 0, step = M == TileCopy::kBulkFourWarps ? 4 : 1;
      if (M != TileCopy::kCpAsync && M != TileCopy::kBulkFourWarps && warp > 0) return;
      for (int t = first; t < tiles; t += step) {
        const int stage = t % stages, use = t / stages;
        unsigned char* dst = ring + size_t(stage) * tile_bytes;
        const char* from = src + block_bytes * __ldg(my_table + t);
        if (use > 0) arch::mbarrier_wait(&empty[stage], (use - 1) & 1);
        if constexpr (M == TileCopy::kCpAsync) {
          for (int b = 16 * tid; b < tile_bytes; b += 16 * 128) arch::cp_async_16(dst + b, from + b, true);
          arch::cp_async_arrive(&full[stage]);
        } else if constexpr (M == TileCopy::kBulkPieces) {
          const int piece = (tile_bytes / pieces + 15) / 16 * 16;
          if (lane == 0) arch::mbarrier_arrive_expect(&full[stage], tile_bytes);
          __syncwarp();
          const int at = lane * piece;
          if (lane < pieces && at < tile_bytes)
            arch::bulk_load(dst + at, from + at, min(piece, tile_bytes - at), &full[stage]);
        } else {
          if (lane == 0) {
            arch::mbarrier_arrive_expect(&full[stage], tile_bytes);
            arch::bulk_load(dst, from, tile_bytes, &full[stage]);
          }
        }
      }
      return;
    }
    const int group = (warp - 4) / 4, thread = tid % 128;
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (int t = group; t < tiles; t += kConsumerGroups) {
      const int stage = t % stages;
      arch::mbarrier_wait(&full[stage], (t / stages) & 1);
      const uint4 x = *reinterpret_cast<const uint4*>(ring + size_t(stage) * tile_bytes + (16 * thread) % tile_bytes);
      acc.x ^= x.x, acc.y ^= x.y, acc.z ^= x.z, acc.w ^= x.w;
      arch::mbarrier_arrive(&empty[stage]);
    }
    if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) *sink = acc.x;  // keeps the reads
  } else {
    __trap();
  }
}

template <TileCopy M>
cudaError_t launch(const void* src, const int* table, long long block_bytes, int tile_bytes, int ctas, int tiles,
                   int stages, int pieces, unsigned* sink, cudaStream_t stream) {
  const size_t bytes = size_t(stages) * tile_bytes + 2 * stages * sizeof(uint64_t) + arch::kSwizzleAtomBytes;
  const auto kernel = tile_copy_kernel<M>;
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  if (e != cudaSuccess) return e;
  kernel<<<ctas, kThreads, bytes, stream>>>(static_cast<const char*>(src), table, block_bytes, tile_bytes, tiles,
                                            stages, pieces, sink);
  return cudaPeekAtLastError();
}

}  // namespace

double invokeTileCopyThroughput(TileCopy method, const void* src, const int* table, long long block_bytes,
                                int tile_bytes, int ctas, int tiles, int stages, int pieces, unsigned* sink,
                                cudaStream_t stream) {
  if (device_compute_capability() < 90 || src == nullptr || table == nullptr || sink == nullptr) return -1.0;
  const size_t ring = size_t(stages) * tile_bytes + 2 * stages * sizeof(uint64_t) + arch::kSwizzleAtomBytes;
  if (tile_bytes <= 0 || tile_bytes % 16 != 0 || block_bytes < tile_bytes || block_bytes % 16 != 0 || ctas < 1 ||
      tiles < 1 || stages < 2 || stages % 2 != 0 || stages > 128 || ring > size_t(kSmemHopper.per_block) ||
      (method == TileCopy::kBulkFourWarps && stages % 4 != 0) ||
      (method == TileCopy::kBulkPieces && (pieces < 1 || pieces > 32)))
    return -1.0;
  const auto args = [&](auto kernel_launch) {
    return kernel_launch(src, table, block_bytes, tile_bytes, ctas, tiles, stages, pieces, sink, stream);
  };
  cudaError_t e = cudaErrorInvalidValue;
  switch (method) {
    case TileCopy::kBulk: e = args(launch<TileCopy::kBulk>); break;
    case TileCopy::kBulkPieces: e = args(launch<TileCopy::kBulkPieces>); break;
    case TileCopy::kBulkFourWarps: e = args(launch<TileCopy::kBulkFourWarps>); break;
    case TileCopy::kCpAsync: e = args(launch<TileCopy::kCpAsync>); break;
  }
  return e == cudaSuccess ? double(ctas) * tiles * tile_bytes : -1.0;
}

}  // namespace mla_kv
