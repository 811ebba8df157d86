// Tensor-core ceilings: 4 independent accumulator chains per warp of the WarpMma16 tile of a tag;
// on Sm90, the m64n256k16 wgmma from shared memory that the Hopper attention kernel uses.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../kernels/arch/arch.cuh"
#include "../kernels/arch/mma.cuh"
#include "../kernels/arch/wgmma.cuh"
#include "mma_throughput.h"

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

constexpr int kWgmmaPerGroup = 16;  // wgmma issued between waits

// Two warpgroups per CTA, each accumulating P.V-shaped products (A: 64 x 16, B: 16 x 256 MN-major).
template <class T>
__global__ void __launch_bounds__(256, 1) wgmma_throughput_kernel(int iterations, float* sink) {
  if constexpr (arch::target_supports<arch::Sm90>()) {
    constexpr int kA = 64 * 64, kB = 4 * 64 * 64;  // one 64-row chunk; four 64-column chunks
    __shared__ __align__(1024) T a_s[kA];
    __shared__ __align__(1024) T b_s[kB];
    for (int i = threadIdx.x; i < kA; i += blockDim.x) a_s[i] = arch::from_float<T>(0.001f * (i % 7));
    for (int i = threadIdx.x; i < kB; i += blockDim.x) b_s[i] = arch::from_float<T>(0.001f * (i % 5));
    arch::fence_proxy_async();
    __syncthreads();
    const uint64_t a = arch::swizzled_desc(a_s, 16, arch::kSwizzleAtomBytes);
    const uint64_t b = arch::swizzled_desc(b_s, 64 * arch::kSwizzleRowBytes, arch::kSwizzleAtomBytes);
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    for (int it = 0; it < iterations; ++it) {
      arch::wgmma_fence();
#pragma unroll
      for (int k = 0; k < kWgmmaPerGroup; ++k)
        arch::Wgmma<T, 256, true>::mma(acc, arch::desc_advance(a, (k % 4) * 32),
                                       arch::desc_advance(b, (k % 4) * 16 * arch::kSwizzleRowBytes), 1);
      arch::wgmma_commit();
      arch::wgmma_wait<0>();
      arch::pin_registers(acc);
    }
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 128; ++i) s += acc[i];
    if (s == 12345.f) *sink = s;  // keeps the work; never true for these inputs
  } else {
    __trap();
  }
}

}  // namespace

double invokeMmaThroughput(Arch arch, DType dtype, int blocks, int iterations, cudaStream_t stream) {
  const Arch tag = resolve_arch(arch, device_compute_capability());
  if (tag == Arch::kAuto || (dtype == DType::kBFloat16 && !tag_has_bf16(tag)) || dtype == DType::kFloat32)
    return -1.0;
  if (tag == Arch::kSm90) {
    if (dtype == DType::kBFloat16)
      wgmma_throughput_kernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(iterations, nullptr);
    else
      wgmma_throughput_kernel<__half><<<blocks, 256, 0, stream>>>(iterations, nullptr);
    if (cudaPeekAtLastError() != cudaSuccess) return -1.0;
    return double(blocks) * 2 * iterations * kWgmmaPerGroup * 2.0 * 64 * 256 * 16;
  }
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
