// Ampere and newer (the Sm90 tag too): mma.m16n8k16, cp.async, index scores.
#include "index_scores.cuh"

MLA_KV_INSTANTIATE_INDEX_SCORES(mla_kv::arch::Sm80)
