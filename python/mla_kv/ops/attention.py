"""The attention ops: the split-KV schedule, decode and prefill over the latent cache, and merge_states."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from .. import reference
from .._checks import integer, real
from .._compiled import _C
from ..gpus import AttentionTiles, LimitsSpec, SmemLimits, c_limits, smem_limits as _smem_limits
from ..layout import LATENT_DIM, BlockPointerCache
from ._common import (_DTYPES, CacheSource, _blocks_cache, _c_dtype, _check_arch, _check_attention_inputs,
                      _check_lens, _check_q, _check_vector_aligned, _kernel_arch, _lse_dtype, _packed_batch,
                      _paged_cache, _result_tensor, _same_device, _stream, _tensor, _validate_table, traceable)


@dataclass(frozen=True)
class AttentionSchedule:
    """How an attention launch splits the KV: computed from sizes only, so it can be made (and the
    workspace allocated) outside a CUDA graph and reused by every replay."""

    num_splits: int
    tokens_per_split: int
    workspace_bytes: int
    # The tiles the launch takes, and the shared-memory limits it plans for (None: the device's;
    # a smaller GPU's make the launch run that GPU's configuration, see mla_kv.gpus).
    tiles: Optional[AttentionTiles] = None
    smem_limits: Optional[SmemLimits] = None
    # How the Hopper kernel loads cache tiles: "auto" (TMA where a paged cache allows it) or
    # "cp.async" (everywhere; for side-by-side measurement). Other variants ignore it.
    tile_loads: str = "auto"


_TILE_LOADS = {"auto": "auto", "cp.async": "cp_async"}  # name -> _C.TileLoads member


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _schedule_device(device) -> torch.device:
    """The CUDA device, with its index, that a schedule is made for (None: the current one)."""
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device: not a torch device: {device!r}") from None
        if device.type != "cuda":
            raise ValueError(f"device: a schedule plans CUDA kernel launches, got {device} (CPU tensors run the "
                             "reference, which takes no schedule)")
    if not torch.cuda.is_available():
        raise RuntimeError("device: a schedule plans CUDA kernel launches, and torch sees no CUDA device here "
                           "(CPU tensors run the reference, which takes no schedule)")
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device: cuda:{index} does not exist ({torch.cuda.device_count()} CUDA devices)")
    return torch.device("cuda", index)


def attention_schedule(batch: int, q_len: int, num_heads: int, max_kv_len: int, *,
                       total_q_tokens: Optional[int] = None, device: Union[None, str, int, torch.device] = None,
                       arch: Optional[str] = None, smem_limits: LimitsSpec = None,
                       tile_loads: str = "auto") -> AttentionSchedule:
    """The split-KV plan of decode/prefill for these sizes on ``device`` (default: current GPU).

    max_kv_len bounds every sequence's kv length (decode uses block_table width x block_size);
    total_q_tokens is batch * q_len for decode and T for prefill. A schedule plans kernel launches, so
    it needs a CUDA device (CPU tensors run the reference, which takes none). ``smem_limits`` (a GPU
    class name of mla_kv.gpus.gpu_classes(), or byte limits) plans, and makes the launch take, the
    tiles of a GPU with that much shared memory; by default the device's own. ``tile_loads``: "auto",
    or "cp.async" to keep the Hopper kernel's paged-cache tiles off TMA (measurement).
    """
    _check_arch(arch)
    batch, q_len, num_heads, max_kv_len = (integer(name, v, 0) for name, v in (
        ("batch", batch), ("q_len", q_len), ("num_heads", num_heads), ("max_kv_len", max_kv_len)))
    total = batch * q_len if total_q_tokens is None else integer("total_q_tokens", total_q_tokens, 0)
    limits = _smem_limits(smem_limits)
    if tile_loads not in _TILE_LOADS:
        raise ValueError(f"tile_loads: one of {', '.join(map(repr, _TILE_LOADS))}, got {tile_loads!r}")
    device = _schedule_device(device)
    tag = _kernel_arch(device, torch.float16, arch)
    s = _C.make_attention_schedule(batch, max(q_len, 1), max(num_heads, 1), max_kv_len, _sm_count(device.index),
                                   tag, c_limits(limits))
    _check_tiles(s.tiles, tag, device, limits)
    return AttentionSchedule(s.num_splits, s.tokens_per_split,
                             _C.attention_workspace_size(total, num_heads, s.num_splits),
                             AttentionTiles.from_c(s.tiles), limits, tile_loads)


def _check_tiles(tiles, tag, device, limits: Optional[SmemLimits]) -> None:
    """Raises when no tile configuration of the variant fits the shared memory it may use."""
    if tiles.block_m:
        return
    if limits is None:
        have = _C.device_smem_limits().per_block
        where = f"{torch.cuda.get_device_name(device)} allows {have:,}"
    else:
        have = min(limits.per_block, _C.device_smem_limits().per_block)
        where = f"the schedule's smem_limits allow {have:,}"
    raise ValueError(f"arch: the {tag.name} attention kernel needs {tiles.min_smem_bytes:,} bytes of shared "
                     f"memory per CTA (its smallest tile configuration); {where} per block "
                     f"(use another arch tag, or None for the device's own)")


def decode_workspace_size(batch: int, q_len: int, num_heads: int, max_kv_len: int, *,
                          device: Union[None, str, int, torch.device] = None, arch: Optional[str] = None) -> int:
    """Bytes of ``workspace`` decode needs for these sizes (0 when the KV is not split)."""
    return attention_schedule(batch, q_len, num_heads, max_kv_len, device=device, arch=arch).workspace_bytes


def _schedule_cover(blocks, max_kv, validate, have, size) -> int:
    """The kv positions a schedule must cover: the block table's width for the paged layout; for
    block pointers the longest block list, known on the host only with validate=True (else 0)."""
    if not blocks:
        return max_kv
    return int(have.max()) * size if validate and have.numel() else 0


def _workspace(workspace, schedule: AttentionSchedule, device, *, max_kv, total_tokens, heads):
    """Checks a (possibly hand-made) schedule against the launch, then returns the workspace tensor
    (None when the schedule does not split the KV). One allocated here must stay referenced by the
    caller until the launch is queued: torch then reuses its memory only in the stream's order, after
    the kernels that use it (the caching allocator), or frees it with a synchronizing cudaFree."""
    if not isinstance(schedule, AttentionSchedule):
        raise ValueError(f"schedule: expected an AttentionSchedule (mla_kv.attention_schedule), got {schedule!r}")
    if schedule.tile_loads not in _TILE_LOADS:
        raise ValueError(f"schedule: tile_loads must be one of {', '.join(map(repr, _TILE_LOADS))}, got "
                         f"{schedule.tile_loads!r}")
    splits, tokens = schedule.num_splits, schedule.tokens_per_split
    if not _C.attention_splits_valid(splits, tokens, 0):
        raise ValueError(f"schedule: needs 1 <= num_splits <= {_C.max_attention_splits} and tokens_per_split >= 1, "
                         f"got {splits} x {tokens}")
    if not _C.attention_splits_valid(splits, tokens, max_kv):
        raise ValueError(f"schedule: {splits} splits x {tokens} tokens cover {splits * tokens} kv positions, "
                         f"but the cache arguments allow up to {max_kv}")
    need = _C.attention_workspace_size(total_tokens, heads, splits)
    if schedule.workspace_bytes < need:
        raise ValueError(f"schedule: workspace_bytes {schedule.workspace_bytes} < the {need} this launch needs")
    if schedule.workspace_bytes == 0:
        return None
    if workspace is None:  # a CUDA graph should pass one sized by attention_schedule()
        workspace = torch.empty(schedule.workspace_bytes, dtype=torch.uint8, device=device)
    _tensor("workspace", workspace, dims=1, contiguous=True)
    if workspace.numel() * workspace.element_size() < schedule.workspace_bytes or workspace.device != device:
        raise ValueError(f"workspace: needs {schedule.workspace_bytes} bytes on {device}, got "
                         f"{workspace.numel() * workspace.element_size()} on {workspace.device}")
    if workspace.data_ptr() % 16:
        raise ValueError("workspace: must be 16-byte aligned")
    return workspace


def _attention_params(q, out, lse, *, packed, batch, q_len, kv_lens, cu_q_lens, causal, scale, schedule):
    p = _C.AttentionParams()
    p.dtype = _c_dtype(q.dtype)
    p.batch, p.num_heads, p.q_len = batch, q.shape[-2], q_len
    p.kv_lens, p.causal, p.softmax_scale = kv_lens.data_ptr(), causal, float(scale)
    p.num_splits, p.tokens_per_split = schedule.num_splits, schedule.tokens_per_split
    p.smem_limits = c_limits(schedule.smem_limits)
    p.tile_loads = getattr(_C.TileLoads, _TILE_LOADS[schedule.tile_loads])
    p.q, p.out, p.lse = q.data_ptr(), out.data_ptr(), lse.data_ptr()
    if packed:
        p.cu_q_lens, p.total_q_tokens = cu_q_lens.data_ptr(), q.shape[0]
        p.q_stride_b = p.out_stride_b = p.lse_stride_b = 0
        p.q_stride_t, p.q_stride_h = q.stride(0), q.stride(1)
        p.out_stride_t, p.out_stride_h = out.stride(0), out.stride(1)
        p.lse_stride_t, p.lse_stride_h = lse.stride(0), lse.stride(1)
    else:
        p.cu_q_lens, p.total_q_tokens = 0, batch * q_len
        p.q_stride_b, p.q_stride_t, p.q_stride_h = q.stride(0), q.stride(1), q.stride(2)
        p.out_stride_b, p.out_stride_t, p.out_stride_h = out.stride(0), out.stride(1), out.stride(2)
        p.lse_stride_b, p.lse_stride_t, p.lse_stride_h = lse.stride(0), lse.stride(1), lse.stride(2)
    return p


def _launch_attention(q, params, cache, source: CacheSource, block_table, arch, workspace,
                      limits: Optional[SmemLimits]):
    """Launches with ``workspace`` (a tensor, or None when the KV is not split): an argument here, so
    one the op allocated stays referenced until its launches are queued (see _workspace)."""
    params.workspace = 0 if workspace is None else workspace.data_ptr()
    tag = _kernel_arch(q.device, q.dtype, arch)
    _check_tiles(_C.attention_launch_tiles(params, tag), tag, q.device, limits)
    with torch.cuda.device(q.device):
        if isinstance(cache, BlockPointerCache):
            _C.attention_blocks(params, _blocks_cache(cache), tag, _stream(q.device))
        else:
            _C.attention_paged(params, _paged_cache(cache, source.kv_format, source.kv_scale, source.block_size),
                               block_table.data_ptr(), block_table.stride(0), block_table.shape[1], tag,
                               _stream(q.device))


def _reference_format(source: CacheSource) -> dict:
    """The reference's keywords for a (CPU) paged cache of this format."""
    if source.kv_format is None:
        return {}
    return dict(kv_format=source.kv_format, kv_scale=source.kv_scale, scale_dtype=source.dtype)


@traceable
def decode(q: torch.Tensor, kv_cache: Union[torch.Tensor, BlockPointerCache], block_table: Optional[torch.Tensor],
           seq_lens: torch.Tensor, softmax_scale: float, *, out: Optional[torch.Tensor] = None,
           lse: Optional[torch.Tensor] = None,
           workspace: Optional[torch.Tensor] = None, schedule: Optional[AttentionSchedule] = None,
           validate: bool = False, arch: Optional[str] = None, kv_format: Optional[str] = None,
           kv_scale: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Decode attention (S_q >= 1 new tokens per sequence) over the latent cache -> (out, lse).

    q [B, S_q, H, 576] = [q_lat | q_pe] (fp16, or bf16 on sm80+; any strides on B, S_q and H);
    kv_cache [num_blocks, block_size, 576] with block_table int32 [B, max_blocks], or a
    layout.BlockPointerCache (then block_table is None); seq_lens int32 [B] = kv length including
    the new tokens, already in the cache. Query i of sequence b sees positions < seq_lens[b] - S_q + i + 1.
    softmax_scale is required (mla_kv.rope.mla_softmax_scale gives the model's): a finite number > 0, a
    Python or numpy scalar or a 0-d CPU tensor (not a CUDA one, which would be read with a host sync).
    Returns out [B, S_q, H, 512] (q's dtype) and lse [B, S_q, H] float32 (natural log); a query that
    sees nothing gets out 0 and lse -inf. For CUDA graphs pass ``workspace`` (and ``schedule``) from
    attention_schedule(); ``validate=True`` checks seq_lens against the table on the host first.
    ``arch`` forces a kernel variant for testing ("sm70", "sm75", "sm80", "sm90": the Hopper wgmma
    kernel, TMA tile loads on 16-bit paged caches).
    A quantized paged cache: ``kv_format`` ("fp8", "fp8_ds_mla", "int8", "int4") with kv_cache in the
    uint8 form write_kv writes (layout.paged_cache_shape) and, for "fp8", ``kv_scale``; int8 / int4
    scales are of q's dtype. A BlockPointerCache carries its format. Every variant dequantizes the
    tiles it reads into q's dtype: out = attention over reference.quant.dequantize_cache.
    Reference: mla_kv.reference.decode.
    """
    _check_arch(arch)
    _check_q(q, 4)
    batch, s_q, heads, _ = q.shape
    softmax_scale = real("softmax_scale", softmax_scale, above=0)
    _check_lens("seq_lens", seq_lens, batch)
    blocks = isinstance(kv_cache, BlockPointerCache)
    device, source = _check_attention_inputs(q, kv_cache, block_table, batch, dict(
        q=q, seq_lens=seq_lens, kv_cache=None if blocks else kv_cache,
        block_table=None if blocks else block_table), kv_format, kv_scale)
    out = _result_tensor("out", out, (batch, s_q, heads, LATENT_DIM), q.dtype, device)
    _check_vector_aligned("out", out)
    lse = _result_tensor("lse", lse, (batch, s_q, heads), _lse_dtype(q), device)
    have = size = None
    if validate:
        q_lens = torch.full((batch,), s_q)
        if blocks:
            have, size = kv_cache.cu_block_nums.diff(), kv_cache.block_seq_len
        else:
            have, size = torch.full((batch,), block_table.shape[1]), source.block_size
        _validate_table("cache.cu_block_nums" if blocks else "block_table", "seq_lens", seq_lens, q_lens, have, size)
    if device.type != "cuda":
        if blocks:
            raise ValueError("cache: block-pointer ops run on CUDA tensors only")
        return reference.decode(q, kv_cache, block_table, seq_lens, softmax_scale, out=out, lse=lse,
                                **_reference_format(source))
    max_kv = (kv_cache.block_ptrs.shape[0] * kv_cache.block_seq_len if blocks
              else block_table.shape[1] * source.block_size)
    if schedule is None:
        schedule = attention_schedule(batch, s_q, heads, max_kv, device=device, arch=arch)
    ws = _workspace(workspace, schedule, device, max_kv=_schedule_cover(blocks, max_kv, validate, have, size),
                    total_tokens=batch * s_q, heads=heads)
    params = _attention_params(q, out, lse, packed=False, batch=batch, q_len=s_q, kv_lens=seq_lens,
                               cu_q_lens=None, causal=True, scale=softmax_scale, schedule=schedule)
    _launch_attention(q, params, kv_cache, source, block_table, arch, ws, schedule.smem_limits)
    return out, lse


@traceable
def prefill(q: torch.Tensor, kv_cache: Union[torch.Tensor, BlockPointerCache], block_table: Optional[torch.Tensor],
            cu_q_lens: torch.Tensor, kv_lens: torch.Tensor, softmax_scale: float, *, causal: bool = True,
            out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
            workspace: Optional[torch.Tensor] = None, schedule: Optional[AttentionSchedule] = None,
            validate: bool = False, arch: Optional[str] = None, kv_format: Optional[str] = None,
            kv_scale: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Prefill / extend attention of packed query tokens over the latent cache -> (out, lse).

    q [T, H, 576] packed over sequences (cu_q_lens int32 [B+1], ending at most at T: checked with
    ``validate=True``; rows of out/lse past cu_q_lens[B] are left untouched); kv_lens int32 [B]
    include the new tokens, already in the cache; the q tokens of sequence b are its last q_len_b
    positions: when causal, query i sees positions < kv_len - q_len + i + 1, otherwise all kv_len.
    Cache arguments (kv_format, kv_scale included) and ``arch`` as in decode. Returns out [T, H, 512] and lse [T, H] float32.
    Reference: mla_kv.reference.prefill.
    """
    _check_arch(arch)
    _check_q(q, 3)
    tokens, heads, _ = q.shape
    softmax_scale = real("softmax_scale", softmax_scale, above=0)
    batch = _packed_batch(causal, cu_q_lens, kv_lens)
    blocks = isinstance(kv_cache, BlockPointerCache)
    device, source = _check_attention_inputs(q, kv_cache, block_table, batch, dict(
        q=q, cu_q_lens=cu_q_lens, kv_lens=kv_lens, kv_cache=None if blocks else kv_cache,
        block_table=None if blocks else block_table), kv_format, kv_scale)
    out = _result_tensor("out", out, (tokens, heads, LATENT_DIM), q.dtype, device)
    _check_vector_aligned("out", out)
    lse = _result_tensor("lse", lse, (tokens, heads), _lse_dtype(q), device)
    have = size = None
    if validate:
        cu = cu_q_lens.cpu().long()
        if int(cu[0]) != 0 or bool((cu.diff() < 0).any()) or int(cu[-1]) > tokens:
            raise ValueError(f"cu_q_lens: must start at 0, be non-decreasing and end at most at q's {tokens} tokens")
        if blocks:
            have, size = kv_cache.cu_block_nums.diff(), kv_cache.block_seq_len
        else:
            have, size = torch.full((batch,), block_table.shape[1]), source.block_size
        _validate_table("cache.cu_block_nums" if blocks else "block_table", "kv_lens", kv_lens, cu.diff(),
                        have, size)
    if device.type != "cuda":
        if blocks:
            raise ValueError("cache: block-pointer ops run on CUDA tensors only")
        return reference.prefill(q, kv_cache, block_table, cu_q_lens, kv_lens, softmax_scale, causal=causal,
                                 out=out, lse=lse, **_reference_format(source))
    max_kv = (kv_cache.block_ptrs.shape[0] * kv_cache.block_seq_len if blocks
              else block_table.shape[1] * source.block_size)
    if schedule is None:
        schedule = attention_schedule(batch, max(1, -(-tokens // batch)), heads, max_kv, total_q_tokens=tokens,
                                      device=device, arch=arch)
    ws = _workspace(workspace, schedule, device, max_kv=_schedule_cover(blocks, max_kv, validate, have, size),
                    total_tokens=tokens, heads=heads)
    params = _attention_params(q, out, lse, packed=True, batch=batch, q_len=0, kv_lens=kv_lens,
                               cu_q_lens=cu_q_lens, causal=causal, scale=softmax_scale, schedule=schedule)
    _launch_attention(q, params, kv_cache, source, block_table, arch, ws, schedule.smem_limits)
    return out, lse


@traceable
def merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor, *,
                 out: Optional[torch.Tensor] = None,
                 lse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merges two attention states over disjoint key sets -> (out, lse).

    out_* [..., D] (fp16/bf16/fp32; float64 on the CPU, with float64 lse), lse_* [...] float32
    natural log; a side with
    lse -inf counts for nothing, and both -inf give out 0, lse -inf. Reference: reference.merge_states.
    """
    _tensor("out_a", out_a)
    dtypes = _DTYPES if out_a.device.type == "cuda" else (*_DTYPES, torch.float64)
    _tensor("out_a", out_a, dtypes=dtypes, last_contiguous=True)
    _tensor("out_b", out_b, dtype=out_a.dtype, last_contiguous=True)
    for name, t, o in (("lse_a", lse_a, out_a), ("lse_b", lse_b, out_b)):
        _tensor(name, t, dtype=_lse_dtype(out_a), contiguous=True)
        if tuple(t.shape) != tuple(o.shape[:-1]):
            raise ValueError(f"{name}: shape {tuple(t.shape)} must be out's without the last dim "
                             f"{tuple(o.shape[:-1])}")
    if out_a.shape != out_b.shape:
        raise ValueError(f"out_b: shape {tuple(out_b.shape)} differs from out_a's {tuple(out_a.shape)}")
    device = _same_device(out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)
    out = _result_tensor("out", out, out_a.shape, out_a.dtype, device)
    lse = _result_tensor("lse", lse, lse_a.shape, _lse_dtype(out_a), device)
    if device.type != "cuda":
        ref_out, ref_lse = reference.merge_states(out_a, lse_a, out_b, lse_b)
        return out.copy_(ref_out), lse.copy_(ref_lse)
    _kernel_arch(device, torch.float16, None)
    rows = lse_a.numel()
    views = []
    for name, t in (("out_a", out_a), ("out_b", out_b), ("out", out)):
        try:
            views.append(t.view(rows, t.shape[-1]) if t.dim() != 2 else t)
        except RuntimeError:
            raise ValueError(f"{name}: its leading dims must flatten to rows (got strides {t.stride()})") from None
    if not lse.is_contiguous():
        raise ValueError("lse: must be contiguous")
    a, b, o = views
    p = _C.MergeParams()
    p.dtype, p.num_rows, p.dim = _c_dtype(out_a.dtype), rows, out_a.shape[-1]
    p.out_a, p.out_a_stride, p.lse_a = a.data_ptr(), a.stride(0), lse_a.data_ptr()
    p.out_b, p.out_b_stride, p.lse_b = b.data_ptr(), b.stride(0), lse_b.data_ptr()
    p.out, p.out_stride, p.lse = o.data_ptr(), o.stride(0), lse.data_ptr()
    with torch.cuda.device(device):
        _C.merge_states(p, _stream(device))
    return out, lse
