// Declarations of the per-arch index-key write launchers; their explicit instantiations live in one .cu
// per arch tag (index_keys_sm70.cu, index_keys_sm80.cu) so the builds run in parallel.
#pragma once

#include "../address.cuh"
#include "mla_kv/indexer.h"

namespace mla_kv {
namespace index_keys_detail {

// vec16: k and q allow 16-byte loads and stores (else 4-byte ones).
template <class A, class T, class Rows>
Status launch_index_keys(const WriteIndexKeysParams& p, const Rows& rows, bool vec16, cudaStream_t stream);

}  // namespace index_keys_detail
}  // namespace mla_kv

#define MLA_KV_INSTANTIATE_INDEX_KEYS(A, T)                                                                 \
  template mla_kv::Status mla_kv::index_keys_detail::launch_index_keys<A, T, mla_kv::PagedSlotRows>(         \
      const mla_kv::WriteIndexKeysParams&, const mla_kv::PagedSlotRows&, bool, cudaStream_t);               \
  template mla_kv::Status mla_kv::index_keys_detail::launch_index_keys<A, T, mla_kv::BlockPointerRows>(      \
      const mla_kv::WriteIndexKeysParams&, const mla_kv::BlockPointerRows&, bool, cudaStream_t);
