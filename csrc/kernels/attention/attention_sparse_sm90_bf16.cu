// Hopper: wgmma, bf16 sparse attention variant (cp.async gathers of the indexed rows).
#include "attention_sm90.cuh"

MLA_KV_INSTANTIATE_SPARSE_ATTENTION_WGMMA(__nv_bfloat16, mla_kv::KvFormat::kNone)
