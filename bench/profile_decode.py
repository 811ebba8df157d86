"""One decode launch for a profiler (ncu): python bench/profile_decode.py B CTX H [dtype]."""
import math
import sys

import torch

import mla_kv

batch, ctx, heads = (int(a) for a in sys.argv[1:4])
dtype = getattr(torch, sys.argv[4]) if len(sys.argv) > 4 else torch.bfloat16
gen = torch.Generator(device="cuda").manual_seed(0)
blocks = ctx // 64
cache = torch.randn(batch * blocks, 64, 576, device="cuda", dtype=dtype, generator=gen)
table = torch.randperm(batch * blocks, device="cuda", generator=gen).int().view(batch, blocks)
lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
q = torch.randn(batch, 1, heads, 576, device="cuda", dtype=dtype, generator=gen)
for _ in range(3):
    mla_kv.decode(q, cache, table, lens, 1 / math.sqrt(192))
torch.cuda.synchronize()
