// Sm70 tag: fp16 keys and queries (Volta has no bf16), e4m3 encoded in software. Also serves Sm75 devices.
#include "index_keys.cuh"
#include "index_keys_launch.h"

MLA_KV_INSTANTIATE_INDEX_KEYS(mla_kv::arch::Sm70, __half)
