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
``from mla_kv.reference_attention import *`` gives the public ones.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._checks import real
from .layout import LATENT_DIM, ROW_DIM, BlockPool, block_table_slots, to_latent_first

__all__ = [
    "decode", "prefill", "merge_states", "gather_kv",
    "decode_blocks", "prefill_blocks", "gather_kv_blocks",
]


# ----------------------------------------------------------------------------------- checks
def _check_tensor(name: str, t, dims: int, last: Optional[int] = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dims, got shape {tuple(t.shape)}")
    if last is not None and t.shape[-1] != last:
        raise ValueError(f"{name}: the last dim must be {last}, got shape {tuple(t.shape)}")


def _check_index(name: str, t, dims: int) -> torch.Tensor:
    """An integer index tensor, returned on the host as int64."""
    _check_tensor(name, t, dims)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer dtype, got {t.dtype}")
    return t.detach().cpu().long()


def _check_lengths(name: str, lens: torch.Tensor, batch: int) -> None:
    if lens.shape[0] != batch:
        raise ValueError(f"{name}: expected {batch} entries, got shape {tuple(lens.shape)}")
    if (lens < 0).any():
        raise ValueError(f"{name}: lengths must be >= 0, got {lens.tolist()}")


def _check_cu(name: str, cu: torch.Tensor) -> None:
    if cu.shape[0] < 1 or cu[0] != 0 or (cu[1:] < cu[:-1]).any():
        raise ValueError(f"{name}: must start at 0 and not decrease, got {cu.tolist()}")


def _check_table(block_table: torch.Tensor, lens: torch.Tensor, kv_cache: torch.Tensor,
                 lens_name: str) -> None:
    """Every position < lens[b] must map to a block of kv_cache through block_table row b."""
    if block_table.shape[0] != lens.shape[0]:
        raise ValueError(f"block_table: expected {lens.shape[0]} rows (one per sequence), "
                         f"got shape {tuple(block_table.shape)}")
    block_size = kv_cache.shape[1]
    needed = (lens + block_size - 1) // block_size
    if (needed > block_table.shape[1]).any():
        raise ValueError(f"block_table: {block_table.shape[1]} blocks per sequence cannot hold "
                         f"{lens_name} {lens.tolist()} with block_size {block_size}")
    for b in range(lens.shape[0]):
        used = block_table[b, :int(needed[b])]
        if ((used < 0) | (used >= kv_cache.shape[0])).any():
            raise ValueError(f"block_table: row {b} holds block ids outside [0, {kv_cache.shape[0]})")


def _result(name: str, given: Optional[torch.Tensor], value: torch.Tensor,
            rows: Optional[int] = None) -> torch.Tensor:
    """Copies ``value`` (its first ``rows`` rows, default all) into the caller's tensor when one is
    given, else returns it."""
    if given is None:
        return value
    if not isinstance(given, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(given).__name__}")
    if given.shape != value.shape:
        raise ValueError(f"{name}: expected shape {tuple(value.shape)}, got {tuple(given.shape)}")
    if given.dtype != value.dtype:
        raise TypeError(f"{name}: expected dtype {value.dtype}, got {given.dtype}")
    given[:rows].copy_(value[:rows])
    return given


# ------------------------------------------------------------------------------------- math
def _acc_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _sequence_rows(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The cache rows at ``slots`` (slot = block * block_size + offset) -> [len(slots), 576]."""
    slots = slots.to(kv_cache.device)
    block_size = kv_cache.shape[1]
    return kv_cache[slots // block_size, slots % block_size]


def _attend(q: torch.Tensor, rows: torch.Tensor, visible: torch.Tensor,
            softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Query n [N, H, 576] attends to rows[:visible[n]] of rows [L, 576].

    Returns out [N, H, 512] and lse [N, H] in the accumulation dtype of q.
    """
    acc = _acc_dtype(q)
    qf, kf = q.to(acc), rows.to(acc)
    counts = visible.clamp(0, kf.shape[0]).to(q.device)                      # rows each query sees
    seen = torch.arange(kf.shape[0], device=q.device)[None, :] < counts[:, None]   # [N, L]
    scores = torch.einsum("nhd,ld->nhl", qf, kf) * softmax_scale
    scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                    # -inf when nothing is seen
    # exp(-inf - (-inf)) would be NaN; a query with no key keeps all-zero weights instead.
    weights = torch.exp(scores - torch.where(lse == float("-inf"), 0.0, lse)[..., None])
    # Each query sums only the rows it sees: a zero weight times a NaN or Inf row that it cannot see
    # would still make its output NaN. Such rows are rare, so the product runs with them zeroed and
    # each is added back for the queries that see it.
    values = kf[:, :LATENT_DIM]
    finite = torch.isfinite(values).all(dim=-1)
    out = torch.einsum("nhl,ld->nhd", weights, torch.where(finite[:, None], values, 0.0))
    for row in (~finite).nonzero().flatten().tolist():
        sel = seen[:, row]
        out[sel] += weights[sel, :, row, None] * values[row]
    return out, lse


# -------------------------------------------------------------------------------- paged ops
def decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
           seq_lens: torch.Tensor, softmax_scale: float, *, out: Optional[torch.Tensor] = None,
           lse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of S_q new tokens per sequence over the paged latent cache.

    q [B, S_q, H, 576] = [q_lat (512) | q_pe (64)], any strides; kv_cache [num_blocks, block_size, 576]
    rows [c_kv | k_pe]; block_table int32 [B, max_blocks]; seq_lens int32 [B], the kv length of each
    sequence including its S_q new tokens (already written to the cache).
    Query i of sequence b sees kv positions < seq_lens[b] - S_q + i + 1 (causal inside the new tokens);
    a query seeing none (seq_len 0, or seq_len < S_q for the first queries) gets out 0 and lse -inf.
    Returns out [B, S_q, H, 512] in q's dtype and lse [B, S_q, H] float32 natural log (float64 for
    float64 q); written into ``out``/``lse`` when given.
    """
    _check_tensor("q", q, 4, ROW_DIM)
    _check_tensor("kv_cache", kv_cache, 3, ROW_DIM)
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
            lse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Prefill / extend attention of packed query tokens over the paged latent cache.

    q [T, H, 576] = [q_lat | q_pe] packed over sequences; kv_cache and block_table as in ``decode``;
    cu_q_lens int32 [B + 1] (sequence b owns q[cu_q_lens[b]:cu_q_lens[b+1]]); kv_lens int32 [B], each
    sequence's kv length including its new tokens (already in the cache). The q tokens of sequence b
    are its last q_len_b positions: when causal, query i sees kv positions < kv_len - q_len + i + 1,
    otherwise all kv_len positions. A query seeing none gets out 0 and lse -inf.
    Returns out [T, H, 512] in q's dtype and lse [T, H] float32 (float64 for float64 q). cu_q_lens[B]
    may be less than T (a CUDA-graph batch padded to a fixed T): the rows past it are left untouched
    in a given ``out``/``lse`` (returned as 0 and -inf otherwise).
    """
    _check_tensor("q", q, 3, ROW_DIM)
    _check_tensor("kv_cache", kv_cache, 3, ROW_DIM)
    table = _check_index("block_table", block_table, 2)
    cu = _check_index("cu_q_lens", cu_q_lens, 1)
    lens = _check_index("kv_lens", kv_lens, 1)
    scale = real("softmax_scale", softmax_scale, above=0)
    _check_cu("cu_q_lens", cu)
    if int(cu[-1]) > q.shape[0]:
        raise ValueError(f"cu_q_lens: ends at {int(cu[-1])}, past q's {q.shape[0]} tokens")
    _check_lengths("kv_lens", lens, cu.shape[0] - 1)
    _check_table(table, lens, kv_cache, "kv_lens")

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
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
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


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, cu_kv_lens: torch.Tensor, *,
              starts: Optional[torch.Tensor] = None,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Copies the cache rows of each sequence into one contiguous tensor.

    kv_cache [num_blocks, block_size, 576]; block_table int32 [B, max_blocks]; cu_kv_lens int32 [B + 1];
    starts int32 [B] (default 0). Sequence b contributes the rows of positions
    starts[b] .. starts[b] + (cu_kv_lens[b+1] - cu_kv_lens[b]) - 1, at out[cu_kv_lens[b]:cu_kv_lens[b+1]].
    Returns [total_kv, 576] in kv_cache's dtype and row order; written into ``out`` when given.
    """
    _check_tensor("kv_cache", kv_cache, 3, ROW_DIM)
    table = _check_index("block_table", block_table, 2)
    cu = _check_index("cu_kv_lens", cu_kv_lens, 1)
    _check_cu("cu_kv_lens", cu)
    counts = cu[1:] - cu[:-1]
    if starts is None:
        first = torch.zeros_like(counts)
    else:
        first = _check_index("starts", starts, 1)
        _check_lengths("starts", first, counts.shape[0])
    _check_table(table, first + counts, kv_cache, "starts + kv lengths")

    ends = first + counts
    parts = [_sequence_rows(kv_cache, slots[int(first[b]):])
             for b, slots in enumerate(block_table_slots(table, ends, kv_cache.shape[1]))]
    rows = torch.cat(parts) if parts else kv_cache.new_zeros(0, ROW_DIM)
    return _result("out", out, rows)


# ------------------------------------------------------------------------ block-pointer ops
def _paged_from_blocks(pool: BlockPool, layer: int, block_ids: torch.Tensor,
                       cu_block_nums: torch.Tensor, lens: torch.Tensor,
                       lens_name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """A block-pointer batch as a latent-first paged cache plus a block table.

    Sequence b owns blocks block_ids[cu_block_nums[b]:cu_block_nums[b+1]] of the pool; ``lens`` [B]
    are the positions each sequence must cover.
    """
    if not isinstance(pool, BlockPool):
        raise TypeError(f"pool: expected a mla_kv.layout.BlockPool, got {type(pool).__name__}")
    num_layers = pool.storage.shape[1]
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer: must be in [0, {num_layers}), got {layer}")
    ids = _check_index("block_ids", block_ids, 1)
    cu = _check_index("cu_block_nums", cu_block_nums, 1)
    _check_cu("cu_block_nums", cu)
    if int(cu[-1]) > ids.shape[0]:
        raise ValueError(f"cu_block_nums: ends at {int(cu[-1])} but block_ids has {ids.shape[0]} entries")
    _check_lengths(lens_name, lens, cu.shape[0] - 1)
    counts = cu[1:] - cu[:-1]
    if (lens > counts * pool.block_seq_len).any():
        raise ValueError(f"{lens_name}: {lens.tolist()} exceed the blocks of each sequence "
                         f"({counts.tolist()} x {pool.block_seq_len} rows)")

    # Entries past a sequence's own blocks are never read (its length fits in them, checked above).
    table = torch.zeros(counts.shape[0], max(int(counts.max()) if counts.numel() else 0, 1),
                        dtype=torch.int64)
    for b in range(counts.shape[0]):
        table[b, :int(counts[b])] = ids[int(cu[b]):int(cu[b + 1])]
    kv_cache = pool.layer_view(layer)
    if pool.rope_first:
        kv_cache = to_latent_first(kv_cache)
    return kv_cache, table


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


def gather_kv_blocks(pool: BlockPool, layer: int, block_ids: torch.Tensor,
                     cu_block_nums: torch.Tensor, cu_kv_lens: torch.Tensor, *,
                     starts: Optional[torch.Tensor] = None,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``gather_kv`` over a TurboMind-style block pool; blocks addressed as in ``decode_blocks``.

    The rows come out latent first, [c_kv | k_pe], whatever the pool's row order, so the result feeds
    kv_b_proj (its first 512 columns) directly.
    """
    cu = _check_index("cu_kv_lens", cu_kv_lens, 1)
    _check_cu("cu_kv_lens", cu)
    counts = cu[1:] - cu[:-1]
    first = torch.zeros_like(counts) if starts is None else _check_index("starts", starts, 1)
    _check_lengths("starts", first, counts.shape[0])
    kv_cache, table = _paged_from_blocks(pool, layer, block_ids, cu_block_nums, first + counts,
                                         "starts + kv lengths")
    return gather_kv(kv_cache, table, cu, starts=first, out=out)
