// Volta: mma.m8n8k4, the expanded-form attention's head dims.
#include "expanded_attention.cuh"

MLA_KV_INSTANTIATE_EXPANDED(mla_kv::arch::Sm70)
