// invokeIndexTopk: checks the arguments, picks how many CTAs share a row and whether a chunk stays in
// shared memory, and launches the kernel (index_topk.cuh). Every arch tag runs the same plain-CUDA
// kernel; the tag is only checked against the device.
#include <algorithm>
#include <atomic>
#include <climits>

#include "index_topk.cuh"

namespace mla_kv {
namespace {

using namespace index_topk_detail;

constexpr int64_t kFillRows = 128;  // rows that give every SM of a 100-132 SM GPU about one CTA
constexpr int kMaxDevices = 64;

// CTAs per row the workspace is sized for (device-independent, so that a workspace sized ahead fits
// every launch): one when the rows alone fill the GPU; else enough for about kFillRows CTAs and as
// many as keep each chunk within shared memory, but no chunk shorter than kMinChunk keys.
int64_t planned_splits(int64_t num_tokens, int64_t max_kv_len) {
  if (num_tokens >= kFillRows) return 1;
  const int64_t for_memory = (max_kv_len + kMaxChunk - 1) / kMaxChunk;
  const int64_t for_fill = (kFillRows + num_tokens - 1) / num_tokens;
  const int64_t most = std::max<int64_t>(1, std::min<int64_t>(kMaxSplits, max_kv_len / kMinChunk));
  return std::min(std::max(for_memory, for_fill), most);
}

// CTAs the current device holds at once of either kernel variant (the fewer); a row's CTAs wait for
// each other, so a row may not have more (0 when the device cannot be queried).
int resident_ctas() {
  static std::atomic<int> known[kMaxDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  if (device < kMaxDevices && known[device].load() > 0) return known[device].load();
  const int sms = device_sm_count();
  int cached = 0, streamed = 0;
  if (sms == 0 || cudaOccupancyMaxActiveBlocksPerMultiprocessor(&cached, index_topk_kernel<true>, kThreads, 0) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&streamed, index_topk_kernel<false>, kThreads, 0) != cudaSuccess)
    return 0;
  const int ctas = sms * std::min(cached, streamed);
  if (device < kMaxDevices) known[device].store(ctas);
  return ctas;
}

}  // namespace

int64_t index_topk_workspace_size(int64_t num_tokens, int64_t max_kv_len, int k) {
  if (num_tokens <= 0 || k < 1 || max_kv_len <= k) return 0;
  const int64_t splits = planned_splits(num_tokens, max_kv_len);
  return splits > 1 ? num_tokens * row_state_words(int(splits)) * int64_t(sizeof(uint32_t)) : 0;
}

Status invokeIndexTopk(const IndexTopkParams& p, void* workspace, Arch arch, cudaStream_t stream) {
  // max_kv_len leaves room for a chunk's end past the row (split * chunk < n + kMaxSplits) in int.
  if (p.num_tokens < 0 || p.batch < 0 || p.k < 1 || p.max_kv_len < 0 || p.max_kv_len > INT_MAX - kMaxSplits ||
      p.logits_stride < p.max_kv_len || p.indices_stride < p.k)
    return Status::kInvalidArgument;
  if (p.block_table != nullptr && (p.page_size < 1 || p.max_blocks < 0 || p.block_table_stride < p.max_blocks))
    return Status::kInvalidArgument;
  if (p.num_tokens > 0 && (p.indices == nullptr || (p.batch > 0 && p.kv_lens == nullptr) ||
                           (p.max_kv_len > 0 && p.logits == nullptr)))
    return Status::kInvalidArgument;
  if (resolve_arch(arch, device_compute_capability()) == Arch::kAuto) return Status::kUnsupportedArch;
  if (p.num_tokens == 0) return Status::kOk;

  int64_t splits = 1;
  if (p.max_kv_len > p.k) {
    splits = std::min<int64_t>(planned_splits(p.num_tokens, p.max_kv_len), resident_ctas());
    splits = std::max<int64_t>(splits, 1);
  }
  if (splits > 1 && workspace == nullptr) return Status::kInvalidArgument;
  const int64_t grid = p.num_tokens * splits;
  if (grid > INT_MAX) return Status::kInvalidArgument;
  const Launch launch{int(splits), static_cast<uint32_t*>(workspace)};
  const bool cached = (p.max_kv_len + splits - 1) / splits <= kMaxChunk;
  if (cached)
    index_topk_kernel<true><<<unsigned(grid), kThreads, 0, stream>>>(p, launch);
  else
    index_topk_kernel<false><<<unsigned(grid), kThreads, 0, stream>>>(p, launch);
  return cudaPeekAtLastError() == cudaSuccess ? Status::kOk : Status::kCudaError;
}

}  // namespace mla_kv
