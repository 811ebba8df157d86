"""mla_kv.parallel on the CPU: context parallelism (positions, slots, write, decode, prefill, merge) and
the head-parallel recipe, against single-process attention through the reference ops.

The cp cases run twice: all ranks in this process merged by merge_partial_states, and as 2 and 4
gloo processes merged by cp_merge (tests/parallel_worker.py holds the shared scenarios).
"""
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

import mla_kv
import parallel_worker as pw
from mla_kv import parallel, reference


# ------------------------------------------------------------------------ positions and slots
def test_local_lens_hand_examples():
    lens = torch.tensor([0, 1, 5, 7], dtype=torch.int32)
    assert parallel.cp_local_lens(lens, 2, 0).tolist() == [0, 1, 3, 4]
    assert parallel.cp_local_lens(lens, 2, 1).tolist() == [0, 0, 2, 3]
    assert [parallel.cp_local_lens(lens, 4, r).tolist() for r in range(4)] == [
        [0, 1, 2, 2], [0, 0, 1, 2], [0, 0, 1, 2], [0, 0, 1, 1]]
    assert parallel.cp_local_lens(lens, 1, 0).tolist() == lens.tolist()
    assert parallel.cp_local_lens(lens, 2, 0).dtype == torch.int32


def test_local_lens_count_positions():
    lens = torch.randint(0, 300, (50,))
    for cp in (2, 3, 5, 8):
        counts = torch.stack([parallel.cp_local_lens(lens, cp, r) for r in range(cp)])
        assert torch.equal(counts.sum(0), lens.int())
        for n, row in zip(lens.tolist(), counts.t().tolist()):
            assert row == [sum(1 for t in range(n) if t % cp == r) for r in range(cp)]


def test_local_positions_hand_example():
    # Sequence 0: history 3, new tokens at positions 3, 4; sequence 1: no history, positions 0, 1, 2;
    # row 5 is padding.
    cu, hist = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([3, 0], dtype=torch.int32)
    one = parallel.cp_local_positions(cu, hist, 2, 1, num_tokens=6)
    assert one.seq_ids.tolist() == [0, 0, 1, 1, 1, 2]
    assert one.positions.tolist() == [3, 4, 0, 1, 2, 0]
    assert one.owned.tolist() == [True, False, False, True, False, False]
    assert one.local_positions.tolist() == [1, 2, 0, 0, 1, 0]
    zero = parallel.cp_local_positions(cu, hist, 2, 0)  # T read from cu_q_lens: no padding row
    assert zero.owned.tolist() == [False, True, True, False, True]

    # Block size 2. Rank 1 owns position 3 of seq 0 (local 1 -> block 5, offset 1) and position 1
    # of seq 1 (local 0 -> block 2).
    table1 = torch.tensor([[5, 7], [2, 9]], dtype=torch.int32)
    assert parallel.cp_slot_mapping(one, table1, 2).tolist() == [11, -1, -1, 4, -1, -1]
    # Rank 0: position 4 of seq 0 (local 2 -> block 3), positions 0 and 2 of seq 1 (local 0, 1 -> block 4).
    table0 = torch.tensor([[1, 3], [4, 6]], dtype=torch.int32)
    assert parallel.cp_slot_mapping(zero, table0, 2).tolist() == [-1, 6, 8, -1, 9]
    # A local position past the table is skipped, not written elsewhere.
    assert parallel.cp_slot_mapping(zero, table0[:, :1].contiguous(), 2).tolist() == [-1, -1, 8, -1, 9]


def test_every_token_has_one_owner_and_distinct_slots():
    batch = 5
    hist = torch.randint(0, 40, (batch,), dtype=torch.int32)
    new = torch.randint(0, 9, (batch,), dtype=torch.int32)
    cu = torch.nn.functional.pad(new.cumsum(0), (1, 0)).int()
    tokens = int(cu[-1]) + 3  # three padding rows
    for cp in (1, 2, 3, 4):
        owners = torch.zeros(tokens, dtype=torch.long)
        for rank in range(cp):
            t = parallel.cp_local_positions(cu, hist, cp, rank, num_tokens=tokens)
            owners += t.owned.long()
            assert torch.equal(t.positions[t.owned] % cp, torch.full_like(t.positions[t.owned], rank))
            width = 20
            table = torch.randperm(batch * width).int().view(batch, width)
            slots = parallel.cp_slot_mapping(t, table, 4)
            kept = slots[slots >= 0]
            assert torch.equal(slots >= 0, t.owned) and kept.unique().numel() == kept.numel()
        assert owners.tolist() == [1] * int(cu[-1]) + [0] * 3


@pytest.mark.parametrize("cp", [2, 3])
def test_rank_caches_hold_the_global_rows(cp):
    batch = pw.make_batch(int(torch.randint(0, 1 << 30, ())), [0, 9, 22], [5, 1, 7])
    global_cache, global_table, _ = pw.write_global(batch)
    lens = pw.total_lens(batch)
    global_rows = reference.gather_kv(global_cache, global_table, torch.nn.functional.pad(lens.cumsum(0), (1, 0)).int())
    for rank in range(cp):
        cache, table, _ = pw.write_rank(batch, cp, rank, seed=3)
        local = parallel.cp_local_lens(lens, cp, rank)
        rows = reference.gather_kv(cache, table, torch.nn.functional.pad(local.cumsum(0), (1, 0)).int())
        start, local_start = 0, 0
        for n, m in zip(lens.tolist(), local.tolist()):
            torch.testing.assert_close(rows[local_start:local_start + m], global_rows[start + rank:start + n:cp],
                                       rtol=0, atol=0)
            start, local_start = start + n, local_start + m


# -------------------------------------------------------------------------- cp attention
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_cp_attention_in_one_process(cp):
    seed = int(torch.randint(0, 1 << 30, ()))
    for name, batch, kind in pw.scenarios(seed):
        parts = [pw.rank_case(batch, kind, cp, rank, seed) for rank in range(cp)]
        truth_out, truth_lse, truth_q = pw.truth_case(batch, kind)
        for _, _, q in parts:
            assert torch.equal(q, truth_q), f"cp {cp}, {name}: q rotated differently from the single-process write"
        out, lse = parallel.merge_partial_states(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
        pw.check_merged(out, lse, truth_out, truth_lse, f"cp {cp}, {name}")


def test_cp_decode_rank_partial_is_attention_over_its_tokens():
    """One rank's partial result alone: the reference over only its positions <= each query's."""
    cp, rank, s_q = 3, 1, 3
    batch = pw.make_batch(11, [0, 4, 17], [s_q] * 3)
    out, lse, q = pw.rank_decode(batch, cp, rank, seed=2)
    cache, table, _ = pw.write_global(batch)
    for b, total in enumerate(pw.total_lens(batch).tolist()):
        for i in range(s_q):
            p = total - s_q + i
            keys = [t for t in range(p + 1) if t % cp == rank]
            rows = cache[table[b, torch.tensor(keys, dtype=torch.long) // pw.BLOCK_SIZE].long(),
                         torch.tensor(keys, dtype=torch.long) % pw.BLOCK_SIZE].double()
            scores = torch.einsum("hd,ld->hl", q.view(3, s_q, pw.HEADS, 576)[b, i].double(), rows) * pw.SCALE
            if not keys:
                assert torch.isinf(lse[b, i]).all() and (out[b, i] == 0).all()
                continue
            torch.testing.assert_close(lse[b, i].double(), torch.logsumexp(scores, -1), **pw.TOL)
            torch.testing.assert_close(out[b, i].double(), torch.softmax(scores, -1) @ rows[:, :512], **pw.TOL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4])
def test_cp_over_gloo_processes(world, monkeypatch):
    package_root = os.path.dirname(os.path.dirname(mla_kv.__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    seed = int(torch.randint(0, 1 << 30, ()))
    mp.spawn(pw.worker, args=(world, _free_port(), seed, mla_kv.__file__), nprocs=world, join=True)


def test_merge_partial_states_edges():
    outs = torch.randn(3, 2, 5, 512)
    lses = torch.randn(3, 2, 5)
    lses[1, 0] = float("-inf")  # rank 1 saw nothing for these rows
    out, lse = parallel.merge_partial_states(outs, lses)
    weights = torch.softmax(lses.double(), dim=0)
    torch.testing.assert_close(out.double(), (weights[..., None] * outs.double()).sum(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), torch.logsumexp(lses.double(), 0), rtol=1e-6, atol=1e-6)
    given_out, given_lse = torch.empty(2, 5, 512), torch.empty(2, 5)
    one = parallel.merge_partial_states(outs[:1], lses[:1], out=given_out, lse=given_lse)
    assert one[0] is given_out and torch.equal(given_out, outs[0]) and torch.equal(given_lse, lses[0])


# ------------------------------------------------------------------------- head parallelism
NOPE, V, Q_LORA, HIDDEN, TP_HEADS = 16, 8, 24, 32, 4


def mla_attention_heads(x, q_b, kv_b, heads, positions, cos_sin, cache, table, seq_lens):
    """MLA attention of the heads whose weight rows are given -> per-head output [B, S, heads, v]."""
    batch, s_q, _ = x.shape
    q = (x @ q_b.t()).view(batch, s_q, heads, NOPE + 64)
    w_uk, w_uv = mla_kv.split_kv_b_proj(kv_b, heads, NOPE, V)
    q_lat = mla_kv.absorb_q(q[..., :NOPE], w_uk)
    q_pe = reference.apply_rope(q[..., NOPE:].flatten(0, 1), positions.flatten(), cos_sin).view(batch, s_q, heads, 64)
    o_lat, _ = mla_kv.decode(torch.cat([q_lat, q_pe], -1), cache, table, seq_lens, pw.SCALE)
    return mla_kv.project_out(o_lat, w_uv)


@pytest.mark.parametrize("tp", [2, 4])
def test_head_parallel_recipe(tp):
    """Each rank: its heads' rows of q_b_proj / kv_b_proj and columns of o_proj, the whole latent
    cache and the same block table. Concatenated heads and summed o_proj partials equal one rank."""
    f32 = dict(dtype=torch.float32)  # mla_kv.decode's CPU path returns float32 lse (float64 q fails there)
    q_b = torch.randn(TP_HEADS * (NOPE + 64), Q_LORA, **f32) / Q_LORA ** 0.5
    kv_b = torch.randn(TP_HEADS * (NOPE + V), 512, **f32) / NOPE ** 0.5
    o_proj = torch.randn(HIDDEN, TP_HEADS * V, **f32)
    batch, s_q = 3, 2
    seq_lens = torch.randint(s_q, 40, (batch,), dtype=torch.int32)
    table = torch.randperm(batch * 10).int().view(batch, 10)
    cache = torch.randn(batch * 10, pw.BLOCK_SIZE, 576, **f32)
    x = torch.randn(batch, s_q, Q_LORA, **f32)
    positions = seq_lens[:, None].long() - s_q + torch.arange(s_q)
    cos_sin = mla_kv.rope.cos_sin_cache(64, 64, theta=1e4, dtype=torch.float32)
    args = (positions, cos_sin, cache, table, seq_lens)

    whole = mla_attention_heads(x, q_b, kv_b, TP_HEADS, *args)
    per_rank = [mla_attention_heads(x, parallel.shard_heads(q_b, TP_HEADS, tp, r),
                                    parallel.shard_heads(kv_b, TP_HEADS, tp, r), TP_HEADS // tp, *args)
                for r in range(tp)]
    torch.testing.assert_close(torch.cat(per_rank, dim=2), whole, rtol=1e-5, atol=1e-5)
    hidden = sum(o.flatten(-2) @ parallel.shard_heads(o_proj, TP_HEADS, tp, r, dim=1).t()
                 for r, o in enumerate(per_rank))
    torch.testing.assert_close(hidden, whole.flatten(-2) @ o_proj.t(), rtol=1e-5, atol=1e-4)


# --------------------------------------------------------------------------- bad arguments
def test_bad_arguments_name_the_argument():
    cu, hist = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    table = torch.zeros(1, 2, dtype=torch.int32)
    cases = [
        (lambda: parallel.cp_local_lens(torch.ones(2, dtype=torch.int32), 2, 2), ValueError, "rank"),
        (lambda: parallel.cp_local_lens(torch.ones(2, dtype=torch.int32), 0, 0), ValueError, "cp"),
        (lambda: parallel.cp_local_lens(torch.ones(2), 2, 0), TypeError, "lens"),
        (lambda: parallel.cp_local_positions(cu, hist, True, 0), TypeError, "cp"),
        (lambda: parallel.cp_local_positions(cu.long(), hist, 2, 0), TypeError, "cu_q_lens"),
        (lambda: parallel.cp_local_positions(cu, torch.ones(2, dtype=torch.int32), 2, 0), ValueError, "history_lens"),
        (lambda: parallel.cp_slot_mapping(parallel.cp_local_positions(cu, hist, 2, 0), table.long(), 4),
         TypeError, "block_table"),
        (lambda: parallel.cp_slot_mapping(parallel.cp_local_positions(cu, hist, 2, 0), table, 0),
         ValueError, "block_size"),
        (lambda: parallel.cp_slot_mapping((1, 2), table, 4), TypeError, "tokens"),
        (lambda: parallel.shard_heads(torch.zeros(20, 3), 20, 3, 0), ValueError, "tp"),
        (lambda: parallel.shard_heads(torch.zeros(21, 3), 20, 4, 0), ValueError, "weight"),
        (lambda: parallel.shard_heads(torch.zeros(20, 3), 20, 4, 0, dim=2), ValueError, "dim"),
        (lambda: parallel.cp_decode(torch.zeros(1, 1, 1, 576), torch.zeros(1, 4, 576), table,
                                    torch.ones(1, dtype=torch.int64), 0.1, 2, 0), TypeError, "seq_lens"),
        (lambda: parallel.cp_prefill(torch.zeros(2, 1, 576), torch.zeros(1, 4, 576), table, cu,
                                     torch.ones(2, dtype=torch.int32), 0.1, 2, 0), ValueError, "kv_lens"),
        (lambda: parallel.merge_partial_states(torch.zeros(2, 3, 8), torch.zeros(2, 4)), ValueError, "lses"),
    ]
    for call, error, name in cases:
        with pytest.raises(error, match=name):
            call()
