// Hopper: wgmma, bf16 attention variant over the quantized caches (fp8, fp8_ds_mla, int8, int4).
#include "attention_sm90.cuh"

MLA_KV_INSTANTIATE_ATTENTION_WGMMA(__nv_bfloat16, mla_kv::KvFormat::kFp8)
MLA_KV_INSTANTIATE_ATTENTION_WGMMA(__nv_bfloat16, mla_kv::KvFormat::kFp8DsMla)
MLA_KV_INSTANTIATE_ATTENTION_WGMMA(__nv_bfloat16, mla_kv::KvFormat::kInt8)
MLA_KV_INSTANTIATE_ATTENTION_WGMMA(__nv_bfloat16, mla_kv::KvFormat::kInt4)
