// invokeWriteIndexKeys*: checks the arguments the kernel relies on, resolves the arch tag and dtype, and
// calls the per-arch launcher over the latent write's addressing functors (address.cuh), whose rows here
// are the 128 code bytes of a token and whose block trailer holds the tokens' scales.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../arch/arch.cuh"
#include "index_keys_launch.h"

namespace mla_kv {
namespace {

// A row of the index cache as the addressing functors see it: 128 code bytes, the scales after a page's rows.
constexpr RowLayout kIndexRow{0, 0, kIndexDim};

// 16 (wide loads), 4, or 0 (refused) for k and q's addresses and strides; the cache must take the
// kernel's 8-byte code stores.
int64_t access_bytes(const WriteIndexKeysParams& p, const void* cache_base, int64_t cache_stride_bytes) {
  const int64_t es = dtype_size(p.dtype);
  if (reinterpret_cast<uintptr_t>(cache_base) % 16 || cache_stride_bytes % 16) return 0;
  return arch::widest_access(es, {p.k, p.q},
                             {p.k_stride * es, p.q ? p.q_stride_token * es : 0, p.q ? p.q_stride_head * es : 0});
}

template <class Rows>
Status dispatch(const WriteIndexKeysParams& p, const Rows& rows, int64_t access, Arch arch, cudaStream_t stream) {
  if (access == 0 || p.num_tokens < 0 || (p.q != nullptr && p.q_heads < 0) || rows.rows_per_block() < 1)
    return Status::kInvalidArgument;
  if (p.dtype == DType::kFloat32) return Status::kUnsupportedDType;
  const Arch tag = resolve_arch(arch, device_compute_capability());
  if (tag == Arch::kAuto) return Status::kUnsupportedArch;
  if (p.dtype == DType::kBFloat16 && !tag_has_bf16(tag)) return Status::kUnsupportedDType;
  const bool vec16 = access == 16;
  // No Turing-specific code: Sm75 runs the Volta variant, Sm90 the Sm80 one.
  if (tag == Arch::kSm70 || tag == Arch::kSm75)
    return index_keys_detail::launch_index_keys<arch::Sm70, __half>(p, rows, vec16, stream);
  return p.dtype == DType::kFloat16
             ? index_keys_detail::launch_index_keys<arch::Sm80, __half>(p, rows, vec16, stream)
             : index_keys_detail::launch_index_keys<arch::Sm80, __nv_bfloat16>(p, rows, vec16, stream);
}

}  // namespace

Status invokeWriteIndexKeysPaged(const WriteIndexKeysParams& params, const IndexCache& cache,
                                 const int64_t* slot_mapping, Arch arch, cudaStream_t stream) {
  const PagedCache paged{cache.base, cache.num_blocks, cache.page_size, cache.block_stride_bytes, kIndexRow};
  // One block's stride is never used (a [1, page_size, 132] tensor's need not be a multiple of 16).
  const int64_t access = access_bytes(params, cache.base, cache.num_blocks > 1 ? cache.block_stride_bytes : 0);
  return dispatch(params, PagedSlotRows{paged, slot_mapping}, access, arch, stream);
}

Status invokeWriteIndexKeysBlocks(const WriteIndexKeysParams& params, const IndexBlockPointerCache& cache,
                                  const BlockWriteTargets& targets, Arch arch, cudaStream_t stream) {
  if (targets.cp_size < 1 || targets.cp_rank < 0 || targets.cp_rank >= targets.cp_size)
    return Status::kInvalidArgument;
  // Block base pointers live on the device; they must be 16-byte aligned (allocators give 256).
  const BlockPointerCache blocks{cache.block_ptrs, cache.cu_block_nums, cache.batch, cache.block_seq_len,
                                 cache.layer_offset_bytes, kIndexRow};
  return dispatch(params, BlockPointerRows{blocks, targets}, access_bytes(params, nullptr, cache.layer_offset_bytes),
                  arch, stream);
}

}  // namespace mla_kv
