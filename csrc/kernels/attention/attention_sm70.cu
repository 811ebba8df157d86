// Volta: mma.m8n8k4, fp16 attention variant.
#include "attention.cuh"
#include "attention_launch.h"

MLA_KV_INSTANTIATE_ATTENTION(mla_kv::arch::Sm70, __half)
