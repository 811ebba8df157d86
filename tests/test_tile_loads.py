"""The Hopper kernel's two tile-load paths (TMA, cp.async) over the same paged caches, chosen by the
schedule's tile_loads (an explicit choice: the core reads no environment), against the reference."""
import math

import pytest
import torch

import mla_kv
from mla_kv import reference

from gpu_checks import check_attention, default_schedule, random_cache, run_decode, run_prefill


def test_tile_loads_is_checked():
    with pytest.raises(ValueError, match="tile_loads"):
        mla_kv.attention_schedule(1, 1, 16, 64, tile_loads="tma")
    bad = mla_kv.AttentionSchedule(1, 64, 0, tile_loads="TMA")
    with pytest.raises(ValueError, match="tile_loads"):
        mla_kv.ops.attention._workspace(None, bad, torch.device("cpu"), max_kv=64, total_tokens=1, heads=16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 64, 128])
def test_tma_and_cp_async_paths_match_the_reference(dtype, block_size):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA path is the Hopper kernel's")
    scale = 1 / math.sqrt(192)
    lens = [1, 64, 300, 1000]
    cache, table, seq_lens = random_cache(lens, block_size, dtype)
    q = torch.randn(len(lens), 2, 20, 576, device="cuda").to(dtype)
    ref = reference.decode(q.double(), cache.double(), table, seq_lens, scale)
    outs = {}
    for loads in ("auto", "cp.async"):
        s = default_schedule(q, cache, table)
        s = mla_kv.AttentionSchedule(s.num_splits, s.tokens_per_split, s.workspace_bytes, s.tiles, s.smem_limits,
                                     loads)
        outs[loads] = run_decode(q, cache, table, seq_lens, scale, schedule=s)
        check_attention(*outs[loads], *ref, f"decode tile_loads={loads} block_size={block_size}")
    cu = torch.tensor([0, 5, 40], device="cuda").int()
    kv = torch.tensor([64, 300], device="cuda").int()
    qp = torch.randn(40, 16, 576, device="cuda").to(dtype)
    ref = reference.prefill(qp.double(), cache.double(), table[1:3], cu, kv, scale)
    for loads in ("auto", "cp.async"):
        s = default_schedule(qp, cache, table[1:3], packed_batch=2)
        s = mla_kv.AttentionSchedule(s.num_splits, s.tokens_per_split, s.workspace_bytes, s.tiles, s.smem_limits,
                                     loads)
        out = run_prefill(qp, cache, table[1:3], cu, kv, scale, schedule=s)
        check_attention(*out, *ref, f"prefill tile_loads={loads} block_size={block_size}", cu_q_lens=cu)
