// invokeWriteKv*: resolves the arch tag, dtype and vector width, then calls the per-arch launcher.
#include <algorithm>
#include <cmath>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../arch/arch.cuh"
#include "write_kv_launch.h"

namespace mla_kv {
namespace {

// Widest access (16 B, or 2 elements) that every address of the op allows; 0 if neither.
// Quantized rows: the parts start at multiples of 64 values, whole 16-byte vectors in every format.
int64_t access_bytes(const WriteKvParams& p, const RowLayout& row, const void* base,
                     int64_t extra_stride_bytes) {
  const int64_t es = dtype_size(p.dtype);
  const int64_t part_bytes = row.format == KvFormat::kNone ? es : 0;
  const int64_t rows_access = arch::widest_access(
      es, {p.kv_c, p.k_pe, base},
      {p.kv_c_stride * es, p.k_pe_stride * es, extra_stride_bytes, row.row_stride_bytes,
       row.latent_offset * part_bytes, row.rope_offset * part_bytes});
  if (p.rms_weight == nullptr) return rows_access;  // plain write: only the rows are touched
  const char* q_rope = p.q ? static_cast<const char*>(p.q) + (p.q_head_dim - kRopeDim) * es : nullptr;
  const int64_t fused_access = arch::widest_access(
      es, {p.rms_weight, q_rope}, {p.q ? p.q_stride_token * es : 0, p.q ? p.q_stride_head * es : 0});
  return std::min(rows_access, fused_access);
}

// A quantized format's own requirements: 16-bit values (also the int8 / int4 scale type), 16-byte
// accesses, fp8_ds_mla rows latent first, a finite positive fp8 scale.
Status check_quantized(const WriteKvParams& p, const RowLayout& row, int64_t access) {
  if (p.dtype == DType::kFloat32) return Status::kUnsupportedDType;
  if (access != 16) return Status::kInvalidArgument;
  switch (row.format) {
    case KvFormat::kFp8:
      return row.kv_scale > 0.f && row.kv_scale < INFINITY ? Status::kOk : Status::kInvalidArgument;
    case KvFormat::kFp8DsMla:
      return row.latent_offset == 0 && row.rope_offset == kLatentDim ? Status::kOk : Status::kInvalidArgument;
    case KvFormat::kInt8:
    case KvFormat::kInt4: return Status::kOk;
    default: return Status::kUnsupportedFormat;
  }
}

template <class Rows>
Status dispatch(const WriteKvParams& p, const Rows& rows, int64_t access, Arch arch, cudaStream_t stream) {
  if (access == 0) return Status::kInvalidArgument;
  const bool vec16 = access == 16;
  const Arch tag = resolve_arch(arch, device_compute_capability());
  if (tag == Arch::kAuto) return Status::kUnsupportedArch;
  if (p.dtype == DType::kBFloat16 && !tag_has_bf16(tag)) return Status::kUnsupportedDType;
  const bool sm70_path = tag == Arch::kSm70 || tag == Arch::kSm75;
  if (rows.cache.row.format != KvFormat::kNone) {
    const Status st = check_quantized(p, rows.cache.row, access);
    if (st != Status::kOk) return st;
    if (sm70_path) return write_detail::launch_write_kv_quant<arch::Sm70, __half>(p, rows, stream);
    return p.dtype == DType::kFloat16 ? write_detail::launch_write_kv_quant<arch::Sm80, __half>(p, rows, stream)
                                      : write_detail::launch_write_kv_quant<arch::Sm80, __nv_bfloat16>(p, rows, stream);
  }
  // The write path has no Turing-specific code: Sm75 runs the Volta variant.
  if (sm70_path) {
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
