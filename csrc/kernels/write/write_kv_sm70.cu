// Sm70 tag: fp16 and fp32 (Volta has no bf16). Also serves Sm75 devices' write path.
#include "write_kv.cuh"
#include "write_kv_launch.h"

MLA_KV_INSTANTIATE_WRITE(mla_kv::arch::Sm70, __half)
MLA_KV_INSTANTIATE_WRITE(mla_kv::arch::Sm70, float)
