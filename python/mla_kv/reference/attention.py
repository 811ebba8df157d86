"""The pure-PyTorch specification of the attention ops over the latent cache.

Absorbed MLA attention: every head h of a query reads the same cache rows [c_kv (512) | k_pe (64)].
The query is laid out in the same order, q = [q_lat (512) | q_pe (64)] with q_lat = q_nope @ W_UK
(mla_kv.weights.absorb_q), so one dot product gives the whole score::

    score[h, t] = softmax_scale * (q_lat[h] . c_kv[t] + q_pe[h] . k_pe[t]) = softmax_scale * (q[h] . row[t])
    out[h]      = sum_t softmax(score[h, :])[t] * c_kv[t]                       -> [512]
    lse[h]      = log(sum_t exp(score[h, t]))                                   natural log

The math runs in float32, or in float64 when q is float64; ``out`` has q's dtype and ``lse`` is float32
(float64 for float64 q). A query that sees no key gets out = 0 and lse = -inf, never NaN.

These functions are written for clarity, run on any device, and move index tensors to the host.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._checks import real, tensor
from ..layout import LATENT_DIM, ROW_DIM, BlockPool, block_table_slots
from . import quant
from ._common import (_acc_dtype, _attend, _check_index, _check_lengths, _check_packed, _check_table,
                      _paged_from_blocks, _result, _sequence_rows)


# -------------------------------------------------------------------------------- paged ops
def decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
           seq_lens: torch.Tensor, softmax_scale: float, *, out: Optional[torch.Tensor] = None,
           lse: Optional[torch.Tensor] = None, kv_format: Optional[str] = None,
           kv_scale: Optional[float] = None,
           scale_dtype: torch.dtype = torch.float16) -> Tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of S_q new tokens per sequence over the paged latent cache.

    q [B, S_q, H, 576] = [q_lat (512) | q_pe (64)], any strides; kv_cache [num_blocks, block_size, 576]
    rows [c_kv | k_pe]; block_table int32 [B, max_blocks]; seq_lens int32 [B], the kv length of each
    sequence including its S_q new tokens (already written to the cache).
    Query i of sequence b sees kv positions < seq_lens[b] - S_q + i + 1 (causal inside the new tokens);
    a query seeing none (seq_len 0, or seq_len < S_q for the first queries) gets out 0 and lse -inf.
    Returns out [B, S_q, H, 512] in q's dtype and lse [B, S_q, H] float32 natural log (float64 for
    float64 q); written into ``out``/``lse`` when given. A quantized cache (kv_format, kv_scale;
    scale_dtype: int8 / int4's scale type) is read as reference.quant.dequantize_cache gives it.
    """
    if kv_format is not None:
        kv_cache = quant.dequantize_cache(kv_cache, kv_format, kv_scale=kv_scale, scale_dtype=scale_dtype)
    tensor("q", q, dims=4, last=ROW_DIM)
    tensor("kv_cache", kv_cache, dims=3, last=ROW_DIM)
    table = _check_index("block_table", block_table, 2)
    lens = _check_index("seq_lens", seq_lens, 1)
    scale = real("softmax_scale", softmax_scale, above=0)
    batch, s_q, heads, _ = q.shape
    _check_lengths("seq_lens", lens, batch)
    _check_table(table, lens, kv_cache, "seq_lens")

    acc = _acc_dtype(q)
    out_acc = torch.zeros(batch, s_q, heads, LATENT_DIM, dtype=acc, device=q.device)
    lse_acc = torch.full((batch, s_q, heads), float("-inf"), dtype=acc, device=q.device)
    for b, slots in enumerate(block_table_slots(table, lens, kv_cache.shape[1])):
        visible = int(lens[b]) - s_q + 1 + torch.arange(s_q)
        out_acc[b], lse_acc[b] = _attend(q[b], _sequence_rows(kv_cache, slots), visible, scale)
    return _result("out", out, out_acc.to(q.dtype)), _result("lse", lse, lse_acc)


def prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
            cu_q_lens: torch.Tensor, kv_lens: torch.Tensor, softmax_scale: float, *,
            causal: bool = True, out: Optional[torch.Tensor] = None,
            lse: Optional[torch.Tensor] = None, kv_format: Optional[str] = None,
            kv_scale: Optional[float] = None,
            scale_dtype: torch.dtype = torch.float16) -> Tuple[torch.Tensor, torch.Tensor]:
    """Prefill / extend attention of packed query tokens over the paged latent cache.

    q [T, H, 576] = [q_lat | q_pe] packed over sequences; kv_cache and block_table as in ``decode``;
    cu_q_lens int32 [B + 1] (sequence b owns q[cu_q_lens[b]:cu_q_lens[b+1]]); kv_lens int32 [B], each
    sequence's kv length including its new tokens (already in the cache). The q tokens of sequence b
    are its last q_len_b positions: when causal, query i sees kv positions < kv_len - q_len + i + 1,
    otherwise all kv_len positions. A query seeing none gets out 0 and lse -inf.
    Returns out [T, H, 512] in q's dtype and lse [T, H] float32 (float64 for float64 q). cu_q_lens[B]
    may be less than T (a CUDA-graph batch padded to a fixed T): the rows past it are left untouched
    in a given ``out``/``lse`` (returned as 0 and -inf otherwise). kv_format / kv_scale /
    scale_dtype: a quantized cache, as in ``decode``.
    """
    if kv_format is not None:
        kv_cache = quant.dequantize_cache(kv_cache, kv_format, kv_scale=kv_scale, scale_dtype=scale_dtype)
    tensor("q", q, dims=3, last=ROW_DIM)
    tensor("kv_cache", kv_cache, dims=3, last=ROW_DIM)
    table, cu, lens, scale = _check_packed(q, kv_cache, block_table, cu_q_lens, kv_lens, softmax_scale)

    acc = _acc_dtype(q)
    tokens, heads, _ = q.shape
    out_acc = torch.zeros(tokens, heads, LATENT_DIM, dtype=acc, device=q.device)
    lse_acc = torch.full((tokens, heads), float("-inf"), dtype=acc, device=q.device)
    for b, slots in enumerate(block_table_slots(table, lens, kv_cache.shape[1])):
        start, end = int(cu[b]), int(cu[b + 1])
        kv_len, q_len = int(lens[b]), end - start
        if causal:
            visible = kv_len - q_len + 1 + torch.arange(q_len)
        else:
            visible = torch.full((q_len,), kv_len)
        out_acc[start:end], lse_acc[start:end] = _attend(
            q[start:end], _sequence_rows(kv_cache, slots), visible, scale)
    used = int(cu[-1])
    return _result("out", out, out_acc.to(q.dtype), used), _result("lse", lse, lse_acc, used)


def merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                 lse_b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Combines attention over two disjoint key sets A and B into attention over A + B.

    out_a/out_b [..., D] (e.g. [T, H, 512]) and lse_a/lse_b [...] (natural log) of the same shapes:
    lse = log(exp(lse_a) + exp(lse_b)), out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b.
    A side with lse -inf saw no key and contributes nothing (its out is not read); -inf on both sides
    gives out 0 and lse -inf. Math in float32 (float64 when out_a is float64); out has out_a's dtype,
    lse has lse_a's dtype.
    """
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        tensor(name, t)
    if out_b.shape != out_a.shape:
        raise ValueError(f"out_b: shape {tuple(out_b.shape)} differs from out_a {tuple(out_a.shape)}")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if t.shape != out_a.shape[:-1]:
            raise ValueError(f"{name}: expected shape {tuple(out_a.shape[:-1])}, got {tuple(t.shape)}")

    acc = _acc_dtype(out_a)
    la, lb = lse_a.to(acc), lse_b.to(acc)
    lse = torch.logaddexp(la, lb)
    finite = torch.where(lse == float("-inf"), 0.0, lse)
    out = torch.zeros(out_a.shape, dtype=acc, device=out_a.device)
    for o, l in ((out_a, la), (out_b, lb)):
        seen = (l != float("-inf"))[..., None]
        out = out + torch.where(seen, torch.exp(l - finite)[..., None] * o.to(acc), 0.0)
    return out.to(out_a.dtype), lse.to(lse_a.dtype)


# ------------------------------------------------------------------------ block-pointer ops
def decode_blocks(q: torch.Tensor, pool: BlockPool, layer: int, block_ids: torch.Tensor,
                  cu_block_nums: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float, *,
                  out: Optional[torch.Tensor] = None,
                  lse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``decode`` over a TurboMind-style block pool (rows in the pool's order, rope-first or not).

    Sequence b owns pool blocks block_ids[cu_block_nums[b]:cu_block_nums[b+1]] (int32/int64), position p
    in block p // block_seq_len of that list; everything else as in ``decode`` (q stays [q_lat | q_pe]).
    """
    lens = _check_index("seq_lens", seq_lens, 1)
    kv_cache, table = _paged_from_blocks(pool, layer, block_ids, cu_block_nums, lens, "seq_lens")
    return decode(q, kv_cache, table, lens, softmax_scale, out=out, lse=lse)


def prefill_blocks(q: torch.Tensor, pool: BlockPool, layer: int, block_ids: torch.Tensor,
                   cu_block_nums: torch.Tensor, cu_q_lens: torch.Tensor, kv_lens: torch.Tensor,
                   softmax_scale: float, *, causal: bool = True, out: Optional[torch.Tensor] = None,
                   lse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``prefill`` over a TurboMind-style block pool; blocks addressed as in ``decode_blocks``."""
    lens = _check_index("kv_lens", kv_lens, 1)
    kv_cache, table = _paged_from_blocks(pool, layer, block_ids, cu_block_nums, lens, "kv_lens")
    return prefill(q, kv_cache, table, cu_q_lens, lens, softmax_scale, causal=causal, out=out, lse=lse)
