// Sm80 tag, quantized caches dequantized into fp16 or bf16 rows.
#include "gather_kv_dequant.cuh"
#include "gather_kv_launch.h"

MLA_KV_INSTANTIATE_GATHER_DEQUANT(mla_kv::arch::Sm80, __half)
MLA_KV_INSTANTIATE_GATHER_DEQUANT(mla_kv::arch::Sm80, __nv_bfloat16)
