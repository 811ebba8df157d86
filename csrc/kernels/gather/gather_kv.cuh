// The gather kernel: out row t (packed over sequences) = the cache row of position
// starts[b] + t - cu_kv_lens[b] of the sequence b owning t, latent first.
//
// Why a 1-D grid over output rows with a per-row binary search over cu_kv_lens, and not a 2-D grid
// of (row tile, sequence): the 2-D grid needs the longest sequence on the host to size it (device
// data, so a host sync that a CUDA graph cannot hold) or a bound such as the total row count, which
// launches batch x total / tile CTAs that mostly exit at once; and each sequence's last tile is
// partial, so the short sequences of a real batch (decode-like rows, chunk tails) leave most of
// their CTA idle. The 1-D grid is sized by out's rows (known on the host), every warp copies whole
// consecutive rows whatever the sequence boundaries, and the token -> sequence lookup costs each
// row log2(batch) loads of a small, L1-resident array, done by a few lanes in parallel and hidden
// behind the copies other warps have in flight.
//
// Bandwidth: a warp owns kRowsPerWarp consecutive rows, kVecsPerLane vectors per lane; every lane
// issues all its (16-byte) loads before its first store, so about 4.6 KB per warp and well over
// 100 KB per SM are in flight, several times HBM's latency x bandwidth product per SM. Loads stream
// past L1 (data used once); stores use the default policy so that the next GEMM can find out in L2.
// The element type only sets the byte offsets of the two row parts: T is a same-size unsigned
// integer, so fp16 and bf16 share one instantiation and no arithmetic is done.
// Reference: python/mla_kv/reference/gather.py (gather_kv, gather_kv_blocks).
#pragma once

#include <climits>
#include <cstdint>

#include "../address.cuh"
#include "../arch/arch.cuh"
#include "mla_kv/gather.h"

namespace mla_kv {
namespace gather_detail {

constexpr int kWarpsPerBlock = 8;
constexpr int kVecsPerLane = 9;

// Rows a warp copies with N-element vectors: 72 (16-bit, 16 B), 144 (32-bit, 16 B) or 288 (two
// elements) vectors per row make 4, 2 or 1 whole rows of 32 x kVecsPerLane vectors.
template <int N>
constexpr int kRowsPerWarp = 32 * kVecsPerLane / (kRowDim / N);

// The cache row of out row t, or nullptr when the row is not written (see mla_kv/gather.h).
template <class Rows>
__device__ __forceinline__ const char* source_row(const GatherKvParams& p, const Rows& rows, int64_t t) {
  if (t >= p.out_rows || t >= p.cu_kv_lens[p.batch]) return nullptr;
  const int b = sequence_of(p.cu_kv_lens, p.batch, t);
  const int64_t pos = (p.starts ? p.starts[b] : 0) + (t - p.cu_kv_lens[b]);
  if (pos < 0 || pos > INT_MAX) return nullptr;
  const char* base = rows.block_base(b, int(pos));
  return base ? rows.row_in_block(base, int(pos)) : nullptr;
}

template <class A, class T, int N, class Rows>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    gather_kv_kernel(const GatherKvParams p, const Rows rows) {
  if constexpr (arch::target_supports<A>()) {
    constexpr int kVecsPerRow = kRowDim / N;
    static_assert(kRowsPerWarp<N> * kVecsPerRow == 32 * kVecsPerLane, "a warp copies whole rows");

    const int lane = threadIdx.x & 31;
    const int64_t first = (int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5)) * kRowsPerWarp<N>;
    // Lane r resolves row first + r; the others read its address by shuffle (no shared memory,
    // no barrier). Every lane takes part in the shuffles, so nobody returns early.
    const char* own = lane < kRowsPerWarp<N> ? source_row(p, rows, first + lane) : nullptr;
    const auto own_bits = static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(own));

    arch::Vec<T, N> data[kVecsPerLane];
    const T* src[kVecsPerLane];
#pragma unroll
    for (int k = 0; k < kVecsPerLane; ++k) {
      const int v = k * 32 + lane;
      const int r = v / kVecsPerRow;
      const auto row = reinterpret_cast<const T*>(static_cast<uintptr_t>(__shfl_sync(0xffffffffu, own_bits, r)));
      src[k] = row ? row + (v - r * kVecsPerRow) * N : nullptr;
      if (src[k]) data[k] = arch::load_stream<A, T, N>(src[k]);
    }
    T* out = static_cast<T*>(p.out);
#pragma unroll
    for (int k = 0; k < kVecsPerLane; ++k) {
      if (src[k] == nullptr) continue;
      const int v = k * 32 + lane;
      const int r = v / kVecsPerRow;
      const int stored = (v - r * kVecsPerRow) * N;  // element of the cache row; N divides both parts
      arch::store<T, N>(out + (first + r) * p.out_stride + canonical_column(rows.cache.row, stored), data[k]);
    }
  } else {
    __trap();  // the host never launches a tag the compiled target cannot run
  }
}

// Host side: picks the vector width (16 bytes, or two elements when an address or stride does not
// allow 16) and launches one warp per kRowsPerWarp rows of out.
template <class A, class T, class Rows>
Status launch_gather_kv(const GatherKvParams& p, const Rows& rows, bool vec16, cudaStream_t stream) {
  if (p.out_rows <= 0 || p.batch <= 0) return Status::kOk;
  auto go = [&](auto kernel, int rows_per_warp) {
    const int64_t warps = (p.out_rows + rows_per_warp - 1) / rows_per_warp;
    const dim3 grid(unsigned((warps + kWarpsPerBlock - 1) / kWarpsPerBlock));
    kernel<<<grid, kWarpsPerBlock * 32, 0, stream>>>(p, rows);
    return cudaPeekAtLastError() == cudaSuccess ? Status::kOk : Status::kCudaError;
  };
  constexpr int kVec = 16 / sizeof(T);
  return vec16 ? go(gather_kv_kernel<A, T, kVec, Rows>, kRowsPerWarp<kVec>)
               : go(gather_kv_kernel<A, T, 2, Rows>, kRowsPerWarp<2>);
}

}  // namespace gather_detail
}  // namespace mla_kv
