"""The expanded-route prefill's specification: up-project the cached latent to per-head keys and
values (kv_b_proj split into W_UK and W_UV), then ordinary attention with the model's head dims.

For sequence b and head h, with rows [c_kv | k_pe] of its cache positions:
    K_h = [c_kv W_UK[h]^T | k_pe]   (d_nope + 64 wide),   V_h = c_kv W_UV[h]^T   (d_v wide)
    out_h = softmax(softmax_scale * q_h K_h^T) V_h, lse_h its natural-log denominator,
under the same causal rule as the absorbed prefill (the q tokens are a sequence's last positions).
Mathematically it equals the absorbed route (mla_kv.reference.prefill of [q_nope W_UK | q_pe], then
weights.project_out by W_UV); it spends 2 x (d_qk + d_v) FLOPs per (query, key, head) instead of 2,176.

``expanded_attention`` is that attention on its own, over per-head K and V the caller already has (the
spec of mla_kv.expanded_attention, the expanded form's own kernel); ``prefill_expanded`` builds K and V
from the cache and runs the same per-sequence math.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .._checks import real, tensor
from ..layout import LATENT_DIM, ROPE_DIM, ROW_DIM, block_table_slots
from ._common import _check_cu, _check_index, _check_packed, _sequence_rows


def _attend_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """One sequence's attention, every head with its own keys: q [n, H, d_qk], k [H, m, d_qk], v [H, m, d_v],
    all in the accumulation dtype. Query i sees keys j <= m - n + i when causal (aligned bottom-right), else
    all m. Returns out [n, H, d_v] and lse [n, H]; a query that sees no key gets 0 and -inf."""
    n, kv_len = q.shape[0], k.shape[1]
    visible = (kv_len - n + 1 + torch.arange(n, device=q.device)) if causal else torch.full((n,), kv_len)
    seen = torch.arange(kv_len, device=q.device)[None, :] < visible.clamp(0, kv_len).to(q.device)[:, None]
    scores = torch.einsum("nhd,hld->nhl", q, k) * scale
    scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    # exp(-inf - (-inf)) would be NaN: a query with no key keeps all-zero weights (out 0) instead.
    weights = torch.exp(scores - torch.where(lse == float("-inf"), 0.0, lse)[..., None])
    return torch.einsum("nhl,hlv->nhv", weights, v), lse


def expanded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q_lens: torch.Tensor,
                       cu_k_lens: torch.Tensor, softmax_scale: float, *,
                       causal: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Multi-head attention of packed sequences whose heads each have their own K and V (no GQA).

    q [T, H, d_qk], k [N, H, d_qk], v [N, H, d_v], all of one float dtype (float64 included) on one device;
    cu_q_lens and cu_k_lens [B + 1] integers (int32 for the op), each starting at 0 and not decreasing:
    sequence b owns q rows cu_q_lens[b] .. cu_q_lens[b + 1] (its n queries) and k / v rows
    cu_k_lens[b] .. cu_k_lens[b + 1] (its m keys). cu_q_lens[B] may be below T and cu_k_lens[B] below N:
    the rows past them belong to no sequence and are never read. A sequence's own k / v rows enter all of
    its queries' sums (with weight 0 where masked), so keep them finite.

    causal=True aligns the mask bottom-right: query i (0-based in its sequence) sees keys j <= m - n + i,
    so the queries are the sequence's last n positions (an extend, or a whole prompt with n == m) and with
    n > m its first n - m queries see no key. causal=False: every query sees its sequence's m keys.

        out[t, h] = softmax(softmax_scale * q[t, h] K_h^T) V_h over the keys t sees,
        lse[t, h] = log(sum over those keys of exp(softmax_scale * q[t, h] . k[j, h]))   (natural log)

    The math runs in float32 (float64 for float64 q). Returns out [T, H, d_v] in q's dtype and lse [T, H]
    float32 (float64 for float64 q). A query that sees no key gets out 0 and lse -inf; so do the rows past
    cu_q_lens[B] here (the op leaves those rows of its out / lse untouched).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        tensor(name, t, dims=3)
    if not q.dtype.is_floating_point:
        raise TypeError(f"q: expected a floating-point dtype, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: expected dtype {q.dtype} (q's), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, expected {q.device} like q")
    tokens, heads, d_qk = q.shape
    if k.shape[1] != heads or k.shape[2] != d_qk:
        raise ValueError(f"k: expected shape (N, {heads}, {d_qk}) (q's heads and head dim), got {tuple(k.shape)}")
    if v.shape[0] != k.shape[0] or v.shape[1] != heads:
        raise ValueError(f"v: expected shape ({k.shape[0]}, {heads}, d_v) (k's rows, q's heads), got "
                         f"{tuple(v.shape)}")
    cu_q = _check_index("cu_q_lens", cu_q_lens, 1)
    cu_k = _check_index("cu_k_lens", cu_k_lens, 1)
    _check_cu("cu_q_lens", cu_q)
    _check_cu("cu_k_lens", cu_k)
    if cu_k.shape[0] != cu_q.shape[0]:
        raise ValueError(f"cu_k_lens: expected {cu_q.shape[0]} entries (cu_q_lens's), got shape {tuple(cu_k.shape)}")
    if int(cu_q[-1]) > tokens:
        raise ValueError(f"cu_q_lens: ends at {int(cu_q[-1])}, past q's {tokens} tokens")
    if int(cu_k[-1]) > k.shape[0]:
        raise ValueError(f"cu_k_lens: ends at {int(cu_k[-1])}, past k's {k.shape[0]} rows")
    scale = real("softmax_scale", softmax_scale, above=0)
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")

    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(tokens, heads, v.shape[2], dtype=acc, device=q.device)
    lse = torch.full((tokens, heads), float("-inf"), dtype=acc, device=q.device)
    for b in range(cu_q.shape[0] - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 == q0:
            continue
        out[q0:q1], lse[q0:q1] = _attend_heads(q[q0:q1].to(acc), k[k0:k1].to(acc).transpose(0, 1),
                                               v[k0:k1].to(acc).transpose(0, 1), scale, causal)
    return out.to(q.dtype), lse


def prefill_expanded(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cu_q_lens: torch.Tensor,
                     kv_lens: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, softmax_scale: float, *,
                     causal: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, d_nope + 64] = [q_nope | q_pe] packed as in ``prefill``; kv_cache [num_blocks, block_size,
    576] latent first; w_uk [H, d_nope, 512], w_uv [H, d_v, 512] (weights.split_kv_b_proj). Returns out
    [T, H, d_v] in q's dtype and lse [T, H] (float32; float64 for float64 q); rows past cu_q_lens[B]
    and queries that see no key are out 0, lse -inf."""
    tensor("q", q, dims=3)
    tensor("kv_cache", kv_cache, dims=3, last=ROW_DIM)
    heads = q.shape[1]
    for name, w in (("w_uk", w_uk), ("w_uv", w_uv)):
        tensor(name, w, dims=3, last=LATENT_DIM)
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
        out[start:end], lse[start:end] = _attend_heads(q[start:end].to(acc), k, v, scale, causal)
    return out.to(q.dtype), lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
