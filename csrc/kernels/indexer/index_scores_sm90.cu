// Hopper: e4m3 queries times the cached codes on mma.m16n8k32.e4m3 (16-bit queries take the Sm80 kernel).
#include "index_scores.cuh"

template mla_kv::Status
mla_kv::index_scores_detail::launch_index_scores<mla_kv::arch::Sm90, mla_kv::index_scores_detail::kQE4m3>(
    const mla_kv::IndexScoresParams&, const mla_kv::IndexCache&, int, cudaStream_t);
