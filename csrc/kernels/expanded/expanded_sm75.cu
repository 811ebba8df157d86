// Turing: mma.m16n8k8, the expanded-form attention's head dims.
#include "expanded_attention.cuh"

MLA_KV_INSTANTIATE_EXPANDED(mla_kv::arch::Sm75)
