// Attention over the latent cache in the absorbed form (decode, multi-token decode, prefill).
//
// Per sequence b, its q_len_b query tokens are the last q_len_b of its kv_len_b cache positions;
// query token s attends to positions < kv_len_b - q_len_b + s + 1 (causal) or to all kv_len_b.
// score(h, j) = softmax_scale * (q_lat[h] . c_kv[j] + q_pe[h] . k_pe[j]); out[h] = softmax . c_kv,
// lse = natural log of the softmax denominator (of the scaled scores). A query that sees no key
// gets out = 0 and lse = -inf. Reference: python/mla_kv/reference/attention.py (decode, prefill).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "mla_kv/arch.h"
#include "mla_kv/layout.h"

namespace mla_kv {

constexpr int kMaxAttentionSplits = 1024;

// How the Hopper kernel loads cache tiles: kAuto takes TMA where a paged cache's tiles are whole
// boxes of a tensor map (and cp.async elsewhere); kCpAsync takes cp.async on every cache (for
// side-by-side measurement). Other variants always copy with cp.async or registers.
enum class TileLoads : int { kAuto = 0, kCpAsync = 1 };

// The capacities of a length-aware work plan (attention_plan_sizes): what the host allocates once
// for every step of a batch shape, whatever the lengths. The plan itself (invokeAttentionPlan) is
// made on the GPU from the step's lengths and read by every layer of that step.
struct AttentionPlanSizes {
  int block_m = 0;        // query rows per CTA of the launch the plan is for (0: no plan)
  int target_ctas = 0;    // CTA slots the work is spread over (SMs x resident CTAs)
  int max_items = 0;      // work items (CTAs) at most: the launch's grid
  int max_slots = 0;      // items that leave a partial state (a unit split over several CTAs)
  int max_units = 0;      // split units (sequence, row block) at most
  int max_rows = 0;       // rows of split units at most (each combine list's capacity)
  size_t plan_bytes = 0;       // of the plan buffer
  size_t workspace_bytes = 0;  // of the partial states (max_slots x block_m rows of 512 + 1 floats)
};

struct AttentionParams {
  DType dtype;        // of q, out and the cache
  int batch;
  int num_heads;
  // Query tokens: uniform q_len per sequence (decode: q [B, q_len, H, 576]) when cu_q_lens is
  // null, else packed (prefill: q [T, H, 576], sequence b owns tokens cu_q_lens[b]..cu_q_lens[b+1]).
  int q_len;               // uniform q_len (ignored when packed)
  const int* cu_q_lens;    // device [batch + 1] or nullptr
  int64_t total_q_tokens;  // batch * q_len (uniform) or T (packed)
  const int* kv_lens;      // device [batch] (sparse attention: may be null)
  bool causal;
  float softmax_scale;
  // Row (b, token, h) of q / out / lse: ptr + b * stride_b + token * stride_t + h * stride_h, where
  // token counts within the sequence (uniform) or globally (packed; stride_b unused). Elements.
  const void* q;
  int64_t q_stride_b, q_stride_t, q_stride_h;
  void* out;
  int64_t out_stride_b, out_stride_t, out_stride_h;
  float* lse;
  int64_t lse_stride_b, lse_stride_t, lse_stride_h;
  // KV split: CTA split i covers positions [i * tokens_per_split, (i + 1) * tokens_per_split).
  int num_splits;  // 1 .. kMaxAttentionSplits
  int tokens_per_split;
  void* workspace;  // attention_workspace_size() bytes when num_splits > 1
  // The shared memory the launch plans for (zeros: the device's). Smaller values make it take the
  // tiles a smaller GPU would (the GPU tests emulate each GPU class this way); pass the schedule's.
  SmemLimits smem_limits;
  TileLoads tile_loads = TileLoads::kAuto;
  // A length-aware plan made by invokeAttentionPlan from these lengths (plan_bytes on the device),
  // or nullptr for the uniform split above. With a plan, num_splits / tokens_per_split are unused,
  // each CTA takes the plan's item (a row block and a kv range that may start and end inside a
  // sequence) and the workspace holds plan_sizes.workspace_bytes.
  const int* plan = nullptr;
  AttentionPlanSizes plan_sizes{};
};

// The tile configuration a launch takes: the tallest CTA up to the rows a sequence needs whose
// shared memory fits the limits (the best of that height first), and how many of its CTAs an SM
// holds. block_m == 0: no configuration of the tag fits; min_smem_bytes is what the smallest needs.
struct AttentionTiles {
  int block_m;         // query rows (token, head) per CTA
  int block_n;         // cache rows per tile
  int stages;          // tiles in flight: 1 = the next tile staged in registers, 2-3 = a cp.async ring
  int smem_bytes;      // dynamic shared memory per CTA
  int ctas_per_sm;     // resident CTAs per SM the split schedule counts
  int min_smem_bytes;  // the tag's smallest configuration
  int config;          // index among the tag's configurations (internal)
};

// rows_per_seq: query rows (q_len x num_heads) per sequence; tag: a resolved tag (not kAuto);
// limits: as AttentionParams::smem_limits.
AttentionTiles attention_tiles(Arch tag, int64_t rows_per_seq, SmemLimits limits);
// The tiles a launch with these params takes on tag (resolved), as invokeAttention* picks them.
AttentionTiles attention_launch_tiles(const AttentionParams& params, Arch tag);

// What a launch runs, all of it decided in one place (attention_launch; README's "Kernel variants by
// arch tag" lists the same choices, and tests/test_attention_launch.py checks that they agree).
enum class AttentionKernel : int {
  kMmaSync = 0,      // Sm70 / Sm75 / Sm80: mma.sync tiles of tile_config.h, 16-64 rows per CTA
  kWgmma = 1,        // Sm90: 64 rows per CTA on wgmma, two warpgroups alternating tiles
  kWgmmaNarrow = 2,  // Sm90, quantized cache, uniform batch of <= 24 rows per sequence: the heads on N
};
enum class TileLoadPath : int {
  kRegisters = 0,  // the next tile staged in registers
  kCpAsync = 1,    // cp.async into a shared-memory ring
  kTma = 2,        // TMA boxes of a 3-D tensor map over the paged cache's blocks
  kBulkCopy = 3,   // cp.async.bulk by a copy warp, a block's run of rows per copy
};
// How the split-KV partials are merged after the attention kernel: not at all (one CTA covers each
// row's keys), by a combine kernel in stream order, or as a programmatic dependent launch whose CTAs
// start while the attention grid runs (the Hopper kernels release it as they start).
enum class CombineLaunch : int { kNone = 0, kAfter = 1, kEarly = 2 };
// How a launch addresses cache rows: the four entry points below.
enum class CacheRows : int { kPagedTable = 0, kBlockPointers = 1, kSparseSlots = 2, kSparseBlocks = 3 };

struct AttentionLaunch {
  Status status = Status::kOk;  // kOk, or what the launch would return before running anything
  Arch tag = Arch::kAuto;       // the resolved arch tag
  AttentionKernel kernel = AttentionKernel::kMmaSync;
  TileLoadPath loads = TileLoadPath::kRegisters;
  int rows_per_cta = 0;         // (token, head) query rows per CTA: what a plan's block_m must be
  AttentionTiles tiles{};       // kMmaSync: its tile configuration; Sm90: the 64-row kernel's
  bool pair_merge = false;      // kWgmmaNarrow with two splits: a cluster of the two CTAs merges them
  CombineLaunch combine = CombineLaunch::kNone;
};

// The launch invokeAttention* / invokeSparseAttention* make with these params over rows of `format`
// addressed as `rows` on tag `arch`: a tag as it is (no device needed: the launch itself checks that
// the device runs it), kAuto the current device's. `paged`: the paged cache of a kPagedTable launch,
// whose block size, alignment and size decide TMA (null: assumed to allow it); a driver that cannot
// encode the tensor map makes the launch take cp.async instead.
AttentionLaunch attention_launch(const AttentionParams& params, CacheRows rows, KvFormat format,
                                 const PagedCache* paged, Arch arch);

// A plan computed on the host from sizes only (no device data), so it can be made outside a graph.
struct AttentionSchedule {
  int num_splits;  // CTAs per (sequence, head block) along the KV
  int tokens_per_split;
  AttentionTiles tiles;  // what the launch will take (tiles.block_m == 0: it will fail)
};

// max_kv_len: an upper bound of every kv_len (e.g. block_table width * block_size); arch: the tag the
// launch will use (kAuto: the current device's); limits: those the launch will pass in its params.
AttentionSchedule make_attention_schedule(int batch, int q_len, int num_heads, int64_t max_kv_len,
                                          int sm_count, Arch arch, SmemLimits limits = {});

// kOk when a split plan is valid (1 <= num_splits <= kMaxAttentionSplits, tokens_per_split >= 1) and
// covers kv positions [0, max_kv_len); kInvalidArgument otherwise (a shorter plan would drop keys).
Status check_attention_splits(int num_splits, int tokens_per_split, int64_t max_kv_len);

// Bytes of workspace a launch with these sizes needs (0 when num_splits == 1).
size_t attention_workspace_size(int64_t total_q_tokens, int num_heads, int num_splits);

// The plan capacities of launches with these params (batch, q_len or cu_q_lens' batch and
// total_q_tokens, num_heads, smem_limits; lengths are not read) over a cache of `format` on tag `arch`
// (kAuto: the current device's) with sm_count SMs. block_m == 0 when no tile configuration fits or
// the batch is larger than kMaxPlanBatch.
constexpr int kMaxPlanBatch = 8192;
AttentionPlanSizes attention_plan_sizes(const AttentionParams& params, KvFormat format, Arch arch, int sm_count);

// Makes the plan of params.plan_sizes into params.plan from the device lengths (kv_lens, cu_q_lens):
// one small kernel, no host sync, so a CUDA graph replayed with new lengths follows them. Work is
// counted in 64-token tiles per (sequence, row block) unit; units longer than the chunk (the batch's
// tiles over target_ctas, at least 4, raised until the items fit in one wave) are cut into near-equal
// pieces whose partial states the combine merges by lse. Every layer of a step may reuse the plan.
Status invokeAttentionPlan(const AttentionParams& params, cudaStream_t stream);

// Both read 16-bit rows of the params' dtype or rows of any quantized KvFormat (cache.row.format),
// dequantized into the dtype (fp16 / bf16; int8 / int4 scales and zeros are of that dtype) tile by
// tile; out = attention over the dequantized cache (mla_kv.reference.decode with kv_format).
// Paged tensor cache: position j of sequence b is in block block_table[b * block_table_stride +
// j / block_size], for j / block_size < max_blocks (rows past the table read as zeros). The splits
// must cover the table (num_splits * tokens_per_split >= max_blocks * block_size), else
// kInvalidArgument: a shorter schedule would drop keys.
Status invokeAttentionPaged(const AttentionParams& params, const PagedCache& cache, const int* block_table,
                            int64_t block_table_stride, int max_blocks, Arch arch, cudaStream_t stream);

// TurboMind block pointers: positions of sequence b are in block_ptrs[cu_block_nums[b] + i]. The
// splits must cover every sequence's kv_len (device data: the caller's bound, not checked here).
Status invokeAttentionBlocks(const AttentionParams& params, const BlockPointerCache& cache, Arch arch,
                             cudaStream_t stream);

// Sparse attention (DeepSeek Sparse Attention: DeepSeek-V3.2, GLM-5.x): query token t attends only to
// the cache rows its index row names. params describe T = params.batch "sequences" of one query token
// each (q_len 1, cu_q_lens null, not causal; q / out / lse strides of the token on stride_b), position
// j < kv_len_t of token t being the row indices[t * stride + j]; kv_len_t = min(kv_lens[t], topk) (the
// tokens' top-k lengths) or, with kv_lens null, topk. A row that does not exist (index -1, outside the
// cache) is left out of the softmax and never read; a token with no row gets out 0 and lse -inf. Each
// repeat of an index counts again, as a gather of the rows would. The splits must cover topk.
struct SparseIndices {
  const int* indices = nullptr;  // device [T, stride] int32
  int64_t stride = 0;            // >= topk
  int topk = 0;
};

// Paged tensor cache: indices are physical slots, block * block_size + offset (FlashMLA's and vLLM's
// form); slots past num_blocks * block_size do not exist.
Status invokeSparseAttention(const AttentionParams& params, const PagedCache& cache, const SparseIndices& indices,
                             Arch arch, cudaStream_t stream);

// TurboMind block pointers: indices are positions in the token's sequence, the b with
// cu_q_lens[b] <= t < cu_q_lens[b + 1] (device [cache.batch + 1]); positions past the sequence's blocks
// do not exist, and tokens past cu_q_lens[cache.batch] read nothing.
Status invokeSparseAttentionBlocks(const AttentionParams& params, const BlockPointerCache& cache,
                                   const SparseIndices& indices, const int* cu_q_lens, Arch arch,
                                   cudaStream_t stream);

}  // namespace mla_kv
