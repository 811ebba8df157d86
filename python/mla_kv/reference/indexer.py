"""The pure-PyTorch specification of the indexer's scores (DeepSeek Sparse Attention: DeepSeek-V3.2, GLM-5.x).

Query token t (packed row cu_q_lens[b] + i of sequence b, at position p_t = kv_lens[b] - q_len_b + i, its own
key included as in prefill) scores every position s of its sequence's index-key cache::

    logits[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s])     for s <= p_t
                 = -inf                                          for p_t < s < max_kv_len

with k[s] = code * scale of the cache's e4m3 row (mla_kv.layout.index_cache_parts; a page id outside the
cache names a zero key) and q either values
(fp16 / bf16 / fp32 / fp64) or e4m3 codes with one scale per (t, h). Math in float64; logits float32, or
float64 for float64 q.
"""
from __future__ import annotations

from typing import Optional

import torch

from .._checks import integer, tensor
from ..layout import INDEX_DIM, check_index_cache, index_cache_parts
from ._common import _check_cu, _check_index, _check_lengths, _result
from .quant import e4m3_values


def query_positions(cu_q_lens: torch.Tensor, kv_lens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Each packed token's sequence and position, int64 [2, num_tokens] (rows past cu_q_lens[-1]: -1, -1)."""
    where = torch.full((2, num_tokens), -1, dtype=torch.int64)
    for b in range(kv_lens.shape[0]):
        start, end = int(cu_q_lens[b]), int(cu_q_lens[b + 1])
        where[0, start:end] = b
        where[1, start:end] = int(kv_lens[b]) - (end - start) + torch.arange(end - start)
    return where


def index_scores(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                 kv_lens: torch.Tensor, max_kv_len: int, *, cu_q_lens: Optional[torch.Tensor] = None,
                 q_scale: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Index scores over a paged index-key cache.

    q [T, H, 128]: values, or uint8 e4m3 codes when q_scale [T, H] float32 is given; weights [T, H] (float);
    index_cache uint8 [num_blocks, page_size, 132] (mla_kv.layout); block_table integer [B, max_blocks] with
    max_blocks * page_size >= max_kv_len;
    kv_lens integer [B]; cu_q_lens integer [B + 1] (None: one token per sequence, T == B); max_kv_len >= every
    kv_len: the logits' width. Returns logits [T, max_kv_len]; rows past cu_q_lens[-1] are -inf (the op leaves
    them unwritten: with ``out`` only the rows of a sequence are copied in).
    """
    tensor("q", q, dims=3, last=INDEX_DIM)
    tokens, heads = q.shape[0], q.shape[1]
    tensor("weights", weights, dims=2)
    if tuple(weights.shape) != (tokens, heads):
        raise ValueError(f"weights: expected shape {(tokens, heads)}, got {tuple(weights.shape)}")
    check_index_cache(index_cache)
    max_kv_len = integer("max_kv_len", max_kv_len, 1)
    table = _check_index("block_table", block_table, 2)
    lens = _check_index("kv_lens", kv_lens, 1)
    batch = lens.shape[0]
    if cu_q_lens is None:
        if tokens != batch:
            raise ValueError(f"q: without cu_q_lens each sequence has one token: expected {batch} tokens, got {tokens}")
        cu = torch.arange(batch + 1)
    else:
        cu = _check_index("cu_q_lens", cu_q_lens, 1)
        _check_cu("cu_q_lens", cu)
        if int(cu[-1]) > tokens:
            raise ValueError(f"cu_q_lens: ends at {int(cu[-1])}, past q's {tokens} tokens")
    _check_lengths("kv_lens", lens, cu.shape[0] - 1)
    q_lens = cu[1:] - cu[:-1]
    if (q_lens > lens).any():
        raise ValueError(f"kv_lens: each sequence's length includes its new tokens, got kv_lens {lens.tolist()} "
                         f"for q lengths {q_lens.tolist()}")
    if batch and int(lens.max()) > max_kv_len:
        raise ValueError(f"max_kv_len: {max_kv_len} is less than the longest kv_len {int(lens.max())}")
    codes, scales = index_cache_parts(index_cache)
    page_size = codes.shape[1]
    if table.shape[0] != batch or table.shape[1] * page_size < max_kv_len:
        raise ValueError(f"block_table: expected {batch} rows of at least {-(-max_kv_len // page_size)} pages "
                         f"(max_kv_len {max_kv_len} / page_size {page_size}), got shape {tuple(table.shape)}")

    if q_scale is not None:
        tensor("q_scale", q_scale, dims=2, dtype=torch.float32)
        if tuple(q_scale.shape) != (tokens, heads):
            raise ValueError(f"q_scale: expected shape {(tokens, heads)}, got {tuple(q_scale.shape)}")
        tensor("q", q, dtype=torch.uint8)
        qf = e4m3_values(q.cpu().contiguous()).double() * q_scale.cpu().double()[..., None]
    else:
        if not q.dtype.is_floating_point:
            raise TypeError(f"q: expected floating-point values (or uint8 e4m3 codes with q_scale), got {q.dtype}")
        qf = q.detach().cpu().double()
    wf = weights.detach().cpu().double()
    keys = e4m3_values(codes.cpu().contiguous()).double() * scales.cpu().double()[..., None]  # [pages, page, 128]
    keys = torch.cat([keys, keys.new_zeros(1, page_size, INDEX_DIM)])        # the zero key of a missing page

    logits = torch.full((tokens, max_kv_len), float("-inf"), dtype=torch.float64)
    where = query_positions(cu, lens, tokens)
    for b in range(batch):
        rows = (where[0] == b).nonzero().flatten()
        if not rows.numel():
            continue
        length = int(lens[b])
        pos = torch.arange(length)
        pages = table[b, pos // page_size]
        pages = torch.where((pages >= 0) & (pages < codes.shape[0]), pages, codes.shape[0])
        k = keys[pages, pos % page_size]                                     # [length, 128]
        dots = torch.einsum("thd,sd->ths", qf[rows], k).clamp_min(0)
        scores = torch.einsum("ths,th->ts", dots, wf[rows])
        visible = pos[None, :] <= where[1, rows][:, None]
        logits[rows, :length] = torch.where(visible, scores, float("-inf"))
    result = logits.to(torch.float64 if q.dtype == torch.float64 else torch.float32).to(q.device)
    return _result("out", out, result, rows=int(cu[-1]))
