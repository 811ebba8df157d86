// The Hopper kernel's tensor maps, encoded on the host through the runtime's driver entry point
// (no link against libcuda).
#include <algorithm>

#include <cuda_runtime.h>

#include "tensor_map.h"

namespace mla_kv {
namespace attention_detail {
namespace sm90 {
namespace {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's tensor-map encoder; null when the driver has none (launches then take cp.async).
EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &f, cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) return EncodeTiled(nullptr);
    return reinterpret_cast<EncodeTiled>(f);
  }();
  return fn;
}

}  // namespace

bool tile_map_fits(const AttentionParams& p, const PagedCache* c) {
  // A plan's kv ranges start on 64-token tiles (plan.cu), a uniform split's on tokens_per_split.
  if (p.tile_loads != TileLoads::kAuto || (p.plan == nullptr && p.tokens_per_split % kTmaBoxTokens != 0)) return false;
  if (c == nullptr) return true;
  if (!(c->block_size == 16 || c->block_size == 32 || c->block_size % kTmaBoxTokens == 0)) return false;
  return reinterpret_cast<uintptr_t>(c->base) % 16 == 0 && c->row.row_stride_bytes % 16 == 0 &&
         c->block_stride_bytes % 16 == 0 && c->num_blocks < (int64_t(1) << 31);
}

bool make_tile_map(const AttentionParams& p, const PagedCache& c, CUtensorMap& map) {
  const EncodeTiled encode = encode_tiled();
  if (encode == nullptr) return false;
  const cuuint64_t dims[3] = {cuuint64_t(kRowDim), cuuint64_t(c.block_size), cuuint64_t(c.num_blocks)};
  const cuuint64_t strides[2] = {cuuint64_t(c.row.row_stride_bytes), cuuint64_t(c.block_stride_bytes)};
  const cuuint32_t box[3] = {64, cuuint32_t(std::min(kTmaBoxTokens, c.block_size)), 1};
  const cuuint32_t unit[3] = {1, 1, 1};
  const CUtensorMapDataType type =
      p.dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return encode(&map, type, 3, c.base, dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace sm90
}  // namespace attention_detail
}  // namespace mla_kv
