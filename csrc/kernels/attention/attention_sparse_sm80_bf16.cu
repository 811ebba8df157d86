// Ampere+: mma.m16n8k16, bf16 sparse attention variant.
#include "attention_mma_sync.cuh"

MLA_KV_INSTANTIATE_SPARSE_ATTENTION(mla_kv::arch::Sm80, __nv_bfloat16, mla_kv::KvFormat::kNone)
