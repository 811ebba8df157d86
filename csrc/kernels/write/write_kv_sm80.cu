// Sm80 tag: fp16, bf16 and fp32 with no-L1-allocate streaming loads.
#include "write_kv.cuh"
#include "write_kv_launch.h"

MLA_KV_INSTANTIATE_WRITE(mla_kv::arch::Sm80, __half)
MLA_KV_INSTANTIATE_WRITE(mla_kv::arch::Sm80, __nv_bfloat16)
MLA_KV_INSTANTIATE_WRITE(mla_kv::arch::Sm80, float)
