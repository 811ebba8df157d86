// Hopper: wgmma, bf16 sparse attention variant over the quantized caches.
#include "attention_sm90.cuh"

MLA_KV_INSTANTIATE_SPARSE_ATTENTION_WGMMA_QUANTIZED(__nv_bfloat16)
