// Turing: mma.m16n8k8, fp16 attention variant.
#include "attention_mma_sync.cuh"

MLA_KV_INSTANTIATE_ATTENTION(mla_kv::arch::Sm75, __half, mla_kv::KvFormat::kNone)
