"""What the op families share: the argument checks (the attention ops' inputs included), the choice of
kernel variant and the cache arguments' conversion to their _C forms."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Dict, Optional, TypeVar, cast

import torch

from .._checks import integer, tensor
from .._compiled import _C
from ..layout import (LATENT_DIM, ROW_DIM, TRAILER_FORMATS, BlockPointerCache, cache_block_size, check_kv_format,
                      check_kv_scale, row_bytes)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ARCH_TAGS = ("sm70", "sm75", "sm80", "sm90")


def kernels_available() -> bool:
    """True when the package was built with its CUDA kernels."""
    return _C is not None


# ------------------------------------------------------------------------- torch.compile
_F = TypeVar("_F", bound=Callable)
# name -> the function's torch.ops form (mla_kv.ops.library fills it in as it registers the ops)
TRACED: Dict[str, Callable] = {}


def _compiling() -> bool:
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling is not None and is_compiling())


def traceable(fn: _F) -> _F:
    """Makes ``fn`` (an op of the public API) trace under torch.compile: while Dynamo traces, the call goes
    to TRACED[fn's name], which calls the op's torch.ops.mla_kv form (an opaque custom op with a fake
    implementation; its real implementation is ``fn`` itself, run eagerly, so the arguments are still
    checked before anything is launched). Outside torch.compile, or where torch has no custom ops, ``fn``
    runs as written (its checks read data pointers, which Dynamo cannot trace)."""
    name = fn.__name__

    @functools.wraps(fn)
    def op(*args, **kwargs):
        if _compiling():
            route = TRACED.get(name)
            if route is not None:
                return route(*args, **kwargs)
        return fn(*args, **kwargs)
    return cast(_F, op)


# ----------------------------------------------------------------------------------- checks
_tensor = tensor  # the tensor check every module shares (mla_kv._checks), under the ops' name


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


def _result_tensor(name, given, shape, dtype, device):
    if given is None:
        return torch.empty(shape, dtype=dtype, device=device)
    _tensor(name, given, dtype=dtype, last_contiguous=True)
    if tuple(given.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(given.shape)}")
    if given.device != device:
        raise ValueError(f"{name}: on {given.device}, expected {device}")
    return given


def _check_lens(name, lens, batch) -> None:
    _tensor(name, lens, dims=1, dtype=torch.int32, contiguous=True)
    _size(name, lens, 0, batch)


def _check_arch(arch, tags=_ARCH_TAGS) -> None:
    """``arch`` is None or one of ``tags``, on every device: a CPU call (the reference) ignores it, and a
    typo must not pass every CPU test to fail only on a GPU."""
    if arch is None:
        return
    if not isinstance(arch, str):
        raise TypeError(f"arch: expected one of {', '.join(map(repr, tags))} or None, got {type(arch).__name__} "
                        f"{arch!r}")
    if arch not in tags:
        raise ValueError(f"arch: must be one of {', '.join(map(repr, tags))} or None, got {arch!r}")


# ---------------------------------------------------------------------------------- kernels
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
    _check_arch(arch)
    cc = _capability(device.index if device.index is not None else torch.cuda.current_device())
    tag = _C.resolve_arch(getattr(_C.Arch, arch) if arch else _C.Arch.auto, cc)
    if tag == _C.Arch.auto:
        raise ValueError(f"arch: no {arch or 'kernel'} variant runs on this sm_{cc} GPU in this build "
                         f"(compiled for {_C.compiled_cuda_archs()})")
    if dtype == torch.bfloat16 and not _C.tag_has_bf16(tag):
        raise TypeError(f"dtype: bfloat16 needs the sm80 kernels (Ampere or newer), this call uses "
                        f"{tag.name} on an sm_{cc} GPU; use float16 or float32")
    return tag


def _c_dtype(dtype: torch.dtype):
    return getattr(_C.DType, str(dtype).split(".")[1])


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


# ------------------------------------------------------------------ caches and block tables
def _check_paged_cache(kv_cache) -> None:
    _tensor("kv_cache", kv_cache)
    dtypes = _DTYPES if kv_cache.device.type == "cuda" else (*_DTYPES, torch.float64)
    _tensor("kv_cache", kv_cache, dims=3, dtypes=dtypes, last_contiguous=True)
    _size("kv_cache", kv_cache, 2, ROW_DIM)


def _check_block_pointer_cache(cache, dtype) -> None:
    if not isinstance(cache, BlockPointerCache):
        raise TypeError(f"cache: expected mla_kv.layout.BlockPointerCache, got {type(cache).__name__}")
    if cache.dtype != dtype:
        raise TypeError(f"cache: dtype {cache.dtype} differs from the inputs' {dtype}")
    _check_kv_format(cache.kv_format, cache.kv_scale, dtype, names=("cache.kv_format", "cache.kv_scale", "cache.dtype"))
    if cache.kv_format == "fp8_ds_mla" and cache.rope_first:
        raise ValueError("cache.rope_first: fp8_ds_mla rows are latent first (its 656-byte layout has no "
                         "rope-first form); pass rope_first=False")
    _tensor("cache.block_ptrs", cache.block_ptrs, dims=1, dtype=torch.int64, contiguous=True)
    _tensor("cache.cu_block_nums", cache.cu_block_nums, dims=1, dtype=torch.int32, contiguous=True)
    if cache.batch < 1:
        raise ValueError("cache.cu_block_nums: needs at least 2 entries (batch >= 1)")
    if cache.block_seq_len < 1:
        raise ValueError(f"cache.block_seq_len: must be >= 1, got {cache.block_seq_len}")
    least = (ROW_DIM * torch.empty((), dtype=dtype).element_size() if cache.kv_format is None
             else row_bytes(cache.kv_format))
    if cache.row_stride_bytes < least or cache.row_stride_bytes % 16:
        raise ValueError(f"cache.row_stride_bytes: must be a multiple of 16 and >= {least}, "
                         f"got {cache.row_stride_bytes}")
    if cache.layer_offset_bytes < 0 or cache.layer_offset_bytes % 16:
        raise ValueError(f"cache.layer_offset_bytes: must be a non-negative multiple of 16, "
                         f"got {cache.layer_offset_bytes}")


@dataclass(frozen=True)
class CacheSource:
    """The cache an op reads: its format (None: values of dtype), fp8's scale, the block size (of a
    paged cache, or block_seq_len), and the rows' dtype (a quantized cache's compute dtype)."""

    kv_format: Optional[str]
    kv_scale: Optional[float]
    block_size: int
    dtype: torch.dtype


def _check_block_table(block_table, batch, name="block_table"):
    _tensor(name, block_table, dims=2, dtype=torch.int32, last_contiguous=True)
    _size(name, block_table, 0, batch)


def _check_kv_format(kv_format, kv_scale, dtype, names=("kv_format", "kv_scale", "dtype")) -> Optional[float]:
    """A quantized format's arguments: the compute dtype is 16-bit; fp8 takes a dequant scale (returned
    as a float), the others none. names: of the format, the scale and what gives the dtype."""
    check_kv_format(kv_format, names[0])
    if kv_format is None:
        if kv_scale is not None:
            raise ValueError(f"{names[1]}: only the fp8 format takes a scale, got {kv_scale!r} without one")
        return None
    if dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"{names[2]}: a {kv_format} cache is written from and read into float16 or bfloat16, "
                        f"got {dtype}")
    if kv_format == "fp8":
        return check_kv_scale(kv_scale, names[1])
    if kv_scale is not None:
        raise ValueError(f"{names[1]}: only the fp8 format takes a scale; {kv_format} keeps its own, got {kv_scale!r}")
    return None


def _check_quantized_paged_cache(kv_cache, kv_format, dtype) -> int:
    """A quantized paged cache (layouts in mla_kv.layout) -> its block size; 16-byte aligned blocks and
    rows, the bytes of a row (of a block, for int8 / int4) contiguous."""
    block_size = cache_block_size(kv_cache, kv_format, dtype)
    if kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache: the last dim must be contiguous (got strides {kv_cache.stride()})")
    if kv_cache.device.type == "cuda" and (kv_cache.data_ptr() % 16 or any(s % 16 for s in kv_cache.stride()[:-1])):
        raise ValueError(f"kv_cache: data pointer and strides must be multiples of 16 bytes (got strides "
                         f"{kv_cache.stride()})")
    return block_size


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


def _c_format(kv_format, kv_scale):
    return (_C.KvFormat.none if kv_format is None else getattr(_C.KvFormat, kv_format)), (kv_scale or 1.0)


def _paged_cache(kv_cache, kv_format=None, kv_scale=None, block_size=None):
    """The _C.PagedCache of a paged cache: [num_blocks, block_size, 576] values, or a quantized one (uint8
    [num_blocks, block_size, row_bytes], or [num_blocks, block_bytes] for int8 / int4 with its block_size)."""
    fmt, scale = _c_format(kv_format, kv_scale)
    if kv_format in TRAILER_FORMATS:
        row = _C.RowLayout(0, LATENT_DIM, row_bytes(kv_format), fmt, scale)
    else:
        block_size = kv_cache.shape[1]
        row = _C.RowLayout(0, LATENT_DIM, kv_cache.stride(1) * kv_cache.element_size(), fmt, scale)
    return _C.PagedCache(kv_cache.data_ptr(), kv_cache.shape[0], block_size,
                         kv_cache.stride(0) * kv_cache.element_size(), row)


def _blocks_cache(cache: BlockPointerCache):
    row = _C.RowLayout(cache.latent_offset, cache.rope_offset, cache.row_stride_bytes,
                       *_c_format(cache.kv_format, cache.kv_scale))
    return _C.BlockPointerCache(cache.block_ptrs.data_ptr(), cache.cu_block_nums.data_ptr(), cache.batch,
                                cache.block_seq_len, cache.layer_offset_bytes, row)


def _index_cache(index_cache):
    """The _C.IndexCache of an index-key cache checked by mla_kv.layout.check_index_cache."""
    return _C.IndexCache(index_cache.data_ptr(), index_cache.shape[0], index_cache.shape[1],
                         index_cache.stride(0))


@dataclass(frozen=True)
class BlockWriteTargets:
    """Where a block-pointer write puts the packed new tokens, as _check_write_targets checked them."""

    cu_q_lens: torch.Tensor
    history_lens: torch.Tensor
    readonly_lens: Optional[torch.Tensor]
    cp_size: int
    cp_rank: int


def _check_write_targets(batch, cu_q_lens, history_lens, readonly_lens, cp_size, cp_rank) -> BlockWriteTargets:
    """The block-pointer writes' targets (the latent and the index-key writes): TurboMind's cu_q_lens,
    history_lens and readonly_lens of a batch, and the context-parallel rank."""
    _tensor("cu_q_lens", cu_q_lens, dims=1, dtype=torch.int32, contiguous=True)
    _tensor("history_lens", history_lens, dims=1, dtype=torch.int32, contiguous=True)
    _size("cu_q_lens", cu_q_lens, 0, batch + 1)
    _size("history_lens", history_lens, 0, batch)
    if readonly_lens is not None:
        _tensor("readonly_lens", readonly_lens, dims=1, dtype=torch.int32, contiguous=True)
        _size("readonly_lens", readonly_lens, 0, batch)
    cp_size = integer("cp_size", cp_size, 1)
    cp_rank = integer("cp_rank", cp_rank, 0)
    if cp_rank >= cp_size:
        raise ValueError(f"cp_rank: must lie in [0, cp_size = {cp_size}), got {cp_rank}")
    return BlockWriteTargets(cu_q_lens, history_lens, readonly_lens, cp_size, cp_rank)


def _validate_write_targets(cu_block_nums, num_block_ptrs, block_seq_len, to: BlockWriteTargets, num_rows) -> None:
    """validate=True for a block-pointer write: the lengths, and enough blocks for every sequence's rows on
    this rank (a host sync)."""
    cu_q, hist = to.cu_q_lens.cpu().long(), to.history_lens.cpu().long()
    cu_b = cu_block_nums.cpu().long()
    q_lens = cu_q[1:] - cu_q[:-1]
    if int(cu_q[0]) != 0 or bool((q_lens < 0).any()):
        raise ValueError("cu_q_lens: must start at 0 and be non-decreasing")
    if int(cu_q[-1]) > num_rows:
        raise ValueError(f"cu_q_lens: {int(cu_q[-1])} tokens but the inputs have {num_rows} rows")
    if bool((hist < 0).any()):
        raise ValueError("history_lens: must be >= 0")
    if to.readonly_lens is not None and bool((to.readonly_lens < 0).any()):
        raise ValueError("readonly_lens: must be >= 0")
    # This rank's rows of positions 0 .. history + q_len - 1 (all of them without context parallelism).
    local = (hist + q_lens - to.cp_rank + to.cp_size - 1).div(to.cp_size, rounding_mode="floor").clamp_min(0)
    need = (local + block_seq_len - 1) // block_seq_len
    have = cu_b[1:] - cu_b[:-1]
    short = (need > have).nonzero()
    if short.numel():
        b = int(short[0])
        rows = "" if to.cp_size == 1 else f" ({int(local[b])} rows on cp rank {to.cp_rank} of {to.cp_size})"
        raise ValueError(f"cache.cu_block_nums: sequence {b} has {int(have[b])} blocks but history "
                         f"{int(hist[b])} + {int(q_lens[b])} new tokens{rows} need {int(need[b])}")
    if int(cu_b[-1]) > num_block_ptrs:
        raise ValueError(f"cache.cu_block_nums: ends at {int(cu_b[-1])} but block_ptrs has "
                         f"{num_block_ptrs} entries")


# ------------------------------------------------------------------------ attention inputs
def _lse_dtype(x: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs (the CPU reference's checking precision)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_q(q, dims) -> None:
    # The kernels take fp16/bf16; the CPU reference any float dtype (float64 for checking).
    _tensor("q", q)
    dtypes = (torch.float16, torch.bfloat16) if q.device.type == "cuda" else (*_DTYPES, torch.float64)
    _tensor("q", q, dims=dims, dtypes=dtypes, last_contiguous=True)
    _size("q", q, dims - 1, ROW_DIM)


def _check_vector_aligned(name, t) -> None:
    """The attention kernels move q, cache and out rows in 16-byte vectors."""
    if t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:-1]):
        raise ValueError(f"{name}: data pointer must be 16-byte aligned and strides multiples of 8 "
                         f"elements (got strides {t.stride()})")


def _check_blocks_read(cache, dtype, batch) -> None:
    _check_block_pointer_cache(cache, dtype)
    if cache.batch != batch:
        raise ValueError(f"cache.cu_block_nums: describes {cache.batch} sequences, q has {batch}")


def _check_attention_inputs(q, cache, block_table, batch, device_tensors, kv_format, kv_scale,
                            table_name="block_table"):
    """-> (device, CacheSource). A paged cache holds rows of q's dtype, or (kv_format) quantized bytes
    whose compute dtype is q's; a BlockPointerCache carries its own format. block_table: the int32
    [batch, n] table of a paged cache (sparse attention's indices, table_name "indices")."""
    if isinstance(cache, BlockPointerCache):
        if kv_format is not None or kv_scale is not None:
            raise ValueError("kv_format / kv_scale: a BlockPointerCache carries its own (cache.kv_format, "
                             "cache.kv_scale)")
        _check_blocks_read(cache, q.dtype, batch)
        source = CacheSource(cache.kv_format, cache.kv_scale, cache.block_seq_len, q.dtype)
    elif kv_format is None:
        _check_kv_format(None, kv_scale, q.dtype)
        _check_paged_cache(cache)
        if cache.dtype != q.dtype:
            raise TypeError(f"kv_cache: dtype {cache.dtype} differs from q's {q.dtype}")
        _check_block_table(block_table, batch, table_name)
        _check_vector_aligned("kv_cache", cache)
        source = CacheSource(None, None, cache.shape[1], q.dtype)
    else:
        scale = _check_kv_format(kv_format, kv_scale, q.dtype, names=("kv_format", "kv_scale", "q"))
        block_size = _check_quantized_paged_cache(cache, kv_format, q.dtype)
        _check_block_table(block_table, batch, table_name)
        source = CacheSource(kv_format, scale, block_size, q.dtype)
    _check_vector_aligned("q", q)
    return _same_device(**device_tensors), source


def _packed_batch(causal, cu_q_lens, kv_lens) -> int:
    """The checks of a packed (prefill) call's causal flag and lengths -> the batch."""
    if not isinstance(causal, bool):  # a truthy string or None would silently pick a mask
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    _tensor("cu_q_lens", cu_q_lens, dims=1, dtype=torch.int32, contiguous=True)
    if cu_q_lens.shape[0] < 2:
        raise ValueError("cu_q_lens: needs at least 2 entries (batch >= 1)")
    batch = cu_q_lens.shape[0] - 1
    _check_lens("kv_lens", kv_lens, batch)
    return batch
