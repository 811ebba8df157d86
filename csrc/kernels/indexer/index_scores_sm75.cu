// Turing: mma.m16n8k8, index scores.
#include "index_scores.cuh"

MLA_KV_INSTANTIATE_INDEX_SCORES(mla_kv::arch::Sm75)
