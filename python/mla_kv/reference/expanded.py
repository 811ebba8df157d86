"""The expanded-route prefill's specification: up-project the cached latent to per-head keys and
values (kv_b_proj split into W_UK and W_UV), then ordinary attention with the model's head dims.

For sequence b and head h, with rows [c_kv | k_pe] of its cache positions:
    K_h = [c_kv W_UK[h]^T | k_pe]   (d_nope + 64 wide),   V_h = c_kv W_UV[h]^T   (d_v wide)
    out_h = softmax(softmax_scale * q_h K_h^T) V_h, lse_h its natural-log denominator,
under the same causal rule as the absorbed prefill (the q tokens are a sequence's last positions).
Mathematically it equals the absorbed route (mla_kv.reference.prefill of [q_nope W_UK | q_pe], then
weights.project_out by W_UV); it spends 2 x (d_qk + d_v) FLOPs per (query, key, head) instead of 2,176.
"""
from __future__ import annotations

from typing import Tuple

import torch

from ..layout import LATENT_DIM, ROPE_DIM, ROW_DIM, block_table_slots
from ._common import _check_packed, _check_tensor, _sequence_rows


def prefill_expanded(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cu_q_lens: torch.Tensor,
                     kv_lens: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, softmax_scale: float, *,
                     causal: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, d_nope + 64] = [q_nope | q_pe] packed as in ``prefill``; kv_cache [num_blocks, block_size,
    576] latent first; w_uk [H, d_nope, 512], w_uv [H, d_v, 512] (weights.split_kv_b_proj). Returns out
    [T, H, d_v] in q's dtype and lse [T, H] (float32; float64 for float64 q); rows past cu_q_lens[B]
    and queries that see no key are out 0, lse -inf."""
    _check_tensor("q", q, 3)
    _check_tensor("kv_cache", kv_cache, 3, ROW_DIM)
    heads = q.shape[1]
    for name, w in (("w_uk", w_uk), ("w_uv", w_uv)):
        _check_tensor(name, w, 3, LATENT_DIM)
        if w.shape[0] != heads:
            raise ValueError(f"{name}: expected {heads} heads (q's), got shape {tuple(w.shape)}")
    d_nope = w_uk.shape[1]
    if q.shape[2] != d_nope + ROPE_DIM:
        raise ValueError(f"q: the last dim must be d_nope + {ROPE_DIM} = {d_nope + ROPE_DIM} (w_uk's), got "
                         f"{q.shape[2]}")
    table, cu, lens, scale = _check_packed(q, kv_cache, block_table, cu_q_lens, kv_lens, softmax_scale)

    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    tokens, d_v = q.shape[0], w_uv.shape[1]
    out = torch.zeros(tokens, heads, d_v, dtype=acc, device=q.device)
    lse = torch.full((tokens, heads), float("-inf"), dtype=acc, device=q.device)
    uk, uv = w_uk.to(acc), w_uv.to(acc)
    for b, slots in enumerate(block_table_slots(table, lens, kv_cache.shape[1])):
        start, end = int(cu[b]), int(cu[b + 1])
        if end == start:
            continue
        rows = _sequence_rows(kv_cache, slots).to(acc)                           # [L, 576]
        k = torch.cat([torch.einsum("lr,hdr->hld", rows[:, :LATENT_DIM], uk),
                       rows[None, :, LATENT_DIM:].expand(heads, -1, -1)], -1)    # [H, L, d_nope + 64]
        v = torch.einsum("lr,hvr->hlv", rows[:, :LATENT_DIM], uv)                # [H, L, d_v]
        qb = q[start:end].to(acc)                                                # [n, H, d_qk]
        n, kv_len = end - start, rows.shape[0]
        visible = (kv_len - n + 1 + torch.arange(n, device=q.device)) if causal else torch.full((n,), kv_len)
        seen = torch.arange(kv_len, device=q.device)[None, :] < visible.clamp(0, kv_len).to(q.device)[:, None]
        scores = torch.einsum("nhd,hld->nhl", qb, k) * scale
        scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
        lse_b = torch.logsumexp(scores, -1)
        weights = torch.exp(scores - torch.where(lse_b == float("-inf"), 0.0, lse_b)[..., None])
        out[start:end] = torch.einsum("nhl,hlv->nhv", weights, v)
        lse[start:end] = lse_b
    return out.to(q.dtype), lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
