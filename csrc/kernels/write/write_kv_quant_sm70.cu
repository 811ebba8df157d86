// Sm70 tag, quantized caches: fp16 rows quantized in the write; e4m3 encoded with integer arithmetic.
#include "write_kv.cuh"
#include "write_kv_launch.h"

MLA_KV_INSTANTIATE_WRITE_QUANT(mla_kv::arch::Sm70, __half)
