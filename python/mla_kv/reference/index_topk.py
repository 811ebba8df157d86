"""The specification of the DeepSeek Sparse Attention indexer's top-k selection.

Token i of sequence b is row cu_q_lens[b] + i of the logits and sits at position
p = kv_lens[b] - q_len_b + i; it sees positions 0 .. p (its own key included)::

    visible(t) = max(0, p_t + 1)
    row t      = the k positions s <= p_t with the largest logits[t, s]; all of them, then -1, when
                 visible(t) <= k

Equal logits prefer the smaller position, so the selected set is unique (the order within a row is
not part of the result). A NaN logit counts as -inf; -0 equals +0. Columns past p_t are never looked
at. With a block table a position becomes its physical slot,
block_table[b, pos // page_size] * page_size + pos % page_size (FlashMLA's and vLLM's sparse indices);
a position the table does not cover (a column past its width, a negative block id) or whose slot
does not fit int32 gives -1.
"""
from __future__ import annotations

from typing import Optional

import torch

from .._checks import integer, tensor
from ._common import _check_cu, _check_index, _check_lengths, _result


def _rows(kv_lens: torch.Tensor, cu_q_lens: Optional[torch.Tensor], num_rows: int):
    """(sequence, position) of every row (host int64; -1 and -1 for a row outside every sequence)."""
    lens = _check_index("kv_lens", kv_lens, 1)
    seq = torch.full((num_rows,), -1, dtype=torch.int64)
    pos = torch.full((num_rows,), -1, dtype=torch.int64)
    if cu_q_lens is None:
        if lens.shape[0] != num_rows:
            raise ValueError(f"kv_lens: without cu_q_lens each of the {num_rows} logits rows is one sequence, "
                             f"got {lens.shape[0]} lengths")
        return torch.arange(num_rows), lens - 1
    cu = _check_index("cu_q_lens", cu_q_lens, 1)
    _check_cu("cu_q_lens", cu)
    _check_lengths("kv_lens", lens, cu.shape[0] - 1)
    if int(cu[-1]) > num_rows:
        raise ValueError(f"cu_q_lens: ends at {int(cu[-1])}, past the logits' {num_rows} rows")
    for b in range(lens.shape[0]):
        first, last = int(cu[b]), int(cu[b + 1])
        seq[first:last] = b
        pos[first:last] = lens[b] - (last - first) + torch.arange(last - first)
    return seq, pos


def index_topk(logits: torch.Tensor, kv_lens: torch.Tensor, k: int, *, cu_q_lens: Optional[torch.Tensor] = None,
               block_table: Optional[torch.Tensor] = None, page_size: Optional[int] = None,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The top-k positions (or slots) of each row of the indexer's logits -> int32 [T, k].

    logits [T, L] (any float dtype); kv_lens integer [B]; cu_q_lens integer [B + 1] (None: one token per
    sequence, T == B, each at its sequence's last position); block_table integer [B, max_blocks] with
    page_size (an int). Rows at or past cu_q_lens[B] are all -1. Every kv length must fit the logits'
    columns (kv_lens <= L). Written into ``out`` (int32 [T, k]) when given.
    """
    tensor("logits", logits, dims=2)
    if not logits.dtype.is_floating_point:
        raise TypeError(f"logits: expected a float dtype, got {logits.dtype}")
    k = integer("k", k, 1)
    num_rows, columns = logits.shape
    seq, pos = _rows(kv_lens, cu_q_lens, num_rows)
    if bool((pos >= columns).any()):
        raise ValueError(f"kv_lens: a token sits at position {int(pos.max())}, past the logits' {columns} columns")
    if (block_table is None) != (page_size is None):
        raise ValueError("page_size: give it with block_table (the slots' page size), and only then")
    if block_table is not None:
        table = _check_index("block_table", block_table, 2)
        page = integer("page_size", page_size, 1)
        if table.shape[0] != kv_lens.shape[0]:
            raise ValueError(f"block_table: expected {kv_lens.shape[0]} rows (one per sequence), got shape "
                             f"{tuple(table.shape)}")

    values = logits.detach().cpu()
    result = torch.full((num_rows, k), -1, dtype=torch.int64)
    for t in range(num_rows):
        visible = int(pos[t]) + 1
        if seq[t] < 0 or visible <= 0:
            continue
        row = values[t, :visible]
        row = torch.where(torch.isnan(row), torch.full_like(row, float("-inf")), row)
        # a stable sort keeps equal logits in position order: the smaller position wins a tie
        chosen = torch.sort(row, descending=True, stable=True).indices[:k]
        result[t, :chosen.shape[0]] = chosen
    if block_table is not None:
        column = result.clamp(min=0) // page
        rows = seq.clamp(min=0)[:, None].expand_as(result)
        covered = (result >= 0) & (column < table.shape[1])
        block = torch.where(covered, table[rows, column.clamp(max=table.shape[1] - 1)], -1)
        slot = block * page + result % page
        result = torch.where(covered & (block >= 0) & (slot <= torch.iinfo(torch.int32).max), slot, -1)
    return _result("out", out, result.to(torch.int32).to(logits.device))
