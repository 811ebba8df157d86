// invokeLengthsFromPrefixSums: TurboMind's cu_q_len / cu_k_len to mla_kv's kv_lens / history_lens.
#include "mla_kv/turbomind.h"

namespace mla_kv {
namespace {

constexpr int kThreads = 128;
// A batch is a few hundred sequences; a grid-stride loop keeps any batch to a bounded launch.
constexpr int kMaxBlocks = 64;

__global__ void __launch_bounds__(kThreads)
    lengths_from_prefix_sums_kernel(const int* cu_q_lens, const int* cu_k_lens, int batch, int* kv_lens,
                                    int* history_lens) {
  for (int b = blockIdx.x * kThreads + threadIdx.x; b < batch; b += gridDim.x * kThreads) {
    const int kv = cu_k_lens[b + 1] - cu_k_lens[b];
    kv_lens[b] = kv;
    if (history_lens != nullptr) history_lens[b] = kv - (cu_q_lens[b + 1] - cu_q_lens[b]);
  }
}

}  // namespace

Status invokeLengthsFromPrefixSums(const int* cu_q_lens, const int* cu_k_lens, int batch, int* kv_lens,
                                   int* history_lens, cudaStream_t stream) {
  if (batch < 0) return Status::kInvalidArgument;
  if (batch == 0) return Status::kOk;
  if (cu_k_lens == nullptr || kv_lens == nullptr || (history_lens != nullptr && cu_q_lens == nullptr))
    return Status::kInvalidArgument;
  const int blocks = (batch + kThreads - 1) / kThreads;
  lengths_from_prefix_sums_kernel<<<blocks < kMaxBlocks ? blocks : kMaxBlocks, kThreads, 0, stream>>>(
      cu_q_lens, cu_k_lens, batch, kv_lens, history_lens);
  return cudaPeekAtLastError() == cudaSuccess ? Status::kOk : Status::kCudaError;
}

}  // namespace mla_kv
