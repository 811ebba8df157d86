"""The quantized formats' spec (mla_kv.reference.quant) against byte layouts built here by hand from
the formats' definitions (../shared/notes/facts.md): an e4m3 decoder from the bits, fp8_ds_mla rows
assembled with struct, TurboMind's int4 nibble order written out, the int8 / int4 block trailer."""
import math
import struct
from fractions import Fraction

import pytest
import torch

from mla_kv import layout
from mla_kv.reference import quant as Q


def e4m3_from_bits(code: int) -> float:
    """OCP E4M3: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN."""
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man / 8 * 2.0 ** -6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


TABLE = [e4m3_from_bits(c) for c in range(256)]


def test_e4m3_decoding_matches_the_bit_definition_for_every_code():
    got = Q.e4m3_values(torch.arange(256, dtype=torch.uint8))
    for code, want in enumerate(TABLE):
        g = got[code].item()
        assert (math.isnan(g) and math.isnan(want)) or g == want, f"code 0x{code:02x}: {g} != {want}"
    assert max(v for v in TABLE if not math.isnan(v)) == Q.E4M3_MAX


def test_e4m3_encoding_rounds_to_nearest_even_and_saturates():
    finite = sorted({v for v in TABLE if not math.isnan(v)})
    xs = [0.0, 1e-9, -3e-3, 0.017, 1.0625, 1.1875, 5.5, 300.0, 447.9, 464.0, 1e6, -1e6]
    mids = [(a + b) / 2 for a, b in zip(finite, finite[1:])]  # exact ties
    gen = torch.Generator().manual_seed(0)
    xs += mids[::7] + (torch.randn(500, generator=gen) * 40).tolist()
    codes = Q.e4m3_codes(torch.tensor(xs, dtype=torch.float64))
    for x, code in zip(xs, codes.tolist()):
        c = max(-Q.E4M3_MAX, min(Q.E4M3_MAX, x))
        best = min(abs(v - c) for v in finite)
        candidates = [i for i, v in enumerate(TABLE) if not math.isnan(v) and abs(v - c) == best]
        assert code in candidates, f"{x}: code 0x{code:02x} ({TABLE[code]}) is not a nearest value"
        if len({TABLE[i] for i in candidates}) > 1:  # a tie: the even mantissa
            assert code & 1 == 0, f"{x}: tie resolved to odd code 0x{code:02x}"


def test_fp8_rows_are_e4m3_of_x_over_the_scale():
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(1)) * 3
    scale = 0.02
    data = Q.quantize_rows(x, "fp8", kv_scale=scale)
    assert data.dtype == torch.uint8 and data.shape == (5, 576)
    want = torch.tensor([[TABLE[c] for c in row] for row in data.tolist()]) * scale
    assert torch.equal(Q.dequantize_rows(data, "fp8", kv_scale=scale), want.float())
    # nearest representable: at most half a step of e4m3 (relative 2^-4) away, saturating at 448 * scale
    assert bool(((want - x.clamp(-448 * scale, 448 * scale)).abs() <= x.abs() * 2 ** -4 + 2 ** -10 * scale).all())
    for bad in (0, -1.0, math.inf, None, True):
        with pytest.raises(ValueError, match="kv_scale"):
            Q.quantize_rows(x, "fp8", kv_scale=bad)


def test_fp8_ds_mla_row_bytes_by_hand():
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(2))
    x[1, 128:256] = 0.0          # an all-zero tile: its scale is FLT_MIN
    x[2, :128] *= 1000.0         # a tile far above 448
    data = Q.quantize_rows(x, "fp8_ds_mla")
    assert data.shape == (3, 656) == (3, layout.row_bytes("fp8_ds_mla"))
    for r in range(3):
        raw = bytes(data[r].tolist())
        scales = struct.unpack("<4f", raw[512:528])
        for t in range(4):
            amax = float(x[r, 128 * t:128 * (t + 1)].abs().max())
            want = max(amax / 448, 2.0 ** -126)
            assert scales[t] == struct.unpack("<f", struct.pack("<f", want))[0], (r, t)
            for i in (0, 37, 127):
                code = raw[128 * t + i]
                got = TABLE[code] * scales[t]
                assert abs(got - float(x[r, 128 * t + i])) <= abs(float(x[r, 128 * t + i])) * 2 ** -4 + scales[t] * 2 ** -9
        rope = struct.unpack("<64H", raw[528:656])
        want_rope = x[r, 512:].to(torch.bfloat16).view(torch.int16).tolist()
        assert list(rope) == [v & 0xFFFF for v in want_rope]
    back = Q.dequantize_rows(data, "fp8_ds_mla")
    assert torch.equal(back[:, 512:], x[:, 512:].to(torch.bfloat16).float())
    assert torch.equal(back[1, 128:256], torch.zeros(128))


def _int_codes_by_hand(codes, kv_format):
    """[rows, 576] int64 codes of int8 bytes, or of int4 words in TurboMind's nibble order, unpacked by
    hand: a word's nibbles (low first) hold v0 v2 v4 v6 v1 v3 v5 v7."""
    if kv_format == "int8":
        return codes.long()
    values = torch.empty(codes.shape[0], 576, dtype=torch.long)
    for r in range(codes.shape[0]):
        raw = bytes(codes[r].tolist())
        for w in range(72):
            (word,) = struct.unpack("<I", raw[4 * w:4 * w + 4])
            for nibble, v in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
                values[r, 8 * w + v] = (word >> (4 * nibble)) & 0xF
    return values


def _round_fp32(x: Fraction) -> Fraction:
    """x rounded to the nearest fp32 value (ties to even, subnormals included), exactly."""
    if x < 0:
        return -_round_fp32(-x)
    if x == 0:
        return x
    e = x.numerator.bit_length() - x.denominator.bit_length()
    if Fraction(2) ** e > x:
        e -= 1
    ulp = Fraction(2) ** (max(e, -126) - 23)
    n, rem = divmod(x, ulp)
    n = int(n)
    if rem > ulp / 2 or (rem == ulp / 2 and n % 2):
        n += 1
    return n * ulp


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ds_tile_scale_by_product_and_one_fma_step_is_the_quotient(dtype):
    """The write kernel's fp8_ds_mla scale (write_kv.cuh e4m3_tile_scale): q = fl(a y), y = fl(1 / 448),
    then fl(q + fl(a - 448 q) y) (two fmas), floored at FLT_MIN, equals the spec's
    max(fl(a / 448), FLT_MIN) for every finite non-negative a of the dtype: checked in exact arithmetic."""
    bits = torch.arange(0, 0x7C00 if dtype == torch.float16 else 0x7F80, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype).float().tolist()
    y = _round_fp32(Fraction(1, 448))
    floor = Fraction(Q.FLT_MIN)
    assert float(y) == float(torch.ones(()) / 448)
    mismatches = []
    for a in map(Fraction, values):
        q = _round_fp32(a * y)
        fixed = _round_fp32(q + _round_fp32(a - 448 * q) * y)
        if max(fixed, floor) != max(_round_fp32(a / 448), floor):
            mismatches.append(float(a))
    assert len(values) > 30000 and mismatches == []
    # the product alone is not the quotient: the fma step is needed
    assert any(max(_round_fp32(a * y), floor) != max(_round_fp32(a / 448), floor) for a in map(Fraction, values[:2000]))


@pytest.mark.parametrize("kv_format,bits", [("int8", 8), ("int4", 4)])
@pytest.mark.parametrize("num", [3, 25])  # scale num / 256: fl(1 / scale) above 1 / scale, and below it
def test_int_codes_are_the_product_with_the_reciprocal(kv_format, bits, num):
    """The spec's code is rint(n r) with r = fl(1 / scale), the exact product rounded once: an exact tie
    of the quotient, n = (k + 1/2) scale, goes the way r leans (k + 1 above, k below), not to even."""
    top = 2 ** bits - 1
    scale = num / 256  # exact in fp16, as are top x scale and every (k + 1/2) scale in fp32
    k = torch.arange(574) % top
    rows = torch.cat([torch.tensor([0.0, top * scale]), (k + 0.5) * scale])[None]
    codes, sz = Q.quantize_rows(rows, kv_format, scale_dtype=torch.float16)
    assert float(sz[0, 0]) == scale and float(sz[0, 1]) == 0.0
    r = torch.ones(()) / torch.tensor(scale)
    leans_up = float(r.double()) * scale > 1.0  # exact in float64
    assert leans_up == (num == 3)
    values = _int_codes_by_hand(codes, kv_format)[0]
    assert values[0] == 0 and values[1] == top
    assert torch.equal(values[2:], k + 1 if leans_up else k)
    # the quotient's ties to even would differ on half of them: the case tells the two specs apart
    assert bool((values[2:] != torch.round(k + 0.5).long()).any())


@pytest.mark.parametrize("kv_format,bits", [("int8", 8), ("int4", 4)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int_rows_are_asymmetric_per_token_codes(kv_format, bits, dtype):
    x = torch.randn(6, 576, generator=torch.Generator().manual_seed(3)) * 4
    x[2] = 1.5  # a constant row: scale 0, every code 0
    codes, sz = Q.quantize_rows(x, kv_format, scale_dtype=dtype)
    assert codes.shape == (6, layout.row_bytes(kv_format)) and sz.dtype == dtype and sz.shape == (6, 2)
    top = 2 ** bits - 1
    scale = ((x.amax(-1) - x.amin(-1)) / top).to(dtype)
    assert torch.equal(sz[:, 0], scale) and torch.equal(sz[:, 1], x.amin(-1).to(dtype))
    values = _int_codes_by_hand(codes, kv_format)
    assert int(values.max()) <= top and int(values.min()) >= 0
    s, z = sz[:, :1].float(), sz[:, 1:].float()
    # the product with the fp32 reciprocal, exact in float64, rounded once (half to even)
    r = torch.ones_like(s) / torch.where(s > 0, s, 1.0)
    want = torch.where(s > 0, torch.round((x - z).double() * r.double()).float(), 0.0).clamp(0, top)
    assert torch.equal(values.float(), want)
    assert bool((values[2] == 0).all())
    back = Q.dequantize_rows(codes, kv_format, scale_zero=sz)
    assert torch.equal(back, values.float() * s + z)
    # within half a step of the stored scale (plus what rounding the scale and zero to dtype costs)
    slack = (x.amax(-1) - x.amin(-1)).abs()[:, None] * (2 ** -8 if dtype == torch.float16 else 2 ** -5)
    assert bool(((back - x).abs() <= s / 2 + slack + 1e-6).all())


def test_int4_packing_of_a_known_row():
    codes = torch.arange(576) % 16
    x = codes.float()[None]  # min 0, max 15: scale 1, zero 0, codes = the values themselves
    data, sz = Q.quantize_rows(x, "int4")
    assert sz.tolist() == [[1.0, 0.0]]
    raw = bytes(data[0].tolist())
    # values 0..7 -> nibbles 0,2,4,6,1,3,5,7 -> bytes 0x20, 0x64, 0x31, 0x75
    assert raw[:4] == bytes([0x20, 0x64, 0x31, 0x75])
    assert raw[4:8] == bytes([0xA8, 0xEC, 0xB9, 0xFD])  # values 8..15


@pytest.mark.parametrize("kv_format", ["int8", "int4"])
def test_block_region_is_rows_then_the_trailer(kv_format):
    block_size, dtype = 16, torch.float16
    x = torch.randn(3 * block_size, 576, generator=torch.Generator().manual_seed(4))
    codes, sz = Q.quantize_rows(x, kv_format, scale_dtype=dtype)
    blocks = Q.pack_blocks(codes.view(3, block_size, -1), sz.view(3, block_size, 2), kv_format)
    rb = layout.row_bytes(kv_format)
    assert blocks.shape == (3, layout.block_bytes(kv_format, block_size, dtype)) == (3, block_size * (rb + 4))
    raw = bytes(blocks[1].tolist())
    token = 5
    assert raw[token * rb:(token + 1) * rb] == bytes(codes[block_size + token].tolist())
    pair = struct.unpack("<2e", raw[block_size * rb + 4 * token:block_size * rb + 4 * token + 4])
    assert list(pair) == sz[block_size + token].float().tolist()
    c, s = Q.unpack_blocks(blocks, kv_format, block_size, dtype)
    assert torch.equal(c.reshape(-1, rb), codes) and torch.equal(s.reshape(-1, 2), sz)


def test_layout_sizes_and_bad_formats():
    assert [layout.bytes_per_token(f) for f in layout.KV_FORMATS] == [1152, 576, 656, 580, 292]
    assert layout.row_bytes(None, torch.float32) == 2304
    assert layout.block_bytes("int4", 64, torch.bfloat16) == 64 * 292
    for bad in ("fp16", "FP8", 8):
        with pytest.raises(ValueError, match="kv_format"):
            layout.row_bytes(bad)
    with pytest.raises(ValueError, match="dtype"):
        layout.block_bytes("int8", 64, torch.float32)
    with pytest.raises(ValueError, match="block_size"):
        layout.block_bytes("fp8", 0)
    with pytest.raises(ValueError, match="data"):
        Q.dequantize_rows(torch.zeros(2, 575, dtype=torch.uint8), "fp8", kv_scale=1.0)
    with pytest.raises(ValueError, match="scale_zero"):
        Q.dequantize_rows(torch.zeros(2, 576, dtype=torch.uint8), "int8")
    cache = torch.zeros(1, layout.block_bytes("int8", 16), dtype=torch.uint8)
    with pytest.raises(TypeError, match="16-bit"):
        Q.write_rows(cache, torch.zeros(1, 576), torch.zeros(1, dtype=torch.int64), "int8")
    assert bool((cache == 0).all())


# ------------------------------------------------------------------------------ the ops' spec
@pytest.mark.parametrize("kv_format", ["fp8", "fp8_ds_mla", "int8", "int4"])
def test_quantized_write_then_decode_prefill_gather(kv_format):
    """write_kv into a quantized cache touches only its slots' bytes; decode / prefill / gather over it
    equal the 16-bit ops over the dequantized cache, which is within the format's error of the rows."""
    from mla_kv import reference

    gen = torch.Generator().manual_seed(5)
    block_size, num_blocks, dtype, scale = 16, 6, torch.float16, 0.05
    kv = {"kv_scale": scale} if kv_format == "fp8" else {}
    if kv_format in layout.TRAILER_FORMATS:
        cache = torch.randint(0, 256, (num_blocks, layout.block_bytes(kv_format, block_size, dtype)),
                              dtype=torch.uint8, generator=gen)
    else:
        cache = torch.randint(0, 256, (num_blocks, block_size, layout.row_bytes(kv_format)), dtype=torch.uint8,
                              generator=gen)
    before = cache.clone()
    lens = [20, 7]
    table = torch.tensor([[3, 0], [5, 1]], dtype=torch.int32)
    slots = torch.cat([torch.tensor([int(table[b, p // block_size]) * block_size + p % block_size
                                     for p in range(n)]) for b, n in enumerate(lens)])
    rows = (torch.randn(sum(lens), 576, generator=gen)).to(dtype)
    padded = torch.cat([slots, torch.tensor([-1, num_blocks * block_size])])
    rows_padded = torch.cat([rows, torch.randn(2, 576, generator=gen).to(dtype)])
    reference.write_kv(rows_padded[:, :512], rows_padded[:, 512:], cache, padded, kv_format=kv_format, **kv)

    # untouched bytes: everything but the written tokens' rows (and, for int8 / int4, their pairs)
    changed = (cache != before)
    rb = layout.row_bytes(kv_format)
    allowed = torch.zeros_like(changed)
    for s in slots.tolist():
        blk, off = divmod(s, block_size)
        if kv_format in layout.TRAILER_FORMATS:
            allowed[blk, off * rb:(off + 1) * rb] = True
            allowed[blk, block_size * rb + 4 * off:block_size * rb + 4 * off + 4] = True
        else:
            allowed[blk, off] = True
    assert not bool((changed & ~allowed).any()), "bytes outside the written slots changed"

    deq = Q.dequantize_cache(cache, kv_format, kv_scale=scale, scale_dtype=dtype)
    flat = deq.reshape(-1, 576)[slots]
    err = (flat - rows.float()).norm() / rows.float().norm()
    assert float(err) < {"fp8": 0.05, "fp8_ds_mla": 0.05, "int8": 0.01, "int4": 0.15}[kv_format], float(err)

    q = torch.randn(2, 1, 5, 576, generator=gen, dtype=torch.float64)
    seq = torch.tensor(lens, dtype=torch.int32)
    got = reference.decode(q, cache, table, seq, 0.1, kv_format=kv_format, scale_dtype=dtype, **kv)
    want = reference.decode(q, deq.double(), table, seq, 0.1)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    qp = torch.randn(7, 5, 576, generator=gen, dtype=torch.float64)
    got = reference.prefill(qp, cache, table, cu, seq, 0.1, kv_format=kv_format, scale_dtype=dtype, **kv)
    want = reference.prefill(qp, deq.double(), table, cu, seq, 0.1)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    cu_kv = torch.tensor([0, 20, 27], dtype=torch.int32)
    rows_out = reference.gather_kv(cache, table, cu_kv, kv_format=kv_format, dtype=dtype, **kv)
    assert rows_out.dtype == dtype and torch.equal(rows_out, flat.to(dtype))


def test_fused_write_quantizes_the_normalized_rotated_row():
    from mla_kv import reference
    from mla_kv.rope import cos_sin_cache

    gen = torch.Generator().manual_seed(6)
    kv_a = torch.randn(9, 576, generator=gen).half()
    w = torch.rand(512, generator=gen).half() + 0.5
    pos = torch.arange(9)
    cs = cos_sin_cache(64, 64, 10000.0)
    slots = torch.arange(9) + 3
    plain = torch.zeros(2, 16, 576, dtype=torch.float16)
    reference.fused_write_kv(kv_a, w, 1e-6, pos, cs, plain, slots)
    quantized = torch.zeros(2, layout.block_bytes("int8", 16, torch.float16), dtype=torch.uint8)
    reference.fused_write_kv(kv_a, w, 1e-6, pos, cs, quantized, slots, kv_format="int8")
    codes, sz = Q.quantize_rows(plain.view(-1, 576)[slots], "int8", scale_dtype=torch.float16)
    deq = Q.dequantize_cache(quantized, "int8").reshape(-1, 576)[slots]
    assert torch.equal(deq, Q.dequantize_rows(codes, "int8", scale_zero=sz))


@pytest.mark.parametrize("kv_format", [None, "fp8", "fp8_ds_mla", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_cache_shape_is_what_the_ops_accept(kv_format, dtype):
    """layout.paged_cache_shape allocates the form the checks read back (block size and bytes per block)."""
    shape = layout.paged_cache_shape(kv_format, 3, 16, dtype)
    if kv_format is None:
        assert shape == (3, 16, 576)
        return
    cache = torch.zeros(shape, dtype=torch.uint8)
    assert Q.cache_block_size(cache, kv_format, dtype) == 16
    assert cache[0].numel() == layout.block_bytes(kv_format, 16, dtype)
