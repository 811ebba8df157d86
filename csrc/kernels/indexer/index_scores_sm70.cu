// Volta: mma.m8n8k4, index scores.
#include "index_scores.cuh"

MLA_KV_INSTANTIATE_INDEX_SCORES(mla_kv::arch::Sm70)
