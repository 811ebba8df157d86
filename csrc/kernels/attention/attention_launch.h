// Declarations of the per-arch attention launchers; explicit instantiations live in one .cu per
// (arch tag, dtype) so the builds run in parallel.
#pragma once

#include "../address.cuh"
#include "mla_kv/attention.h"

namespace mla_kv {
namespace attention_detail {

// Tag A's tile configuration `config` (tile_config.h) over rows of format F, then the split-KV combine.
template <class A, class T, class Rows, KvFormat F>
Status launch_attention(const AttentionParams& p, const Rows& rows, int config, int grid_x, cudaStream_t stream);

// How the combine follows the attention kernel. kEarly: as a programmatic dependent launch, for the
// Hopper kernels, which run arch::launch_dependents as they start: the combine's CTAs are scheduled
// while the attention grid runs and wait for its end in the kernel, which takes the launch gap
// between the two off a split call. kAfter: in plain stream order.
enum class CombineLaunch { kAfter, kEarly };

// The split-KV combine after a launch with num_splits > 1 (combine.cu, one instantiation per dtype).
template <class T>
Status launch_combine(const AttentionParams& p, CombineLaunch when, cudaStream_t stream);

// The grid of an attention launch: grid_x CTAs per split (uniform split), or one CTA per item the
// plan may hold (a plan).
inline dim3 attention_grid(const AttentionParams& p, int grid_x) {
  return p.plan != nullptr ? dim3(unsigned(p.plan_sizes.max_items)) : dim3(unsigned(grid_x), unsigned(p.num_splits));
}

// Hopper decode steps over a quantized cache whose (token, head) rows fit N = 16 or 24 columns, in
// uniform batches (a packed batch's sequences may have more rows: the 64-row kernel takes those),
// run on the narrow kernel (attention_sm90_narrow.cuh) unless the caller asked for the cp.async
// tile loads (the 64-row kernel's, which the tests also run): -> N, or 0 for the 64-row kernel.
inline int narrow_columns(const AttentionParams& p, KvFormat format) {
  if (format == KvFormat::kNone || p.cu_q_lens != nullptr || p.tile_loads != TileLoads::kAuto) return 0;
  const int64_t rows = int64_t(p.q_len) * p.num_heads;
  // N = 32 (25-32 rows) spills beside its 128 accumulators: the 64-row kernel takes those.
  return rows <= 16 ? 16 : rows <= 24 ? 24 : 0;
}

// The plan kernel (plan.cu): fills params.plan from its lengths.
Status launch_attention_plan(const AttentionParams& p, cudaStream_t stream);

// Hopper: 64-row CTAs on wgmma (attention_sm90.cuh), whose shared memory per CTA is this.
int wgmma_smem_bytes();
template <class T, class Rows, KvFormat F>
Status launch_attention_wgmma(const AttentionParams& p, const Rows& rows, int grid_x, cudaStream_t stream);

}  // namespace attention_detail
}  // namespace mla_kv

#define MLA_KV_INSTANTIATE_ATTENTION_ROWS(A, T, ROWS, F)                                       \
  template mla_kv::Status mla_kv::attention_detail::launch_attention<A, T, ROWS, F>(              \
      const mla_kv::AttentionParams&, const ROWS&, int, int, cudaStream_t);
#define MLA_KV_INSTANTIATE_ATTENTION_WGMMA_ROWS(T, ROWS, F)                                     \
  template mla_kv::Status mla_kv::attention_detail::launch_attention_wgmma<T, ROWS, F>(          \
      const mla_kv::AttentionParams&, const ROWS&, int, cudaStream_t);

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
