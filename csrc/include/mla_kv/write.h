// Writing new tokens into the latent cache (replaces an engine's MLACopyQKV + ProcessKV).
//
// Two ops share one kernel:
//   write:       row = [kv_c | k_pe] as given (already normalized and rotated)
//   fused write: row = [RMSNorm(kv_c) * w | RoPE(k_pe, position)], optionally rotating the rope
//                part of q in place in the same launch.
// A cache whose RowLayout::format is a quantized KvFormat gets the row quantized in the same launch
// (fp16 / bf16 inputs, 16-byte aligned; kv_scale for kFp8; fp8_ds_mla rows latent first), byte for
// byte what python/mla_kv/reference/quant.py's quantizer writes; int8 / int4 put the row's (scale,
// zero), in the input dtype, in the block's trailer after its rows.
// Reference semantics: python/mla_kv/reference/write.py (write_kv, fused_write_kv).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "mla_kv/arch.h"
#include "mla_kv/layout.h"

namespace mla_kv {

enum class RopeStyle : int {
  kInterleaved = 0,  // pairs (2i, 2i+1): DeepSeek, GLM (GPT-J style)
  kNeox = 1,         // pairs (i, i + 32)
};

struct WriteKvParams {
  DType dtype;       // of kv_c, k_pe, q, rms_weight and the cache
  int64_t num_tokens;
  // Inputs: row t of kv_c starts at kv_c + t * kv_c_stride (elements); last dim contiguous.
  const void* kv_c;
  int64_t kv_c_stride;
  const void* k_pe;
  int64_t k_pe_stride;

  // Fused part; rms_weight == nullptr means plain write (no norm, no rope, q ignored).
  const void* rms_weight;  // [512], dtype
  float rms_eps;
  const int64_t* positions;  // [num_tokens]
  const void* cos_sin;       // [max_position, 64] = [cos(32) | sin(32)]
  bool cos_sin_fp32;         // cos_sin is float32, else dtype
  int64_t max_position;      // positions outside [0, max_position) leave the row unwritten
  RopeStyle rope_style;
  // Optional q [num_tokens, q_heads, q_head_dim]: its last 64 values per head are rotated in place.
  void* q;
  int q_heads;
  int q_head_dim;
  int64_t q_stride_token;
  int64_t q_stride_head;
};

// vLLM-style addressing: token t goes to slot_mapping[t]; negative or out-of-range slots are
// skipped, so a bad slot never writes outside the cache.
Status invokeWriteKvPaged(const WriteKvParams& params, const PagedCache& cache,
                          const int64_t* slot_mapping, Arch arch, cudaStream_t stream);

// Where the packed new tokens of a block-pointer batch go: TurboMind's addressing (ProcessKV_v2).
struct BlockWriteTargets {
  const int* cu_q_lens;     // [batch + 1]: token i of sequence b is input row cu_q_lens[b] + i
  const int* history_lens;  // [batch]: its global position is history_lens[b] + i
  // Optional [batch]: this rank's rows below readonly_lens[b] are never written. They are blocks
  // shared through a prefix cache (TurboMind: readonly_block_num[b] * block_len rows).
  const int* readonly_lens = nullptr;
  // Context parallelism: global position p lives on rank p % cp_size at local row p / cp_size of
  // that rank's blocks; a launch writes only the tokens of its own rank.
  int cp_size = 1;
  int cp_rank = 0;
};

// TurboMind-style addressing: a token lands at local row (history_lens[b] + i) / cp_size of
// sequence b's blocks if its position belongs to cp_rank. Tokens past cu_q_lens[batch], other
// ranks' positions, read-only rows and rows beyond the sequence's blocks are skipped.
// kInvalidArgument: cp_size < 1 or cp_rank outside [0, cp_size).
Status invokeWriteKvBlocks(const WriteKvParams& params, const BlockPointerCache& cache,
                           const BlockWriteTargets& targets, Arch arch, cudaStream_t stream);

}  // namespace mla_kv
