"""Randomized differential sweep: every op on seeded random configurations against the float64
reference, with canary bytes around every tensor (tests/sweep_cases.py runs a case).

A configuration comes from (op, seed) alone (``case_of``), its data from a generator seeded by the
same pair: a failure prints the seed and the case, and ``--sweep=SEED[,SEED...] -k OP`` reruns it.
``--sweep=short`` (the default, also MLA_KV_SWEEP) runs SHORT_COUNT seeds per op, ``--sweep=full``
FULL_COUNT. Each op is one test looping over its seeds, printing one line:
``sweep decode: 1000 configs (31 refused as expected), 0 mismatches, 0 changed canary bytes, 9.8 s``.

Sizes are skewed to small (log-uniform lengths, a third of them next to a block or tile boundary;
batches mostly <= 32, up to 300) and capped per configuration (the MAX_* work limits) so that a
full run of all ops takes about three minutes on an H200. Every arch tag runs (None: the GPU's best,
sm80, sm75, sm70), fp16 everywhere, bf16 on None/sm80 (everywhere for gather_kv, a copy), fp32 for
the writes, gather and merge. Inputs the ops refuse by design are exercised as refusals: bf16 on
sm75/sm70, batch 0 for block-pointer caches and for prefill/gather (cu_*_lens needs two entries).
Skipped by design: out strides that are not multiples of 8 elements (the output stores are vectorized,
so the ops refuse them: tests/test_bad_input.py), validate=True with seq_lens < S_q (validate refuses
it: the new tokens must be in the cache).
"""
from __future__ import annotations

import math
import random
import time
import zlib

import pytest
import torch

import sweep_cases as sc
from sweep_cases import (BlockWriteCase, CacheSpec, DecodeCase, GatherCase, MergeCase, PrefillCase, RopeSpec,
                         WriteCase)

SHORT_COUNT = 40
FULL_COUNT = 1000
ARCHS = (None, "sm80", "sm75", "sm70")
BF16_ARCHS = (None, "sm80")
BLOCK_SIZES = (16, 32, 64, 128)
ODD_BLOCK_SIZES = (8, 48)
HEAD_COUNTS = (1, 16, 20, 32, 64, 128)
SPLITS = (1, 2, 3, 8, 9, 16, 33, 64, 100, 1024)  # around the combine kernels' 8 / 16 / 64 split thresholds
REFUSE_RATE = 0.03
MAX_LEN = 70_000
MAX_BATCH = 300
# Per-configuration work caps (elements), sized so that a full run stays near three minutes:
MAX_ATTENTION_WORK = 1 << 26   # sum over sequences of queries x heads x visible kv (the float64 reference)
MAX_SEQUENCE_WORK = 1 << 25    # one sequence's [queries, heads, kv] float64 scores
MAX_CACHE_ROWS = 1 << 20
MAX_PREFILL_TOKENS = 1 << 16
MAX_GATHER_ROWS = 1 << 18
MAX_WRITE_ELEMS = 1 << 25      # tokens x q heads x q head dim of a fused write
MAX_MERGE_ELEMS = 1 << 24
MAX_SPLIT_ROWS = 1 << 17       # splits x query rows x heads: the split-KV workspace (2 KB a row)


# ------------------------------------------------------------------------------------ sampling
def _log_uniform(rng: random.Random, hi: int) -> int:
    """An int in [0, hi], log-uniform: as many draws below sqrt(hi) as above."""
    return min(hi, int(math.exp(rng.uniform(0.0, math.log(hi + 1)))) - 1) if hi > 0 else 0


def _length(rng: random.Random, block_size: int, hi: int = MAX_LEN) -> int:
    """A length in [0, hi]; a third of them one off or on a multiple of the block size or of 64."""
    if rng.random() < 0.35:
        unit = rng.choice((block_size, 64))
        return max(0, min(hi, _log_uniform(rng, hi // unit) * unit + rng.choice((-1, 0, 1))))
    return _log_uniform(rng, hi)


def _batch(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.02:
        return 0
    if r < 0.5:
        return rng.randint(1, 4)
    if r < 0.85:
        return rng.randint(5, 32)
    return min(MAX_BATCH, int(math.exp(rng.uniform(math.log(33), math.log(MAX_BATCH + 1)))))


def _heads(rng: random.Random) -> int:
    return rng.choice(HEAD_COUNTS) if rng.random() < 0.5 else rng.randint(1, 128)


def _block_size(rng: random.Random) -> int:
    return rng.choice(BLOCK_SIZES) if rng.random() < 0.9 else rng.choice(ODD_BLOCK_SIZES)


def _variant(rng: random.Random, *, fp32: bool = False):
    """(arch, dtype, expect_error): every tag, bf16 where the variant has it; now and then bf16 on
    sm75/sm70, which must be refused."""
    if rng.random() < REFUSE_RATE:
        return rng.choice(("sm75", "sm70")), "bfloat16", "TypeError: bfloat16"
    arch = rng.choice(ARCHS)
    names = ["float16"] + (["bfloat16"] if arch in BF16_ARCHS else []) + (["float32"] if fp32 else [])
    return arch, rng.choice(names), None


# The GPU classes whose shared-memory limits a case of each tag may run under (None: this GPU's own).
GPU_CLASSES = {"sm70": ("V100",), "sm75": ("T4 / RTX 20",), "sm80": ("A10 / A40 / RTX 30", "A100"), None: ()}


def _gpu_class(rng: random.Random, arch, expect):
    """A GPU class for half of the mma.sync cases (drawn last: the case's other fields stay as they were)."""
    if expect or rng.random() < 0.5:
        return None
    return rng.choice(GPU_CLASSES[arch] or (None,))


def _halve_until(values, over):
    """``values`` (ints, or tuples of ints) halved until ``over(values)`` is false."""
    while over(values):
        values = [tuple(x // 2 for x in v) if isinstance(v, tuple) else v // 2 for v in values]
    return values


def _pad(rng: random.Random, choices) -> int:
    return rng.choice((0, 0) + tuple(choices))


def _cache_spec(rng: random.Random, row_pads=(8, 24)) -> CacheSpec:
    blocks = rng.random() < 0.3
    layers = rng.randint(1, 3) if blocks else 1
    return CacheSpec(blocks=blocks, block_size=_block_size(rng), shared_blocks=rng.choice((0, 0, 0, 1, 2, 5)),
                     spare_blocks=rng.randint(0, 4), extra_blocks=rng.choice((0, 0, 1, 3)),
                     table_poison=rng.choice(("oob", "neg", "any")), nan_poison=rng.random() < 0.7,
                     row_pad=0 if blocks else _pad(rng, row_pads), block_pad=_pad(rng, (1, 3)),
                     table_pad=_pad(rng, (1, 7)), layers=layers, layer=rng.randrange(layers),
                     rope_first=rng.random() < 0.7)


def _split_plan(rng: random.Random, rows: int):
    """(splits, granularity) for a third of the cases, capped by the workspace it needs."""
    if rng.random() >= 0.35:
        return None
    splits = max(1, min(rng.choice(SPLITS), MAX_SPLIT_ROWS // max(rows, 1)))
    return splits, rng.choice((1, 16, 64))


def sample_decode(rng: random.Random) -> DecodeCase:
    arch, dtype, expect = _variant(rng)
    cache, batch = _cache_spec(rng), _batch(rng)
    s_q = rng.randint(2, 8) if rng.random() < 0.4 else 1
    heads = _heads(rng)
    lens = _halve_until([_length(rng, cache.block_size) for _ in range(batch)],
                        lambda ls: (sum(ls) > MAX_CACHE_ROWS or s_q * heads * sum(ls) > MAX_ATTENTION_WORK
                                    or s_q * heads * max(ls + [0]) > MAX_SEQUENCE_WORK))
    if batch == 0 and cache.blocks:
        expect = "ValueError: cu_block_nums"
    plan = None if expect else _split_plan(rng, batch * s_q * heads)
    lead_pads = (_pad(rng, (1, 3)), _pad(rng, (2,)), _pad(rng, (1, 5)))
    return DecodeCase(arch=arch, dtype=dtype, lens=lens, s_q=s_q, heads=heads, scale=rng.uniform(0.02, 0.25),
                      cache=cache, q_pad=lead_pads + (_pad(rng, (8, 64)),), give_out=rng.random() < 0.5,
                      out_pad=lead_pads + (_pad(rng, (8, 16)),),
                      lse_pad=(_pad(rng, (1,)), _pad(rng, (3,)), _pad(rng, (1,))),
                      schedule=plan, give_workspace=expect is None and rng.random() < 0.3,
                      validate=expect is None and rng.random() < 0.2 and min(lens + [s_q]) >= s_q,
                      expect_error=expect, gpu=_gpu_class(rng, arch, expect))


def sample_prefill(rng: random.Random) -> PrefillCase:
    arch, dtype, expect = _variant(rng)
    cache, batch, heads = _cache_spec(rng), _batch(rng), _heads(rng)
    pairs = []
    for _ in range(batch):
        kv = _length(rng, cache.block_size)
        r = rng.random()
        pairs.append((kv if r < 0.3 else min(kv, rng.randint(1, 8)) if r < 0.6 else rng.randint(0, kv), kv))
    pairs = _halve_until(pairs, lambda ps: (sum(k for _, k in ps) > MAX_CACHE_ROWS
                                            or sum(q for q, _ in ps) > MAX_PREFILL_TOKENS
                                            or heads * sum(q * k for q, k in ps) > MAX_ATTENTION_WORK
                                            or heads * max([q * k for q, k in ps] + [0]) > MAX_SEQUENCE_WORK))
    if batch == 0:
        expect = "ValueError: cu_q_lens"
    pad_rows = rng.choice((0, 0, 0, 1, 13))
    tokens = sum(q for q, _ in pairs) + pad_rows
    plan = None if expect else _split_plan(rng, tokens * heads)
    return PrefillCase(arch=arch, dtype=dtype, q_lens=[q for q, _ in pairs], kv_lens=[k for _, k in pairs],
                       pad_rows=pad_rows, causal=rng.random() < 0.7, heads=heads, scale=rng.uniform(0.02, 0.25),
                       cache=cache, q_pad=(_pad(rng, (1, 2)), _pad(rng, (3,)), _pad(rng, (8, 64))),
                       give_out=rng.random() < 0.5, out_pad=(_pad(rng, (1,)), _pad(rng, (2,)), _pad(rng, (8,))),
                       lse_pad=(_pad(rng, (1,)), _pad(rng, (5,))), schedule=plan,
                       give_workspace=expect is None and rng.random() < 0.3,
                       validate=expect is None and rng.random() < 0.2, expect_error=expect,
                       gpu=_gpu_class(rng, arch, expect))


def sample_gather(rng: random.Random) -> GatherCase:
    arch = rng.choice(ARCHS)
    dtype = rng.choice(("float16", "bfloat16", "float32"))  # a copy: every dtype on every tag
    cache, batch = _cache_spec(rng, row_pads=(2, 8, 14)), _batch(rng)
    counts = [_length(rng, cache.block_size) for _ in range(batch)]
    starts = [_length(rng, cache.block_size, MAX_LEN - n) for n in counts] if rng.random() < 0.5 else None
    spans = _halve_until([(s, n) for s, n in zip(starts or [0] * batch, counts)],
                         lambda sp: (sum(s + n for s, n in sp) > MAX_CACHE_ROWS
                                     or sum(n for _, n in sp) > MAX_GATHER_ROWS))
    return GatherCase(arch=arch, dtype=dtype, counts=[n for _, n in spans],
                      starts=None if starts is None else [s for s, _ in spans], cache=cache,
                      give_out=rng.random() < 0.6, out_extra_rows=rng.choice((0, 0, 3)), out_pad=_pad(rng, (2, 8, 64)),
                      validate=batch > 0 and rng.random() < 0.2,
                      expect_error="ValueError: cu_kv_lens" if batch == 0 else None)


def sample_merge(rng: random.Random) -> MergeCase:
    batch, heads = _batch(rng), _heads(rng)
    dim = 512 if rng.random() < 0.7 else rng.choice((1, 2, 31, 64, 100, 576))
    shape = rng.choice(((batch, heads), (batch, rng.randint(1, 8), heads), (batch * rng.randint(1, 8),)))
    shape = tuple(_halve_until([shape], lambda s: math.prod(s[0]) * dim > MAX_MERGE_ELEMS)[0])
    return MergeCase(dtype=rng.choice(("float16", "bfloat16", "float32")), shape=shape, dim=dim,
                     pads=(_pad(rng, (1, 7, 64)), _pad(rng, (1, 7, 64)), _pad(rng, (1, 7, 64))),
                     give_out=rng.random() < 0.5, neg_inf_rate=rng.choice((0.0, 0.1, 0.5, 1.0)),
                     nan_where_unseen=rng.random() < 0.5)


def _rope(rng: random.Random) -> RopeSpec:
    q_heads = 0 if rng.random() < 0.3 else _heads(rng)
    return RopeSpec(max_position=rng.choice((4096, 131072)), theta=rng.choice((1e4, 1e6)),
                    cos_sin_fp32=rng.random() < 0.7, style=rng.choice(("interleaved", "neox")),
                    eps=rng.choice((1e-6, 1e-5)), positions_out_of_range=rng.choice((0, 0, 0, 1, 4)),
                    q_heads=q_heads, q_dim=rng.choice((64, 192, 256, 576)),
                    q_pad=(_pad(rng, (2,)), _pad(rng, (1,)), _pad(rng, (2, 8))))


def _input_layout(rng: random.Random) -> dict:
    """Strided input rows: padded (a multiple of 2 elements, so not always 16-byte rows) and offset."""
    return dict(extra_rows=rng.choice((0, 0, 1, 9)), input_pad=_pad(rng, (2, 8, 30)),
                input_offset=rng.choice((0, 0, 0, 2, 8)))


def sample_write(rng: random.Random, fused: bool) -> WriteCase:
    arch, dtype, expect = _variant(rng, fp32=True)
    rope = _rope(rng)
    block_size = _block_size(rng)
    tokens = _length(rng, block_size)
    if fused:
        tokens = _halve_until([tokens], lambda t: t[0] * max(rope.q_heads, 1) * rope.q_dim > MAX_WRITE_ELEMS)[0]
    num_blocks = max(1, math.ceil(tokens * rng.uniform(1.0, 2.0) / block_size) + rng.randint(0, 3))
    padded = int(tokens * rng.choice((0.0, 0.0, 0.1, 0.5)))
    past = min(tokens - padded, rng.choice((0, 0, 0, 0, 1, 5)))
    rope.positions_out_of_range = min(rope.positions_out_of_range, tokens)
    return WriteCase(fused=fused, arch=arch, dtype=dtype, tokens=tokens, block_size=block_size,
                     num_blocks=num_blocks, padded_slots=padded, slots_past_cache=past,
                     cache_pad=(_pad(rng, (1,)), _pad(rng, (1, 3)), _pad(rng, (2, 8))), rope=rope,
                     validate=expect is None and past == 0 and rope.positions_out_of_range == 0 and rng.random() < 0.2,
                     expect_error=expect, **_input_layout(rng))


def sample_write_blocks(rng: random.Random, fused: bool) -> BlockWriteCase:
    arch, dtype, expect = _variant(rng, fp32=True)
    rope, batch, block_size = _rope(rng), _batch(rng), _block_size(rng)
    layers = rng.randint(1, 3)
    decode_like = rng.random() < 0.5
    step = rng.choice((1, 2, 4))
    spans = [(_length(rng, block_size), step if decode_like else _length(rng, block_size)) for _ in range(batch)]
    q_width = max(rope.q_heads, 1) * rope.q_dim if fused else 1
    spans = _halve_until(spans, lambda sp: (sum(n for _, n in sp) > MAX_LEN
                                            or layers * sum(h + n for h, n in sp) > MAX_CACHE_ROWS
                                            or q_width * sum(n for _, n in sp) > MAX_WRITE_ELEMS))
    short = rng.random() < 0.1
    extra = [-1 if short and rng.random() < 0.3 else rng.choice((0, 0, 0, 1, 2)) for _ in range(batch)]
    if batch == 0:
        expect = "ValueError: cu_block_nums"
    layout = _input_layout(rng)
    rope.positions_out_of_range = min(rope.positions_out_of_range, sum(n for _, n in spans) + layout["extra_rows"])
    cp_size = rng.choice((2, 3, 4)) if rng.random() < 0.3 else 1
    cp = (cp_size, rng.randrange(cp_size))
    # read-only local rows from none to past the last new token (TurboMind's shared prefix blocks)
    readonly = [rng.randint(0, (h + n) // cp_size + 1) for h, n in spans] if rng.random() < 0.3 else None
    return BlockWriteCase(fused=fused, arch=arch, dtype=dtype, q_lens=[n for _, n in spans], readonly=readonly, cp=cp,
                          history=[h for h, _ in spans], extra_blocks=extra, block_size=block_size, layers=layers,
                          layer=rng.randrange(layers), rope_first=rng.random() < 0.7, spare_blocks=rng.randint(0, 4),
                          layer_pad=_pad(rng, (1, 5)), positions_from_history=rng.random() < 0.8, rope=rope,
                          validate=(expect is None and -1 not in extra and rope.positions_out_of_range == 0
                                    and rng.random() < 0.2),
                          expect_error=expect, **layout)


SAMPLERS = {
    "write_kv": lambda rng: sample_write(rng, fused=False),
    "fused_write_kv": lambda rng: sample_write(rng, fused=True),
    "write_kv_blocks": lambda rng: sample_write_blocks(rng, fused=False),
    "fused_write_kv_blocks": lambda rng: sample_write_blocks(rng, fused=True),
    "decode": sample_decode,
    "prefill": sample_prefill,
    "gather_kv": sample_gather,
    "merge_states": sample_merge,
}


def case_of(op: str, seed: int):
    """The configuration of (op, seed): the same on every machine and run."""
    return SAMPLERS[op](random.Random(f"{op}:{seed}"))


def data_seed(op: str, seed: int) -> int:
    return zlib.crc32(f"{op}:{seed}".encode())


# --------------------------------------------------------------------------------------- sweep
@pytest.fixture
def sweep_seeds(request):
    mode = request.config.getoption("--sweep")
    if mode in ("short", "full"):
        return range(SHORT_COUNT if mode == "short" else FULL_COUNT)
    try:
        return [int(s) for s in mode.split(",")]
    except ValueError:
        raise pytest.UsageError(f"--sweep: 'short', 'full' or comma-separated seeds, got {mode!r}") from None


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(SAMPLERS))
def test_sweep(op, sweep_seeds, capsys):
    start = time.perf_counter()
    failed, canary, refused, configs = [], 0, 0, 0
    for seed in sweep_seeds:
        case = case_of(op, seed)
        try:
            outcome = sc.run(case, "cuda", data_seed(op, seed))
        except Exception as error:  # noqa: BLE001 - a harness error fails this seed, not the sweep
            outcome = sc.Outcome([f"harness error {type(error).__name__}: {error}"])
        configs += 1
        refused += bool(getattr(case, "expect_error", None)) and not outcome.problems
        canary += outcome.canary_bytes
        if outcome.problems or outcome.canary_bytes:
            failed.append((seed, case, outcome))
        if outcome.fatal:
            break  # the CUDA context is gone: every later seed would fail the same way
    mismatches = sum(bool(o.problems) for _, _, o in failed)
    with capsys.disabled():
        print(f"\nsweep {op}: {configs} configs ({refused} refused as expected), {mismatches} mismatches, "
              f"{canary} changed canary bytes, {time.perf_counter() - start:.1f} s")
    if failed:
        details = "\n".join(f"seed {seed}: {case!r}\n    "
                            + "\n    ".join(o.problems + [f"{o.canary_bytes} changed canary bytes"])
                            for seed, case, o in failed[:5])
        seeds = ",".join(str(seed) for seed, _, _ in failed)
        pytest.fail(f"{op}: {len(failed)} of {configs} configs failed (rerun: pytest tests/test_sweep.py -k {op} "
                    f"--sweep={seeds})\n{details}", pytrace=False)


# ------------------------------------------------------------------------ the harness on the CPU
def _work(case) -> int:
    if isinstance(case, DecodeCase):
        return case.s_q * case.heads * sum(case.lens)
    if isinstance(case, PrefillCase):
        return case.heads * sum(q * k for q, k in zip(case.q_lens, case.kv_lens))
    return 0


def test_sampled_cases_are_reproducible_varied_and_within_budget():
    seen = {op: set() for op in SAMPLERS}
    for op in SAMPLERS:
        for seed in range(FULL_COUNT):
            case = case_of(op, seed)
            assert case == case_of(op, seed)
            assert _work(case) <= MAX_ATTENTION_WORK
            tags = seen[op]
            tags.add(("arch", getattr(case, "arch", "-")))
            tags.add(("dtype", case.dtype))
            tags.add(("refused", getattr(case, "expect_error", None) is not None))
            spec = getattr(case, "cache", None)
            if spec is not None:
                tags.add(("blocks", spec.blocks))
                lens = {DecodeCase: "lens", PrefillCase: "kv_lens", GatherCase: "counts"}[type(case)]
                lens = getattr(case, lens)
                tags.update(("boundary", n % spec.block_size) for n in lens if n and n % spec.block_size in (0, 1))
                tags.add(("batch", min(len(lens), 2)))
            if hasattr(case, "schedule"):
                tags.add(("forced split", case.schedule is not None))
            if hasattr(case, "gpu"):
                tags.add(("gpu", case.gpu))
    for op, tags in seen.items():
        archs = ARCHS if op != "merge_states" else ("-",)
        assert {("arch", a) for a in archs} <= tags, op
        assert {("dtype", "float16"), ("dtype", "bfloat16")} <= tags, op
        if op in ("decode", "prefill"):  # every GPU class's limits, and the device's own
            assert {("gpu", g) for cls in GPU_CLASSES.values() for g in cls} | {("gpu", None)} <= tags, op
        if op not in ("merge_states",):
            assert ("refused", True) in tags and ("refused", False) in tags, op
        if op in ("decode", "prefill", "gather_kv"):
            assert {("blocks", True), ("blocks", False), ("boundary", 0), ("boundary", 1), ("batch", 0),
                    ("batch", 2)} <= tags, op
        if op in ("decode", "prefill"):
            assert {("forced split", True), ("forced split", False)} <= tags, op


def test_canaries_count_bytes_outside_the_written_views():
    can = sc.Canaries("cpu", torch.Generator().manual_seed(0))
    out = can.tensor((3, 4, 8), torch.float16, pad=(1, 2, 8), offset=(0, 1, 0))
    lse = can.tensor((3, 4), torch.float32)
    can.arm()
    assert can.changed_bytes() == 0
    out[:2] = 1.0
    assert can.changed_bytes(out[:2]) == 0
    assert can.changed_bytes(out[:1]) > 0, "row 1 was written but only row 0 may be"
    out.as_strided((1,), (1,), out.storage_offset() + 8).fill_(7.0)  # the first padding element of row 0
    assert can.changed_bytes(out) == 2
    lse.view(-1)[-1] = 3.0
    raw = lse.untyped_storage()
    raw[raw.nbytes() - 1] = (raw[raw.nbytes() - 1] + 1) % 256  # the last tail byte
    assert can.changed_bytes(out, lse) == 3


def test_checks_catch_wrong_results():
    ref_out = torch.randn(4, 3, 512, dtype=torch.float64)
    ref_lse = torch.randn(4, 3, dtype=torch.float64)
    ref_lse[0, 1] = -math.inf
    ref_out[0, 1] = 0
    out, lse = ref_out.half(), ref_lse.float()
    assert sc.attention_problems("x", out, lse, ref_out, ref_lse) == []
    bad = out.clone()
    bad[2, 2, 7] += 1.0
    assert "row (t=2, h=2) out error" in sc.attention_problems("x", bad, lse, ref_out, ref_lse)[0]
    bad = out.clone()
    bad[0, 1, 0] = 1e-3
    assert "sees no key" in sc.attention_problems("x", bad, lse, ref_out, ref_lse)[0]
    want = torch.tensor([1.0, 1e-3, 0.0, -2.5], dtype=torch.float64)
    got = want.half()
    assert sc.rounding_problems("w", got, want, torch.zeros(4, dtype=torch.float64)) == []
    off = got.view(torch.int16) + torch.tensor([0, 3, 0, 0], dtype=torch.int16)
    assert sc.rounding_problems("w", off.view(torch.float16), want, torch.zeros(4, dtype=torch.float64))
    tiny = torch.tensor([3e-7], dtype=torch.float64)  # a cancelling rotation of inputs near 1
    zero = torch.tensor([0.0], dtype=torch.float16)
    assert sc.rounding_problems("w", zero, tiny, torch.ones(1, dtype=torch.float64)) == []


CPU_CASES = [  # the paged ops' CPU path runs the reference: the harness must find nothing
    WriteCase(tokens=40, block_size=16, num_blocks=4, padded_slots=5, slots_past_cache=2, extra_rows=3, input_pad=2,
              input_offset=2, cache_pad=(1, 1, 2)),
    WriteCase(fused=True, dtype="bfloat16", tokens=33, block_size=8, num_blocks=6, padded_slots=3, extra_rows=2,
              rope=RopeSpec(positions_out_of_range=2, q_heads=3, q_dim=192, q_pad=(1, 1, 2), style="neox")),
    WriteCase(fused=True, dtype="float32", tokens=9, block_size=32, num_blocks=1, rope=RopeSpec(cos_sin_fp32=False)),
    DecodeCase(lens=[0, 1, 17, 64, 100], s_q=3, heads=5, give_out=True, q_pad=(1, 0, 2, 8), out_pad=(0, 1, 1, 8),
               lse_pad=(1, 0, 3), cache=CacheSpec(block_size=16, shared_blocks=1, extra_blocks=2, table_poison="neg",
                                                  row_pad=8, block_pad=3, table_pad=1)),
    DecodeCase(dtype="bfloat16", lens=[], cache=CacheSpec(table_poison="any", nan_poison=False)),
    PrefillCase(q_lens=[0, 7, 1], kv_lens=[3, 7, 40], causal=False, heads=3, give_out=True,
                cache=CacheSpec(block_size=32, shared_blocks=2, table_poison="oob")),
    PrefillCase(q_lens=[20, 5], kv_lens=[20, 50], heads=2, q_pad=(1, 3, 8)),
    GatherCase(counts=[0, 5, 70], starts=[3, 0, 10], give_out=True, out_extra_rows=3, out_pad=2,
               cache=CacheSpec(block_size=16, shared_blocks=1, row_pad=2)),
    GatherCase(dtype="float32", counts=[9], cache=CacheSpec(block_size=8, nan_poison=False)),
    MergeCase(shape=(3, 2, 5), dim=31, pads=(1, 7, 2), give_out=True, neg_inf_rate=0.5),
    MergeCase(dtype="float32", shape=(0, 4), give_out=True),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: type(c).__name__)
def test_harness_finds_nothing_on_the_cpu_reference(case):
    outcome = sc.run(case, "cpu", 1)
    assert outcome.problems == [] and outcome.canary_bytes == 0
