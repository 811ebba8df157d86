// merge_states: combines two attention states over disjoint key sets by their log-sum-exp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../arch/arch.cuh"
#include "common.cuh"
#include "mla_kv/merge.h"

namespace mla_kv {
namespace {

constexpr int kRowsPerBlock = 4;

template <class T>
__global__ void __launch_bounds__(kRowsPerBlock * 32) merge_states_kernel(const MergeParams p) {
  const int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (r >= p.num_rows) return;
  const int lane = threadIdx.x & 31;
  const attention_detail::StateWeights w = attention_detail::merge_weights(p.lse_a[r], p.lse_b[r]);
  const T* a = static_cast<const T*>(p.out_a) + r * p.out_a_stride;
  const T* b = static_cast<const T*>(p.out_b) + r * p.out_b_stride;
  T* o = static_cast<T*>(p.out) + r * p.out_stride;
  for (int c = lane; c < p.dim; c += 32) {
    const float va = w.a > 0.f ? arch::to_float(a[c]) * w.a : 0.f;
    const float vb = w.b > 0.f ? arch::to_float(b[c]) * w.b : 0.f;
    o[c] = arch::from_float<T>((va + vb) * w.inv);
  }
  if (lane == 0 && p.lse != nullptr) p.lse[r] = w.lse();
}

}  // namespace

Status invokeMergeStates(const MergeParams& p, cudaStream_t stream) {
  if (p.num_rows == 0) return Status::kOk;
  const dim3 grid(unsigned((p.num_rows + kRowsPerBlock - 1) / kRowsPerBlock)), block(kRowsPerBlock * 32);
  switch (p.dtype) {
    case DType::kFloat16: merge_states_kernel<__half><<<grid, block, 0, stream>>>(p); break;
    case DType::kBFloat16: merge_states_kernel<__nv_bfloat16><<<grid, block, 0, stream>>>(p); break;
    case DType::kFloat32: merge_states_kernel<float><<<grid, block, 0, stream>>>(p); break;
  }
  return cudaPeekAtLastError() == cudaSuccess ? Status::kOk : Status::kCudaError;
}

}  // namespace mla_kv
