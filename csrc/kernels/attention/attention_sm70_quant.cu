// Volta: mma.m8n8k4, fp16 attention variant over the quantized caches (fp8, fp8_ds_mla, int8, int4).
#include "attention_mma_sync.cuh"

MLA_KV_INSTANTIATE_ATTENTION_QUANTIZED(mla_kv::arch::Sm70, __half)
