"""gather_kv: each sequence's cache rows, latent first, packed into one tensor."""
from __future__ import annotations

from typing import Optional, Union

import torch

from .. import reference
from .._compiled import _C
from ..layout import ROW_DIM, BlockPointerCache
from ._common import (_DTYPES, CacheSource, _aligned, _blocks_cache, _c_dtype, _check_block_pointer_cache,
                      _check_block_table, _check_kv_format, _check_lens, _check_paged_cache,
                      _check_arch, _check_quantized_paged_cache, _kernel_arch, _paged_cache, _same_device, _size,
                      _stream, _tensor, _validate_table, traceable)


def _check_gather_cache(kv_cache, block_table, batch, kv_format, kv_scale, dtype) -> CacheSource:
    if isinstance(kv_cache, BlockPointerCache):
        if block_table is not None:
            raise ValueError("block_table: must be None with a BlockPointerCache (its blocks are given by "
                             "cache.cu_block_nums)")
        if kv_format is not None or kv_scale is not None or dtype is not None:
            raise ValueError("kv_format / kv_scale / dtype: a BlockPointerCache carries its own (cache.kv_format, "
                             "cache.kv_scale, cache.dtype)")
        if kv_cache.dtype not in _DTYPES:
            raise TypeError(f"cache: dtype must be one of {', '.join(map(str, _DTYPES))}, got {kv_cache.dtype}")
        _check_block_pointer_cache(kv_cache, kv_cache.dtype)
        if kv_cache.batch != batch:
            raise ValueError(f"cu_kv_lens: describes {batch} sequences, cache.cu_block_nums {kv_cache.batch}")
        return CacheSource(kv_cache.kv_format, kv_cache.kv_scale, kv_cache.block_seq_len, kv_cache.dtype)
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache: expected a torch.Tensor or a layout.BlockPointerCache, "
                        f"got {type(kv_cache).__name__}")
    if kv_format is None:
        _check_kv_format(None, kv_scale, None)
        if dtype is not None:
            raise ValueError("dtype: only a quantized cache takes one (the rows keep kv_cache's dtype)")
        _check_paged_cache(kv_cache)
        _check_block_table(block_table, batch)
        return CacheSource(None, None, kv_cache.shape[1], kv_cache.dtype)
    if dtype is None:
        raise ValueError(f"dtype: a {kv_format} cache needs the dtype of its rows (float16 or bfloat16; int8 / "
                         f"int4 also store their scales in it), or an out to take it from")
    scale = _check_kv_format(kv_format, kv_scale, dtype)
    block_size = _check_quantized_paged_cache(kv_cache, kv_format, dtype)
    _check_block_table(block_table, batch)
    return CacheSource(kv_format, scale, block_size, dtype)


def _validate_gather(kv_cache, block_table, cu_kv_lens, starts, out_rows, block_size) -> None:
    """Host checks of device data (validate=True): cu_kv_lens, starts, out's rows, table coverage."""
    cu = cu_kv_lens.cpu().long()
    counts = cu.diff()
    if int(cu[0]) != 0 or bool((counts < 0).any()):
        raise ValueError("cu_kv_lens: must start at 0 and be non-decreasing")
    if out_rows is not None and int(cu[-1]) > out_rows:
        raise ValueError(f"out: {out_rows} rows cannot hold the {int(cu[-1])} rows cu_kv_lens asks for")
    first = torch.zeros_like(counts) if starts is None else starts.cpu().long()
    if bool((first < 0).any()):
        raise ValueError("starts: must be >= 0")
    ends = first + counts
    if isinstance(kv_cache, BlockPointerCache):
        cu_b = kv_cache.cu_block_nums.cpu().long()
        if int(cu_b[0]) != 0 or bool((cu_b.diff() < 0).any()) or int(cu_b[-1]) > kv_cache.block_ptrs.shape[0]:
            raise ValueError(f"cache.cu_block_nums: must start at 0, be non-decreasing and end at most at "
                             f"block_ptrs' {kv_cache.block_ptrs.shape[0]} entries")
        _validate_table("cache.cu_block_nums", "starts", ends, counts, cu_b.diff(), kv_cache.block_seq_len)
        return
    size = block_size
    _validate_table("block_table", "starts", ends, counts, torch.full_like(counts, block_table.shape[1]), size)
    table = block_table.cpu().long()
    column = torch.arange(table.shape[1])
    used = ((column[None, :] >= (first // size)[:, None]) & (column[None, :] < ((ends + size - 1) // size)[:, None])
            & (counts > 0)[:, None])
    bad = (used & ((table < 0) | (table >= kv_cache.shape[0]))).nonzero()
    if bad.numel():
        b, i = (int(x) for x in bad[0])
        raise ValueError(f"block_table: sequence {b} uses block id {int(table[b, i])} outside "
                         f"[0, {kv_cache.shape[0]})")


@traceable
def gather_kv(kv_cache: Union[torch.Tensor, BlockPointerCache], block_table: Optional[torch.Tensor],
              cu_kv_lens: torch.Tensor, *,
              starts: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
              kv_format: Optional[str] = None, kv_scale: Optional[float] = None, dtype: Optional[torch.dtype] = None,
              validate: bool = False, arch: Optional[str] = None) -> torch.Tensor:
    """Copies each sequence's cache rows into one packed tensor [total_kv, 576], latent first.

    kv_cache [num_blocks, block_size, 576] with block_table int32 [B, max_blocks], or a
    layout.BlockPointerCache (then block_table is None; rows may be rope first). cu_kv_lens int32 [B+1]:
    sequence b fills rows cu_kv_lens[b] .. cu_kv_lens[b+1] - 1 with its cache positions starts[b],
    starts[b] + 1, ... (starts int32 [B], default 0: e.g. the already-cached context of a chunk).
    Output rows are [c_kv | k_pe] whatever the cache's row order, so rows[:, :512] feed kv_b_proj.
    out [N, 576] (the cache's dtype, any row stride, last dim contiguous; N >= total_kv) is filled in
    rows < total_kv and returned whole; rows past total_kv are left untouched. Without ``out`` the
    result is allocated, which reads cu_kv_lens[B] on the host (a sync; pass ``out`` in CUDA graphs).
    Without ``validate`` the kernel leaves rows the cache does not cover (block table too short, block
    ids outside the cache, negative positions) untouched and fills only the first N rows of an ``out``
    shorter than total_kv; ``validate=True`` raises for both before launching. A copy: fp16, bf16 and
    fp32 run on every arch tag (``arch`` forces "sm70", "sm75" or "sm80" for testing; "sm90" runs the
    sm80 kernel). CPU tensors run the reference, which always validates.
    A quantized cache is dequantized into float16 / bfloat16 rows (the expanded route's input), equal to
    mla_kv.reference.gather_kv(kv_format=...) bit for bit: a paged one is uint8 (the write_kv forms)
    with kv_format, kv_scale (fp8) and dtype (its rows' and int8 / int4 scales' type; default out's);
    a BlockPointerCache carries all three. out must then be 16-byte aligned with a row stride of a
    multiple of 8 elements. An e4m3 NaN code (0x7F, 0xFF) gives NaN, its payload unspecified.
    Reference: mla_kv.reference.gather_kv / gather_kv_blocks.
    """
    _check_arch(arch)
    _tensor("cu_kv_lens", cu_kv_lens, dims=1, dtype=torch.int32, contiguous=True)
    if cu_kv_lens.shape[0] < 2:
        raise ValueError("cu_kv_lens: needs at least 2 entries (batch >= 1)")
    batch = cu_kv_lens.shape[0] - 1
    if starts is not None:
        _check_lens("starts", starts, batch)
    blocks = isinstance(kv_cache, BlockPointerCache)
    if out is not None and kv_format is not None and dtype is None:
        dtype = _tensor("out", out).dtype
    source = _check_gather_cache(kv_cache, block_table, batch, kv_format, kv_scale, dtype)
    if out is not None:
        _tensor("out", out, dims=2, dtype=source.dtype, last_contiguous=True)
        _size("out", out, 1, ROW_DIM)
    device = _same_device(**{"cu_kv_lens": cu_kv_lens, "starts": starts,
                             "cache.block_ptrs": kv_cache.block_ptrs if blocks else None,
                             "cache.cu_block_nums": kv_cache.cu_block_nums if blocks else None,
                             "kv_cache": None if blocks else kv_cache,
                             "block_table": None if blocks else block_table, "out": out})
    if blocks and device.type != "cuda":
        raise ValueError("cache: block-pointer ops run on CUDA tensors only; on the CPU use "
                         "mla_kv.reference.gather_kv_blocks with a layout.BlockPool")
    if validate:
        _validate_gather(kv_cache, block_table, cu_kv_lens, starts, None if out is None else out.shape[0],
                         source.block_size)
    if device.type != "cuda":
        quantized = {} if source.kv_format is None else dict(kv_format=source.kv_format, kv_scale=source.kv_scale,
                                                             dtype=source.dtype)
        rows = reference.gather_kv(kv_cache, block_table, cu_kv_lens, starts=starts, **quantized)
        if out is None:
            return rows
        _size("out", out, 0, rows.shape[0], at_least=True)
        out[:rows.shape[0]].copy_(rows)
        return out
    tag = _kernel_arch(device, torch.float16, arch)  # a copy: every dtype runs on every tag
    if out is None:
        total = int(cu_kv_lens[-1])
        if total < 0:
            raise ValueError(f"cu_kv_lens: ends at {total}; it must start at 0 and be non-decreasing")
        out = torch.empty(total, ROW_DIM, dtype=source.dtype, device=device)
    _aligned("out", out, 2 if source.kv_format is None else 8)
    if not blocks and source.kv_format is None:
        _aligned("kv_cache", kv_cache, 2)
    p = _C.GatherKvParams()
    p.dtype, p.batch, p.cu_kv_lens = _c_dtype(source.dtype), batch, cu_kv_lens.data_ptr()
    p.starts = 0 if starts is None else starts.data_ptr()
    p.out, p.out_rows, p.out_stride = out.data_ptr(), out.shape[0], out.stride(0)
    with torch.cuda.device(device):
        if blocks:
            _C.gather_kv_blocks(p, _blocks_cache(kv_cache), tag, _stream(device))
        else:
            _C.gather_kv_paged(p, _paged_cache(kv_cache, source.kv_format, source.kv_scale, source.block_size),
                               block_table.data_ptr(), block_table.stride(0), block_table.shape[1], tag,
                               _stream(device))
    return out
