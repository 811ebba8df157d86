// Hopper: wgmma, f16 attention variant.
#include "attention_sm90.cuh"
#include "attention_launch.h"

MLA_KV_INSTANTIATE_ATTENTION_WGMMA(__half)
