// mla_kv: what an engine includes to address the MLA latent cache. No torch, no pybind11.
//
// A cache row holds one token of one layer: kLatentDim values of the RMS-normalized latent c_kv
// and kRopeDim values of the rotated rope key k_pe, in either order, 16-bit (or fp32) or in one of
// the engines' quantized formats (KvFormat). `row_stride_bytes` is a parameter everywhere and never
// derived from the element count.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace mla_kv {

constexpr int kLatentDim = 512;
constexpr int kRopeDim = 64;
constexpr int kRowDim = kLatentDim + kRopeDim;  // 576

enum class DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

inline int dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }

// The bytes of a cached row. Byte layouts: python/mla_kv/reference/quant.py (the spec) and
// ../shared/notes/facts.md; every format is byte-compatible with the engine named.
enum class KvFormat : int {
  kNone = 0,      // 16-bit (or fp32) values, the op's dtype
  kFp8 = 1,       // 576 B: every value e4m3 of x / kv_scale (vLLM fp8)
  kFp8DsMla = 2,  // 656 B: 4 tiles of 128 latent e4m3, 4 fp32 tile scales, 64 bf16 rope values (vLLM
                  //        fp8_ds_mla, FlashMLA FP8); latent first only
  kInt8 = 3,      // 576 B of codes; per-token (scale, zero) in the op's 16-bit dtype after the
                  //        block's rows: [block rows][block (scale, zero) pairs] (TurboMind policy 8)
  kInt4 = 4,      // 288 B of codes, 8 per 32-bit word in nibble order 0,2,4,6,1,3,5,7; the same
                  //        trailer (TurboMind quant_policy 4)
};

inline bool has_trailer(KvFormat f) { return f == KvFormat::kInt8 || f == KvFormat::kInt4; }

// Where the two parts sit inside a row, as element (value) indices 0..575, and the row's format.
struct RowLayout {
  int latent_offset;  // first element of c_kv
  int rope_offset;    // first element of k_pe
  int64_t row_stride_bytes;
  KvFormat format = KvFormat::kNone;
  float kv_scale = 1.f;  // kFp8's dequant scale: value = e4m3 * kv_scale

  // vLLM / FlashMLA / FlashInfer: [c_kv | k_pe]
  static RowLayout latent_first(int64_t row_stride_bytes) { return {0, kLatentDim, row_stride_bytes}; }
  // TurboMind: [k_pe | c_kv]
  static RowLayout rope_first(int64_t row_stride_bytes) { return {kRopeDim, 0, row_stride_bytes}; }
};

// Paged tensor addressing: cache [num_blocks, block_size, row], written through a slot mapping
// (slot = block_id * block_size + offset; negative = padded token, skipped). Strides are in bytes
// so that one layer of a [num_blocks, num_layers, block_size, row] pool is addressable too.
struct PagedCache {
  void* base;
  int64_t num_blocks;
  int block_size;
  int64_t block_stride_bytes;
  RowLayout row;
};

// TurboMind-style block pointers: sequence b owns block_ptrs[cu_block_nums[b] .. cu_block_nums[b+1]);
// each block holds every layer, this layer starts `layer_offset_bytes` into it, and holds
// block_seq_len rows.
struct BlockPointerCache {
  void* const* block_ptrs;     // device array
  const int* cu_block_nums;    // device [batch + 1]
  int batch;
  int block_seq_len;
  int64_t layer_offset_bytes;
  RowLayout row;
};

// Status codes of the invoke* entry points besides CUDA's own errors.
enum class Status : int {
  kOk = 0,
  kUnsupportedDType = 1,   // e.g. bf16 on an arch tag below Sm80
  kUnsupportedArch = 2,    // arch tag not compiled in or above the device
  kInvalidArgument = 3,
  kCudaError = 4,          // see cudaGetLastError()
  kSharedMemoryExceeded = 5,  // no tile configuration fits the device's (or the given) shared memory
  kUnsupportedFormat = 6,  // this op does not read or write the cache's KvFormat (yet)
};

const char* status_string(Status s);

}  // namespace mla_kv
