"""What the op families share: the compiled module, the argument checks, the choice of kernel variant and
the cache arguments' conversion to their _C forms."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Dict, Optional, TypeVar, cast

import torch

from ..layout import LATENT_DIM, ROW_DIM, TRAILER_FORMATS, BlockPointerCache, check_kv_format, row_bytes
from ..reference import quant as _quant

try:  # the compiled kernels are absent in a reference-only install
    from .. import _C
except ImportError:  # pragma: no cover - depends on the build
    _C = None

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


def _check_block_table(block_table, batch):
    _tensor("block_table", block_table, dims=2, dtype=torch.int32, last_contiguous=True)
    _size("block_table", block_table, 0, batch)


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
        return _quant.check_kv_scale(kv_scale, names[1])
    if kv_scale is not None:
        raise ValueError(f"{names[1]}: only the fp8 format takes a scale; {kv_format} keeps its own, got {kv_scale!r}")
    return None


def _check_quantized_paged_cache(kv_cache, kv_format, dtype) -> int:
    """A quantized paged cache (layouts in mla_kv.reference.quant) -> its block size; 16-byte aligned
    blocks and rows, the bytes of a row (of a block, for int8 / int4) contiguous."""
    block_size = _quant.cache_block_size(kv_cache, kv_format, dtype)
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
