// Ampere+: mma.m16n8k16, fp16 attention variant.
#include "attention.cuh"
#include "attention_launch.h"

MLA_KV_INSTANTIATE_ATTENTION(mla_kv::arch::Sm80, __half)
