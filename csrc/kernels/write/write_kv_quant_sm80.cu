// Sm80 tag, quantized caches: fp16 and bf16 rows; e4m3 by cvt where the target has it (sm_89+).
#include "write_kv.cuh"
#include "write_kv_launch.h"

MLA_KV_INSTANTIATE_WRITE_QUANT(mla_kv::arch::Sm80, __half)
MLA_KV_INSTANTIATE_WRITE_QUANT(mla_kv::arch::Sm80, __nv_bfloat16)
