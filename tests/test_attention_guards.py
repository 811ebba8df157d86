"""decode / prefill without validation on lengths and block ids the cache does not cover.

What the kernels do (common.cuh kv_limit / find_work, address.cuh block_base, the Sm90 TMA
copy): a query row reads positions < min(its causal limit, num_splits x tokens_per_split); a
position whose block the table does not give (past its width or the sequence's block list, block
id < 0 or >= num_blocks) reads as a zero row, which scores 0 and still counts in the softmax
(mla_kv/attention.h: "rows past the table read as zeros"); positions at or past the schedule's
coverage are not read. Negative lengths see nothing. reference_reading_zeros computes that in float64.

The GPU tests run once per variant (the `arch` fixture) with the default schedule and three forced ones (the table's
width exactly, 3 and 40 splits past the longest sequence), and check every row (check_attention),
that the NaN canaries around the targets are not read (a read shows as NaN in out), that out/lse
are written only inside their windows of larger buffers and that the cache bytes stay the same.
"""
import math

import pytest
import torch

from mla_kv import reference
from mla_kv.layout import LATENT_DIM, ROW_DIM, BlockPool, to_rope_first

from gpu_checks import (ATTENTION_ARCHS, check_attention, default_schedule, poison_unwritten, run_decode,
                        run_prefill, same_bytes, split_schedule)

pytestmark = ATTENTION_ARCHS  # the variants of the tests taking `arch` (the GPU ones)

SCALE = 0.0625
BLOCK_SIZE, WIDTH = 32, 4  # a 4-entry block table covers positions < 128
HUGE = 2 ** 31 - 1
# (kv_len, prefill q_len, paged block-table row, blocks owned behind block pointers); "own": one of
# the sequence's blocks, "past": num_blocks, "unused": an id outside the cache no position maps to.
SEQUENCES = [
    (100, 10, ("own",) * 4, 4),                         # control
    (200, 20, ("own",) * 4, 4),                         # positions 128.. past the table / the blocks
    (90, 5, ("own", -1, "own", "unused"), 1),           # block -1 in the middle / 1 block of 3
    (120, 30, (HUGE, "own", "past", "own"), 0),         # ids past the cache / no block at all
    (2, 4, ("own", "unused", "unused", "unused"), 1),   # more queries than positions
    (50, 0, ("own", "own", "unused", "unused"), 2),     # no queries (prefill)
    (0, 0, ("unused",) * 4, 0),                         # empty
    (-3, 3, ("unused",) * 4, 0),                        # negative length
    (5000, 6, ("own",) * 4, 2),                         # far past the table
]
KV_LENS = [s[0] for s in SEQUENCES]
Q_LENS = [s[1] for s in SEQUENCES]


def reference_reading_zeros(q, cache, table, kv_lens, coverage, *, cu_q_lens=None, causal=True):
    """The kernels' result (module docstring) in float64 from a paged cache [num_blocks, bs, 576]
    and a table that may hold ids outside it: decode q [B, S_q, H, 576], or packed q [T, H, 576]
    with cu_q_lens. Each query row is a sequence of its own in reference.decode, over the cache
    with a block of zeros appended for the positions without a block."""
    num_blocks, block_size = cache.shape[:2]
    lens = kv_lens.cpu().long()
    if cu_q_lens is None:
        batch, s_q = q.shape[:2]
        seq_of = torch.arange(batch).repeat_interleave(s_q)
        token, q_len = torch.arange(s_q).repeat(batch), torch.full((batch,), s_q)
    else:
        cu = cu_q_lens.cpu().long()
        q_len = cu.diff()
        seq_of = torch.repeat_interleave(torch.arange(q_len.shape[0]), q_len)
        token = torch.arange(int(cu[-1])) - cu[seq_of]
    limit = lens[seq_of] - q_len[seq_of] + token + 1 if causal else lens[seq_of]
    visible = limit.clamp(0, coverage)
    zeros = torch.cat([cache.double(), cache.new_zeros(1, block_size, ROW_DIM, dtype=torch.float64)])
    ids = table.cpu().long()
    rows = torch.full((ids.shape[0], max(1, -(-int(visible.max()) // block_size))), num_blocks)
    shown = ids[:, :rows.shape[1]]
    rows[:, :shown.shape[1]] = torch.where((shown >= 0) & (shown < num_blocks), shown, num_blocks)
    queries = q.reshape(-1, 1, *q.shape[-2:]).double()
    out, lse = reference.decode(queries, zeros, rows[seq_of], visible.int(), SCALE)
    return out.reshape(*q.shape[:-1], LATENT_DIM), lse.reshape(q.shape[:-1])


def guard_cache(addressing, dtype):
    """The SEQUENCES' cache: random rows at every position their blocks cover, NaN elsewhere (and
    in canary blocks next to the cache). Returns (storage: every byte to stay unchanged,
    kv_cache, block_table, paged view of the data, its table) for reference_reading_zeros."""
    if addressing == "paged":
        own = sum(row.count("own") for _, _, row, _ in SEQUENCES)
        num_blocks = own + 3  # 3 blocks nobody owns
        storage = torch.full((num_blocks + 2, BLOCK_SIZE, ROW_DIM), float("nan"), dtype=dtype, device="cuda")
        cache = storage[1:-1]  # canary blocks on both sides
        fresh = iter(torch.randperm(num_blocks).tolist())
        named = {"past": num_blocks, "unused": num_blocks + 7}
        table = torch.tensor([[next(fresh) if e == "own" else named.get(e, e) for e in row]
                              for _, _, row, _ in SEQUENCES], dtype=torch.int32, device="cuda")
        cache.copy_(torch.randn(cache.shape, device="cuda") * 0.5)
        poison_unwritten(cache, table, KV_LENS)
        return storage, cache, table, cache, table
    counts = [n for _, _, _, n in SEQUENCES]
    num_blocks = sum(counts) + 3
    ids = torch.randperm(num_blocks)[:sum(counts)]
    cu_blocks = torch.tensor([0] + counts).cumsum(0).int()
    table = torch.full((len(counts), WIDTH), -1, dtype=torch.int32)
    for b, n in enumerate(counts):
        table[b, :n] = ids[cu_blocks[b]:cu_blocks[b + 1]]
    table = table.cuda()
    view = (torch.randn(num_blocks, BLOCK_SIZE, ROW_DIM, device="cuda") * 0.5).to(dtype)
    poison_unwritten(view, table, KV_LENS)
    pool = BlockPool(num_blocks, 2, BLOCK_SIZE, dtype, "cuda")  # layer 0 and unowned blocks: NaN canaries
    pool.storage.fill_(float("nan"))
    pool.storage[:, 1] = to_rope_first(view)
    return pool.storage, pool.cache(1, ids, cu_blocks), None, view, table


def guard_schedules(q, kv_cache, block_table, arch, total_q_tokens, heads, packed_batch=None):
    """The default schedule, one covering exactly the table (positions past it are dropped), and 3
    or 40 splits reaching past the longest sequence (its uncovered positions read as zeros). Splits of
    whole 64-token tiles take the Sm90 kernel's TMA loads on paged caches, the 125-token ones (ending
    inside tiles) its cp.async loads."""
    longest = max(KV_LENS)
    return [default_schedule(q, kv_cache, block_table, packed_batch=packed_batch, arch=arch),
            split_schedule(1, WIDTH * BLOCK_SIZE, total_q_tokens, heads),
            split_schedule(3, -(-longest // (3 * 64)) * 64, total_q_tokens, heads),
            split_schedule(40, -(-longest // 40), total_q_tokens, heads)]


def coverage_of(schedule) -> int:
    """The kv positions a launch reads: a uniform split's num_splits x tokens_per_split, a plan's every
    sequence's whole length (positions past the table read as zeros)."""
    return max(KV_LENS) if schedule.split == "lengths" else schedule.num_splits * schedule.tokens_per_split


def windowed_outputs(rows_shape, dtype):
    """NaN out [*rows_shape, 512] and lse [*rows_shape] inside larger buffers of random bytes (one
    more head on each side, 8 more columns on each side of out): (out, lse, buffers)."""
    out_buffer = torch.randn(*rows_shape[:-1], rows_shape[-1] + 2, LATENT_DIM + 16, device="cuda").to(dtype)
    lse_buffer = torch.randn(*rows_shape[:-1], rows_shape[-1] + 2, device="cuda")
    out, lse = out_buffer[..., 1:-1, 8:-8], lse_buffer[..., 1:-1]
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    return out, lse, (out_buffer, lse_buffer)


def outside_windows(buffers):
    """Copies of the buffers with their out/lse windows zeroed: the bytes that must not change."""
    out_buffer, lse_buffer = (b.clone() for b in buffers)
    out_buffer[..., 1:-1, 8:-8] = 0
    lse_buffer[..., 1:-1] = 0
    return out_buffer, lse_buffer


@pytest.mark.gpu
@pytest.mark.parametrize("addressing", ["paged", "blocks"])
@pytest.mark.parametrize("s_q", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_past_the_block_table(dtype, s_q, addressing, arch):
    heads = 20
    storage, kv_cache, block_table, view, view_table = guard_cache(addressing, dtype)
    storage_before = storage.clone()
    seq_lens = torch.tensor(KV_LENS, dtype=torch.int32, device="cuda")
    q = torch.randn(len(SEQUENCES), s_q, heads, ROW_DIM, device="cuda").to(dtype)
    expected = {}
    for schedule in guard_schedules(q, kv_cache, block_table, arch, len(SEQUENCES) * s_q, heads):
        coverage = coverage_of(schedule)
        if coverage not in expected:
            expected[coverage] = reference_reading_zeros(q, view, view_table, seq_lens, coverage)
        out, lse, buffers = windowed_outputs(q.shape[:3], dtype)
        canaries = outside_windows(buffers)
        run_decode(q, kv_cache, block_table, seq_lens, SCALE, arch=arch, schedule=schedule, out=out, lse=lse)
        what = f"{addressing} S_q={s_q} splits={schedule.num_splits}x{schedule.tokens_per_split}"
        check_attention(out, lse, *expected[coverage], what)
        assert all(same_bytes(a, b) for a, b in zip(outside_windows(buffers), canaries)), \
            f"{what}: out/lse written outside their rows"
    assert same_bytes(storage, storage_before), "the cache changed"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("addressing", ["paged", "blocks"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_past_the_block_table(dtype, addressing, causal, arch):
    """Also 3 padding rows past cu_q_lens[B], which stay untouched."""
    heads, pad = 8, 3
    storage, kv_cache, block_table, view, view_table = guard_cache(addressing, dtype)
    storage_before = storage.clone()
    kv_lens = torch.tensor(KV_LENS, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0] + Q_LENS, device="cuda").cumsum(0).int()
    tokens = sum(Q_LENS)
    q = torch.randn(tokens + pad, heads, ROW_DIM, device="cuda").to(dtype)
    expected = {}
    for schedule in guard_schedules(q, kv_cache, block_table, arch, tokens + pad, heads,
                                    packed_batch=len(SEQUENCES)):
        coverage = coverage_of(schedule)
        if coverage not in expected:
            expected[coverage] = reference_reading_zeros(q[:tokens], view, view_table, kv_lens, coverage,
                                                         cu_q_lens=cu, causal=causal)
        out, lse, buffers = windowed_outputs(q.shape[:2], dtype)
        canaries = outside_windows(buffers)
        run_prefill(q, kv_cache, block_table, cu, kv_lens, SCALE, causal=causal, arch=arch, schedule=schedule,
                    out=out, lse=lse)
        what = f"{addressing} causal={causal} splits={schedule.num_splits}x{schedule.tokens_per_split}"
        check_attention(out[:tokens], lse[:tokens], *expected[coverage], what, cu_q_lens=cu)
        assert out[tokens:].isnan().all() and lse[tokens:].isnan().all(), f"{what}: padding rows written"
        assert all(same_bytes(a, b) for a, b in zip(outside_windows(buffers), canaries)), \
            f"{what}: out/lse written outside their rows"
    assert same_bytes(storage, storage_before), "the cache changed"


# ----------------------------------------------------------------------------------- CPU
def naive_reading_zeros(q_row, cache, table_row, visible):
    """One query row [H, 576] over positions < visible, block by block as the module docstring
    says (zeros where the table gives no block of the cache), by an explicit softmax."""
    num_blocks, block_size = cache.shape[:2]
    keys = []
    for p in range(visible):
        i = p // block_size
        block = int(table_row[i]) if i < table_row.shape[0] else -1
        keys.append(cache[block, p % block_size].double() if 0 <= block < num_blocks
                    else torch.zeros(ROW_DIM, dtype=torch.float64))
    if not keys:
        return torch.zeros(q_row.shape[0], LATENT_DIM, dtype=torch.float64), torch.full((q_row.shape[0],), -math.inf)
    keys = torch.stack(keys)
    scores = SCALE * q_row.double() @ keys.T
    weights = torch.softmax(scores, dim=-1)
    return weights @ keys[:, :LATENT_DIM], torch.logsumexp(scores, dim=-1)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_reading_zeros_matches_a_naive_loop(causal):
    """Cases like the SEQUENCES' on 6 blocks of 8 rows (tables cover 32 positions), coverage 48."""
    kv = torch.tensor([10, 20, 9, 12, 2, 5, 0, -3, 500], dtype=torch.int32)
    q_lens = [1, 2, 1, 3, 4, 0, 0, 3, 6]
    cu = torch.tensor([0] + q_lens).cumsum(0).int()
    cache = torch.randn(6, 8, ROW_DIM, dtype=torch.float64)
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 0, 1], [2, -1, 3, 9], [HUGE, 1, 6, 2], [3, 9, 9, 9],
                          [5, 4, 9, 9], [9] * 4, [9] * 4, [1, 2, 3, 4]], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), 2, ROW_DIM, dtype=torch.float64)
    out, lse = reference_reading_zeros(q, cache, table, kv, 48, cu_q_lens=cu, causal=causal)
    for b in range(len(q_lens)):
        for s in range(q_lens[b]):
            t = int(cu[b]) + s
            limit = int(kv[b]) - q_lens[b] + s + 1 if causal else int(kv[b])
            want_out, want_lse = naive_reading_zeros(q[t], cache, table[b], max(0, min(limit, 48)))
            assert torch.allclose(out[t], want_out, rtol=0, atol=1e-12), f"sequence {b} query {s}"
            assert torch.allclose(lse[t], want_lse.double(), rtol=0, atol=1e-12), f"sequence {b} query {s}"
