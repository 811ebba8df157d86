"""The pure-PyTorch specification of DeepSeek-V4 attention, as FlashMLA's MODEL1 sparse decode computes it.

V4 has no latent absorption: each head's query is 512 wide, and one 512-wide cache row is both key and value
(its trailing 64 dims carry RoPE). A query token attends to the rows named by one or two index sets (the
sliding window's slots and the compressed entries' slots) under ONE softmax, whose denominator also holds a
per-head attention sink::

    rows(t)  = the rows named by every set's indices[t, :lengths[t]]     (each repeat counts again)
    l_r      = softmax_scale * q[t, h] . row_r
    out[t,h] = sum_r exp(l_r) / (sum_s exp(l_s) + exp(attn_sink[h])) * row_r
    lse[t,h] = log(sum_s exp(l_s))                                        (natural log, WITHOUT the sink)

FlashMLA applies the sink the same way, after the softmax: out *= 1 / (1 + exp(sink - lse)). A sink of -inf
is no sink; +inf zeroes the output. A token with no row gets out 0 and lse -inf, with or without a sink.
With ``derotate`` the output's trailing 64 dims are rotated back by the query's position (HF's
``apply_rotary_pos_emb(out, cos, -sin)``), since V carries the rotated dims. Math in float64.
"""
from __future__ import annotations

import functools
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

from .._checks import real, tensor
from ..layout import V4_DIM, V4_ROPE_DIM
from ._common import _attend, _check_index, _result, _sequence_rows
from .write import apply_rope

# A cache [num_blocks, page_size, 512] of plain floats, or a reader: int64 slots [N] -> float rows [N, 512].
RowsSource = Union[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]
# (rows_source, indices int [T, k] of slots, lengths int [T] or None)
IndexSet = Tuple[RowsSource, torch.Tensor, Optional[torch.Tensor]]

_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _set_rows(name: str, index_set, tokens: int) -> List[torch.Tensor]:
    """The float64 rows each token reads from one set: a list of T tensors [n_t, 512]."""
    if not isinstance(index_set, (tuple, list)) or len(index_set) != 3:
        raise ValueError(f"{name}: expected a (rows_source, indices, lengths) triple, got {type(index_set).__name__}")
    source, indices, lengths = index_set
    slots = _check_index(f"{name} indices", indices, 2)
    if slots.shape[0] != tokens:
        raise ValueError(f"{name} indices: expected {tokens} rows (one per token of q), got shape "
                         f"{tuple(slots.shape)}")
    width = slots.shape[1]
    if lengths is None:
        counts = torch.full((tokens,), width, dtype=torch.int64)
    else:
        counts = _check_index(f"{name} lengths", lengths, 1)
        if counts.shape[0] != tokens:
            raise ValueError(f"{name} lengths: expected {tokens} entries (one per token), got shape "
                             f"{tuple(counts.shape)}")
    used = torch.arange(width)[None, :] < counts[:, None]                    # [T, k]: inside lengths[t]
    if isinstance(source, torch.Tensor):
        tensor(f"{name} rows_source", source, dims=3, last=V4_DIM, dtypes=_CACHE_DTYPES)
        used &= (slots >= 0) & (slots < source.shape[0] * source.shape[1])
        read = functools.partial(_sequence_rows, source)
    elif callable(source):
        # A reader (e.g. of a quantized V4 cache) sees every slot >= 0 and decides itself which exist.
        used &= slots >= 0
        read = source
    else:
        raise TypeError(f"{name} rows_source: expected a cache tensor or a callable slots -> rows, got "
                        f"{type(source).__name__}")
    wanted = slots[used]
    # One read per set, not per token: a reader of a quantized cache dequantizes whole pages.
    rows = read(wanted)
    tensor(f"{name} rows_source", rows, dims=2, last=V4_DIM)
    if rows.shape[0] != wanted.shape[0] or not rows.dtype.is_floating_point:
        raise ValueError(f"{name} rows_source: the reader must return float rows [{wanted.shape[0]}, {V4_DIM}] "
                         f"for {wanted.shape[0]} slots, got {rows.dtype} of shape {tuple(rows.shape)}")
    return list(rows.to(device="cpu", dtype=torch.float64).split(used.sum(dim=1).tolist()))


def _check_sink(attn_sink: Optional[torch.Tensor], heads: int) -> Optional[torch.Tensor]:
    if attn_sink is None:
        return None
    tensor("attn_sink", attn_sink, dims=1)
    if not attn_sink.dtype.is_floating_point:
        raise TypeError(f"attn_sink: expected a floating dtype, got {attn_sink.dtype}")
    if attn_sink.shape[0] != heads:
        raise ValueError(f"attn_sink: expected {heads} entries (one per head of q), got shape "
                         f"{tuple(attn_sink.shape)}")
    return attn_sink.detach().cpu().to(torch.float64)


def _derotation(derotate, tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(positions int64 [T], cos_sin_cache [max_pos, 64] with sin negated): apply_rope by it undoes RoPE."""
    if not isinstance(derotate, (tuple, list)) or len(derotate) != 2:
        raise ValueError(f"derotate: expected a (positions, cos_sin_cache) pair, got {type(derotate).__name__}")
    positions, cos_sin_cache = derotate
    pos = _check_index("derotate positions", positions, 1)
    if pos.shape[0] != tokens:
        raise ValueError(f"derotate positions: expected {tokens} entries (one per token of q), got shape "
                         f"{tuple(pos.shape)}")
    tensor("derotate cos_sin_cache", cos_sin_cache, dims=2, last=V4_ROPE_DIM)
    if not cos_sin_cache.dtype.is_floating_point:
        raise TypeError(f"derotate cos_sin_cache: expected a floating dtype, got {cos_sin_cache.dtype}")
    if ((pos < 0) | (pos >= cos_sin_cache.shape[0])).any():
        raise ValueError(f"derotate positions: must lie in [0, {cos_sin_cache.shape[0]}) (the cos_sin_cache's "
                         f"rows), got {pos.tolist()}")
    cs = cos_sin_cache.detach().cpu().to(torch.float64)
    half = V4_ROPE_DIM // 2
    # The rotation by -angle is the inverse one: same cos, negated sin.
    return pos, torch.cat((cs[:, :half], -cs[:, half:]), dim=-1)


def v4_sparse_attention(q: torch.Tensor, sets: Sequence[IndexSet], softmax_scale: float, *,
                        attn_sink: Optional[torch.Tensor] = None,
                        derotate: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                        out: Optional[torch.Tensor] = None,
                        lse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 sparse attention over one or two index sets sharing one softmax (and the sink).

    q [T, H, 512] float (already RoPE'd on its trailing 64 dims). ``sets``: a sequence of one or two
    (rows_source, indices, lengths) triples. rows_source is a cache [num_blocks, page_size, 512]
    (float16/bfloat16/float32/float64; slot = block * page_size + offset) or a callable taking int64
    slots [N] (every one >= 0) and returning their rows [N, 512]; indices integer [T, k] (k may be 0),
    -1 or a slot past a cache tensor naming no row; lengths integer [T] or None: token t reads only
    indices[t, :lengths[t]]. attn_sink [H] (float; -inf no sink) joins only the softmax denominator.
    derotate (positions int [T], cos_sin_cache [max_pos, 64] = [cos | sin]) rotates the output's trailing
    64 dims back by -angle at each query's position (the inverse of reference.write.apply_rope, interleaved).

    Returns out [T, H, 512] in q's dtype and lse [T, H] float32 (natural log, without the sink), written
    into ``out`` / ``lse`` when given.
    """
    tensor("q", q, dims=3, last=V4_DIM, dtypes=_CACHE_DTYPES)
    scale = real("softmax_scale", softmax_scale, above=0)
    if not isinstance(sets, (tuple, list)) or not 1 <= len(sets) <= 2:
        raise ValueError(f"sets: expected one or two (rows_source, indices, lengths) triples, got "
                         f"{len(sets) if isinstance(sets, (tuple, list)) else type(sets).__name__}")
    tokens, heads, _ = q.shape
    sink = _check_sink(attn_sink, heads)
    derotation = None if derotate is None else _derotation(derotate, tokens)
    per_set = [_set_rows(f"sets[{i}]", index_set, tokens) for i, index_set in enumerate(sets)]

    qf = q.detach().cpu().to(torch.float64)
    out_acc = torch.zeros(tokens, heads, V4_DIM, dtype=torch.float64)
    lse_acc = torch.full((tokens, heads), float("-inf"), dtype=torch.float64)
    for t in range(tokens):
        rows = torch.cat([set_rows[t] for set_rows in per_set])               # the shared softmax's rows
        if rows.shape[0]:
            # K = V = the whole 512-wide row: _attend's values are its first 512 dims, i.e. all of it.
            out_acc[t:t + 1], lse_acc[t:t + 1] = _attend(qf[t:t + 1], rows, torch.tensor([rows.shape[0]]), scale)
    if sink is not None:
        # exp(lse) / (exp(lse) + exp(sink)), FlashMLA's 1 / (1 + exp(sink - lse)); a token with no row
        # (lse -inf) already has out 0 and would make it NaN against a -inf sink.
        kept = torch.exp(lse_acc - torch.logaddexp(lse_acc, sink[None, :]))
        out_acc *= torch.where(lse_acc == float("-inf"), 0.0, kept)[..., None]
    if derotation is not None:
        positions, inverse_cache = derotation
        out_acc[..., -V4_ROPE_DIM:] = apply_rope(out_acc[..., -V4_ROPE_DIM:], positions, inverse_cache, "interleaved")
    return (_result("out", out, out_acc.to(device=q.device, dtype=q.dtype)),
            _result("lse", lse, lse_acc.to(device=q.device, dtype=torch.float32)))
