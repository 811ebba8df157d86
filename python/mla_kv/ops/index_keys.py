"""The indexer's key write (DeepSeek Sparse Attention): index keys through LayerNorm, RoPE, the Hadamard
rotation and e4m3 quantization into a paged or block-pointer index cache, the index queries' RoPE and
Hadamard in place, in one launch. The byte layout: mla_kv.layout (INDEX_*), csrc/include/mla_kv/indexer.h;
the specification: mla_kv.reference.index_keys."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import reference
from .._checks import integer, real
from .._compiled import _C
from ..layout import INDEX_DIM, INDEX_ROPE_DIM, INDEX_SCALE_FORMATS, IndexBlockPointerCache, check_index_cache
from ._common import (BlockWriteTargets, _aligned, _c_dtype, _check_arch, _check_write_targets, _index_cache,
                      _kernel_arch, _same_device, _size, _stream, _tensor, _validate_write_targets, traceable)

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_CPU_DTYPES = (*_KERNEL_DTYPES, torch.float32, torch.float64)


@dataclass(frozen=True)
class IndexKeyInputs:
    """The inputs every form takes, as _check_inputs checked them (eps a float)."""

    k: torch.Tensor
    ln_weight: torch.Tensor
    ln_bias: torch.Tensor
    eps: float
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    rope_style: str
    scale_fmt: Optional[str]
    q: Optional[torch.Tensor]


def _check_inputs(k, ln_weight, ln_bias, eps, positions, cos_sin_cache, num_tokens, rope_style, scale_fmt,
                  q) -> IndexKeyInputs:
    _tensor("k", k)
    dtypes = _KERNEL_DTYPES if k.device.type == "cuda" else _CPU_DTYPES
    _tensor("k", k, dims=2, dtypes=dtypes, last_contiguous=True)
    _size("k", k, 1, INDEX_DIM)
    _size("k", k, 0, num_tokens, at_least=True)
    params = (torch.float32, k.dtype)
    _tensor("ln_weight", ln_weight, dims=1, dtypes=params, contiguous=True)
    _size("ln_weight", ln_weight, 0, INDEX_DIM)
    _tensor("ln_bias", ln_bias, dims=1, dtype=ln_weight.dtype, contiguous=True)
    _size("ln_bias", ln_bias, 0, INDEX_DIM)
    eps = real("eps", eps, at_least=0)
    _tensor("positions", positions, dims=1, dtype=torch.int64, contiguous=True)
    _size("positions", positions, 0, num_tokens, at_least=True)
    _tensor("cos_sin_cache", cos_sin_cache, dims=2, dtypes=params, contiguous=True)
    _size("cos_sin_cache", cos_sin_cache, 1, INDEX_ROPE_DIM)
    if rope_style not in ("neox", "interleaved"):
        raise ValueError(f"rope_style: must be 'neox' (DeepSeek-V3.2) or 'interleaved' (GLM-5.x), got {rope_style!r}")
    if scale_fmt not in INDEX_SCALE_FORMATS:
        raise ValueError(f"scale_fmt: one of {', '.join(map(repr, INDEX_SCALE_FORMATS))}, got {scale_fmt!r}")
    if q is not None:
        _tensor("q", q, dims=3, dtype=k.dtype, last_contiguous=True)
        _size("q", q, 0, num_tokens, at_least=True)
        _size("q", q, 2, INDEX_DIM)
    return IndexKeyInputs(k, ln_weight, ln_bias, eps, positions, cos_sin_cache, rope_style, scale_fmt, q)


def _validate_positions(x: IndexKeyInputs, num_tokens: int) -> None:
    pos = x.positions[:num_tokens]
    if num_tokens and (int(pos.min()) < 0 or int(pos.max()) >= x.cos_sin_cache.shape[0]):
        raise ValueError(f"positions: values must lie in [0, {x.cos_sin_cache.shape[0]}) (cos_sin_cache rows), "
                         f"got [{int(pos.min())}, {int(pos.max())}]")


def _kernel_tag(x: IndexKeyInputs, device: torch.device, arch):
    """The _C.Arch of the launch after the checks the kernel's loads need (4-byte k and q rows)."""
    tag = _kernel_arch(device, x.k.dtype, arch)
    for name, t in (("k", x.k), ("q", x.q)):
        if t is not None:
            _aligned(name, t, 2)
    return tag


def _params(x: IndexKeyInputs, num_tokens: int):
    p = _C.WriteIndexKeysParams()
    p.dtype, p.num_tokens = _c_dtype(x.k.dtype), num_tokens
    p.k, p.k_stride = x.k.data_ptr(), x.k.stride(0)
    p.ln_weight, p.ln_bias = x.ln_weight.data_ptr(), x.ln_bias.data_ptr()
    p.ln_fp32, p.ln_eps = x.ln_weight.dtype == torch.float32, x.eps
    p.positions = x.positions.data_ptr()
    p.cos_sin, p.cos_sin_fp32 = x.cos_sin_cache.data_ptr(), x.cos_sin_cache.dtype == torch.float32
    p.max_position = x.cos_sin_cache.shape[0]
    p.rope_style = getattr(_C.RopeStyle, x.rope_style)
    p.scale_format = _C.IndexScaleFormat.ue8m0 if x.scale_fmt == "ue8m0" else _C.IndexScaleFormat.raw
    if x.q is not None:
        p.q, p.q_heads = x.q.data_ptr(), x.q.shape[1]
        p.q_stride_token, p.q_stride_head = x.q.stride(0), x.q.stride(1)
    return p


@traceable
def write_index_keys(k: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                     positions: torch.Tensor, cos_sin_cache: torch.Tensor, index_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, *, rope_style: str = "neox", scale_fmt: Optional[str] = None,
                     q: Optional[torch.Tensor] = None, validate: bool = False, arch: Optional[str] = None) -> None:
    """The indexer's key write into a paged index cache, in place, in one launch.

    k [>=T, 128] (the index-key projection output; any row stride, dims contiguous; float16, bfloat16
    on sm80+) -> LayerNorm(ln_weight, ln_bias [128], float32 or k's dtype; eps >= 0) in float32 -> RoPE on
    dims 0..63 at positions (int64 [>=T]; cos_sin_cache [max_position, 64] float32 or k's dtype, from
    mla_kv.rope.cos_sin_cache; rope_style "neox" for DeepSeek-V3.2, "interleaved" for GLM-5.x) -> H x /
    sqrt(128) -> e4m3 codes and one float32 scale per token (scale_fmt None: max(amax, 1e-4) / 448; "ue8m0":
    that rounded up to a power of two, DeepSeek's configs) -> index_cache (uint8 [num_blocks, page_size,
    132] or [num_blocks, page_size, 1, 132], mla_kv.layout.index_cache_shape) at slot_mapping (int64 [T],
    slot = page * page_size + offset; negative = padded token; slots past the cache are skipped).
    q [>=T, H, 128] (optional; k's dtype, any strides, dims contiguous): the index queries, rotated
    (RoPE and Hadamard, no quantization) in place, also for padded slots. A token whose position lies
    outside [0, max_position) is left alone, cache and q (``validate=True`` raises instead, and checks the
    slots, with a host sync). Bytes: mla_kv.reference.write_index_keys.
    """
    _check_arch(arch)
    page_size = check_index_cache(index_cache)
    _tensor("slot_mapping", slot_mapping, dims=1, dtype=torch.int64, contiguous=True)
    t = slot_mapping.shape[0]
    x = _check_inputs(k, ln_weight, ln_bias, eps, positions, cos_sin_cache, t, rope_style, scale_fmt, q)
    device = _same_device(index_cache=index_cache, k=k, ln_weight=ln_weight, ln_bias=ln_bias, positions=positions,
                          cos_sin_cache=cos_sin_cache, slot_mapping=slot_mapping, q=q)
    if validate and t:
        capacity = index_cache.shape[0] * page_size
        if int(slot_mapping.max()) >= capacity:
            raise ValueError(f"slot_mapping: slot {int(slot_mapping.max())} >= cache capacity {capacity}")
        _validate_positions(x, t)
    if device.type != "cuda":
        reference.write_index_keys(k, ln_weight, ln_bias, x.eps, positions, cos_sin_cache, index_cache, slot_mapping,
                                   rope_style=rope_style, scale_fmt=scale_fmt, q=q)
        return
    tag = _kernel_tag(x, device, arch)
    with torch.cuda.device(device):
        _C.write_index_keys_paged(_params(x, t), _index_cache(index_cache), slot_mapping.data_ptr(), tag,
                                  _stream(device))


# --------------------------------------------------------------------------- block pointers
def _check_targets(cache, cu_q_lens, history_lens, readonly_lens, cp_size, cp_rank) -> BlockWriteTargets:
    if not isinstance(cache, IndexBlockPointerCache):
        raise TypeError(f"cache: expected mla_kv.layout.IndexBlockPointerCache, got {type(cache).__name__}")
    _tensor("cache.block_ptrs", cache.block_ptrs, dims=1, dtype=torch.int64, contiguous=True)
    _tensor("cache.cu_block_nums", cache.cu_block_nums, dims=1, dtype=torch.int32, contiguous=True)
    if cache.batch < 1:
        raise ValueError("cache.cu_block_nums: needs at least 2 entries (batch >= 1)")
    integer("cache.block_seq_len", cache.block_seq_len, 1)
    if integer("cache.layer_offset_bytes", cache.layer_offset_bytes, 0) % 16:
        raise ValueError(f"cache.layer_offset_bytes: must be a multiple of 16, got {cache.layer_offset_bytes}")
    return _check_write_targets(cache.batch, cu_q_lens, history_lens, readonly_lens, cp_size, cp_rank)


@traceable
def write_index_keys_blocks(k: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                            positions: torch.Tensor, cos_sin_cache: torch.Tensor, cache: IndexBlockPointerCache,
                            cu_q_lens: torch.Tensor, history_lens: torch.Tensor, *,
                            readonly_lens: Optional[torch.Tensor] = None, cp_size: int = 1, cp_rank: int = 0,
                            rope_style: str = "neox", scale_fmt: Optional[str] = None,
                            q: Optional[torch.Tensor] = None, validate: bool = False,
                            arch: Optional[str] = None) -> None:
    """write_index_keys over TurboMind-style block pointers (mla_kv.layout.IndexBlockPointerCache: each block
    holds this layer's index page, block_seq_len tokens, layer_offset_bytes into it).

    The rows of k are the new tokens packed by sequence (cu_q_lens int32 [B+1]); row i of sequence b lands at
    position history_lens[b] + i (int32 [B]), addressed as write_kv_blocks addresses a latent row:
    readonly_lens (int32 [B], optional) rows are never written, cp_size / cp_rank keep the position p on
    rank p % cp_size at local row p // cp_size. RoPE rotates by ``positions`` (the global ones, one per row
    of k). Rows past cu_q_lens[B], other ranks' positions and rows beyond a sequence's blocks are skipped
    (``validate=True`` raises for the lengths and blocks instead); q is rotated for every row of k whose
    position is in range. On CPU tensors block_ptrs hold host addresses and the reference writes there.
    """
    _check_arch(arch)
    _tensor("k", k, dims=2)
    to = _check_targets(cache, cu_q_lens, history_lens, readonly_lens, cp_size, cp_rank)
    t = k.shape[0]
    x = _check_inputs(k, ln_weight, ln_bias, eps, positions, cos_sin_cache, t, rope_style, scale_fmt, q)
    device = _same_device(k=k, ln_weight=ln_weight, ln_bias=ln_bias, positions=positions, cos_sin_cache=cos_sin_cache,
                          q=q, block_ptrs=cache.block_ptrs, cu_block_nums=cache.cu_block_nums, cu_q_lens=cu_q_lens,
                          history_lens=history_lens, readonly_lens=readonly_lens)
    if validate:
        _validate_write_targets(cache.cu_block_nums, cache.block_ptrs.shape[0], cache.block_seq_len, to, t)
        _validate_positions(x, t)
    if device.type != "cuda":
        reference.write_index_keys_blocks(k, ln_weight, ln_bias, x.eps, positions, cos_sin_cache, cache, cu_q_lens,
                                          history_lens, readonly_lens=readonly_lens, cp_size=to.cp_size,
                                          cp_rank=to.cp_rank, rope_style=rope_style, scale_fmt=scale_fmt, q=q)
        return
    tag = _kernel_tag(x, device, arch)
    targets = _C.BlockWriteTargets()
    targets.cu_q_lens, targets.history_lens = cu_q_lens.data_ptr(), history_lens.data_ptr()
    targets.readonly_lens = 0 if readonly_lens is None else readonly_lens.data_ptr()
    targets.cp_size, targets.cp_rank = to.cp_size, to.cp_rank
    c_cache = _C.IndexBlockPointerCache(cache.block_ptrs.data_ptr(), cache.cu_block_nums.data_ptr(), cache.batch,
                                        cache.block_seq_len, cache.layer_offset_bytes)
    with torch.cuda.device(device):
        _C.write_index_keys_blocks(_params(x, t), c_cache, targets, tag, _stream(device))
