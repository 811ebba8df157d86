"""gather_kv of quantized caches: the rows come out dequantized into float16 / bfloat16, latent first.

The caches are built byte by byte from the layouts (tests/quant_bytes.py), not with the library's
writer. The rows equal mla_kv.reference.gather_kv(kv_format=...) bit for bit (the spec) and lie within
one rounding of the dtype of the values this file's reader decodes; out rows past the gathered ones
keep their poison.
"""
import pytest
import torch

import mla_kv
from mla_kv import layout, reference

from gpu_checks import same_bytes
from quant_bytes import KV_SCALE, decode_rows, paged_bytes, random_rows

GPU = pytest.mark.gpu
pytestmark = pytest.mark.arch_variants("best", "sm70", bf16_needs_sm80=False)

FORMATS = ["fp8", "fp8_ds_mla", "int8", "int4"]
ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}  # relative; fp16 subnormals: 2^-24 apart
TINY = 2.0 ** -24


def table_of(ids, counts, width):
    table = torch.full((len(counts), width), -1, dtype=torch.int32)
    at = 0
    for b, c in enumerate(counts):
        table[b, :c] = ids[at:at + c]
        at += c
    return table


def expected_rows(rows, pairs, kv_format, dtype, slots, rope_first):
    """The reader's float64 values of the rows at slots, latent first."""
    values = decode_rows(rows[slots], kv_format, None if pairs is None else pairs[slots], dtype)
    return layout.to_latent_first(values) if rope_first else values


@GPU
@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("form", ["paged", "blocks"])
def test_gather_dequantizes(kv_format, dtype, form, arch):
    gen = torch.Generator().manual_seed(FORMATS.index(kv_format) * 7 + (form == "blocks"))
    bs, num_blocks = 32, 12
    rope_first = form == "blocks" and kv_format != "fp8_ds_mla"
    rows, pairs = random_rows(num_blocks * bs, kv_format, dtype, gen)
    cache = paged_bytes(rows, pairs, bs).cuda()
    counts_kv, starts = [40, 0, 70, 1], [5, 0, 0, 63]
    need = [-(-(s + c) // bs) for s, c in zip(starts, counts_kv)]
    ids = torch.randperm(num_blocks, generator=gen)[:sum(need)]
    cu = torch.tensor([0] + counts_kv).cumsum(0).int()
    starts_t = torch.tensor(starts, dtype=torch.int32)
    total = int(cu[-1])
    out = torch.full((total + 3, 576), float("nan"), dtype=dtype, device="cuda")
    table = table_of(ids, need, max(need))
    if form == "paged":
        scale = KV_SCALE if kv_format == "fp8" else None
        mla_kv.gather_kv(cache, table.cuda(), cu.cuda(), starts=starts_t.cuda(), out=out, kv_format=kv_format,
                         kv_scale=scale, arch=arch, validate=True)
    else:
        # the same bytes behind block pointers: each block's region at a 16-bit layer's distance into a block
        region = cache.view(num_blocks, -1)
        pad = layout.block_bytes(None, bs, dtype)
        pool = torch.randint(0, 256, (num_blocks, pad + region.shape[1]), generator=gen, dtype=torch.uint8).cuda()
        pool[:, pad:] = region
        cu_blocks = torch.tensor([0] + need).cumsum(0).int()
        blocks = layout.BlockPointerCache(
            (pool.data_ptr() + ids.long() * pool.stride(0)).cuda(), cu_blocks.cuda(), bs, pad, dtype,
            rope_first=rope_first, kv_format=kv_format, kv_scale=KV_SCALE if kv_format == "fp8" else None)
        mla_kv.gather_kv(blocks, None, cu.cuda(), starts=starts_t.cuda(), out=out, arch=arch, validate=True)
    slots = torch.cat([table[b, (s + torch.arange(c)) // bs].long() * bs + (s + torch.arange(c)) % bs
                       for b, (s, c) in enumerate(zip(starts, counts_kv))])
    spec = reference.gather_kv(cache.cpu(), table, cu, starts=starts_t, kv_format=kv_format,
                               kv_scale=KV_SCALE if kv_format == "fp8" else None, dtype=dtype)
    if rope_first:
        spec = layout.to_latent_first(spec)
    assert same_bytes(out[:total].cpu(), spec), f"{kv_format} {form}: rows differ from the spec's"
    want = expected_rows(rows, pairs, kv_format, dtype, slots, rope_first)
    err = (out[:total].double().cpu() - want).abs() - ULP[dtype] * want.abs() - TINY
    assert float(err.max()) <= 0, f"{kv_format} {form}: a row differs from the reader's values by more than a rounding"
    assert torch.isnan(out[total:]).all(), "rows past the gathered ones were written"


@GPU
@pytest.mark.parametrize("kv_format,kv_scale", [("fp8", KV_SCALE), ("fp8", 255.0), ("fp8", 256.0), ("fp8_ds_mla", None)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gather_e4m3_nan_codes_and_scales_from_2_to_the_8(kv_format, kv_scale, dtype, arch):
    """NaN codes (0x7F, 0xFF) among finite ones, and scales of 2^8 and more (fp8's kv_scale 256, a
    fp8_ds_mla tile's 256 or 300; 255 stays on the common path): the cases that the integer e4m3
    decode (dequant.cuh, the gather kernel's on every arch tag) hands to its per-value path. Rows equal
    the spec's, NaN where it is NaN (the NaN's bits aside)."""
    gen = torch.Generator().manual_seed(41 + int(kv_scale or 0))
    bs, num_blocks = 16, 4
    rows, _ = random_rows(num_blocks * bs, kv_format, dtype, gen)
    codes = 512 if kv_format == "fp8_ds_mla" else 576
    for r in range(0, rows.shape[0], 2):  # three NaN codes in every other row: most vectors keep none
        rows[r, torch.randint(0, codes, (3,), generator=gen)] = torch.tensor([0x7F, 0xFF, 0x7F], dtype=torch.uint8)
    if kv_format == "fp8_ds_mla":
        scales = rows[:, 512:528].clone().view(torch.float32)
        scales[1::3, 2] = 300.0
        scales[4::5, 0] = 256.0
        scales[3::4, 1] = 255.0
        rows[:, 512:528] = scales.view(torch.uint8)
    cache = paged_bytes(rows, None, bs).cuda()
    table = torch.randperm(num_blocks, generator=gen).int().view(1, -1)
    cu = torch.tensor([0, num_blocks * bs - 5], dtype=torch.int32)
    total = int(cu[-1])
    out = torch.full((total + 3, 576), float("nan"), dtype=dtype, device="cuda")
    out[total:] = -3.0  # a finite canary: NaN codes decode to NaN
    canary = out[total:].clone()
    mla_kv.gather_kv(cache, table.cuda(), cu.cuda(), out=out, kv_format=kv_format, kv_scale=kv_scale, arch=arch,
                     validate=True)
    assert same_bytes(out[total:], canary), "rows past the gathered ones were written"
    spec = reference.gather_kv(cache.cpu(), table, cu, kv_format=kv_format, kv_scale=kv_scale, dtype=dtype)
    got, nan = out[:total].cpu(), torch.isnan(spec)
    assert int(nan.any(1).sum()) >= 20, "the NaN codes did not decode to NaN in the spec"
    assert torch.equal(torch.isnan(got), nan), f"{kv_format}: NaN where the spec has none, or none where it has"
    assert same_bytes(got.masked_fill(nan, 0), spec.masked_fill(nan, 0)), f"{kv_format}: rows differ from the spec's"


# ------------------------------------------------------------------------------------ CPU
def test_cpu_gather_reads_the_bytes_as_the_reader_does():
    gen = torch.Generator().manual_seed(9)
    for kv_format in FORMATS:
        rows, pairs = random_rows(64, kv_format, torch.float16, gen)
        cache = paged_bytes(rows, pairs, 16)
        table = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)
        cu = torch.tensor([0, 20, 23], dtype=torch.int32)
        got = mla_kv.gather_kv(cache, table, cu, kv_format=kv_format, dtype=torch.float16,
                               kv_scale=KV_SCALE if kv_format == "fp8" else None)
        slots = torch.cat([torch.arange(32, 48), torch.arange(0, 4), torch.arange(48, 51)])
        want = expected_rows(rows, pairs, kv_format, torch.float16, slots, False)
        assert torch.allclose(got.double(), want, rtol=ULP[torch.float16], atol=TINY), kv_format


def test_quantized_gather_arguments_are_checked():
    cache = torch.zeros(2, 16 * 580, dtype=torch.uint8)
    table, cu = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="dtype: a int8 cache needs the dtype"):
        mla_kv.gather_kv(cache, table, cu, kv_format="int8")
    with pytest.raises(ValueError, match="dtype: only a quantized cache"):
        mla_kv.gather_kv(torch.zeros(2, 16, 576), table, cu, dtype=torch.float16)
    with pytest.raises(TypeError, match="out: expected dtype torch.bfloat16"):
        mla_kv.gather_kv(cache, table, cu, kv_format="int8", dtype=torch.bfloat16, out=torch.zeros(3, 576).half())
    with pytest.raises(ValueError, match="kv_cache"):
        mla_kv.gather_kv(cache, table, cu, kv_format="int4", dtype=torch.float16)
