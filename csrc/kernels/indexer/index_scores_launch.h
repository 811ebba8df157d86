// Declarations of the per-arch index-score launchers; their instantiations live in one .cu per arch tag
// (index_scores_sm70.cu, index_scores_sm75.cu, index_scores_sm80.cu) so the builds run in parallel.
#pragma once

#include "mla_kv/indexer.h"

namespace mla_kv {
namespace index_scores_detail {

// The q operand as given: fp16, bf16, or e4m3 codes with a scale per (token, head).
enum QKind : int { kQHalf = 0, kQBf16 = 1, kQE4m3 = 2 };

template <class A, int kQ>
Status launch_index_scores(const IndexScoresParams& p, const IndexCache& cache, int tiles_per_cta,
                           cudaStream_t stream);

}  // namespace index_scores_detail
}  // namespace mla_kv

#define MLA_KV_INSTANTIATE_INDEX_SCORES(A)                                                                 \
  template mla_kv::Status mla_kv::index_scores_detail::launch_index_scores<A, mla_kv::index_scores_detail::kQHalf>( \
      const mla_kv::IndexScoresParams&, const mla_kv::IndexCache&, int, cudaStream_t);                       \
  template mla_kv::Status mla_kv::index_scores_detail::launch_index_scores<A, mla_kv::index_scores_detail::kQBf16>( \
      const mla_kv::IndexScoresParams&, const mla_kv::IndexCache&, int, cudaStream_t);                       \
  template mla_kv::Status mla_kv::index_scores_detail::launch_index_scores<A, mla_kv::index_scores_detail::kQE4m3>( \
      const mla_kv::IndexScoresParams&, const mla_kv::IndexCache&, int, cudaStream_t);
