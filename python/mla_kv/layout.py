"""Cache layouts: the row, the paged tensor and TurboMind-style block pointers.

A row is one token of one layer: 576 values, [c_kv (512) | k_pe (64)] in the paged tensor (vLLM,
FlashMLA, FlashInfer) and [k_pe | c_kv] ("rope first") behind TurboMind block pointers by default.
Quantized formats (KV_FORMATS below) change a row's bytes; int8 / int4 keep per-token (scale, zero)
in a trailer after a block's rows.

Paged tensor, per layer::

    kv_cache [num_blocks, block_size, 576]      slot = block_id * block_size + offset
    block_table [B, max_blocks] int32           sequence b, position p -> block_table[b, p // block_size]

Block pointers (one allocation per block holds every layer)::

    block_ptrs  [sum of blocks] int64 (device addresses)
    cu_block_nums [B + 1] int32                 sequence b owns block_ptrs[cu[b]:cu[b+1]]
    block base + layer_offset_bytes + (p % block_seq_len) * row_stride_bytes -> row of position p
"""
from __future__ import annotations

import numbers
from collections import abc
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import _checks

LATENT_DIM = 512
ROPE_DIM = 64
ROW_DIM = LATENT_DIM + ROPE_DIM

# Cache formats (byte layouts in mla_kv.reference.quant, the spec of each): None is the 16-bit
# (or fp32) row of today; the others are the engines' quantized rows.
#   "fp8"         576 B: [c_kv | k_pe] in e4m3, one per-tensor dequant scale (vLLM fp8)
#   "fp8_ds_mla"  656 B: 512 e4m3 in 4 tiles of 128, 4 fp32 tile scales, 64 bf16 k_pe (vLLM, FlashMLA)
#   "int8"        576 B of codes per row + a (scale, zero) pair per token in the block's trailer
#   "int4"        288 B of codes per row (TurboMind's nibble order) + the same trailer (TurboMind)
KV_FORMATS = (None, "fp8", "fp8_ds_mla", "int8", "int4")
_ROW_BYTES = {"fp8": ROW_DIM, "fp8_ds_mla": LATENT_DIM + 4 * 4 + ROPE_DIM * 2, "int8": ROW_DIM, "int4": ROW_DIM // 2}
TRAILER_FORMATS = ("int8", "int4")  # formats whose per-token (scale, zero) sit after a block's rows


# The DeepSeek Sparse Attention indexer's key cache (one per indexed layer; csrc/include/mla_kv/indexer.h):
# per token 128 e4m3 codes and one fp32 scale, a page holding all its tokens' codes first, then all their
# scales. One layer's cache is uint8 [num_blocks, page_size, 132] (or [num_blocks, page_size, 1, 132], the
# engines' view); only the block stride may exceed page_size * 132 bytes.
INDEX_DIM = 128
INDEX_ROPE_DIM = 64  # the rope part is the FIRST 64 dims of an index key or query
INDEX_ROW_BYTES = INDEX_DIM + 4
INDEX_SCALE_FORMATS = (None, "ue8m0")  # the model's scale_fmt: raw amax / 448, or rounded up to 2^n


def index_cache_shape(num_blocks: int, page_size: int) -> tuple:
    """The shape of one layer's index-key cache: uint8 [num_blocks, page_size, 132]."""
    _checks.integer("num_blocks", num_blocks, 1)
    _checks.integer("page_size", page_size, 1)
    return (num_blocks, page_size, INDEX_ROW_BYTES)


def check_index_cache(index_cache, name: str = "index_cache") -> int:
    """Checks an index-key cache (uint8 [num_blocks, page_size, 132] or [num_blocks, page_size, 1, 132],
    each page contiguous, the block stride a multiple of 16 bytes and >= a page) and returns page_size."""
    _checks.tensor(name, index_cache, dtype=torch.uint8)
    shape = tuple(index_cache.shape)
    if not (len(shape) == 3 or (len(shape) == 4 and shape[2] == 1)) or shape[-1] != INDEX_ROW_BYTES:
        raise ValueError(f"{name}: expected uint8 [num_blocks, page_size, {INDEX_ROW_BYTES}] (or "
                         f"[num_blocks, page_size, 1, {INDEX_ROW_BYTES}]), got {shape}")
    page_size = shape[1]
    inner = index_cache[0] if shape[0] else index_cache.new_empty(shape[1:])
    if shape[0] and not inner.is_contiguous():
        raise ValueError(f"{name}: each page must be contiguous (strides {index_cache.stride()})")
    stride = index_cache.stride(0)
    if shape[0] > 1 and (stride < page_size * INDEX_ROW_BYTES or stride % 16):
        raise ValueError(f"{name}: the block stride ({stride} B) must be >= a page ({page_size * INDEX_ROW_BYTES} B) "
                         "and a multiple of 16")
    if index_cache.device.type == "cuda" and index_cache.data_ptr() % 16:
        raise ValueError(f"{name}: its data pointer must be 16-byte aligned")
    return page_size


def index_cache_parts(index_cache: torch.Tensor):
    """(codes, scales) of an index-key cache: codes uint8 [num_blocks, page_size, 128] (a view of the pages'
    first region) and scales float32 [num_blocks, page_size] (a copy of the second); value = code * scale."""
    page_size = check_index_cache(index_cache)
    num_blocks = index_cache.shape[0]
    pages = index_cache.as_strided((num_blocks, page_size * INDEX_ROW_BYTES), (index_cache.stride(0), 1))
    codes = pages[:, :page_size * INDEX_DIM].unflatten(1, (page_size, INDEX_DIM))
    scales = pages[:, page_size * INDEX_DIM:].contiguous().view(torch.float32)
    return codes, scales


def check_kv_format(kv_format, name: str = "kv_format") -> None:
    if kv_format not in KV_FORMATS:
        raise ValueError(f"{name}: one of {', '.join(map(repr, KV_FORMATS))}, got {kv_format!r}")


def _element_size(dtype) -> int:
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype: float16, bfloat16 or float32, got {dtype}")
    return torch.empty(0, dtype=dtype).element_size()


def row_bytes(kv_format=None, dtype=torch.float16) -> int:
    """Bytes of one cached row (one token of one layer) in ``kv_format``; dtype: the 16-bit (or fp32)
    element type of an unquantized row. int8 / int4 rows hold the codes only (their per-token scale and
    zero are in the block's trailer, see block_bytes)."""
    check_kv_format(kv_format)
    return ROW_DIM * _element_size(dtype) if kv_format is None else _ROW_BYTES[kv_format]


def block_bytes(kv_format, block_size: int, dtype=torch.float16) -> int:
    """Bytes of one layer's region of a block: block_size rows, then for int8 / int4 block_size
    (scale, zero) pairs in ``dtype`` (the compute dtype, 16-bit), as TurboMind lays them out."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size: a positive int, got {block_size!r}")
    rows = block_size * row_bytes(kv_format, dtype)
    if kv_format in TRAILER_FORMATS:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype: {kv_format} stores its scale and zero in float16 or bfloat16, got {dtype}")
        rows += block_size * 2 * _element_size(dtype)
    return rows


def paged_cache_shape(kv_format, num_blocks: int, block_size: int, dtype=torch.float16) -> tuple:
    """The shape of one layer's paged cache in ``kv_format``: [num_blocks, block_size, 576] values of dtype
    (None), uint8 [num_blocks, block_size, row_bytes] (fp8, fp8_ds_mla), uint8 [num_blocks, block_bytes]
    (int8 / int4: a block's rows, then its (scale, zero) pairs in dtype)."""
    if kv_format is None:
        return (num_blocks, block_size, ROW_DIM)
    if kv_format in TRAILER_FORMATS:
        return (num_blocks, block_bytes(kv_format, block_size, dtype))
    return (num_blocks, block_size, row_bytes(kv_format))


def bytes_per_token(kv_format=None, dtype=torch.float16) -> int:
    """Cache bytes one token takes in one layer, trailer included (580 B for int8, 292 for int4)."""
    return block_bytes(kv_format, 1, dtype)


def check_kv_scale(kv_scale, name: str = "kv_scale") -> float:
    """fp8's dequant scale as a float: finite and > 0."""
    if isinstance(kv_scale, bool) or not isinstance(kv_scale, (int, float)) or not 0 < float(kv_scale) < float("inf"):
        raise ValueError(f"{name}: the fp8 format needs a finite dequant scale > 0, got {kv_scale!r}")
    return float(kv_scale)


def cache_block_size(kv_cache: torch.Tensor, kv_format: str, scale_dtype: torch.dtype) -> int:
    """Checks a quantized paged cache and returns its block size (TypeError / ValueError naming
    kv_cache otherwise): uint8 [num_blocks, block_size, row_bytes] for the
    per-row formats, uint8 [num_blocks, block_bytes] (rows, then the trailer) for int8 / int4."""
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dtype != torch.uint8:
        raise TypeError(f"kv_cache: a {kv_format} cache is uint8, got {getattr(kv_cache, 'dtype', type(kv_cache))}")
    if kv_format in TRAILER_FORMATS:
        per_token = block_bytes(kv_format, 1, scale_dtype)
        if kv_cache.dim() != 2 or kv_cache.shape[1] % per_token:
            raise ValueError(f"kv_cache: {kv_format} blocks are [num_blocks, block_size x {per_token}] bytes, got "
                             f"{tuple(kv_cache.shape)}")
        return kv_cache.shape[1] // per_token
    if kv_cache.dim() != 3 or kv_cache.shape[2] != row_bytes(kv_format):
        raise ValueError(f"kv_cache: {kv_format} is [num_blocks, block_size, {row_bytes(kv_format)}] bytes, got "
                         f"{tuple(kv_cache.shape)}")
    return kv_cache.shape[1]


@dataclass
class BlockPointerCache:
    """One layer's view of a TurboMind-style block-pointer cache.

    block_ptrs: int64 tensor of block base addresses (16-byte aligned) on the cache's device.
    cu_block_nums: int32 [B + 1], sequence b owns block_ptrs[cu_block_nums[b]:cu_block_nums[b+1]].
    block_seq_len: rows per block (a multiple of 64 for TurboMind on sm70).
    layer_offset_bytes: where this layer's rows start inside each block.
    dtype: element type of the rows; for a quantized kv_format the compute dtype (float16 / bfloat16),
        also the type of int8 / int4's per-token scale and zero.
    rope_first: row order [k_pe | c_kv] (TurboMind) if True, else [c_kv | k_pe] (fp8_ds_mla: always).
    row_stride_bytes: bytes from one row to the next (default row_bytes(kv_format, dtype): 576 * element
        size when unquantized). int8 / int4 (scale, zero) pairs follow a layer's block_seq_len rows.
    kv_format / kv_scale: the rows' format (KV_FORMATS) and fp8's dequant scale.
    """

    block_ptrs: torch.Tensor
    cu_block_nums: torch.Tensor
    block_seq_len: int
    layer_offset_bytes: int
    dtype: torch.dtype
    rope_first: bool = True
    row_stride_bytes: Optional[int] = None
    kv_format: Optional[str] = None
    kv_scale: Optional[float] = None

    def __post_init__(self) -> None:
        if self.row_stride_bytes is None:
            check_kv_format(self.kv_format, "cache.kv_format")
            self.row_stride_bytes = (ROW_DIM * torch.empty((), dtype=self.dtype).element_size()
                                     if self.kv_format is None else row_bytes(self.kv_format, self.dtype))

    @property
    def batch(self) -> int:
        return self.cu_block_nums.shape[0] - 1

    @property
    def latent_offset(self) -> int:
        return ROPE_DIM if self.rope_first else 0

    @property
    def rope_offset(self) -> int:
        return 0 if self.rope_first else LATENT_DIM


@dataclass
class IndexBlockPointerCache:
    """One indexed layer's index-key pages behind TurboMind-style block pointers.

    block_ptrs: int64 tensor of block base addresses (16-byte aligned) on the cache's device (host
        addresses for CPU tensors, which the reference writes through).
    cu_block_nums: int32 [B + 1], sequence b owns block_ptrs[cu_block_nums[b]:cu_block_nums[b+1]].
    block_seq_len: tokens per block.
    layer_offset_bytes: where this layer's page starts inside each block (a multiple of 16): block_seq_len x
        128 e4m3 codes, then block_seq_len float32 scales (the paged index cache's page, INDEX_ROW_BYTES a token).
    """

    block_ptrs: torch.Tensor
    cu_block_nums: torch.Tensor
    block_seq_len: int
    layer_offset_bytes: int

    @property
    def batch(self) -> int:
        return self.cu_block_nums.shape[0] - 1


class BlockPool:
    """A pool of TurboMind-style blocks in one tensor, for tests, demos and engines without one.

    ``bytes`` is uint8 [num_blocks, bytes_per_block]; block i's base address is ``bytes[i].data_ptr()``.
    Inside a block, layer l occupies ``layer_bytes[l]`` bytes from ``layer_offset_bytes(l)`` =
    sum(layer_bytes[:l]), as TurboMind sums its layers' actual sizes: layers differ when some are
    quantized (``layout.block_bytes(kv_format, block_seq_len)``) or not MLA. The default is every layer
    block_seq_len rows of 576 values of ``dtype``. Offsets and the block size are multiples of 16, as
    the kernels' 16-byte row vectors need.

    ``layer_view(l)`` is layer l's rows as a paged tensor [num_blocks, block_seq_len, 576] of ``dtype``
    in the pool's row order (a view: writes through it land in the pool), so the paged reference ops
    can check what the block-pointer kernels wrote; a layer whose region is smaller than those rows is
    an opaque region and has no view. When every layer holds rows and all have one size, ``storage``
    is the whole pool as [num_blocks, num_layers, block_seq_len, 576] of ``dtype`` (a view of the
    bytes); assigning such a view of other memory to ``storage`` moves the pool there, its block and
    layer strides taken from the view (how tests put a pool inside a canaried buffer).
    """

    def __init__(self, num_blocks: int, num_layers: int, block_seq_len: int, dtype: torch.dtype,
                 device="cpu", rope_first: bool = True, layer_bytes: Optional[Sequence[int]] = None):
        num_blocks = _checks.integer("num_blocks", num_blocks, 0)
        num_layers = _checks.integer("num_layers", num_layers, 1)
        self.block_seq_len = _checks.integer("block_seq_len", block_seq_len, 1)
        self.rope_first = rope_first
        self.dtype = dtype
        rows = self._rows_bytes()
        if layer_bytes is None:
            layer_bytes = [rows] * num_layers
        elif isinstance(layer_bytes, (str, bytes, torch.Tensor)) or not isinstance(layer_bytes, abc.Sequence):
            raise TypeError(f"layer_bytes: expected a sequence of ints (bytes per block of each layer), "
                            f"got {type(layer_bytes).__name__}")
        elif len(layer_bytes) != num_layers:
            raise ValueError(f"layer_bytes: {len(layer_bytes)} entries for num_layers = {num_layers}")
        self.layer_bytes = tuple(_checks.integer(f"layer_bytes[{l}]", n, 1) for l, n in enumerate(layer_bytes))
        offsets = [0]
        for n in self.layer_bytes:
            offsets.append(offsets[-1] + n)
        for l, offset in enumerate(offsets[1:-1], start=1):
            if offset % 16:
                raise ValueError(f"layer_bytes: layer {l} starts at byte {offset} of the block (the sum of the "
                                 f"earlier layers' bytes), not a multiple of 16")
        if offsets[-1] % 16:
            raise ValueError(f"layer_bytes: the block's {offsets[-1]} bytes (their sum, layer {num_layers - 1} "
                             f"ending there) are not a multiple of 16")
        self._offsets = tuple(offsets[:-1])
        self.bytes = torch.empty(num_blocks, offsets[-1], dtype=torch.uint8, device=device)

    def _rows_bytes(self) -> int:
        """Bytes of one layer's rows in a block: block_seq_len rows of 576 values of the pool dtype."""
        return self.block_seq_len * ROW_DIM * torch.empty((), dtype=self.dtype).element_size()

    @property
    def num_blocks(self) -> int:
        return self.bytes.shape[0]

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def bytes_per_block(self) -> int:
        """Bytes from one block's base to the next one's (the sum of layer_bytes for a pool made here)."""
        return self.bytes.shape[1]

    @property
    def device(self) -> torch.device:
        return self.bytes.device

    def _check_layer(self, layer) -> int:
        if isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: must be an int in [0, {self.num_layers}), got {layer!r}")
        return int(layer)

    def layer_offset_bytes(self, layer: int) -> int:
        """Where layer ``layer`` starts inside each block: the sum of the earlier layers' bytes."""
        return self._offsets[self._check_layer(layer)]

    def layer_view(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s rows as [num_blocks, block_seq_len, 576] of the pool dtype, a view of ``bytes``."""
        layer = self._check_layer(layer)
        rows = self._rows_bytes()
        if self.layer_bytes[layer] < rows:
            raise ValueError(f"layer: layer {layer} is an opaque region of {self.layer_bytes[layer]} bytes per "
                             f"block, smaller than {self.block_seq_len} rows of {ROW_DIM} {self.dtype} values "
                             f"({rows} bytes): it has no row view")
        offset = self._offsets[layer]
        return self.bytes[:, offset:offset + rows].view(self.dtype).view(self.num_blocks, self.block_seq_len, ROW_DIM)

    @property
    def storage(self) -> torch.Tensor:
        """The pool as [num_blocks, num_layers, block_seq_len, 576] of the pool dtype (a view of ``bytes``);
        only for a pool whose layers all hold rows and have one size."""
        rows, size = self._rows_bytes(), self.layer_bytes[0]
        if any(n != size for n in self.layer_bytes) or size < rows:
            raise ValueError(f"storage: one 4-D view needs layers of one size holding {self.block_seq_len} rows of "
                             f"{ROW_DIM} {self.dtype} values each; this pool's layer_bytes are "
                             f"{list(self.layer_bytes)}: use pool.bytes and pool.layer_view(layer)")
        esz = torch.empty((), dtype=self.dtype).element_size()
        return self.bytes.view(self.dtype).as_strided(
            (self.num_blocks, self.num_layers, self.block_seq_len, ROW_DIM),
            (self.bytes_per_block // esz, size // esz, ROW_DIM, 1))

    @storage.setter
    def storage(self, storage: torch.Tensor) -> None:
        _checks.tensor("storage", storage)
        shape = (self.num_layers, self.block_seq_len, ROW_DIM)
        if storage.dim() != 4 or tuple(storage.shape[1:]) != shape or storage.dtype != self.dtype:
            raise ValueError(f"storage: expected [num_blocks, {', '.join(map(str, shape))}] of {self.dtype}, "
                             f"got {tuple(storage.shape)} of {storage.dtype}")
        if storage.stride(3) != 1 or storage.stride(2) != ROW_DIM:
            raise ValueError(f"storage: a layer's rows must be contiguous (strides [..., {ROW_DIM}, 1]), "
                             f"got strides {storage.stride()}")
        esz = storage.element_size()
        layer_bytes, block_stride = storage.stride(1) * esz, storage.stride(0) * esz
        if layer_bytes < self._rows_bytes() or block_stride < self.num_layers * layer_bytes or \
                layer_bytes % 16 or block_stride % 16:
            raise ValueError(f"storage: its layers ({layer_bytes} bytes apart) must not overlap within a block "
                             f"({block_stride} bytes apart), and both strides must be multiples of 16 bytes")
        raw = storage.view(torch.uint8)  # same memory; as_strided below starts where storage does
        if (storage.storage_offset() * esz + storage.shape[0] * block_stride) > raw.untyped_storage().nbytes():
            raise ValueError(f"storage: its {storage.shape[0]} blocks of {block_stride} bytes run past the end "
                             f"of the tensor's memory")
        self.bytes = raw.as_strided((storage.shape[0], block_stride), (block_stride, 1))
        self.layer_bytes = (layer_bytes,) * self.num_layers
        self._offsets = tuple(l * layer_bytes for l in range(self.num_layers))

    def cache(self, layer: int, block_ids: torch.Tensor, cu_block_nums: torch.Tensor) -> BlockPointerCache:
        """The BlockPointerCache of ``layer`` for sequences owning ``block_ids`` (flat, by cu_block_nums)."""
        self.layer_view(layer)  # a layer without rows (an opaque region) has no cache
        ptrs = self.bytes.data_ptr() + block_ids.to(torch.int64) * self.bytes_per_block
        return BlockPointerCache(
            block_ptrs=ptrs.to(self.device),
            cu_block_nums=cu_block_nums.to(device=self.device, dtype=torch.int32),
            block_seq_len=self.block_seq_len, layer_offset_bytes=self.layer_offset_bytes(layer),
            dtype=self.dtype, rope_first=self.rope_first)


def to_latent_first(rows: torch.Tensor) -> torch.Tensor:
    """[k_pe | c_kv] rows -> [c_kv | k_pe] rows (a copy)."""
    return torch.cat([rows[..., ROPE_DIM:], rows[..., :ROPE_DIM]], dim=-1)


def to_rope_first(rows: torch.Tensor) -> torch.Tensor:
    """[c_kv | k_pe] rows -> [k_pe | c_kv] rows (a copy)."""
    return torch.cat([rows[..., LATENT_DIM:], rows[..., :LATENT_DIM]], dim=-1)


def block_slots(cu_q_lens: torch.Tensor, history_lens: torch.Tensor, cu_block_nums: torch.Tensor,
                block_ids: torch.Tensor, block_seq_len: int, *, readonly_lens: Optional[torch.Tensor] = None,
                cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """Slot mapping (into a pool layer view) of the packed new tokens of a block-pointer batch.

    Token i of sequence b sits at global position p = history_lens[b] + i; under context parallelism
    (cp_size > 1) it belongs to rank p % cp_size, at local row p // cp_size of that rank's blocks
    block_ids[cu_block_nums[b]:cu_block_nums[b + 1]]. Slot -1 (skipped by the kernels): negative
    positions, other ranks' positions, local rows below readonly_lens[b] (read-only prefix blocks) and
    rows past a sequence's blocks. Runs on the host; for references and validation.
    """
    cu_q, hist = cu_q_lens.cpu().long(), history_lens.cpu().long()
    cu_b, ids = cu_block_nums.cpu().long(), block_ids.cpu().long()
    readonly = None if readonly_lens is None else readonly_lens.cpu().long()
    slots = []
    for b in range(cu_q.shape[0] - 1):
        pos = hist[b] + torch.arange(int(cu_q[b + 1] - cu_q[b]))
        local = pos.div(cp_size, rounding_mode="floor")
        blk = local // block_seq_len
        nblocks = int(cu_b[b + 1] - cu_b[b])
        ok = (pos >= 0) & (pos % cp_size == cp_rank) & (blk < nblocks)
        if readonly is not None:
            ok &= local >= readonly[b]
        s = torch.full_like(pos, -1)
        s[ok] = ids[cu_b[b] + blk[ok]] * block_seq_len + local[ok] % block_seq_len
        slots.append(s)
    return torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long)


def block_table_slots(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> list:
    """Per sequence, the slots of positions 0..seq_len-1 under a paged block table (host lists)."""
    bt, lens = block_table.cpu().long(), seq_lens.cpu().long()
    out = []
    for b in range(bt.shape[0]):
        pos = torch.arange(int(lens[b]))
        out.append(bt[b, pos // block_size] * block_size + pos % block_size)
    return out


# ------------------------------------------------------------------------------------- DeepSeek-V4 caches
# DeepSeek-V4 keeps one 512-wide row per token and layer, [NoPE (448) | RoPE (64)], that is both key and value
# (byte layouts: mla_kv.reference.v4_cache, the spec of each). One layer's cache, by row format:
#   "bf16" / "fp16"  plain rows [num_blocks, page_size, 512] of that dtype
#   "v4_fp8"         FlashMLA "MODEL1", 584 B a token. A page: page_size x 576 B values [448 e4m3 NoPE | 64 bf16
#                    RoPE], then page_size x 8 B [7 UE8M0 scales | 1 pad byte], padded up to a multiple of 576 B
#   "v4_mxfp8"       V4.1 MXFP8, 528 B a token. A page: page_size x 512 e4m3 (all dims), then page_size x 16
#                    UE8M0 scales (one per 32 dims), padded up to a multiple of 512 B
# A quantized cache is uint8 [num_blocks, page_bytes]; slot = block * page_size + offset in every format.
V4_DIM = 512
V4_NOPE_DIM = 448
V4_ROPE_DIM = V4_DIM - V4_NOPE_DIM
V4_FORMATS = ("bf16", "fp16", "v4_fp8", "v4_mxfp8")
V4_PLAIN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Per quantized format: (value bytes, scale bytes, scales used, dims per scale, page alignment) of one token.
_V4_ROW = {"v4_fp8": (V4_NOPE_DIM + 2 * V4_ROPE_DIM, 8, 7, 64, 576), "v4_mxfp8": (V4_DIM, 16, 16, 32, 512)}


def check_v4_format(fmt, name: str = "fmt") -> str:
    if fmt not in V4_FORMATS:
        raise ValueError(f"{name}: one of {', '.join(map(repr, V4_FORMATS))}, got {fmt!r}")
    return fmt


def v4_value_bytes(fmt: str) -> int:
    """Bytes of one token's values in a quantized V4 format's page: 576 (v4_fp8), 512 (v4_mxfp8)."""
    return _v4_row(fmt)[0]


def v4_scale_bytes(fmt: str) -> int:
    """Bytes of one token's scale record: 8 (v4_fp8: 7 UE8M0 scales and a pad byte), 16 (v4_mxfp8)."""
    return _v4_row(fmt)[1]


def v4_scale_count(fmt: str) -> int:
    """UE8M0 scales of one token: 7 (v4_fp8, one per 64 NoPE dims), 16 (v4_mxfp8, one per 32 dims)."""
    return _v4_row(fmt)[2]


def v4_scale_group(fmt: str) -> int:
    """Consecutive dims one scale covers: 64 (v4_fp8, NoPE only), 32 (v4_mxfp8, all 512)."""
    return _v4_row(fmt)[3]


def _v4_row(fmt: str) -> tuple:
    check_v4_format(fmt)
    if fmt not in _V4_ROW:
        raise ValueError(f"fmt: {fmt!r} is a plain (unquantized) V4 format; quantized ones are "
                         f"{', '.join(map(repr, _V4_ROW))}")
    return _V4_ROW[fmt]


def v4_bytes_per_token(fmt: str) -> int:
    """Bytes one token takes before a page's padding: 1,024 (bf16 / fp16), 584 (v4_fp8), 528 (v4_mxfp8)."""
    check_v4_format(fmt)
    if fmt in V4_PLAIN_DTYPES:
        return V4_DIM * 2
    return v4_value_bytes(fmt) + v4_scale_bytes(fmt)


def v4_page_bytes(page_size: int, fmt: str) -> int:
    """Bytes of one page of page_size tokens: page_size x 1,024 for bf16 / fp16; for the quantized formats
    page_size x bytes per token rounded up to a multiple of 576 (v4_fp8) or 512 (v4_mxfp8)."""
    page_size = _checks.integer("page_size", page_size, 1)
    check_v4_format(fmt)
    if fmt in V4_PLAIN_DTYPES:
        return page_size * V4_DIM * 2
    align = _V4_ROW[fmt][4]
    return -(-page_size * v4_bytes_per_token(fmt) // align) * align


def v4_cache_shape(num_blocks: int, page_size: int, fmt: str) -> tuple:
    """One layer's V4 cache shape: [num_blocks, page_size, 512] (bf16 / fp16), uint8 [num_blocks, page_bytes]
    (v4_fp8, v4_mxfp8)."""
    num_blocks = _checks.integer("num_blocks", num_blocks, 1)
    page_size = _checks.integer("page_size", page_size, 1)
    if check_v4_format(fmt) in V4_PLAIN_DTYPES:
        return (num_blocks, page_size, V4_DIM)
    return (num_blocks, v4_page_bytes(page_size, fmt))


def _v4_page_size_of(page_bytes: int, fmt: str) -> Optional[int]:
    """The page size whose padded page is page_bytes long, or None (the padded size grows strictly with it)."""
    guess = max(1, page_bytes // v4_bytes_per_token(fmt))
    for page_size in range(max(1, guess - 2), guess + 3):
        if v4_page_bytes(page_size, fmt) == page_bytes:
            return page_size
    return None


def check_v4_cache(cache, fmt: str, page_size: Optional[int] = None, name: str = "cache") -> int:
    """Checks one layer's V4 cache in row format fmt and returns its page size. bf16 / fp16: a [num_blocks,
    page_size, 512] tensor of that dtype, each page contiguous. v4_fp8 / v4_mxfp8: uint8 [num_blocks,
    page_bytes] (page_bytes = v4_page_bytes(page_size, fmt), which fixes page_size), each page contiguous,
    the block stride >= a page and a multiple of 16 bytes. page_size, when given, must match."""
    check_v4_format(fmt)
    if fmt in V4_PLAIN_DTYPES:
        _checks.tensor(name, cache, dtype=V4_PLAIN_DTYPES[fmt])
        if cache.dim() != 3 or cache.shape[2] != V4_DIM:
            raise ValueError(f"{name}: {fmt} is [num_blocks, page_size, {V4_DIM}], got {tuple(cache.shape)}")
        found = cache.shape[1]
        if cache.stride(2) != 1 or (found > 1 and cache.stride(1) != V4_DIM):
            raise ValueError(f"{name}: each page must be contiguous (strides {cache.stride()})")
    else:
        _checks.tensor(name, cache, dtype=torch.uint8)
        if cache.dim() != 2:
            raise ValueError(f"{name}: {fmt} is uint8 [num_blocks, page_bytes], got {tuple(cache.shape)}")
        found = _v4_page_size_of(cache.shape[1], fmt)
        if found is None:
            raise ValueError(f"{name}: {cache.shape[1]} bytes a page is no {fmt} page (page_size tokens x "
                             f"{v4_bytes_per_token(fmt)} B, padded up to a multiple of {_V4_ROW[fmt][4]})")
        if cache.stride(1) != 1:
            raise ValueError(f"{name}: each page must be contiguous (strides {cache.stride()})")
        stride = cache.stride(0)
        if cache.shape[0] > 1 and (stride < cache.shape[1] or stride % 16):
            raise ValueError(f"{name}: the block stride ({stride} B) must be >= a page ({cache.shape[1]} B) and a "
                             "multiple of 16")
    if cache.device.type == "cuda" and cache.data_ptr() % 16:
        raise ValueError(f"{name}: its data pointer must be 16-byte aligned")
    if page_size is not None and _checks.integer("page_size", page_size, 1) != found:
        raise ValueError(f"page_size: {page_size} does not match {name}'s pages ({found} tokens of {fmt})")
    return found


def v4_cache_parts(cache: torch.Tensor, page_size: int, fmt: str):
    """(values, scales) of a quantized V4 cache, both uint8 views of its pages: values [num_blocks,
    page_size, 576] (v4_fp8: 448 e4m3 then 64 bf16 as bytes) or [num_blocks, page_size, 512] (v4_mxfp8: e4m3);
    scales: each token's scale record, [num_blocks, page_size, 8] (v4_fp8: 7 UE8M0 bytes, then the pad byte)
    or [num_blocks, page_size, 16] (v4_mxfp8), a UE8M0 byte e standing for 2^(e - 127)."""
    _v4_row(fmt)
    page_size = check_v4_cache(cache, fmt, page_size)
    value_bytes, scale_bytes = v4_value_bytes(fmt), v4_scale_bytes(fmt)
    num_blocks, block_stride = cache.shape[0], cache.stride(0)
    base = cache.storage_offset()
    values = cache.as_strided((num_blocks, page_size, value_bytes), (block_stride, value_bytes, 1), base)
    scales = cache.as_strided((num_blocks, page_size, scale_bytes), (block_stride, scale_bytes, 1),
                              base + page_size * value_bytes)
    return values, scales
