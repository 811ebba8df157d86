// Tensor-core ceiling: 4 independent accumulator chains per warp of the WarpMma16 tile of a tag.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../arch/arch.cuh"
#include "../arch/mma.cuh"
#include "mla_kv/bench.h"

namespace mla_kv {
namespace {

constexpr int kChains = 4;

template <class A, class T>
__global__ void __launch_bounds__(256) mma_throughput_kernel(int iterations, float* sink) {
  if constexpr (arch::target_supports<A>()) {
    __shared__ __align__(16) T tile[16 * 24];
    for (int i = threadIdx.x; i < 16 * 24; i += blockDim.x) tile[i] = arch::from_float<T>(0.001f * (i % 7));
    __syncthreads();
    using Mma = arch::WarpMma16<A, T>;
    const int lane = threadIdx.x & 31;
    typename Mma::FragA a;
    typename Mma::FragB b;
    Mma::load_a(a, tile, 24, lane);
    Mma::load_b_nk(b, tile, 24, lane);
    float acc[kChains][8] = {};
    for (int it = 0; it < iterations; ++it)
#pragma unroll
      for (int c = 0; c < kChains; ++c) Mma::mma(acc[c], a, b);
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < kChains; ++c)
#pragma unroll
      for (int i = 0; i < 8; ++i) s += acc[c][i];
    if (s == 12345.f) *sink = s;  // keeps the work; never true for these inputs
  } else {
    __trap();
  }
}

}  // namespace

double invokeMmaThroughput(Arch arch, DType dtype, int blocks, int iterations, cudaStream_t stream) {
  const Arch tag = resolve_arch(arch, device_compute_capability());
  if (tag == Arch::kAuto || (dtype == DType::kBFloat16 && tag != Arch::kSm80) || dtype == DType::kFloat32)
    return -1.0;
  if (dtype == DType::kBFloat16)
    mma_throughput_kernel<arch::Sm80, __nv_bfloat16><<<blocks, 256, 0, stream>>>(iterations, nullptr);
  else if (tag == Arch::kSm70)
    mma_throughput_kernel<arch::Sm70, __half><<<blocks, 256, 0, stream>>>(iterations, nullptr);
  else if (tag == Arch::kSm75)
    mma_throughput_kernel<arch::Sm75, __half><<<blocks, 256, 0, stream>>>(iterations, nullptr);
  else
    mma_throughput_kernel<arch::Sm80, __half><<<blocks, 256, 0, stream>>>(iterations, nullptr);
  if (cudaPeekAtLastError() != cudaSuccess) return -1.0;
  return double(blocks) * 8 * iterations * kChains * 2.0 * 16 * 16 * 16;
}

}  // namespace mla_kv
