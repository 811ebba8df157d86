// merge_states: two partial attention states over disjoint key sets combined by their log-sum-exp
// (split-KV across launches, context parallelism, a cached prefix and new tokens).
// Reference: python/mla_kv/reference (merge_states).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "mla_kv/layout.h"

namespace mla_kv {

// out = merge of two partial attention states over disjoint key sets, by their lse (natural log):
// rows [num_rows, dim] with row strides (elements); lse [num_rows] contiguous fp32.
struct MergeParams {
  DType dtype;  // of the outs
  int64_t num_rows;
  int dim;
  const void* out_a; int64_t out_a_stride; const float* lse_a;
  const void* out_b; int64_t out_b_stride; const float* lse_b;
  void* out; int64_t out_stride; float* lse;  // lse may be nullptr
};
Status invokeMergeStates(const MergeParams& params, cudaStream_t stream);

}  // namespace mla_kv
