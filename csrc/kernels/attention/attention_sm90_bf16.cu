// Hopper: wgmma, bf16 attention variant.
#include "attention_sm90.cuh"
#include "attention_launch.h"

MLA_KV_INSTANTIATE_ATTENTION_WGMMA(__nv_bfloat16)
