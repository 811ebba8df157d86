// Expanded-form attention: the attention of the expanded-route prefill, after kv_b_proj has
// up-projected the latent cache to per-head K [N, H, d_qk] and V [N, H, d_v]. Ordinary multi-head
// attention over packed sequences, with MLA's head dims, for the GPUs torch's flash kernel does not
// serve: the Sm70 (mma.m8n8k4) and Sm75 (mma.m16n8k8) tags, fp16.
// Reference: python/mla_kv/reference/expanded.py (expanded_attention).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "mla_kv/arch.h"
#include "mla_kv/layout.h"

namespace mla_kv {

// Sequence b owns q rows cu_q_lens[b] .. cu_q_lens[b + 1] and k / v rows cu_k_lens[b] .. cu_k_lens[b + 1].
// causal: aligned bottom-right, query i of a sequence with n queries and m keys sees keys j <= m - n + i
// (the new tokens of an extend, or a whole prompt with n == m); else every key of its sequence.
// Strides are in elements (multiples of 8: rows are read as 16-byte vectors); the head dim is
// contiguous. out [T, H, d_v] in the inputs' dtype and lse [T, H] (natural log, fp32; may be
// nullptr): a query that sees no key gets 0 and -inf; rows past cu_q_lens[batch] are not written.
struct ExpandedAttentionParams {
  DType dtype = DType::kFloat16;
  int batch = 0, num_heads = 0;
  int head_dim_qk = 0, head_dim_v = 0;  // supported pairs: expanded_attention_supported
  int max_q_len = 0;  // host bound on every q_len: sizes the grid (a longer sequence is cut short)
  const int* cu_q_lens = nullptr;  // [batch + 1], device
  const int* cu_k_lens = nullptr;  // [batch + 1], device
  const void* q = nullptr; int64_t q_stride_t = 0, q_stride_h = 0;
  const void* k = nullptr; int64_t k_stride_t = 0, k_stride_h = 0;
  const void* v = nullptr; int64_t v_stride_t = 0, v_stride_h = 0;
  void* out = nullptr; int64_t out_stride_t = 0, out_stride_h = 0;
  float* lse = nullptr; int64_t lse_stride_t = 0, lse_stride_h = 0;
  float softmax_scale = 0.f;
  bool causal = true;
  SmemLimits smem_limits;  // zero fields: the device's (smaller ones plan for a smaller GPU)
};

// Whether tag `tag` has an expanded-attention kernel for (d_qk, d_v) in `dtype`.
bool expanded_attention_supported(Arch tag, int head_dim_qk, int head_dim_v, DType dtype);

// The CTA height (query rows of one head) a launch of tag `tag` takes under `limits`, 0 when no
// configuration fits; and its shared memory in bytes.
struct ExpandedTiles {
  int block_m = 0, block_n = 0;
  int smem_bytes = 0;
};
ExpandedTiles expanded_attention_tiles(Arch tag, int head_dim_qk, int head_dim_v, SmemLimits limits);

// kAuto takes the device's best tag that has these kernels (Sm75 from sm75 up, Sm70 on Volta).
Status invokeExpandedAttention(const ExpandedAttentionParams& params, Arch arch, cudaStream_t stream);

}  // namespace mla_kv
