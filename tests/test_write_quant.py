"""Quantizing writes (kv_format "fp8", "fp8_ds_mla", "int8", "int4"): write_kv, fused_write_kv and the
block-pointer forms into quantized caches.

Two checks per written row, both against bytes the test reads itself:
- the bytes equal mla_kv.reference.quant's quantizer applied to the row the 16-bit op writes (the
  spec; for the fused writes the row the same kernel variant writes into a 16-bit cache, whose
  RMSNorm and RoPE test_write.py checks against float64);
- the values decoded by this file's own reader, written from the byte layouts of
  ../shared/notes/facts.md (not with the library's dequantizer), lie within half a quantization step
  of that row.
Every other byte of the cache (other rows, other layers, the trailer pairs of other rows) keeps its
value. CPU tests cover the argument checks and the CPU path (the reference).
"""
import functools

import pytest
import torch

import mla_kv
from mla_kv import layout, reference
from mla_kv.reference import quant
from mla_kv.rope import cos_sin_cache

from gpu_checks import same_bytes
from quant_bytes import KV_SCALE, decode_rows, step

GPU = pytest.mark.gpu
pytestmark = pytest.mark.arch_variants("best", "sm70", bf16_needs_sm80=True)

FORMATS = ["fp8", "fp8_ds_mla", "int8", "int4"]
# -------------------------------------------------------------------------------- targets
class QuantCache:
    """A quantized paged cache inside a storage tensor (``view(storage)`` is the cache): its rows' bytes
    and the spec's expected storage."""

    def __init__(self, kv_format, dtype, block_size, view, kv_scale=KV_SCALE):
        self.kv_format, self.dtype, self.block_size, self.view = kv_format, dtype, block_size, view
        self.kv_scale = kv_scale

    def scale(self):
        return self.kv_scale if self.kv_format == "fp8" else None

    def rows_and_pairs(self, storage):
        """Every row's bytes [capacity, row_bytes] and (scale, zero) bytes [capacity, 4] (None: none)."""
        cache, rb = self.view(storage), layout.row_bytes(self.kv_format)
        if self.kv_format not in layout.TRAILER_FORMATS:
            return cache.reshape(-1, rb), None
        rows = cache[:, :self.block_size * rb].reshape(-1, rb)
        return rows, cache[:, self.block_size * rb:].reshape(-1, 4)

    def expect(self, before, rows_stored, slots):
        """The storage after writing rows (stored order) at slots by the spec."""
        want = before.clone()
        quant.write_rows(self.view(want), rows_stored, slots, self.kv_format, kv_scale=self.scale())
        return want


def paged_target(kv_format, dtype, num_blocks, block_size, gen):
    """(storage of random bytes, its QuantCache): a paged cache between two canary blocks."""
    shape = layout.paged_cache_shape(kv_format, num_blocks + 2, block_size, dtype)
    storage = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).cuda()
    return storage, QuantCache(kv_format, dtype, block_size, lambda s: s[1:-1])


def quant_inputs(num_tokens, dtype, gen, row_stride=640):
    wide = torch.randn(num_tokens, row_stride, generator=gen).to("cuda", dtype)
    kv_a = wide[:, row_stride - 576:]
    # a few rows with a wide range (int8 / int4 spread, fp8 saturation, fp8_ds_mla tile scales)
    kv_a[::7] *= 40
    kv_a[3::11, :128] *= 1e-3
    q = torch.randn(num_tokens, 3, 192, generator=gen).to("cuda", dtype)
    weight = (torch.rand(512, generator=gen) + 0.5).to("cuda", dtype)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).cuda()
    return kv_a, q, weight, positions


def rows16(fused, kv_a, weight, positions, cs, arch):
    """The 16-bit rows [T, 576] (latent first) the same kernel variant writes: the rows to quantize."""
    t = kv_a.shape[0]
    cache = torch.full((1, t, 576), float("nan"), dtype=kv_a.dtype, device="cuda")
    slots = torch.arange(t, device="cuda")
    if fused:
        mla_kv.fused_write_kv(kv_a, weight, 1e-6, positions, cs, cache, slots, arch=arch)
    else:
        mla_kv.write_kv(kv_a[:, :512], kv_a[:, 512:], cache, slots, arch=arch)
    return cache[0]


def check_rows(target, got_storage, want_storage, rows_stored, slots, what):
    """Bytes equal the spec's; this file's reader decodes the written rows to within half a step."""
    if not same_bytes(got_storage, want_storage):
        got_rows, got_pairs = target.rows_and_pairs(got_storage)
        want_rows, want_pairs = target.rows_and_pairs(want_storage)
        bad = (got_rows != want_rows).any(-1)
        if got_pairs is not None:
            bad |= (got_pairs != want_pairs).any(-1)
        first = int(bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} rows differ from the spec's bytes, first at slot {first}; "
                             f"untouched slots differ: {bool(bad[~written_mask(slots, bad.shape[0])].any())}")
    got_rows, got_pairs = target.rows_and_pairs(got_storage)
    keep = slots >= 0
    s = slots[keep]
    values = decode_rows(got_rows[s], target.kv_format, None if got_pairs is None else got_pairs[s], target.dtype,
                         target.kv_scale)
    want = rows_stored[keep].double()
    err = (values - want).abs() - step(want, target.kv_format, target.kv_scale)
    assert not torch.isnan(values).any(), f"{what}: NaN decoded"
    assert float(err.max()) <= 1e-9 * float(want.abs().max()), f"{what}: a decoded value is off by more than half a step"


def written_mask(slots, capacity):
    mask = torch.zeros(capacity, dtype=torch.bool, device=slots.device)
    mask[slots[slots >= 0]] = True
    return mask


# ------------------------------------------------------------------------------------ GPU
@GPU
@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("block_size", [16, 64])
def test_paged_quantized_write(kv_format, dtype, fused, block_size, arch):
    gen = torch.Generator().manual_seed(FORMATS.index(kv_format) * 17 + fused + block_size)
    num_tokens, num_blocks = 150, 12
    storage, target = paged_target(kv_format, dtype, num_blocks, block_size, gen)
    cache = target.view(storage)
    kv_a, q, weight, positions = quant_inputs(num_tokens, dtype, gen)
    cs = cos_sin_cache(64, 4096, 1e4, device="cuda")
    perm = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots = torch.where(torch.arange(num_tokens) % 9 == 4, -1, perm).cuda()
    before, q_kernel = storage.clone(), q.clone()
    if fused:
        mla_kv.fused_write_kv(kv_a, weight, 1e-6, positions, cs, cache, slots, q=q_kernel, kv_format=kv_format,
                              kv_scale=target.scale(), arch=arch)
    else:
        mla_kv.write_kv(kv_a[:, :512], kv_a[:, 512:], cache, slots, kv_format=kv_format,
                        kv_scale=target.scale(), arch=arch)
    rows = rows16(fused, kv_a, weight, positions, cs, arch)
    check_rows(target, storage, target.expect(before, rows, slots), rows, slots,
               f"{kv_format} {'fused' if fused else 'plain'} write")
    if fused:  # q is rotated as by the 16-bit fused write
        q_16 = q.clone()
        mla_kv.fused_write_kv(kv_a, weight, 1e-6, positions, cs, torch.empty(1, 1, 576, dtype=dtype, device="cuda"),
                              torch.full((num_tokens,), -1, device="cuda"), q=q_16, arch=arch)
        assert same_bytes(q_kernel, q_16), "q rotated differently"


@GPU
@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
def test_block_pointer_quantized_write(kv_format, dtype, fused, arch):
    """A TurboMind-style pool whose block holds a 16-bit layer, then the quantized layer (rows, then for
    int8 / int4 the block's (scale, zero) pairs), then another 16-bit layer; rows rope first (latent first
    for fp8_ds_mla). Sequences with history, read-only rows and a padded batch."""
    gen = torch.Generator().manual_seed(FORMATS.index(kv_format) * 5 + fused + 100)
    bsl, num_blocks = 32, 14
    rope_first = kv_format != "fp8_ds_mla"
    plain = layout.block_bytes(None, bsl, dtype)
    region = layout.block_bytes(kv_format, bsl, dtype)
    block = plain + region + plain  # every format's region of 32 rows is a multiple of 16 bytes
    storage = torch.randint(0, 256, (num_blocks, block), generator=gen, dtype=torch.uint8).cuda()
    q_lens, hist, readonly = [40, 1, 0, 25], [0, 70, 3, 31], [0, 64, 0, 32]
    counts = [-(-(h + n) // bsl) for h, n in zip(hist, q_lens)]
    ids = torch.randperm(num_blocks, generator=gen)[:sum(counts)]
    cu_blocks = torch.tensor([0] + counts).cumsum(0).int()
    cu_q = torch.tensor([0] + q_lens).cumsum(0).int()
    cache = layout.BlockPointerCache(
        block_ptrs=(storage.data_ptr() + ids.long() * block).cuda(), cu_block_nums=cu_blocks.cuda(),
        block_seq_len=bsl, layer_offset_bytes=plain, dtype=dtype, rope_first=rope_first, kv_format=kv_format,
        kv_scale=KV_SCALE if kv_format == "fp8" else None)
    total = int(cu_q[-1])
    kv_a, q, weight, positions = quant_inputs(total + 3, dtype, gen)
    cs = cos_sin_cache(64, 4096, 1e4, device="cuda")
    hist_t, readonly_t = torch.tensor(hist, dtype=torch.int32), torch.tensor(readonly, dtype=torch.int32)
    before = storage.clone()
    args = (cache, cu_q.cuda(), hist_t.cuda())
    if fused:
        mla_kv.fused_write_kv_blocks(kv_a, weight, 1e-6, positions, cs, *args, q=q, readonly_lens=readonly_t.cuda(),
                                     arch=arch, validate=True)
    else:
        mla_kv.write_kv_blocks(kv_a[:, :512], kv_a[:, 512:], *args, readonly_lens=readonly_t.cuda(), arch=arch,
                               validate=True)
    slots = layout.block_slots(cu_q, hist_t, cu_blocks, ids, bsl, readonly_lens=readonly_t).cuda()
    assert int((slots >= 0).sum()) == total - 1, "the case writes every token but one read-only row"
    rows = rows16(fused, kv_a[:total], weight, positions[:total], cs, arch)
    stored = layout.to_rope_first(rows) if rope_first else rows

    # the quantized layer of every block, as a paged cache (a view: the spec writes through it)
    target = QuantCache(kv_format, dtype, bsl, lambda s: s[:, plain:plain + region]
                        if kv_format in layout.TRAILER_FORMATS else s[:, plain:plain + region].unflatten(1, (bsl, -1)))
    want = target.expect(before, stored, slots)
    for name, span in (("the first 16-bit layer", slice(0, plain)), ("the last 16-bit layer", slice(plain + region, block))):
        assert same_bytes(storage[:, span], before[:, span]), f"{name} changed"
    check_rows(target, storage, want, stored, slots, f"{kv_format} block-pointer {'fused' if fused else 'plain'} write")


# ------------------------------------------------------------------ rounding boundaries
# e4m3 bytes: the kernels find most by a product with the reciprocal of the scale and divide only where
# the product may round otherwise than the spec's correctly rounded quotient. int codes: the spec is
# the product n r (r = fl(1 / scale)) rounded once, one fma. The rows below hold the values on which a
# kernel that trusts a product too far, never divides, divides where it should multiply, or rounds
# the int product twice (fl(n r), then to an integer) writes other bytes than the spec.
def _dtype_grid(dtype):
    """Every finite value of a 16-bit dtype, as float32."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype).float()
    return values[torch.isfinite(values)]


def _int_code_variants(v, lo, hi, dtype, top):
    """For values v (float32) of a row whose min and max are lo and hi: (the spec's codes, the quotient's
    round(fl(n / scale)), the twice-rounded product's round(fl(n r)))."""
    scale = ((hi - lo) / top).to(dtype).float()
    n = v - lo.to(dtype).float()
    r = 1 / scale
    spec = torch.round(n.double() * r.double()).clamp(0, top)
    return spec, torch.round(n / scale).clamp(0, top), torch.round(n * r).clamp(0, top)


@functools.lru_cache(maxsize=None)
def int_boundary_rows(kv_format, dtype, num_rows=96):
    """Rows [num_rows, 576] (float32 values of dtype) each holding its min lo and max hi and as many
    values of dtype's grid as the search finds on which the spec's code and the quotient's or the
    twice-rounded product's differ; the rest of the row random values between lo and hi. Returns
    (rows, number of values where the quotient differs, number where the twice-rounded one does)."""
    top = 255 if kv_format == "int8" else 15
    gen = torch.Generator().manual_seed(11 + top)
    grid = _dtype_grid(dtype)
    rows, by_quotient, by_twice = [], 0, 0
    for _ in range(20000):
        lo, hi = (torch.rand(2, generator=gen) * torch.tensor([-3.5, 3.5]) + torch.tensor([-0.5, 0.5])).to(dtype).float()
        v = grid[(grid > lo) & (grid < hi)]
        spec, quotient, twice = _int_code_variants(v, lo, hi, dtype, top)
        hard_twice = v[spec != twice][:100]  # the rarer kind first
        hard = torch.cat([hard_twice, v[(spec != quotient) & (spec == twice)][:500 - len(hard_twice)]])
        if len(hard) == 0:
            continue
        fill = v[torch.randint(0, len(v), (576 - 2 - len(hard),), generator=gen)]
        row = torch.cat([torch.stack([lo, hi]), hard, fill])
        rows.append(row[torch.randperm(576, generator=gen)])
        spec, quotient, twice = _int_code_variants(hard, lo, hi, dtype, top)
        by_quotient += int((spec != quotient).sum())
        by_twice += int((spec != twice).sum())
        if len(rows) == num_rows:
            break
    return torch.stack(rows), by_quotient, by_twice


def e4m3_midpoint_rows(num_rows, scale, gen):
    """Rows of scale times e4m3 midpoints (ties, to even in the spec; subnormal ones among them) and
    e4m3 values, up to 448 (beyond it a decoded value is off by more than half a step), with 448 x scale
    in every 128-value tile: quotients by scale (fp8's kv_scale; fp8_ds_mla's tile scale, as that is
    every tile's amax) land on the midpoints. scale 0.5 has an exact reciprocal; 0.75 does not, and
    scale x midpoint is still exact in fp16 and bf16 (2 + 5 significant bits)."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0 .. 448, no NaN
    values = quant.e4m3_values(codes)
    mids = (values[1:] + values[:-1]) / 2
    pool = torch.cat([mids, values])
    pool = torch.cat([pool, -pool])
    rows = pool[torch.randint(0, len(pool), (num_rows, 576), generator=gen)]
    rows[:, ::128] = 448.0
    return rows * scale


@GPU
@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantized_write_at_rounding_boundaries(kv_format, dtype, arch):
    gen = torch.Generator().manual_seed(FORMATS.index(kv_format) + 40)
    if kv_format in ("int8", "int4"):
        rows, by_quotient, by_twice = int_boundary_rows(kv_format, dtype)
        # the search is deterministic: enough values where a dividing or twice-rounding kernel would miss
        assert by_quotient >= 150 and by_twice >= 150, f"only {by_quotient} / {by_twice} boundary values found"
        cases = [(rows, KV_SCALE)]
    else:  # an exact reciprocal of the scale (one product) and an inexact one (two, bracketing)
        cases = [(e4m3_midpoint_rows(96, scale, gen), scale) for scale in (0.5, 0.75)]
    for rows, scale in cases:
        rows = rows.to("cuda", dtype)
        storage, target = paged_target(kv_format, dtype, 8, 16, gen)
        target.kv_scale = scale
        slots = torch.randperm(128, generator=gen)[:rows.shape[0]].cuda()
        before = storage.clone()
        mla_kv.write_kv(rows[:, :512], rows[:, 512:], target.view(storage), slots, kv_format=kv_format,
                        kv_scale=target.scale(), arch=arch)
        check_rows(target, storage, target.expect(before, rows, slots), rows, slots,
                   f"{kv_format} write at rounding boundaries, scale {scale}")


@GPU
@pytest.mark.parametrize("kv_format, dtype, unit, case", [
    ("int8", torch.bfloat16, 1e-39, "overflow"),  # an fp16 scale's reciprocal never overflows
    ("int4", torch.bfloat16, 1e-39, "overflow"),
    # a bf16 scale with a normal reciprocal keeps 5 bits or more: too many for int4's top to be passed
    ("int8", torch.bfloat16, 5e-39, "coarse"),
    ("int8", torch.float16, 4.5e-8, "coarse"),
    ("int4", torch.float16, 4.5e-8, "coarse"),
])
def test_int_write_with_a_subnormal_scale(kv_format, dtype, unit, case, arch):
    """Rows whose range makes the stored scale subnormal in dtype. overflow: its fp32 reciprocal
    overflows, and the kernels divide as the spec does (no product with 1 / scale exists). coarse: the
    reciprocal is a normal float, but the scale kept so few bits that the product n r of the row's
    max exceeds the top code: the codes saturate."""
    gen = torch.Generator().manual_seed(7)
    top = 255 if kv_format == "int8" else 15
    rows = ((torch.rand(32, 576, generator=gen) * 2 - 1) * (top * unit)).to(dtype)
    lo, hi = rows.float().amin(1), rows.float().amax(1)
    scale = ((hi - lo) / top).to(dtype).float()
    assert bool((scale > 0).all() and (scale < torch.finfo(dtype).tiny).all())
    if case == "overflow":
        assert bool(torch.isinf(1 / scale).all()), "the case needs scales whose reciprocal overflows"
    else:
        assert bool(torch.isfinite(1 / scale).all()), "the case needs normal reciprocals"
        assert bool(((hi - lo).double() * (1 / scale).double() > top + 0.5).any()), "the case needs codes past top"
    rows = rows.cuda()
    storage, target = paged_target(kv_format, dtype, 4, 16, gen)
    slots = torch.randperm(64, generator=gen)[:32].cuda()
    want = target.expect(storage.clone(), rows, slots)
    mla_kv.write_kv(rows[:, :512], rows[:, 512:], target.view(storage), slots, kv_format=kv_format, arch=arch)
    assert same_bytes(storage, want), f"{kv_format}: bytes differ from the spec's (or untouched bytes changed)"


# ------------------------------------------------------------------------------------ CPU
def test_cpu_write_is_the_reference_quantizer():
    """CPU tensors run the reference: the bytes are quant.write_rows' of the rows."""
    gen = torch.Generator().manual_seed(3)
    kv_a = torch.randn(9, 576, generator=gen).half()
    for kv_format in FORMATS:
        cache = torch.randint(0, 256, layout.paged_cache_shape(kv_format, 2, 8, torch.float16), generator=gen,
                              dtype=torch.uint8)
        want = cache.clone()
        slots = torch.tensor([3, -1, 0, 15, 8, 9, 10, 11, 2])
        scale = KV_SCALE if kv_format == "fp8" else None
        mla_kv.write_kv(kv_a[:, :512], kv_a[:, 512:], cache, slots, kv_format=kv_format, kv_scale=scale)
        quant.write_rows(want, kv_a, slots, kv_format, kv_scale=scale)
        assert torch.equal(cache, want), kv_format


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(kv_format="fp4"), ValueError, "kv_format"),
    (dict(kv_format="fp8"), ValueError, "kv_scale"),
    (dict(kv_format="fp8", kv_scale=0.0), ValueError, "kv_scale"),
    (dict(kv_format="int8", kv_scale=1.0), ValueError, "kv_scale"),
    (dict(kv_scale=1.0), ValueError, "kv_scale"),
])
def test_quantized_write_arguments_name_the_argument(kwargs, error, name):
    cache = torch.zeros(2, 8, 576, dtype=torch.uint8)
    kv_a = torch.randn(3, 576).half()
    with pytest.raises(error, match=name):
        mla_kv.write_kv(kv_a[:, :512], kv_a[:, 512:], cache, torch.arange(3), **kwargs)


def test_quantized_caches_are_checked():
    kv_a = torch.randn(3, 576)
    with pytest.raises(TypeError, match="kv_c"):  # float32 rows: int8 stores 16-bit scales
        mla_kv.write_kv(kv_a[:, :512], kv_a[:, 512:], torch.zeros(2, 8 * 580, dtype=torch.uint8), torch.arange(3),
                        kv_format="int8")
    half = kv_a.half()
    with pytest.raises(ValueError, match="kv_cache"):  # an fp8 cache has 576-byte rows
        mla_kv.write_kv(half[:, :512], half[:, 512:], torch.zeros(2, 8, 656, dtype=torch.uint8), torch.arange(3),
                        kv_format="fp8", kv_scale=1.0)
    with pytest.raises(TypeError, match="kv_cache"):
        mla_kv.write_kv(half[:, :512], half[:, 512:], torch.zeros(2, 8, 576, dtype=torch.float16), torch.arange(3),
                        kv_format="fp8", kv_scale=1.0)


def test_block_pointer_cache_formats_are_checked():
    pool = layout.BlockPool(2, 1, 16, torch.float16)
    base = pool.cache(0, torch.tensor([1]), torch.tensor([0, 1]))
    cu, hist = torch.tensor([0, 3], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    kv_a = torch.randn(3, 576).half()

    def write(**cache_fields):
        fields = dict(block_ptrs=base.block_ptrs, cu_block_nums=base.cu_block_nums, block_seq_len=16,
                      layer_offset_bytes=0, dtype=torch.float16)
        fields.update(cache_fields)
        mla_kv.write_kv_blocks(kv_a[:, :512], kv_a[:, 512:], layout.BlockPointerCache(**fields), cu, hist)

    with pytest.raises(ValueError, match="cache.rope_first"):
        write(kv_format="fp8_ds_mla")
    with pytest.raises(ValueError, match="cache.kv_scale"):
        write(kv_format="fp8", rope_first=False)
    with pytest.raises(ValueError, match="cache.kv_format"):
        write(kv_format="int2")
    with pytest.raises(ValueError, match="CUDA tensors only"):  # a valid quantized cache: then the device check
        write(kv_format="int4")
    q = torch.randn(1, 1, 4, 576).half()
    with pytest.raises(ValueError, match="CUDA tensors only"):  # decode reads it: then the device check
        mla_kv.decode(q, layout.BlockPointerCache(base.block_ptrs, base.cu_block_nums, 16, 0, torch.float16,
                                                  kv_format="int8"), None, torch.ones(1, dtype=torch.int32), 0.1)
