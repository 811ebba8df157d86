// Turing: mma.m16n8k8, fp16 sparse attention variant.
#include "attention_mma_sync.cuh"

MLA_KV_INSTANTIATE_SPARSE_ATTENTION(mla_kv::arch::Sm75, __half, mla_kv::KvFormat::kNone)
