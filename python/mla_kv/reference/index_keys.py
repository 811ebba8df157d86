"""The indexer's key write (DeepSeek Sparse Attention: DeepSeek-V3.2, GLM-5.x): the specification.

Token t's index key k_t [128] (the indexer's wk projection) becomes, at position p_t:
  LayerNorm(k_t; weight, bias, eps) -> RoPE on dims 0..63 (the FIRST 64: "neox" pairs (i, i + 32),
  DeepSeek-V3.2; "interleaved" pairs (2i, 2i + 1), GLM-5.x) -> H x / sqrt(128) (H the 128-point Sylvester
  Hadamard matrix) -> e4m3 codes with one fp32 scale s = max(amax, 1e-4) / 448 (rounded up to a power of
  two for scale_fmt "ue8m0"), codes e4m3(clamp(x / s, +-448)), round half to even;
and its page of the index cache (mla_kv.layout: a page's page_size x 128 codes, then its page_size
scales) gets them. Optional index queries q [T, H, 128] get the same RoPE and Hadamard in place.

Values stay float32 from the LayerNorm's output to the quantizer (float64 inputs: float64), and every
sum is taken in the order the kernels take it (index_key_rows, hadamard_128), one IEEE operation at a
time, so that a kernel's bytes equal these (the model rounds to bf16 between the steps; the difference
is far below e4m3's step). q is rounded once, to its dtype, at the end.
"""
from __future__ import annotations

import ctypes
from typing import Optional, Tuple

import torch

from ..layout import INDEX_DIM, INDEX_ROPE_DIM, INDEX_ROW_BYTES, check_index_cache
from .quant import E4M3_MAX, e4m3_codes
from .write import apply_rope

AMAX_FLOOR = 1e-4  # the scale of an all-zero key: 1e-4 / 448


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def hadamard_128(x: torch.Tensor) -> torch.Tensor:
    """H x / sqrt(128) over the last dim (128) of x, H the Sylvester Hadamard matrix (H[i, j] =
    (-1)^popcount(i & j)), in float32 (float64 for float64 x; the result's dtype): the butterflies
    (a, b) -> (a + b, a - b) over element bits 0, 1, ..., 6 in that order (a the element with the bit
    clear), then a product by fl(1 / sqrt(128))."""
    acc = _compute_dtype(x)
    y = x.to(acc)
    lead = y.shape[:-1]
    for bit in range(7):
        h = 1 << bit
        pairs = y.reshape(*lead, INDEX_DIM // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*lead, INDEX_DIM)
    return y * torch.tensor(INDEX_DIM ** -0.5, dtype=acc)


def _halve(s: torch.Tensor, dim: int) -> torch.Tensor:
    """Entry v + w added into entry v for v < w, then the same for w / 2, ..., 1 along ``dim`` (a power
    of two long): the sum in the kernels' order."""
    while s.shape[dim] > 1:
        w = s.shape[dim] // 2
        s = s.narrow(dim, 0, w) + s.narrow(dim, w, w)
    return s.squeeze(dim)


def _row_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum over the last dim (128) in the kernels' order: eight lanes, lane g holding elements
    8g .. 8g+7 and 64+8g .. 64+8g+7 as its slots 0..15; each lane's slots by halving, then the lanes."""
    lanes = x.unflatten(-1, (2, 8, 8)).transpose(-3, -2).flatten(-2)  # [..., lane g, slot 8h + j]
    return _halve(_halve(lanes, -1), -1)


def _layer_norm(k: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    acc = _compute_dtype(k)
    x = k.to(acc)
    n = torch.tensor(1.0 / INDEX_DIM, dtype=acc)
    d = x - (_row_sum(x) * n)[..., None]
    var = _row_sum(d * d) * n
    spread = var + torch.tensor(eps, dtype=acc)
    # The kernels' root is IEEE's (__fsqrt_rn); torch's float32 sqrt on the CPU is not (about one result in
    # six is a step off). A float32's root taken in float64 rounds to the correctly rounded float32 one.
    root = torch.sqrt(spread.double()).to(acc) if acc == torch.float32 else torch.sqrt(spread)
    rstd = 1.0 / root
    return d * rstd[..., None] * weight.to(acc) + bias.to(acc)


def _rotate(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_style: str) -> torch.Tensor:
    """x [T, ..., 128] in its compute dtype with dims 0..63 rotated at ``positions`` [T], then H x / sqrt(128)."""
    rope = apply_rope(x[..., :INDEX_ROPE_DIM], positions, cos_sin_cache, rope_style)
    return hadamard_128(torch.cat([rope, x[..., INDEX_ROPE_DIM:]], dim=-1))


def index_key_rows(k: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                   positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_style: str = "neox") -> torch.Tensor:
    """The index keys [T, 128] before quantization, float32 (float64 for float64 k), T = k.shape[0]:
    LayerNorm (mean and variance by _row_sum's order, (x - mean) * rstd * weight + bias, rstd = 1 /
    sqrt(var + eps)), RoPE on dims 0..63 at positions[:T] (each in [0, max_position)), Hadamard."""
    pos = positions[:k.shape[0]].long()
    return _rotate(_layer_norm(k, ln_weight, ln_bias, eps), pos, cos_sin_cache, rope_style)


def quantize_index_keys(x: torch.Tensor, scale_fmt: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [..., 128], scales float32 [...]) of keys x [..., 128]: s = max(amax, 1e-4) / 448 in
    x's dtype (float32 or float64), for scale_fmt "ue8m0" rounded up to a power of two (2^ceil(log2 s),
    exactly); codes e4m3(clamp(x / s, +-448)), round half to even. value = code * scale."""
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"scale_fmt: None or 'ue8m0', got {scale_fmt!r}")
    amax = x.abs().amax(-1)
    s = torch.maximum(amax, torch.tensor(AMAX_FLOOR, dtype=x.dtype)) / E4M3_MAX
    if scale_fmt == "ue8m0":
        mantissa, exponent = torch.frexp(s)  # s = mantissa * 2^exponent, mantissa in [0.5, 1)
        s = torch.ldexp(torch.ones_like(s), torch.where(mantissa == 0.5, exponent - 1, exponent))
    return e4m3_codes(x / s[..., None]), s.float()


def _in_range(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    return (positions >= 0) & (positions < cos_sin_cache.shape[0])


def _rotate_q(q: Optional[torch.Tensor], positions: torch.Tensor, ok: torch.Tensor, cos_sin_cache: torch.Tensor,
              rope_style: str) -> None:
    """q[:T] rotated in place for the tokens whose position is in range (padded cache slots too)."""
    if q is None or not bool(ok.any()):
        return
    rows = q[:ok.shape[0]][ok]
    rotated = _rotate(rows.to(_compute_dtype(q)), positions[ok], cos_sin_cache, rope_style)
    q[:ok.shape[0]][ok] = rotated.to(q.dtype)


def _encoded(k, ln_weight, ln_bias, eps, positions, cos_sin_cache, rope_style, scale_fmt, keep):
    """(codes, scale bytes uint8 [n, 4]) of the tokens ``keep`` selects (positions in range)."""
    x = index_key_rows(k[keep], ln_weight, ln_bias, eps, positions[keep], cos_sin_cache, rope_style)
    codes, scales = quantize_index_keys(x, scale_fmt)
    return codes, scales.view(torch.uint8).view(-1, 4)


def write_index_keys(k: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                     positions: torch.Tensor, cos_sin_cache: torch.Tensor, index_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, *, rope_style: str = "neox", scale_fmt: Optional[str] = None,
                     q: Optional[torch.Tensor] = None) -> None:
    """Writes the index keys of k [>=T, 128] into a paged index cache (uint8 [num_blocks, page_size, 132]
    or [num_blocks, page_size, 1, 132]), in place: token t < T = slot_mapping.shape[0] to page
    slot // page_size, offset slot % page_size. Negative slots (padded tokens), slots past the cache and
    tokens whose position lies outside [0, max_position) are skipped; q [>=T, H, 128] (optional) is rotated
    in place for every token whose position is in range."""
    page_size = check_index_cache(index_cache)
    t = slot_mapping.shape[0]
    pos = positions[:t].long()
    ok = _in_range(pos, cos_sin_cache)
    slots = slot_mapping.long()
    keep = ok & (slots >= 0) & (slots < index_cache.shape[0] * page_size)
    if bool(keep.any()):
        codes, scale_bytes = _encoded(k[:t], ln_weight, ln_bias, eps, pos.where(ok, 0), cos_sin_cache, rope_style,
                                      scale_fmt, keep)
        pages = index_cache.as_strided((index_cache.shape[0], page_size * INDEX_ROW_BYTES), (index_cache.stride(0), 1))
        block, offset = (slots[keep] // page_size)[:, None], (slots[keep] % page_size)[:, None]
        pages[block, offset * INDEX_DIM + torch.arange(INDEX_DIM, device=pages.device)] = codes.to(pages.device)
        pages[block, page_size * INDEX_DIM + offset * 4 + torch.arange(4, device=pages.device)] = \
            scale_bytes.to(pages.device)
    _rotate_q(q, pos.where(ok, 0), ok, cos_sin_cache, rope_style)


def _host_bytes(address: int, nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] over host memory at ``address`` (a CPU block pointer), written through."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


def write_index_keys_blocks(k: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                            positions: torch.Tensor, cos_sin_cache: torch.Tensor, cache, cu_q_lens: torch.Tensor,
                            history_lens: torch.Tensor, *, readonly_lens: Optional[torch.Tensor] = None,
                            cp_size: int = 1, cp_rank: int = 0, rope_style: str = "neox",
                            scale_fmt: Optional[str] = None, q: Optional[torch.Tensor] = None) -> None:
    """write_index_keys through TurboMind-style block pointers (a layout.IndexBlockPointerCache whose
    block_ptrs hold host addresses: this reference writes the memory they point to). Input row t of
    sequence b (cu_q_lens[b] <= t < cu_q_lens[b + 1]) lands at global position history_lens[b] + t -
    cu_q_lens[b], which rank p % cp_size keeps at its local row p // cp_size: page
    block_ptrs[cu_block_nums[b] + row // block_seq_len] + layer_offset_bytes, offset row % block_seq_len.
    Rows past cu_q_lens[B], other ranks' positions, local rows below readonly_lens[b], rows past a
    sequence's blocks and tokens whose RoPE position (positions[t]) is out of range are skipped; q is
    rotated for every input row whose position is in range."""
    if cache.block_ptrs.device.type != "cpu":
        raise ValueError("cache.block_ptrs: the reference writes through host addresses (CPU block pointers)")
    t = k.shape[0]
    pos = positions[:t].long()
    ok = _in_range(pos, cos_sin_cache)
    cu_q, hist = cu_q_lens.cpu().long(), history_lens.cpu().long()
    cu_b, ptrs = cache.cu_block_nums.cpu().long(), cache.block_ptrs.cpu().long()
    readonly = None if readonly_lens is None else readonly_lens.cpu().long()
    bsl = cache.block_seq_len
    targets = []  # (input row, page address, offset)
    for b in range(cu_q.shape[0] - 1):
        for i in range(int(cu_q[b]), min(int(cu_q[b + 1]), t)):
            p = int(hist[b]) + i - int(cu_q[b])
            local = p // cp_size
            if p < 0 or p % cp_size != cp_rank or (readonly is not None and local < int(readonly[b])):
                continue
            block = local // bsl
            if block >= int(cu_b[b + 1] - cu_b[b]) or not bool(ok[i]):
                continue
            targets.append((i, int(ptrs[cu_b[b] + block]) + cache.layer_offset_bytes, local % bsl))
    if targets:
        keep = torch.zeros(t, dtype=torch.bool)
        keep[[row for row, _, _ in targets]] = True
        codes, scale_bytes = _encoded(k, ln_weight, ln_bias, eps, pos.where(ok, 0), cos_sin_cache, rope_style,
                                      scale_fmt, keep.to(k.device))
        order = {row: n for n, row in enumerate(keep.nonzero().flatten().tolist())}
        for row, page, offset in targets:
            region = _host_bytes(page, bsl * INDEX_ROW_BYTES)
            region[offset * INDEX_DIM:(offset + 1) * INDEX_DIM] = codes[order[row]].cpu()
            region[bsl * INDEX_DIM + offset * 4:bsl * INDEX_DIM + offset * 4 + 4] = scale_bytes[order[row]].cpu()
    _rotate_q(q, pos.where(ok, 0), ok, cos_sin_cache, rope_style)
