// Declarations of the per-arch write launchers; their explicit instantiations live in one .cu per
// arch tag and kind (write_kv_sm70.cu, write_kv_sm80.cu, write_kv_quant_sm70.cu, ...) so the builds
// run in parallel.
#pragma once

#include "../address.cuh"
#include "mla_kv/write.h"

namespace mla_kv {
namespace write_detail {

template <class A, class T, class Rows>
Status launch_write_kv(const WriteKvParams& p, const Rows& rows, bool vec16, cudaStream_t stream);
template <class A, class T, class Rows>
Status launch_write_kv_quant(const WriteKvParams& p, const Rows& rows, cudaStream_t stream);

}  // namespace write_detail
}  // namespace mla_kv

#define MLA_KV_INSTANTIATE_WRITE(A, T)                                                            \
  template mla_kv::Status mla_kv::write_detail::launch_write_kv<A, T, mla_kv::PagedSlotRows>(      \
      const mla_kv::WriteKvParams&, const mla_kv::PagedSlotRows&, bool, cudaStream_t);            \
  template mla_kv::Status mla_kv::write_detail::launch_write_kv<A, T, mla_kv::BlockPointerRows>(   \
      const mla_kv::WriteKvParams&, const mla_kv::BlockPointerRows&, bool, cudaStream_t);

#define MLA_KV_INSTANTIATE_WRITE_QUANT(A, T)                                                          \
  template mla_kv::Status mla_kv::write_detail::launch_write_kv_quant<A, T, mla_kv::PagedSlotRows>(      \
      const mla_kv::WriteKvParams&, const mla_kv::PagedSlotRows&, cudaStream_t);                        \
  template mla_kv::Status mla_kv::write_detail::launch_write_kv_quant<A, T, mla_kv::BlockPointerRows>(   \
      const mla_kv::WriteKvParams&, const mla_kv::BlockPointerRows&, cudaStream_t);
