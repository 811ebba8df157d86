// Declarations of the per-arch attention launchers; explicit instantiations live in one .cu per
// (arch tag, dtype) so the builds run in parallel.
#pragma once

#include "../address.cuh"
#include "mla_kv/attention.h"

namespace mla_kv {
namespace attention_detail {

// Tag A's tile configuration `config` (tile_config.h), then the split-KV combine.
template <class A, class T, class Rows>
Status launch_attention(const AttentionParams& p, const Rows& rows, int config, int grid_x, cudaStream_t stream);

// The split-KV combine after a launch with num_splits > 1 (combine.cu, one instantiation per dtype).
template <class T>
Status launch_combine(const AttentionParams& p, cudaStream_t stream);

// Hopper: 64-row CTAs on wgmma (attention_sm90.cuh), whose shared memory per CTA is this.
int wgmma_smem_bytes();
template <class T, class Rows>
Status launch_attention_wgmma(const AttentionParams& p, const Rows& rows, int grid_x, cudaStream_t stream);

}  // namespace attention_detail
}  // namespace mla_kv

#define MLA_KV_INSTANTIATE_ATTENTION(A, T)                                                                \
  template mla_kv::Status mla_kv::attention_detail::launch_attention<A, T, mla_kv::PagedTableRows>(        \
      const mla_kv::AttentionParams&, const mla_kv::PagedTableRows&, int, int, cudaStream_t);             \
  template mla_kv::Status mla_kv::attention_detail::launch_attention<A, T, mla_kv::BlockPointerTableRows>( \
      const mla_kv::AttentionParams&, const mla_kv::BlockPointerTableRows&, int, int, cudaStream_t);

#define MLA_KV_INSTANTIATE_ATTENTION_WGMMA(T)                                                           \
  template mla_kv::Status mla_kv::attention_detail::launch_attention_wgmma<T, mla_kv::PagedTableRows>(       \
      const mla_kv::AttentionParams&, const mla_kv::PagedTableRows&, int, cudaStream_t);                   \
  template mla_kv::Status mla_kv::attention_detail::launch_attention_wgmma<T, mla_kv::BlockPointerTableRows>( \
      const mla_kv::AttentionParams&, const mla_kv::BlockPointerTableRows&, int, cudaStream_t);
