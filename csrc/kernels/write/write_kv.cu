// invokeWriteKv*: resolves the arch tag, dtype and vector width, then calls the per-arch launcher.
#include <algorithm>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../arch/arch.cuh"
#include "write_kv_launch.h"

namespace mla_kv {
namespace {

// Widest access (16 B, or 2 elements) that every address of the op allows; 0 if neither.
int64_t access_bytes(const WriteKvParams& p, const RowLayout& row, const void* base,
                     int64_t extra_stride_bytes) {
  const int64_t es = dtype_size(p.dtype);
  const int64_t rows_access = arch::widest_access(
      es, {p.kv_c, p.k_pe, base},
      {p.kv_c_stride * es, p.k_pe_stride * es, extra_stride_bytes, row.row_stride_bytes,
       row.latent_offset * es, row.rope_offset * es});
  if (p.rms_weight == nullptr) return rows_access;  // plain write: only the rows are touched
  const char* q_rope = p.q ? static_cast<const char*>(p.q) + (p.q_head_dim - kRopeDim) * es : nullptr;
  const int64_t fused_access = arch::widest_access(
      es, {p.rms_weight, q_rope}, {p.q ? p.q_stride_token * es : 0, p.q ? p.q_stride_head * es : 0});
  return std::min(rows_access, fused_access);
}

template <class Rows>
Status dispatch(const WriteKvParams& p, const Rows& rows, int64_t access, Arch arch, cudaStream_t stream) {
  if (access == 0) return Status::kInvalidArgument;
  const bool vec16 = access == 16;
  const Arch tag = resolve_arch(arch, device_compute_capability());
  if (tag == Arch::kAuto) return Status::kUnsupportedArch;
  if (p.dtype == DType::kBFloat16 && !tag_has_bf16(tag)) return Status::kUnsupportedDType;
  // The write path has no Turing-specific code: Sm75 runs the Volta variant.
  if (tag == Arch::kSm70 || tag == Arch::kSm75) {
    switch (p.dtype) {
      case DType::kFloat16: return write_detail::launch_write_kv<arch::Sm70, __half>(p, rows, vec16, stream);
      case DType::kFloat32: return write_detail::launch_write_kv<arch::Sm70, float>(p, rows, vec16, stream);
      default: return Status::kUnsupportedDType;
    }
  }
  switch (p.dtype) {
    case DType::kFloat16: return write_detail::launch_write_kv<arch::Sm80, __half>(p, rows, vec16, stream);
    case DType::kBFloat16: return write_detail::launch_write_kv<arch::Sm80, __nv_bfloat16>(p, rows, vec16, stream);
    case DType::kFloat32: return write_detail::launch_write_kv<arch::Sm80, float>(p, rows, vec16, stream);
  }
  return Status::kUnsupportedDType;
}

}  // namespace

Status invokeWriteKvPaged(const WriteKvParams& params, const PagedCache& cache,
                          const int64_t* slot_mapping, Arch arch, cudaStream_t stream) {
  const int64_t access = access_bytes(params, cache.row, cache.base, cache.block_stride_bytes);
  return dispatch(params, PagedSlotRows{cache, slot_mapping}, access, arch, stream);
}

Status invokeWriteKvBlocks(const WriteKvParams& params, const BlockPointerCache& cache,
                           const BlockWriteTargets& targets, Arch arch, cudaStream_t stream) {
  if (targets.cp_size < 1 || targets.cp_rank < 0 || targets.cp_rank >= targets.cp_size)
    return Status::kInvalidArgument;
  // Block base pointers live on the device; they must be 16-byte aligned (allocators give 256).
  const int64_t access = access_bytes(params, cache.row, nullptr, cache.layer_offset_bytes);
  return dispatch(params, BlockPointerRows{cache, targets}, access, arch, stream);
}

}  // namespace mla_kv
