"""Quantized cache rows read byte by byte from the layouts of ../shared/notes/facts.md, independently
of mla_kv's own dequantizer: the tests' reader of the bytes the kernels write and the tests' writer of
the caches the kernels read."""
import math

import torch

KV_SCALE = 0.5  # fp8's dequant scale: values up to 224 are representable (the inputs stay below)
NIBBLE_VALUE = (0, 2, 4, 6, 1, 3, 5, 7)  # TurboMind int4: value index held by nibble 0 (low) .. 7


def e4m3(codes: torch.Tensor) -> torch.Tensor:
    """OCP e4m3 bytes -> float64, from the bit fields: sign, 4 exponent bits (bias 7), 3 mantissa bits."""
    c = codes.long()
    sign = torch.where(c & 0x80 > 0, -1.0, 1.0).double()
    exp, man = (c >> 3) & 0xF, (c & 7).double()
    normal = (1 + man / 8) * torch.pow(2.0, (exp - 7).double())
    value = torch.where(exp == 0, man / 8 * 2.0 ** -6, normal)
    return torch.where((c & 0x7F) == 0x7F, math.nan, sign * value)


def as_float(data: torch.Tensor, dtype) -> torch.Tensor:
    """Little-endian bytes [..., 4k] or [..., 2k] -> float64 values of dtype (float32, float16, bfloat16)."""
    return data.contiguous().view(dtype).double()


def decode_rows(rows: torch.Tensor, kv_format: str, pairs: torch.Tensor = None, dtype=None,
                kv_scale: float = KV_SCALE) -> torch.Tensor:
    """Stored rows [N, row_bytes] (+ int8 / int4 (scale, zero) bytes [N, 4] in dtype) -> values [N, 576],
    in the stored order."""
    if kv_format == "fp8":
        return e4m3(rows) * kv_scale
    if kv_format == "fp8_ds_mla":
        scales = as_float(rows[:, 512:528], torch.float32)                      # [N, 4]
        latent = e4m3(rows[:, :512]).view(-1, 4, 128) * scales[:, :, None]
        return torch.cat([latent.reshape(-1, 512), as_float(rows[:, 528:656], torch.bfloat16)], -1)
    sz = as_float(pairs, dtype)
    if kv_format == "int8":
        codes = rows.long()
    else:
        b = rows.long().view(-1, 72, 4)
        words = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24
        codes = torch.empty(rows.shape[0], 72, 8, dtype=torch.long, device=rows.device)
        for nibble, value in enumerate(NIBBLE_VALUE):
            codes[..., value] = (words >> (4 * nibble)) & 0xF
        codes = codes.view(-1, 576)
    return codes.double() * sz[:, :1] + sz[:, 1:]


def step(rows: torch.Tensor, kv_format: str, kv_scale: float = KV_SCALE) -> torch.Tensor:
    """Half the quantization step of each value of rows [N, 576] (float64), the error a reader may see."""
    x = rows.double()
    if kv_format == "fp8":
        return torch.maximum(x.abs() * 2.0 ** -4, torch.full_like(x, kv_scale * 2.0 ** -10))
    if kv_format == "fp8_ds_mla":
        tile = torch.clamp(x[:, :512].abs().view(-1, 4, 128).amax(-1) / 448, min=1e-30)
        latent = torch.maximum(x[:, :512].abs() * 2.0 ** -4, tile.repeat_interleave(128, 1) * 2.0 ** -10)
        return torch.cat([latent, x[:, 512:].abs() * 2.0 ** -8], -1)
    top = 255 if kv_format == "int8" else 15
    spread = x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)
    # half a step, plus the stored scale's rounding (bf16: 2^-9 relative) times the largest code
    return (spread / top * 0.5 * (1 + 2 ** -7) + spread * 2 ** -8).expand_as(x)


def random_rows(n: int, kv_format: str, dtype, gen: torch.Generator):
    """n stored rows of random content built byte by byte: (rows uint8 [n, row_bytes], pairs uint8 [n, 4] of
    int8 / int4's (scale, zero) in dtype, else None). e4m3 codes avoid the NaN code 0x7F / 0xFF."""
    def codes(count):
        c = torch.randint(0, 256, (n, count), generator=gen, dtype=torch.int32)
        return torch.where((c & 0x7F) == 0x7F, c - 1, c).to(torch.uint8)

    if kv_format == "fp8":
        return codes(576), None
    if kv_format == "fp8_ds_mla":
        scales = (torch.rand(n, 4, generator=gen) * 0.1 + 1e-3).view(torch.uint8)
        rope = torch.randn(n, 64, generator=gen).to(torch.bfloat16).view(torch.uint8)
        return torch.cat([codes(512), scales, rope], -1), None
    width = 576 if kv_format == "int8" else 288
    rows = torch.randint(0, 256, (n, width), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale = torch.rand(n, generator=gen) * 0.05 + 0.005
    zero = -2 * torch.rand(n, generator=gen)
    return rows, torch.stack([scale, zero], -1).to(dtype).view(torch.uint8)


def paged_bytes(rows: torch.Tensor, pairs, block_size: int) -> torch.Tensor:
    """Rows (capacity a multiple of block_size) as a paged cache: [num_blocks, block_size, row_bytes], or
    [num_blocks, block_size * row_bytes + block_size * 4] with the (scale, zero) pairs after a block's rows."""
    blocks = rows.view(-1, block_size, rows.shape[-1])
    if pairs is None:
        return blocks.clone()
    return torch.cat([blocks.reshape(blocks.shape[0], -1), pairs.view(blocks.shape[0], -1)], -1)
