// Volta: mma.m8n8k4, fp16 attention variant.
#include "attention_mma_sync.cuh"

MLA_KV_INSTANTIATE_ATTENTION(mla_kv::arch::Sm70, __half, mla_kv::KvFormat::kNone)
