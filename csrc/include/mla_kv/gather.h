// Gathering the cache rows of sequences into one contiguous tensor: the first step of the
// "expanded" MLA route, where an engine then runs kv_b_proj as one GEMM over the gathered c_kv and
// a standard attention kernel over per-head K and V.
//
// Sequence b fills out rows cu_kv_lens[b] .. cu_kv_lens[b+1] - 1 with its cache positions
// starts[b], starts[b] + 1, ... (starts == nullptr: from position 0). Output rows are always latent
// first, [c_kv | k_pe], whatever the cache's row order, so their first 512 columns feed kv_b_proj.
// Rows whose position the cache does not cover (past the block table or a sequence's blocks, a
// block id outside the cache, a negative position) and out rows at or past cu_kv_lens[batch] are
// left untouched: the op never reads or writes outside the cache and out.
// The op is a copy with no arithmetic: every dtype runs on every arch tag (bf16 on Sm70 too). A
// quantized cache (RowLayout::format) is dequantized into fp16 / bf16 rows (params.dtype; also the
// int8 / int4 scale type), equal to python/mla_kv/reference's gather bit for bit; out 16-byte aligned.
// Reference: python/mla_kv/reference/gather.py (gather_kv, gather_kv_blocks).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "mla_kv/arch.h"
#include "mla_kv/layout.h"

namespace mla_kv {

struct GatherKvParams {
  DType dtype;             // of the cache and out; only its size matters
  int batch;
  const int* cu_kv_lens;   // device [batch + 1], non-decreasing from 0
  const int* starts;       // device [batch] first cache position per sequence, or nullptr (all 0)
  void* out;               // row r at out + r * out_stride (elements); last dim contiguous
  int64_t out_rows;        // rows of out: at most min(out_rows, cu_kv_lens[batch]) rows are written
  int64_t out_stride;
};

// Paged tensor cache: position j of sequence b is in block block_table[b * block_table_stride +
// j / block_size], for j / block_size < max_blocks.
Status invokeGatherKvPaged(const GatherKvParams& params, const PagedCache& cache, const int* block_table,
                           int64_t block_table_stride, int max_blocks, Arch arch, cudaStream_t stream);

// TurboMind block pointers: positions of sequence b are in block_ptrs[cu_block_nums[b] + i];
// cache.batch must equal params.batch.
Status invokeGatherKvBlocks(const GatherKvParams& params, const BlockPointerCache& cache, Arch arch,
                            cudaStream_t stream);

}  // namespace mla_kv
