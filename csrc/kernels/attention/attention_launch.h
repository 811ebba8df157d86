// Declarations of the per-arch attention launchers; explicit instantiations live in one .cu per
// (arch tag, dtype) so the builds run in parallel.
#pragma once

#include <cuda.h>

#include "../address.cuh"
#include "mla_kv/attention.h"

namespace mla_kv {
namespace attention_detail {

// The launchers run what attention.cu's attention_launch chose; none of them chooses anything.

// Tag A's tile configuration `config` (tile_config.h) over rows of format F.
template <class A, class T, class Rows, KvFormat F>
Status launch_attention(const AttentionParams& p, const Rows& rows, int config, int grid_x, cudaStream_t stream);

// The split-KV combine of a launch (combine.cu, one instantiation per dtype): when is kAfter or kEarly
// (attention.h; the Hopper kernels run arch::launch_dependents as they start, so an early combine's
// CTAs are scheduled while the attention grid runs and wait for its end in the kernel, which takes
// the launch gap between the two off a split call).
template <class T>
Status launch_combine(const AttentionParams& p, CombineLaunch when, cudaStream_t stream);

// The grid of an attention launch: grid_x CTAs per split (uniform split), or one CTA per item the
// plan may hold (a plan).
inline dim3 attention_grid(const AttentionParams& p, int grid_x) {
  return p.plan != nullptr ? dim3(unsigned(p.plan_sizes.max_items)) : dim3(unsigned(grid_x), unsigned(p.num_splits));
}

// The plan kernel (plan.cu): fills params.plan from its lengths.
Status launch_attention_plan(const AttentionParams& p, cudaStream_t stream);

// Hopper (attention_sm90.cuh): launch.kernel's kernel, the 64-row one (whose shared memory per CTA
// wgmma_smem_bytes() is) with TMA boxes of `map` when launch.copy is kTma, else cp.async, or the narrow
// one (attention_sm90_narrow.cuh) of launch.rows_per_cta columns.
int wgmma_smem_bytes();
template <class T, class Rows, KvFormat F>
Status launch_attention_wgmma(const AttentionParams& p, const Rows& rows, const AttentionLaunch& launch,
                              const CUtensorMap& map, int grid_x, cudaStream_t stream);

}  // namespace attention_detail
}  // namespace mla_kv

#define MLA_KV_INSTANTIATE_ATTENTION_ROWS(A, T, ROWS, F)                                       \
  template mla_kv::Status mla_kv::attention_detail::launch_attention<A, T, ROWS, F>(              \
      const mla_kv::AttentionParams&, const ROWS&, int, int, cudaStream_t);
#define MLA_KV_INSTANTIATE_ATTENTION_WGMMA_ROWS(T, ROWS, F)                                     \
  template mla_kv::Status mla_kv::attention_detail::launch_attention_wgmma<T, ROWS, F>(          \
      const mla_kv::AttentionParams&, const ROWS&, const mla_kv::AttentionLaunch&, const CUtensorMap&, int, \
      cudaStream_t);

// Dense attention: positions through a paged block table or TurboMind block pointers.
#define MLA_KV_INSTANTIATE_ATTENTION(A, T, F)                                    \
  MLA_KV_INSTANTIATE_ATTENTION_ROWS(A, T, mla_kv::PagedTableRows, F)             \
  MLA_KV_INSTANTIATE_ATTENTION_ROWS(A, T, mla_kv::BlockPointerTableRows, F)
#define MLA_KV_INSTANTIATE_ATTENTION_WGMMA(T, F)                                 \
  MLA_KV_INSTANTIATE_ATTENTION_WGMMA_ROWS(T, mla_kv::PagedTableRows, F)          \
  MLA_KV_INSTANTIATE_ATTENTION_WGMMA_ROWS(T, mla_kv::BlockPointerTableRows, F)

// Sparse attention: the rows the indices name, as paged slots or block-pointer positions.
#define MLA_KV_INSTANTIATE_SPARSE_ATTENTION(A, T, F)                             \
  MLA_KV_INSTANTIATE_ATTENTION_ROWS(A, T, mla_kv::SparseSlotRows, F)             \
  MLA_KV_INSTANTIATE_ATTENTION_ROWS(A, T, mla_kv::SparseBlockRows, F)
#define MLA_KV_INSTANTIATE_SPARSE_ATTENTION_WGMMA(T, F)                          \
  MLA_KV_INSTANTIATE_ATTENTION_WGMMA_ROWS(T, mla_kv::SparseSlotRows, F)          \
  MLA_KV_INSTANTIATE_ATTENTION_WGMMA_ROWS(T, mla_kv::SparseBlockRows, F)

// The four quantized formats of tag A (dtype T): one .cu per (tag, dtype), beside the 16-bit one.
#define MLA_KV_INSTANTIATE_ATTENTION_QUANTIZED(A, T)             \
  MLA_KV_INSTANTIATE_ATTENTION(A, T, mla_kv::KvFormat::kFp8)      \
  MLA_KV_INSTANTIATE_ATTENTION(A, T, mla_kv::KvFormat::kFp8DsMla) \
  MLA_KV_INSTANTIATE_ATTENTION(A, T, mla_kv::KvFormat::kInt8)     \
  MLA_KV_INSTANTIATE_ATTENTION(A, T, mla_kv::KvFormat::kInt4)
#define MLA_KV_INSTANTIATE_SPARSE_ATTENTION_QUANTIZED(A, T)             \
  MLA_KV_INSTANTIATE_SPARSE_ATTENTION(A, T, mla_kv::KvFormat::kFp8)      \
  MLA_KV_INSTANTIATE_SPARSE_ATTENTION(A, T, mla_kv::KvFormat::kFp8DsMla) \
  MLA_KV_INSTANTIATE_SPARSE_ATTENTION(A, T, mla_kv::KvFormat::kInt8)     \
  MLA_KV_INSTANTIATE_SPARSE_ATTENTION(A, T, mla_kv::KvFormat::kInt4)
#define MLA_KV_INSTANTIATE_SPARSE_ATTENTION_WGMMA_QUANTIZED(T)             \
  MLA_KV_INSTANTIATE_SPARSE_ATTENTION_WGMMA(T, mla_kv::KvFormat::kFp8)      \
  MLA_KV_INSTANTIATE_SPARSE_ATTENTION_WGMMA(T, mla_kv::KvFormat::kFp8DsMla) \
  MLA_KV_INSTANTIATE_SPARSE_ATTENTION_WGMMA(T, mla_kv::KvFormat::kInt8)     \
  MLA_KV_INSTANTIATE_SPARSE_ATTENTION_WGMMA(T, mla_kv::KvFormat::kInt4)
