// Hopper: wgmma, f16 attention variant.
#include "attention_sm90.cuh"

MLA_KV_INSTANTIATE_ATTENTION_WGMMA(__half, mla_kv::KvFormat::kNone)

int mla_kv::attention_detail::wgmma_smem_bytes() { return int(mla_kv::attention_detail::sm90::kBytes); }
