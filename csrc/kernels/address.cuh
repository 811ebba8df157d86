// Token -> cache row addressing. One small functor per addressing, so every kernel family is
// written once and serves both the paged tensor and the block-pointer caches.
#pragma once

#include <cstdint>

#include "mla_kv/layout.h"
#include "mla_kv/write.h"

namespace mla_kv {

// The sequence owning packed token t < cu_lens[batch]: the largest b with cu_lens[b] <= t (empty
// sequences have cu_lens[b] == cu_lens[b + 1] and are passed over).
__device__ __forceinline__ int sequence_of(const int* cu_lens, int batch, int64_t t) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (cu_lens[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// pos / size and pos % size for a cache's block size: a shift and a mask for the powers of two that
// engines use (the read kernels do this per row and tile, where a division costs ~30 instructions),
// a division otherwise. The branch is uniform: size is a kernel argument.
__device__ __forceinline__ int block_index(int pos, int size) {
  return (size & (size - 1)) == 0 ? pos >> (__ffs(size) - 1) : pos / size;
}
__device__ __forceinline__ int block_offset(int pos, int size) {
  return (size & (size - 1)) == 0 ? pos & (size - 1) : pos % size;
}

// A write's target: the layer's region of one block and the row's index in it; a trailer format
// keeps the row's (scale, zero) at region + rows_per_block * row_stride_bytes + offset * 4.
struct RowSlot {
  char* region;  // nullptr: the token is skipped
  int64_t offset;
};
__device__ __forceinline__ char* row_of(const RowSlot& s, const RowLayout& row) {
  return s.region == nullptr ? nullptr : s.region + s.offset * row.row_stride_bytes;
}

// Writes through a vLLM-style slot mapping.
struct PagedSlotRows {
  PagedCache cache;
  const int64_t* slot_mapping;

  __host__ __device__ __forceinline__ int rows_per_block() const { return cache.block_size; }
  // Skipped: padded (negative) or out-of-range slots.
  __device__ __forceinline__ RowSlot slot(int64_t t) const {
    const int64_t slot = slot_mapping[t];
    const int64_t block = slot / cache.block_size;
    if (slot < 0 || block >= cache.num_blocks) return {nullptr, 0};
    return {static_cast<char*>(cache.base) + block * cache.block_stride_bytes, slot - block * cache.block_size};
  }
  __device__ __forceinline__ char* row(int64_t t) const { return row_of(slot(t), cache.row); }
};

// Writes new tokens of packed sequences behind TurboMind-style block pointers.
struct BlockPointerRows {
  BlockPointerCache cache;
  BlockWriteTargets to;

  __host__ __device__ __forceinline__ int rows_per_block() const { return cache.block_seq_len; }
  __device__ __forceinline__ RowSlot slot(int64_t t) const {
    if (t >= to.cu_q_lens[cache.batch]) return {nullptr, 0};
    const int b = sequence_of(to.cu_q_lens, cache.batch, t);
    const int64_t pos = to.history_lens[b] + (t - to.cu_q_lens[b]);
    if (pos < 0 || pos % to.cp_size != to.cp_rank) return {nullptr, 0};
    const int64_t local = pos / to.cp_size;
    if (to.readonly_lens != nullptr && local < to.readonly_lens[b]) return {nullptr, 0};
    const int64_t block = local / cache.block_seq_len;
    const int first = cache.cu_block_nums[b];
    if (block >= cache.cu_block_nums[b + 1] - first) return {nullptr, 0};
    return {static_cast<char*>(cache.block_ptrs[first + block]) + cache.layer_offset_bytes,
            local - block * cache.block_seq_len};
  }
  __device__ __forceinline__ char* row(int64_t t) const { return row_of(slot(t), cache.row); }
};

// A cache row found for reading: its layer's region of the block and the row's index there (block
// null: no such row). The read kernels' row-level addressing (locate), which serves the dense
// positions and the sparse indices alike; readers of whole blocks use block_base.
struct RowRef {
  const char* block;
  int offset;
};
template <class Rows>
__device__ __forceinline__ const char* row_at(const Rows& rows, const RowRef& r) {
  return r.block == nullptr ? nullptr : r.block + int64_t(r.offset) * rows.cache.row.row_stride_bytes;
}
// An int8 / int4 row's (scale, zero) pair: after the rows of its layer's region of the block.
template <class Rows>
__device__ __forceinline__ const char* trailer_at(const Rows& rows, const RowRef& r) {
  return r.block + int64_t(rows.rows_per_block()) * rows.cache.row.row_stride_bytes + 4 * int64_t(r.offset);
}

// Reads position `pos` of sequence b through a paged block table. A null block base for positions
// the table does not cover or block ids outside the cache: the kernels treat such rows as zeros.
struct PagedTableRows {
  PagedCache cache;
  const int* block_table;
  int64_t block_table_stride;
  int max_blocks;  // entries per block-table row

  // This layer's first row in the block holding `pos`.
  __device__ __forceinline__ const char* block_base(int b, int pos) const {
    const int i = block_index(pos, cache.block_size);
    if (i >= max_blocks) return nullptr;
    const int block = block_table[b * block_table_stride + i];
    if (block < 0 || block >= cache.num_blocks) return nullptr;
    return static_cast<const char*>(cache.base) + int64_t(block) * cache.block_stride_bytes;
  }
  __device__ __forceinline__ const char* row_in_block(const char* base, int pos) const {
    return base + int64_t(block_offset(pos, cache.block_size)) * cache.row.row_stride_bytes;
  }
  __device__ __forceinline__ RowRef locate(int b, int pos) const {
    return {block_base(b, pos), block_offset(pos, cache.block_size)};
  }
  __device__ __forceinline__ int kv_len(const int* kv_lens, int b) const { return kv_lens[b]; }
  __host__ __device__ __forceinline__ int rows_per_block() const { return cache.block_size; }
  static constexpr bool kMasksMissing = false;  // a missing row reads as zeros (attention.h)
};

// Reads position `pos` of sequence b through TurboMind-style block pointers.
struct BlockPointerTableRows {
  BlockPointerCache cache;

  __device__ __forceinline__ const char* block_base(int b, int pos) const {
    const int i = block_index(pos, cache.block_seq_len);
    const int first = cache.cu_block_nums[b];
    if (i >= cache.cu_block_nums[b + 1] - first) return nullptr;
    return static_cast<const char*>(cache.block_ptrs[first + i]) + cache.layer_offset_bytes;
  }
  __device__ __forceinline__ const char* row_in_block(const char* base, int pos) const {
    return base + int64_t(block_offset(pos, cache.block_seq_len)) * cache.row.row_stride_bytes;
  }
  __device__ __forceinline__ RowRef locate(int b, int pos) const {
    return {block_base(b, pos), block_offset(pos, cache.block_seq_len)};
  }
  __device__ __forceinline__ int kv_len(const int* kv_lens, int b) const { return kv_lens[b]; }
  __host__ __device__ __forceinline__ int rows_per_block() const { return cache.block_seq_len; }
  static constexpr bool kMasksMissing = false;
};

// Sparse attention: "sequence" t is one query token and its kv position j < topk the row named by
// indices[t * stride + j]. A missing row (index -1, or outside the cache) is masked out of the softmax
// (kMasksMissing), never read.
struct SparseIndexRows {
  const int* indices;
  int64_t stride;
  int topk;
  __device__ __forceinline__ int index(int t, int j) const { return j < topk ? __ldg(indices + t * stride + j) : -1; }
  // Token t's indices read: its top-k length (kv_lens, optional) within topk.
  __device__ __forceinline__ int kv_len(const int* kv_lens, int t) const {
    return kv_lens == nullptr ? topk : min(kv_lens[t], topk);
  }
};

// Indices are physical slots of a paged cache, block * block_size + offset (FlashMLA's and vLLM's form).
struct SparseSlotRows {
  PagedCache cache;
  SparseIndexRows at;

  __device__ __forceinline__ RowRef locate(int t, int j) const {
    const int slot = at.index(t, j);
    if (slot < 0) return {nullptr, 0};
    const int block = block_index(slot, cache.block_size);
    if (block >= cache.num_blocks) return {nullptr, 0};
    return {static_cast<const char*>(cache.base) + int64_t(block) * cache.block_stride_bytes,
            block_offset(slot, cache.block_size)};
  }
  __host__ __device__ __forceinline__ int rows_per_block() const { return cache.block_size; }
  __device__ __forceinline__ int kv_len(const int* kv_lens, int t) const { return at.kv_len(kv_lens, t); }
  static constexpr bool kMasksMissing = true;
};

// Indices are positions in the query token's sequence behind TurboMind-style block pointers; token t
// belongs to the sequence b with cu_q_lens[b] <= t < cu_q_lens[b + 1] (tokens past cu_q_lens[batch]
// read nothing).
struct SparseBlockRows {
  BlockPointerCache cache;
  SparseIndexRows at;
  const int* cu_q_lens;  // device [cache.batch + 1]

  __device__ __forceinline__ RowRef locate(int t, int j) const {
    const int pos = at.index(t, j);
    if (pos < 0 || t >= cu_q_lens[cache.batch]) return {nullptr, 0};
    const int b = sequence_of(cu_q_lens, cache.batch, t);
    const int i = block_index(pos, cache.block_seq_len), first = cache.cu_block_nums[b];
    if (i >= cache.cu_block_nums[b + 1] - first) return {nullptr, 0};
    return {static_cast<const char*>(cache.block_ptrs[first + i]) + cache.layer_offset_bytes,
            block_offset(pos, cache.block_seq_len)};
  }
  __host__ __device__ __forceinline__ int rows_per_block() const { return cache.block_seq_len; }
  __device__ __forceinline__ int kv_len(const int* kv_lens, int t) const { return at.kv_len(kv_lens, t); }
  static constexpr bool kMasksMissing = true;
};

// The (scale, zero) pair of position pos in the block at base (readers of whole blocks).
template <class Rows>
__device__ __forceinline__ const char* trailer_pair(const Rows& rows, const char* base, int pos) {
  return trailer_at(rows, RowRef{base, block_offset(pos, rows.rows_per_block())});
}

// Kernels keep rows in shared memory in the canonical [c_kv | k_pe] order, like q's [q_lat | q_pe]:
// the column of element e of a stored row (parts start at multiples of 64 elements).
__device__ __forceinline__ int canonical_column(const RowLayout& row, int e) {
  return (e >= row.latent_offset && e < row.latent_offset + kLatentDim) ? e - row.latent_offset
                                                                        : kLatentDim + e - row.rope_offset;
}
// The inverse: the element of a stored row that holds canonical column c.
__device__ __forceinline__ int stored_column(const RowLayout& row, int c) {
  return c < kLatentDim ? row.latent_offset + c : row.rope_offset + c - kLatentDim;
}

}  // namespace mla_kv
