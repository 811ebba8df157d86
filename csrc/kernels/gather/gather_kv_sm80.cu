// Sm80 tag: 16- and 32-bit elements with no-L1-allocate streaming loads.
#include "gather_kv.cuh"
#include "gather_kv_launch.h"

MLA_KV_INSTANTIATE_GATHER(mla_kv::arch::Sm80, uint16_t)
MLA_KV_INSTANTIATE_GATHER(mla_kv::arch::Sm80, uint32_t)
