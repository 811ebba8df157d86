"""DeepSeek-V4's KV cache (512-wide K = V rows): the specification of its row formats and of its write.

A row is [NoPE (448) | RoPE (64)] (layout.V4_DIM). Formats (layout.V4_FORMATS; page byte layout in mla_kv.layout):

- "bf16" / "fp16": the row in that dtype.
- "v4_fp8" (FlashMLA "MODEL1"): 576 value bytes [448 e4m3 | 64 bf16 (little-endian)] and an 8-byte scale record
  [7 UE8M0 | pad]. Scale j covers NoPE dims [64 j, 64 j + 64); the RoPE dims are stored as bf16 (round to nearest
  even), unscaled. The pad byte is written as 0.
- "v4_mxfp8" (V4.1): 512 e4m3 (RoPE included) and 16 UE8M0 scales, scale j for dims [32 j, 32 j + 32). [U] The
  notes have this format from a secondary source only (vLLM PR #56893); the scale rule below, the same as
  v4_fp8's, follows that source and a FlashMLA fork's tests/quant.py.

Scale rule (both formats), per group of dims with amax = max |x| (x the row as float32):
  s = 2^k, k = ceil(log2(max(fl32(amax / 448), fl32(1e-4)))), computed exactly (no floating log2);
  its UE8M0 byte is e = k + 127 (so s = 2^(e - 127)); code = e4m3(x / s), round to nearest even, clamped to
  +-448 (x / s is exact: s is a power of two). Dequantized value = e4m3 value * 2^(e - 127), exact in float32.
A zero group gets k = -13 (the 1e-4 floor) and all-zero codes; a NaN stays NaN in its code and makes its group's
amax NaN, whose scale byte is then unspecified.

The write (write_v4_kv) follows HF transformers' DeepseekV4Attention: kv = RMSNorm(kv; weight, eps) (float32
math, rounded to kv's dtype), then interleaved RoPE (pairs 2i, 2i + 1) on dims 448..511 (float32 math, rounded to
kv's dtype), then stored in the cache's format. q (optional): a weightless RMSNorm per head, as HF's
DeepseekV4UnweightedRMSNorm does it: q * fl_q(rsqrt(mean(q^2) + eps)) with the factor rounded to q's dtype
and the product taken in q's dtype, then the same RoPE on its trailing 64 dims. float64 inputs stay float64.

cos_sin_cache [max_position, 64] is [cos (32) | sin (32)] (mla_kv.rope): HF's DeepseekV4RotaryEmbedding returns
cos and sin of shape [..., 32] (one angle per pair, repeated per pair inside apply_rotary_pos_emb), so
``torch.cat([cos, sin], -1)`` of its output for positions 0..max_position-1 is this cache; HF rounds cos and
sin to the model dtype, so for HF's exact bytes build the cache from those rounded values.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._checks import tensor
from ..layout import (V4_DIM, V4_NOPE_DIM, V4_PLAIN_DTYPES, V4_ROPE_DIM, check_v4_cache, check_v4_format,
                      v4_cache_parts, v4_scale_bytes, v4_scale_count, v4_scale_group, v4_value_bytes)
from ._common import _acc_dtype, _check_index
from .quant import E4M3_MAX, e4m3_codes, e4m3_values
from .write import apply_rope, rms_norm

UE8M0_BIAS = 127
V4_SCALE_FLOOR = 1e-4  # the floor of amax / 448 (FlashMLA's FP8_AMAX_MARGIN): the scale of a zero group is 2^-13


def _scaled_part(fmt: str) -> int:
    """Dims that are e4m3 with a UE8M0 scale: the NoPE dims (v4_fp8), all of them (v4_mxfp8)."""
    return V4_NOPE_DIM if fmt == "v4_fp8" else V4_DIM


def _check_rows(name: str, rows) -> torch.Tensor:
    tensor(name, rows)
    if not rows.is_floating_point() or rows.dim() == 0 or rows.shape[-1] != V4_DIM:
        raise ValueError(f"{name}: expected floating-point rows [..., {V4_DIM}], got {rows.dtype} "
                         f"{tuple(rows.shape)}")
    return rows


def ue8m0_exponents(amax: torch.Tensor) -> torch.Tensor:
    """k (int32) with 2^k = 2^ceil(log2(max(fl32(amax / 448), fl32(1e-4)))) for float32 amax: the scale of a
    group of dims whose largest magnitude is amax. Exact: frexp's mantissa is 0.5 only for a power of two."""
    ratio = torch.clamp(amax.float() / torch.full_like(amax.float(), E4M3_MAX), min=V4_SCALE_FLOOR)
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    return torch.where(mantissa == 0.5, exponent - 1, exponent).to(torch.int32)


def quantize_v4_rows(rows: torch.Tensor, fmt: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rows [..., 512] -> (values, scales), the bytes of each row in a quantized V4 format (the module
    docstring's rule; rows are taken as float32, a float64 row rounded to float32 first):
    v4_fp8: values uint8 [..., 576] = [448 e4m3 | 64 bf16 as little-endian bytes], scales uint8 [..., 8] =
    [7 UE8M0 | 0]; v4_mxfp8: values uint8 [..., 512] e4m3, scales uint8 [..., 16] UE8M0."""
    v4_value_bytes(fmt)  # refuses the plain formats
    x = _check_rows("rows", rows).float()
    lead, scaled, group = x.shape[:-1], _scaled_part(fmt), v4_scale_group(fmt)
    groups = x[..., :scaled].reshape(*lead, scaled // group, group)
    k = ue8m0_exponents(groups.abs().amax(-1))
    scale = torch.ldexp(torch.ones_like(k, dtype=torch.float32), k)
    codes = e4m3_codes(groups / scale[..., None]).reshape(*lead, scaled)
    scale_bytes = torch.zeros(*lead, v4_scale_bytes(fmt), dtype=torch.uint8, device=x.device)
    scale_bytes[..., :v4_scale_count(fmt)] = (k + UE8M0_BIAS).to(torch.uint8)
    if fmt == "v4_mxfp8":
        return codes, scale_bytes
    rope = x[..., V4_NOPE_DIM:].to(torch.bfloat16).contiguous().view(torch.uint8).reshape(*lead, 2 * V4_ROPE_DIM)
    return torch.cat([codes, rope], -1), scale_bytes


def dequantize_v4_rows(values: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """The float32 rows [..., 512] that bytes (values, scales) stand for (as quantize_v4_rows returns them;
    v4_fp8's scales may be the 7 scale bytes or the 8-byte record): e4m3 value * 2^(e - 127) per scaled
    dim, v4_fp8's RoPE dims from their bf16. Exact."""
    v4_value_bytes(fmt)  # refuses the plain formats
    width, count = v4_value_bytes(fmt), v4_scale_count(fmt)
    tensor("values", values, dtype=torch.uint8)
    tensor("scales", scales, dtype=torch.uint8)
    if values.dim() == 0 or values.shape[-1] != width:
        raise ValueError(f"values: {fmt} rows are uint8 [..., {width}], got {tuple(values.shape)}")
    if scales.shape[:-1] != values.shape[:-1] or scales.shape[-1] not in (count, v4_scale_bytes(fmt)):
        raise ValueError(f"scales: expected uint8 [{', '.join(map(str, values.shape[:-1]))}, {count}] for "
                         f"{fmt}, got {tuple(scales.shape)}")
    lead, scaled, group = values.shape[:-1], _scaled_part(fmt), v4_scale_group(fmt)
    k = scales[..., :count].to(torch.int32) - UE8M0_BIAS
    scale = torch.ldexp(torch.ones_like(k, dtype=torch.float32), k)
    codes = e4m3_values(values[..., :scaled].contiguous()).reshape(*lead, scaled // group, group)
    scaled_rows = (codes * scale[..., None]).reshape(*lead, scaled)
    if fmt == "v4_mxfp8":
        return scaled_rows
    rope = values[..., scaled:].contiguous().view(torch.bfloat16).float()
    return torch.cat([scaled_rows, rope], -1)


def v4_kv_rows(kv: torch.Tensor, rms_weight: torch.Tensor, eps: float, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """The rows [T, 512] write_v4_kv stores (before the format), in kv's dtype, T = kv.shape[0]:
    rms_norm(kv, rms_weight, eps) (reference.write.rms_norm: float32 math, rounded to kv's dtype), then
    apply_rope(..., "interleaved") of its dims 448..511 at positions[:T] (each in [0, max_position))."""
    normed = rms_norm(kv, rms_weight, eps)
    rope = apply_rope(normed[:, V4_NOPE_DIM:], positions[:kv.shape[0]].long(), cos_sin_cache, "interleaved")
    return torch.cat([normed[:, :V4_NOPE_DIM], rope], -1)


def v4_q_rows(q: torch.Tensor, eps: float, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """q [T, H, 512] as the attention takes it, in q's dtype (HF's q_b_norm, then RoPE): per head
    q * r with r = rsqrt(mean(q^2) + eps) computed in float32 (float64 for float64) and rounded to q's dtype,
    the product rounded to q's dtype; then interleaved RoPE of dims 448..511 at positions[:T]."""
    factor = torch.rsqrt(q.to(_acc_dtype(q)).square().mean(-1, keepdim=True) + eps).to(q.dtype)
    normed = q * factor
    rope = apply_rope(normed[..., V4_NOPE_DIM:], positions[:q.shape[0]].long(), cos_sin_cache, "interleaved")
    return torch.cat([normed[..., :V4_NOPE_DIM], rope], -1)


def write_v4_kv(kv: torch.Tensor, rms_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, *, fmt: str,
                q: Optional[torch.Tensor] = None) -> None:
    """Writes DeepSeek-V4 K = V rows into one layer's paged cache (layout.check_v4_cache), in place.

    kv [>=T, 512] (kv_proj's output), rms_weight [512], positions int [>=T], cos_sin_cache [max_position, 64]
    ([cos | sin]), slot_mapping int [T] (T = its length; slot = block * page_size + offset, distinct slots).
    Token t's row is v4_kv_rows(kv)[t], stored in fmt: cast to the cache dtype (bf16 / fp16) or quantized by
    quantize_v4_rows into its page (values at offset * value bytes, scale record at page_size * value bytes +
    offset * scale bytes). Negative slots (padded tokens), slots past the cache and tokens whose position lies
    outside [0, max_position) are skipped; nothing else of a page changes (its padding included).
    q [>=T, H, 512] (optional): rows t < T whose position is in range become v4_q_rows(q)[t], in place.
    """
    check_v4_format(fmt)
    page_size = check_v4_cache(cache, fmt)
    slot_mapping = _check_index("slot_mapping", slot_mapping, 1)
    t = slot_mapping.shape[0]
    tensor("kv", kv, dims=2, last=V4_DIM)
    tensor("rms_weight", rms_weight, dims=1, last=V4_DIM)
    positions = _check_index("positions", positions, 1)
    tensor("cos_sin_cache", cos_sin_cache, dims=2, last=V4_ROPE_DIM)
    if not kv.is_floating_point():
        raise TypeError(f"kv: expected a floating-point dtype, got {kv.dtype}")
    if kv.shape[0] < t or positions.shape[0] < t:
        raise ValueError(f"{'kv' if kv.shape[0] < t else 'positions'}: needs >= {t} tokens (slot_mapping's "
                         f"length), got {kv.shape[0] if kv.shape[0] < t else positions.shape[0]}")
    if q is not None:
        tensor("q", q, dims=3, last=V4_DIM)
        if q.shape[0] < t or not q.is_floating_point():
            raise ValueError(f"q: expected floating-point [>={t}, H, {V4_DIM}], got {q.dtype} {tuple(q.shape)}")
    pos = positions[:t].to(kv.device)
    in_range = (pos >= 0) & (pos < cos_sin_cache.shape[0])
    pos = pos.where(in_range, 0)
    slots = slot_mapping.to(kv.device)
    keep = in_range & (slots >= 0) & (slots < cache.shape[0] * page_size)
    blocks, offsets = slots[keep] // page_size, slots[keep] % page_size
    if bool(keep.any()):
        rows = v4_kv_rows(kv[:t][keep], rms_weight, eps, pos[keep], cos_sin_cache)
        blocks, offsets = blocks.to(cache.device), offsets.to(cache.device)
        if fmt in V4_PLAIN_DTYPES:
            cache[blocks, offsets] = rows.to(device=cache.device, dtype=cache.dtype)
        else:
            values, scales = quantize_v4_rows(rows, fmt)
            value_pages, scale_pages = v4_cache_parts(cache, page_size, fmt)
            value_pages[blocks, offsets] = values.to(cache.device)
            scale_pages[blocks, offsets] = scales.to(cache.device)
    if q is not None:
        rotated = v4_q_rows(q[:t], eps, pos.to(q.device), cos_sin_cache)
        q[:t] = torch.where(in_range.to(q.device)[:, None, None], rotated, q[:t])


def read_v4_rows(cache: torch.Tensor, slots: torch.Tensor, fmt: str, page_size: int) -> torch.Tensor:
    """The float32 rows [N, 512] at slots [N] (slot = block * page_size + offset) of one layer's V4 cache, as
    the attention reads them (bf16 / fp16 widened; quantized rows by dequantize_v4_rows). A missing slot
    (negative or past the cache) reads as a row of NaN, so that attending to it by mistake shows."""
    check_v4_format(fmt)
    page_size = check_v4_cache(cache, fmt, page_size)
    slots = _check_index("slots", slots, 1).to(cache.device)
    present = (slots >= 0) & (slots < cache.shape[0] * page_size)
    safe = slots.where(present, 0)
    blocks, offsets = safe // page_size, safe % page_size
    if fmt in V4_PLAIN_DTYPES:
        rows = cache[blocks, offsets].float()
    else:
        value_pages, scale_pages = v4_cache_parts(cache, page_size, fmt)
        rows = dequantize_v4_rows(value_pages[blocks, offsets], scale_pages[blocks, offsets], fmt)
    return torch.where(present[:, None], rows, float("nan"))
