// Sm70 tag: 16- and 32-bit elements (fp16, bf16 and fp32: a copy needs no bf16 arithmetic, so bf16
// caches gather on Volta too). Also serves Sm75 devices' gather path.
#include "gather_kv.cuh"
#include "gather_kv_launch.h"

MLA_KV_INSTANTIATE_GATHER(mla_kv::arch::Sm70, uint16_t)
MLA_KV_INSTANTIATE_GATHER(mla_kv::arch::Sm70, uint32_t)
