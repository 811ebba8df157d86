"""The write ops: rows [c_kv | k_pe], or the kv_a projection output through RMSNorm and RoPE, into a paged or
block-pointer cache."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import reference
from .._checks import real
from .._compiled import _C
from ..layout import LATENT_DIM, ROPE_DIM, ROW_DIM, BlockPointerCache
from ._common import (BlockWriteTargets, _aligned, _blocks_cache, _c_dtype, _check_arch, _check_block_pointer_cache,
                      _check_kv_format, _check_paged_cache, _check_quantized_paged_cache, _check_write_targets,
                      _kernel_arch, _paged_cache, _same_device, _size, _stream, _tensor, _validate_write_targets,
                      traceable)

_ROPE_STYLES = ("interleaved", "neox")


@dataclass(frozen=True)
class FusedWriteArgs:
    """The fused write's inputs besides the rows and the cache, as checked by _check_fused."""

    rms_weight: torch.Tensor
    eps: float
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    rope_style: str
    q: Optional[torch.Tensor]


# ------------------------------------------------------------------------------------ paged
def _check_rows(kv_c, k_pe, num_tokens: int, dtype) -> None:
    _tensor("kv_c", kv_c, dims=2, dtype=dtype, last_contiguous=True)
    _tensor("k_pe", k_pe, dims=2, dtype=dtype, last_contiguous=True)
    _size("kv_c", kv_c, 1, LATENT_DIM)
    _size("k_pe", k_pe, 1, ROPE_DIM)
    _size("kv_c", kv_c, 0, num_tokens, at_least=True)
    _size("k_pe", k_pe, 0, num_tokens, at_least=True)


def _check_fused(kv_a, rms_weight, eps, positions, cos_sin_cache, num_tokens, rope_style, q, dtype) -> float:
    """Checks the fused write's inputs; returns eps as a float."""
    _tensor("kv_a", kv_a, dims=2, dtype=dtype, last_contiguous=True)
    _size("kv_a", kv_a, 1, ROW_DIM)
    _size("kv_a", kv_a, 0, num_tokens, at_least=True)
    _tensor("rms_weight", rms_weight, dims=1, dtype=dtype, contiguous=True)
    _size("rms_weight", rms_weight, 0, LATENT_DIM)
    eps = real("eps", eps, at_least=0)
    _tensor("positions", positions, dims=1, dtype=torch.int64, contiguous=True)
    _size("positions", positions, 0, num_tokens, at_least=True)
    _tensor("cos_sin_cache", cos_sin_cache, dims=2, dtypes=(torch.float32, dtype), contiguous=True)
    _size("cos_sin_cache", cos_sin_cache, 1, ROPE_DIM)
    if rope_style not in _ROPE_STYLES:
        raise ValueError(f"rope_style: must be 'interleaved' or 'neox', got {rope_style!r}")
    if q is not None:
        _tensor("q", q, dims=3, dtype=dtype, last_contiguous=True)
        _size("q", q, 0, num_tokens, at_least=True)
        _size("q", q, 2, ROPE_DIM, at_least=True)
    return eps


def _validate_positions(positions, num_tokens, cos_sin_cache) -> None:
    pos = positions[:num_tokens]
    if num_tokens and (int(pos.min()) < 0 or int(pos.max()) >= cos_sin_cache.shape[0]):
        raise ValueError(f"positions: values must lie in [0, {cos_sin_cache.shape[0]}) "
                         f"(cos_sin_cache rows), got [{int(pos.min())}, {int(pos.max())}]")


def _params(kv_c, k_pe, num_tokens, fused=None):
    p = _C.WriteKvParams()
    p.dtype = _c_dtype(kv_c.dtype)
    p.num_tokens = num_tokens
    p.kv_c, p.kv_c_stride = kv_c.data_ptr(), kv_c.stride(0)
    p.k_pe, p.k_pe_stride = k_pe.data_ptr(), k_pe.stride(0)
    if fused is not None:
        p.rms_weight, p.rms_eps = fused.rms_weight.data_ptr(), float(fused.eps)
        p.positions = fused.positions.data_ptr()
        cos_sin = fused.cos_sin_cache
        p.cos_sin, p.cos_sin_fp32 = cos_sin.data_ptr(), cos_sin.dtype == torch.float32
        p.max_position = cos_sin.shape[0]
        p.rope_style = getattr(_C.RopeStyle, fused.rope_style)
        q = fused.q
        if q is not None:
            p.q, p.q_heads, p.q_head_dim = q.data_ptr(), q.shape[1], q.shape[2]
            p.q_stride_token, p.q_stride_head = q.stride(0), q.stride(1)
    return p


@dataclass(frozen=True)
class PagedTarget:
    """A paged cache as a write sees it: the tensor, its format (None: values of the cache's dtype) and
    fp8 scale, its block size, and the rows' dtype (the inputs'; for int8 / int4 also the scales')."""

    kv_cache: torch.Tensor
    kv_format: Optional[str]
    kv_scale: Optional[float]
    block_size: int
    dtype: torch.dtype


def _check_paged_target(kv_cache, kv_format, kv_scale, rows_name, rows) -> PagedTarget:
    if kv_format is None:
        _check_kv_format(None, kv_scale, None)
        _check_paged_cache(kv_cache)
        return PagedTarget(kv_cache, None, None, kv_cache.shape[1], kv_cache.dtype)
    dtype = _tensor(rows_name, rows).dtype
    scale = _check_kv_format(kv_format, kv_scale, dtype, names=("kv_format", "kv_scale", rows_name))
    return PagedTarget(kv_cache, kv_format, scale, _check_quantized_paged_cache(kv_cache, kv_format, dtype), dtype)


def _input_alignment(kv_format) -> int:
    """Elements the kernels read at a time at least: quantized rows are written from 16-byte vectors."""
    return 2 if kv_format is None else 8


def _write_paged(kv_c, k_pe, target: PagedTarget, slot_mapping, fused, validate, arch) -> bool:
    """Launches the kernel for CUDA tensors; returns False when the caller must run the reference."""
    kv_cache = target.kv_cache
    num_tokens = slot_mapping.shape[0]
    if validate and num_tokens:
        capacity = kv_cache.shape[0] * target.block_size
        if int(slot_mapping.max()) >= capacity:
            raise ValueError(f"slot_mapping: slot {int(slot_mapping.max())} >= cache capacity {capacity}")
        if fused is not None:
            _validate_positions(fused.positions, num_tokens, fused.cos_sin_cache)
    if kv_cache.device.type != "cuda":
        return False
    tag = _kernel_arch(kv_cache.device, target.dtype, arch)
    elems = _input_alignment(target.kv_format)
    inputs = [("kv_c", kv_c), ("k_pe", k_pe)] + ([] if target.kv_format else [("kv_cache", kv_cache)])
    if fused is not None:
        inputs += [("q", fused.q)] + ([("rms_weight", fused.rms_weight)] if target.kv_format else [])
    for name, t in inputs:
        if t is not None:
            _aligned(name, t, elems)
    with torch.cuda.device(kv_cache.device):
        _C.write_kv_paged(_params(kv_c, k_pe, num_tokens, fused),
                          _paged_cache(kv_cache, target.kv_format, target.kv_scale, target.block_size),
                          slot_mapping.data_ptr(), tag, _stream(kv_cache.device))
    return True


@traceable
def write_kv(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, kv_format: Optional[str] = None, kv_scale: Optional[float] = None,
             validate: bool = False, arch: Optional[str] = None) -> None:
    """Writes rows [kv_c | k_pe] (already normalized and rotated) into a paged cache, in place.

    kv_c [>=T, 512], k_pe [>=T, 64] (any row strides, last dim contiguous), kv_cache
    [num_blocks, block_size, 576] (fp16, bf16 on sm80+, fp32; same dtype as the inputs), slot_mapping
    int64 [T]: token t goes to slot slot_mapping[t] = block * block_size + offset; negative slots are
    padded tokens and are skipped. Reference: mla_kv.reference.write_kv.
    kv_format (mla_kv.layout.KV_FORMATS): a quantized uint8 cache, [num_blocks, block_size, row_bytes]
    for "fp8" / "fp8_ds_mla", [num_blocks, block_bytes] for "int8" / "int4" (layout.block_bytes), written
    from float16 / bfloat16 inputs (int8 / int4 store their scale and zero in that dtype) whose
    addresses and strides are multiples of 8 elements; kv_scale: fp8's dequant scale. The bytes equal
    mla_kv.reference.quant's quantizer's (round half to even everywhere).
    ``arch`` forces a kernel variant ("sm70", "sm75", "sm80"; "sm90" runs the sm80 kernel) for
    testing; ``validate`` checks slot values on the host first.
    """
    _check_arch(arch)
    target = _check_paged_target(kv_cache, kv_format, kv_scale, "kv_c", kv_c)
    _tensor("slot_mapping", slot_mapping, dims=1, dtype=torch.int64, contiguous=True)
    _check_rows(kv_c, k_pe, slot_mapping.shape[0], target.dtype)
    _same_device(kv_cache=kv_cache, kv_c=kv_c, k_pe=k_pe, slot_mapping=slot_mapping)
    if not _write_paged(kv_c, k_pe, target, slot_mapping, None, validate, arch):
        reference.write_kv(kv_c, k_pe, kv_cache, slot_mapping, kv_format=kv_format, kv_scale=target.kv_scale)


@traceable
def fused_write_kv(kv_a: torch.Tensor, rms_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                   rope_style: str = "interleaved", q: Optional[torch.Tensor] = None,
                   kv_format: Optional[str] = None, kv_scale: Optional[float] = None,
                   validate: bool = False, arch: Optional[str] = None) -> None:
    """RMSNorm + RoPE + paged cache write of the kv_a projection output in one launch, in place.

    kv_a [>=T, 576] = raw kv_a_proj_with_mqa output [c_kv | k_pe] (any row stride, e.g. a column
    slice of a fused projection); rms_weight [512] (kv_a's dtype); eps >= 0 (a number as decode's
    softmax_scale); positions int64 [>=T];
    cos_sin_cache [max_position, 64] (float32 or kv_a's dtype, from mla_kv.rope.cos_sin_cache);
    kv_cache / slot_mapping / kv_format / kv_scale as in write_kv (a quantized row is the normalized,
    rotated row rounded to kv_a's dtype, then quantized). q [>=T, H, D] (optional, any strides, last
    dim contiguous): its last 64 values per head are rotated in place. Tokens whose position is outside
    [0, max_position) are left unwritten by the kernels (``validate=True`` raises instead).
    Reference: mla_kv.reference.fused_write_kv.
    """
    _check_arch(arch)
    target = _check_paged_target(kv_cache, kv_format, kv_scale, "kv_a", kv_a)
    _tensor("slot_mapping", slot_mapping, dims=1, dtype=torch.int64, contiguous=True)
    t = slot_mapping.shape[0]
    eps = _check_fused(kv_a, rms_weight, eps, positions, cos_sin_cache, t, rope_style, q, target.dtype)
    _same_device(kv_cache=kv_cache, kv_a=kv_a, rms_weight=rms_weight, positions=positions,
                 cos_sin_cache=cos_sin_cache, slot_mapping=slot_mapping, q=q)
    fused = FusedWriteArgs(rms_weight, eps, positions, cos_sin_cache, rope_style, q)
    if not _write_paged(kv_a[:, :LATENT_DIM], kv_a[:, LATENT_DIM:], target, slot_mapping, fused,
                        validate, arch):
        reference.fused_write_kv(kv_a, rms_weight, eps, positions, cos_sin_cache, kv_cache, slot_mapping,
                                 rope_style=rope_style, q=q, kv_format=kv_format, kv_scale=target.kv_scale)


# --------------------------------------------------------------------------- block pointers
def _check_blocks(cache, cu_q_lens, history_lens, readonly_lens, cp_size, cp_rank, dtype) -> BlockWriteTargets:
    _check_block_pointer_cache(cache, dtype)
    return _check_write_targets(cache.batch, cu_q_lens, history_lens, readonly_lens, cp_size, cp_rank)


def _write_blocks(kv_c, k_pe, cache, to: BlockWriteTargets, fused, validate, arch) -> None:
    device = _same_device(kv_c=kv_c, k_pe=k_pe, block_ptrs=cache.block_ptrs,
                          cu_block_nums=cache.cu_block_nums, cu_q_lens=to.cu_q_lens,
                          history_lens=to.history_lens, readonly_lens=to.readonly_lens)
    if device.type != "cuda":
        raise ValueError("cache: block-pointer ops run on CUDA tensors only; on the CPU use "
                         "mla_kv.reference with a layout.BlockPool layer view")
    if validate:
        _validate_write_targets(cache.cu_block_nums, cache.block_ptrs.shape[0], cache.block_seq_len, to,
                                kv_c.shape[0])
        if fused is not None:
            _validate_positions(fused.positions, kv_c.shape[0], fused.cos_sin_cache)
    tag = _kernel_arch(device, kv_c.dtype, arch)
    elems = _input_alignment(cache.kv_format)
    inputs = [("kv_c", kv_c), ("k_pe", k_pe)]
    if fused is not None:
        inputs += [("q", fused.q)] + ([("rms_weight", fused.rms_weight)] if cache.kv_format else [])
    for name, t in inputs:
        if t is not None:
            _aligned(name, t, elems)
    targets = _C.BlockWriteTargets()
    targets.cu_q_lens, targets.history_lens = to.cu_q_lens.data_ptr(), to.history_lens.data_ptr()
    targets.readonly_lens = 0 if to.readonly_lens is None else to.readonly_lens.data_ptr()
    targets.cp_size, targets.cp_rank = to.cp_size, to.cp_rank
    with torch.cuda.device(device):
        _C.write_kv_blocks(_params(kv_c, k_pe, kv_c.shape[0], fused), _blocks_cache(cache), targets, tag,
                           _stream(device))


@traceable
def write_kv_blocks(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: BlockPointerCache,
                    cu_q_lens: torch.Tensor, history_lens: torch.Tensor, *,
                    readonly_lens: Optional[torch.Tensor] = None, cp_size: int = 1, cp_rank: int = 0,
                    validate: bool = False, arch: Optional[str] = None) -> None:
    """write_kv over TurboMind-style block pointers (mla_kv.layout.BlockPointerCache).

    The input rows are the new tokens packed by sequence: cu_q_lens int32 [B+1]; token i of
    sequence b lands at position history_lens[b] + i (int32 [B]). Tokens past cu_q_lens[B] and
    positions beyond a sequence's blocks are skipped (``validate=True`` raises instead).
    readonly_lens (int32 [B], optional): rows below readonly_lens[b] are never written, as TurboMind
    never writes its read-only prefix blocks (readonly_block_num[b] * block_len rows): tokens landing
    there are skipped, also with ``validate=True`` (TurboMind recomputes a fully cached prompt's last
    token, whose row is already in the shared block). cp_size / cp_rank (context parallelism): the
    token at global position p belongs to rank p % cp_size, at local row p // cp_size of this rank's
    blocks; this rank writes only its own tokens, and readonly_lens counts local rows.
    A quantized cache (cache.kv_format, cache.kv_scale) is written as write_kv writes one; an int8 /
    int4 row's (scale, zero) pair sits at the layer region's byte block_seq_len * row_stride_bytes +
    4 * row.
    Reference: mla_kv.reference.write_kv on a layout.BlockPool layer view with layout.block_slots.
    """
    _check_arch(arch)
    _tensor("kv_c", kv_c, dims=2, last_contiguous=True)
    to = _check_blocks(cache, cu_q_lens, history_lens, readonly_lens, cp_size, cp_rank, kv_c.dtype)
    _check_rows(kv_c, k_pe, kv_c.shape[0], cache.dtype)
    _write_blocks(kv_c, k_pe, cache, to, None, validate, arch)


@traceable
def fused_write_kv_blocks(kv_a: torch.Tensor, rms_weight: torch.Tensor, eps: float,
                          positions: torch.Tensor, cos_sin_cache: torch.Tensor, cache: BlockPointerCache,
                          cu_q_lens: torch.Tensor, history_lens: torch.Tensor, *,
                          rope_style: str = "interleaved", q: Optional[torch.Tensor] = None,
                          readonly_lens: Optional[torch.Tensor] = None, cp_size: int = 1, cp_rank: int = 0,
                          validate: bool = False, arch: Optional[str] = None) -> None:
    """fused_write_kv over TurboMind-style block pointers; addressing (readonly_lens and context
    parallelism included) as in write_kv_blocks. RoPE rotates by ``positions`` (the global ones).

    q's rope part is rotated for every input row whose position lies in the rope table, also for
    rows past cu_q_lens[B] (a padded batch) and rows whose cache position is skipped (read-only,
    another rank's): every rank attends with all queries."""
    _check_arch(arch)
    _tensor("kv_a", kv_a, dims=2, last_contiguous=True)
    to = _check_blocks(cache, cu_q_lens, history_lens, readonly_lens, cp_size, cp_rank, kv_a.dtype)
    eps = _check_fused(kv_a, rms_weight, eps, positions, cos_sin_cache, kv_a.shape[0], rope_style, q,
                       cache.dtype)
    _same_device(kv_a=kv_a, rms_weight=rms_weight, positions=positions, cos_sin_cache=cos_sin_cache, q=q)
    fused = FusedWriteArgs(rms_weight, eps, positions, cos_sin_cache, rope_style, q)
    _write_blocks(kv_a[:, :LATENT_DIM], kv_a[:, LATENT_DIM:], cache, to, fused, validate, arch)
