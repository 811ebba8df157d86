"""The quantized cache formats, byte by byte: quantize / dequantize are the spec of each format.

Rows are in their storage order (latent first as vLLM lays them; a rope-first row is quantized as
it is stored, see layout.to_rope_first). ``layout.KV_FORMATS`` lists the formats:

- "fp8" (vLLM ``fp8``): 576 bytes, every value e4m3 of x / kv_scale, one per-tensor float scale;
  x = e4m3 * kv_scale. Every division here is one correctly rounded fp32 division; the kernels write
  the same bytes, by a product with the reciprocal wherever that provably rounds alike, else dividing.
- "fp8_ds_mla" (vLLM ``fp8_ds_mla``, FlashMLA's FP8 KV, SGLang NSA): 656 bytes. Bytes 0-511: the 512
  latent values in 4 tiles of 128, each e4m3 of x / s_t with s_t = max(amax_t / 448, FLT_MIN) (fp32);
  bytes 512-527: s_0..s_3 as little-endian fp32; bytes 528-655: the 64 rope values in bf16.
- "int8" / "int4" (TurboMind quant_policy 8 / 4): asymmetric per token over all 576 values:
  scale = (max - min) / (2^bits - 1), zero = min, both stored in the 16-bit compute dtype;
  code = round-half-to-even((x - zero) * r) saturated to [0, 2^bits - 1], r = 1 / scale in fp32 and
  the product exact (rounded once, to the code), computed from the stored (rounded) scale and zero so
  that x = code * scale + zero is what a reader gets. A product with the reciprocal, as TurboMind
  quantizes (in 16-bit precision there): one fma a value in the kernels. It differs from the quotient's
  code only within ~2^-16 of a half-integer; an exact tie of the quotient (x - zero = (k + 1/2) scale,
  frequent in 16-bit data) rounds as r's own rounding leans: up where fl(1 / scale) > 1 / scale.
  Where r is not a normal fp32 (a scale near the ends of fp32's range) the code is of the quotient
  fl((x - zero) / scale); a row whose values are all equal (scale 0) stores code 0 everywhere.
  int8 codes are one byte each (576 bytes); int4 packs 8 consecutive codes v0..v7 into a
  little-endian 32-bit word whose nibbles, from the low one up, hold v0, v2, v4, v6, v1, v3, v5, v7
  (288 bytes). A layer's region of a block is
  [block_size rows of codes][block_size (scale, zero) pairs in the compute dtype] (pack_blocks).

e4m3 is OCP FP8 E4M3 (torch.float8_e4m3fn): bias 7, no infinities, 0x7F / 0xFF NaN, largest 448.
Encoding rounds to nearest, ties to even, and saturates to +-448 (NaN stays NaN).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..layout import (LATENT_DIM, ROPE_DIM, ROW_DIM, TRAILER_FORMATS, block_bytes, cache_block_size, check_kv_format,
                      check_kv_scale, row_bytes)

E4M3_MAX = 448.0
FLT_MIN = torch.finfo(torch.float32).tiny  # the smallest fp32 normal: fp8_ds_mla's scale floor
DS_TILES = 4
DS_TILE = LATENT_DIM // DS_TILES
INT4_NIBBLE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # value held by nibble 0 (low) .. 7 of a 32-bit word
_BITS = {"int8": 8, "int4": 4}


def e4m3_codes(x: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 codes of x (round to nearest even, saturating to +-448, NaN kept)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 e4m3 codes."""
    return codes.view(torch.float8_e4m3fn).float()


def _divide(x: torch.Tensor, by: float) -> torch.Tensor:
    """x / by rounded once, as the kernels divide: torch's CUDA division by a Python scalar multiplies by
    its reciprocal, which rounds twice and would make the spec depend on the device."""
    return x / torch.full_like(x, by)


def _check_rows(rows: torch.Tensor) -> None:
    if not isinstance(rows, torch.Tensor) or not rows.is_floating_point():
        raise TypeError(f"rows: expected a floating-point tensor, got {type(rows).__name__}")
    if rows.dim() == 0 or rows.shape[-1] != ROW_DIM:
        raise ValueError(f"rows: the last dim must be {ROW_DIM}, got shape {tuple(rows.shape)}")


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[..., 576] codes 0..15 -> [..., 288] bytes in TurboMind's nibble order."""
    v = codes.to(torch.int32).reshape(*codes.shape[:-1], -1, 8)
    word = torch.zeros(v.shape[:-1], dtype=torch.int64, device=codes.device)
    for nibble, value in enumerate(INT4_NIBBLE_ORDER):
        word |= v[..., value].to(torch.int64) << (4 * nibble)
    shifts = torch.arange(4, device=codes.device) * 8
    return ((word[..., None] >> shifts) & 0xFF).to(torch.uint8).reshape(*codes.shape[:-1], -1)


def _unpack_int4(data: torch.Tensor) -> torch.Tensor:
    """[..., 288] bytes -> [..., 576] codes (int64)."""
    b = data.to(torch.int64).reshape(*data.shape[:-1], -1, 4)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    out = torch.empty(*word.shape, 8, dtype=torch.int64, device=data.device)
    for nibble, value in enumerate(INT4_NIBBLE_ORDER):
        out[..., value] = (word >> (4 * nibble)) & 0xF
    return out.reshape(*data.shape[:-1], -1)


def quantize_rows(rows: torch.Tensor, kv_format: str, *, kv_scale: Optional[float] = None,
                  scale_dtype: torch.dtype = torch.float16):
    """Rows [..., 576] -> their bytes in kv_format: uint8 [..., row_bytes] for "fp8" / "fp8_ds_mla";
    for "int8" / "int4" (codes uint8 [..., row_bytes], scale_zero [..., 2] in scale_dtype)."""
    check_kv_format(kv_format)
    if kv_format is None:
        raise ValueError("kv_format: None is the unquantized row (nothing to quantize)")
    _check_rows(rows)
    x = rows.float()
    if kv_format == "fp8":
        return e4m3_codes(_divide(x, check_kv_scale(kv_scale)))
    if kv_format == "fp8_ds_mla":
        tiles = x[..., :LATENT_DIM].reshape(*x.shape[:-1], DS_TILES, DS_TILE)
        scale = torch.clamp(_divide(tiles.abs().amax(-1), E4M3_MAX), min=FLT_MIN)
        codes = e4m3_codes(tiles / scale[..., None]).reshape(*x.shape[:-1], LATENT_DIM)
        scale_bytes = scale.contiguous().view(torch.uint8).reshape(*x.shape[:-1], 4 * DS_TILES)
        rope_bytes = x[..., LATENT_DIM:].to(torch.bfloat16).contiguous().view(torch.uint8)
        return torch.cat([codes, scale_bytes, rope_bytes.reshape(*x.shape[:-1], 2 * ROPE_DIM)], -1)
    if scale_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"scale_dtype: {kv_format} stores scale and zero in float16 or bfloat16, got {scale_dtype}")
    top = 2 ** _BITS[kv_format] - 1
    lo, hi = x.amin(-1), x.amax(-1)
    scale, zero = _divide(hi - lo, top).to(scale_dtype), lo.to(scale_dtype)
    s, z = scale.float()[..., None], zero.float()[..., None]
    n, r = x - z, torch.ones_like(s) / s  # a tensor division: correctly rounded on every device
    by_product = (r >= FLT_MIN) & torch.isfinite(r)
    # n r is exact in float64 (24 + 24 significant bits), so its round is the once-rounded product's
    product = torch.round(n.double() * torch.where(by_product, r, 0.0).double()).float()
    quotient = torch.round(n / torch.where(s > 0, s, 1.0))
    codes = torch.where(by_product, product, torch.where(s > 0, quotient, 0.0)).clamp(0, top).to(torch.uint8)
    if kv_format == "int4":
        codes = _pack_int4(codes)
    return codes, torch.stack([scale, zero], -1)


def dequantize_rows(data: torch.Tensor, kv_format: str, *, kv_scale: Optional[float] = None,
                    scale_zero: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The float32 rows [..., 576] that bytes ``data`` (as quantize_rows returns them) stand for."""
    check_kv_format(kv_format)
    if kv_format is None:
        raise ValueError("kv_format: None is the unquantized row (nothing to dequantize)")
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.shape[-1:] != (row_bytes(kv_format),):
        raise ValueError(f"data: expected uint8 [..., {row_bytes(kv_format)}] for {kv_format}, got "
                         f"{getattr(data, 'dtype', type(data).__name__)} {tuple(getattr(data, 'shape', ()))}")
    if kv_format == "fp8":
        return e4m3_values(data) * check_kv_scale(kv_scale)
    if kv_format == "fp8_ds_mla":
        lead = data.shape[:-1]
        codes = e4m3_values(data[..., :LATENT_DIM].contiguous()).reshape(*lead, DS_TILES, DS_TILE)
        scale = data[..., LATENT_DIM:LATENT_DIM + 4 * DS_TILES].contiguous().view(torch.float32)
        rope = data[..., LATENT_DIM + 4 * DS_TILES:].contiguous().view(torch.bfloat16).float()
        return torch.cat([(codes * scale[..., None]).reshape(*lead, LATENT_DIM), rope], -1)
    if scale_zero is None or scale_zero.shape != (*data.shape[:-1], 2):
        raise ValueError(f"scale_zero: {kv_format} needs [..., 2] (scale, zero) per row, got "
                         f"{None if scale_zero is None else tuple(scale_zero.shape)}")
    codes = _unpack_int4(data) if kv_format == "int4" else data.to(torch.int64)
    sz = scale_zero.float()
    return codes.float() * sz[..., :1] + sz[..., 1:]


def pack_blocks(codes: torch.Tensor, scale_zero: torch.Tensor, kv_format: str) -> torch.Tensor:
    """int8 / int4 paged form: codes [num_blocks, block_size, row_bytes] and scale_zero
    [num_blocks, block_size, 2] (16-bit) -> uint8 [num_blocks, block_bytes], each block's rows of codes
    followed by its (scale, zero) pairs, token by token."""
    if kv_format not in TRAILER_FORMATS:
        raise ValueError(f"kv_format: blocks with a trailer are {TRAILER_FORMATS}, got {kv_format!r}")
    num_blocks, block_size = codes.shape[:2]
    trailer = scale_zero.contiguous().view(torch.uint8).reshape(num_blocks, -1)
    out = torch.cat([codes.reshape(num_blocks, -1), trailer], -1)
    assert out.shape[1] == block_bytes(kv_format, block_size, scale_zero.dtype)
    return out


def unpack_blocks(blocks: torch.Tensor, kv_format: str, block_size: int,
                  dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """The inverse of pack_blocks: (codes [num_blocks, block_size, row_bytes], scale_zero
    [num_blocks, block_size, 2] in dtype)."""
    if kv_format not in TRAILER_FORMATS:
        raise ValueError(f"kv_format: blocks with a trailer are {TRAILER_FORMATS}, got {kv_format!r}")
    size = block_bytes(kv_format, block_size, dtype)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != size:
        raise ValueError(f"blocks: expected uint8 [num_blocks, {size}], got {blocks.dtype} {tuple(blocks.shape)}")
    rows = block_size * row_bytes(kv_format)
    codes = blocks[:, :rows].reshape(blocks.shape[0], block_size, -1)
    scale_zero = blocks[:, rows:].contiguous().view(dtype).reshape(blocks.shape[0], block_size, 2)
    return codes, scale_zero


# ------------------------------------------------------------------------------ paged caches
def dequantize_cache(kv_cache: torch.Tensor, kv_format: str, *, kv_scale: Optional[float] = None,
                     scale_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Every row of a quantized paged cache as float32 [num_blocks, block_size, 576]: what the
    attention and gather kernels read from it (scale_dtype: the 16-bit type of int8 / int4 scales)."""
    block_size = cache_block_size(kv_cache, kv_format, scale_dtype)
    if kv_format in TRAILER_FORMATS:
        codes, sz = unpack_blocks(kv_cache, kv_format, block_size, scale_dtype)
        return dequantize_rows(codes, kv_format, scale_zero=sz)
    return dequantize_rows(kv_cache, kv_format, kv_scale=kv_scale)


def write_rows(kv_cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor, kv_format: str, *,
               kv_scale: Optional[float] = None) -> None:
    """Quantizes rows [T, 576] (in their compute dtype, float16 / bfloat16: also the int8 / int4 scale
    type) into the slots of a quantized paged cache, in place; negative and past-the-cache slots
    are skipped, and nothing else of a block changes (an int8 / int4 token's codes and its pair)."""
    if kv_format in TRAILER_FORMATS and rows.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"rows: {kv_format} stores its scale and zero in the rows' 16-bit dtype, got {rows.dtype}")
    scale_dtype = rows.dtype if rows.dtype in (torch.float16, torch.bfloat16) else torch.float16
    block_size = cache_block_size(kv_cache, kv_format, scale_dtype)
    keep = (slot_mapping >= 0) & (slot_mapping < kv_cache.shape[0] * block_size)
    slots, rows = slot_mapping[keep].long(), rows[keep]
    blocks, offsets = slots // block_size, slots % block_size
    if kv_format not in TRAILER_FORMATS:
        kv_cache[blocks, offsets] = quantize_rows(rows, kv_format, kv_scale=kv_scale)
        return
    codes, sz = quantize_rows(rows, kv_format, scale_dtype=scale_dtype)
    rb = row_bytes(kv_format)
    columns = torch.arange(rb, device=kv_cache.device)
    kv_cache[blocks[:, None], offsets[:, None] * rb + columns] = codes
    pair = sz.contiguous().view(torch.uint8).reshape(-1, 4)
    kv_cache[blocks[:, None], block_size * rb + offsets[:, None] * 4 + torch.arange(4, device=kv_cache.device)] = pair
