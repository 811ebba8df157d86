"""The length-aware work plan (attention_schedule's split="lengths", attention_plan) against the float64
reference, and the plan's own invariants.

Batches of unequal lengths (0, 1, 63, 64, 65, block and chunk boundaries, one long sequence among many
short ones) run on every kernel variant and both addressings, decode with S_q 1-4 (the causal limit
inside a piece) and prefill with packed sequences; every launch gets NaN outputs and a 0xFF workspace.
plan_table reads a plan back from its workspace and checks what the kernels rely on: each (sequence,
row block) unit's visible kv range is cut into contiguous pieces on 64-token tiles that cover it
exactly once, split units own distinct slots and every one of their rows is in exactly one combine
list, and the items fit the capacities (and one wave, where the batch allows it).
"""
import math

import pytest
import torch

import mla_kv
from mla_kv import reference

from gpu_checks import (ATTENTION_ARCHS, block_pointer_copy, capture_graph, check_attention, default_schedule,
                        nan_outputs, random_cache)

GPU = pytest.mark.gpu
SCALE = 1.0 / math.sqrt(192 + 64)
TILE = 64
HUGE_AMONG_TINY = [40_000] + [1 + 37 * i % 700 for i in range(40)]


def poisoned(schedule, device):
    return torch.full((schedule.workspace_bytes,), 0xFF, dtype=torch.uint8, device=device)


def plan_table(plan, kv_lens, q_lens, heads, causal):
    """Reads ``plan`` back and checks its invariants against the lengths -> (header, items)."""
    sizes = plan.schedule._plan_sizes
    words = plan.workspace[:plan.schedule.plan_bytes].view(torch.int32).cpu()
    header = words[:8].tolist()
    n_items, n_few, n_many, chunk, n_units = header[:5]
    items = words[8:8 + 8 * sizes.max_items].view(-1, 8)[:n_items].tolist()
    off = 8 + 8 * sizes.max_items
    units = words[off:off + 4 * sizes.max_units].view(-1, 4)[:n_units].tolist()
    off += 4 * sizes.max_units
    few = words[off:off + n_few].tolist()
    many = words[off + sizes.max_rows:off + sizes.max_rows + n_many].tolist()
    bm = sizes.block_m
    assert n_items <= sizes.max_items and chunk >= 4

    want = {}  # (b, row0) -> (rows, visible)
    for b, (kv, q) in enumerate(zip(kv_lens, q_lens)):
        for row0 in range(0, q * heads, bm):
            rows = min(bm, q * heads - row0)
            last = row0 + rows - 1
            visible = min(kv, max(0, kv - q + last // heads + 1)) if causal else kv
            want[(b, row0)] = (rows, visible)
    pieces = {}
    slots = []
    for b, row0, lo, hi, kv_len, slot, unit, _ in items:
        assert (b, row0) in want, f"item for a unit that does not exist: {(b, row0)}"
        assert kv_len == kv_lens[b] and lo % TILE == 0 and lo <= hi
        assert -(-(hi - lo) // TILE) <= chunk or hi - lo <= TILE, f"piece {lo}..{hi} longer than the chunk {chunk}"
        pieces.setdefault((b, row0), []).append((lo, hi, slot, unit))
        if slot >= 0:
            slots.append(slot)
    assert set(pieces) == set(want), "a unit has no item"
    assert len(slots) == len(set(slots)) and all(s < sizes.max_slots for s in slots)
    rows_listed = []
    for key, ps in pieces.items():
        ps.sort()
        rows, visible = want[key]
        assert ps[0][0] == 0 and ps[-1][1] == visible, f"unit {key}: pieces {ps} do not cover [0, {visible})"
        assert all(a[1] == c[0] for a, c in zip(ps, ps[1:])), f"unit {key}: pieces {ps} overlap or leave a gap"
        if len(ps) == 1:
            assert ps[0][2] == -1, f"unit {key}: one piece, yet a partial slot"
            continue
        u = ps[0][3]
        assert all(p[3] == u for p in ps) and 0 <= u < n_units
        ub, urow0, slot0, splits = units[u]
        assert (ub, urow0) == key and splits == len(ps)
        assert sorted(p[2] for p in ps) == list(range(slot0, slot0 + splits))
        rows_listed += [(u, r, splits <= 8) for r in range(rows)]
    listed = [(e >> 6, e & 63, True) for e in few] + [(e >> 6, e & 63, False) for e in many]
    assert sorted(listed) == sorted(rows_listed), "the combine lists miss or repeat a split unit's row"
    if len(want) <= sizes.target_ctas:
        work = sum(max(1, -(-v // TILE)) for _, v in want.values())
        if work >= 4 * sizes.target_ctas:
            assert n_items <= sizes.target_ctas, f"{n_items} items for {sizes.target_ctas} CTA slots"
    return header, items


def run_planned_decode(q, kv_cache, table, seq_lens, *, arch=None, kv_format=None, kv_scale=None, block_size=None):
    """decode with an explicit plan (NaN outputs, 0xFF workspace) -> (out, lse, plan)."""
    schedule = default_schedule(q, kv_cache, table, arch=arch, kv_format=kv_format, block_size=block_size)
    assert schedule.split == "lengths"
    plan = mla_kv.attention_plan(schedule, seq_lens, workspace=poisoned(schedule, q.device))
    out, lse = nan_outputs(q, q.shape[:3])
    mla_kv.decode(q, kv_cache, table, seq_lens, SCALE, out=out, lse=lse, plan=plan, arch=arch,
                  kv_format=kv_format, kv_scale=kv_scale)
    return out, lse, plan


def decode_inputs(lens, heads, s_q, dtype, block_size=64):
    cache, table, seq_lens = random_cache(lens, block_size, dtype)
    q = torch.randn(len(lens), s_q, heads + 2, 576, device="cuda").to(dtype)[:, :, 1:heads + 1]
    ref = reference.decode(q.double(), cache.double(), table, seq_lens, SCALE)
    return q, cache, table, seq_lens, ref


@GPU
@ATTENTION_ARCHS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,s_q", [(16, 1), (16, 4), (128, 1), (20, 3)])
@pytest.mark.parametrize("lens", [[0, 1, 63, 64, 65, 2049, 5000], HUGE_AMONG_TINY], ids=["edges", "huge-among-tiny"])
def test_plan_decode_unequal_lengths(dtype, heads, s_q, lens, arch):
    lens = [max(n, s_q) if n else 0 for n in lens]
    q, cache, table, seq_lens, ref = decode_inputs(lens, heads, s_q, dtype)
    out, lse, plan = run_planned_decode(q, cache, table, seq_lens, arch=arch)
    check_attention(out, lse, *ref, f"planned H={heads} S_q={s_q} paged")
    plan_table(plan, lens, [s_q] * len(lens), heads, True)
    # Block pointers, with the default schedule (the plan made inside the call).
    pool, blocks = block_pointer_copy(cache, table, lens)
    out, lse = nan_outputs(q, q.shape[:3])
    mla_kv.decode(q, blocks, None, seq_lens, SCALE, out=out, lse=lse, arch=arch)
    check_attention(out, lse, *ref, f"default H={heads} S_q={s_q} block pointers")


@GPU
@ATTENTION_ARCHS
@pytest.mark.parametrize("causal", [True, False])
def test_plan_prefill_unequal_packed(causal, arch):
    dtype = torch.float16
    q_lens, kv_lens, heads = [1, 7, 0, 30, 3, 2], [9000, 7, 0, 30, 40, 700], 16
    cache, table, kv = random_cache(kv_lens, 64, dtype)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device="cuda")
    tokens = sum(q_lens) + 3  # padded tokens past cu_q_lens[B] stay untouched
    q = torch.randn(tokens, heads, 576, device="cuda").to(dtype)
    ref = reference.prefill(q.double(), cache.double(), table, cu, kv, SCALE, causal=causal)
    schedule = default_schedule(q, cache, table, packed_batch=len(q_lens), arch=arch)
    plan = mla_kv.attention_plan(schedule, kv, cu_q_lens=cu, causal=causal, workspace=poisoned(schedule, q.device))
    out, lse = nan_outputs(q, q.shape[:2])
    mla_kv.prefill(q, cache, table, cu, kv, SCALE, causal=causal, out=out, lse=lse, plan=plan, arch=arch)
    n = sum(q_lens)
    check_attention(out[:n], lse[:n], ref[0][:n], ref[1][:n], f"prefill causal={causal}", cu_q_lens=cu)
    assert torch.isnan(out[n:]).all() and torch.isnan(lse[n:]).all(), "padded tokens were written"
    plan_table(plan, kv_lens, q_lens, heads, causal)


@GPU
@ATTENTION_ARCHS
def test_plan_graph_replay_follows_new_lengths(arch):
    """One capture (the plan made inside the graph), replayed with longer and shorter lengths."""
    dtype, heads = torch.float16, 16
    top = [6000, 300, 4500, 70, 1]
    cache, table, seq_lens = random_cache(top, 64, dtype)
    q = torch.randn(len(top), 1, heads, 576, device="cuda").to(dtype)
    schedule = default_schedule(q, cache, table, arch=arch)
    ws = poisoned(schedule, q.device)
    out, lse = nan_outputs(q, q.shape[:3])
    lens = seq_lens.clone()

    def step():
        mla_kv.decode(q, cache, table, lens, SCALE, out=out, lse=lse, workspace=ws, schedule=schedule, arch=arch)

    graph = capture_graph(step)
    for new in ([6000, 300, 4500, 70, 1], [5000, 1, 65, 64, 0], [1, 299, 4500, 3, 1]):  # (within the table)
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.decode(q.double(), cache.double(), table, lens, SCALE)
        check_attention(out, lse, *ref, f"replay lens={new}")


@GPU
@ATTENTION_ARCHS
def test_plan_reused_by_every_layer(arch):
    """One plan per step, two layers' caches read through it."""
    dtype, heads, lens = torch.float16, 128, [3000, 17, 64, 9000]
    q, cache, table, seq_lens, _ = decode_inputs(lens, heads, 1, dtype)
    schedule = default_schedule(q, cache, table, arch=arch)
    plan = mla_kv.attention_plan(schedule, seq_lens, workspace=poisoned(schedule, q.device))
    for layer in range(2):
        layer_cache = cache if layer == 0 else (torch.randn_like(cache, dtype=torch.float32) * 0.5).to(dtype)
        out, lse = nan_outputs(q, q.shape[:3])
        mla_kv.decode(q, layer_cache, table, seq_lens, SCALE, out=out, lse=lse, plan=plan, arch=arch)
        ref = reference.decode(q.double(), layer_cache.double(), table, seq_lens, SCALE)
        check_attention(out, lse, *ref, f"layer {layer}")


@GPU
@ATTENTION_ARCHS
@pytest.mark.parametrize("kv_format", ["fp8_ds_mla", "int4"])
@pytest.mark.parametrize("heads", [16, 128])
def test_plan_quantized_unequal_lengths(kv_format, heads, arch):
    dtype, lens, block_size = torch.float16, [0, 65, 7000, 1, 640, 130], 64
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 2
    rows = (torch.randn(num_blocks * block_size, 576, device="cuda") * 0.5).to(dtype)
    cache = torch.zeros(mla_kv.layout.paged_cache_shape(kv_format, num_blocks, block_size, dtype), dtype=torch.uint8,
                        device="cuda")
    mla_kv.write_kv(rows[:, :512], rows[:, 512:], cache, torch.arange(num_blocks * block_size, device="cuda"),
                    kv_format=kv_format)
    perm = torch.randperm(num_blocks, device="cuda").int()
    table = torch.zeros(len(lens), max(need), dtype=torch.int32, device="cuda")
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at:at + n]
        at += n
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lens), 1, heads, 576, device="cuda").to(dtype)
    ref = reference.decode(q.double(), cache, table, seq_lens, SCALE, kv_format=kv_format, scale_dtype=dtype)
    out, lse, plan = run_planned_decode(q, cache, table, seq_lens, arch=arch, kv_format=kv_format,
                                        block_size=block_size)
    check_attention(out, lse, *ref, f"{kv_format} H={heads}", out_tol=8e-3, lse_tol=1e-2)
    plan_table(plan, lens, [1] * len(lens), heads, True)


# ------------------------------------------------------------------------------ CPU checks
def test_plan_arguments_are_checked():
    with pytest.raises(ValueError, match="schedule"):
        mla_kv.attention_plan(mla_kv.AttentionSchedule(1, 64, 0), torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="split"):
        mla_kv.attention_schedule(2, 1, 16, 4096, split="even")
    q = torch.randn(2, 1, 4, 576, dtype=torch.float64)
    cache = torch.randn(4, 16, 576, dtype=torch.float64)
    table = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="plan"):
        mla_kv.decode(q, cache, table, lens, SCALE, plan="step plan")
