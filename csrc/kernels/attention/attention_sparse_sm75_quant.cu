// Turing: mma.m16n8k8, fp16 sparse attention variant over the quantized caches.
#include "attention_mma_sync.cuh"

MLA_KV_INSTANTIATE_SPARSE_ATTENTION_QUANTIZED(mla_kv::arch::Sm75, __half)
