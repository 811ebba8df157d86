// The DeepSeek Sparse Attention indexer (DeepSeek-V3.2, GLM-5.x): its per-layer key cache, the index
// scores of every query token over its visible past, and the top-k selection that becomes the rows
// sparse attention reads (attention.h, SparseIndices).
//
// Index cache: per token 128 e4m3 values and one fp32 scale (132 B). A page of page_size tokens keeps
// all its tokens' values first, then all their scales:
//   page + offset * 128          128 e4m3 codes of the token at `offset`
//   page + page_size * 128 + offset * 4   its fp32 scale; value = code * scale
// (byte for byte what vLLM's indexer_k_quant_and_cache and DeepGEMM's paged scores use; engines view a
// page as [page_size, 132] bytes with a stride trick). Reference semantics:
// python/mla_kv/reference/index_keys.py, indexer.py, index_topk.py.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "mla_kv/arch.h"
#include "mla_kv/layout.h"
#include "mla_kv/write.h"

namespace mla_kv {

constexpr int kIndexDim = 128;      // the indexer's head dimension, keys and queries
constexpr int kIndexRopeDim = 64;   // its rope part, the FIRST 64 dims (unlike the latent row)
constexpr int kIndexRowBytes = kIndexDim + 4;

// Paged index cache: page p starts at base + p * block_stride_bytes (>= page_size * 132, a multiple
// of 16) and holds page_size tokens in the layout above.
struct IndexCache {
  void* base;
  int64_t num_blocks;
  int page_size;
  int64_t block_stride_bytes;
};

// ---------------------------------------------------------------------------------------- write
// The model's scale_fmt: raw max(amax, 1e-4) / 448, or that rounded up to a power of two ("ue8m0").
enum class IndexScaleFormat : int { kRaw = 0, kPow2 = 1 };

// One launch: k [num_tokens, 128] -> LayerNorm(weight, bias, eps) in fp32 -> RoPE on dims 0..63 at
// positions[t] -> 128-point Hadamard / sqrt(128) -> e4m3 with one scale per token -> the cache.
// Optionally the index queries q [num_tokens, q_heads, 128] get the same RoPE and Hadamard in place.
// Values stay fp32 from the LayerNorm to the quantizer (q: rounded once to dtype at the end), in the
// operation order python/mla_kv/reference/index_keys.py spells out, so the bytes are the reference's.
// k and q: 4-byte aligned addresses and strides (16-byte ones take the wide loads). kUnsupportedDType:
// fp32, or bf16 on the Sm70 / Sm75 tags.
struct WriteIndexKeysParams {
  DType dtype;  // of k and q (fp16 or bf16)
  int64_t num_tokens;
  const void* k;
  int64_t k_stride;  // elements between tokens; dims contiguous
  const void* ln_weight;  // [128]
  const void* ln_bias;    // [128]
  bool ln_fp32;           // ln_weight and ln_bias are float32 (DeepSeek-V3.2 keeps them so), else dtype
  float ln_eps;
  const int64_t* positions;  // [num_tokens]
  const void* cos_sin;       // [max_position, 64] = [cos(32) | sin(32)]
  bool cos_sin_fp32;         // cos_sin is float32, else dtype
  int64_t max_position;      // positions outside [0, max_position) leave the token unwritten
  RopeStyle rope_style;      // kNeox for DeepSeek-V3.2, kInterleaved for GLM-5.x
  IndexScaleFormat scale_format;
  // Optional q, rotated in place for every token whose position is in range (padded cache slots too).
  void* q = nullptr;
  int q_heads = 0;
  int64_t q_stride_token = 0;  // elements
  int64_t q_stride_head = 0;
};

// vLLM-style: token t goes to slot_mapping[t] = page * page_size + offset; negative or out-of-range
// slots are skipped. kInvalidArgument: a cache base, or with several pages a block stride, not a multiple
// of 16.
Status invokeWriteIndexKeysPaged(const WriteIndexKeysParams& params, const IndexCache& cache,
                                 const int64_t* slot_mapping, Arch arch, cudaStream_t stream);

// TurboMind-style block pointers: sequence b's pages are block_ptrs[cu_block_nums[b] ..], this layer's
// index page starting layer_offset_bytes into each block (16-byte aligned), block_seq_len tokens each.
struct IndexBlockPointerCache {
  void* const* block_ptrs;
  const int* cu_block_nums;
  int batch;
  int block_seq_len;
  int64_t layer_offset_bytes;
};

// Token i of sequence b lands at position history_lens[b] + i, as in invokeWriteKvBlocks (read-only rows
// and context-parallel ranks honoured the same way, through the same addressing); RoPE takes positions[t].
// kInvalidArgument: cp_size < 1, cp_rank outside [0, cp_size), layer_offset_bytes not a multiple of 16.
Status invokeWriteIndexKeysBlocks(const WriteIndexKeysParams& params, const IndexBlockPointerCache& cache,
                                  const BlockWriteTargets& targets, Arch arch, cudaStream_t stream);

// --------------------------------------------------------------------------------------- scores
// logits[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s]) for the positions s <= p_t a query token
// sees, -inf for its positions past p_t up to max_kv_len. Token i of sequence b (rows cu_q_lens[b] + i)
// sits at position p = kv_lens[b] - q_len_b + i (its own key included, as in prefill); decode is the
// case q_len_b = 1.
struct IndexScoresParams {
  // q [num_tokens, heads, 128]: fp16 or bf16 values, or e4m3 codes (uint8) with q_scale [num_tokens,
  // heads] fp32 (value = code * scale).
  const void* q;
  DType q_dtype;         // kFloat16 / kBFloat16; ignored when q_scale is given
  const float* q_scale;  // non-null: q holds e4m3 codes
  int64_t q_stride_token;
  int64_t q_stride_head;
  int heads;  // 16, 32 or 64
  const float* weights;  // [num_tokens, heads] fp32
  int64_t weights_stride;
  int64_t num_tokens;
  int batch;
  int max_q_len;          // >= every q_len_b (sizes the grid)
  const int* cu_q_lens;   // [batch + 1]; nullptr: one token per sequence (decode, num_tokens == batch)
  const int* kv_lens;     // [batch]
  const int* block_table;  // [batch, >= ceil(max_kv_len / page_size)] page ids; outside the cache: zero keys
  int64_t block_table_stride;
  int64_t max_kv_len;     // logits columns computed; must be >= every kv_len (positions past it are not scored)
  float* logits;          // [num_tokens, logits_stride], columns 0 .. max_kv_len - 1 written
  int64_t logits_stride;
};

Status invokeIndexScores(const IndexScoresParams& params, const IndexCache& cache, Arch arch,
                         cudaStream_t stream);

// ---------------------------------------------------------------------------------------- top-k
// For each query token t: the k positions with the largest logits among its visible positions
// [0, p_t] (p_t as in IndexScoresParams), as positions or, with a block table, as physical slots
// (block_table[b, pos / page_size] * page_size + pos % page_size, the indices FlashMLA and vLLM take);
// -1 fills the rest when fewer are visible (then every visible position is returned). Equal logits
// prefer the smaller position, so the selected set is unique; order within a row is unspecified.
// A NaN logit counts as -inf, and -0 equals +0. Columns at or past min(p_t + 1, max_kv_len) are never
// read. A position the block table does not cover (its column at or past max_blocks, or a negative
// block id) gives -1. Rows at or past cu_q_lens[batch] are filled with -1.
// Reference: python/mla_kv/reference/index_topk.py.
struct IndexTopkParams {
  const float* logits;  // [num_tokens, logits_stride]
  int64_t logits_stride;
  int64_t num_tokens;
  int batch;
  const int* cu_q_lens;  // [batch + 1]; nullptr: one token per sequence (decode, num_tokens == batch)
  const int* kv_lens;    // [batch]
  int64_t max_kv_len;    // columns of logits that hold scores
  int k;
  int* indices;          // [num_tokens, indices_stride], columns 0 .. k - 1 written
  int64_t indices_stride;
  const int* block_table = nullptr;  // optional [batch, block_table_stride]: return slots
  int64_t block_table_stride = 0;
  int max_blocks = 0;                // columns of block_table
  int page_size = 0;
};

// Bytes of global scratch the top-k needs for num_tokens rows of max_kv_len columns (0 when none: many
// rows, or k >= max_kv_len). Few rows are split over several CTAs, which combine their histograms
// there. The workspace must be zero-filled before its first use; every launch leaves it zeroed again
// (so CUDA-graph replays need nothing else), and one launch at a time may use it.
int64_t index_topk_workspace_size(int64_t num_tokens, int64_t max_kv_len, int k);

// Every arch tag runs the same kernel (plain CUDA: no tensor cores, no cp.async).
Status invokeIndexTopk(const IndexTopkParams& params, void* workspace, Arch arch, cudaStream_t stream);

}  // namespace mla_kv
