"""The attention ops: the split-KV schedule, decode and prefill over the latent cache, merge_states, and sparse
attention (DeepSeek Sparse Attention: each query token attends to the rows its index row names, on the same
kernels, which read each token's indexed rows instead of a sequence's positions: csrc/kernels/address.cuh)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Optional, Tuple, Union

import torch

from .. import reference
from .._checks import integer, real
from .._compiled import _C
from ..gpus import AttentionTiles, LimitsSpec, SmemLimits, c_limits, smem_limits as _smem_limits
from ..layout import LATENT_DIM, BlockPointerCache, check_kv_format
from ._common import (_DTYPES, CacheSource, _blocks_cache, _c_dtype, _c_format, _check_arch,
                      _check_attention_inputs, _check_lens, _check_q, _check_vector_aligned, _kernel_arch, _lse_dtype,
                      _packed_batch, _paged_cache, _result_tensor, _same_device, _size, _stream, _tensor,
                      _validate_table, traceable)


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
    # "lengths": a work plan made on the GPU from each call's lengths (attention_plan) spreads the
    # batch's tokens over the GPU, so one long sequence among short ones no longer sets the time; it
    # lives at the head of the workspace (plan_bytes), the partial states after it. "uniform": every
    # sequence is cut into the same num_splits x tokens_per_split (sized by max_kv_len).
    split: str = "uniform"
    plan_bytes: int = 0
    kv_format: Optional[str] = None  # the cache format a "lengths" schedule was sized for
    packed: bool = False             # made for prefill (total_q_tokens given)
    _plan_sizes: object = field(default=None, repr=False, compare=False)
    _shape: tuple = field(default=(), repr=False, compare=False)  # (batch, q_len, num_heads, total_q_tokens)


@dataclass(frozen=True)
class AttentionPlan:
    """The work plan of one step's lengths (attention_plan), in ``workspace``: every layer of the step
    passes it to decode / prefill (plan=...), which then reuse it without planning again."""

    schedule: AttentionSchedule
    workspace: torch.Tensor
    batch: int
    causal: bool


_TILE_LOADS = {"auto": "auto", "cp.async": "cp_async"}  # name -> _C.TileLoads member
_SPLITS = ("lengths", "uniform")
_PLAN_ALIGN = 256  # the partial states start this far into the workspace, past the plan


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
                       tile_loads: str = "auto", kv_format: Optional[str] = None,
                       split: str = "lengths") -> AttentionSchedule:
    """The split-KV plan of decode/prefill for these sizes on ``device`` (default: current GPU).

    max_kv_len bounds every sequence's kv length (decode uses block_table width x block_size);
    total_q_tokens is batch * q_len for decode and T for prefill. A schedule plans kernel launches, so
    it needs a CUDA device (CPU tensors run the reference, which takes none). ``smem_limits`` (a GPU
    class name of mla_kv.gpus.gpu_classes(), or byte limits) plans, and makes the launch take, the
    tiles of a GPU with that much shared memory; by default the device's own. ``tile_loads``: "auto",
    or "cp.async" to keep the Hopper kernel's paged-cache tiles off TMA (measurement).
    ``split``: "lengths" (default) sizes a work plan that follows each call's lengths (its workspace
    holds the plan and the partial states; pass the cache's ``kv_format``, which sets the rows per
    CTA on Hopper); "uniform" cuts every sequence alike, from max_kv_len (the batch is larger than
    mla_kv's plan takes, _C.max_plan_batch, falls back to it).
    """
    _check_arch(arch)
    batch, q_len, num_heads, max_kv_len = (integer(name, v, 0) for name, v in (
        ("batch", batch), ("q_len", q_len), ("num_heads", num_heads), ("max_kv_len", max_kv_len)))
    total = batch * q_len if total_q_tokens is None else integer("total_q_tokens", total_q_tokens, 0)
    limits = _smem_limits(smem_limits)
    if tile_loads not in _TILE_LOADS:
        raise ValueError(f"tile_loads: one of {', '.join(map(repr, _TILE_LOADS))}, got {tile_loads!r}")
    if split not in _SPLITS:
        raise ValueError(f"split: one of {', '.join(map(repr, _SPLITS))}, got {split!r}")
    check_kv_format(kv_format, "kv_format")
    device = _schedule_device(device)
    tag = _kernel_arch(device, torch.float16, arch)
    s = _C.make_attention_schedule(batch, max(q_len, 1), max(num_heads, 1), max_kv_len, _sm_count(device.index),
                                   tag, c_limits(limits))
    _check_tiles(s.tiles, tag, device, limits)
    packed = total_q_tokens is not None
    uniform = AttentionSchedule(s.num_splits, s.tokens_per_split,
                                _C.attention_workspace_size(total, num_heads, s.num_splits),
                                AttentionTiles.from_c(s.tiles), limits, tile_loads, kv_format=kv_format,
                                packed=packed)
    if split == "uniform" or batch == 0 or total == 0 or num_heads == 0:
        return uniform
    sizes = _plan_sizes(batch, q_len, num_heads, total, packed, limits, tile_loads, kv_format, tag, device)
    if sizes.block_m == 0:
        return uniform
    # Without a kv_format the workspace fits any format's plan (Hopper's quantized decode takes
    # narrower CTAs, so more of them); the plan sizes (attention_plan) are the 16-bit cache's.
    both = [sizes] if kv_format is not None else [sizes, _plan_sizes(batch, q_len, num_heads, total, packed, limits,
                                                                      tile_loads, "fp8", tag, device)]
    plan_bytes = max(-(-x.plan_bytes // _PLAN_ALIGN) * _PLAN_ALIGN for x in both if x.block_m)
    partial_bytes = max(x.workspace_bytes for x in both if x.block_m)
    return replace(uniform, split="lengths", plan_bytes=plan_bytes, workspace_bytes=plan_bytes + partial_bytes,
                   _plan_sizes=sizes, _shape=(batch, q_len, num_heads, total))


def _plan_sizes(batch, q_len, heads, total, packed, limits, tile_loads, kv_format, tag, device):
    """The plan capacities (_C.AttentionPlanSizes) of launches of these sizes on ``device``."""
    p = _C.AttentionParams()
    p.batch, p.num_heads, p.q_len, p.total_q_tokens = batch, heads, 0 if packed else q_len, total
    p.cu_q_lens = 16 if packed else 0  # (sizes only, from whether it is null: never read here)
    p.smem_limits = c_limits(limits)
    p.tile_loads = getattr(_C.TileLoads, _TILE_LOADS[tile_loads])
    fmt = _C.KvFormat.none if kv_format is None else getattr(_C.KvFormat, kv_format)
    return _C.attention_plan_sizes(p, fmt, tag, _sm_count(device.index))


def _attention_launch(params, rows: str, c_cache, kv_format, tag, device, limits: Optional[SmemLimits]):
    """What the launch will run: the C++ dispatch room's one answer (_C.attention_launch: kernel, tiles,
    tile loads, the splits' merge) for this launch over ``c_cache`` (a _C.PagedCache or BlockPointerCache).
    Raises when no tile configuration of the variant fits the shared memory it may use."""
    kind = getattr(_C.CacheRows, rows)
    paged = c_cache if kind == _C.CacheRows.paged_table else None
    launch = _C.attention_launch(params, kind, _c_format(kv_format, None)[0], paged, tag)
    _check_tiles(launch.tiles, tag, device, limits)
    return launch


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
                          device: Union[None, str, int, torch.device] = None, arch: Optional[str] = None,
                          kv_format: Optional[str] = None) -> int:
    """Bytes of ``workspace`` decode's default schedule needs for these sizes (its plan and partial states)."""
    return attention_schedule(batch, q_len, num_heads, max_kv_len, device=device, arch=arch,
                              kv_format=kv_format).workspace_bytes


def _schedule_cover(blocks, max_kv, validate, have, size) -> int:
    """The kv positions a schedule must cover: the block table's width for the paged layout; for
    block pointers the longest block list, known on the host only with validate=True (else 0)."""
    if not blocks:
        return max_kv
    return int(have.max()) * size if validate and have.numel() else 0


def _workspace(workspace, schedule: AttentionSchedule, device, *, max_kv, total_tokens, heads, plan_sizes=None,
               exact=False):
    """Checks a (possibly hand-made) schedule against the launch, then returns the workspace tensor
    (None when the schedule does not split the KV). One allocated here must stay referenced by the
    caller until the launch is queued: torch then reuses its memory only in the stream's order, after
    the kernels that use it (the caching allocator), or frees it with a synchronizing cudaFree."""
    if not isinstance(schedule, AttentionSchedule):
        raise ValueError(f"schedule: expected an AttentionSchedule (mla_kv.attention_schedule), got {schedule!r}")
    if schedule.tile_loads not in _TILE_LOADS:
        raise ValueError(f"schedule: tile_loads must be one of {', '.join(map(repr, _TILE_LOADS))}, got "
                         f"{schedule.tile_loads!r}")
    if schedule.split not in _SPLITS:
        raise ValueError(f"schedule: split must be one of {', '.join(map(repr, _SPLITS))}, got {schedule.split!r}")
    if schedule.split == "lengths":
        return _plan_workspace(workspace, schedule, device, plan_sizes, exact)
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
    return _workspace_tensor(workspace, schedule, device)


def _workspace_tensor(workspace, schedule: AttentionSchedule, device) -> torch.Tensor:
    if workspace is None:  # a CUDA graph should pass one sized by attention_schedule()
        workspace = torch.empty(schedule.workspace_bytes, dtype=torch.uint8, device=device)
    _tensor("workspace", workspace, dims=1, contiguous=True)
    if workspace.numel() * workspace.element_size() < schedule.workspace_bytes or workspace.device != device:
        raise ValueError(f"workspace: needs {schedule.workspace_bytes} bytes on {device}, got "
                         f"{workspace.numel() * workspace.element_size()} on {workspace.device}")
    if workspace.data_ptr() % 16:
        raise ValueError("workspace: must be 16-byte aligned")
    return workspace


def _plan_workspace(workspace, schedule: AttentionSchedule, device, plan_sizes, exact) -> torch.Tensor:
    """The workspace of a "lengths" schedule, checked against the plan the launch needs (exact: the
    plan was made already, with the schedule's sizes)."""
    have = schedule._plan_sizes
    if have is None:
        raise ValueError('schedule: a split="lengths" schedule comes from attention_schedule() (it carries the '
                         "plan's sizes)")
    fields = ("block_m", "target_ctas", "max_items", "max_slots", "max_units", "max_rows")
    same = plan_sizes is not None and all(getattr(have, f) == getattr(plan_sizes, f) for f in fields)
    fits = plan_sizes is not None and plan_sizes.block_m and plan_sizes.plan_bytes <= schedule.plan_bytes and \
        plan_sizes.workspace_bytes <= schedule.workspace_bytes - schedule.plan_bytes
    if not (same if exact else fits):
        want = "none" if plan_sizes is None else f"{plan_sizes.block_m} rows per CTA, {plan_sizes.max_items} items"
        raise ValueError(f"{'plan' if exact else 'schedule'}: sized for {have.block_m} rows per CTA and "
                         f"{have.max_items} items (kv_format {schedule.kv_format!r}); this launch needs {want}: make "
                         "the schedule with this launch's sizes and kv_format")
    return _workspace_tensor(workspace, schedule, device)


def _launch_plan_sizes(schedule, q, *, batch, q_len, total, packed, kv_format, tag):
    """The plan sizes a launch on ``tag`` (a resolved _C.Arch) needs (None for a uniform schedule)."""
    if schedule.split != "lengths":
        return None
    return _plan_sizes(batch, q_len, q.shape[-2], total, packed, schedule.smem_limits, schedule.tile_loads,
                       kv_format, tag, q.device)


def _attention_params(q, out, lse, *, packed, batch, q_len, kv_lens, cu_q_lens, causal, scale, schedule):
    p = _C.AttentionParams()
    p.dtype = _c_dtype(q.dtype)
    p.batch, p.num_heads, p.q_len = batch, q.shape[-2], q_len
    p.kv_lens, p.causal, p.softmax_scale = 0 if kv_lens is None else kv_lens.data_ptr(), causal, float(scale)
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
    elif q.dim() == 3:  # one query token per sequence (sparse attention): the token's strides on b
        p.cu_q_lens, p.total_q_tokens = 0, batch
        p.q_stride_b, p.q_stride_t, p.q_stride_h = q.stride(0), 0, q.stride(1)
        p.out_stride_b, p.out_stride_t, p.out_stride_h = out.stride(0), 0, out.stride(1)
        p.lse_stride_b, p.lse_stride_t, p.lse_stride_h = lse.stride(0), 0, lse.stride(1)
    else:
        p.cu_q_lens, p.total_q_tokens = 0, batch * q_len
        p.q_stride_b, p.q_stride_t, p.q_stride_h = q.stride(0), q.stride(1), q.stride(2)
        p.out_stride_b, p.out_stride_t, p.out_stride_h = out.stride(0), out.stride(1), out.stride(2)
        p.lse_stride_b, p.lse_stride_t, p.lse_stride_h = lse.stride(0), lse.stride(1), lse.stride(2)
    return p


def _launch_attention(q, params, cache, source: CacheSource, block_table, tag, workspace,
                      limits: Optional[SmemLimits], schedule: AttentionSchedule, plan_sizes=None,
                      plan: Optional[AttentionPlan] = None):
    """Launches with ``workspace`` (a tensor, or None when the KV is not split): an argument here, so
    one the op allocated stays referenced until its launches are queued (see _workspace). A "lengths"
    schedule's plan is made first at the workspace's head, unless ``plan`` holds this step's."""
    params.workspace = 0 if workspace is None else workspace.data_ptr()
    if plan_sizes is not None:
        params.plan, params.plan_sizes = workspace.data_ptr(), plan_sizes
        params.workspace = workspace.data_ptr() + schedule.plan_bytes
    blocks = isinstance(cache, BlockPointerCache)
    c_cache = _blocks_cache(cache) if blocks else _paged_cache(cache, source.kv_format, source.kv_scale,
                                                               source.block_size)
    _attention_launch(params, "block_pointers" if blocks else "paged_table", c_cache, source.kv_format, tag,
                      q.device, limits)
    with torch.cuda.device(q.device):
        if plan_sizes is not None and plan is None:
            _C.attention_plan(params, _stream(q.device))
        if blocks:
            _C.attention_blocks(params, c_cache, tag, _stream(q.device))
        else:
            _C.attention_paged(params, c_cache, block_table.data_ptr(), block_table.stride(0), block_table.shape[1],
                               tag, _stream(q.device))


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
           kv_scale: Optional[float] = None,
           plan: Optional[AttentionPlan] = None) -> Tuple[torch.Tensor, torch.Tensor]:
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
    The default schedule plans the work on the GPU from seq_lens at each call (attention_schedule's
    split="lengths"); ``plan`` (attention_plan of these seq_lens, made once per step) lets every layer
    of a step reuse one plan and its workspace.
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
    schedule, workspace = _planned(plan, schedule, workspace, batch=batch, packed=False, causal=True)
    if device.type != "cuda":
        if blocks:
            raise ValueError("cache: block-pointer ops run on CUDA tensors only")
        return reference.decode(q, kv_cache, block_table, seq_lens, softmax_scale, out=out, lse=lse,
                                **_reference_format(source))
    max_kv = (kv_cache.block_ptrs.shape[0] * kv_cache.block_seq_len if blocks
              else block_table.shape[1] * source.block_size)
    if schedule is None:
        schedule = attention_schedule(batch, s_q, heads, max_kv, device=device, arch=arch, kv_format=source.kv_format)
    tag = _kernel_arch(q.device, q.dtype, arch)
    sizes = _launch_plan_sizes(schedule, q, batch=batch, q_len=s_q, total=batch * s_q, packed=False,
                               kv_format=source.kv_format, tag=tag)
    ws = _workspace(workspace, schedule, device, max_kv=_schedule_cover(blocks, max_kv, validate, have, size),
                    total_tokens=batch * s_q, heads=heads, plan_sizes=sizes, exact=plan is not None)
    params = _attention_params(q, out, lse, packed=False, batch=batch, q_len=s_q, kv_lens=seq_lens,
                               cu_q_lens=None, causal=True, scale=softmax_scale, schedule=schedule)
    _launch_attention(q, params, kv_cache, source, block_table, tag, ws, schedule.smem_limits, schedule, sizes, plan)
    return out, lse


def _planned(plan, schedule, workspace, *, batch, packed, causal):
    """(schedule, workspace) of a call given ``plan`` (made by attention_plan for this step)."""
    if plan is None:
        return schedule, workspace
    if not isinstance(plan, AttentionPlan):
        raise ValueError(f"plan: expected an AttentionPlan (mla_kv.attention_plan), got {plan!r}")
    if schedule is not None and schedule != plan.schedule:
        raise ValueError("schedule: differs from the plan's (pass the plan alone)")
    if workspace is not None and workspace is not plan.workspace:
        raise ValueError("workspace: a plan lives in its own workspace (pass the plan alone)")
    if plan.schedule.packed != packed or plan.batch != batch or plan.causal != causal:
        what = "prefill" if plan.schedule.packed else "decode"
        raise ValueError(f"plan: made for {what} of {plan.batch} sequences (causal={plan.causal}); this call is "
                         f"{'prefill' if packed else 'decode'} of {batch} (causal={causal})")
    return plan.schedule, plan.workspace


def attention_plan(schedule: AttentionSchedule, seq_lens: torch.Tensor, *, cu_q_lens: Optional[torch.Tensor] = None,
                   causal: bool = True, workspace: Optional[torch.Tensor] = None) -> AttentionPlan:
    """The work plan of one step's lengths, made on the GPU (one small kernel, no host sync: a CUDA graph
    replayed with new lengths follows them) in ``workspace`` (schedule.workspace_bytes; allocated when
    None). ``schedule``: attention_schedule(..., split="lengths") of the step's sizes; seq_lens int32 [B]
    (prefill: kv_lens, with cu_q_lens int32 [B + 1]; causal as the prefill call's). Pass the plan to every
    layer's decode / prefill of the step (plan=...); the lengths must be the ones it was made from."""
    if not isinstance(schedule, AttentionSchedule) or schedule.split != "lengths" or schedule._plan_sizes is None:
        raise ValueError('schedule: expected attention_schedule(..., split="lengths") (an AttentionSchedule that '
                         f"plans), got {schedule!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    batch, q_len, heads, total = schedule._shape
    _check_lens("seq_lens", seq_lens, batch)
    if schedule.packed:
        if cu_q_lens is None:
            raise ValueError("cu_q_lens: a prefill schedule (total_q_tokens) plans packed sequences: pass cu_q_lens")
        _tensor("cu_q_lens", cu_q_lens, dims=1, dtype=torch.int32, contiguous=True)
        _size("cu_q_lens", cu_q_lens, 0, batch + 1)
    elif cu_q_lens is not None:
        raise ValueError("cu_q_lens: a decode schedule plans q_len tokens per sequence; it takes no cu_q_lens")
    elif not causal:
        raise ValueError("causal: decode is causal")
    device = _same_device(seq_lens=seq_lens, **({} if cu_q_lens is None else dict(cu_q_lens=cu_q_lens)))
    if device.type != "cuda":
        raise ValueError("seq_lens: a plan is made on the GPU for the kernels (CPU tensors run the reference, which "
                         "takes none)")
    workspace = _workspace_tensor(workspace, schedule, device)
    p = _C.AttentionParams()
    p.batch, p.num_heads, p.q_len, p.total_q_tokens = batch, heads, 0 if schedule.packed else q_len, total
    p.kv_lens, p.causal = seq_lens.data_ptr(), causal
    p.cu_q_lens = 0 if cu_q_lens is None else cu_q_lens.data_ptr()
    p.plan, p.plan_sizes = workspace.data_ptr(), schedule._plan_sizes
    with torch.cuda.device(device):
        _C.attention_plan(p, _stream(device))
    return AttentionPlan(schedule, workspace, batch, causal)


@traceable
def prefill(q: torch.Tensor, kv_cache: Union[torch.Tensor, BlockPointerCache], block_table: Optional[torch.Tensor],
            cu_q_lens: torch.Tensor, kv_lens: torch.Tensor, softmax_scale: float, *, causal: bool = True,
            out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
            workspace: Optional[torch.Tensor] = None, schedule: Optional[AttentionSchedule] = None,
            validate: bool = False, arch: Optional[str] = None, kv_format: Optional[str] = None,
            kv_scale: Optional[float] = None,
           plan: Optional[AttentionPlan] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Prefill / extend attention of packed query tokens over the latent cache -> (out, lse).

    q [T, H, 576] packed over sequences (cu_q_lens int32 [B+1], ending at most at T: checked with
    ``validate=True``; rows of out/lse past cu_q_lens[B] are left untouched); kv_lens int32 [B]
    include the new tokens, already in the cache; the q tokens of sequence b are its last q_len_b
    positions: when causal, query i sees positions < kv_len - q_len + i + 1, otherwise all kv_len.
    Cache arguments (kv_format, kv_scale included), ``arch`` and ``plan`` (attention_plan with cu_q_lens) as in
    decode. Returns out [T, H, 512] and lse [T, H] float32.
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
    schedule, workspace = _planned(plan, schedule, workspace, batch=batch, packed=True, causal=causal)
    if device.type != "cuda":
        if blocks:
            raise ValueError("cache: block-pointer ops run on CUDA tensors only")
        return reference.prefill(q, kv_cache, block_table, cu_q_lens, kv_lens, softmax_scale, causal=causal,
                                 out=out, lse=lse, **_reference_format(source))
    max_kv = (kv_cache.block_ptrs.shape[0] * kv_cache.block_seq_len if blocks
              else block_table.shape[1] * source.block_size)
    q_len = max(1, -(-tokens // batch))
    if schedule is None:
        schedule = attention_schedule(batch, q_len, heads, max_kv, total_q_tokens=tokens, device=device, arch=arch,
                                      kv_format=source.kv_format)
    tag = _kernel_arch(q.device, q.dtype, arch)
    sizes = _launch_plan_sizes(schedule, q, batch=batch, q_len=q_len, total=tokens, packed=True,
                               kv_format=source.kv_format, tag=tag)
    ws = _workspace(workspace, schedule, device, max_kv=_schedule_cover(blocks, max_kv, validate, have, size),
                    total_tokens=tokens, heads=heads, plan_sizes=sizes, exact=plan is not None)
    params = _attention_params(q, out, lse, packed=True, batch=batch, q_len=0, kv_lens=kv_lens,
                               cu_q_lens=cu_q_lens, causal=causal, scale=softmax_scale, schedule=schedule)
    _launch_attention(q, params, kv_cache, source, block_table, tag, ws, schedule.smem_limits, schedule, sizes, plan)
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


# ------------------------------------------------------------------------- sparse attention
def sparse_attention_schedule(num_tokens: int, num_heads: int, topk: int, *,
                              device: Union[None, str, int, torch.device] = None, arch: Optional[str] = None,
                              smem_limits: LimitsSpec = None) -> AttentionSchedule:
    """The split of sparse_attention's index rows over CTAs for these sizes (from sizes only: make it, and
    its workspace, outside a CUDA graph). Few tokens x heads cut each token's topk rows into pieces that
    fill the GPU, merged by lse; arguments as attention_schedule's."""
    return attention_schedule(num_tokens, 1, num_heads, topk, device=device, arch=arch, smem_limits=smem_limits,
                              split="uniform")


def _validate_indices(indices, topk_lens, cu_q_lens, kv_cache, source, tokens) -> None:
    """Host checks of device data (validate=True): every index read names a row or is -1."""
    idx = indices.cpu().long()
    counts = torch.full((tokens,), idx.shape[1]) if topk_lens is None else topk_lens.cpu().long()
    if bool((counts < 0).any()) or bool((counts > idx.shape[1]).any()):
        raise ValueError(f"topk_lens: must be in [0, {idx.shape[1]}] (indices' columns), got {counts.tolist()}")
    read = torch.arange(idx.shape[1])[None, :] < counts[:, None]
    if isinstance(kv_cache, BlockPointerCache):
        cu = cu_q_lens.cpu().long()
        if int(cu[0]) != 0 or bool((cu.diff() < 0).any()) or int(cu[-1]) > tokens:
            raise ValueError(f"cu_q_lens: must start at 0, be non-decreasing and end at most at q's {tokens} tokens")
        have = kv_cache.cu_block_nums.cpu().long().diff() * kv_cache.block_seq_len
        limit = torch.zeros(tokens, dtype=torch.long)
        for b in range(cu.shape[0] - 1):
            limit[int(cu[b]):int(cu[b + 1])] = have[b]
        what = "positions of the token's sequence"
    else:
        limit = torch.full((tokens,), kv_cache.shape[0] * source.block_size)
        what = "slots of the cache"
    bad = read & (idx != -1) & ((idx < 0) | (idx >= limit[:, None]))
    if bool(bad.any()):
        t, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"indices: [{t}, {j}] = {int(idx[t, j])} names no row ({what} are [0, {int(limit[t])}); "
                         "-1 marks an empty entry)")


@traceable
def sparse_attention(q: torch.Tensor, kv_cache: Union[torch.Tensor, BlockPointerCache], indices: torch.Tensor,
                     softmax_scale: float, *, topk_lens: Optional[torch.Tensor] = None,
                     cu_q_lens: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                     lse: Optional[torch.Tensor] = None, workspace: Optional[torch.Tensor] = None,
                     schedule: Optional[AttentionSchedule] = None, validate: bool = False,
                     arch: Optional[str] = None, kv_format: Optional[str] = None,
                     kv_scale: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention: query token t attends only to the cache rows indices[t] names -> (out, lse).

    One call serves decode (T = batch), multi-token decode and prefill (T = packed tokens). q [T, H, 576]
    = [q_lat | q_pe] (fp16, or bf16 on sm80+); indices int32 [T, k] (any row stride, last dim
    contiguous), -1 = no row. A paged kv_cache [num_blocks, block_size, 576] (or a quantized one:
    ``kv_format``, ``kv_scale`` as in decode) takes physical slots, block * block_size + offset (FlashMLA's
    and vLLM's form); a layout.BlockPointerCache takes positions in each token's sequence, with cu_q_lens
    int32 [B + 1] saying which tokens are sequence b's (TurboMind's form; tokens past cu_q_lens[B] get out
    0 and lse -inf). topk_lens int32 [T] (optional): token t reads only indices[t, :topk_lens[t]].
    An index that names no row (-1, a slot or position outside the cache) is left out of the softmax and
    never read; ``validate=True`` raises for any but -1 instead (a host sync). An index repeated counts each
    time. A token with no row gets out 0 and lse -inf. Returns out [T, H, 512] (q's dtype) and lse [T, H]
    float32 (natural log). For CUDA graphs pass ``workspace`` and ``schedule`` from
    sparse_attention_schedule(T, H, k). ``arch`` forces a kernel variant ("sm70", "sm75", "sm80", "sm90").
    Reference: mla_kv.reference.sparse_attention (and sparse_attention_blocks).
    """
    _check_arch(arch)
    _check_q(q, 3)
    tokens, heads, _ = q.shape
    softmax_scale = real("softmax_scale", softmax_scale, above=0)
    _tensor("indices", indices, dims=2, dtype=torch.int32, last_contiguous=True)
    _size("indices", indices, 0, tokens)
    topk = indices.shape[1]
    if topk_lens is not None:
        _check_lens("topk_lens", topk_lens, tokens)
    blocks = isinstance(kv_cache, BlockPointerCache)
    if blocks:
        if cu_q_lens is None:
            raise ValueError("cu_q_lens: a BlockPointerCache's indices are positions of each token's sequence: pass "
                             "cu_q_lens int32 [B + 1]")
        _check_lens("cu_q_lens", cu_q_lens, kv_cache.batch + 1)
    elif cu_q_lens is not None:
        raise ValueError("cu_q_lens: a paged cache's indices are physical slots; cu_q_lens belongs to a "
                         "BlockPointerCache")
    extra = {k: v for k, v in (("topk_lens", topk_lens), ("cu_q_lens", cu_q_lens)) if v is not None}
    device, source = _check_attention_inputs(
        q, kv_cache, indices, kv_cache.batch if blocks else tokens,
        dict(q=q, indices=indices, kv_cache=None if blocks else kv_cache, **extra), kv_format, kv_scale,
        table_name="indices")
    out = _result_tensor("out", out, (tokens, heads, LATENT_DIM), q.dtype, device)
    _check_vector_aligned("out", out)
    lse = _result_tensor("lse", lse, (tokens, heads), _lse_dtype(q), device)
    if validate:
        _validate_indices(indices, topk_lens, cu_q_lens, kv_cache, source, tokens)
    if device.type != "cuda":
        if blocks:
            raise ValueError("cache: block-pointer ops run on CUDA tensors only")
        return reference.sparse_attention(q, kv_cache, indices, softmax_scale, topk_lens=topk_lens, out=out, lse=lse,
                                          **_reference_format(source))
    if schedule is None:
        schedule = sparse_attention_schedule(tokens, heads, topk, device=device, arch=arch)
    elif schedule.split != "uniform":
        raise ValueError("schedule: sparse attention splits each token's rows alike: pass "
                         "sparse_attention_schedule(T, H, k)")
    ws = _workspace(workspace, schedule, device, max_kv=topk, total_tokens=tokens, heads=heads)
    params = _attention_params(q, out, lse, packed=False, batch=tokens, q_len=1, kv_lens=topk_lens, cu_q_lens=None,
                               causal=False, scale=softmax_scale, schedule=schedule)
    params.workspace = 0 if ws is None else ws.data_ptr()
    tag = _kernel_arch(device, q.dtype, arch)
    c_cache = _blocks_cache(kv_cache) if blocks else _paged_cache(kv_cache, source.kv_format, source.kv_scale,
                                                                  source.block_size)
    _attention_launch(params, "sparse_blocks" if blocks else "sparse_slots", c_cache, source.kv_format, tag, device,
                      schedule.smem_limits)
    with torch.cuda.device(device):
        if blocks:
            _C.sparse_attention_blocks(params, c_cache, indices.data_ptr(), indices.stride(0), topk,
                                       cu_q_lens.data_ptr(), tag, _stream(device))
        else:
            _C.sparse_attention(params, c_cache, indices.data_ptr(), indices.stride(0), topk, tag, _stream(device))
    return out, lse
