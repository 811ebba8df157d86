// Adapters from TurboMind's (LMDeploy's) batch description to the inputs of mla_kv's entry points.
//
// TurboMind describes a batch by prefix sums: cu_q_len [B + 1] (new tokens) and cu_k_len [B + 1]
// (keys each sequence's attention sees: its history plus its new tokens). mla_kv's attention takes
// per-sequence kv_lens [B] and its block write history_lens [B] (the position of each sequence's
// first new token). This header turns the one into the other on the device, so an engine keeps
// its own inputs and nothing is read back to the host (a CUDA graph can hold the call). It is
// bookkeeping, not a second attention or write kernel: one tiny launch per batch, shared by every
// layer of the step.
#pragma once

#include <cuda_runtime.h>

#include "mla_kv/arch.h"
#include "mla_kv/layout.h"

namespace mla_kv {

// For each sequence b < batch (device arrays):
//   kv_lens[b]      = cu_k_lens[b + 1] - cu_k_lens[b]                       (history + new tokens)
//   history_lens[b] = kv_lens[b] - (cu_q_lens[b + 1] - cu_q_lens[b])        (tokens before the new ones)
// history_lens may be nullptr (attention needs kv_lens only); cu_q_lens is read only when it is not.
// A sequence that recomputes its last cached token (LMDeploy, when a whole prompt hits the prefix
// cache) has cu_k_len counting that token once, so its history is one less than the cached length,
// as TurboMind computes it. kInvalidArgument: batch < 0, or a needed pointer is null (batch > 0);
// batch 0 launches nothing; kCudaError: the launch failed (see cudaGetLastError()).
Status invokeLengthsFromPrefixSums(const int* cu_q_lens, const int* cu_k_lens, int batch, int* kv_lens,
                                   int* history_lens, cudaStream_t stream);

}  // namespace mla_kv
