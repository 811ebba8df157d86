"""The pure-PyTorch specification of sparse attention (DeepSeek Sparse Attention: DeepSeek-V3.2, GLM-5.x).

Each query token t attends only to the cache rows its index row names, with the absorbed MLA math of
mla_kv.reference.attention (one 576-d dot product per row, out = softmax . c_kv, lse natural log)::

    rows(t)  = the existing rows among indices[t, :topk_lens[t]]   (each repeat counts again)
    out[t,h] = sum_{r in rows(t)} softmax(softmax_scale * q[t,h] . row[r]) * c_kv[r]

An index that names no row (-1, or outside the cache) is left out; a token with no row gets out 0 and
lse -inf. Math in float32, or float64 for float64 q.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._checks import real, tensor
from ..layout import LATENT_DIM, ROW_DIM, BlockPool
from . import quant
from ._common import _acc_dtype, _attend, _check_cu, _check_index, _check_lengths, _paged_from_blocks, _result


def _token_counts(topk_lens: Optional[torch.Tensor], tokens: int, topk: int) -> torch.Tensor:
    """How many leading indices each token reads: topk_lens clamped to [0, topk], or topk."""
    if topk_lens is None:
        return torch.full((tokens,), topk, dtype=torch.int64)
    lens = _check_index("topk_lens", topk_lens, 1)
    if lens.shape[0] != tokens:
        raise ValueError(f"topk_lens: expected {tokens} entries (one per token), got shape {tuple(lens.shape)}")
    return lens.clamp(0, topk)


def _attend_selected(q: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                     softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token t of q [T, H, 576] over rows[slots[t, :counts[t]]] of rows [N, 576], slots outside [0, N) left
    out -> out [T, H, 512], lse [T, H] in q's accumulation dtype."""
    acc = _acc_dtype(q)
    tokens, heads, _ = q.shape
    out = torch.zeros(tokens, heads, LATENT_DIM, dtype=acc, device=q.device)
    lse = torch.full((tokens, heads), float("-inf"), dtype=acc, device=q.device)
    for t in range(tokens):
        sel = slots[t, :int(counts[t])]
        sel = sel[(sel >= 0) & (sel < rows.shape[0])]
        if sel.numel():
            out[t:t + 1], lse[t:t + 1] = _attend(q[t:t + 1], rows[sel.to(rows.device)], torch.tensor([sel.numel()]),
                                                 softmax_scale)
    return out, lse


def sparse_attention(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, softmax_scale: float, *,
                     topk_lens: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                     lse: Optional[torch.Tensor] = None, kv_format: Optional[str] = None,
                     kv_scale: Optional[float] = None,
                     scale_dtype: torch.dtype = torch.float16) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention over the paged latent cache.

    q [T, H, 576] = [q_lat | q_pe]; kv_cache [num_blocks, block_size, 576]; indices integer [T, k]:
    physical slots block * block_size + offset (FlashMLA's and vLLM's form), -1 or any slot outside
    [0, num_blocks * block_size) naming no row; topk_lens integer [T] (optional): token t reads only
    indices[t, :topk_lens[t]]. Returns out [T, H, 512] in q's dtype and lse [T, H] float32 (float64 for
    float64 q), written into ``out`` / ``lse`` when given. A quantized cache (kv_format, kv_scale,
    scale_dtype) is read as reference.quant.dequantize_cache gives it.
    """
    if kv_format is not None:
        kv_cache = quant.dequantize_cache(kv_cache, kv_format, kv_scale=kv_scale, scale_dtype=scale_dtype)
    tensor("q", q, dims=3, last=ROW_DIM)
    tensor("kv_cache", kv_cache, dims=3, last=ROW_DIM)
    slots = _check_index("indices", indices, 2)
    scale = real("softmax_scale", softmax_scale, above=0)
    if slots.shape[0] != q.shape[0]:
        raise ValueError(f"indices: expected {q.shape[0]} rows (one per token of q), got shape {tuple(slots.shape)}")
    counts = _token_counts(topk_lens, q.shape[0], slots.shape[1])
    out_acc, lse_acc = _attend_selected(q, kv_cache.reshape(-1, ROW_DIM), slots, counts, scale)
    return _result("out", out, out_acc.to(q.dtype)), _result("lse", lse, lse_acc)


def block_slots(positions: torch.Tensor, block_ids: torch.Tensor, cu_block_nums: torch.Tensor,
                cu_q_lens: torch.Tensor, block_seq_len: int) -> torch.Tensor:
    """Block-pointer indices as physical slots of the pool: token t of sequence b (cu_q_lens[b] <= t <
    cu_q_lens[b + 1]) names position p of b, block block_ids[cu_block_nums[b] + p // block_seq_len];
    -1 for p < 0, past the sequence's blocks, or tokens past cu_q_lens[B]."""
    pos = _check_index("indices", positions, 2)
    ids = _check_index("block_ids", block_ids, 1)
    cu_blocks = _check_index("cu_block_nums", cu_block_nums, 1)
    cu = _check_index("cu_q_lens", cu_q_lens, 1)
    _check_cu("cu_block_nums", cu_blocks)
    _check_cu("cu_q_lens", cu)
    _check_lengths("cu_q_lens", cu[1:] - cu[:-1], cu_blocks.shape[0] - 1)
    slots = torch.full_like(pos, -1)
    for b in range(cu.shape[0] - 1):
        first, count = int(cu_blocks[b]), int(cu_blocks[b + 1] - cu_blocks[b])
        p = pos[int(cu[b]):int(cu[b + 1])]
        ok = (p >= 0) & (p < count * block_seq_len)
        block = ids[first + torch.where(ok, p, 0) // block_seq_len] if count else torch.zeros_like(p)
        slots[int(cu[b]):int(cu[b + 1])] = torch.where(ok, block * block_seq_len + p % block_seq_len, -1)
    return slots


def sparse_attention_blocks(q: torch.Tensor, pool: BlockPool, layer: int, block_ids: torch.Tensor,
                            cu_block_nums: torch.Tensor, cu_q_lens: torch.Tensor, indices: torch.Tensor,
                            softmax_scale: float, *, topk_lens: Optional[torch.Tensor] = None,
                            out: Optional[torch.Tensor] = None,
                            lse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``sparse_attention`` over a TurboMind-style block pool: indices are positions in each token's
    sequence (block_slots gives the rows they name); tokens past cu_q_lens[B] get out 0 and lse -inf."""
    kv_cache, _ = _paged_from_blocks(pool, layer, block_ids, cu_block_nums,
                                     torch.zeros(max(cu_block_nums.shape[0] - 1, 0), dtype=torch.int64), "lengths")
    slots = block_slots(indices, block_ids, cu_block_nums, cu_q_lens, pool.block_seq_len)
    return sparse_attention(q, kv_cache, slots, softmax_scale, topk_lens=topk_lens, out=out, lse=lse)
