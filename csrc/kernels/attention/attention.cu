// The attention family's one dispatch room: every choice of a launch (attention_launch: tag, kernel,
// tiles, tile loads, splits' merge) and the schedule and plan sizes that follow from it; invokeAttention*
// run what it chose.
#include <algorithm>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../arch/arch.cuh"
#include "attention_launch.h"
#include "plan.h"
#include "tensor_map.h"
#include "tile_config.h"

namespace mla_kv {
namespace {

constexpr int kMinTokensPerSplit = 256;
constexpr int kTileTokens = 64;  // splits end on tile boundaries of every CTA shape

int ceil_div(int64_t a, int64_t b) { return int((a + b - 1) / b); }

// Hopper runs every CTA on the wgmma kernel (64 rows, padded): with its TMA tile loads it streams
// the cache faster than the Sm80 kernel's 16-row CTAs, two per SM, do even where the padding
// quadruples the tensor work (H200, B=64 ctx 4K, H=16: 85% of copy bandwidth against 72%).
bool uses_wgmma(Arch arch) { return arch == Arch::kSm90; }

int grid_x_for(const AttentionParams& p, int block_m) {
  if (p.cu_q_lens == nullptr) return p.batch * ceil_div(int64_t(p.q_len) * p.num_heads, block_m);
  // Packed: each sequence rounds its rows up to whole CTAs; this bounds the sum.
  return ceil_div(p.total_q_tokens * p.num_heads, block_m) + p.batch;
}

// Hopper decode steps over a quantized cache whose (token, head) rows fit N = 16 or 24 columns, in
// uniform batches (a packed batch's sequences may have more rows: the 64-row kernel takes those),
// run on the narrow kernel (attention_sm90_narrow.cuh) unless the caller asked for the cp.async
// tile loads (the 64-row kernel's, which the tests also run): -> N, or 0 for the 64-row kernel.
// Sparse rows stay on the 64-row kernel, whose loads mask missing rows.
int narrow_columns(const AttentionParams& p, KvFormat format, CacheRows kind) {
  if (format == KvFormat::kNone || p.cu_q_lens != nullptr || p.tile_loads != TileLoads::kAuto ||
      kind == CacheRows::kSparseSlots || kind == CacheRows::kSparseBlocks)
    return 0;
  const int64_t rows = int64_t(p.q_len) * p.num_heads;
  // N = 32 (25-32 rows) spills beside its 128 accumulators: the 64-row kernel takes those.
  return rows <= 16 ? 16 : rows <= 24 ? 24 : 0;
}

template <class Rows> constexpr CacheRows cache_rows_of();
template <> constexpr CacheRows cache_rows_of<PagedTableRows>() { return CacheRows::kPagedTable; }
template <> constexpr CacheRows cache_rows_of<BlockPointerTableRows>() { return CacheRows::kBlockPointers; }
template <> constexpr CacheRows cache_rows_of<SparseSlotRows>() { return CacheRows::kSparseSlots; }
template <> constexpr CacheRows cache_rows_of<SparseBlockRows>() { return CacheRows::kSparseBlocks; }

// The attention kernel of `launch` for rows of format F.
template <KvFormat F, class Rows>
Status launch_kernel(const AttentionParams& p, const Rows& rows, const AttentionLaunch& launch, const CUtensorMap& map,
                     int grid_x, cudaStream_t stream) {
  using namespace attention_detail;
  const int config = launch.tiles.config;
  if (launch.kernel != AttentionKernel::kMmaSync) {
    return p.dtype == DType::kBFloat16
               ? launch_attention_wgmma<__nv_bfloat16, Rows, F>(p, rows, launch, map, grid_x, stream)
               : launch_attention_wgmma<__half, Rows, F>(p, rows, launch, map, grid_x, stream);
  }
  if (p.dtype == DType::kBFloat16) return launch_attention<arch::Sm80, __nv_bfloat16, Rows, F>(p, rows, config, grid_x, stream);
  switch (launch.tag) {
    case Arch::kSm70: return launch_attention<arch::Sm70, __half, Rows, F>(p, rows, config, grid_x, stream);
    case Arch::kSm75: return launch_attention<arch::Sm75, __half, Rows, F>(p, rows, config, grid_x, stream);
    default: return launch_attention<arch::Sm80, __half, Rows, F>(p, rows, config, grid_x, stream);
  }
}

template <class Rows>
Status launch_format(const AttentionParams& p, const Rows& rows, const AttentionLaunch& launch, const CUtensorMap& map,
                     int grid_x, cudaStream_t stream) {
  switch (rows.cache.row.format) {
    case KvFormat::kNone: return launch_kernel<KvFormat::kNone>(p, rows, launch, map, grid_x, stream);
    case KvFormat::kFp8: return launch_kernel<KvFormat::kFp8>(p, rows, launch, map, grid_x, stream);
    case KvFormat::kFp8DsMla: return launch_kernel<KvFormat::kFp8DsMla>(p, rows, launch, map, grid_x, stream);
    case KvFormat::kInt8: return launch_kernel<KvFormat::kInt8>(p, rows, launch, map, grid_x, stream);
    case KvFormat::kInt4: return launch_kernel<KvFormat::kInt4>(p, rows, launch, map, grid_x, stream);
  }
  return Status::kUnsupportedFormat;
}

const PagedCache* paged_cache_of(const PagedTableRows& rows) { return &rows.cache; }
template <class Rows> const PagedCache* paged_cache_of(const Rows&) { return nullptr; }

template <class Rows>
Status dispatch(const AttentionParams& p, const Rows& rows, Arch arch, cudaStream_t stream) {
  if (p.dtype == DType::kFloat32) return Status::kUnsupportedDType;
  if (p.plan == nullptr && check_attention_splits(p.num_splits, p.tokens_per_split, 0) != Status::kOk)
    return Status::kInvalidArgument;
  const Arch tag = resolve_arch(arch, device_compute_capability());  // (a tag this device runs, or none)
  if (tag == Arch::kAuto) return Status::kUnsupportedArch;
  AttentionLaunch launch = attention_launch(p, cache_rows_of<Rows>(), rows.cache.row.format, paged_cache_of(rows), tag);
  // An empty batch launches nothing, so it needs no workspace (its size is 0 for 0 query rows) and no
  // tiles that fit.
  const bool empty = p.batch == 0 || p.total_q_tokens == 0 || p.num_heads == 0;
  if (launch.status != Status::kOk && !(empty && launch.status == Status::kSharedMemoryExceeded)) return launch.status;
  if (empty) return Status::kOk;
  if ((p.plan != nullptr || p.num_splits > 1) && p.workspace == nullptr) return Status::kInvalidArgument;
  // A plan made for other rows per CTA would hand the kernel rows it does not cover.
  if (p.plan != nullptr && (p.plan_sizes.block_m != launch.rows_per_cta || p.plan_sizes.max_items < 1))
    return Status::kInvalidArgument;
  CUtensorMap map{};
  if constexpr (std::is_same_v<Rows, PagedTableRows>) {
    // (a driver without the encoder, or one refusing the map: the same kernel with cp.async)
    if (launch.loads == TileLoadPath::kTma && !attention_detail::sm90::make_tile_map(p, rows.cache, map))
      launch.loads = TileLoadPath::kCpAsync;
  }
  const Status st = launch_format(p, rows, launch, map, grid_x_for(p, launch.tiles.block_m), stream);
  if (st != Status::kOk || launch.combine == CombineLaunch::kNone) return st;
  return p.dtype == DType::kBFloat16 ? attention_detail::launch_combine<__nv_bfloat16>(p, launch.combine, stream)
                                     : attention_detail::launch_combine<__half>(p, launch.combine, stream);
}

// Sparse attention: T one-token "sequences" whose positions are their index rows (attention.h).
template <class Rows>
Status dispatch_sparse(const AttentionParams& p, const Rows& rows, Arch arch, cudaStream_t stream) {
  const SparseIndexRows& at = rows.at;
  if (p.q_len != 1 || p.cu_q_lens != nullptr || p.causal || p.plan != nullptr || at.topk < 0 || at.stride < at.topk ||
      (at.indices == nullptr && at.topk > 0 && p.batch > 0) ||
      check_attention_splits(p.num_splits, p.tokens_per_split, at.topk) != Status::kOk)
    return Status::kInvalidArgument;
  return dispatch(p, rows, arch, stream);
}

}  // namespace

AttentionTiles attention_tiles(Arch tag, int64_t rows_per_seq, SmemLimits limits) {
  using namespace attention_detail;
  const SmemLimits l = effective_smem_limits(limits);
  auto resident = [&](int bytes, int most) {
    return std::max(0, std::min(most, l.per_sm / (bytes + l.reserved_per_block)));
  };
  if (uses_wgmma(tag)) {
    const int bytes = wgmma_smem_bytes();
    const bool fits = bytes <= l.per_block && resident(bytes, 1) > 0;
    return {fits ? 64 : 0, 64, 2, bytes, 1, bytes, 0};
  }
  const TileConfigs list = tile_configs(tag);
  int smallest = 0;
  for (int i = 0; i < list.count; ++i) {
    const int bytes = int(smem_bytes(list.at[i]));
    smallest = smallest == 0 ? bytes : std::min(smallest, bytes);
  }
  // The tallest CTA a sequence's rows can use: 64 rows read each cache tile once for up to 64
  // (token, head) rows; a shorter one where the device cannot hold it (more CTAs, more reads).
  const int wanted = rows_per_seq <= 16 ? 16 : rows_per_seq <= 32 ? 32 : 64;
  for (int block_m = wanted; block_m >= 16; block_m /= 2) {
    for (int i = 0; i < list.count; ++i) {
      const TileConfig& c = list.at[i];
      const int bytes = int(smem_bytes(c));
      if (c.block_m != block_m || bytes > l.per_block || resident(bytes, c.max_ctas_per_sm) == 0) continue;
      return {c.block_m, c.block_n, c.stages, bytes, resident(bytes, c.max_ctas_per_sm), smallest, i};
    }
  }
  return {0, 0, 0, 0, 0, smallest, -1};
}

AttentionTiles attention_launch_tiles(const AttentionParams& p, Arch tag) {
  // Packed batches size the CTA by the average rows per sequence (the schedule does the same).
  const int64_t rows_per_seq = p.cu_q_lens == nullptr || p.batch == 0
                                   ? int64_t(p.q_len) * p.num_heads
                                   : ceil_div(p.total_q_tokens, p.batch) * int64_t(p.num_heads);
  return attention_tiles(tag, rows_per_seq, p.smem_limits);
}

AttentionLaunch attention_launch(const AttentionParams& p, CacheRows kind, KvFormat format, const PagedCache* paged,
                                 Arch arch) {
  AttentionLaunch l;
  if (p.dtype == DType::kFloat32) { l.status = Status::kUnsupportedDType; return l; }
  l.tag = arch == Arch::kAuto ? resolve_arch(arch, device_compute_capability()) : arch;
  if (l.tag == Arch::kAuto) { l.status = Status::kUnsupportedArch; return l; }
  if (p.dtype == DType::kBFloat16 && !tag_has_bf16(l.tag)) { l.status = Status::kUnsupportedDType; return l; }
  l.tiles = attention_launch_tiles(p, l.tag);
  if (l.tiles.block_m == 0) l.status = Status::kSharedMemoryExceeded;
  l.rows_per_cta = l.tiles.block_m;
  if (uses_wgmma(l.tag)) {
    const int columns = narrow_columns(p, format, kind);
    if (columns != 0) {
      l.kernel = AttentionKernel::kWgmmaNarrow;
      l.loads = TileLoadPath::kBulkCopy;
      l.rows_per_cta = columns;
      l.pair_merge = p.plan == nullptr && p.num_splits == 2;
    } else {
      l.kernel = AttentionKernel::kWgmma;
      const bool tma = kind == CacheRows::kPagedTable && format == KvFormat::kNone &&
                       attention_detail::sm90::tile_map_fits(p, paged);
      l.loads = tma ? TileLoadPath::kTma : TileLoadPath::kCpAsync;
    }
  } else {
    l.kernel = AttentionKernel::kMmaSync;
    // A quantized cache dequantizes from registers: a ring configuration runs its register twin.
    l.loads = l.tiles.stages > 1 && format == KvFormat::kNone ? TileLoadPath::kCpAsync : TileLoadPath::kRegisters;
  }
  const bool splits_left = p.plan != nullptr || (p.num_splits > 1 && !l.pair_merge);
  l.combine = !splits_left ? CombineLaunch::kNone
              : l.kernel == AttentionKernel::kMmaSync ? CombineLaunch::kAfter : CombineLaunch::kEarly;
  return l;
}

AttentionSchedule make_attention_schedule(int batch, int q_len, int num_heads, int64_t max_kv_len,
                                          int sm_count, Arch arch, SmemLimits limits) {
  if (arch == Arch::kAuto) arch = resolve_arch(arch, device_compute_capability());
  const AttentionTiles tiles = attention_tiles(arch, int64_t(q_len) * num_heads, limits);
  const int block_m = std::max(tiles.block_m, 16);  // (no configuration fits: the launch will say so)
  const int64_t ctas = int64_t(batch) * ceil_div(int64_t(q_len) * num_heads, block_m);
  // Split the KV only when the (sequence, head block) CTAs cannot fill the GPU, and then into as
  // many pieces as fit in one wave (a CTA holds most of an SM's shared memory): a second, partial
  // wave would cost a whole CTA time. Splits stay long enough that the combine is a small extra.
  const int64_t slots = int64_t(sm_count) * std::max(tiles.ctas_per_sm, 1);
  int splits = 1;
  if (ctas > 0 && 2 * ctas <= slots && max_kv_len > kMinTokensPerSplit)  // (an empty batch: nothing to split)
    splits = std::max(1, std::min<int>(int(slots / ctas), ceil_div(max_kv_len, kMinTokensPerSplit)));
  int tokens = ceil_div(std::max<int64_t>(max_kv_len, 1), splits);
  tokens = ceil_div(tokens, kTileTokens) * kTileTokens;
  return {ceil_div(std::max<int64_t>(max_kv_len, 1), tokens), tokens, tiles};
}

AttentionPlanSizes attention_plan_sizes(const AttentionParams& p, KvFormat format, Arch arch, int sm_count) {
  if (arch == Arch::kAuto) arch = resolve_arch(arch, device_compute_capability());
  AttentionPlanSizes s{};
  // (a plan's rows are those of either dense addressing: the kernel does not depend on it)
  const AttentionLaunch launch = attention_launch(p, CacheRows::kPagedTable, format, nullptr, arch);
  const int rows = launch.status == Status::kOk ? launch.rows_per_cta : 0;
  if (rows == 0 || p.batch > kMaxPlanBatch || sm_count < 1) return s;
  const bool narrow = launch.kernel == AttentionKernel::kWgmmaNarrow;
  const int slots = sm_count * (narrow ? 1 : std::max(1, attention_launch_tiles(p, arch).ctas_per_sm));
  // Bounds whatever the lengths (plan.cu): a unit is split only where its cost passes the chunk,
  // itself at least the batch's work over the slots, so there are fewer than `slots` split units,
  // at most 2 slots of pieces among them, and at most slots + units items.
  s.block_m = rows;
  s.target_ctas = slots;
  s.max_items = grid_x_for(p, rows) + slots;
  s.max_slots = 2 * slots;
  s.max_units = slots;
  s.max_rows = slots * rows;
  s.plan_bytes = attention_detail::plan_bytes_of(s);
  s.workspace_bytes = size_t(s.max_slots) * rows * (kLatentDim + 1) * sizeof(float);
  return s;
}

Status invokeAttentionPlan(const AttentionParams& p, cudaStream_t stream) {
  const AttentionPlanSizes& s = p.plan_sizes;
  if (p.plan == nullptr || s.block_m < 1 || s.block_m > 64 || s.target_ctas < 1 || s.max_items < 1 ||
      s.max_slots < 1 || s.max_units < 1 || s.max_rows < 1 || p.batch > kMaxPlanBatch || p.batch < 0 ||
      p.num_heads < 1 || (p.cu_q_lens == nullptr && p.q_len < 1) || p.kv_lens == nullptr)
    return Status::kInvalidArgument;
  return attention_detail::launch_attention_plan(p, stream);
}

Status check_attention_splits(int num_splits, int tokens_per_split, int64_t max_kv_len) {
  if (num_splits < 1 || num_splits > kMaxAttentionSplits || tokens_per_split < 1) return Status::kInvalidArgument;
  return int64_t(num_splits) * tokens_per_split < max_kv_len ? Status::kInvalidArgument : Status::kOk;
}

size_t attention_workspace_size(int64_t total_q_tokens, int num_heads, int num_splits) {
  if (num_splits <= 1) return 0;
  return size_t(num_splits) * size_t(total_q_tokens) * num_heads * (kLatentDim + 1) * sizeof(float);
}

Status invokeAttentionPaged(const AttentionParams& params, const PagedCache& cache, const int* block_table,
                            int64_t block_table_stride, int max_blocks, Arch arch, cudaStream_t stream) {
  // (A plan follows the lengths; a uniform split must cover the table.)
  const Status s = params.plan != nullptr ? Status::kOk
                   : check_attention_splits(params.num_splits, params.tokens_per_split, int64_t(max_blocks) * cache.block_size);
  if (s != Status::kOk) return s;
  const PagedTableRows rows{cache, block_table, block_table_stride, max_blocks};
  return dispatch(params, rows, arch, stream);
}

Status invokeAttentionBlocks(const AttentionParams& params, const BlockPointerCache& cache, Arch arch,
                             cudaStream_t stream) {
  return dispatch(params, BlockPointerTableRows{cache}, arch, stream);
}

Status invokeSparseAttention(const AttentionParams& params, const PagedCache& cache, const SparseIndices& indices,
                             Arch arch, cudaStream_t stream) {
  return dispatch_sparse(params, SparseSlotRows{cache, {indices.indices, indices.stride, indices.topk}}, arch, stream);
}

Status invokeSparseAttentionBlocks(const AttentionParams& params, const BlockPointerCache& cache,
                                   const SparseIndices& indices, const int* cu_q_lens, Arch arch,
                                   cudaStream_t stream) {
  if (cu_q_lens == nullptr && params.batch > 0) return Status::kInvalidArgument;
  return dispatch_sparse(params, SparseBlockRows{cache, {indices.indices, indices.stride, indices.topk}, cu_q_lens},
                         arch, stream);
}

}  // namespace mla_kv
