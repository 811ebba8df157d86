// Sm80 tag (and Sm90 devices): fp16 and bf16, streaming key loads; e4m3 by cvt where the target has it (sm_89+).
#include "index_keys.cuh"
#include "index_keys_launch.h"

MLA_KV_INSTANTIATE_INDEX_KEYS(mla_kv::arch::Sm80, __half)
MLA_KV_INSTANTIATE_INDEX_KEYS(mla_kv::arch::Sm80, __nv_bfloat16)
