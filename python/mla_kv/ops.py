"""The torch-facing ops: argument validation, then dispatch to the CUDA kernels or the reference.

Every op checks its arguments before anything is launched or written and raises a ValueError or
TypeError naming the bad argument. CUDA tensors go to the compiled kernels; CPU tensors run the
pure-PyTorch reference (mla_kv.reference), which is also the specification of each op.

Bounds that need device data (slot values, positions, block-table lengths) are checked only with
``validate=True`` (a host synchronization); without it the kernels never read or write outside the
cache and the outputs: writes skip out-of-range rows, gather leaves the rows it cannot find untouched,
and attention reads a position with no block as a zero row (a finite but unspecified result). Ops do
no host synchronization or allocation otherwise, so they can be captured in CUDA graphs.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from . import reference
from ._checks import integer, real
from .gpus import AttentionTiles, LimitsSpec, SmemLimits, c_limits, smem_limits as _smem_limits
from .layout import LATENT_DIM, ROPE_DIM, ROW_DIM, BlockPointerCache

try:  # the compiled kernels are absent in a reference-only install
    from . import _C
except ImportError:  # pragma: no cover - depends on the build
    _C = None

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ROPE_STYLES = ("interleaved", "neox")
_ARCH_TAGS = ("sm70", "sm75", "sm80", "sm90")


def kernels_available() -> bool:
    """True when the package was built with its CUDA kernels."""
    return _C is not None


# ----------------------------------------------------------------------------------- checks
def _tensor(name: str, t, *, dims: Optional[int] = None, dtype=None, dtypes=None,
            last_contiguous: bool = False, contiguous: bool = False) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dims, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: dtype must be one of {', '.join(map(str, dtypes))}, got {t.dtype}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (got strides {t.stride()})")
    if last_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim must be contiguous (got strides {t.stride()})")
    return t


def _size(name: str, t: torch.Tensor, dim: int, expected: int, *, at_least: bool = False) -> None:
    got = t.shape[dim]
    if (got < expected) if at_least else (got != expected):
        need = f">= {expected}" if at_least else str(expected)
        raise ValueError(f"{name}: dim {dim} must be {need}, got shape {tuple(t.shape)}")


def _same_device(**tensors) -> torch.device:
    items = [(n, t) for n, t in tensors.items() if t is not None]
    device = items[0][1].device
    for name, t in items[1:]:
        if t.device != device:
            raise ValueError(f"{name}: on {t.device}, expected {device} like {items[0][0]}")
    return device


def _aligned(name: str, t: torch.Tensor, elems: int) -> None:
    """Kernels access at least two elements at a time: addresses and strides must allow it."""
    if t.data_ptr() % (elems * t.element_size()) or any(s % elems for s in t.stride()[:-1]):
        raise ValueError(f"{name}: data pointer and strides must be multiples of {elems} elements "
                         f"(got strides {t.stride()})")


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor


def _kernel_arch(device: torch.device, dtype: torch.dtype, arch: Optional[str]):
    """The _C.Arch to launch on ``device``; checks the build, the GPU, the tag and bf16 support."""
    if _C is None:
        raise RuntimeError("mla_kv was installed without its CUDA kernels (no CUDA compiler at build "
                           "time): CUDA tensors cannot be processed; reinstall with nvcc on PATH, or "
                           "pass CPU tensors to run the reference")
    if arch is not None and arch not in _ARCH_TAGS:
        raise ValueError(f"arch: must be one of {', '.join(_ARCH_TAGS)} or None, got {arch!r}")
    cc = _capability(device.index if device.index is not None else torch.cuda.current_device())
    tag = _C.resolve_arch(getattr(_C.Arch, arch) if arch else _C.Arch.auto, cc)
    if tag == _C.Arch.auto:
        raise ValueError(f"arch: no {arch or 'kernel'} variant runs on this sm_{cc} GPU in this build "
                         f"(compiled for {_C.compiled_cuda_archs()})")
    if dtype == torch.bfloat16 and int(tag) < 80:
        raise TypeError(f"dtype: bfloat16 needs the sm80 kernels (Ampere or newer), this call uses "
                        f"{tag.name} on an sm_{cc} GPU; use float16 or float32")
    return tag


def _c_dtype(dtype: torch.dtype):
    return getattr(_C.DType, str(dtype).split(".")[1])


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


# ----------------------------------------------------------------------------------- write
def _check_rows(kv_c, k_pe, num_tokens: int, dtype) -> None:
    _tensor("kv_c", kv_c, dims=2, dtype=dtype, last_contiguous=True)
    _tensor("k_pe", k_pe, dims=2, dtype=dtype, last_contiguous=True)
    _size("kv_c", kv_c, 1, LATENT_DIM)
    _size("k_pe", k_pe, 1, ROPE_DIM)
    _size("kv_c", kv_c, 0, num_tokens, at_least=True)
    _size("k_pe", k_pe, 0, num_tokens, at_least=True)


def _check_paged_cache(kv_cache) -> None:
    _tensor("kv_cache", kv_cache)
    dtypes = _DTYPES if kv_cache.device.type == "cuda" else (*_DTYPES, torch.float64)
    _tensor("kv_cache", kv_cache, dims=3, dtypes=dtypes, last_contiguous=True)
    _size("kv_cache", kv_cache, 2, ROW_DIM)


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
        rms_weight, eps, positions, cos_sin_cache, rope_style, q = fused
        p.rms_weight, p.rms_eps = rms_weight.data_ptr(), float(eps)
        p.positions = positions.data_ptr()
        p.cos_sin, p.cos_sin_fp32 = cos_sin_cache.data_ptr(), cos_sin_cache.dtype == torch.float32
        p.max_position = cos_sin_cache.shape[0]
        p.rope_style = getattr(_C.RopeStyle, rope_style)
        if q is not None:
            p.q, p.q_heads, p.q_head_dim = q.data_ptr(), q.shape[1], q.shape[2]
            p.q_stride_token, p.q_stride_head = q.stride(0), q.stride(1)
    return p


def _paged_cache(kv_cache):
    esz = kv_cache.element_size()
    row = _C.RowLayout(0, LATENT_DIM, kv_cache.stride(1) * esz)
    return _C.PagedCache(kv_cache.data_ptr(), kv_cache.shape[0], kv_cache.shape[1],
                         kv_cache.stride(0) * esz, row)


def _blocks_cache(cache: BlockPointerCache):
    row = _C.RowLayout(cache.latent_offset, cache.rope_offset, cache.row_stride_bytes)
    return _C.BlockPointerCache(cache.block_ptrs.data_ptr(), cache.cu_block_nums.data_ptr(), cache.batch,
                                cache.block_seq_len, cache.layer_offset_bytes, row)


def _write_paged(kv_c, k_pe, kv_cache, slot_mapping, fused, validate, arch) -> bool:
    """Launches the kernel for CUDA tensors; returns False when the caller must run the reference."""
    num_tokens = slot_mapping.shape[0]
    if validate and num_tokens:
        capacity = kv_cache.shape[0] * kv_cache.shape[1]
        if int(slot_mapping.max()) >= capacity:
            raise ValueError(f"slot_mapping: slot {int(slot_mapping.max())} >= cache capacity {capacity}")
        if fused is not None:
            _validate_positions(fused[2], num_tokens, fused[3])
    if kv_cache.device.type != "cuda":
        return False
    tag = _kernel_arch(kv_cache.device, kv_cache.dtype, arch)
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe), ("kv_cache", kv_cache)):
        _aligned(name, t, 2)
    if fused is not None and fused[5] is not None:
        _aligned("q", fused[5], 2)
    with torch.cuda.device(kv_cache.device):
        _C.write_kv_paged(_params(kv_c, k_pe, num_tokens, fused), _paged_cache(kv_cache),
                          slot_mapping.data_ptr(), tag, _stream(kv_cache.device))
    return True


def write_kv(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, validate: bool = False, arch: Optional[str] = None) -> None:
    """Writes rows [kv_c | k_pe] (already normalized and rotated) into a paged cache, in place.

    kv_c [>=T, 512], k_pe [>=T, 64] (any row strides, last dim contiguous), kv_cache
    [num_blocks, block_size, 576] (fp16, bf16 on sm80+, fp32; same dtype as the inputs), slot_mapping
    int64 [T]: token t goes to slot slot_mapping[t] = block * block_size + offset; negative slots are
    padded tokens and are skipped. Reference: mla_kv.reference.write_kv.
    ``arch`` forces a kernel variant ("sm70", "sm75", "sm80"; "sm90" runs the sm80 kernel) for
    testing; ``validate`` checks slot values on the host first.
    """
    _check_paged_cache(kv_cache)
    _tensor("slot_mapping", slot_mapping, dims=1, dtype=torch.int64, contiguous=True)
    _check_rows(kv_c, k_pe, slot_mapping.shape[0], kv_cache.dtype)
    _same_device(kv_cache=kv_cache, kv_c=kv_c, k_pe=k_pe, slot_mapping=slot_mapping)
    if not _write_paged(kv_c, k_pe, kv_cache, slot_mapping, None, validate, arch):
        reference.write_kv(kv_c, k_pe, kv_cache, slot_mapping)


def fused_write_kv(kv_a: torch.Tensor, rms_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                   rope_style: str = "interleaved", q: Optional[torch.Tensor] = None,
                   validate: bool = False, arch: Optional[str] = None) -> None:
    """RMSNorm + RoPE + paged cache write of the kv_a projection output in one launch, in place.

    kv_a [>=T, 576] = raw kv_a_proj_with_mqa output [c_kv | k_pe] (any row stride, e.g. a column
    slice of a fused projection); rms_weight [512] (kv_a's dtype); eps >= 0 (a number as decode's
    softmax_scale); positions int64 [>=T];
    cos_sin_cache [max_position, 64] (float32 or kv_a's dtype, from mla_kv.rope.cos_sin_cache);
    kv_cache / slot_mapping as in write_kv. q [>=T, H, D] (optional, any strides, last dim
    contiguous): its last 64 values per head are rotated in place. Tokens whose position is outside
    [0, max_position) are left unwritten by the kernels (``validate=True`` raises instead).
    Reference: mla_kv.reference.fused_write_kv.
    """
    _check_paged_cache(kv_cache)
    _tensor("slot_mapping", slot_mapping, dims=1, dtype=torch.int64, contiguous=True)
    t = slot_mapping.shape[0]
    eps = _check_fused(kv_a, rms_weight, eps, positions, cos_sin_cache, t, rope_style, q, kv_cache.dtype)
    _same_device(kv_cache=kv_cache, kv_a=kv_a, rms_weight=rms_weight, positions=positions,
                 cos_sin_cache=cos_sin_cache, slot_mapping=slot_mapping, q=q)
    fused = (rms_weight, eps, positions, cos_sin_cache, rope_style, q)
    if not _write_paged(kv_a[:, :LATENT_DIM], kv_a[:, LATENT_DIM:], kv_cache, slot_mapping, fused,
                        validate, arch):
        reference.fused_write_kv(kv_a, rms_weight, eps, positions, cos_sin_cache, kv_cache, slot_mapping,
                                 rope_style=rope_style, q=q)


# ------------------------------------------------------------------ write, block pointers
def _check_block_pointer_cache(cache, dtype) -> None:
    if not isinstance(cache, BlockPointerCache):
        raise TypeError(f"cache: expected mla_kv.layout.BlockPointerCache, got {type(cache).__name__}")
    if cache.dtype != dtype:
        raise TypeError(f"cache: dtype {cache.dtype} differs from the inputs' {dtype}")
    _tensor("cache.block_ptrs", cache.block_ptrs, dims=1, dtype=torch.int64, contiguous=True)
    _tensor("cache.cu_block_nums", cache.cu_block_nums, dims=1, dtype=torch.int32, contiguous=True)
    if cache.batch < 1:
        raise ValueError("cache.cu_block_nums: needs at least 2 entries (batch >= 1)")
    if cache.block_seq_len < 1:
        raise ValueError(f"cache.block_seq_len: must be >= 1, got {cache.block_seq_len}")
    esz = torch.empty((), dtype=dtype).element_size()
    if cache.row_stride_bytes < ROW_DIM * esz or cache.row_stride_bytes % 16:
        raise ValueError(f"cache.row_stride_bytes: must be a multiple of 16 and >= {ROW_DIM * esz}, "
                         f"got {cache.row_stride_bytes}")
    if cache.layer_offset_bytes < 0 or cache.layer_offset_bytes % 16:
        raise ValueError(f"cache.layer_offset_bytes: must be a non-negative multiple of 16, "
                         f"got {cache.layer_offset_bytes}")


def _check_blocks(cache, cu_q_lens, history_lens, dtype) -> None:
    _check_block_pointer_cache(cache, dtype)
    _tensor("cu_q_lens", cu_q_lens, dims=1, dtype=torch.int32, contiguous=True)
    _tensor("history_lens", history_lens, dims=1, dtype=torch.int32, contiguous=True)
    _size("cu_q_lens", cu_q_lens, 0, cache.batch + 1)
    _size("history_lens", history_lens, 0, cache.batch)


def _validate_blocks(cache, cu_q_lens, history_lens, num_rows) -> None:
    cu_q, hist = cu_q_lens.cpu().long(), history_lens.cpu().long()
    cu_b = cache.cu_block_nums.cpu().long()
    q_lens = cu_q[1:] - cu_q[:-1]
    if int(cu_q[0]) != 0 or bool((q_lens < 0).any()):
        raise ValueError("cu_q_lens: must start at 0 and be non-decreasing")
    if int(cu_q[-1]) > num_rows:
        raise ValueError(f"cu_q_lens: {int(cu_q[-1])} tokens but the inputs have {num_rows} rows")
    if bool((hist < 0).any()):
        raise ValueError("history_lens: must be >= 0")
    need = (hist + q_lens + cache.block_seq_len - 1) // cache.block_seq_len
    have = cu_b[1:] - cu_b[:-1]
    short = (need > have).nonzero()
    if short.numel():
        b = int(short[0])
        raise ValueError(f"cache.cu_block_nums: sequence {b} has {int(have[b])} blocks but history "
                         f"{int(hist[b])} + {int(q_lens[b])} new tokens need {int(need[b])}")
    if int(cu_b[-1]) > cache.block_ptrs.shape[0]:
        raise ValueError(f"cache.cu_block_nums: ends at {int(cu_b[-1])} but block_ptrs has "
                         f"{cache.block_ptrs.shape[0]} entries")


def _write_blocks(kv_c, k_pe, cache, cu_q_lens, history_lens, fused, validate, arch) -> None:
    device = _same_device(kv_c=kv_c, k_pe=k_pe, block_ptrs=cache.block_ptrs,
                          cu_block_nums=cache.cu_block_nums, cu_q_lens=cu_q_lens,
                          history_lens=history_lens)
    if device.type != "cuda":
        raise ValueError("cache: block-pointer ops run on CUDA tensors only; on the CPU use "
                         "mla_kv.reference with a layout.BlockPool layer view")
    if validate:
        _validate_blocks(cache, cu_q_lens, history_lens, kv_c.shape[0])
        if fused is not None:
            _validate_positions(fused[2], kv_c.shape[0], fused[3])
    tag = _kernel_arch(device, kv_c.dtype, arch)
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
        _aligned(name, t, 2)
    if fused is not None and fused[5] is not None:
        _aligned("q", fused[5], 2)
    with torch.cuda.device(device):
        _C.write_kv_blocks(_params(kv_c, k_pe, kv_c.shape[0], fused), _blocks_cache(cache),
                           cu_q_lens.data_ptr(), history_lens.data_ptr(), tag, _stream(device))


def write_kv_blocks(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: BlockPointerCache,
                    cu_q_lens: torch.Tensor, history_lens: torch.Tensor, *, validate: bool = False,
                    arch: Optional[str] = None) -> None:
    """write_kv over TurboMind-style block pointers (mla_kv.layout.BlockPointerCache).

    The input rows are the new tokens packed by sequence: cu_q_lens int32 [B+1]; token i of
    sequence b lands at position history_lens[b] + i (int32 [B]). Tokens past cu_q_lens[B] and
    positions beyond a sequence's blocks are skipped (``validate=True`` raises instead).
    Reference: mla_kv.reference.write_kv on a layout.BlockPool layer view with layout.block_slots.
    """
    _tensor("kv_c", kv_c, dims=2, last_contiguous=True)
    _check_blocks(cache, cu_q_lens, history_lens, kv_c.dtype)
    _check_rows(kv_c, k_pe, kv_c.shape[0], cache.dtype)
    _write_blocks(kv_c, k_pe, cache, cu_q_lens, history_lens, None, validate, arch)


def fused_write_kv_blocks(kv_a: torch.Tensor, rms_weight: torch.Tensor, eps: float,
                          positions: torch.Tensor, cos_sin_cache: torch.Tensor, cache: BlockPointerCache,
                          cu_q_lens: torch.Tensor, history_lens: torch.Tensor, *,
                          rope_style: str = "interleaved", q: Optional[torch.Tensor] = None,
                          validate: bool = False, arch: Optional[str] = None) -> None:
    """fused_write_kv over TurboMind-style block pointers; addressing as in write_kv_blocks.

    q's rope part is rotated for every input row whose position lies in the rope table, also for
    rows past cu_q_lens[B] (a padded batch) and rows whose cache position is skipped."""
    _tensor("kv_a", kv_a, dims=2, last_contiguous=True)
    _check_blocks(cache, cu_q_lens, history_lens, kv_a.dtype)
    eps = _check_fused(kv_a, rms_weight, eps, positions, cos_sin_cache, kv_a.shape[0], rope_style, q,
                       cache.dtype)
    _same_device(kv_a=kv_a, rms_weight=rms_weight, positions=positions, cos_sin_cache=cos_sin_cache, q=q)
    fused = (rms_weight, eps, positions, cos_sin_cache, rope_style, q)
    _write_blocks(kv_a[:, :LATENT_DIM], kv_a[:, LATENT_DIM:], cache, cu_q_lens, history_lens, fused,
                  validate, arch)


# ------------------------------------------------------------------------------ attention
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
                       total_q_tokens: Optional[int] = None, device=None,
                       arch: Optional[str] = None, smem_limits: LimitsSpec = None) -> AttentionSchedule:
    """The split-KV plan of decode/prefill for these sizes on ``device`` (default: current GPU).

    max_kv_len bounds every sequence's kv length (decode uses block_table width x block_size);
    total_q_tokens is batch * q_len for decode and T for prefill. A schedule plans kernel launches, so
    it needs a CUDA device (CPU tensors run the reference, which takes none). ``smem_limits`` (a GPU
    class name of mla_kv.gpus.gpu_classes(), or byte limits) plans, and makes the launch take, the
    tiles of a GPU with that much shared memory; by default the device's own.
    """
    batch, q_len, num_heads, max_kv_len = (integer(name, v, 0) for name, v in (
        ("batch", batch), ("q_len", q_len), ("num_heads", num_heads), ("max_kv_len", max_kv_len)))
    total = batch * q_len if total_q_tokens is None else integer("total_q_tokens", total_q_tokens, 0)
    limits = _smem_limits(smem_limits)
    device = _schedule_device(device)
    tag = _kernel_arch(device, torch.float16, arch)
    s = _C.make_attention_schedule(batch, max(q_len, 1), max(num_heads, 1), max_kv_len, _sm_count(device.index),
                                   tag, c_limits(limits))
    _check_tiles(s.tiles, tag, device, limits)
    return AttentionSchedule(s.num_splits, s.tokens_per_split,
                             _C.attention_workspace_size(total, num_heads, s.num_splits),
                             AttentionTiles.from_c(s.tiles), limits)


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


def decode_workspace_size(batch: int, q_len: int, num_heads: int, max_kv_len: int, *, device=None,
                          arch: Optional[str] = None) -> int:
    """Bytes of ``workspace`` decode needs for these sizes (0 when the KV is not split)."""
    return attention_schedule(batch, q_len, num_heads, max_kv_len, device=device, arch=arch).workspace_bytes


def _lse_dtype(x: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs (the CPU reference's checking precision)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_q(q, dims) -> None:
    # The kernels take fp16/bf16; the CPU reference any float dtype (float64 for checking).
    _tensor("q", q)
    dtypes = (torch.float16, torch.bfloat16) if q.device.type == "cuda" else (*_DTYPES, torch.float64)
    _tensor("q", q, dims=dims, dtypes=dtypes, last_contiguous=True)
    _size("q", q, dims - 1, ROW_DIM)


def _result_tensor(name, given, shape, dtype, device):
    if given is None:
        return torch.empty(shape, dtype=dtype, device=device)
    _tensor(name, given, dtype=dtype, last_contiguous=True)
    if tuple(given.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(given.shape)}")
    if given.device != device:
        raise ValueError(f"{name}: on {given.device}, expected {device}")
    return given


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
    splits, tokens = schedule.num_splits, schedule.tokens_per_split
    if not 1 <= splits <= _C.max_attention_splits or tokens < 1:
        raise ValueError(f"schedule: needs 1 <= num_splits <= {_C.max_attention_splits} and tokens_per_split >= 1, "
                         f"got {splits} x {tokens}")
    if splits * tokens < max_kv:
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


def _check_lens(name, lens, batch) -> None:
    _tensor(name, lens, dims=1, dtype=torch.int32, contiguous=True)
    _size(name, lens, 0, batch)


def _validate_table(table_name, lens_name, lens, q_lens, blocks_have, block_size) -> None:
    """Host checks of device data (validate=True): lengths, q_len <= kv_len, table coverage."""
    lens, q_lens = lens.cpu().long(), q_lens.cpu().long()
    if bool((lens < 0).any()):
        raise ValueError(f"{lens_name}: must be >= 0")
    bad = (q_lens > lens).nonzero()
    if bad.numel():
        b = int(bad[0])
        raise ValueError(f"{lens_name}: sequence {b} has {int(q_lens[b])} query tokens but kv length "
                         f"{int(lens[b])} (the new tokens must already be in the cache)")
    short = ((lens + block_size - 1) // block_size > blocks_have.cpu().long()).nonzero()
    if short.numel():
        b = int(short[0])
        raise ValueError(f"{table_name}: too short for sequence {b}: {int(lens[b])} positions need "
                         f"{-(-int(lens[b]) // block_size)} blocks of {block_size}")


def _check_block_table(block_table, batch):
    _tensor("block_table", block_table, dims=2, dtype=torch.int32, last_contiguous=True)
    _size("block_table", block_table, 0, batch)


def _launch_attention(q, params, cache, block_table, arch, workspace, limits: Optional[SmemLimits]):
    """Launches with ``workspace`` (a tensor, or None when the KV is not split): an argument here, so
    one the op allocated stays referenced until its launches are queued (see _workspace)."""
    params.workspace = 0 if workspace is None else workspace.data_ptr()
    tag = _kernel_arch(q.device, q.dtype, arch)
    _check_tiles(_C.attention_launch_tiles(params, tag), tag, q.device, limits)
    with torch.cuda.device(q.device):
        if isinstance(cache, BlockPointerCache):
            _C.attention_blocks(params, _blocks_cache(cache), tag, _stream(q.device))
        else:
            _C.attention_paged(params, _paged_cache(cache), block_table.data_ptr(), block_table.stride(0),
                               block_table.shape[1], tag, _stream(q.device))


def _check_attention_inputs(q, cache, block_table, batch, device_tensors):
    if isinstance(cache, BlockPointerCache):
        _check_blocks_read(cache, q.dtype, batch)
    else:
        _check_paged_cache(cache)
        if cache.dtype != q.dtype:
            raise TypeError(f"kv_cache: dtype {cache.dtype} differs from q's {q.dtype}")
        _check_block_table(block_table, batch)
    _check_vector_aligned("q", q)
    if not isinstance(cache, BlockPointerCache):
        _check_vector_aligned("kv_cache", cache)
    return _same_device(**device_tensors)


def _check_vector_aligned(name, t) -> None:
    """The attention kernels move q, cache and out rows in 16-byte vectors."""
    if t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:-1]):
        raise ValueError(f"{name}: data pointer must be 16-byte aligned and strides multiples of 8 "
                         f"elements (got strides {t.stride()})")


def _check_blocks_read(cache, dtype, batch) -> None:
    _check_block_pointer_cache(cache, dtype)
    if cache.batch != batch:
        raise ValueError(f"cache.cu_block_nums: describes {cache.batch} sequences, q has {batch}")


def decode(q: torch.Tensor, kv_cache, block_table: Optional[torch.Tensor], seq_lens: torch.Tensor,
           softmax_scale: float, *, out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
           workspace: Optional[torch.Tensor] = None, schedule: Optional[AttentionSchedule] = None,
           validate: bool = False, arch: Optional[str] = None):
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
    kernel, TMA tile loads on paged caches).
    Reference: mla_kv.reference.decode.
    """
    _check_q(q, 4)
    batch, s_q, heads, _ = q.shape
    softmax_scale = real("softmax_scale", softmax_scale, above=0)
    _check_lens("seq_lens", seq_lens, batch)
    blocks = isinstance(kv_cache, BlockPointerCache)
    device = _check_attention_inputs(q, kv_cache, block_table, batch, dict(
        q=q, seq_lens=seq_lens, kv_cache=None if blocks else kv_cache,
        block_table=None if blocks else block_table))
    out = _result_tensor("out", out, (batch, s_q, heads, LATENT_DIM), q.dtype, device)
    _check_vector_aligned("out", out)
    lse = _result_tensor("lse", lse, (batch, s_q, heads), _lse_dtype(q), device)
    have = size = None
    if validate:
        q_lens = torch.full((batch,), s_q)
        if blocks:
            have, size = kv_cache.cu_block_nums.diff(), kv_cache.block_seq_len
        else:
            have, size = torch.full((batch,), block_table.shape[1]), kv_cache.shape[1]
        _validate_table("cache.cu_block_nums" if blocks else "block_table", "seq_lens", seq_lens, q_lens, have, size)
    if device.type != "cuda":
        if blocks:
            raise ValueError("cache: block-pointer ops run on CUDA tensors only")
        return reference.decode(q, kv_cache, block_table, seq_lens, softmax_scale, out=out, lse=lse)
    max_kv = (kv_cache.block_ptrs.shape[0] * kv_cache.block_seq_len if blocks
              else block_table.shape[1] * kv_cache.shape[1])
    if schedule is None:
        schedule = attention_schedule(batch, s_q, heads, max_kv, device=device, arch=arch)
    ws = _workspace(workspace, schedule, device, max_kv=_schedule_cover(blocks, max_kv, validate, have, size),
                    total_tokens=batch * s_q, heads=heads)
    params = _attention_params(q, out, lse, packed=False, batch=batch, q_len=s_q, kv_lens=seq_lens,
                               cu_q_lens=None, causal=True, scale=softmax_scale, schedule=schedule)
    _launch_attention(q, params, kv_cache, block_table, arch, ws, schedule.smem_limits)
    return out, lse


def prefill(q: torch.Tensor, kv_cache, block_table: Optional[torch.Tensor], cu_q_lens: torch.Tensor,
            kv_lens: torch.Tensor, softmax_scale: float, *, causal: bool = True,
            out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
            workspace: Optional[torch.Tensor] = None, schedule: Optional[AttentionSchedule] = None,
            validate: bool = False, arch: Optional[str] = None):
    """Prefill / extend attention of packed query tokens over the latent cache -> (out, lse).

    q [T, H, 576] packed over sequences (cu_q_lens int32 [B+1], ending at most at T: checked with
    ``validate=True``; rows of out/lse past cu_q_lens[B] are left untouched); kv_lens int32 [B]
    include the new tokens, already in the cache; the q tokens of sequence b are its last q_len_b
    positions: when causal, query i sees positions < kv_len - q_len + i + 1, otherwise all kv_len.
    Cache arguments and ``arch`` as in decode. Returns out [T, H, 512] and lse [T, H] float32.
    Reference: mla_kv.reference.prefill.
    """
    _check_q(q, 3)
    tokens, heads, _ = q.shape
    softmax_scale = real("softmax_scale", softmax_scale, above=0)
    if not isinstance(causal, bool):  # a truthy string or None would silently pick a mask
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    _tensor("cu_q_lens", cu_q_lens, dims=1, dtype=torch.int32, contiguous=True)
    if cu_q_lens.shape[0] < 2:
        raise ValueError("cu_q_lens: needs at least 2 entries (batch >= 1)")
    batch = cu_q_lens.shape[0] - 1
    _check_lens("kv_lens", kv_lens, batch)
    blocks = isinstance(kv_cache, BlockPointerCache)
    device = _check_attention_inputs(q, kv_cache, block_table, batch, dict(
        q=q, cu_q_lens=cu_q_lens, kv_lens=kv_lens, kv_cache=None if blocks else kv_cache,
        block_table=None if blocks else block_table))
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
            have, size = torch.full((batch,), block_table.shape[1]), kv_cache.shape[1]
        _validate_table("cache.cu_block_nums" if blocks else "block_table", "kv_lens", kv_lens, cu.diff(),
                        have, size)
    if device.type != "cuda":
        if blocks:
            raise ValueError("cache: block-pointer ops run on CUDA tensors only")
        return reference.prefill(q, kv_cache, block_table, cu_q_lens, kv_lens, softmax_scale, causal=causal,
                                 out=out, lse=lse)
    max_kv = (kv_cache.block_ptrs.shape[0] * kv_cache.block_seq_len if blocks
              else block_table.shape[1] * kv_cache.shape[1])
    if schedule is None:
        schedule = attention_schedule(batch, max(1, -(-tokens // batch)), heads, max_kv, total_q_tokens=tokens,
                                      device=device, arch=arch)
    ws = _workspace(workspace, schedule, device, max_kv=_schedule_cover(blocks, max_kv, validate, have, size),
                    total_tokens=tokens, heads=heads)
    params = _attention_params(q, out, lse, packed=True, batch=batch, q_len=0, kv_lens=kv_lens,
                               cu_q_lens=cu_q_lens, causal=causal, scale=softmax_scale, schedule=schedule)
    _launch_attention(q, params, kv_cache, block_table, arch, ws, schedule.smem_limits)
    return out, lse


def merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor, *,
                 out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None):
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
    with torch.cuda.device(device):
        _C.merge_states(_c_dtype(out_a.dtype), rows, out_a.shape[-1], a.data_ptr(), a.stride(0), lse_a.data_ptr(),
                        b.data_ptr(), b.stride(0), lse_b.data_ptr(), o.data_ptr(), o.stride(0), lse.data_ptr(),
                        _stream(device))
    return out, lse


# ---------------------------------------------------------------------------------- gather
def _check_gather_cache(kv_cache, block_table, batch) -> None:
    if isinstance(kv_cache, BlockPointerCache):
        if block_table is not None:
            raise ValueError("block_table: must be None with a BlockPointerCache (its blocks are given by "
                             "cache.cu_block_nums)")
        if kv_cache.dtype not in _DTYPES:
            raise TypeError(f"cache: dtype must be one of {', '.join(map(str, _DTYPES))}, got {kv_cache.dtype}")
        _check_block_pointer_cache(kv_cache, kv_cache.dtype)
        if kv_cache.batch != batch:
            raise ValueError(f"cu_kv_lens: describes {batch} sequences, cache.cu_block_nums {kv_cache.batch}")
    elif not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache: expected a torch.Tensor or a layout.BlockPointerCache, "
                        f"got {type(kv_cache).__name__}")
    else:
        _check_paged_cache(kv_cache)
        _check_block_table(block_table, batch)


def _validate_gather(kv_cache, block_table, cu_kv_lens, starts, out_rows) -> None:
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
    size = kv_cache.shape[1]
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


def gather_kv(kv_cache, block_table: Optional[torch.Tensor], cu_kv_lens: torch.Tensor, *,
              starts: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None, validate: bool = False,
              arch: Optional[str] = None) -> torch.Tensor:
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
    Reference: mla_kv.reference.gather_kv / gather_kv_blocks.
    """
    _tensor("cu_kv_lens", cu_kv_lens, dims=1, dtype=torch.int32, contiguous=True)
    if cu_kv_lens.shape[0] < 2:
        raise ValueError("cu_kv_lens: needs at least 2 entries (batch >= 1)")
    batch = cu_kv_lens.shape[0] - 1
    if starts is not None:
        _check_lens("starts", starts, batch)
    blocks = isinstance(kv_cache, BlockPointerCache)
    _check_gather_cache(kv_cache, block_table, batch)
    if out is not None:
        _tensor("out", out, dims=2, dtype=kv_cache.dtype, last_contiguous=True)
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
        _validate_gather(kv_cache, block_table, cu_kv_lens, starts, None if out is None else out.shape[0])
    if device.type != "cuda":
        rows = reference.gather_kv(kv_cache, block_table, cu_kv_lens, starts=starts)
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
        out = torch.empty(total, ROW_DIM, dtype=kv_cache.dtype, device=device)
    _aligned("out", out, 2)
    if not blocks:
        _aligned("kv_cache", kv_cache, 2)
    args = (_c_dtype(kv_cache.dtype), batch, cu_kv_lens.data_ptr(), 0 if starts is None else starts.data_ptr(),
            out.data_ptr(), out.shape[0], out.stride(0))
    with torch.cuda.device(device):
        if blocks:
            _C.gather_kv_blocks(*args, _blocks_cache(kv_cache), tag, _stream(device))
        else:
            _C.gather_kv_paged(*args, _paged_cache(kv_cache), block_table.data_ptr(), block_table.stride(0),
                               block_table.shape[1], tag, _stream(device))
    return out
