"""The expanded-route prefill's spec equals the absorbed route (absorb q by W_UK, absorbed prefill,
project out by W_UV) in float64, at DeepSeek's and GLM-4.7-Flash's head dims, over cached prefixes; and the
spec of the expanded form's own attention, reference.expanded_attention, equals a dense masked softmax written
out query by query, aligns its causal mask bottom-right, and equals prefill_expanded over the up-projected
cache rows."""
import math

import pytest
import torch

from mla_kv import reference
from mla_kv.weights import absorb_q, project_out


@pytest.mark.parametrize("d_nope,d_v", [(128, 128), (192, 256)])
@pytest.mark.parametrize("causal", [True, False])
def test_expanded_equals_absorbed(d_nope, d_v, causal):
    gen = torch.Generator().manual_seed(d_nope + d_v + causal)
    heads, block_size = 5, 16
    kv_lens, q_lens = [40, 7, 0, 33], [40, 3, 0, 1]       # a whole prompt, extends, empty, one token
    num_blocks = sum(-(-n // block_size) for n in kv_lens) + 2
    cache = torch.randn(num_blocks, block_size, 576, generator=gen, dtype=torch.float64)
    perm = torch.randperm(num_blocks, generator=gen).int()
    table = torch.full((4, 3), num_blocks + 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(kv_lens):
        need = -(-n // block_size)
        table[b, :need] = perm[used:used + need]
        used += need
    cu = torch.tensor([0] + q_lens).cumsum(0).int()
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    q = torch.randn(int(cu[-1]) + 2, heads, d_nope + 64, generator=gen, dtype=torch.float64)  # 2 padded rows
    w_uk = torch.randn(heads, d_nope, 512, generator=gen, dtype=torch.float64) / 20
    w_uv = torch.randn(heads, d_v, 512, generator=gen, dtype=torch.float64) / 20
    scale = 1 / (d_nope + 64) ** 0.5

    out, lse = reference.prefill_expanded(q, cache, table, cu, lens, w_uk, w_uv, scale, causal=causal)
    q_abs = torch.cat([absorb_q(q[..., :d_nope], w_uk), q[..., d_nope:]], -1)
    o_lat, lse_abs = reference.prefill(q_abs, cache, table, cu, lens, scale, causal=causal)
    want = project_out(o_lat, w_uv)
    assert out.shape == want.shape == (q.shape[0], heads, d_v)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, lse_abs, rtol=1e-12, atol=1e-12)
    assert bool((out[-2:] == 0).all()) and bool((lse[-2:] == float("-inf")).all())


def test_expanded_checks_its_weights():
    q = torch.zeros(2, 4, 192)
    cache = torch.zeros(2, 16, 576)
    table = torch.zeros(1, 1, dtype=torch.int32)
    cu, lens = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    w = torch.zeros(4, 128, 512)
    with pytest.raises(ValueError, match="w_uk"):
        reference.prefill_expanded(q, cache, table, cu, lens, torch.zeros(3, 128, 512), w, 0.1)
    with pytest.raises(ValueError, match="q: the last dim"):
        reference.prefill_expanded(q[..., :100], cache, table, cu, lens, w, w, 0.1)
    with pytest.raises(ValueError, match="w_uv"):
        reference.prefill_expanded(q, cache, table, cu, lens, w, torch.zeros(4, 128, 511), 0.1)



# ------------------------------------------------------------------------------ expanded_attention
# (q_len, k_len) per sequence: whole prompts, extends (q_len < k_len), q_len > k_len (under the causal mask
# the first q_len - k_len queries see no key), a sequence without queries, one without keys, an empty one.
SEQS = [(5, 5), (3, 9), (9, 4), (0, 6), (1, 1), (4, 0), (1, 6), (0, 0), (7, 1)]


def packed(seqs, heads, d_qk, d_v, *, padded_rows=2, spare_keys=3, q_std=2.0, dtype=torch.float64, gen=None):
    """(q, k, v, cu_q_lens, cu_k_lens) of the sequences packed in order, with padded q rows past cu_q_lens[B]
    and spare k / v rows past cu_k_lens[B], all NaN: the spec must read none of them."""
    q_lens, k_lens = [n for n, _ in seqs], [m for _, m in seqs]
    used_q, used_k = sum(q_lens), sum(k_lens)
    q = torch.randn(used_q + padded_rows, heads, d_qk, generator=gen, dtype=torch.float64) * q_std
    k = torch.randn(used_k + spare_keys, heads, d_qk, generator=gen, dtype=torch.float64)
    v = torch.randn(used_k + spare_keys, heads, d_v, generator=gen, dtype=torch.float64)
    q[used_q:], k[used_k:], v[used_k:] = math.nan, math.nan, math.nan
    cu_q = torch.tensor([0] + q_lens).cumsum(0).int()
    cu_k = torch.tensor([0] + k_lens).cumsum(0).int()
    return q.to(dtype), k.to(dtype), v.to(dtype), cu_q, cu_k


def dense_attention(q, k, v, scale, causal):
    """One sequence, query by query and head by head, with the visible keys listed explicitly: the spec
    written independently of reference.expanded_attention (float64)."""
    n, heads, _ = q.shape
    m = k.shape[0]
    out = torch.zeros(n, heads, v.shape[-1], dtype=torch.float64)
    lse = torch.full((n, heads), -math.inf, dtype=torch.float64)
    for i in range(n):
        keys = [j for j in range(m) if not causal or j <= m - n + i]
        for h in range(heads) if keys else ():
            scores = torch.stack([scale * torch.dot(q[i, h], k[j, h]) for j in keys])
            top = scores.max()
            e = torch.exp(scores - top)
            lse[i, h] = top + torch.log(e.sum())
            out[i, h] = sum(w * v[j, h] for w, j in zip(e / e.sum(), keys))
    return out, lse


@pytest.mark.parametrize("causal", [True, False])
def test_expanded_attention_equals_dense_masked_softmax(causal):
    gen = torch.Generator().manual_seed(7 + causal)
    q, k, v, cu_q, cu_k = packed(SEQS, 3, 12, 8, gen=gen)
    out, lse = reference.expanded_attention(q, k, v, cu_q, cu_k, 0.3, causal=causal)
    assert out.shape == (q.shape[0], 3, 8) and out.dtype == lse.dtype == torch.float64
    for b, (n, m) in enumerate(SEQS):
        q0, k0 = int(cu_q[b]), int(cu_k[b])
        want_out, want_lse = dense_attention(q[q0:q0 + n], k[k0:k0 + m], v[k0:k0 + m], 0.3, causal)
        torch.testing.assert_close(out[q0:q0 + n], want_out, rtol=1e-12, atol=1e-12, msg=f"sequence {b} out")
        torch.testing.assert_close(lse[q0:q0 + n], want_lse, rtol=1e-12, atol=1e-12, msg=f"sequence {b} lse")
    used = int(cu_q[-1])
    assert bool((out[used:] == 0).all()) and bool((lse[used:] == -math.inf).all()), "padded rows: 0 / -inf"
    # Without keys, or (causal) ahead of them, a query sees nothing; the NaN spare rows stay unread.
    empty = lse == -math.inf
    assert bool((out[empty] == 0).all()) and bool(torch.isfinite(out).all())
    assert int(empty[:used].any(-1).sum()) == (4 + 5 + 6 if causal else 4)


@pytest.mark.parametrize("n,m", [(9, 4), (4, 9), (6, 6), (3, 1)])
def test_expanded_attention_causal_mask_is_bottom_right(n, m):
    """Causal query i is the unmasked attention of that query over the first m - n + i + 1 keys alone (the last
    query over all m); with n > m the first n - m see none."""
    gen = torch.Generator().manual_seed(n * 16 + m)
    q, k, v, cu_q, cu_k = packed([(n, m)], 2, 16, 8, padded_rows=0, spare_keys=0, gen=gen)
    out, lse = reference.expanded_attention(q, k, v, cu_q, cu_k, 0.25, causal=True)
    one = torch.tensor([0, 1], dtype=torch.int32)
    for i in range(n):
        seen = m - n + i + 1
        if seen <= 0:
            assert bool((out[i] == 0).all()) and bool((lse[i] == -math.inf).all()), f"query {i} sees no key"
            continue
        want_out, want_lse = reference.expanded_attention(q[i:i + 1], k[:seen], v[:seen], one,
                                                          torch.tensor([0, seen], dtype=torch.int32), 0.25,
                                                          causal=False)
        torch.testing.assert_close(out[i], want_out[0], rtol=1e-13, atol=1e-13, msg=f"query {i}")
        torch.testing.assert_close(lse[i], want_lse[0], rtol=1e-13, atol=1e-13, msg=f"query {i}")
        if seen == 1:  # the first query that sees anything sees key 0 alone: weight exactly 1
            torch.testing.assert_close(out[i], v[0], rtol=1e-15, atol=0)
            torch.testing.assert_close(lse[i], 0.25 * (q[i] * k[0]).sum(-1), rtol=1e-13, atol=1e-13)


def test_expanded_attention_large_scores_do_not_overflow():
    """Scores in the thousands (exp overflows even float64): the softmax picks the best key of each row."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, cu_q, cu_k = packed([(6, 10)], 2, 16, 8, padded_rows=0, spare_keys=0, q_std=1e3, gen=gen)
    out, lse = reference.expanded_attention(q, k, v, cu_q, cu_k, 1.0, causal=False)
    scores = torch.einsum("nhd,mhd->nhm", q, k)
    best = scores.argmax(-1)                                                   # [n, H]
    assert bool((scores.topk(2, -1).values.diff(dim=-1).abs() > 50).all()), "a clear winner in every row"
    torch.testing.assert_close(out, v[best, torch.arange(2)[None, :]], rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, scores.max(-1).values, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3), (torch.bfloat16, 2e-2)])
def test_expanded_attention_lower_precision_computes_in_float32(dtype, tol):
    gen = torch.Generator().manual_seed(11)
    q, k, v, cu_q, cu_k = packed(SEQS, 3, 16, 8, spare_keys=0, dtype=torch.float64, gen=gen)
    out, lse = reference.expanded_attention(q.to(dtype), k.to(dtype), v.to(dtype), cu_q, cu_k, 0.3)
    assert out.dtype == dtype and lse.dtype == torch.float32
    # The float64 run over the same rounded inputs: only the float32 math and out's rounding differ.
    want_out, want_lse = reference.expanded_attention(q.to(dtype).double(), k.to(dtype).double(),
                                                      v.to(dtype).double(), cu_q, cu_k, 0.3)
    used = int(cu_q[-1])
    torch.testing.assert_close(out[:used].double(), want_out[:used], rtol=tol, atol=tol)
    torch.testing.assert_close(lse[:used].double(), want_lse[:used], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d_nope,d_v", [(128, 128), (192, 256)])
@pytest.mark.parametrize("causal", [True, False])
def test_expanded_attention_over_up_projected_rows_equals_prefill_expanded(d_nope, d_v, causal):
    """K = [c_kv W_UK^T | k_pe], V = c_kv W_UV^T of each sequence's cache positions, packed by cu_k_lens = the
    cumulative kv_lens: the same attention as prefill_expanded over the paged cache."""
    gen = torch.Generator().manual_seed(d_nope + d_v + causal)
    heads, block_size = 4, 16
    kv_lens, q_lens = [40, 7, 0, 33, 12], [40, 3, 0, 1, 0]
    num_blocks = sum(-(-n // block_size) for n in kv_lens) + 2
    cache = torch.randn(num_blocks, block_size, 576, generator=gen, dtype=torch.float64)
    perm = torch.randperm(num_blocks, generator=gen).int()
    table = torch.full((len(kv_lens), 3), num_blocks + 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(kv_lens):
        need = -(-n // block_size)
        table[b, :need] = perm[used:used + need]
        used += need
    w_uk = torch.randn(heads, d_nope, 512, generator=gen, dtype=torch.float64) / 20
    w_uv = torch.randn(heads, d_v, 512, generator=gen, dtype=torch.float64) / 20
    ks, vs = [], []
    for b, n in enumerate(kv_lens):
        rows = torch.stack([cache[table[b, p // block_size], p % block_size] for p in range(n)]) if n else \
            torch.zeros(0, 576, dtype=torch.float64)
        ks.append(torch.stack([torch.cat([rows[:, :512] @ w_uk[h].T, rows[:, 512:]], -1) for h in range(heads)], 1))
        vs.append(torch.stack([rows[:, :512] @ w_uv[h].T for h in range(heads)], 1))
    k, v = torch.cat(ks), torch.cat(vs)
    cu_q = torch.tensor([0] + q_lens).cumsum(0).int()
    cu_k = torch.tensor([0] + kv_lens).cumsum(0).int()
    q = torch.randn(int(cu_q[-1]) + 2, heads, d_nope + 64, generator=gen, dtype=torch.float64)
    scale = 1 / (d_nope + 64) ** 0.5

    out, lse = reference.expanded_attention(q, k, v, cu_q, cu_k, scale, causal=causal)
    want_out, want_lse = reference.prefill_expanded(q, cache, table, cu_q, torch.tensor(kv_lens, dtype=torch.int32),
                                                    w_uk, w_uv, scale, causal=causal)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


def _expanded_args(**changes):
    q, k, v, cu_q, cu_k = packed([(3, 5), (2, 2)], 2, 16, 8, padded_rows=1, spare_keys=1)
    args = dict(q=q, k=k, v=v, cu_q_lens=cu_q, cu_k_lens=cu_k, softmax_scale=0.25)
    kwargs = {}
    for name, value in changes.items():
        (args if name in args else kwargs)[name] = value(args) if callable(value) else value
    return args, kwargs


@pytest.mark.parametrize("change,error,match", [
    (dict(q=lambda a: a["q"][0]), ValueError, r"^q: expected 3 dims"),
    (dict(q=lambda a: a["q"].int()), TypeError, r"^q: expected a floating-point dtype"),
    (dict(k=lambda a: a["k"][:, :1]), ValueError, r"^k: expected shape"),
    (dict(k=lambda a: a["k"][..., :8]), ValueError, r"^k: expected shape"),
    (dict(k=lambda a: a["k"].float()), TypeError, r"^k: expected dtype torch.float64"),
    (dict(v=lambda a: a["v"][:-1]), ValueError, r"^v: expected shape"),
    (dict(v=lambda a: a["v"][:, :1]), ValueError, r"^v: expected shape"),
    (dict(v=lambda a: a["v"].float()), TypeError, r"^v: expected dtype"),
    (dict(cu_q_lens=lambda a: a["cu_q_lens"].float()), TypeError, r"^cu_q_lens: expected an integer dtype"),
    (dict(cu_q_lens=lambda a: a["cu_q_lens"][None]), ValueError, r"^cu_q_lens: expected 1 dims"),
    (dict(cu_q_lens=torch.tensor([1, 3, 5])), ValueError, r"^cu_q_lens: must start at 0"),
    (dict(cu_q_lens=torch.tensor([0, 3, 2])), ValueError, r"^cu_q_lens: must start at 0 and not decrease"),
    (dict(cu_q_lens=torch.tensor([0, 3, 7])), ValueError, r"^cu_q_lens: ends at 7, past q's 6 tokens"),
    (dict(cu_k_lens=torch.tensor([0, 5])), ValueError, r"^cu_k_lens: expected 3 entries"),
    (dict(cu_k_lens=torch.tensor([0, 5, 9])), ValueError, r"^cu_k_lens: ends at 9, past k's 8 rows"),
    (dict(softmax_scale=0.0), ValueError, r"^softmax_scale"),
    (dict(softmax_scale=math.inf), ValueError, r"^softmax_scale"),
    (dict(causal="yes"), TypeError, r"^causal"),
])
def test_expanded_attention_checks_its_arguments(change, error, match):
    args, kwargs = _expanded_args(**change)
    with pytest.raises(error, match=match):
        reference.expanded_attention(*args.values(), **kwargs)
