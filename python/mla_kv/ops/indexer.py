"""The indexer's scores over the paged index-key cache (DeepSeek Sparse Attention's lightning indexer)."""
from __future__ import annotations

from typing import Optional

import torch

from .. import reference
from .._checks import integer
from .._compiled import _C
from ..layout import INDEX_DIM, check_index_cache
from ._common import (_check_arch, _check_block_table, _check_lens, _index_cache, _kernel_arch, _result_tensor,
                      _same_device, _stream, _tensor, _validate_table, traceable)

INDEX_HEADS = (16, 32, 64)  # index heads one launch scores (DeepSeek-V3.2: 64, GLM-5.x: 32)


@traceable
def index_scores(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                 kv_lens: torch.Tensor, max_kv_len: int, *, cu_q_lens: Optional[torch.Tensor] = None,
                 max_q_len: Optional[int] = None, q_scale: Optional[torch.Tensor] = None,
                 out: Optional[torch.Tensor] = None, validate: bool = False,
                 arch: Optional[str] = None) -> torch.Tensor:
    """The indexer's logits of every query token over its sequence's past -> float32 [T, max_kv_len].

    logits[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s]) for the positions s <= p_t token t sees, -inf
    for its positions past p_t. Token i of sequence b is row cu_q_lens[b] + i at position p = kv_lens[b] - q_len_b
    + i (its own key, already written, included); without cu_q_lens each sequence has one token (decode,
    T == B). q [T, H, 128] (H 16, 32 or 64; last dim contiguous, 16-byte aligned rows): float16 or bfloat16
    values, or uint8 e4m3 codes with q_scale float32 [T, H] (value = code * scale, the model's quantized
    index queries); weights float32 [T, H] (the model's head weights with its scaling folded in);
    index_cache uint8 [num_blocks, page_size, 132] (mla_kv.layout.check_index_cache); block_table int32
    [B, max_blocks], max_blocks * page_size >= max_kv_len; kv_lens int32 [B]; max_kv_len >= every kv_len (the
    logits' width, fixed for CUDA graphs); max_q_len >= every q_len_b, needed with cu_q_lens (it sizes the grid). Rows past cu_q_lens[B] are not
    written. A page id outside the cache reads as a zero key; ``validate=True`` checks the lengths and the
    table's coverage instead (a host sync). ``arch`` forces a kernel variant ("sm70", "sm75", "sm80", "sm90";
    every variant takes bf16 q). Reference: mla_kv.reference.index_scores.
    """
    _check_arch(arch)
    _tensor("q", q, dims=3, last=INDEX_DIM, last_contiguous=True)
    tokens, heads = q.shape[0], q.shape[1]
    if q.device.type == "cuda" and heads not in INDEX_HEADS:
        raise ValueError(f"q: the kernels score {', '.join(map(str, INDEX_HEADS))} index heads, got {heads}")
    if q_scale is None:
        dtypes = (torch.float16, torch.bfloat16) if q.device.type == "cuda" else (torch.float16, torch.bfloat16,
                                                                               torch.float32, torch.float64)
        _tensor("q", q, dtypes=dtypes)
    else:
        _tensor("q", q, dtype=torch.uint8)
        _tensor("q_scale", q_scale, dims=2, dtype=torch.float32, contiguous=True)
        if tuple(q_scale.shape) != (tokens, heads):
            raise ValueError(f"q_scale: expected shape {(tokens, heads)}, got {tuple(q_scale.shape)}")
    _tensor("weights", weights, dims=2, dtype=torch.float32, last_contiguous=True)
    if tuple(weights.shape) != (tokens, heads):
        raise ValueError(f"weights: expected shape {(tokens, heads)}, got {tuple(weights.shape)}")
    page_size = check_index_cache(index_cache)
    max_kv_len = integer("max_kv_len", max_kv_len, 1)
    batch = block_table.shape[0] if isinstance(block_table, torch.Tensor) else 0
    _check_block_table(block_table, batch)
    _check_lens("kv_lens", kv_lens, batch)
    if cu_q_lens is None:
        if tokens != batch:
            raise ValueError(f"q: without cu_q_lens each sequence has one token: expected {batch} tokens (one per "
                             f"block_table row), got {tokens}")
        if max_q_len is not None and integer("max_q_len", max_q_len, 1) != 1:
            raise ValueError(f"max_q_len: without cu_q_lens each sequence has one token, got {max_q_len}")
        max_q_len = 1
    else:
        _check_lens("cu_q_lens", cu_q_lens, batch + 1)
        if max_q_len is None:
            raise ValueError("max_q_len: pass the longest q_len of the batch (a host int: it sizes the grid) with "
                             "cu_q_lens")
        max_q_len = integer("max_q_len", max_q_len, 1)
    if block_table.shape[1] * page_size < max_kv_len:
        raise ValueError(f"block_table: {block_table.shape[1]} pages of {page_size} positions per sequence cover fewer "
                         f"than max_kv_len {max_kv_len} (rows need {-(-max_kv_len // page_size)} entries)")
    device = _same_device(q=q, weights=weights, index_cache=index_cache, block_table=block_table, kv_lens=kv_lens,
                          cu_q_lens=cu_q_lens, q_scale=q_scale)
    out = _result_tensor("out", out, (tokens, max_kv_len), torch.float32 if q.dtype != torch.float64 else q.dtype,
                         device)
    if validate:
        cu = torch.arange(batch + 1) if cu_q_lens is None else cu_q_lens.cpu().long()
        q_lens, lens = cu[1:] - cu[:-1], kv_lens.cpu().long()
        if int(cu[-1]) > tokens:
            raise ValueError(f"cu_q_lens: ends at {int(cu[-1])}, past q's {tokens} tokens")
        if batch and int(q_lens.max()) > max_q_len:
            raise ValueError(f"max_q_len: {max_q_len} is less than the longest q_len {int(q_lens.max())}")
        if batch and int(lens.max()) > max_kv_len:
            raise ValueError(f"max_kv_len: {max_kv_len} is less than the longest kv_len {int(lens.max())}")
        blocks_have = torch.full((batch,), block_table.shape[1])
        _validate_table("block_table", "kv_lens", lens, q_lens, blocks_have, page_size)
        for b in range(batch):
            used = block_table[b, :-(-int(lens[b]) // page_size)].cpu()
            if used.numel() and bool(((used < 0) | (used >= index_cache.shape[0])).any()):
                raise ValueError(f"block_table: row {b} names pages outside [0, {index_cache.shape[0]})")
    if device.type != "cuda":
        return reference.index_scores(q, weights, index_cache, block_table, kv_lens, max_kv_len, cu_q_lens=cu_q_lens,
                                      q_scale=q_scale, out=out)
    if q.data_ptr() % 16 or any(st * q.element_size() % 16 for st in q.stride()[:2]):
        raise ValueError(f"q: its data pointer and token / head strides must be multiples of 16 bytes (got strides "
                         f"{q.stride()})")
    tag = _kernel_arch(device, torch.float16, arch)
    params = _C.IndexScoresParams()
    params.q = q.data_ptr()
    params.q_dtype = _C.DType.bfloat16 if q.dtype == torch.bfloat16 else _C.DType.float16
    params.q_scale = 0 if q_scale is None else q_scale.data_ptr()
    params.q_stride_token, params.q_stride_head = q.stride(0), q.stride(1)
    params.heads = heads
    params.weights, params.weights_stride = weights.data_ptr(), weights.stride(0)
    params.num_tokens, params.batch, params.max_q_len = tokens, batch, max_q_len
    params.cu_q_lens = 0 if cu_q_lens is None else cu_q_lens.data_ptr()
    params.kv_lens = kv_lens.data_ptr()
    params.block_table, params.block_table_stride = block_table.data_ptr(), block_table.stride(0)
    params.max_kv_len = max_kv_len
    params.logits, params.logits_stride = out.data_ptr(), out.stride(0)
    with torch.cuda.device(device):
        _C.index_scores(params, _index_cache(index_cache), tag, _stream(device))
    return out
