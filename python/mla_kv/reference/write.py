"""The write ops' specification: RMSNorm, RoPE and the paged cache write (see mla_kv.reference)."""
from __future__ import annotations

from typing import Optional

import torch

from . import quant

LATENT_DIM = 512
ROPE_DIM = 64
ROW_DIM = LATENT_DIM + ROPE_DIM


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with the mean of squares taken in float32 (float64 stays float64).

    Returns ``weight * x / sqrt(mean(x^2) + eps)`` rounded once to x's dtype.
    """
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * inv * weight.to(acc)).to(x.dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
               style: str = "interleaved") -> torch.Tensor:
    """Rotates the last dim (64) of x [T, ..., 64] by the angles at ``positions`` [T].

    cos_sin_cache [max_position, 64] holds [cos (32) | sin (32)] (see mla_kv.rope.cos_sin_cache).
    style "interleaved" rotates pairs (2i, 2i+1) (GPT-J; DeepSeek and GLM); "neox" pairs (i, i+32).
    The output keeps x's element order and dtype; the math is done in float32 (float64 for float64).
    x's first dim is the token dim; any dims between it and the last are broadcast (heads).
    """
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    half = ROPE_DIM // 2
    cs = cos_sin_cache[positions.long()].to(acc)
    shape = (cs.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cs[:, :half].reshape(shape), cs[:, half:].reshape(shape)
    xf = x.to(acc)
    if style == "interleaved":
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    elif style == "neox":
        a, b = xf[..., :half], xf[..., half:]
        out = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    else:
        raise ValueError(f"rope_style must be 'interleaved' or 'neox', got {style!r}")
    return out.to(x.dtype)


def write_kv(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, kv_format: Optional[str] = None,
             kv_scale: Optional[float] = None) -> None:
    """Writes rows [kv_c | k_pe] into the paged cache in place (vLLM's concat_and_cache_mla).

    kv_c [>=T, 512], k_pe [>=T, 64]; kv_cache [num_blocks, block_size, 576] (any strides);
    slot_mapping int64 [T]: token t goes to block slot // block_size, offset slot % block_size.
    Negative slots are padded tokens and are skipped, as are slots past the cache's capacity (the
    kernels never write outside the cache); only the first T input rows are read.
    kv_format (layout.KV_FORMATS): a quantized uint8 cache (reference.quant.write_rows) written from
    the rows in kv_c's dtype; kv_scale is "fp8"'s dequant scale.
    """
    t = slot_mapping.shape[0]
    if kv_format is not None:
        rows = torch.cat([kv_c[:t], k_pe[:t]], dim=-1)
        quant.write_rows(kv_cache, rows, slot_mapping, kv_format, kv_scale=kv_scale)
        return
    block_size = kv_cache.shape[1]
    keep = (slot_mapping >= 0) & (slot_mapping < kv_cache.shape[0] * block_size)
    rows = torch.cat([kv_c[:t], k_pe[:t]], dim=-1).to(kv_cache.dtype)
    # Indexed by (block, offset), not through a flat view: the cache may be strided, e.g. one layer of
    # a layout.BlockPool, whose blocks are not adjacent in memory.
    slots = slot_mapping[keep]
    kv_cache[slots // block_size, slots % block_size] = rows[keep]


def fused_write_kv(kv_a: torch.Tensor, rms_weight: torch.Tensor, eps: float,
                   positions: torch.Tensor, cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, *, rope_style: str = "interleaved",
                   q: Optional[torch.Tensor] = None, kv_format: Optional[str] = None,
                   kv_scale: Optional[float] = None) -> None:
    """RMSNorm + RoPE + cache write of the raw kv_a projection output, in place.

    kv_a [>=T, 576] = [c_kv (512) | k_pe (64)]; rms_weight [512]; positions int [>=T];
    cos_sin_cache [max_position, 64]; kv_cache/slot_mapping as in write_kv.
    The row written is [rms_norm(c_kv, rms_weight, eps) | apply_rope(k_pe, positions)].
    If q [T, H, D] is given, its last 64 values per head are rotated in place at the same positions
    (also for padded tokens, whose cache row is skipped). A token whose position lies outside
    [0, max_position) is left alone entirely: no cache row, no q rotation. kv_format / kv_scale as
    in write_kv (the normalized, rotated row is quantized in kv_a's dtype).
    """
    t = slot_mapping.shape[0]
    pos = positions[:t].long()
    ok = (pos >= 0) & (pos < cos_sin_cache.shape[0])
    pos = pos.where(ok, 0)
    kv_c = rms_norm(kv_a[:t, :LATENT_DIM], rms_weight, eps)
    k_pe = apply_rope(kv_a[:t, LATENT_DIM:], pos, cos_sin_cache, rope_style)
    write_kv(kv_c, k_pe, kv_cache, slot_mapping.where(ok, -1), kv_format=kv_format, kv_scale=kv_scale)
    if q is not None:
        rotated = apply_rope(q[:t, :, -ROPE_DIM:], pos, cos_sin_cache, rope_style)
        q[:t, :, -ROPE_DIM:] = torch.where(ok[:, None, None], rotated, q[:t, :, -ROPE_DIM:])


# The attention ops' specification lives in its own module; it is part of this one's API.
