// invokeGatherKv*: resolves the arch tag, element size and vector width, then calls the per-arch
// launcher.
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../arch/arch.cuh"
#include "gather_kv_launch.h"

namespace mla_kv {
namespace {

// Widest access (16 B, or 2 elements) that every address of the op allows; 0 if neither.
int64_t access_bytes(const GatherKvParams& p, const RowLayout& row, const void* base,
                     int64_t extra_stride_bytes) {
  const int64_t es = dtype_size(p.dtype);
  return arch::widest_access(es, {p.out, base},
                             {p.out_stride * es, extra_stride_bytes, row.row_stride_bytes,
                              row.latent_offset * es, row.rope_offset * es});
}

// A quantized cache is dequantized into 16-bit rows (out, strides and rows 16-byte aligned: access
// 16), fp8_ds_mla rows latent first.
template <class Rows>
Status dispatch_dequant(const GatherKvParams& p, const Rows& rows, int64_t access, Arch tag, cudaStream_t stream) {
  const RowLayout& row = rows.cache.row;
  if (p.dtype == DType::kFloat32) return Status::kUnsupportedDType;
  if (access != 16) return Status::kInvalidArgument;
  if (row.format == KvFormat::kFp8DsMla && (row.latent_offset != 0 || row.rope_offset != kLatentDim))
    return Status::kInvalidArgument;
  using gather_detail::launch_gather_kv_dequant;
  const bool half = p.dtype == DType::kFloat16;
  if (tag == Arch::kSm70 || tag == Arch::kSm75) {
    return half ? launch_gather_kv_dequant<arch::Sm70, __half>(p, rows, stream)
                : launch_gather_kv_dequant<arch::Sm70, __nv_bfloat16>(p, rows, stream);
  }
  return half ? launch_gather_kv_dequant<arch::Sm80, __half>(p, rows, stream)
              : launch_gather_kv_dequant<arch::Sm80, __nv_bfloat16>(p, rows, stream);
}

template <class Rows>
Status dispatch(const GatherKvParams& p, const Rows& rows, int64_t access, Arch arch, cudaStream_t stream) {
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat32)
    return Status::kUnsupportedDType;
  if (access == 0 || p.batch < 0 || p.out_rows < 0) return Status::kInvalidArgument;
  const bool vec16 = access == 16;
  const Arch tag = resolve_arch(arch, device_compute_capability());
  if (tag == Arch::kAuto) return Status::kUnsupportedArch;
  if (rows.cache.row.format != KvFormat::kNone) return dispatch_dequant(p, rows, access, tag, stream);
  const bool wide = p.dtype == DType::kFloat32;
  using gather_detail::launch_gather_kv;
  // A copy has no Turing-specific code: Sm75 runs the Volta variant.
  if (tag == Arch::kSm70 || tag == Arch::kSm75) {
    return wide ? launch_gather_kv<arch::Sm70, uint32_t>(p, rows, vec16, stream)
                : launch_gather_kv<arch::Sm70, uint16_t>(p, rows, vec16, stream);
  }
  return wide ? launch_gather_kv<arch::Sm80, uint32_t>(p, rows, vec16, stream)
              : launch_gather_kv<arch::Sm80, uint16_t>(p, rows, vec16, stream);
}

}  // namespace

Status invokeGatherKvPaged(const GatherKvParams& params, const PagedCache& cache, const int* block_table,
                           int64_t block_table_stride, int max_blocks, Arch arch, cudaStream_t stream) {
  const int64_t access = access_bytes(params, cache.row, cache.base, cache.block_stride_bytes);
  return dispatch(params, PagedTableRows{cache, block_table, block_table_stride, max_blocks}, access, arch,
                  stream);
}

Status invokeGatherKvBlocks(const GatherKvParams& params, const BlockPointerCache& cache, Arch arch,
                            cudaStream_t stream) {
  if (cache.batch != params.batch) return Status::kInvalidArgument;
  // Block base pointers live on the device; they must be 16-byte aligned (allocators give 256).
  const int64_t access = access_bytes(params, cache.row, nullptr, cache.layer_offset_bytes);
  return dispatch(params, BlockPointerTableRows{cache}, access, arch, stream);
}

}  // namespace mla_kv
