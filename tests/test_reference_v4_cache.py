"""DeepSeek-V4 cache reference (mla_kv.reference.v4_cache) against an encoder written here from the notes
(../shared/notes/deepseek-v4.md, "Row formats"): numpy, bit by bit, no torch float8 and no reference code."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mla_kv import layout
from mla_kv.reference import v4_cache

FORMATS = ("v4_fp8", "v4_mxfp8")
NOPE, DIM = 448, 512


# ------------------------------------------------------------------------ the independent encoder
def np_e4m3(x: np.ndarray) -> np.ndarray:
    """OCP e4m3 bytes of float32 values (round half to even, saturating at +-448), from the bit layout."""
    v = np.clip(x.astype(np.float64), -448.0, 448.0)
    sign = np.signbit(v).astype(np.uint8) << 7
    a = np.abs(v)
    out = np.zeros(a.shape, dtype=np.uint8)
    sub = a < 2.0 ** -6  # subnormals: steps of 2^-9, code = the step count (8 steps is the first normal, 0x08)
    out[sub] = np.rint(a[sub] / 2.0 ** -9).astype(np.uint8)
    norm = ~sub
    e = np.floor(np.log2(a[norm])).astype(np.int64)
    q = np.rint(a[norm] / 2.0 ** (e - 3)) * 2.0 ** (e - 3)  # 3 mantissa bits; may carry into the next binade
    e = np.where(q >= 2.0 ** (e + 1), e + 1, e)
    mantissa = np.rint(q / 2.0 ** e * 8).astype(np.int64) - 8
    out[norm] = (((e + 7) << 3) | mantissa).astype(np.uint8)
    return out | sign


def np_bf16_bytes(x: np.ndarray) -> np.ndarray:
    """Little-endian bf16 bytes of float32 values (round half to even on the dropped 16 bits)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    h = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return h.view(np.uint8).reshape(*x.shape[:-1], -1)


def np_scale_exponent(amax: np.ndarray) -> np.ndarray:
    """ceil(log2(max(amax / 448, 1e-4))) in float32, from the float32 bits (the ratio is always normal)."""
    ratio = np.maximum(amax.astype(np.float32) / np.float32(448.0), np.float32(1e-4))
    bits = ratio.view(np.uint32)
    return ((bits >> 23) & 0xFF).astype(np.int64) - 127 + ((bits & 0x7FFFFF) != 0)


def np_encode(rows: np.ndarray, fmt: str):
    """(values [N, w], scales [N, 8 or 16]) bytes of float32 rows [N, 512]."""
    group, scaled = (64, NOPE) if fmt == "v4_fp8" else (32, DIM)
    n = rows.shape[0]
    groups = rows[:, :scaled].reshape(n, -1, group)
    k = np_scale_exponent(np.abs(groups).max(-1))
    codes = np_e4m3(groups / np.float32(2.0) ** k[..., None].astype(np.float32)).reshape(n, scaled)
    scales = np.zeros((n, 8 if fmt == "v4_fp8" else 16), dtype=np.uint8)
    scales[:, :k.shape[1]] = k + 127
    if fmt == "v4_fp8":
        codes = np.concatenate([codes, np_bf16_bytes(rows[:, NOPE:])], 1)
    return codes, scales


def np_page_size_bytes(page_size: int, fmt: str) -> int:
    per_token, align = (584, 576) if fmt == "v4_fp8" else (528, 512)
    return math.ceil(page_size * per_token / align) * align


def np_write(pages: np.ndarray, page_size: int, slots, rows: np.ndarray, fmt: str) -> np.ndarray:
    """pages (uint8 [num_blocks, page bytes]) with rows written at slots, as the notes lay a page out."""
    out = pages.copy()
    values, scales = np_encode(rows, fmt)
    width, record = values.shape[1], scales.shape[1]
    for row, slot in enumerate(slots):
        block, offset = divmod(int(slot), page_size)
        out[block, offset * width:(offset + 1) * width] = values[row]
        start = page_size * width + offset * record
        out[block, start:start + record] = scales[row]
    return out


def special_rows(gen: torch.Generator) -> torch.Tensor:
    """Rows that hit the scale rule's edges: amax exactly 448 * 2^k, just above it, tiny (the 1e-4 floor), zero,
    e4m3 ties, subnormal codes and mixed magnitudes across groups."""
    rows = torch.randn(10, DIM, generator=gen)
    rows[0] = 0.0
    rows[1] = torch.randn(DIM, generator=gen) * 1e-7
    for j, k in enumerate(range(-3, 11)):  # group j's amax exactly 448 * 2^k
        rows[2, 32 * j] = 448.0 * 2.0 ** k
        rows[3, 32 * j] = np.nextafter(np.float32(448.0 * 2.0 ** k), np.float32(1e9)).item()
    rows[4] = torch.linspace(-1, 1, DIM) * 0.0447  # amax / 448 close to 1e-4
    rows[5] = (torch.arange(DIM) % 16 + 0.5) * 2.0 ** -4  # halfway points of e4m3 steps after scaling
    rows[6, :DIM // 2] *= 1e4
    rows[7] = torch.randn(DIM, generator=gen) * 2.0 ** -12
    rows[8] = -rows[8].abs()
    rows[9, ::7] = 0.0
    return rows


def poisoned_cache(num_blocks: int, page_size: int, fmt: str, gen: torch.Generator) -> torch.Tensor:
    shape = layout.v4_cache_shape(num_blocks, page_size, fmt)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)


def cos_sin(max_position: int, dtype=torch.float32, theta: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv
    return torch.cat([angles.cos(), angles.sin()], -1).to(dtype)


# ------------------------------------------------------------------------------------------ layout
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("page_size", [1, 2, 64, 72, 73])
def test_page_bytes_and_parts(fmt, page_size):
    assert layout.v4_page_bytes(page_size, fmt) == np_page_size_bytes(page_size, fmt)
    cache = torch.zeros(layout.v4_cache_shape(3, page_size, fmt), dtype=torch.uint8)
    assert layout.check_v4_cache(cache, fmt) == page_size
    values, scales = layout.v4_cache_parts(cache, page_size, fmt)
    width, record = (576, 8) if fmt == "v4_fp8" else (512, 16)
    assert values.shape == (3, page_size, width) and scales.shape == (3, page_size, record)
    values[1, page_size - 1, 0] = 1
    scales[2, page_size - 1, record - 2] = 2
    assert cache[1, (page_size - 1) * width] == 1
    assert cache[2, page_size * width + (page_size - 1) * record + record - 2] == 2
    assert int(cache.sum()) == 3


def test_plain_layout():
    assert layout.v4_cache_shape(4, 16, "bf16") == (4, 16, 512)
    assert layout.v4_page_bytes(16, "fp16") == 16 * 1024
    assert layout.check_v4_cache(torch.zeros(4, 16, 512, dtype=torch.float16), "fp16") == 16


@pytest.mark.parametrize("call, match", [
    (lambda: layout.v4_page_bytes(0, "v4_fp8"), "page_size"),
    (lambda: layout.v4_page_bytes(4, "fp8"), "fmt"),
    (lambda: layout.v4_cache_shape(0, 4, "v4_fp8"), "num_blocks"),
    (lambda: layout.check_v4_cache(torch.zeros(2, 1000, dtype=torch.uint8), "v4_fp8"), "cache"),
    (lambda: layout.check_v4_cache(torch.zeros(2, 2, 512), "bf16"), "cache"),
    (lambda: layout.check_v4_cache(torch.zeros(2, 1152, dtype=torch.uint8), "v4_fp8", 2), "page_size"),
    (lambda: layout.check_v4_cache(torch.zeros(2, 3, 1152, dtype=torch.uint8), "v4_fp8"), "cache"),
    (lambda: layout.check_v4_cache(torch.zeros(1152, 2, dtype=torch.uint8).t(), "v4_fp8"), "cache"),
    (lambda: layout.v4_cache_parts(torch.zeros(2, 2, 512, dtype=torch.bfloat16), 2, "bf16"), "fmt"),
])
def test_layout_errors_name_the_argument(call, match):
    with pytest.raises((TypeError, ValueError), match=f"^{match}"):
        call()


# ----------------------------------------------------------------------------------- row bytes
@pytest.mark.parametrize("fmt", FORMATS)
def test_row_bytes_match_the_notes(fmt):
    gen = torch.Generator().manual_seed(1)
    rows = torch.cat([special_rows(gen), torch.randn(64, DIM, generator=gen) * 3.0])
    values, scales = v4_cache.quantize_v4_rows(rows, fmt)
    expected_values, expected_scales = np_encode(rows.numpy(), fmt)
    np.testing.assert_array_equal(values.numpy(), expected_values)
    np.testing.assert_array_equal(scales.numpy(), expected_scales)
    assert (scales[0, :7 if fmt == "v4_fp8" else 16] == 127 - 13).all() and (values[0] == 0).all()  # zero row


def test_amax_on_a_power_of_two_uses_that_power():
    rows = torch.zeros(12, DIM)
    for k in range(12):
        rows[k, 5] = 448.0 * 2.0 ** (k - 6)
        rows[k, 6] = -rows[k, 5]
    for fmt in FORMATS:
        values, scales = v4_cache.quantize_v4_rows(rows, fmt)
        assert scales[:, 0].tolist() == [127 + k - 6 for k in range(12)]
        assert (values[:, 5] == 0x7E).all() and (values[:, 6] == 0xFE).all()  # +-448 exactly


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_error_bounds(fmt):
    gen = torch.Generator().manual_seed(2)
    rows = torch.randn(256, DIM, generator=gen) * torch.logspace(-6, 4, 256)[:, None]
    values, scales = v4_cache.quantize_v4_rows(rows, fmt)
    back = v4_cache.dequantize_v4_rows(values, scales, fmt)
    group, scaled = (64, NOPE) if fmt == "v4_fp8" else (32, DIM)
    scale = torch.ldexp(torch.ones(256, scaled // group), scales[:, :scaled // group].long() - 127)
    per_dim = scale.repeat_interleave(group, 1)
    err = (back[:, :scaled] - rows[:, :scaled]).abs()
    # half an e4m3 step: 2^-4 relative for normals, 2^-10 of the scale for subnormals
    assert (err <= torch.maximum(rows[:, :scaled].abs() * 2.0 ** -4, per_dim * 2.0 ** -10)).all()
    assert (rows[:, :scaled].abs().amax(-1) <= per_dim.amax(-1) * 448).all()
    if fmt == "v4_fp8":
        torch.testing.assert_close(back[:, NOPE:], rows[:, NOPE:].bfloat16().float(), rtol=0, atol=0)


# ----------------------------------------------------------------------------------- the write
def _write_inputs(t: int, gen: torch.Generator, dtype=torch.float32):
    kv = (torch.randn(t, DIM, generator=gen) * 4).to(dtype)
    weight = torch.rand(DIM, generator=gen) + 0.5
    positions = torch.randint(0, 100, (t,), generator=gen)
    return kv, weight, positions, cos_sin(100)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("page_size", [1, 2, 64])
def test_write_changes_only_the_written_slots(fmt, page_size):
    gen = torch.Generator().manual_seed(page_size)
    num_blocks = 3
    t = min(num_blocks * page_size, 40) + 3
    kv, weight, positions, table = _write_inputs(t, gen)
    slots = torch.randperm(num_blocks * page_size, generator=gen)[:t - 3]
    slots = torch.cat([slots, torch.tensor([-1, num_blocks * page_size, 0])])  # padded, past the cache, bad position
    positions[-1] = 100
    if slots.shape[0] and (slots[:-3] == 0).any():
        slots[-1] = -5
    cache = poisoned_cache(num_blocks, page_size, fmt, gen)
    before = cache.numpy().copy()
    v4_cache.write_v4_kv(kv, weight, 1e-6, positions, table, cache, slots, fmt=fmt)
    written = slots[:-3]
    rows = v4_cache.v4_kv_rows(kv[:-3], weight, 1e-6, positions[:-3], table)
    expected = np_write(before, page_size, written.tolist(), rows.numpy(), fmt)
    np.testing.assert_array_equal(cache.numpy(), expected)
    read = v4_cache.read_v4_rows(cache, torch.cat([written, torch.tensor([-1, 10 ** 6])]), fmt, page_size)
    assert torch.isnan(read[-2:]).all() and not torch.isnan(read[:-2]).any()
    values, scales = np_encode(rows.numpy(), fmt)
    torch.testing.assert_close(read[:-2], v4_cache.dequantize_v4_rows(torch.from_numpy(values),
                                                                      torch.from_numpy(scales), fmt))


def test_write_plain_rows():
    gen = torch.Generator().manual_seed(9)
    kv, weight, positions, table = _write_inputs(6, gen, torch.bfloat16)
    cache = torch.full((2, 4, DIM), 7.0, dtype=torch.bfloat16)
    slots = torch.tensor([5, 0, -1, 3, 7, 1])
    v4_cache.write_v4_kv(kv, weight, 1e-6, positions, table, cache, slots, fmt="bf16")
    rows = v4_cache.v4_kv_rows(kv, weight, 1e-6, positions, table)
    flat = cache.reshape(8, DIM)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat[slot], rows[t])
    assert (flat[[2, 4, 6]] == 7.0).all()
    torch.testing.assert_close(v4_cache.read_v4_rows(cache, slots[slots >= 0], "bf16", 4), rows[slots >= 0].float())


def _float64_rows(kv, weight, eps, positions, table):
    x = kv.double()
    x = x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps) * weight.double()
    cs = table.double()[positions]
    cos, sin = cs[:, :32], cs[:, 32:]
    even, odd = x[:, NOPE::2].clone(), x[:, NOPE + 1::2].clone()
    x[:, NOPE::2], x[:, NOPE + 1::2] = even * cos - odd * sin, odd * cos + even * sin
    return x


def test_kv_rows_against_float64():
    gen = torch.Generator().manual_seed(3)
    kv, weight, positions, table = _write_inputs(32, gen)
    expected = _float64_rows(kv, weight, 1e-6, positions, table)
    torch.testing.assert_close(v4_cache.v4_kv_rows(kv, weight, 1e-6, positions, table).double(), expected,
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v4_cache.v4_kv_rows(kv.double(), weight, 1e-6, positions, table.double()), expected,
                               rtol=1e-12, atol=1e-12)
    for fmt in FORMATS:  # the cache's bytes dequantize to within e4m3 (bf16 for the RoPE) of the float64 rows
        cache = torch.zeros(layout.v4_cache_shape(1, 32, fmt), dtype=torch.uint8)
        v4_cache.write_v4_kv(kv, weight, 1e-6, positions, table, cache, torch.arange(32), fmt=fmt)
        read = v4_cache.read_v4_rows(cache, torch.arange(32), fmt, 32).double()
        assert ((read - expected).abs() <= expected.abs() * 2.0 ** -4 + 2.0 ** -12).all()


def test_q_is_normed_and_rotated_in_place():
    gen = torch.Generator().manual_seed(4)
    kv, weight, positions, table = _write_inputs(5, gen)
    positions[2] = -1
    q = torch.randn(5, 3, DIM, generator=gen, dtype=torch.float64) * 3
    original = q.clone()
    cache = torch.zeros(layout.v4_cache_shape(1, 8, "v4_fp8"), dtype=torch.uint8)
    v4_cache.write_v4_kv(kv.double(), weight, 1e-6, positions, table.double(), cache, torch.arange(5), fmt="v4_fp8",
                         q=q)
    ok = positions >= 0
    expected = original / torch.sqrt(original.square().mean(-1, keepdim=True) + 1e-6)
    cs = table.double()[positions.clamp(min=0)][:, None]
    even, odd = expected[..., NOPE::2].clone(), expected[..., NOPE + 1::2].clone()
    expected[..., NOPE::2] = even * cs[..., :32] - odd * cs[..., 32:]
    expected[..., NOPE + 1::2] = odd * cs[..., :32] + even * cs[..., 32:]
    torch.testing.assert_close(q[ok], expected[ok], rtol=1e-12, atol=1e-12)
    assert torch.equal(q[~ok], original[~ok])
    assert (cache[0, 2 * 576:3 * 576] == 0).all()  # the out-of-range position wrote nothing


def test_matches_hf_transformers_kv_and_q():
    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    gen = torch.Generator().manual_seed(5)
    t, heads, eps = 7, 4, 1e-6
    kv = (torch.randn(1, t, DIM, generator=gen) * 3).bfloat16()
    q = (torch.randn(1, heads, t, DIM, generator=gen) * 3).bfloat16()
    norm = modeling.DeepseekV4RMSNorm(DIM, eps=eps).to(torch.float32)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(DIM, generator=gen) + 0.5)
    positions = torch.tensor([0, 3, 17, 64, 65, 100, 4095])
    inv = 1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64)
    freqs = positions[None, :, None].float() * inv  # as DeepseekV4RotaryEmbedding.forward, then cast like HF
    cos, sin = freqs.cos().bfloat16(), freqs.sin().bfloat16()
    with torch.no_grad():
        hf_kv = modeling.apply_rotary_pos_emb(norm(kv).unsqueeze(1), cos, sin).squeeze(1)[0]
        hf_q = modeling.apply_rotary_pos_emb(modeling.DeepseekV4UnweightedRMSNorm(eps=eps)(q), cos, sin)[0]
    table = torch.zeros(4096, 64, dtype=torch.bfloat16)
    table[positions] = torch.cat([cos, sin], -1)[0]  # HF's [.., 32] cos and sin -> our [cos | sin] rows
    cache = torch.zeros(1, 8, DIM, dtype=torch.bfloat16)
    ours_q = q[0].transpose(0, 1).contiguous()  # [T, H, 512]
    v4_cache.write_v4_kv(kv[0], norm.weight.detach(), eps, positions, table, cache, torch.arange(t), fmt="bf16",
                         q=ours_q)
    assert torch.equal(cache[0, :t], hf_kv)
    assert torch.equal(ours_q, hf_q.transpose(0, 1))


# ----------------------------------------------------------------------------------- bad input
def _good():
    gen = torch.Generator().manual_seed(6)
    kv, weight, positions, table = _write_inputs(4, gen)
    cache = torch.zeros(layout.v4_cache_shape(2, 4, "v4_fp8"), dtype=torch.uint8)
    return dict(kv=kv, rms_weight=weight, eps=1e-6, positions=positions, cos_sin_cache=table, cache=cache,
                slot_mapping=torch.arange(4), fmt="v4_fp8")


@pytest.mark.parametrize("name, value", [
    ("kv", torch.zeros(4, 576)), ("kv", [1.0]), ("rms_weight", torch.ones(448)), ("positions", torch.zeros(4)),
    ("positions", torch.zeros(2, dtype=torch.long)), ("cos_sin_cache", torch.zeros(100, 32)),
    ("cache", torch.zeros(2, 100, dtype=torch.uint8)), ("cache", torch.zeros(2, 2304)),
    ("slot_mapping", torch.zeros(4)), ("fmt", "fp8_ds_mla"), ("q", torch.zeros(4, 2, 576)),
])
def test_write_errors_name_the_argument(name, value):
    args = _good()
    args[name] = value
    fmt = args.pop("fmt")
    with pytest.raises((TypeError, ValueError), match=f"^{name}"):
        v4_cache.write_v4_kv(*args.values(), fmt=fmt) if name != "q" else \
            v4_cache.write_v4_kv(*list(args.values())[:-1], fmt=fmt, q=value)


def test_row_function_errors_name_the_argument():
    with pytest.raises(ValueError, match="^rows"):
        v4_cache.quantize_v4_rows(torch.zeros(2, 576), "v4_fp8")
    with pytest.raises(ValueError, match="^fmt"):
        v4_cache.quantize_v4_rows(torch.zeros(2, 512), "bf16")
    with pytest.raises(ValueError, match="^scales"):
        v4_cache.dequantize_v4_rows(torch.zeros(2, 576, dtype=torch.uint8), torch.zeros(2, 16, dtype=torch.uint8),
                                    "v4_fp8")
    with pytest.raises(ValueError, match="^page_size"):
        v4_cache.read_v4_rows(torch.zeros(1, 1152, dtype=torch.uint8), torch.arange(1), "v4_fp8", 2)
