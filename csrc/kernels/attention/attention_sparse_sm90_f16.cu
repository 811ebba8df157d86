// Hopper: wgmma, fp16 sparse attention variant (cp.async gathers of the indexed rows).
#include "attention_sm90.cuh"

MLA_KV_INSTANTIATE_SPARSE_ATTENTION_WGMMA(__half, mla_kv::KvFormat::kNone)
