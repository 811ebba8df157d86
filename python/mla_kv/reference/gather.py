"""gather_kv's specification: each sequence's cache rows packed into one tensor.

Written for clarity like the attention ops (mla_kv.reference.attention); index tensors move to the host.
"""
from __future__ import annotations

from typing import Optional

import torch

from .._checks import tensor
from ..layout import ROW_DIM, BlockPool, block_table_slots
from . import quant
from ._common import (_check_cu, _check_index, _check_lengths, _check_table, _paged_from_blocks,
                      _result, _sequence_rows)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, cu_kv_lens: torch.Tensor, *,
              starts: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
              kv_format: Optional[str] = None, kv_scale: Optional[float] = None,
              dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Copies the cache rows of each sequence into one contiguous tensor.

    kv_cache [num_blocks, block_size, 576]; block_table int32 [B, max_blocks]; cu_kv_lens int32 [B + 1];
    starts int32 [B] (default 0). Sequence b contributes the rows of positions
    starts[b] .. starts[b] + (cu_kv_lens[b+1] - cu_kv_lens[b]) - 1, at out[cu_kv_lens[b]:cu_kv_lens[b+1]].
    Returns [total_kv, 576] in kv_cache's dtype and row order; written into ``out`` when given.
    A quantized cache (kv_format, kv_scale) is dequantized into rows of ``dtype`` (16-bit: the
    expanded-route prefill input; also int8 / int4's scale type).
    """
    if kv_format is not None:
        kv_cache = quant.dequantize_cache(kv_cache, kv_format, kv_scale=kv_scale, scale_dtype=dtype).to(dtype)
    tensor("kv_cache", kv_cache, dims=3, last=ROW_DIM)
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
