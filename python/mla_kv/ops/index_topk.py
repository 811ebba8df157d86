"""index_topk: the DeepSeek Sparse Attention indexer's top-k positions (or slots) of each query token."""
from __future__ import annotations

from typing import Optional

import torch

from .. import reference
from .._checks import integer
from .._compiled import _C
from ._common import (_check_arch, _check_block_table, _check_lens, _kernel_arch, _same_device, _stream, _tensor,
                      traceable)

_INT32_MAX = 2**31 - 1


def _row_stride(t: torch.Tensor) -> int:
    """t's row stride, as the kernel reads it (a single row's stride is arbitrary in torch)."""
    return t.stride(0) if t.shape[0] > 1 else max(t.stride(0), t.shape[1])


def index_topk_workspace_size(num_tokens: int, max_kv_len: int, k: int) -> int:
    """Bytes of ``workspace`` index_topk needs for logits [num_tokens, max_kv_len] and this k (0: none;
    also 0 without the kernels, where the reference needs none). Few rows (decode) are split over
    several CTAs that combine their histograms there."""
    num_tokens = integer("num_tokens", num_tokens, 0)
    max_kv_len = integer("max_kv_len", max_kv_len, 0)
    k = integer("k", k, 1)
    return 0 if _C is None else int(_C.index_topk_workspace_size(num_tokens, max_kv_len, k))


def _validate_index_topk(logits, kv_lens, cu_q_lens, block_table, page_size, workspace) -> None:
    """Host checks of device data (validate=True): cu_q_lens, 0 <= kv_lens <= L, the block table's coverage
    of every sequence's positions, a zeroed workspace. A token before its sequence's first position (kv
    length below its q length, e.g. a padded decode row of length 0) is allowed: it sees nothing."""
    lens = kv_lens.cpu().long()
    if cu_q_lens is not None:
        cu = cu_q_lens.cpu().long()
        if int(cu[0]) != 0 or bool((cu.diff() < 0).any()) or int(cu[-1]) > logits.shape[0]:
            raise ValueError(f"cu_q_lens: must start at 0, be non-decreasing and end at most at the logits' "
                             f"{logits.shape[0]} rows")
    if bool((lens < 0).any()) or bool((lens > logits.shape[1]).any()):
        raise ValueError(f"kv_lens: must be in [0, {logits.shape[1]}] (the logits' columns), got {lens.tolist()}")
    if block_table is not None:
        table = block_table.cpu().long()
        blocks = (lens + page_size - 1) // page_size
        short = (blocks > table.shape[1]).nonzero()
        if short.numel():
            b = int(short[0])
            raise ValueError(f"block_table: too short for sequence {b}: {int(lens[b])} positions need "
                             f"{int(blocks[b])} blocks of {page_size}")
        used = torch.arange(table.shape[1])[None, :] < blocks[:, None]
        if bool((used & (table < 0)).any()):
            raise ValueError("block_table: a sequence uses a negative block id")
        if bool((used & (table * page_size + page_size - 1 > _INT32_MAX)).any()):
            raise ValueError("block_table: a block's slots pass int32 (the indices' dtype)")
    if workspace is not None and bool(workspace.any()):
        raise ValueError("workspace: must be zero-filled before its first use (each launch leaves it zeroed); "
                         "allocate it with torch.zeros")


@traceable
def index_topk(logits: torch.Tensor, kv_lens: torch.Tensor, k: int, *, cu_q_lens: Optional[torch.Tensor] = None,
               block_table: Optional[torch.Tensor] = None, page_size: Optional[int] = None,
               out: Optional[torch.Tensor] = None, workspace: Optional[torch.Tensor] = None,
               validate: bool = False, arch: Optional[str] = None) -> torch.Tensor:
    """The k largest logits' positions of each query token -> int32 [T, k].

    logits float32 [T, L] (the index scores; last dim contiguous, any row stride); kv_lens int32 [B];
    cu_q_lens int32 [B + 1]: token i of sequence b is row cu_q_lens[b] + i at position
    kv_lens[b] - q_len_b + i and sees positions 0 .. that one (None: decode, one token per sequence, T == B).
    Each row gets the k visible positions with the largest logits, or every visible one and then -1
    when k or fewer are visible; equal logits prefer the smaller position (the set is unique; the
    order within a row is unspecified). A NaN logit counts as -inf. Columns past a token's position
    are never read (they may hold anything). Rows at or past cu_q_lens[B] are all -1.
    block_table int32 [B, max_blocks] with page_size: the positions become physical slots
    block_table[b, pos // page_size] * page_size + pos % page_size (FlashMLA's and vLLM's sparse indices;
    a position the table does not cover gives -1).
    out int32 [T, k] (any row stride, last dim contiguous) is filled and returned. workspace: uint8, at
    least index_topk_workspace_size(T, L, k) bytes, zero-filled before its first use (each launch leaves it
    zeroed, so a CUDA graph replays with it as is; one launch at a time per workspace); without it one
    is allocated. validate=True checks kv_lens <= L, the lengths, the table's coverage and a zeroed
    workspace on the host (a sync). Every arch tag runs the same kernel ("sm70" .. "sm90" accepted for
    testing). CPU tensors run mla_kv.reference.index_topk.
    """
    _check_arch(arch)
    _tensor("logits", logits, dims=2, dtype=torch.float32, last_contiguous=True)
    if logits.shape[0] > 1 and logits.stride(0) < logits.shape[1]:
        raise ValueError(f"logits: rows overlap (row stride {logits.stride(0)} < {logits.shape[1]} columns)")
    k = integer("k", k, 1)
    if k > _INT32_MAX:
        raise ValueError(f"k: must be < 2**31, got {k}")
    num_tokens, max_kv_len = logits.shape
    if cu_q_lens is None:
        _tensor("kv_lens", kv_lens, dims=1, dtype=torch.int32, contiguous=True)
        batch = kv_lens.shape[0]
        if batch != num_tokens:
            raise ValueError(f"kv_lens: without cu_q_lens each of the {num_tokens} logits rows is one sequence, "
                             f"got {batch} lengths")
    else:
        _tensor("cu_q_lens", cu_q_lens, dims=1, dtype=torch.int32, contiguous=True)
        if cu_q_lens.shape[0] < 2:
            raise ValueError("cu_q_lens: needs at least 2 entries (batch >= 1)")
        batch = cu_q_lens.shape[0] - 1
        _check_lens("kv_lens", kv_lens, batch)
    if block_table is None:
        if page_size is not None:
            raise ValueError("page_size: only a block_table takes one (the slots' page size)")
    else:
        _check_block_table(block_table, batch)
        if page_size is None:
            raise ValueError("page_size: required with block_table (the slots' page size)")
        page_size = integer("page_size", page_size, 1)
    if out is not None:
        _tensor("out", out, dims=2, dtype=torch.int32, last_contiguous=True)
        if tuple(out.shape) != (num_tokens, k):
            raise ValueError(f"out: expected shape {(num_tokens, k)}, got {tuple(out.shape)}")
    if workspace is not None:
        _tensor("workspace", workspace, dims=1, dtype=torch.uint8, contiguous=True)
    device = _same_device(logits=logits, kv_lens=kv_lens, cu_q_lens=cu_q_lens, block_table=block_table, out=out,
                          workspace=workspace)
    if device.type == "cuda" and workspace is not None:
        need = index_topk_workspace_size(num_tokens, max_kv_len, k)
        if workspace.shape[0] < need:
            raise ValueError(f"workspace: needs {need} bytes (index_topk_workspace_size), got {workspace.shape[0]}")
    if validate:
        _validate_index_topk(logits, kv_lens, cu_q_lens, block_table, page_size,
                             workspace if device.type == "cuda" else None)
    if device.type != "cuda":
        return reference.index_topk(logits, kv_lens, k, cu_q_lens=cu_q_lens, block_table=block_table,
                                    page_size=page_size, out=out)
    tag = _kernel_arch(device, torch.float32, arch)  # plain CUDA: one kernel for every tag
    if out is None:
        out = torch.empty(num_tokens, k, dtype=torch.int32, device=device)
    if workspace is None:
        need = index_topk_workspace_size(num_tokens, max_kv_len, k)
        workspace = torch.zeros(need, dtype=torch.uint8, device=device) if need else None
    p = _C.IndexTopkParams()
    p.logits, p.logits_stride, p.num_tokens = logits.data_ptr(), _row_stride(logits), num_tokens
    p.batch, p.kv_lens, p.max_kv_len, p.k = batch, kv_lens.data_ptr(), max_kv_len, k
    p.cu_q_lens = 0 if cu_q_lens is None else cu_q_lens.data_ptr()
    p.indices, p.indices_stride = out.data_ptr(), _row_stride(out)
    if block_table is not None:
        p.block_table, p.block_table_stride = block_table.data_ptr(), _row_stride(block_table)
        p.max_blocks, p.page_size = block_table.shape[1], page_size
    with torch.cuda.device(device):
        _C.index_topk(p, 0 if workspace is None else workspace.data_ptr(), tag, _stream(device))
    return out
