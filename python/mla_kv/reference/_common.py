"""What the reference's attention, sparse and gather ops share: argument checks, reading cache rows and the
attention math."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._checks import real, tensor
from ..layout import LATENT_DIM, BlockPool, to_latent_first


# ----------------------------------------------------------------------------------- checks
def _check_index(name: str, t, dims: int) -> torch.Tensor:
    """An integer index tensor, returned on the host as int64."""
    tensor(name, t, dims=dims)
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
    tensor(name, given)
    if given.shape != value.shape:
        raise ValueError(f"{name}: expected shape {tuple(value.shape)}, got {tuple(given.shape)}")
    if given.dtype != value.dtype:
        raise TypeError(f"{name}: expected dtype {value.dtype}, got {given.dtype}")
    given[:rows].copy_(value[:rows])
    return given


# ------------------------------------------------------------------------------- cache rows
def _sequence_rows(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The cache rows at ``slots`` (slot = block * block_size + offset) -> [len(slots), 576]."""
    slots = slots.to(kv_cache.device)
    block_size = kv_cache.shape[1]
    return kv_cache[slots // block_size, slots % block_size]


def _paged_from_blocks(pool: BlockPool, layer: int, block_ids: torch.Tensor,
                       cu_block_nums: torch.Tensor, lens: torch.Tensor,
                       lens_name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """A block-pointer batch as a latent-first paged cache plus a block table.

    Sequence b owns blocks block_ids[cu_block_nums[b]:cu_block_nums[b+1]] of the pool; ``lens`` [B]
    are the positions each sequence must cover.
    """
    if not isinstance(pool, BlockPool):
        raise TypeError(f"pool: expected a mla_kv.layout.BlockPool, got {type(pool).__name__}")
    num_layers = pool.num_layers
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


def _check_packed(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cu_q_lens: torch.Tensor,
                  kv_lens: torch.Tensor, softmax_scale) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """The checks of a packed (prefill) call after q's own: (table, cu_q_lens, kv_lens, scale)."""
    table = _check_index("block_table", block_table, 2)
    cu = _check_index("cu_q_lens", cu_q_lens, 1)
    lens = _check_index("kv_lens", kv_lens, 1)
    scale = real("softmax_scale", softmax_scale, above=0)
    _check_cu("cu_q_lens", cu)
    if int(cu[-1]) > q.shape[0]:
        raise ValueError(f"cu_q_lens: ends at {int(cu[-1])}, past q's {q.shape[0]} tokens")
    _check_lengths("kv_lens", lens, cu.shape[0] - 1)
    _check_table(table, lens, kv_cache, "kv_lens")
    return table, cu, lens, scale


# ---------------------------------------------------------------------- attention math
def _acc_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


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
