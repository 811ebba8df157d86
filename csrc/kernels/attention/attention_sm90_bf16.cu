// Hopper: wgmma, bf16 attention variant.
#include "attention_sm90.cuh"

MLA_KV_INSTANTIATE_ATTENTION_WGMMA(__nv_bfloat16, mla_kv::KvFormat::kNone)
