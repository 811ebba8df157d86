"""The reference attention and gather ops (mla_kv.reference) against independent float64 loops.

The naive versions below walk every sequence, head and query, find each visible kv position's row
through the block table one position at a time, and do the softmax by hand (max, exp, sum). Caches
use shuffled block ids, blocks shared between sequences, empty and one-token sequences, and lengths
on and around block boundaries.
"""
import math

import pytest
import torch

from mla_kv.layout import BlockPool
from mla_kv.reference import (decode, decode_blocks, gather_kv, gather_kv_blocks, merge_states, prefill,
                              prefill_blocks)

ROW, LAT = 576, 512


# --------------------------------------------------------------------------- naive versions
def naive_row(kv_cache, table_row, position):
    block_size = kv_cache.shape[1]
    return kv_cache[int(table_row[position // block_size]), position % block_size]


def naive_query(q_head, rows, scale):
    """One head of one query over rows [n, 576] (float64) -> (out [512], lse)."""
    if rows.shape[0] == 0:
        return torch.zeros(LAT, dtype=torch.float64), -math.inf
    scores = scale * (rows.double() @ q_head.double())
    peak = scores.max()
    weights = torch.exp(scores - peak)
    total = weights.sum()
    out = (weights[:, None] * rows[:, :LAT].double()).sum(0) / total
    return out, float(peak + torch.log(total))


def naive_attention(q_tokens, kv_cache, table_row, visible_counts, scale):
    """q_tokens [N, H, 576]; query n sees positions 0 .. visible_counts[n] - 1 (none if <= 0)."""
    n, heads, _ = q_tokens.shape
    out = torch.zeros(n, heads, LAT, dtype=torch.float64)
    lse = torch.full((n, heads), -math.inf, dtype=torch.float64)
    longest = max([int(c) for c in visible_counts] + [0])
    rows = kv_cache.new_zeros(longest, ROW)
    for p in range(longest):
        rows[p] = naive_row(kv_cache, table_row, p)
    for i in range(n):
        count = max(int(visible_counts[i]), 0)
        for h in range(heads):
            out[i, h], lse[i, h] = naive_query(q_tokens[i, h], rows[:count], scale)
    return out, lse


def naive_decode(q, kv_cache, block_table, seq_lens, scale):
    b_count, s_q, heads, _ = q.shape
    out = torch.zeros(b_count, s_q, heads, LAT, dtype=torch.float64)
    lse = torch.zeros(b_count, s_q, heads, dtype=torch.float64)
    for b in range(b_count):
        counts = [int(seq_lens[b]) - s_q + i + 1 for i in range(s_q)]
        out[b], lse[b] = naive_attention(q[b], kv_cache, block_table[b], counts, scale)
    return out, lse


def naive_prefill(q, kv_cache, block_table, cu_q_lens, kv_lens, scale, causal):
    out = torch.zeros(q.shape[0], q.shape[1], LAT, dtype=torch.float64)
    lse = torch.zeros(q.shape[0], q.shape[1], dtype=torch.float64)
    for b in range(len(kv_lens)):
        start, end = int(cu_q_lens[b]), int(cu_q_lens[b + 1])
        kv_len, q_len = int(kv_lens[b]), end - start
        counts = [kv_len - q_len + i + 1 if causal else kv_len for i in range(q_len)]
        out[start:end], lse[start:end] = naive_attention(q[start:end], kv_cache, block_table[b], counts,
                                                         scale)
    return out, lse


# ------------------------------------------------------------------------------- test data
def make_table(lens, block_size, num_blocks, *, share=()):
    """A block table over shuffled block ids; for (b, src) in share, sequence b starts with the
    blocks of sequence src (prefix sharing). Unused entries hold -1."""
    needed = [(n + block_size - 1) // block_size for n in lens]
    width = max(max(needed), 1) + 1
    ids = iter(torch.randperm(num_blocks).tolist())
    table = torch.full((len(lens), width), -1, dtype=torch.int32)
    shared_from = dict(share)
    for b, count in enumerate(needed):
        prefix = 0
        if b in shared_from:
            src = shared_from[b]
            prefix = min(count, needed[src]) - 1
            table[b, :prefix] = table[src, :prefix]
        for j in range(prefix, count):
            table[b, j] = next(ids)
    return table


def rel_err(got, want):
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-300))


def assert_lse(got, want, atol):
    """Equal -inf entries (queries that saw no key), the rest within atol."""
    assert torch.equal(got == -math.inf, want == -math.inf), "lse -inf pattern differs"
    finite = want != -math.inf
    assert torch.allclose(got.double()[finite], want[finite], rtol=0, atol=atol)


# ------------------------------------------------------------------------------------ decode
@pytest.mark.parametrize("heads", [5, 20])
@pytest.mark.parametrize("s_q", [1, 2, 3, 4])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_naive_loop(heads, s_q, block_size):
    lens = [0, 1, s_q - 1, 2 * block_size, block_size, block_size + 1, 77]
    table = make_table(lens, block_size, num_blocks=40, share=[(5, 3), (6, 3)])
    kv_cache = torch.randn(40, block_size, ROW, dtype=torch.float64)
    q = torch.randn(len(lens), s_q, heads, ROW, dtype=torch.float64)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = 0.05 + torch.rand(()).item() / 10

    out, lse = decode(q, kv_cache, table, seq_lens, scale)
    want_out, want_lse = naive_decode(q, kv_cache, table, seq_lens, scale)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert out.shape == (len(lens), s_q, heads, LAT) and lse.shape == (len(lens), s_q, heads)
    assert not out.isnan().any() and not lse.isnan().any()
    assert rel_err(out, want_out) < 1e-12
    assert_lse(lse, want_lse, 1e-10)
    # seq_len 0: no key at all; seq_len < S_q: the first queries see none either.
    assert (out[0] == 0).all() and (lse[0] == -math.inf).all()
    if s_q > 1:
        assert (lse[2, 0] == -math.inf).all() and torch.isfinite(lse[2, -1]).all()


def test_decode_strided_q_and_low_precision_dtypes():
    lens = [5, 40, 16]
    table = make_table(lens, 16, num_blocks=12)
    cache64 = torch.randn(12, 16, ROW, dtype=torch.float64)
    wide = torch.randn(3, 2, 7, ROW + 8, dtype=torch.float64)
    q64 = wide[:, :, 1:6, 8:]  # strides on B, S_q and H that are not those of a packed tensor
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    for dtype, tol in [(torch.float32, 1e-6), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)]:
        q, cache = q64.to(dtype), cache64.to(dtype)
        out, lse = decode(q, cache, table, seq_lens, 0.06)
        want_out, want_lse = naive_decode(q.double(), cache.double(), table, seq_lens, 0.06)
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert rel_err(out, want_out) < tol
        assert_lse(lse, want_lse, 1e-4)


def test_decode_writes_into_given_outputs():
    table = make_table([9, 20], 8, num_blocks=8)
    cache = torch.randn(8, 8, ROW)
    q = torch.randn(2, 2, 3, ROW)
    seq_lens = torch.tensor([9, 20], dtype=torch.int32)
    out = torch.full((2, 2, 3, LAT), float("nan"))
    lse = torch.full((2, 2, 3), float("nan"))
    got_out, got_lse = decode(q, cache, table, seq_lens, 0.1, out=out, lse=lse)
    assert got_out is out and got_lse is lse
    want_out, want_lse = decode(q, cache, table, seq_lens, 0.1)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_decode_rejects_bad_input():
    table = make_table([9, 20], 8, num_blocks=8)
    cache = torch.randn(8, 8, ROW)
    q = torch.randn(2, 1, 3, ROW)
    lens = torch.tensor([9, 20], dtype=torch.int32)
    with pytest.raises(ValueError, match="q"):
        decode(q[..., :512], cache, table, lens, 0.1)
    with pytest.raises(ValueError, match="block_table"):
        decode(q, cache, table[:, :2], torch.tensor([9, 40], dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="block_table"):
        decode(q, cache, table + 100, lens, 0.1)
    with pytest.raises(TypeError, match="block_table"):
        decode(q, cache, table.float(), lens, 0.1)
    with pytest.raises(ValueError, match="seq_lens"):
        decode(q, cache, table, torch.tensor([9, 20, 3], dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="softmax_scale"):
        decode(q, cache, table, lens, 0.0)
    with pytest.raises(TypeError, match="out"):
        decode(q, cache, table, lens, 0.1, out=torch.zeros(2, 1, 3, LAT, dtype=torch.float64))
    with pytest.raises(ValueError, match="lse"):
        decode(q, cache, table, lens, 0.1, lse=torch.zeros(2, 3))


# ----------------------------------------------------------------------------------- prefill
PREFILL_CASES = [  # (q_len, kv_len) per sequence
    [(37, 37), (1, 1), (16, 16)],               # whole prompts, one of exactly one block
    [(3, 40), (0, 10), (17, 33), (1, 64)],       # extends over cached prefixes, an empty q
    [(5, 2), (8, 8), (0, 0)],                    # more queries than keys: the first see nothing
]


@pytest.mark.parametrize("case", PREFILL_CASES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [5, 20])
def test_prefill_matches_naive_loop(case, causal, heads):
    q_lens, kv_lens = [c[0] for c in case], [c[1] for c in case]
    block_size = 16
    table = make_table(kv_lens, block_size, num_blocks=30, share=[(1, 0)])
    cache = torch.randn(30, block_size, ROW, dtype=torch.float64)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), heads, ROW, dtype=torch.float64)
    kv = torch.tensor(kv_lens, dtype=torch.int32)

    out, lse = prefill(q, cache, table, cu, kv, 0.07, causal=causal)
    want_out, want_lse = naive_prefill(q, cache, table, cu, kv, 0.07, causal)
    assert out.shape == (q.shape[0], heads, LAT) and lse.shape == (q.shape[0], heads)
    assert not out.isnan().any()
    assert rel_err(out, want_out) < 1e-12
    assert_lse(lse, want_lse, 1e-10)


def test_prefill_with_equal_q_lens_is_decode():
    lens = [4, 19, 33]
    table = make_table(lens, 16, num_blocks=10)
    cache = torch.randn(10, 16, ROW, dtype=torch.float64)
    q = torch.randn(3, 3, 4, ROW, dtype=torch.float64)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu = torch.arange(0, 10, 3, dtype=torch.int32)
    out_d, lse_d = decode(q, cache, table, seq_lens, 0.1)
    out_p, lse_p = prefill(q.flatten(0, 1), cache, table, cu, seq_lens, 0.1)
    assert torch.allclose(out_p, out_d.flatten(0, 1), rtol=0, atol=1e-13)
    assert torch.allclose(lse_p, lse_d.flatten(0, 1), rtol=0, atol=1e-13)


def test_prefill_rejects_bad_input():
    table = make_table([9, 20], 8, num_blocks=8)
    cache = torch.randn(8, 8, ROW)
    q = torch.randn(6, 3, ROW)
    kv = torch.tensor([9, 20], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_q_lens"):  # ends past q's 6 tokens (ending before is padding)
        prefill(q, cache, table, torch.tensor([0, 4, 7], dtype=torch.int32), kv, 0.1)
    with pytest.raises(ValueError, match="cu_q_lens"):
        prefill(q, cache, table, torch.tensor([0, 4, 2, 6], dtype=torch.int32), kv, 0.1)
    with pytest.raises(ValueError, match="kv_lens"):
        prefill(q, cache, table, torch.tensor([0, 6], dtype=torch.int32), kv, 0.1)


# ------------------------------------------------------------------------------ merge_states
def test_merge_of_split_kv_equals_whole():
    block_size, heads = 16, 5
    lens = [70, 33, 48]
    table = make_table(lens, block_size, num_blocks=20)
    cache = torch.randn(20, block_size, ROW, dtype=torch.float64)
    q = torch.randn(3, 1, heads, ROW, dtype=torch.float64)
    whole_out, whole_lse = decode(q, cache, table, torch.tensor(lens, dtype=torch.int32), 0.08)
    for split_blocks in range(0, 4):  # 0: an empty first part
        split = split_blocks * block_size
        first = torch.tensor([min(n, split) for n in lens], dtype=torch.int32)
        rest = torch.tensor([max(n - split, 0) for n in lens], dtype=torch.int32)
        out_a, lse_a = decode(q, cache, table, first, 0.08)
        out_b, lse_b = decode(q, cache, table[:, split_blocks:], rest, 0.08)
        out, lse = merge_states(out_a, lse_a, out_b, lse_b)
        assert rel_err(out, whole_out) < 1e-13
        assert torch.allclose(lse, whole_lse, rtol=0, atol=1e-12)


def test_merge_of_empty_sides():
    out_a, out_b = torch.randn(4, 3, LAT), torch.randn(4, 3, LAT)
    lse_a, lse_b = torch.randn(4, 3), torch.randn(4, 3)
    lse_a[0] = -math.inf
    out_a[0] = float("nan")  # an empty side's output is not read
    lse_b[1] = -math.inf
    lse_a[2] = lse_b[2] = -math.inf
    out, lse = merge_states(out_a, lse_a, out_b, lse_b)
    assert not out.isnan().any() and out.dtype == torch.float32 and lse.dtype == torch.float32
    assert torch.allclose(out[0], out_b[0]) and torch.equal(lse[0], lse_b[0])
    assert torch.allclose(out[1], out_a[1]) and torch.equal(lse[1], lse_a[1])
    assert (out[2] == 0).all() and (lse[2] == -math.inf).all()
    both = slice(3, 4)
    wa = torch.exp(lse_a[both] - lse[both])[..., None]
    wb = torch.exp(lse_b[both] - lse[both])[..., None]
    assert torch.allclose(out[both], wa * out_a[both] + wb * out_b[both], atol=1e-6)
    assert torch.allclose(torch.exp(lse[both]), torch.exp(lse_a[both]) + torch.exp(lse_b[both]))


def test_merge_rejects_mismatched_shapes():
    out, lse = torch.randn(2, 3, LAT), torch.randn(2, 3)
    with pytest.raises(ValueError, match="out_b"):
        merge_states(out, lse, out[:1], lse[:1])
    with pytest.raises(ValueError, match="lse_b"):
        merge_states(out, lse, out, lse[:, :2])


# --------------------------------------------------------------------------------- gather_kv
def test_gather_kv_matches_naive_loop():
    block_size = 16
    lens = [0, 1, 16, 17, 50]
    starts_list = [3, 0, 16, 5, 9]
    table = make_table([s + n for s, n in zip(starts_list, lens)], block_size, num_blocks=20,
                       share=[(4, 3)])
    cache = torch.randn(20, block_size, ROW, dtype=torch.float16)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    starts = torch.tensor(starts_list, dtype=torch.int32)

    got = gather_kv(cache, table, cu, starts=starts)
    want = torch.stack([naive_row(cache, table[b], starts_list[b] + i)
                        for b in range(len(lens)) for i in range(lens[b])])
    assert got.dtype == torch.float16 and torch.equal(got, want)

    from_zero = gather_kv(cache, table, cu)
    want0 = torch.stack([naive_row(cache, table[b], i) for b in range(len(lens)) for i in range(lens[b])])
    assert torch.equal(from_zero, want0)

    out = torch.empty_like(want)
    assert gather_kv(cache, table, cu, starts=starts, out=out) is out and torch.equal(out, want)
    with pytest.raises(ValueError, match="block_table"):
        gather_kv(cache, table[:, :1], cu, starts=starts)


# ------------------------------------------------------------------------ block-pointer forms
def pool_with_sequences(lens, block_seq_len, rope_first, num_layers=3):
    """A pool with random rows and per-sequence shuffled block lists (the second shares the first's
    leading block)."""
    pool = BlockPool(24, num_layers, block_seq_len, torch.float64, rope_first=rope_first)
    pool.storage.copy_(torch.randn(pool.storage.shape, dtype=torch.float64))
    order = iter(torch.randperm(24).tolist())
    lists = []
    for b, n in enumerate(lens):
        count = (n + block_seq_len - 1) // block_seq_len
        blocks = [next(order) for _ in range(count)]
        if b == 1 and count and lists[0]:
            blocks[0] = lists[0][0]
        lists.append(blocks)
    block_ids = torch.tensor([i for blocks in lists for i in blocks], dtype=torch.int32)
    cu = torch.tensor([0] + torch.tensor([len(x) for x in lists]).cumsum(0).tolist(), dtype=torch.int32)
    return pool, lists, block_ids, cu


def latent_first_rows(pool, layer, blocks, count):
    """Rows 0..count-1 of a block list, read one at a time and reordered to [c_kv | k_pe] by hand."""
    rows = []
    for p in range(count):
        raw = pool.storage[blocks[p // pool.block_seq_len], layer, p % pool.block_seq_len]
        rows.append(torch.cat([raw[64:], raw[:64]]) if pool.rope_first else raw)
    return torch.stack(rows) if rows else torch.zeros(0, ROW, dtype=torch.float64)


@pytest.mark.parametrize("rope_first", [True, False])
def test_block_pointer_forms_match_naive(rope_first):
    lens = [40, 65, 0, 1]
    layer, heads, s_q = 1, 5, 2
    pool, lists, block_ids, cu_blocks = pool_with_sequences(lens, 16, rope_first)
    seq_lens = torch.tensor(lens, dtype=torch.int32)

    q = torch.randn(len(lens), s_q, heads, ROW, dtype=torch.float64)
    out, lse = decode_blocks(q, pool, layer, block_ids, cu_blocks, seq_lens, 0.09)
    for b, n in enumerate(lens):
        rows = latent_first_rows(pool, layer, lists[b], n)
        for i in range(s_q):
            for h in range(heads):
                want_out, want_lse = naive_query(q[b, i, h], rows[:max(n - s_q + i + 1, 0)], 0.09)
                assert torch.allclose(out[b, i, h], want_out, rtol=0, atol=1e-12)
                assert_lse(lse[b, i, h], torch.tensor(want_lse, dtype=torch.float64), 1e-10)

    q_lens = [7, 65, 0, 1]
    cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    qp = torch.randn(int(cu_q[-1]), heads, ROW, dtype=torch.float64)
    out_p, _ = prefill_blocks(qp, pool, layer, block_ids, cu_blocks, cu_q, seq_lens, 0.09)
    for b, n in enumerate(lens):
        rows = latent_first_rows(pool, layer, lists[b], n)
        for i in range(q_lens[b]):
            t = int(cu_q[b]) + i
            for h in range(heads):
                want_out, _ = naive_query(qp[t, h], rows[:n - q_lens[b] + i + 1], 0.09)
                assert torch.allclose(out_p[t, h], want_out, rtol=0, atol=1e-12)

    counts, starts = [30, 20, 0, 1], [10, 45, 0, 0]
    cu_kv = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    got = gather_kv_blocks(pool, layer, block_ids, cu_blocks, cu_kv,
                           starts=torch.tensor(starts, dtype=torch.int32))
    want = torch.cat([latent_first_rows(pool, layer, lists[b], lens[b])[starts[b]:starts[b] + counts[b]]
                      for b in range(len(lens))])
    assert torch.equal(got, want)

    with pytest.raises(ValueError, match="seq_lens"):
        decode_blocks(q, pool, layer, block_ids, cu_blocks, seq_lens + 16, 0.09)
    with pytest.raises(ValueError, match="layer"):
        decode_blocks(q, pool, 3, block_ids, cu_blocks, seq_lens, 0.09)
