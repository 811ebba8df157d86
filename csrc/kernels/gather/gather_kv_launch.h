// Declarations of the per-arch gather launchers; their explicit instantiations live in one .cu per
// arch tag (gather_kv_sm70.cu, gather_kv_sm80.cu). T is the element's same-size unsigned integer
// (uint16_t for fp16 and bf16, uint32_t for fp32): the gather moves bytes and does no arithmetic.
#pragma once

#include <cstdint>

#include "../address.cuh"
#include "mla_kv/gather.h"

namespace mla_kv {
namespace gather_detail {

template <class A, class T, class Rows>
Status launch_gather_kv(const GatherKvParams& p, const Rows& rows, bool vec16, cudaStream_t stream);
template <class A, class T, class Rows>
Status launch_gather_kv_dequant(const GatherKvParams& p, const Rows& rows, cudaStream_t stream);

}  // namespace gather_detail
}  // namespace mla_kv

#define MLA_KV_INSTANTIATE_GATHER(A, T)                                                                  \
  template mla_kv::Status mla_kv::gather_detail::launch_gather_kv<A, T, mla_kv::PagedTableRows>(          \
      const mla_kv::GatherKvParams&, const mla_kv::PagedTableRows&, bool, cudaStream_t);                 \
  template mla_kv::Status mla_kv::gather_detail::launch_gather_kv<A, T, mla_kv::BlockPointerTableRows>(   \
      const mla_kv::GatherKvParams&, const mla_kv::BlockPointerTableRows&, bool, cudaStream_t);

#define MLA_KV_INSTANTIATE_GATHER_DEQUANT(A, T)                                                                  \
  template mla_kv::Status mla_kv::gather_detail::launch_gather_kv_dequant<A, T, mla_kv::PagedTableRows>(          \
      const mla_kv::GatherKvParams&, const mla_kv::PagedTableRows&, cudaStream_t);                              \
  template mla_kv::Status mla_kv::gather_detail::launch_gather_kv_dequant<A, T, mla_kv::BlockPointerTableRows>(   \
      const mla_kv::GatherKvParams&, const mla_kv::BlockPointerTableRows&, cudaStream_t);
