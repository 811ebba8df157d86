// Volta: mma.m8n8k4, fp16 sparse attention variant over the quantized caches.
#include "attention_mma_sync.cuh"

MLA_KV_INSTANTIATE_SPARSE_ATTENTION_QUANTIZED(mla_kv::arch::Sm70, __half)
