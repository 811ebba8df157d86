"""Cases of every op, run against the float64 reference with canary bytes around every tensor.

Shared by tests/test_sweep.py (seeded random cases) and scripts/sanitize_calls.py (one hand-made
case per op x kernel variant under compute-sanitizer). A case is a dataclass that fixes everything
but the random data; ``run(case, device, seed)`` builds the inputs from generators seeded by
``seed``, calls the op and returns an Outcome: the mismatches against the reference and the number
of canary bytes the call changed.

Canaries: every tensor a call gets lies inside a larger buffer of random bytes, padded in some dims
(so it is a strided view) and followed by CANARY_BYTES. Afterwards every byte of the buffer must be
unchanged except the elements the op writes: a read op's cache and all inputs stay untouched, and so
do prefill's out/lse rows past cu_q_lens[B] and gather's rows past the total. The caches of read ops
hold NaN (or random rows) wherever no sequence reads (past sequence ends, unused blocks, other
layers), so a read of them shows. All data is initialized (compute-sanitizer's initcheck sees only
what the ops themselves leave unwritten).

Tolerances: attention and merge rows (sequence, query, head) as gpu_checks.check_attention
judges them; plain writes and gathers bit for bit; fused writes within ULPS spacings of the float64
result (plus fp32 rounding of the inputs' magnitude, for a rotation whose terms cancel).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import List, Optional, Tuple

import torch

import gpu_checks
from gpu_checks import bits
import mla_kv
from mla_kv import parallel, reference
from mla_kv.layout import BlockPool, block_slots, to_latent_first, to_rope_first
from mla_kv.rope import cos_sin_cache

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
CANARY_BYTES = 256
MERGE_LSE_TOL = 1e-5  # merge_states' lse is fp32 math on its inputs
ULPS = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 32}
FP32_SLACK = 2.0 ** -21  # a few fp32 roundings of the largest input of a rotated row


# ---------------------------------------------------------------------------------- canaries
class Canaries:
    """Makes every tensor of a call inside its own buffer of random bytes (see the module docstring)."""

    def __init__(self, device, gen: torch.Generator):
        self.device, self.gen = torch.device(device), gen
        self._buffers: List[torch.Tensor] = []
        self._initial: List[torch.Tensor] = []

    def tensor(self, shape, dtype, pad=(), offset=()) -> torch.Tensor:
        """A ``shape`` view into a buffer of dims offset + shape + pad (per dim, default 0) and the
        tail; its elements start as random bytes like the rest (NaN and all, for outputs)."""
        pad = tuple(pad) + (0,) * (len(shape) - len(pad))
        offset = tuple(offset) + (0,) * (len(shape) - len(offset))
        full = [o + s + p for o, s, p in zip(offset, shape, pad)]
        nbytes = math.prod(full) * torch.empty((), dtype=dtype).element_size()
        buffer = torch.randint(0, 256, (nbytes + CANARY_BYTES,), dtype=torch.uint8, generator=self.gen,
                               device=self.device)
        self._buffers.append(buffer)
        return buffer[:nbytes].view(dtype).view(full)[tuple(slice(o, o + s) for o, s in zip(offset, shape))]

    def arm(self) -> None:
        """Snapshots every buffer: call after filling the inputs, right before the op."""
        self._initial = [b.clone() for b in self._buffers]

    def changed_bytes(self, *written: torch.Tensor) -> int:
        """Bytes that differ from the snapshot, except the elements of ``written`` (views of these
        tensors that the op may write; the caller checks their values)."""
        changed = 0
        for buffer, initial in zip(self._buffers, self._initial):
            expected = initial.clone()
            for w in written:
                if w is None or not w.numel() or w.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
                    continue
                dst = expected.view(w.dtype).as_strided(w.shape, w.stride(), w.storage_offset())
                dst.view(torch.uint8).copy_(w.view(torch.uint8))
            changed += int((expected != buffer).sum())
        return changed


def generators(device, seed: int):
    """(device generator for data, host generator for permutations), both seeded by ``seed``."""
    return torch.Generator(device=device).manual_seed(seed), torch.Generator().manual_seed(seed)


def randn(shape, gen, device, scale=1.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device) * scale


# ------------------------------------------------------------------------------------ checks
@dataclass
class Outcome:
    problems: List[str] = field(default_factory=list)
    canary_bytes: int = 0
    fatal: bool = False  # the CUDA context may be gone: later calls cannot be trusted


def attention_problems(what, out, lse, ref_out, ref_lse, **tolerances) -> List[str]:
    """gpu_checks.check_attention's verdict on every (sequence, query, head) row, as a list."""
    try:
        gpu_checks.check_attention(out, lse, ref_out, ref_lse, what, **tolerances)
    except AssertionError as error:
        return [str(error)]
    return []


def spacing(x: torch.Tensor, dtype) -> torch.Tensor:
    """The gap between adjacent ``dtype`` values at |x| (float64 x; subnormal spacing near 0)."""
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(x)
    exponent = torch.where(x == 0, int(math.log2(info.tiny)), exponent - 1).clamp_min(int(math.log2(info.tiny)))
    return torch.ldexp(torch.full_like(x, info.eps), exponent)


def rounding_problems(what, got, want, magnitude) -> List[str]:
    """got (a float dtype) against the float64 ``want``: within ULPS spacings of want, or within
    fp32 rounding of ``magnitude`` (per element, broadcast) where a rotation cancels."""
    if not got.numel():
        return []
    err = (got.double() - want).abs()
    allowed = ULPS[got.dtype] * spacing(want, got.dtype) + FP32_SLACK * magnitude
    bad = ~(err <= allowed)
    if not bad.any():
        return []
    worst = int(torch.where(bad, err, -1.0).flatten().argmax())
    return [f"{what}: {int(bad.sum())} of {got.numel()} values beyond {ULPS[got.dtype]} ulp; worst at flat index "
            f"{worst}: {float(got.flatten()[worst])!r} vs {float(want.flatten()[worst])!r}"]


def unchanged_problems(what, got, before, keep=None) -> List[str]:
    """Elements of got that must equal ``before`` bit for bit (where ``keep``, default all)."""
    differ = bits(got) != bits(before)
    if keep is not None:
        differ &= keep
    n = int(differ.sum())
    return [f"{what}: {n} elements changed that must not"] if n else []


def _context_lost(device: torch.device) -> bool:
    """After an error: whether the CUDA context is gone (a sticky error), so later calls would fail too."""
    if device.type != "cuda":
        return False
    try:
        torch.cuda.synchronize(device)
    except RuntimeError:
        return True
    return False


def _call(fn, expect: Optional[str], canaries: Canaries):
    """(result, None) of fn(), synchronized; or (None, Outcome) when it raised (expected: a type
    name and a part of the message, "TypeError: bfloat16", with nothing written) or did not raise
    as expected."""
    canaries.arm()
    try:
        result = fn()
        if canaries.device.type == "cuda":
            torch.cuda.synchronize(canaries.device)
    except Exception as error:  # noqa: BLE001 - every failure of the op becomes a reported problem
        kind, _, part = (expect or "").partition(":")
        if expect and type(error).__name__ == kind and part.strip() in str(error):
            return None, Outcome([], canaries.changed_bytes())
        message = f"raised {type(error).__name__}: {str(error)[:300]}" + (f" (expected {expect})" if expect else "")
        return None, Outcome([message], canaries.changed_bytes(), fatal=_context_lost(canaries.device))
    if expect:
        return None, Outcome([f"expected {expect}, the call returned"], canaries.changed_bytes())
    return result, None


# ------------------------------------------------------------------------------------ caches
@dataclass
class CacheSpec:
    """The cache a read op (decode, prefill, gather_kv) gets."""

    blocks: bool = False        # a BlockPointerCache over a layout.BlockPool, else a paged tensor + table
    block_size: int = 64
    shared_blocks: int = 0      # leading blocks every sequence shares (a common prefix)
    spare_blocks: int = 2       # blocks no sequence uses
    extra_blocks: int = 0       # paged: table entries past the longest sequence; pointers: blocks a sequence has
    #                             past its end
    table_poison: str = "oob"   # paged entries past a sequence's blocks: "oob" (an id past the cache), "neg" (-1),
    #                             "any" (a random id)
    nan_poison: bool = True     # rows no sequence reads hold NaN (else random values)
    row_pad: int = 0            # paged: elements after each row (multiple of 8)
    block_pad: int = 0          # rows after each block (paged) / after each layer of a block (pool)
    table_pad: int = 0          # paged: entries after each table row
    layers: int = 1             # pool only
    layer: int = 0
    rope_first: bool = True


class ReadCache:
    """A cache whose sequence b holds random rows at positions < covers[b], NaN (or random) elsewhere."""

    def __init__(self, spec: CacheSpec, dtype, covers: List[int], device, gen, cpu_gen, canaries: Canaries):
        self.spec = spec
        bs = spec.block_size
        need = [-(-c // bs) for c in covers]
        shared = min([spec.shared_blocks] + need)
        extra = spec.extra_blocks if spec.blocks else 0
        own = [n - shared + extra for n in need]
        num_blocks = max(1, shared + sum(own) + spec.spare_blocks)
        perm = torch.randperm(num_blocks, generator=cpu_gen)
        starts = torch.tensor([0] + own).cumsum(0).tolist()
        lists = [torch.cat([perm[:shared], perm[shared + starts[b]:shared + starts[b + 1]]])
                 for b in range(len(covers))]
        seq = torch.repeat_interleave(torch.arange(len(covers)), torch.tensor(covers, dtype=torch.long))
        pos = torch.arange(len(seq)) - torch.tensor([0] + covers).cumsum(0)[:-1][seq] if len(seq) else seq
        if spec.blocks:
            self.ids = torch.cat(lists) if lists else torch.zeros(0, dtype=torch.long)
            self.cu_blocks = torch.tensor([0] + [len(x) for x in lists]).cumsum(0).to(torch.int32)
            covered_block = self.ids[self.cu_blocks.long()[seq] + pos // bs] if len(seq) else seq
            storage = canaries.tensor((num_blocks, spec.layers, bs, 576), dtype, pad=(0, 0, spec.block_pad))
            storage.copy_(randn(storage.shape, gen, device, 0.5))
            self.pool = BlockPool(0, spec.layers, bs, dtype, device, rope_first=spec.rope_first)
            self.pool.storage = storage  # the pool's rows inside a canaried buffer
            rows = storage[:, spec.layer]
            if spec.nan_poison:
                for other in range(spec.layers):
                    if other != spec.layer:
                        storage[:, other] = float("nan")
            self.kv_cache, self.block_table = self.pool.cache(spec.layer, self.ids, self.cu_blocks), None
            self.cache_args = (self.pool, spec.layer, self.ids, self.cu_blocks)
        else:
            width = max(need + [1]) + spec.extra_blocks
            poison = {"oob": torch.full((len(covers), width), num_blocks + 7),
                      "neg": torch.full((len(covers), width), -1),
                      "any": torch.randint(0, num_blocks, (len(covers), width), generator=cpu_gen)}[spec.table_poison]
            table = poison.to(torch.int32)
            for b, ids in enumerate(lists):
                table[b, :len(ids)] = ids.to(torch.int32)
            covered_block = table.long()[seq, pos // bs] if len(seq) else seq
            self.block_table = canaries.tensor(table.shape, torch.int32, pad=(0, spec.table_pad))
            self.block_table.copy_(table)
            rows = canaries.tensor((num_blocks, bs, 576), dtype, pad=(0, spec.block_pad, spec.row_pad))
            rows.copy_(randn(rows.shape, gen, device, 0.5))
            self.kv_cache = rows
            self.cache_args = (rows, self.block_table)
        if spec.nan_poison:
            covered = torch.zeros(num_blocks, bs, dtype=torch.bool)
            covered[covered_block, pos % bs] = True
            rows[~covered.to(device)] = float("nan")
        self.block_counts = [len(x) for x in lists]

    def reference(self, name: str, *args, **kwargs):
        """reference.<name> (its _blocks form for block pointers) with the cache arguments placed
        after args[:1] for decode/prefill (q first) and first for gather_kv."""
        fn = getattr(reference, name + ("_blocks" if self.spec.blocks else ""))
        if name == "gather_kv":
            return fn(*self.cache_args, *args, **kwargs)
        return fn(args[0], *self.cache_args, *args[1:], **kwargs)


def _plan(case, canaries, q, cache: "ReadCache", packed_batch=None):
    """(schedule, workspace) a case passes: hand-made (splits, granularity) covering what the op
    checks, or the op's own plan (gpu_checks.default_schedule) when only a workspace or a GPU class
    is given, as a CUDA-graph caller plans; (None, None) lets the op plan and allocate. The CPU path
    (the reference) takes neither."""
    if q.device.type != "cuda" or (case.schedule is None and not case.give_workspace and case.gpu is None):
        return None, None
    heads, total = q.shape[-2], q.shape[0] * (q.shape[1] if packed_batch is None else 1)
    if case.schedule is not None:
        splits, granularity = case.schedule
        # The paged table's width, or the longest block list for block pointers (validate=True checks it).
        cover = max(cache.block_counts + [1]) if case.cache.blocks else cache.block_table.shape[1]
        tokens = -(-cover * case.cache.block_size // splits)
        schedule = replace(gpu_checks.split_schedule(splits, -(-tokens // granularity) * granularity, total, heads),
                           smem_limits=mla_kv.gpus.smem_limits(case.gpu))
    else:
        schedule = gpu_checks.default_schedule(q, cache.kv_cache, cache.block_table, packed_batch=packed_batch,
                                               arch=case.arch, smem_limits=case.gpu)
    workspace = canaries.tensor((schedule.workspace_bytes,), torch.uint8) if case.give_workspace else None
    return schedule, workspace


# --------------------------------------------------------------------------------- attention
@dataclass
class DecodeCase:
    arch: Optional[str] = None
    dtype: str = "float16"
    lens: List[int] = field(default_factory=lambda: [5, 70])
    s_q: int = 1
    heads: int = 8
    scale: float = 0.0625
    cache: CacheSpec = field(default_factory=CacheSpec)
    q_pad: Tuple[int, ...] = (0, 0, 0, 0)   # per dim; the last a multiple of 8
    give_out: bool = False
    out_pad: Tuple[int, ...] = (0, 0, 0, 0)  # the last a multiple of 8 (see the sweep's notes on out alignment)
    lse_pad: Tuple[int, ...] = (0, 0, 0)
    schedule: Optional[Tuple[int, int]] = None  # (splits, token granularity) forced; None: the op's plan
    give_workspace: bool = False
    validate: bool = False
    gpu: Optional[str] = None  # a GPU class (mla_kv.gpus): plan and launch under its shared-memory limits
    expect_error: Optional[str] = None  # "TypeError: part of the message" when the call must be refused


def run_decode(case: DecodeCase, device, seed: int) -> Outcome:
    dtype, (gen, cpu_gen) = DTYPES[case.dtype], generators(device, seed)
    can = Canaries(device, gen)
    batch, s_q, heads = len(case.lens), case.s_q, case.heads
    cache = ReadCache(case.cache, dtype, case.lens, device, gen, cpu_gen, can)
    q = can.tensor((batch, s_q, heads, 576), dtype, pad=case.q_pad)
    q.copy_(randn(q.shape, gen, device))
    seq_lens = can.tensor((batch,), torch.int32)
    seq_lens.copy_(torch.tensor(case.lens, dtype=torch.int32))
    out = lse = None
    if case.give_out:
        out = can.tensor((batch, s_q, heads, 512), dtype, pad=case.out_pad)
        lse = can.tensor((batch, s_q, heads), torch.float32, pad=case.lse_pad)
    schedule, workspace = _plan(case, can, q, cache)
    result, failed = _call(lambda: mla_kv.decode(q, cache.kv_cache, cache.block_table, seq_lens, case.scale, out=out,
                                                 lse=lse, workspace=workspace, schedule=schedule,
                                                 validate=case.validate, arch=case.arch), case.expect_error, can)
    if failed:
        return failed
    ref_out, ref_lse = cache.reference("decode", q.double(), seq_lens, case.scale)
    problems = attention_problems("decode", *result, ref_out, ref_lse)
    return Outcome(problems, can.changed_bytes(out, lse, workspace))


@dataclass
class PrefillCase:
    arch: Optional[str] = None
    dtype: str = "float16"
    q_lens: List[int] = field(default_factory=lambda: [5, 1])
    kv_lens: List[int] = field(default_factory=lambda: [5, 70])
    pad_rows: int = 0           # q/out/lse rows past cu_q_lens[B] (a padded graph batch): untouched
    causal: bool = True
    heads: int = 8
    scale: float = 0.0625
    cache: CacheSpec = field(default_factory=CacheSpec)
    q_pad: Tuple[int, ...] = (0, 0, 0)
    give_out: bool = False
    out_pad: Tuple[int, ...] = (0, 0, 0)
    lse_pad: Tuple[int, ...] = (0, 0)
    schedule: Optional[Tuple[int, int]] = None
    give_workspace: bool = False
    validate: bool = False
    gpu: Optional[str] = None  # a GPU class (mla_kv.gpus): plan and launch under its shared-memory limits
    expect_error: Optional[str] = None


def run_prefill(case: PrefillCase, device, seed: int) -> Outcome:
    dtype, (gen, cpu_gen) = DTYPES[case.dtype], generators(device, seed)
    can = Canaries(device, gen)
    batch, heads = len(case.kv_lens), case.heads
    packed = sum(case.q_lens)
    tokens = packed + case.pad_rows
    cache = ReadCache(case.cache, dtype, case.kv_lens, device, gen, cpu_gen, can)
    q = can.tensor((tokens, heads, 576), dtype, pad=case.q_pad)
    q.copy_(randn(q.shape, gen, device))
    cu_q = can.tensor((batch + 1,), torch.int32)
    cu_q.copy_(torch.tensor([0] + case.q_lens).cumsum(0))
    kv_lens = can.tensor((batch,), torch.int32)
    kv_lens.copy_(torch.tensor(case.kv_lens, dtype=torch.int32))
    out = lse = None
    if case.give_out:
        out = can.tensor((tokens, heads, 512), dtype, pad=case.out_pad)
        lse = can.tensor((tokens, heads), torch.float32, pad=case.lse_pad)
    schedule, workspace = _plan(case, can, q, cache, packed_batch=batch)
    result, failed = _call(lambda: mla_kv.prefill(q, cache.kv_cache, cache.block_table, cu_q, kv_lens, case.scale,
                                                  causal=case.causal, out=out, lse=lse, workspace=workspace,
                                                  schedule=schedule, validate=case.validate, arch=case.arch),
                           case.expect_error, can)
    if failed:
        return failed
    ref_out, ref_lse = cache.reference("prefill", q[:packed].double(), cu_q, kv_lens, case.scale, causal=case.causal)
    got_out, got_lse = result
    problems = attention_problems("prefill", got_out[:packed], got_lse[:packed], ref_out, ref_lse, cu_q_lens=cu_q)
    written = (None, None) if out is None else (out[:packed], lse[:packed])
    return Outcome(problems, can.changed_bytes(*written, workspace))


@dataclass
class MergeCase:
    dtype: str = "float16"
    shape: Tuple[int, ...] = (3, 7)  # the leading dims; rows = their product
    dim: int = 512
    pads: Tuple[int, int, int] = (0, 0, 0)  # elements after each row of out_a, out_b, out
    give_out: bool = False
    neg_inf_rate: float = 0.1  # of each side's lse
    nan_where_unseen: bool = True  # a side with lse -inf holds NaN: it must not be read


def run_merge(case: MergeCase, device, seed: int) -> Outcome:
    dtype, (gen, _) = DTYPES[case.dtype], generators(device, seed)
    can = Canaries(device, gen)
    lead = len(case.shape)
    states = []
    for pad in case.pads[:2]:
        out = can.tensor((*case.shape, case.dim), dtype, pad=(0,) * lead + (pad,))
        lse = can.tensor(case.shape, torch.float32)
        lse.copy_(randn(case.shape, gen, device, 4.0))
        unseen = torch.rand(case.shape, generator=gen, device=device) < case.neg_inf_rate
        lse[unseen] = -math.inf
        out.copy_(randn(out.shape, gen, device))
        if case.nan_where_unseen:
            out[unseen] = math.nan
        states += [out, lse]
    out = lse = None
    if case.give_out:
        out = can.tensor((*case.shape, case.dim), dtype, pad=(0,) * lead + (case.pads[2],))
        lse = can.tensor(case.shape, torch.float32)
    result, failed = _call(lambda: mla_kv.merge_states(*states, out=out, lse=lse), None, can)
    if failed:
        return failed
    ref_out, ref_lse = reference.merge_states(*(t.double() for t in states))
    problems = attention_problems("merge_states", *result, ref_out, ref_lse, lse_tol=MERGE_LSE_TOL)
    return Outcome(problems, can.changed_bytes(out, lse))


# ------------------------------------------------------------------------------------ gather
@dataclass
class GatherCase:
    arch: Optional[str] = None
    dtype: str = "float16"
    counts: List[int] = field(default_factory=lambda: [5, 70])
    starts: Optional[List[int]] = None
    cache: CacheSpec = field(default_factory=CacheSpec)
    give_out: bool = False
    out_extra_rows: int = 0  # rows of out past the total: untouched
    out_pad: int = 0         # elements after each out row (multiple of 2)
    validate: bool = False
    expect_error: Optional[str] = None


def run_gather(case: GatherCase, device, seed: int) -> Outcome:
    dtype, (gen, cpu_gen) = DTYPES[case.dtype], generators(device, seed)
    can = Canaries(device, gen)
    batch, total = len(case.counts), sum(case.counts)
    first = case.starts or [0] * batch
    cache = ReadCache(case.cache, dtype, [s + n for s, n in zip(first, case.counts)], device, gen, cpu_gen, can)
    cu = can.tensor((batch + 1,), torch.int32)
    cu.copy_(torch.tensor([0] + case.counts).cumsum(0))
    starts = None
    if case.starts is not None:
        starts = can.tensor((batch,), torch.int32)
        starts.copy_(torch.tensor(case.starts, dtype=torch.int32))
    out = can.tensor((total + case.out_extra_rows, 576), dtype, pad=(0, case.out_pad)) if case.give_out else None
    got, failed = _call(lambda: mla_kv.gather_kv(cache.kv_cache, cache.block_table, cu, starts=starts, out=out,
                                                 validate=case.validate, arch=case.arch), case.expect_error, can)
    if failed:
        return failed
    want = cache.reference("gather_kv", cu, starts=starts)
    problems = unchanged_problems("gather_kv rows", got[:total], want)
    if out is None and got.shape[0] != total:
        problems.append(f"gather_kv: allocated {got.shape[0]} rows for {total}")
    return Outcome(problems, can.changed_bytes(None if out is None else out[:total]))


# ------------------------------------------------------------------------------------- write
@dataclass
class RopeSpec:
    """The fused ops' extra inputs: RMSNorm weight and eps, RoPE table and positions, q."""

    max_position: int = 4096
    theta: float = 1e4
    cos_sin_fp32: bool = True
    style: str = "interleaved"
    eps: float = 1e-6
    positions_out_of_range: int = 0  # tokens whose position lies outside the table: left alone
    q_heads: int = 4                 # 0: no q
    q_dim: int = 256
    q_pad: Tuple[int, int, int] = (0, 0, 0)


@dataclass
class WriteCase:
    """write_kv / fused_write_kv into a paged cache."""

    fused: bool = False
    arch: Optional[str] = None
    dtype: str = "float16"
    tokens: int = 20
    block_size: int = 16
    num_blocks: int = 4
    padded_slots: int = 0   # slots -1
    slots_past_cache: int = 0  # slots >= capacity: skipped
    extra_rows: int = 0     # input rows past the tokens
    input_pad: int = 0      # elements after each input row (multiple of 2; not of 8: the 2-element path)
    input_offset: int = 0   # elements before each input row (even)
    cache_pad: Tuple[int, int, int] = (0, 0, 0)  # blocks after the cache, rows after a block, elements after a row
    rope: RopeSpec = field(default_factory=RopeSpec)
    validate: bool = False
    expect_error: Optional[str] = None


@dataclass
class BlockWriteCase:
    """write_kv_blocks / fused_write_kv_blocks into a block pool."""

    fused: bool = False
    arch: Optional[str] = None
    dtype: str = "float16"
    q_lens: List[int] = field(default_factory=lambda: [3, 70])
    history: List[int] = field(default_factory=lambda: [60, 0])
    extra_blocks: List[int] = field(default_factory=lambda: [0, 1])  # per sequence past its need; -1: short
    block_size: int = 64
    layers: int = 2
    layer: int = 1
    rope_first: bool = True
    spare_blocks: int = 2
    layer_pad: int = 0      # rows after each layer of a block
    extra_rows: int = 0     # input rows past cu_q_lens[B]: no cache row (q is still rotated)
    input_pad: int = 0
    input_offset: int = 0
    positions_from_history: bool = True  # RoPE positions = cache positions, else random
    readonly: Optional[List[int]] = None  # readonly_lens: per sequence, local rows never written
    cp: Tuple[int, int] = (1, 0)          # (cp_size, cp_rank) of the write
    rope: RopeSpec = field(default_factory=RopeSpec)
    validate: bool = False
    expect_error: Optional[str] = None


class _WriteInputs:
    """Input rows ([kv_c | k_pe] or kv_a), and for fused writes weight, positions, cos/sin and q."""

    def __init__(self, case, rows: int, dtype, device, gen, can: Canaries, positions):
        pad, offset = (0, case.input_pad), (0, case.input_offset)
        self.rope = rope = case.rope
        if not case.fused:
            self.kv_c = can.tensor((rows, 512), dtype, pad=pad, offset=offset)
            self.k_pe = can.tensor((rows, 64), dtype, pad=pad, offset=offset)
            for t in (self.kv_c, self.k_pe):
                t.copy_(randn(t.shape, gen, device))
            self.q = None
            return
        self.kv_a = can.tensor((rows, 576), dtype, pad=pad, offset=offset)
        self.kv_a.copy_(randn(self.kv_a.shape, gen, device))
        self.weight = can.tensor((512,), dtype)
        self.weight.copy_(torch.rand(512, generator=gen, device=device) + 0.5)
        self.positions = can.tensor((rows,), torch.int64)
        self.positions.copy_(positions)
        bad = torch.randperm(rows, generator=gen, device=device)[:rope.positions_out_of_range]
        self.positions[bad] = torch.where(torch.arange(len(bad), device=device) % 2 == 0, rope.max_position, -1)
        table = cos_sin_cache(64, rope.max_position, rope.theta, dtype=torch.float32 if rope.cos_sin_fp32 else dtype,
                              device=device)
        self.cos_sin = can.tensor(table.shape, table.dtype)
        self.cos_sin.copy_(table)
        self.q = None
        if rope.q_heads:
            self.q = can.tensor((rows, rope.q_heads, rope.q_dim), dtype, pad=rope.q_pad)
            self.q.copy_(randn(self.q.shape, gen, device))
        self.q_before = None if self.q is None else self.q.clone()

    def fused_args(self):
        return self.kv_a, self.weight, self.rope.eps, self.positions

    def in_range(self) -> torch.Tensor:
        return (self.positions >= 0) & (self.positions < self.rope.max_position)

    def reference_fused(self, cache64, slots):
        """reference.fused_write_kv of the first len(slots) input rows into cache64 -> the rotated q64."""
        q64 = None if self.q is None else self.q_before.double()
        reference.fused_write_kv(self.kv_a.double(), self.weight.double(), self.rope.eps, self.positions,
                                 self.cos_sin.double(), cache64, slots, rope_style=self.rope.style, q=q64)
        return q64

    def q_problems(self, q64, tokens: int) -> List[str]:
        """The rotated rope part of q's first ``tokens`` rows (where the position is in range)
        against the reference; every other element of q unchanged."""
        if self.q is None:
            return []
        rotated = torch.zeros(self.q.shape, dtype=torch.bool, device=self.q.device)
        rotated[:tokens, :, -64:] = self.in_range()[:tokens, None, None]
        magnitude = self.q_before[..., -64:].abs().amax(-1, keepdim=True).double()
        got, want = self.q[..., -64:], q64[..., -64:]
        keep = rotated[..., -64:]
        return (rounding_problems("q rope part", got[keep], want[keep], magnitude.expand_as(got)[keep])
                + unchanged_problems("q outside the rotated part", self.q, self.q_before, ~rotated))


def _written_row_problems(what, got_rows, ref_rows, before_rows, written, magnitude) -> List[str]:
    """Cache rows [N, 576]: the written ones against the float64 reference, the others unchanged."""
    return (rounding_problems(f"{what} written rows", got_rows[written], ref_rows[written], magnitude)
            + unchanged_problems(f"{what} unwritten rows", got_rows[~written], before_rows[~written]))


def run_write(case: WriteCase, device, seed: int) -> Outcome:
    dtype, (gen, cpu_gen) = DTYPES[case.dtype], generators(device, seed)
    can = Canaries(device, gen)
    rows, capacity = case.tokens + case.extra_rows, case.num_blocks * case.block_size
    cache = can.tensor((case.num_blocks, case.block_size, 576), dtype, pad=case.cache_pad)
    cache.copy_(randn(cache.shape, gen, device, 0.5))
    chosen = torch.randperm(capacity, generator=cpu_gen)[:case.tokens]
    odd = torch.randperm(case.tokens, generator=cpu_gen)
    chosen[odd[:case.padded_slots]] = -1
    chosen[odd[case.padded_slots:case.padded_slots + case.slots_past_cache]] = capacity + 3
    slots = can.tensor((case.tokens,), torch.int64)
    slots.copy_(chosen)
    positions = torch.randint(0, case.rope.max_position, (rows,), generator=gen, device=device)
    inputs = _WriteInputs(case, rows, dtype, device, gen, can, positions)
    before = cache.clone()
    if case.fused:
        call = lambda: mla_kv.fused_write_kv(*inputs.fused_args(), inputs.cos_sin, cache, slots,  # noqa: E731
                                             rope_style=case.rope.style, q=inputs.q, validate=case.validate,
                                             arch=case.arch)
    else:
        call = lambda: mla_kv.write_kv(inputs.kv_c, inputs.k_pe, cache, slots,  # noqa: E731
                                       validate=case.validate, arch=case.arch)
    _, failed = _call(call, case.expect_error, can)
    if failed:
        return failed
    got = cache.contiguous().view(-1, 576)
    if not case.fused:
        want = before.clone()
        reference.write_kv(inputs.kv_c, inputs.k_pe, want, slots)
        problems = unchanged_problems("write_kv cache", got, want.view(-1, 576))
    else:
        ref = before.double()
        q64 = inputs.reference_fused(ref, slots)
        ok = (slots >= 0) & (slots < capacity) & inputs.in_range()[:case.tokens]
        written = torch.zeros(capacity, dtype=torch.bool, device=got.device)
        written[slots[ok]] = True
        magnitude = torch.zeros(capacity, 1, dtype=torch.float64, device=got.device)
        magnitude[slots[ok]] = inputs.kv_a[:case.tokens][ok, 512:].abs().amax(-1, keepdim=True).double()
        problems = _written_row_problems("fused_write_kv cache", got, ref.view(-1, 576), before.view(-1, 576),
                                         written, magnitude[written])
        problems += inputs.q_problems(q64, case.tokens)
    return Outcome(problems, can.changed_bytes(cache, inputs.q))


def run_write_blocks(case: BlockWriteCase, device, seed: int) -> Outcome:
    dtype, (gen, cpu_gen) = DTYPES[case.dtype], generators(device, seed)
    can = Canaries(device, gen)
    bs, batch = case.block_size, len(case.q_lens)
    packed = sum(case.q_lens)
    rows = packed + case.extra_rows
    counts = [max(0, -(-(h + n) // bs) + e) for h, n, e in zip(case.history, case.q_lens, case.extra_blocks)]
    num_blocks = max(1, sum(counts) + case.spare_blocks)
    ids = torch.randperm(num_blocks, generator=cpu_gen)[:sum(counts)]
    cu_blocks = torch.tensor([0] + counts).cumsum(0).to(torch.int32)
    storage = can.tensor((num_blocks, case.layers, bs, 576), dtype, pad=(0, 0, case.layer_pad))
    storage.copy_(randn(storage.shape, gen, device, 0.5))
    pool = BlockPool(0, case.layers, bs, dtype, device, rope_first=case.rope_first)
    pool.storage = storage  # the pool's rows inside a canaried buffer
    cache = pool.cache(case.layer, ids, cu_blocks)
    cu_q = can.tensor((batch + 1,), torch.int32)
    cu_q.copy_(torch.tensor([0] + case.q_lens).cumsum(0))
    history = can.tensor((batch,), torch.int32)
    history.copy_(torch.tensor(case.history, dtype=torch.int32))
    seq = torch.repeat_interleave(torch.arange(batch), torch.tensor(case.q_lens, dtype=torch.long))
    cache_positions = torch.tensor(case.history, dtype=torch.long)[seq] + torch.arange(packed) - cu_q.cpu().long()[seq]
    positions = torch.randint(0, case.rope.max_position, (rows,), generator=gen, device=device)
    if case.positions_from_history:
        positions[:packed] = cache_positions.clamp_max(case.rope.max_position - 1).to(device)
    inputs = _WriteInputs(case, rows, dtype, device, gen, can, positions)
    readonly = None
    if case.readonly is not None:
        readonly = can.tensor((batch,), torch.int32)
        readonly.copy_(torch.tensor(case.readonly, dtype=torch.int32))
    targets = dict(readonly_lens=readonly, cp_size=case.cp[0], cp_rank=case.cp[1], validate=case.validate,
                   arch=case.arch)
    before = storage.clone()
    if case.fused:
        call = lambda: mla_kv.fused_write_kv_blocks(*inputs.fused_args(), inputs.cos_sin, cache, cu_q,  # noqa: E731
                                                    history, rope_style=case.rope.style, q=inputs.q, **targets)
    else:
        call = lambda: mla_kv.write_kv_blocks(inputs.kv_c, inputs.k_pe, cache, cu_q, history,  # noqa: E731
                                              **targets)
    _, failed = _call(call, case.expect_error, can)
    if failed:
        return failed
    slots = block_slots(cu_q, history, cu_blocks, ids, bs, readonly_lens=readonly, cp_size=case.cp[0],
                        cp_rank=case.cp[1]).to(device)
    to_pool_order = to_rope_first if case.rope_first else torch.clone
    to_reference_order = to_latent_first if case.rope_first else torch.clone
    layer_before = before[:, case.layer]
    others = torch.arange(case.layers, device=device) != case.layer
    problems = unchanged_problems("other layers", storage[:, others], before[:, others])
    got = storage[:, case.layer].contiguous().view(-1, 576)
    if not case.fused:
        want = to_reference_order(layer_before)
        reference.write_kv(inputs.kv_c, inputs.k_pe, want, slots)
        problems += unchanged_problems("write_kv_blocks layer", got, to_pool_order(want).reshape(-1, 576))
    else:
        ref = to_reference_order(layer_before.double())
        # Every input row is a token of the kernel: q is rotated past cu_q_lens[B] too (no cache row).
        padded = torch.full((rows - packed,), -1, dtype=torch.int64, device=device)
        q64 = inputs.reference_fused(ref, torch.cat([slots, padded]))
        ok = (slots >= 0) & inputs.in_range()[:packed]
        written = torch.zeros(got.shape[0], dtype=torch.bool, device=device)
        written[slots[ok]] = True
        magnitude = torch.zeros(got.shape[0], 1, dtype=torch.float64, device=device)
        magnitude[slots[ok]] = inputs.kv_a[:packed][ok, 512:].abs().amax(-1, keepdim=True).double()
        problems += _written_row_problems("fused_write_kv_blocks layer", got, to_pool_order(ref).reshape(-1, 576),
                                          layer_before.reshape(-1, 576), written, magnitude[written])
        problems += inputs.q_problems(q64, rows)
    return Outcome(problems, can.changed_bytes(storage, inputs.q))


@dataclass
class CpCase:
    """cp_decode / cp_prefill of all cp ranks in one process: rank r's cache holds the positions
    p % cp == r of every sequence (local position p // cp); merge_partial_states of the ranks' states
    against the reference over one cache with every position."""

    prefill: bool = False
    arch: Optional[str] = None
    dtype: str = "float16"
    cp: int = 2
    kv_lens: List[int] = field(default_factory=lambda: [70, 5])
    q_lens: List[int] = field(default_factory=lambda: [3, 3])  # decode: all equal (S_q)
    heads: int = 4
    block_size: int = 16
    causal: bool = True
    scale: float = 0.0625


def _paged_rows(can: Canaries, sequences: List[torch.Tensor], block_size: int, cpu_gen):
    """A paged cache (shuffled blocks, NaN elsewhere) holding each sequence's rows -> (cache, table)."""
    need = [-(-len(rows) // block_size) for rows in sequences]
    num_blocks = sum(need) + 1
    perm = torch.randperm(num_blocks, generator=cpu_gen).to(torch.int32)
    cache = can.tensor((num_blocks, block_size, 576), sequences[0].dtype)
    cache.fill_(float("nan"))
    table = torch.full((len(sequences), max(need) + 1), num_blocks + 7, dtype=torch.int32)
    taken = 0
    for b, rows in enumerate(sequences):
        table[b, :need[b]] = perm[taken:taken + need[b]]
        taken += need[b]
        pos = torch.arange(len(rows))
        cache[table[b, pos // block_size].long(), pos % block_size] = rows
    return cache, table.to(cache.device)


def run_cp(case: CpCase, device, seed: int) -> Outcome:
    dtype, (gen, cpu_gen) = DTYPES[case.dtype], generators(device, seed)
    can = Canaries(device, gen)
    sequences = [randn((n, 576), gen, device, 0.5).to(dtype) for n in case.kv_lens]
    whole = _paged_rows(can, sequences, case.block_size, cpu_gen)
    ranks = [_paged_rows(can, [rows[r::case.cp] for rows in sequences], case.block_size, cpu_gen)
             for r in range(case.cp)]
    kv_lens = torch.tensor(case.kv_lens, dtype=torch.int32, device=device)
    cu_q = torch.tensor([0] + case.q_lens, device=device).cumsum(0).to(torch.int32)
    if case.prefill:
        q = randn((sum(case.q_lens), case.heads, 576), gen, device).to(dtype)
        def partial(r):  # noqa: E306
            return parallel.cp_prefill(q, *ranks[r], cu_q, kv_lens, case.scale, case.cp, r, causal=case.causal,
                                       arch=case.arch)
        ref = reference.prefill(q.double(), *whole, cu_q, kv_lens, case.scale, causal=case.causal)
    else:
        q = randn((len(case.kv_lens), case.q_lens[0], case.heads, 576), gen, device).to(dtype)
        def partial(r):  # noqa: E306
            return parallel.cp_decode(q, *ranks[r], kv_lens, case.scale, case.cp, r, arch=case.arch)
        ref = reference.decode(q.double(), *whole, kv_lens, case.scale)
    states, failed = _call(lambda: [partial(r) for r in range(case.cp)], None, can)
    if failed:
        return failed
    out, lse = parallel.merge_partial_states(torch.stack([o for o, _ in states]), torch.stack([l for _, l in states]))
    what = "cp_prefill" if case.prefill else "cp_decode"
    return Outcome(attention_problems(what, out, lse, *ref), can.changed_bytes())


@dataclass
class QuantCase:
    """fused_write_kv into a quantized paged cache, then gather_kv of it: the written bytes equal the
    spec's quantizer (mla_kv.reference.quant) of the rows the 16-bit fused write gives, the gathered
    rows equal the reference gather of the cache, bit for bit; then decode over a quantized cache
    equals the reference attention over its dequantized rows."""

    kv_format: str = "int8"
    arch: Optional[str] = None
    dtype: str = "float16"
    tokens: int = 40
    block_size: int = 16
    num_blocks: int = 4
    padded_slots: int = 3
    splits: int = 0  # > 0: the decode's kv positions in that many splits (else the op's own schedule)


def run_quant(case: QuantCase, device, seed: int) -> Outcome:
    from mla_kv import layout
    from mla_kv.reference import quant
    dtype, (gen, cpu_gen) = DTYPES[case.dtype], generators(device, seed)
    can = Canaries(device, gen)
    fmt, bs, t = case.kv_format, case.block_size, case.tokens
    scale = 0.5 if fmt == "fp8" else None
    cache = can.tensor(layout.paged_cache_shape(fmt, case.num_blocks, bs, dtype), torch.uint8)
    kv_a = can.tensor((t, 576), dtype, pad=(0, 64))
    kv_a.copy_(randn(kv_a.shape, gen, device))
    weight = can.tensor((512,), dtype)
    weight.copy_(torch.rand(512, generator=gen, device=device) + 0.5)
    positions = torch.randint(0, 1024, (t,), generator=gen, device=device)
    cos_sin = cos_sin_cache(64, 1024, 1e4, device=device)
    slots = torch.randperm(case.num_blocks * bs, generator=cpu_gen)[:t]
    slots[:case.padded_slots] = -1
    slots = slots.to(device)
    before = cache.clone()
    _, failed = _call(lambda: mla_kv.fused_write_kv(kv_a, weight, 1e-6, positions, cos_sin, cache, slots,
                                                    kv_format=fmt, kv_scale=scale, arch=case.arch), None, can)
    if failed:
        return failed
    rows16 = torch.empty(1, t, 576, dtype=dtype, device=device)
    mla_kv.fused_write_kv(kv_a, weight, 1e-6, positions, cos_sin, rows16, torch.arange(t, device=device),
                          arch=case.arch)
    want = before.clone()
    quant.write_rows(want, rows16[0], slots, fmt, kv_scale=scale)
    problems = unchanged_problems(f"fused_write_kv[{fmt}] cache", cache, want)
    changed = can.changed_bytes(cache)
    table = can.tensor((1, case.num_blocks), torch.int32)
    table.copy_(torch.randperm(case.num_blocks, generator=cpu_gen).view(1, -1).to(torch.int32))
    cu = can.tensor((2,), torch.int32)
    cu.copy_(torch.tensor([0, case.num_blocks * bs - 5], dtype=torch.int32))
    out = can.tensor((case.num_blocks * bs - 3, 576), dtype)
    _, failed = _call(lambda: mla_kv.gather_kv(cache, table, cu, out=out, kv_format=fmt, kv_scale=scale,
                                               arch=case.arch), None, can)
    if failed:
        return failed
    total = int(cu[-1])
    spec = reference.gather_kv(cache.cpu(), table.cpu(), cu.cpu(), kv_format=fmt, kv_scale=scale, dtype=dtype)
    # Bit for bit but for NaN's payload: the unwritten slots hold random bytes, e4m3's NaN code among them.
    got = out[:total].cpu()
    differ = int((bits(got) != bits(spec)).logical_and(~(got.isnan() & spec.isnan())).sum())
    problems += [f"gather_kv[{fmt}] rows: {differ} elements differ from the reference"] if differ else []
    changed += can.changed_bytes(out[:total])
    # decode over a cache of valid rows (the one above keeps random bytes, NaN codes among them, in
    # its unwritten slots): two sequences over the shuffled table, against the float64 reference.
    rows = can.tensor(layout.paged_cache_shape(fmt, case.num_blocks, bs, dtype), torch.uint8)
    quant.write_rows(rows, randn((case.num_blocks * bs, 576), gen, device).to(dtype),
                     torch.arange(case.num_blocks * bs, device=device), fmt, kv_scale=scale)
    tables = can.tensor((2, case.num_blocks), torch.int32)
    tables.copy_(table.expand(2, -1))
    lens = can.tensor((2,), torch.int32)
    lens.copy_(torch.tensor([3, case.num_blocks * bs - 1], dtype=torch.int32))
    q = can.tensor((2, 2, 8, 576), dtype)
    q.copy_(randn(q.shape, gen, device, 0.3))
    att_out, att_lse = can.tensor((2, 2, 8, 512), dtype), can.tensor((2, 2, 8), torch.float32)
    schedule = None if case.splits == 0 else gpu_checks.split_schedule(
        case.splits, -(-case.num_blocks * bs // case.splits), q.shape[0] * q.shape[1], q.shape[2])
    _, failed = _call(lambda: mla_kv.decode(q, rows, tables, lens, 0.07, out=att_out, lse=att_lse, kv_format=fmt,
                                            kv_scale=scale, arch=case.arch, schedule=schedule), None, can)
    if failed:
        return failed
    ref_out, ref_lse = reference.decode(q.double().cpu(), rows.cpu(), tables.cpu(), lens.cpu(), 0.07, kv_format=fmt,
                                        kv_scale=scale, scale_dtype=dtype)
    err = float((att_out.double().cpu() - ref_out).abs().max())
    lse_err = float((att_lse.double().cpu() - ref_lse).abs().max())
    if not (err < 2e-2 and lse_err < 2e-2):
        problems.append(f"decode[{fmt}]: out error {err:.3g}, lse error {lse_err:.3g} against the reference")
    return Outcome(problems, changed + can.changed_bytes(att_out, att_lse))


@dataclass
class ExpandedCase:
    """mla_kv.expanded_attention over per-head K / V: rows past cu_q_lens[B] must stay untouched."""
    arch: Optional[str] = None
    dims: Tuple[int, int] = (256, 256)  # (d_qk, d_v)
    q_lens: List[int] = field(default_factory=lambda: [5, 1])
    k_lens: List[int] = field(default_factory=lambda: [5, 70])
    pad_rows: int = 0
    causal: bool = True
    heads: int = 3
    pads: Tuple[int, int, int, int] = (0, 0, 0, 0)  # elements after each head row of q, k, v, out (x 8)
    gpu: Optional[str] = None


def run_expanded(case: ExpandedCase, device, seed: int) -> Outcome:
    (d_qk, d_v), (gen, _) = case.dims, generators(device, seed)
    can = Canaries(device, gen)
    heads, batch = case.heads, len(case.q_lens)
    packed, keys = sum(case.q_lens), sum(case.k_lens)
    tokens = packed + case.pad_rows
    q = can.tensor((tokens, heads, d_qk), torch.float16, pad=(0, 0, case.pads[0]))
    k = can.tensor((keys, heads, d_qk), torch.float16, pad=(0, 0, case.pads[1]))
    v = can.tensor((keys, heads, d_v), torch.float16, pad=(0, 0, case.pads[2]))
    # Scores of std 2.5 at the 1/sqrt(d_qk) scale (q std 2.5 d^1/4, k std d^-1/4); the pads keep their
    # random bytes (NaN among them), which the kernel must never read.
    q.copy_(randn(q.shape, gen, device, 2.5 * d_qk ** 0.25))
    k.copy_(randn(k.shape, gen, device, d_qk ** -0.25))
    v.copy_(randn(v.shape, gen, device))
    cu_q, cu_k = can.tensor((batch + 1,), torch.int32), can.tensor((batch + 1,), torch.int32)
    cu_q.copy_(torch.tensor([0] + case.q_lens).cumsum(0))
    cu_k.copy_(torch.tensor([0] + case.k_lens).cumsum(0))
    out = can.tensor((tokens, heads, d_v), torch.float16, pad=(0, 0, case.pads[3]))
    lse = can.tensor((tokens, heads), torch.float32)
    scale = d_qk ** -0.5
    result, failed = _call(lambda: mla_kv.expanded_attention(q, k, v, cu_q, cu_k, scale, causal=case.causal,
                                                             max_q_len=max(max(case.q_lens), 1), out=out, lse=lse,
                                                             arch=case.arch, smem_limits=case.gpu), None, can)
    if failed:
        return failed
    ref_out, ref_lse = mla_kv.reference.expanded_attention(q.double(), k.double(), v.double(), cu_q, cu_k, scale,
                                                           causal=case.causal)
    problems = attention_problems("expanded_attention", out[:packed], lse[:packed], ref_out[:packed],
                                  ref_lse[:packed], cu_q_lens=cu_q)
    return Outcome(problems, can.changed_bytes(out[:packed], lse[:packed]))


@dataclass
class SparseCase:
    """sparse_attention over a paged cache (kv_format: a quantized one, written by the reference's quantizer):
    each token's indices are random slots of the cache with -1 entries, slots past the cache and negative
    ones; out / lse / indices / the workspace inside canaries."""

    arch: Optional[str] = None
    dtype: str = "float16"
    tokens: int = 3
    heads: int = 20
    topk: int = 130
    block_size: int = 64
    num_blocks: int = 5
    kv_format: Optional[str] = None
    splits: bool = False  # the op's schedule with a given workspace (it splits few tokens' rows)


def run_sparse(case: SparseCase, device, seed: int) -> Outcome:
    from mla_kv import layout
    from mla_kv.reference import quant
    dtype, (gen, cpu_gen) = DTYPES[case.dtype], generators(device, seed)
    can = Canaries(device, gen)
    slots = case.num_blocks * case.block_size
    rows = randn((slots, 576), gen, device, 0.5).to(dtype)
    if case.kv_format is None:
        kv_cache = can.tensor((case.num_blocks, case.block_size, 576), dtype)
        kv_cache.copy_(rows.view(kv_cache.shape))
    else:
        kv_cache = can.tensor(layout.paged_cache_shape(case.kv_format, case.num_blocks, case.block_size, dtype),
                              torch.uint8)
        kv_cache.zero_()
        quant.write_rows(kv_cache, rows, torch.arange(slots, device=device), case.kv_format,
                         kv_scale=0.02 if case.kv_format == "fp8" else None)
    idx = torch.randint(0, slots, (case.tokens, case.topk), generator=cpu_gen, dtype=torch.int32)
    odd = torch.rand(idx.shape, generator=cpu_gen)
    idx[odd < 0.1] = -1
    idx[(odd >= 0.1) & (odd < 0.15)] = slots + 5
    idx[(odd >= 0.15) & (odd < 0.18)] = -3
    indices = can.tensor(idx.shape, torch.int32, pad=(1, 3))
    indices.copy_(idx)
    q = can.tensor((case.tokens, case.heads, 576), dtype)
    q.copy_(randn(q.shape, gen, device))
    out = can.tensor((case.tokens, case.heads, 512), dtype, pad=(1, 0, 8))
    lse = can.tensor((case.tokens, case.heads), torch.float32, pad=(0, 1))
    schedule = workspace = None
    if case.splits and torch.device(device).type == "cuda":
        schedule = mla_kv.sparse_attention_schedule(case.tokens, case.heads, case.topk, device=device, arch=case.arch)
        workspace = can.tensor((schedule.workspace_bytes,), torch.uint8)
    fmt = dict(kv_format=case.kv_format, kv_scale=0.02 if case.kv_format == "fp8" else None)
    result, failed = _call(lambda: mla_kv.sparse_attention(q, kv_cache, indices, 0.0625, out=out, lse=lse,
                                                           workspace=workspace, schedule=schedule, arch=case.arch,
                                                           **fmt), None, can)
    if failed:
        return failed
    ref = mla_kv.reference.sparse_attention(q.double(), kv_cache if case.kv_format else kv_cache.double(), indices,
                                            0.0625, scale_dtype=dtype, **fmt)
    tol = {} if case.kv_format is None else dict(out_tol=4e-2, lse_tol=6e-2)
    problems = attention_problems("sparse_attention", *result, *ref, **tol)
    return Outcome(problems, can.changed_bytes(out, lse, workspace))


@dataclass
class IndexScoresCase:
    """index_scores over a paged index-key cache of random codes and scales: packed tokens of sequences with
    cached prefixes (q_lens), a page id outside the cache in one table, out inside canaries with the columns
    past max_kv_len and a padded token row in the canary region."""

    arch: Optional[str] = None
    q_kind: str = "float16"  # float16, bfloat16 or e4m3
    heads: int = 32
    kv_lens: Tuple[int, ...] = (130, 7, 300)
    q_lens: Tuple[int, ...] = (2, 7, 1)
    page_size: int = 64


def run_index_scores(case: IndexScoresCase, device, seed: int) -> Outcome:
    from mla_kv import layout
    gen, cpu_gen = generators(device, seed)
    can = Canaries(device, gen)
    need = [-(-n // case.page_size) for n in case.kv_lens]
    pages = sum(need) + 2
    cache = can.tensor(layout.index_cache_shape(pages, case.page_size), torch.uint8)
    codes = torch.randint(0, 256, cache.shape, generator=gen, device=device, dtype=torch.uint8)
    cache.copy_(torch.where((codes & 0x7F) == 0x7F, codes ^ 1, codes))
    scales = torch.rand(pages, case.page_size, generator=gen, device=device) * 0.1 + 0.01
    cache.view(pages, -1)[:, case.page_size * layout.INDEX_DIM:] = scales.view(torch.uint8)
    max_kv_len = max(case.kv_lens) + 3
    width = -(-max_kv_len // case.page_size)
    perm = torch.randperm(pages, generator=cpu_gen).int()
    table = torch.full((len(need), width), pages + 3, dtype=torch.int32)  # past a sequence's pages: outside
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used:used + n]
        used += n
    table[0, need[0] - 1] = -2  # a page of sequence 0 is missing: zero keys
    block_table = can.tensor(table.shape, torch.int32, pad=(0, 1))
    block_table.copy_(table)
    tokens = sum(case.q_lens)
    if case.q_kind == "e4m3":
        q = can.tensor((tokens + 1, case.heads, layout.INDEX_DIM), torch.uint8)[:tokens]
        q.copy_(torch.randint(0, 126, q.shape, generator=gen, device=device, dtype=torch.uint8))
        q_scale = can.tensor((tokens, case.heads), torch.float32)
        q_scale.copy_(torch.rand(q_scale.shape, generator=gen, device=device) * 0.05)
    else:
        q = can.tensor((tokens + 1, case.heads, layout.INDEX_DIM), DTYPES[case.q_kind])[:tokens]
        q.copy_(randn(q.shape, gen, device))
        q_scale = None
    weights = can.tensor((tokens, case.heads), torch.float32)
    weights.copy_(randn(weights.shape, gen, device))
    kv_lens = can.tensor((len(need),), torch.int32)
    kv_lens.copy_(torch.tensor(case.kv_lens, dtype=torch.int32))
    cu = can.tensor((len(need) + 1,), torch.int32)
    cu.copy_(torch.tensor([0, *case.q_lens]).cumsum(0).int())
    out = can.tensor((tokens, max_kv_len), torch.float32, pad=(1, 5))
    result, failed = _call(lambda: mla_kv.index_scores(q, weights, cache, block_table, kv_lens, max_kv_len,
                                                       cu_q_lens=cu, max_q_len=max(case.q_lens), q_scale=q_scale,
                                                       out=out, arch=case.arch), None, can)
    if failed:
        return failed
    want = mla_kv.reference.index_scores(q.cpu(), weights.cpu(), cache.cpu(), block_table.cpu(), kv_lens.cpu(),
                                         max_kv_len, cu_q_lens=cu.cpu(),
                                         q_scale=None if q_scale is None else q_scale.cpu()).double()
    got = result.double().cpu()
    problems = []
    if not torch.equal(torch.isneginf(got), torch.isneginf(want)) or torch.isnan(got).any():
        problems.append("index_scores: -inf / NaN pattern differs from the reference")
    else:
        err = torch.where(torch.isinf(want), 0.0, (got - want).abs())
        scale = want.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0).max().clamp_min(1e-30)
        if float(err.max()) > 1e-4 * float(scale):
            problems.append(f"index_scores: max error {float(err.max()):.3e} of logits up to {float(scale):.3e}")
    return Outcome(problems, can.changed_bytes(out))


@dataclass
class IndexKeysCase:
    """write_index_keys into a paged index cache of random bytes (slots padded, past the cache, positions out of
    the rope table) or, blocks=True, write_index_keys_blocks into the index pages of a random pool (sequences
    q_lens over history, readonly_lens, a context-parallel rank): the bytes against the reference's
    (index_cache_problems), q in place within one step of its dtype; k, q and the cache inside canaries."""

    arch: Optional[str] = None
    dtype: str = "float16"
    tokens: int = 40
    page_size: int = 16
    num_blocks: int = 5
    heads: int = 4
    rope_style: str = "neox"
    scale_fmt: Optional[str] = None
    blocks: bool = False
    history: Tuple[int, ...] = (20, 1, 5)
    readonly: Optional[Tuple[int, ...]] = None
    cp: Tuple[int, int] = (1, 0)


INDEX_MAX_POSITION = 1024


def e4m3_step(values: torch.Tensor) -> torch.Tensor:
    """One e4m3 step at each float64 value: 2^(floor(log2 |v|) - 3), 2^-9 below 2^-6."""
    _, exponent = torch.frexp(values.abs())
    return torch.where(values.abs() < 2.0 ** -6, 2.0 ** -9, torch.ldexp(torch.ones_like(values), exponent - 4))


def index_cache_problems(what, got: torch.Tensor, want: torch.Tensor, code_mask: torch.Tensor) -> List[str]:
    """An index cache's bytes (flat uint8) against the reference's: every byte outside the written codes
    (code_mask) equal, scales and untouched bytes alike; the codes within one e4m3 step of the reference's
    (a value on a rounding boundary may land on either side), >= 99.9% of them exact."""
    from quant_bytes import e4m3
    got, want, code_mask = got.cpu(), want.cpu(), code_mask.cpu()
    problems = []
    differ = int((got[~code_mask] != want[~code_mask]).sum())
    if differ:
        problems.append(f"{what}: {differ} bytes outside the codes (scales, untouched bytes) differ")
    if bool(code_mask.any()):
        g, w = e4m3(got[code_mask]), e4m3(want[code_mask])
        far = int(((g - w).abs() > e4m3_step(w)).logical_or(g.isnan() != w.isnan()).sum())
        exact = float((got[code_mask] == want[code_mask]).double().mean())
        if far or exact < 0.999:
            problems.append(f"{what}: {far} codes beyond one e4m3 step of the reference's, {exact:.4%} exact")
    return problems


def index_code_mask(nbytes: int, rows: List[Tuple[int, int]]) -> torch.Tensor:
    """The flat byte mask of the 128 code bytes of each written row, given as (page's first byte, offset)."""
    mask = torch.zeros(nbytes, dtype=torch.bool)
    for page, offset in rows:
        mask[page + offset * 128:page + offset * 128 + 128] = True
    return mask


def run_index_keys(case: IndexKeysCase, device, seed: int) -> Outcome:
    from mla_kv import layout
    dtype, (gen, cpu_gen) = DTYPES[case.dtype], generators(device, seed)
    can = Canaries(device, gen)
    t, ps = case.tokens, case.page_size
    k = can.tensor((t, 128), dtype, pad=(0, 32))
    k.copy_(randn(k.shape, gen, device, 2.0))
    weight, bias = can.tensor((128,), torch.float32), can.tensor((128,), torch.float32)
    weight.copy_(torch.rand(128, generator=gen, device=device) + 0.5)
    bias.copy_(randn((128,), gen, device, 0.1))
    positions = can.tensor((t,), torch.int64)
    positions.copy_(torch.randint(0, INDEX_MAX_POSITION, (t,), generator=gen, device=device))
    positions[:2] = INDEX_MAX_POSITION  # out of the table: the token is left alone
    cos_sin = cos_sin_cache(64, INDEX_MAX_POSITION, 1e4, device=device)
    q = can.tensor((t, case.heads, 128), dtype, pad=(0, 1, 8))
    q.copy_(randn(q.shape, gen, device))
    pos_ok = ((positions >= 0) & (positions < INDEX_MAX_POSITION)).cpu()
    style = dict(rope_style=case.rope_style, scale_fmt=case.scale_fmt)
    host = [k.cpu(), weight.cpu(), bias.cpu(), 1e-6, positions.cpu(), cos_sin.cpu()]
    q_want = q.cpu()
    if not case.blocks:
        storage = can.tensor((case.num_blocks * ps * layout.INDEX_ROW_BYTES,), torch.uint8)
        cache = storage.view(case.num_blocks, ps, layout.INDEX_ROW_BYTES)
        slots = torch.randperm(case.num_blocks * ps, generator=cpu_gen)[:t]
        slots[2:5] = -1
        slots[5] = case.num_blocks * ps
        slots = slots.to(device)
        want = storage.cpu()
        reference.write_index_keys(*host, want.view(cache.shape), slots.cpu(), q=q_want, **style)
        _, failed = _call(lambda: mla_kv.write_index_keys(k, weight, bias, 1e-6, positions, cos_sin, cache, slots, q=q,
                                                          arch=case.arch, **style), None, can)
        if failed:
            return failed
        rows = [((s // ps) * ps * layout.INDEX_ROW_BYTES, s % ps) for s, ok in zip(slots.tolist(), pos_ok.tolist())
                if ok and 0 <= s < case.num_blocks * ps]
        got = storage
    else:
        history = list(case.history)
        q_lens = [t // 3, 0, t - t // 3 - 2]  # two rows past cu_q_lens[B]
        counts = [-(-(h + n) // ps) + 1 for h, n in zip(history, q_lens)]
        bpb = ps * layout.INDEX_ROW_BYTES + 272  # this layer's page at byte 144 of each block
        bpb += -bpb % 16
        pool = can.tensor((sum(counts) + 2, bpb), torch.uint8)
        ids = torch.randperm(pool.shape[0], generator=cpu_gen)[:sum(counts)]
        cu_b = torch.tensor([0] + counts).cumsum(0).int()
        cu_q = torch.tensor([0] + q_lens).cumsum(0).int()
        hist = torch.tensor(history).int()
        readonly = None if case.readonly is None else torch.tensor(case.readonly).int()
        want = pool.cpu()
        ref_cache = layout.IndexBlockPointerCache(want.data_ptr() + ids * bpb, cu_b, ps, 144)
        reference.write_index_keys_blocks(*host, ref_cache, cu_q, hist, readonly_lens=readonly, cp_size=case.cp[0],
                                          cp_rank=case.cp[1], q=q_want, **style)
        cache = layout.IndexBlockPointerCache((pool.data_ptr() + ids * bpb).to(device), cu_b.to(device), ps, 144)
        args = [x.to(device) for x in (cu_q, hist)]
        ro = None if readonly is None else readonly.to(device)
        _, failed = _call(lambda: mla_kv.write_index_keys_blocks(
            k, weight, bias, 1e-6, positions, cos_sin, cache, *args, readonly_lens=ro, cp_size=case.cp[0],
            cp_rank=case.cp[1], q=q, arch=case.arch, **style), None, can)
        if failed:
            return failed
        slots = block_slots(cu_q, hist, cu_b, ids, ps, readonly_lens=readonly, cp_size=case.cp[0], cp_rank=case.cp[1])
        rows = [((s // ps) * bpb + 144, s % ps) for s, ok in zip(slots.tolist(), pos_ok.tolist()) if ok and s >= 0]
        got = pool.flatten()
        want = want.flatten()
    problems = index_cache_problems("index cache", got, want, index_code_mask(want.numel(), rows))
    step = spacing(q_want.double(), dtype)
    q_far = int(((q.cpu().double() - q_want.double()).abs() > step).sum())
    q_exact = float((q.cpu() == q_want).double().mean())
    if q_far or q_exact < 0.999:
        problems.append(f"q: {q_far} values beyond one step of the reference's, {q_exact:.4%} exact")
    return Outcome(problems, can.changed_bytes(got, q))


@dataclass
class IndexTopkCase:
    """index_topk: decode rows (q_lens None) or packed tokens of sequences plus one row past the last, the
    columns past each token's position left as canary bytes (anything may be there); optionally slots
    through a shuffled block table whose unused columns hold -1, and logits of five values (ties). out
    inside canaries; the workspace starts zeroed and must be left so (it is not among the written)."""

    arch: Optional[str] = None
    kv_lens: Tuple[int, ...] = (5000, 70, 2100)
    q_lens: Optional[Tuple[int, ...]] = None
    k: int = 2048
    page_size: Optional[int] = None
    ties: bool = False


def run_index_topk(case: IndexTopkCase, device, seed: int) -> Outcome:
    gen, cpu_gen = generators(device, seed)
    can = Canaries(device, gen)
    batch, max_kv_len = len(case.kv_lens), max(case.kv_lens) + 3
    q_lens = case.q_lens or (1,) * batch
    tokens = batch if case.q_lens is None else sum(q_lens) + 1
    logits = can.tensor((tokens, max_kv_len), torch.float32, pad=(1, 5))
    values = (torch.randint(-2, 3, (tokens, max_kv_len), generator=cpu_gen).float() if case.ties
              else torch.randn(tokens, max_kv_len, generator=cpu_gen)).to(device)
    row = 0
    for n, q in zip(case.kv_lens, q_lens):
        for i in range(q):
            visible = max(0, n - q + i + 1)
            logits[row, :visible] = values[row, :visible]
            row += 1
    kv_lens = can.tensor((batch,), torch.int32)
    kv_lens.copy_(torch.tensor(case.kv_lens, dtype=torch.int32))
    cu = None
    if case.q_lens is not None:
        cu = can.tensor((batch + 1,), torch.int32)
        cu.copy_(torch.tensor([0, *q_lens]).cumsum(0).int())
    table = None
    if case.page_size is not None:
        need = [-(-n // case.page_size) for n in case.kv_lens]
        ids = torch.randperm(sum(need) + 4, generator=cpu_gen).int()
        table = can.tensor((batch, max(need) + 1), torch.int32, pad=(0, 2))
        rows = torch.full(table.shape, -1, dtype=torch.int32)
        for b, used in enumerate(need):
            rows[b, :used] = ids[sum(need[:b]):sum(need[:b]) + used]
        table.copy_(rows)
    out = can.tensor((tokens, case.k), torch.int32, pad=(1, 3))
    workspace = None
    if torch.device(device).type == "cuda":
        workspace = can.tensor((mla_kv.index_topk_workspace_size(tokens, max_kv_len, case.k),), torch.uint8)
        workspace.zero_()
    result, failed = _call(lambda: mla_kv.index_topk(logits, kv_lens, case.k, cu_q_lens=cu, block_table=table,
                                                     page_size=case.page_size, out=out, workspace=workspace,
                                                     arch=case.arch), None, can)
    if failed:
        return failed
    want = mla_kv.reference.index_topk(logits.cpu(), kv_lens.cpu(), case.k, cu_q_lens=None if cu is None else cu.cpu(),
                                       block_table=None if table is None else table.cpu(), page_size=case.page_size)
    got = result.cpu().long().sort(dim=1).values
    problems = [] if torch.equal(got, want.long().sort(dim=1).values) else ["index_topk: selected sets differ"]
    return Outcome(problems, can.changed_bytes(out))


RUNNERS = {DecodeCase: run_decode, PrefillCase: run_prefill, MergeCase: run_merge, GatherCase: run_gather,
           WriteCase: run_write, BlockWriteCase: run_write_blocks, CpCase: run_cp, QuantCase: run_quant,
           ExpandedCase: run_expanded, SparseCase: run_sparse, IndexScoresCase: run_index_scores,
           IndexKeysCase: run_index_keys, IndexTopkCase: run_index_topk}


def run(case, device, seed: int) -> Outcome:
    """Runs one case on ``device`` with data from ``seed``."""
    return RUNNERS[type(case)](case, device, seed)
