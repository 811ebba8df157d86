"""The indexer's key write (write_index_keys, write_index_keys_blocks): LayerNorm, RoPE on the first 64
dims, Hadamard / sqrt(128), e4m3 with one fp32 scale per token, into the paged index cache.

CPU: the reference's bytes equal this file's own encoder, written byte by byte from the layout of
../shared/notes/sparse-mla.md with numpy (not the reference's quantizer), over every kind of slot (page
boundaries, padded, past the cache) and position (out of range); the reference's values equal a float64
computation from the definitions (LayerNorm, the rotation, the Sylvester matrix); the block-pointer form
equals the paged one on the same pages; bad arguments raise naming the argument and write nothing.
GPU: every kernel variant's bytes against the reference's (scales and every byte outside the codes
exact, codes within one e4m3 step and >= 99.9% exact), q in place, untouched bytes around and between
the written slots, CUDA graphs.
"""
import math

import numpy as np
import pytest
import torch

import mla_kv
from mla_kv import layout, reference
from mla_kv.reference import index_keys as index_keys_reference
from mla_kv.layout import IndexBlockPointerCache, index_cache_shape
from mla_kv.rope import cos_sin_cache

import sweep_cases
from gpu_checks import capture_graph, same_bytes
from quant_bytes import e4m3

GPU = pytest.mark.gpu
ROW = layout.INDEX_ROW_BYTES
EPS = 1e-6
MAX_POSITION = 4096


# ---------------------------------------------------------------------------- inputs
def inputs(tokens, dtype, gen, *, heads=3, k_pad=32, q_pad=32, ln_fp32=False, cos_fp32=True, device="cpu"):
    """(k [T, 128] a column slice of a wider row, ln_weight, ln_bias, positions, cos_sin_cache, q [T, H, 128]
    strided by head): keys with a wide range of magnitudes, some rows near zero."""
    wide = torch.randn(tokens, 128 + k_pad, generator=gen) * 2 + 0.5
    wide[::5] *= 30
    wide[2::7] *= 1e-3
    k = wide.to(device, dtype)[:, k_pad // 2:k_pad // 2 + 128]  # sliced where it lives: .to() would compact it
    ln_dtype = torch.float32 if ln_fp32 else dtype
    weight = (torch.rand(128, generator=gen) + 0.5).to(device, ln_dtype)
    bias = (torch.randn(128, generator=gen) * 0.1).to(device, ln_dtype)
    positions = torch.randint(0, MAX_POSITION, (tokens,), generator=gen).to(device)
    cs = cos_sin_cache(64, MAX_POSITION, 10000.0).to(device, torch.float32 if cos_fp32 else dtype)
    q = (torch.randn(tokens, heads, 128 + q_pad, generator=gen) * 3).to(device, dtype)[..., :128]
    return k, weight, bias, positions, cs, q


def poisoned_cache(num_blocks, page_size, gen, device="cpu", pad=0):
    """(storage, cache): a random-byte index cache [num_blocks, page_size, 132] between two guard blocks;
    pad bytes after each page (page_size 1 needs a 16-byte multiple)."""
    stride = page_size * ROW + pad
    storage = torch.randint(0, 256, ((num_blocks + 2) * stride,), generator=gen, dtype=torch.uint8).to(device)
    cache = storage.as_strided((num_blocks, page_size, ROW), (stride, ROW, 1), stride)
    return storage, cache


def page_pad(page_size):
    return (-page_size * ROW) % 16


def odd_slots(tokens, num_blocks, page_size, gen):
    """A slot per token: distinct random slots (both ends of pages among them), padded ones (-1) and slots
    past the cache."""
    capacity = num_blocks * page_size
    slots = torch.randperm(capacity, generator=gen)
    for token, slot in ((7, 0), (8, capacity - 1)):  # the cache's first and last slots, where tokens allow
        if token < tokens:
            at = int((slots == slot).nonzero())
            slots[at], slots[token] = slots[token].clone(), slot
    slots = slots[:tokens].clone()
    if tokens > 3:
        slots[1] = -1
        slots[3] = capacity + 5
    return slots


# ------------------------------------------------------------------ the test's own encoder
def e4m3_byte(v: float) -> int:
    """OCP e4m3 code of v (already clamped to +-448), round half to even, from the bit fields: sign, 4
    exponent bits (bias 7), 3 mantissa bits; |v| < 2^-6 in subnormal steps of 2^-9."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    if a < 2.0 ** -6:
        return sign | int(np.rint(a * 512))  # 8 steps are the smallest normal, code 0x08
    m, e = math.frexp(a)  # a = m 2^e, m in [0.5, 1)
    frac = int(np.rint((m * 2 - 1) * 8))
    exponent = e - 1 + 7
    if frac == 8:
        frac, exponent = 0, exponent + 1
    return sign | min((exponent << 3) | frac, 0x7E)


def expected_bytes(values: np.ndarray, scale_fmt):
    """(codes [n, 128] uint8, scale bytes [n, 4]) of float32 keys [n, 128], from sparse-mla.md."""
    codes = np.zeros(values.shape, dtype=np.uint8)
    scales = np.zeros(values.shape[0], dtype=np.float32)
    for i, row in enumerate(values.astype(np.float32)):
        s = np.float32(max(np.float32(np.abs(row).max()), np.float32(1e-4))) / np.float32(448)
        if scale_fmt == "ue8m0":
            m, e = math.frexp(float(s))
            s = np.float32(2.0 ** (e - 1 if m == 0.5 else e))
        scales[i] = s
        for j, x in enumerate(row):
            codes[i, j] = e4m3_byte(float(np.clip(np.float32(x) / s, -448, 448)))
    return codes, scales.view(np.uint8).reshape(-1, 4)


def expected_storage(storage, cache, values, slots, positions, scale_fmt):
    """The storage after writing values (one row per token) at slots, byte by byte."""
    want = storage.numpy().copy()
    base, stride = cache.storage_offset(), cache.stride(0)
    page_size, capacity = cache.shape[1], cache.shape[0] * cache.shape[1]
    codes, scale_bytes = expected_bytes(values, scale_fmt)
    for t, slot in enumerate(slots.tolist()):
        if not (0 <= slot < capacity) or not (0 <= int(positions[t]) < MAX_POSITION):
            continue
        page = base + (slot // page_size) * stride
        offset = slot % page_size
        want[page + offset * 128:page + offset * 128 + 128] = codes[t]
        want[page + page_size * 128 + offset * 4:page + page_size * 128 + offset * 4 + 4] = scale_bytes[t]
    return torch.from_numpy(want)


def sylvester(n=128) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def float64_rows(k, weight, bias, positions, cs, rope_style):
    """The keys from the definitions, in float64: layer_norm, rotate the first 64 dims, multiply by H / sqrt(128)."""
    x = torch.nn.functional.layer_norm(k.double(), (128,), weight.double(), bias.double(), EPS)
    c, s = cs.double()[positions, :32], cs.double()[positions, 32:]
    r = x.clone()
    if rope_style == "neox":
        a, b = x[:, :32], x[:, 32:64]
        r[:, :32], r[:, 32:64] = a * c - b * s, b * c + a * s
    else:
        a, b = x[:, 0:64:2], x[:, 1:64:2]
        r[:, 0:64:2], r[:, 1:64:2] = a * c - b * s, b * c + a * s
    return r @ sylvester().T / math.sqrt(128)


# ------------------------------------------------------------------------------- CPU
def test_hadamard_is_the_sylvester_matrix():
    x = torch.randn(5, 128, dtype=torch.float64)
    torch.testing.assert_close(reference.hadamard_128(x), x @ sylvester().T / math.sqrt(128), rtol=1e-12, atol=1e-12)
    assert reference.hadamard_128(torch.eye(128)).dtype == torch.float32


@pytest.mark.parametrize("rope_style", ["neox", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_values_are_the_definitions(rope_style, dtype):
    k, weight, bias, positions, cs, _ = inputs(40, dtype, torch.Generator().manual_seed(1))
    got = reference.index_key_rows(k, weight, bias, EPS, positions, cs, rope_style)
    assert got.dtype == torch.float32
    want = float64_rows(k, weight, bias, positions, cs, rope_style)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    k64 = reference.index_key_rows(k.double(), weight, bias, EPS, positions, cs, rope_style)
    torch.testing.assert_close(k64, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize("rope_style", ["neox", "interleaved"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_reference_bytes_are_the_layout(scale_fmt, rope_style, page_size):
    gen = torch.Generator().manual_seed(2)
    tokens, num_blocks = 24, 3 if page_size == 16 else 40
    k, weight, bias, positions, cs, q = inputs(tokens, torch.float16, gen, ln_fp32=True)
    positions[5] = MAX_POSITION          # out of range: token left alone
    positions[6] = -2
    slots = odd_slots(tokens, num_blocks, page_size, gen)
    storage, cache = poisoned_cache(num_blocks, page_size, gen, pad=page_pad(page_size))
    before, q_before = storage.clone(), q.clone()
    mla_kv.write_index_keys(k, weight, bias, EPS, positions, cs, cache, slots, rope_style=rope_style,
                            scale_fmt=scale_fmt, q=q)
    ok = (positions >= 0) & (positions < MAX_POSITION)
    values = reference.index_key_rows(k, weight, bias, EPS, positions.where(ok, 0), cs, rope_style).numpy()
    assert same_bytes(storage, expected_storage(before, cache, values, slots, positions, scale_fmt))
    # q: the same rotation in q's dtype for the tokens in range, the others untouched
    q_want = reference.hadamard_128(torch.cat([reference.apply_rope(q_before[ok].float()[..., :64], positions[ok], cs,
                                                                    rope_style), q_before[ok].float()[..., 64:]], -1))
    assert same_bytes(q[ok], q_want.to(q.dtype)) and same_bytes(q[~ok], q_before[~ok])


def test_layer_norm_root_is_correctly_rounded():
    """The kernels take IEEE's float32 root (__fsqrt_rn) and divide by it; so must the reference, whose
    values and scales the GPU tests compare bit for bit (torch's float32 sqrt on the CPU is not IEEE's)."""
    gen = torch.Generator().manual_seed(11)
    k = (torch.randn(4000, 128, generator=gen) * torch.rand(4000, 1, generator=gen) * 50).to(torch.bfloat16)
    weight, bias = torch.rand(128, generator=gen) + 0.5, torch.randn(128, generator=gen) * 0.1
    got = index_keys_reference._layer_norm(k, weight, bias, 1e-6).numpy()
    x = k.float()
    n = np.float32(1 / 128)
    d = (x - (index_keys_reference._row_sum(x) * float(n))[:, None]).numpy()
    var = index_keys_reference._row_sum(torch.from_numpy(d * d)).numpy() * n
    rstd = np.float32(1) / np.sqrt(var + np.float32(1e-6))
    want = d * rstd[:, None] * weight.numpy() + bias.numpy()
    assert np.array_equal(got, want)


def test_quantize_index_keys_scales():
    x = torch.zeros(3, 128)
    x[1, 7] = -448 * 3.0
    x[2, :] = 0.7
    codes, scales = reference.quantize_index_keys(x)
    assert scales.tolist() == [np.float32(1e-4) / np.float32(448), 3.0, np.float32(0.7) / np.float32(448)]
    assert codes[0].eq(0).all() and codes[1, 7] == 0xFE and codes[2].eq(0x7E).all()
    _, pow2 = reference.quantize_index_keys(x, "ue8m0")
    assert pow2.tolist() == [2.0 ** -22, 4.0, 2.0 ** -9]  # 1e-4 / 448 = 2.2e-7 -> 2^-22; 3 -> 4


def test_dequantized_values_are_close():
    k, weight, bias, positions, cs, _ = inputs(16, torch.bfloat16, torch.Generator().manual_seed(3))
    x = reference.index_key_rows(k, weight, bias, EPS, positions, cs)
    for fmt in (None, "ue8m0"):
        codes, scales = reference.quantize_index_keys(x, fmt)
        err = (e4m3(codes) * scales[:, None].double() - x.double()).abs()
        assert bool((err <= x.double().abs() * 2.0 ** -4 + scales[:, None].double() * 2.0 ** -10).all())


def pool_for(num_blocks, bsl, layer_offset, gen, device="cpu"):
    """(bytes [num_blocks, bytes_per_block] of random content, the index layer's pages as a paged cache view)."""
    per_block = layer_offset + bsl * ROW + 48
    per_block += -per_block % 16
    pool = torch.randint(0, 256, (num_blocks, per_block), generator=gen, dtype=torch.uint8).to(device)
    pages = pool.as_strided((num_blocks, bsl, ROW), (per_block, ROW, 1), layer_offset)
    return pool, pages


def blocks_case(gen, device="cpu"):
    """Three sequences (one empty) behind shuffled blocks of 16 tokens, 2 rows past cu_q_lens[B]."""
    q_lens, history, blocks = [5, 0, 37], [30, 3, 9], [3, 1, 4]
    bsl, layer_offset = 16, 4 * 1024
    num_blocks = sum(blocks) + 2
    ids = torch.randperm(num_blocks, generator=gen)[:sum(blocks)]
    pool, pages = pool_for(num_blocks, bsl, layer_offset, gen, device)
    cu_b = torch.tensor([0] + blocks).cumsum(0).int()
    cache = IndexBlockPointerCache((pool.data_ptr() + ids * pool.stride(0)).to(device), cu_b.to(device), bsl,
                                   layer_offset)
    cu_q = torch.tensor([0] + q_lens).cumsum(0).int()
    return dict(pool=pool, pages=pages, cache=cache, ids=ids, cu_q=cu_q, history=torch.tensor(history).int(),
                rows=sum(q_lens) + 2, bsl=bsl)


@pytest.mark.parametrize("cp", [(1, 0), (2, 1)])
@pytest.mark.parametrize("readonly", [None, [16, 0, 8]])
def test_block_pointer_form_is_the_paged_form(cp, readonly):
    gen = torch.Generator().manual_seed(4)
    case = blocks_case(gen)
    k, weight, bias, positions, cs, q = inputs(case["rows"], torch.bfloat16, gen)
    positions[2] = MAX_POSITION + 1
    readonly_t = None if readonly is None else torch.tensor(readonly).int()
    slots = layout.block_slots(case["cu_q"], case["history"], case["cache"].cu_block_nums, case["ids"], case["bsl"],
                               readonly_lens=readonly_t, cp_size=cp[0], cp_rank=cp[1])
    slots = torch.cat([slots, torch.full((2,), -1)])  # the rows past cu_q_lens[B]
    want, q_want = case["pool"].clone(), q.clone()
    want_pages = want.as_strided(case["pages"].shape, case["pages"].stride(), case["pages"].storage_offset())
    reference.write_index_keys(k, weight, bias, EPS, positions, cs, want_pages, slots, scale_fmt="ue8m0", q=q_want)
    mla_kv.write_index_keys_blocks(k, weight, bias, EPS, positions, cs, case["cache"], case["cu_q"], case["history"],
                                   readonly_lens=readonly_t, cp_size=cp[0], cp_rank=cp[1], scale_fmt="ue8m0", q=q)
    assert same_bytes(case["pool"], want) and same_bytes(q, q_want)


def bad_calls():
    """(name, change to the good call's arguments, error type, what the message starts with)."""
    def kw(**changes):
        return lambda a: a.update(changes)

    def bad_tensor(name, fn):
        return lambda a: a.update({name: fn(a[name])})

    return [
        ("k-fp64-ln", bad_tensor("ln_weight", lambda t: t.double()), TypeError, "ln_weight"),
        ("k-dim", bad_tensor("k", lambda t: t[:, :64]), ValueError, "k"),
        ("k-rows", bad_tensor("k", lambda t: t[:3]), ValueError, "k"),
        ("k-int", bad_tensor("k", lambda t: t.int()), TypeError, "k"),
        ("bias-dtype", bad_tensor("ln_bias", lambda t: t.float()), TypeError, "ln_bias"),
        ("bias-size", bad_tensor("ln_bias", lambda t: t[:64]), ValueError, "ln_bias"),
        ("eps", kw(eps=-1.0), ValueError, "eps"),
        ("eps-type", kw(eps="1e-6"), TypeError, "eps"),
        ("positions-dtype", bad_tensor("positions", lambda t: t.int()), TypeError, "positions"),
        ("positions-short", bad_tensor("positions", lambda t: t[:2]), ValueError, "positions"),
        ("cos-width", bad_tensor("cos_sin_cache", lambda t: t[:, :32].contiguous()), ValueError, "cos_sin_cache"),
        ("rope-style", kw(rope_style="gptj"), ValueError, "rope_style"),
        ("scale-fmt", kw(scale_fmt="e8m0"), ValueError, "scale_fmt"),
        ("q-dim", bad_tensor("q", lambda t: t[..., :64]), ValueError, "q"),
        ("q-dtype", bad_tensor("q", lambda t: t.float()), TypeError, "q"),
        ("cache-dtype", bad_tensor("index_cache", lambda t: t.view(torch.int8)), TypeError, "index_cache"),
        ("cache-row", bad_tensor("index_cache", lambda t: t[..., :128]), ValueError, "index_cache"),
        ("slots-dtype", bad_tensor("slot_mapping", lambda t: t.int()), TypeError, "slot_mapping"),
        ("slots-validate", lambda a: (a["slot_mapping"].__setitem__(0, 10 ** 6), a.update(validate=True)),
         ValueError, "slot_mapping"),
        ("positions-validate", lambda a: (a["positions"].__setitem__(0, MAX_POSITION), a.update(validate=True)),
         ValueError, "positions"),
        ("arch", kw(arch="sm60"), ValueError, "arch"),
    ]


def good_call(gen):
    k, weight, bias, positions, cs, q = inputs(8, torch.float16, gen)
    storage, cache = poisoned_cache(2, 16, gen)
    return dict(k=k, ln_weight=weight, ln_bias=bias, eps=EPS, positions=positions, cos_sin_cache=cs,
                index_cache=cache, slot_mapping=torch.randperm(32, generator=gen)[:8], q=q), storage


@pytest.mark.parametrize("name,change,error,argument", bad_calls(), ids=[c[0] for c in bad_calls()])
def test_bad_arguments_name_the_argument_and_write_nothing(name, change, error, argument):
    args, storage = good_call(torch.Generator().manual_seed(5))
    change(args)
    before, q_before = storage.clone(), args["q"].clone()
    with pytest.raises(error) as raised:
        mla_kv.write_index_keys(**args)
    assert str(raised.value).startswith(argument), str(raised.value)
    assert same_bytes(storage, before) and same_bytes(args["q"], q_before)


@pytest.mark.parametrize("change,error,argument", [
    (lambda c: c.update(cache="pages"), TypeError, "cache"),
    (lambda c: c.update(cp_rank=2, cp_size=2), ValueError, "cp_rank"),
    (lambda c: c.update(history=c["history"].long()), TypeError, "history_lens"),
    (lambda c: c.update(cu_q=c["cu_q"][:2]), ValueError, "cu_q_lens"),
    (lambda c: c.update(readonly=torch.zeros(2, dtype=torch.int32)), ValueError, "readonly_lens"),
    (lambda c: c.update(cache=IndexBlockPointerCache(c["cache"].block_ptrs, c["cache"].cu_block_nums, 16, 8)),
     ValueError, "cache.layer_offset_bytes"),
    (lambda c: c.update(cache=IndexBlockPointerCache(c["cache"].block_ptrs, c["cache"].cu_block_nums.clone().fill_(0),
                                                     16, 4096), validate=True), ValueError, "cache.cu_block_nums"),
])
def test_block_pointer_arguments_are_checked(change, error, argument):
    gen = torch.Generator().manual_seed(6)
    case = blocks_case(gen)
    case.update(readonly=None, cp_size=1, cp_rank=0, validate=False)
    k, weight, bias, positions, cs, q = inputs(case["rows"], torch.float16, gen)
    change(case)
    before = case["pool"].clone()
    with pytest.raises(error) as raised:
        mla_kv.write_index_keys_blocks(k, weight, bias, EPS, positions, cs, case["cache"], case["cu_q"],
                                       case["history"], readonly_lens=case["readonly"], cp_size=case["cp_size"],
                                       cp_rank=case["cp_rank"], q=q, validate=case["validate"])
    assert str(raised.value).startswith(argument), str(raised.value)
    assert same_bytes(case["pool"], before)


def test_four_dim_cache_view_and_the_op_form():
    gen = torch.Generator().manual_seed(7)
    k, weight, bias, positions, cs, q = inputs(6, torch.bfloat16, gen)
    cache = torch.zeros(index_cache_shape(2, 64)).to(torch.uint8)
    slots = torch.tensor([0, 63, 64, 127, -1, 5])
    engines_view = cache.view(2, 64, 1, ROW)
    q2 = q.clone()
    torch.ops.mla_kv.write_index_keys(k, weight, bias, EPS, positions, cs, engines_view, slots, q2, scale_fmt="ue8m0")
    want, q_want = torch.zeros_like(cache), q.clone()
    reference.write_index_keys(k, weight, bias, EPS, positions, cs, want, slots, scale_fmt="ue8m0", q=q_want)
    assert same_bytes(cache, want) and same_bytes(q2, q_want)
    codes, scales = layout.index_cache_parts(cache)
    x = reference.index_key_rows(k, weight, bias, EPS, positions, cs)
    assert torch.equal(scales[1, 0], reference.quantize_index_keys(x[2:3], "ue8m0")[1][0])


@pytest.mark.parametrize("case", [
    sweep_cases.IndexKeysCase(),
    sweep_cases.IndexKeysCase(blocks=True, page_size=8, readonly=(9, 0, 3), cp=(2, 0), scale_fmt="ue8m0",
                              rope_style="interleaved", dtype="bfloat16"),
], ids=["paged", "blocks"])
def test_sweep_case_runs_on_the_reference(case):
    outcome = sweep_cases.run(case, "cpu", 1)
    assert outcome.problems == [] and outcome.canary_bytes == 0


# ------------------------------------------------------------------------------- GPU
ARCHS = pytest.mark.arch_variants("best", "sm80", "sm75", "sm70", bf16_needs_sm80=True)


def check_against_reference(got_storage, want_storage, code_mask):
    problems = sweep_cases.index_cache_problems("index cache", got_storage, want_storage, code_mask)
    assert not problems, problems


def code_bytes(storage, cache, slots, positions):
    """The storage bytes that hold written codes."""
    page_size, capacity = cache.shape[1], cache.shape[0] * cache.shape[1]
    return sweep_cases.index_code_mask(storage.numel(), [
        (cache.storage_offset() + (slot // page_size) * cache.stride(0), slot % page_size)
        for t, slot in enumerate(slots.tolist()) if 0 <= slot < capacity and 0 <= int(positions[t]) < MAX_POSITION])


def check_q(got, want):
    """q in place: bit for bit but for values within one step of the dtype (>= 99.9% exact)."""
    got, want = got.cpu(), want.cpu()
    step = sweep_cases.spacing(want.double(), want.dtype)
    assert bool(((got.double() - want.double()).abs() <= step).all())
    assert float((got == want).double().mean()) >= 0.999


@GPU
@ARCHS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 64, 1000])
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("rope_style,scale_fmt", [("neox", "ue8m0"), ("interleaved", None)])
def test_gpu_write_index_keys(dtype, tokens, page_size, rope_style, scale_fmt, arch):
    gen = torch.Generator().manual_seed(tokens + page_size)
    k, weight, bias, positions, cs, q = inputs(tokens, dtype, gen, heads=4, ln_fp32=tokens % 2 == 0,
                                               cos_fp32=page_size == 64, device="cuda")
    assert k.stride(0) > 128 and q.stride(1) > 128
    if tokens > 5:
        positions[4] = MAX_POSITION
    num_blocks = max(2, -(-tokens // page_size) + 1)
    slots = odd_slots(tokens, num_blocks, page_size, gen)
    storage, cache = poisoned_cache(num_blocks, page_size, gen, pad=page_pad(page_size))
    want, q_want = storage.clone(), q.cpu()
    want_cache = want.as_strided(cache.shape, cache.stride(), cache.storage_offset())
    reference.write_index_keys(k.cpu(), weight.cpu(), bias.cpu(), EPS, positions.cpu(), cs.cpu(), want_cache, slots,
                               rope_style=rope_style, scale_fmt=scale_fmt, q=q_want)
    d_storage = storage.cuda()
    d_cache = d_storage.as_strided(cache.shape, cache.stride(), cache.storage_offset())
    mla_kv.write_index_keys(k, weight, bias, EPS, positions, cs, d_cache, slots.cuda(), rope_style=rope_style,
                            scale_fmt=scale_fmt, q=q, arch=arch)
    check_against_reference(d_storage, want, code_bytes(storage, cache, slots, positions.cpu()))
    check_q(q, q_want)


@GPU
@ARCHS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_two_element_rows(dtype, arch):
    """k and q rows 4-byte but not 16-byte aligned take the kernel's narrow loads."""
    gen = torch.Generator().manual_seed(8)
    k, weight, bias, positions, cs, q = inputs(33, dtype, gen, k_pad=4, q_pad=2, device="cuda")
    assert k.data_ptr() % 16 and q.stride(1) % 8
    slots = odd_slots(33, 2, 64, gen)
    storage, cache = poisoned_cache(2, 64, gen)
    want, q_want = storage.clone(), q.cpu()
    reference.write_index_keys(k.cpu(), weight.cpu(), bias.cpu(), EPS, positions.cpu(), cs.cpu(),
                               want.as_strided(cache.shape, cache.stride(), cache.storage_offset()), slots, q=q_want)
    d_storage = storage.cuda()
    mla_kv.write_index_keys(k, weight, bias, EPS, positions, cs,
                            d_storage.as_strided(cache.shape, cache.stride(), cache.storage_offset()), slots.cuda(),
                            q=q, arch=arch)
    check_against_reference(d_storage, want, code_bytes(storage, cache, slots, positions.cpu()))
    check_q(q, q_want)


@GPU
@ARCHS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_size,cp,readonly", [(64, (1, 0), None), (16, (2, 1), (16, 0, 2)), (1, (1, 0), (3, 0, 1))])
def test_gpu_block_pointer_write(dtype, page_size, cp, readonly, arch):
    case = sweep_cases.IndexKeysCase(arch=arch, dtype=str(dtype).split(".")[1], tokens=70, page_size=page_size,
                                     blocks=True, cp=cp, readonly=readonly, rope_style="interleaved", scale_fmt="ue8m0")
    outcome = sweep_cases.run(case, "cuda", page_size)
    assert outcome.problems == [] and outcome.canary_bytes == 0


@GPU
@ARCHS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 64])
def test_gpu_sweep_case_paged(dtype, tokens, arch):
    case = sweep_cases.IndexKeysCase(arch=arch, dtype=str(dtype).split(".")[1], tokens=max(tokens, 6), heads=64)
    outcome = sweep_cases.run(case, "cuda", tokens)
    assert outcome.problems == [] and outcome.canary_bytes == 0


@GPU
@pytest.mark.parametrize("arch", ["sm70", "sm75"])
def test_gpu_bfloat16_needs_the_sm80_kernels(arch):
    gen = torch.Generator().manual_seed(10)
    k, weight, bias, positions, cs, q = inputs(4, torch.bfloat16, gen, device="cuda")
    storage, cache = poisoned_cache(1, 64, gen, device="cuda")
    before = storage.clone()
    with pytest.raises(TypeError, match="dtype: bfloat16 needs the sm80 kernels"):
        mla_kv.write_index_keys(k, weight, bias, EPS, positions, cs, cache, torch.arange(4, device="cuda"), q=q,
                                arch=arch)
    assert same_bytes(storage, before)


@GPU
@ARCHS
@pytest.mark.parametrize("dtype", [torch.float16])
def test_gpu_cuda_graph_replays_with_new_inputs(dtype, arch):
    gen = torch.Generator().manual_seed(11)
    tokens = 37
    k, weight, bias, positions, cs, q = inputs(tokens, dtype, gen, device="cuda")
    k, q = k.contiguous(), q.contiguous()  # the graph's static inputs, refilled in place
    slots = odd_slots(tokens, 2, 64, gen).cuda()
    storage, cache = poisoned_cache(2, 64, gen, device="cuda")
    step = lambda: mla_kv.write_index_keys(k, weight, bias, EPS, positions, cs, cache, slots, q=q,  # noqa: E731
                                           scale_fmt="ue8m0", arch=arch)
    graph = capture_graph(step)
    for seed in (12, 13):
        new = inputs(tokens, dtype, torch.Generator().manual_seed(seed), device="cuda")
        k.copy_(new[0])
        positions.copy_(new[3])
        q.copy_(new[5])
        slots.copy_(odd_slots(tokens, 2, 64, torch.Generator().manual_seed(seed)).cuda())
        want, q_want = storage.cpu(), q.cpu()
        reference.write_index_keys(k.cpu(), weight.cpu(), bias.cpu(), EPS, positions.cpu(), cs.cpu(),
                                   want.as_strided(cache.shape, cache.stride(), cache.storage_offset()), slots.cpu(),
                                   scale_fmt="ue8m0", q=q_want)
        graph.replay()
        torch.cuda.synchronize()
        check_against_reference(storage, want, code_bytes(storage.cpu(), cache, slots.cpu(), positions.cpu()))
        check_q(q, q_want)
