"""write_kv / fused_write_kv (paged and block-pointer forms) against mla_kv.reference.

GPU tests poison the whole cache first, then check every target row against the reference and
every other byte for being unchanged. CPU tests cover validation (errors before anything is written)
and the CPU dispatch to the reference.
"""
import pytest
import torch

import mla_kv
from mla_kv import reference
from mla_kv.layout import BlockPool, block_slots, to_rope_first
from mla_kv.rope import cos_sin_cache

GPU = pytest.mark.gpu

TOL = {torch.float16: 2e-3, torch.bfloat16: 8e-3, torch.float32: 2e-6}


def arch_cases(dtype):
    """Kernel variants to run: the device's best and, where the dtype allows, the Volta one."""
    cases = [None]
    if dtype != torch.bfloat16:
        cases.append("sm70")
    return cases


def poison_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random finite values (never zeros) so unwritten or misplaced rows show."""
    return (torch.rand(t.shape, generator=gen, device="cpu") * 8 + 3).to(t.device, t.dtype)


def shuffled_slots(num_tokens, block_size, num_blocks, gen, pad_every=0):
    """Slots of a random set of distinct positions over shuffled blocks; every pad_every-th is -1."""
    perm = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots = perm.clone()
    if pad_every:
        slots[::pad_every] = -1
    return slots.to(torch.int64)


def make_inputs(num_tokens, dtype, device, gen, *, row_stride=576, heads=5, q_dim=192 + 64,
                q_token_stride_extra=0, max_position=4096):
    """kv_a as a column slice of a wider projection, q with padded strides."""
    wide = torch.randn(num_tokens, row_stride, generator=gen).to(device, dtype)
    kv_a = wide[:, row_stride - 576:]
    q_full = torch.randn(num_tokens, heads, q_dim + q_token_stride_extra, generator=gen).to(device, dtype)
    q = q_full[:, :, q_token_stride_extra:]
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen).to(device)
    weight = (torch.rand(512, generator=gen) + 0.5).to(device, dtype)
    return kv_a, q, positions, weight


def assert_close_rows(got, want, dtype, what):
    assert not torch.isnan(got).any(), f"{what}: NaN written"
    err = (got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)
    assert err <= TOL[dtype], f"{what}: relative error {err:.3e} > {TOL[dtype]:.1e}"


# ------------------------------------------------------------------------------- GPU
@GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 1000])
def test_write_kv_paged_exact(dtype, block_size, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens * 131 + block_size)
    num_blocks = (num_tokens * 2) // block_size + 3
    for arch in arch_cases(dtype):
        cache = poison_like(torch.empty(num_blocks, block_size, 576, dtype=dtype, device="cuda"), gen)
        want = cache.clone()
        kv_c = torch.randn(num_tokens + 3, 700, generator=gen).to("cuda", dtype)[:, 100:612]
        k_pe = torch.randn(num_tokens + 3, 64, generator=gen).to("cuda", dtype)
        slots = shuffled_slots(num_tokens, block_size, num_blocks, gen, pad_every=5).cuda()
        mla_kv.write_kv(kv_c, k_pe, cache, slots, arch=arch)
        reference.write_kv(kv_c, k_pe, want, slots)
        assert torch.equal(cache, want), f"arch={arch}: plain write must be bit-exact"


@GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rope_style", ["interleaved", "neox"])
@pytest.mark.parametrize("num_tokens,block_size", [(1, 64), (63, 16), (129, 32), (4097, 128), (70000, 64)])
@pytest.mark.parametrize("cos_fp32", [True, False])
def test_fused_write_kv_paged(dtype, rope_style, num_tokens, block_size, cos_fp32):
    gen = torch.Generator().manual_seed(num_tokens + block_size + (7 if cos_fp32 else 0))
    num_blocks = (num_tokens * 3) // (2 * block_size) + 2
    cs = cos_sin_cache(64, 4096, 1e4, dtype=torch.float32 if cos_fp32 else dtype, device="cuda")
    for arch in arch_cases(dtype):
        kv_a, q, positions, weight = make_inputs(num_tokens, dtype, "cuda", gen, row_stride=768,
                                                 q_token_stride_extra=8)
        cache = poison_like(torch.empty(num_blocks, block_size, 576, dtype=dtype, device="cuda"), gen)
        slots = shuffled_slots(num_tokens, block_size, num_blocks, gen, pad_every=7).cuda()
        want_cache, want_q = cache.clone(), q.clone()
        q_untouched = q[..., :-64].clone()
        mla_kv.fused_write_kv(kv_a, weight, 1e-6, positions, cs, cache, slots, rope_style=rope_style,
                              q=q, arch=arch)
        # The float64 reference of the same inputs, then rounded like the kernel's single rounding.
        ref64 = want_cache.double()
        q64 = want_q.double()
        reference.fused_write_kv(kv_a.double(), weight.double(), 1e-6, positions, cs.double(), ref64,
                                 slots, rope_style=rope_style, q=q64)
        written = torch.zeros(cache.shape[:2], dtype=torch.bool, device="cuda").view(-1)
        written[slots[slots >= 0]] = True
        written = written.view(cache.shape[:2])
        assert torch.equal(cache[~written], want_cache[~written]), f"arch={arch}: untouched rows changed"
        assert_close_rows(cache[written][:, :512], ref64[written][:, :512], dtype, f"arch={arch} c_kv")
        assert_close_rows(cache[written][:, 512:], ref64[written][:, 512:], dtype, f"arch={arch} k_pe")
        assert_close_rows(q[..., -64:], q64[..., -64:], dtype, f"arch={arch} q_pe")
        assert torch.equal(q[..., :-64], q_untouched), f"arch={arch}: q_nope changed"


@GPU
def test_nan_row_poisons_only_its_slot():
    gen = torch.Generator().manual_seed(3)
    dtype = torch.float16
    cs = cos_sin_cache(64, 4096, 1e4, device="cuda")
    kv_a, q, positions, weight = make_inputs(64, dtype, "cuda", gen)
    kv_a[10, 5] = float("nan")
    for arch in arch_cases(dtype):
        cache = poison_like(torch.empty(8, 16, 576, dtype=dtype, device="cuda"), gen)
        slots = shuffled_slots(64, 16, 8, gen).cuda()
        mla_kv.fused_write_kv(kv_a, weight, 1e-6, positions, cs, cache, slots, arch=arch)
        flat = cache.view(-1, 576)
        nan_rows = torch.isnan(flat).any(-1).nonzero().flatten().tolist()
        assert nan_rows == [int(slots[10])], f"arch={arch}: NaN rows {nan_rows}"
        assert torch.isnan(flat[int(slots[10]), :512]).all()


@GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_out_of_range_slots_and_positions_are_skipped(dtype):
    gen = torch.Generator().manual_seed(11)
    cs = cos_sin_cache(64, 100, 1e4, device="cuda")
    kv_a, q, positions, weight = make_inputs(32, dtype, "cuda", gen, max_position=100)
    cache = poison_like(torch.empty(4, 16, 576, dtype=dtype, device="cuda"), gen)
    before = cache.clone()
    slots = torch.arange(32, dtype=torch.int64, device="cuda") + 48  # 48..79, capacity 64
    positions[3] = 100  # outside cos_sin_cache
    mla_kv.fused_write_kv(kv_a, weight, 1e-6, positions, cs, cache, slots)
    flat, flat_before = cache.view(-1, 576), before.view(-1, 576)
    assert torch.equal(flat[:48], flat_before[:48])
    assert torch.equal(flat[51], flat_before[51]), "row with an out-of-range position was written"
    assert not torch.equal(flat[48], flat_before[48])
    with pytest.raises(ValueError, match="slot_mapping"):
        mla_kv.fused_write_kv(kv_a, weight, 1e-6, positions, cs, cache, slots, validate=True)
    with pytest.raises(ValueError, match="positions"):
        mla_kv.fused_write_kv(kv_a, weight, 1e-6, positions, cs, cache, slots - 48, validate=True)


def make_block_batch(q_lens, hist, block_seq_len, num_blocks, gen, spare_blocks=0):
    """Shuffled block ids per sequence, enough for history + new tokens (+ spare)."""
    need = [-(-(h + n) // block_seq_len) + spare_blocks for h, n in zip(hist, q_lens)]
    ids = torch.randperm(num_blocks, generator=gen)[: sum(need)]
    cu_blocks = torch.tensor([0] + need).cumsum(0).to(torch.int32)
    cu_q = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    return ids, cu_blocks, cu_q, torch.tensor(hist, dtype=torch.int32)


@GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rope_first", [True, False])
@pytest.mark.parametrize("block_seq_len", [64, 128])
def test_fused_write_kv_blocks(dtype, rope_first, block_seq_len):
    gen = torch.Generator().manual_seed(block_seq_len + rope_first)
    q_lens, hist = [1, 0, 300, 64, 5], [0, 17, 63, 1000, 127]
    ids, cu_blocks, cu_q, hist_t = make_block_batch(q_lens, hist, block_seq_len, 64, gen)
    total = int(cu_q[-1])
    cs = cos_sin_cache(64, 4096, 1e6, device="cuda")
    for arch in arch_cases(dtype):
        pool = BlockPool(64, 3, block_seq_len, dtype, "cuda", rope_first=rope_first)
        pool.storage.copy_(poison_like(pool.storage, gen))
        before = pool.storage.clone()
        kv_a, q, positions, weight = make_inputs(total + 4, dtype, "cuda", gen, row_stride=640)
        cache = pool.cache(1, ids, cu_blocks)
        q_before = q.clone()
        mla_kv.fused_write_kv_blocks(kv_a, weight, 1e-5, positions, cs, cache, cu_q.cuda(),
                                     hist_t.cuda(), q=q, arch=arch, validate=True)
        slots = block_slots(cu_q, hist_t, cu_blocks, ids, block_seq_len).cuda()
        ref_layer = torch.empty(64, block_seq_len, 576, dtype=torch.float64, device="cuda")
        layer_before = before[:, 1]
        ref_layer.copy_(layer_before if not rope_first else
                        torch.cat([layer_before[..., 64:], layer_before[..., :64]], -1))
        reference.fused_write_kv(kv_a.double(), weight.double(), 1e-5, positions, cs.double(), ref_layer,
                                 slots)
        if rope_first:
            ref_layer = to_rope_first(ref_layer)
        written = torch.zeros(64 * block_seq_len, dtype=torch.bool, device="cuda")
        written[slots[slots >= 0]] = True
        written = written.view(64, block_seq_len)
        got = pool.storage[:, 1]
        for layer in (0, 2):
            assert torch.equal(pool.storage[:, layer], before[:, layer]), f"arch={arch}: layer {layer} touched"
        assert torch.equal(got[~written], layer_before[~written]), f"arch={arch}: untouched rows changed"
        assert_close_rows(got[written], ref_layer[written], dtype, f"arch={arch} block rows")
        q_ref = reference.apply_rope(q_before[:total, :, -64:].double(), positions[:total], cs.double())
        assert_close_rows(q[:total, :, -64:], q_ref, dtype, f"arch={arch} q_pe")


@GPU
def test_write_kv_blocks_exact_and_skips_tokens_past_batch():
    gen = torch.Generator().manual_seed(5)
    dtype = torch.float16
    q_lens, hist = [3, 70], [60, 0]
    ids, cu_blocks, cu_q, hist_t = make_block_batch(q_lens, hist, 64, 16, gen)
    total = int(cu_q[-1])
    for arch in arch_cases(dtype):
        pool = BlockPool(16, 2, 64, dtype, "cuda")
        pool.storage.copy_(poison_like(pool.storage, gen))
        want = pool.storage[:, 0].clone()
        kv_c = torch.randn(total + 9, 512, generator=gen).to("cuda", dtype)  # 9 rows past the batch
        k_pe = torch.randn(total + 9, 64, generator=gen).to("cuda", dtype)
        mla_kv.write_kv_blocks(kv_c, k_pe, pool.cache(0, ids, cu_blocks), cu_q.cuda(), hist_t.cuda(),
                               arch=arch)
        slots = block_slots(cu_q, hist_t, cu_blocks, ids, 64).cuda()
        flat = want.view(-1, 576)
        flat[slots] = to_rope_first(torch.cat([kv_c[:total], k_pe[:total]], -1))
        assert torch.equal(pool.storage[:, 0], want)


@GPU
def test_bad_input_on_gpu_writes_nothing():
    gen = torch.Generator().manual_seed(9)
    cs = cos_sin_cache(64, 128, 1e4, device="cuda")
    kv_a, q, positions, weight = make_inputs(8, torch.float16, "cuda", gen, max_position=128)
    cache = poison_like(torch.empty(2, 16, 576, dtype=torch.float16, device="cuda"), gen)
    before = cache.clone()
    slots = torch.arange(8, device="cuda")
    with pytest.raises(TypeError, match="rms_weight"):
        mla_kv.fused_write_kv(kv_a, weight.float(), 1e-6, positions, cs, cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        mla_kv.fused_write_kv(kv_a, weight, 1e-6, positions, cs, cache, slots + 60, validate=True)
    with pytest.raises(ValueError, match="kv_a"):
        mla_kv.fused_write_kv(kv_a.cpu(), weight, 1e-6, positions, cs, cache, slots)
    with pytest.raises(TypeError, match="bfloat16"):
        mla_kv.write_kv(kv_a[:, :512].bfloat16(), kv_a[:, 512:].bfloat16(), cache.bfloat16(), slots,
                        arch="sm70")
    torch.cuda.synchronize()
    assert torch.equal(cache, before)


# ------------------------------------------------------------------------------- CPU
def cpu_case(num_tokens=6, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    kv_a, q, positions, weight = make_inputs(num_tokens, dtype, "cpu", gen, max_position=64)
    cache = poison_like(torch.empty(2, 16, 576, dtype=dtype), gen)
    slots = torch.randperm(32, generator=gen)[:num_tokens]
    return kv_a, q, positions, weight, cos_sin_cache(64, 64, 1e4), cache, slots


def test_cpu_tensors_run_the_reference():
    kv_a, q, positions, weight, cs, cache, slots = cpu_case()
    want, want_q = cache.clone(), q.clone()
    mla_kv.fused_write_kv(kv_a, weight, 1e-6, positions, cs, cache, slots, q=q)
    reference.fused_write_kv(kv_a, weight, 1e-6, positions, cs, want, slots, q=want_q)
    assert torch.equal(cache, want) and torch.equal(q, want_q)
    assert not torch.equal(q, q.new_zeros(q.shape))


@pytest.mark.parametrize("mutate,exc,name", [
    (lambda a: a.update(kv_a=a["kv_a"][:, :575]), ValueError, "kv_a"),
    (lambda a: a.update(kv_a=a["kv_a"].half()), TypeError, "kv_a"),
    (lambda a: a.update(kv_a=a["kv_a"].t().contiguous().t()), ValueError, "kv_a"),
    (lambda a: a.update(rms_weight=a["rms_weight"][:256]), ValueError, "rms_weight"),
    (lambda a: a.update(positions=a["positions"].int()), TypeError, "positions"),
    (lambda a: a.update(positions=a["positions"][:3]), ValueError, "positions"),
    (lambda a: a.update(cos_sin_cache=a["cos_sin_cache"][:, :32].contiguous()), ValueError, "cos_sin_cache"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"].int()), TypeError, "slot_mapping"),
    (lambda a: a.update(kv_cache=a["kv_cache"].view(-1, 576)), ValueError, "kv_cache"),
    (lambda a: a.update(eps=-1.0), ValueError, "eps"),
    (lambda a: a.update(rope_style="gptj"), ValueError, "rope_style"),
    (lambda a: a.update(q=a["kv_a"][:, :32].reshape(6, 1, 32)), ValueError, "q"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"] + 40, validate=True), ValueError, "slot_mapping"),
    (lambda a: a.update(validate=True, positions=a["positions"] + 64), ValueError, "positions"),
])
def test_fused_write_kv_rejects_bad_input_before_writing(mutate, exc, name):
    kv_a, q, positions, weight, cs, cache, slots = cpu_case()
    args = dict(kv_a=kv_a, rms_weight=weight, eps=1e-6, positions=positions, cos_sin_cache=cs,
                kv_cache=cache, slot_mapping=slots, q=None, validate=False)
    mutate(args)
    before = cache.clone()
    with pytest.raises(exc, match=name):
        mla_kv.fused_write_kv(args.pop("kv_a"), args.pop("rms_weight"), args.pop("eps"),
                              args.pop("positions"), args.pop("cos_sin_cache"), args.pop("kv_cache"),
                              args.pop("slot_mapping"), **args)
    assert torch.equal(cache, before)


def test_write_kv_rejects_bad_input():
    kv_a, q, positions, weight, cs, cache, slots = cpu_case()
    with pytest.raises(ValueError, match="k_pe"):
        mla_kv.write_kv(kv_a[:, :512], kv_a[:, :63], cache, slots)
    with pytest.raises(ValueError, match="kv_c"):
        mla_kv.write_kv(kv_a[:2, :512], kv_a[:, 512:], cache, slots)
    with pytest.raises(TypeError, match="kv_cache"):
        mla_kv.write_kv(kv_a[:, :512].long(), kv_a[:, 512:].long(), cache.long(), slots)
    with pytest.raises(TypeError, match="kv_c"):
        mla_kv.write_kv(kv_a[:, :512].half(), kv_a[:, 512:], cache, slots)


def test_block_pointer_ops_need_cuda():
    gen = torch.Generator().manual_seed(2)
    pool = BlockPool(4, 1, 64, torch.float16, "cpu")
    ids, cu_blocks, cu_q, hist = make_block_batch([3], [0], 64, 4, gen)
    kv = torch.randn(3, 576, dtype=torch.float16)
    with pytest.raises(ValueError, match="CUDA"):
        mla_kv.write_kv_blocks(kv[:, :512], kv[:, 512:], pool.cache(0, ids, cu_blocks), cu_q, hist)
    with pytest.raises(ValueError, match="cu_q_lens"):
        mla_kv.write_kv_blocks(kv[:, :512], kv[:, 512:], pool.cache(0, ids, cu_blocks), cu_q[:1], hist)
    with pytest.raises(TypeError, match="cache"):
        mla_kv.write_kv_blocks(kv[:, :512], kv[:, 512:], pool.layer_view(0), cu_q, hist)
