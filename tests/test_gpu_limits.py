"""Every attention variant under the shared-memory limits of the GPUs it serves.

The CPU part checks the tile choice itself (mla_kv._C.attention_tiles, the one the launch makes) for
every GPU class against that class's limits; the GPU part imposes each class's limits on the GPU at
hand (attention_schedule(smem_limits=...)), so an H200 runs the configuration a V100, a T4, an
A10 / L40 or an A100 would get, and checks the results against the float64 reference.
"""
import math

import pytest
import torch

import mla_kv
from mla_kv import gpus, reference
from mla_kv.ops._common import _paged_cache
from mla_kv.ops.attention import _attention_params

from gpu_checks import (block_pointer_copy, check_attention, default_schedule, nan_outputs, random_cache,
                        run_decode, run_prefill)

_C = mla_kv.ops._C
needs_core = pytest.mark.skipif(_C is None, reason="mla_kv was built without its CUDA kernels")
CLASSES = gpus.gpu_classes()
ROWS = [1, 5, 16, 17, 20, 32, 33, 40, 64, 100, 128, 300]


def tiles(tag, rows, limits):
    return _C.attention_tiles(getattr(_C.Arch, tag), rows, gpus.c_limits(limits))


@needs_core
def test_every_gpu_class_has_a_fitting_configuration_at_every_height():
    assert set(CLASSES) == {"V100", "T4 / RTX 20", "A10 / A40 / RTX 30", "L40 / RTX 40", "A100", "H100 / H200"}
    for name, g in CLASSES.items():
        for rows in ROWS:
            t = tiles(g.arch, rows, g.smem)
            what = f"{name} {g.arch} rows={rows}"
            assert t.block_m > 0, f"{what}: no configuration fits"
            assert t.smem_bytes <= g.smem.per_block, f"{what}: {t.smem_bytes} B > {g.smem.per_block}"
            assert t.ctas_per_sm >= 1
            assert t.ctas_per_sm * (t.smem_bytes + g.smem.reserved_per_block) <= g.smem.per_sm, what
            wanted = 16 if rows <= 16 else 32 if rows <= 32 else 64
            assert t.block_m <= wanted or g.arch == "sm90", f"{what}: {t.block_m}-row CTA for {rows} rows"


@needs_core
def test_configurations_per_gpu_class():
    """The configuration each class gets, as README's table states it (block_m, block_n, stages,
    bytes, CTAs per SM)."""
    def got(name, rows):
        t = tiles(CLASSES[name].arch, rows, CLASSES[name].smem)
        return (t.block_m, t.block_n, t.stages, t.smem_bytes, t.ctas_per_sm)

    assert got("V100", 16) == (16, 32, 1, 66752, 1)
    assert got("V100", 20) == got("V100", 128) == (32, 32, 1, 86912, 1)
    for rows in ROWS:  # Turing's 64 KB hold only the 16-row CTA (P in the score buffer)
        assert got("T4 / RTX 20", rows) == (16, 32, 1, 65472, 1)
    for name in ("A10 / A40 / RTX 30", "L40 / RTX 40"):
        assert got(name, 16) == (16, 32, 1, 66752, 1)
        assert got(name, 20) == got(name, 128) == (32, 32, 1, 86912, 1)
    assert got("A100", 16) == (16, 32, 2, 104128, 1)  # two per SM would need 210 KB; an A100 has 164
    assert got("A100", 20) == (32, 32, 3, 161664, 1)
    assert got("A100", 64) == got("A100", 128) == (64, 32, 1, 136448, 1)
    h = got("H100 / H200", 20)
    assert h[0] == 64 and h[3] <= 232448 and h[4] == 1
    # The Sm80 kernel's 16-row CTA runs two per SM where the SM holds them (the H200 stand-in).
    assert tiles("sm80", 16, CLASSES["H100 / H200"].smem).ctas_per_sm == 2


@needs_core
def test_no_fitting_configuration_reports_what_the_smallest_needs():
    t = tiles("sm70", 20, CLASSES["T4 / RTX 20"].smem)  # a V100 tile on a T4
    assert (t.block_m, t.min_smem_bytes) == (0, 66752)
    t = tiles("sm90", 20, CLASSES["A100"].smem)
    assert t.block_m == 0 and t.min_smem_bytes > CLASSES["A100"].smem.per_block
    assert tiles("sm80", 20, gpus.SmemLimits(66752, 66752)).block_m == 16  # exactly the smallest fits
    assert tiles("sm80", 20, gpus.SmemLimits(66751, 66752)).block_m == 0


@needs_core
def test_schedule_counts_the_ctas_an_sm_holds():
    """A 16-row Sm80 CTA is two per SM on an H200 but one on an A100: the split count follows."""
    def splits(name):
        limits = gpus.c_limits(CLASSES[name].smem)
        s = _C.make_attention_schedule(54, 1, 16, 8192, 108, _C.Arch.sm80, limits)
        return s.num_splits, s.tiles.ctas_per_sm

    assert splits("A100") == (2, 1)        # 54 CTAs, 108 slots
    assert splits("H100 / H200") == (4, 2)  # 54 CTAs, 216 slots


def test_smem_limits_argument_is_checked():
    for bad in ("K80", (0, 100), (100, -1), (1, 2, -3), (1.5, 2), [1, 2], 7):
        with pytest.raises(ValueError, match="smem_limits"):
            gpus.smem_limits(bad)
    assert gpus.smem_limits((1000, 2000)) == gpus.SmemLimits(1000, 2000, 0)
    assert gpus.smem_limits(None) is None


# --------------------------------------------------------------------------------- on the GPU
def runnable(name):
    """The class's variant runs here (its tag at or below the GPU's) and the GPU is at least as large."""
    g = CLASSES[name]
    cc = torch.cuda.get_device_capability()
    have = _C.device_smem_limits()
    return int(g.arch[2:]) <= cc[0] * 10 + cc[1] and g.smem.per_block <= have.per_block


CASES = [  # (lens, heads, s_q, block_size)
    ([1, 77, 300], 16, 1, 16),      # 16 rows
    ([513, 64, 2], 20, 1, 32),      # GLM-4.7-Flash's 20 heads: 32 rows, two 16-row CTAs on a T4
    ([1000, 3], 20, 2, 64),         # 40 rows: 64-row CTAs on an A100
    ([2500], 128, 1, 64),           # DeepSeek's 128 heads, one long sequence: split KV
]


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CLASSES) if CLASSES else ["none"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_and_prefill_under_each_gpu_class(name, dtype):
    if name not in CLASSES or not runnable(name):
        pytest.skip(f"{name}: its variant or shared memory exceeds this GPU")
    g = CLASSES[name]
    if dtype == torch.bfloat16 and int(g.arch[2:]) < 80:
        pytest.skip("bf16 needs the sm80 kernels")
    scale = 1 / math.sqrt(192)
    for lens, heads, s_q, block_size in CASES:
        cache, table, seq_lens = random_cache(lens, block_size, dtype)
        q = torch.randn(len(lens), s_q, heads, 576, device="cuda").to(dtype)
        ref = reference.decode(q.double(), cache.double(), table, seq_lens, scale)
        pool, blocks = block_pointer_copy(cache, table, lens)
        for kv_cache, block_table, addressing in ((cache, table, "paged"), (blocks, None, "block pointers")):
            schedule = default_schedule(q, kv_cache, block_table, arch=g.arch, smem_limits=name)
            what = f"{name} {g.arch} {addressing} H={heads} S_q={s_q} tiles={schedule.tiles}"
            assert schedule.tiles.smem_bytes <= g.smem.per_block, what
            out, lse = run_decode(q, kv_cache, block_table, seq_lens, scale, arch=g.arch, schedule=schedule)
            check_attention(out, lse, *ref, what)

    # prefill: packed new tokens over a cached prefix, causal
    q_lens, kv_lens, heads = [5, 33, 1], [40, 100, 1], 20
    cache, table, kv = random_cache(kv_lens, 16, dtype)
    cu = torch.tensor([0] + q_lens, device="cuda").cumsum(0).int()
    q = torch.randn(sum(q_lens), heads, 576, device="cuda").to(dtype)
    ref = reference.prefill(q.double(), cache.double(), table, cu, kv, scale)
    schedule = default_schedule(q, cache, table, packed_batch=len(q_lens), arch=g.arch, smem_limits=name)
    assert schedule.tiles.smem_bytes <= g.smem.per_block
    out, lse = run_prefill(q, cache, table, cu, kv, scale, arch=g.arch, schedule=schedule)
    check_attention(out, lse, *ref, f"{name} {g.arch} prefill tiles={schedule.tiles}", cu_q_lens=cu)


@pytest.mark.gpu
def test_a_variant_that_cannot_fit_raises_before_launch():
    cache, table, seq_lens = random_cache([100], 16, torch.float16)
    q = torch.randn(1, 1, 20, 576, device="cuda").half()
    with pytest.raises(ValueError, match=r"sm70 attention kernel needs 66,752 bytes.*allow 65,536"):
        default_schedule(q, cache, table, arch="sm70", smem_limits="T4 / RTX 20")
    # The core refuses the launch too (Status kSharedMemoryExceeded), and writes nothing.
    schedule = default_schedule(q, cache, table, arch="sm70")
    out, lse = nan_outputs(q, q.shape[:3])
    params = _attention_params(q, out, lse, packed=False, batch=1, q_len=1, kv_lens=seq_lens,
                               cu_q_lens=None, causal=True, scale=0.1, schedule=schedule)
    params.smem_limits = gpus.c_limits(CLASSES["T4 / RTX 20"].smem)
    with pytest.raises(RuntimeError, match="shared memory"):
        _C.attention_paged(params, _paged_cache(cache), table.data_ptr(), table.stride(0),
                           table.shape[1], _C.Arch.sm70, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert bool(out.isnan().all()) and bool(lse.isnan().all())
