"""decode / prefill over quantized latent caches (kv_format "fp8", "fp8_ds_mla", "int8", "int4").

The caches are built byte by byte from the layouts (tests/quant_bytes.py), not with the library's
writer, and read back by that file's own reader (not the library's dequantizer). Rows no sequence
sees (the tail of a last block, spare blocks, the other layer behind block pointers) hold bytes
that decode to NaN in every format (0xFF: e4m3 NaN codes, NaN tile scales and rope, NaN int8 / int4
(scale, zero) pairs), so a kernel that lets one reach its output shows NaN; a few seen rows hold
edge content (every e4m3 code, subnormals only, +-0, the largest codes; int8 / int4 codes all 0, all
at the top, alternating, a scale of 0). q is scaled from the cache's rows so that the scores spread
by about SCORE_STD: the softmax is neither uniform nor one-hot.

Two comparisons of every launch (fresh NaN out / lse, a 0xFF workspace where the KV is split):

- with the float64 reference over the reader's values rounded once to q's dtype (what the kernels
  feed their MMAs: they dequantize each value in fp32 and round it once to q's dtype), at the
  16-bit kernel tests' tolerances (check_attention's defaults);
- with the spec, mla_kv.reference.decode / prefill(kv_format=..., scale_dtype=q.dtype) over the same
  bytes, whose values are not rounded to q's dtype. Only fp8's (e4m3 x 0.5) are representable in
  it: an int8 / int4 code times a 16-bit scale plus a 16-bit zero, or an e4m3 code times an fp32
  tile scale, has more significant bits than q's dtype. Rounding the keys and values moves out and
  lse by more than the 16-bit tolerances in bf16 (up to 1.6e-2 in out and 3.2e-2 in lse on these
  caches; fp16: 2e-3 and 3.5e-3), so this comparison takes the wider SPEC_OUT_TOL / SPEC_LSE_TOL
  (the 16-bit tolerances plus about twice that gap). test_cpu_spec_tolerances_cover_the_rounding
  checks, on the very caches and queries of the GPU tests, that the rounded-rows reference lies
  within these minus the 16-bit tolerances of the spec: a kernel passing the first comparison
  passes the second.

The cache bytes (and the block pool) are the same after the launches. CPU tests cover the argument
checks and the CPU path (the reference).
"""
import dataclasses
import functools
import math
import zlib
from dataclasses import dataclass

import pytest
import torch

import mla_kv
from mla_kv import layout, reference
from mla_kv.reference import quant

from gpu_checks import (ATTENTION_ARCHS, LSE_TOL, OUT_TOL, capture_graph, check_attention, nan_outputs,
                        poisoned_workspace, same_bytes, split_schedule)
from quant_bytes import KV_SCALE, decode_rows, paged_bytes, random_rows

GPU = pytest.mark.gpu
pytestmark = ATTENTION_ARCHS  # best, sm80, sm75, sm70; bf16 skips sm75 / sm70

FORMATS = ["fp8", "fp8_ds_mla", "int8", "int4"]
DTYPES = [torch.float16, torch.bfloat16]
SOFTMAX_SCALE = 1.0 / math.sqrt(192)
SCORE_STD = 2.5  # the spread of a query's scores over the keys (see query_std)
# The spec comparison's tolerances: the 16-bit ones plus what rounding the dequantized keys and values
# to q's dtype moves out / lse on these caches (see the module docstring).
SPEC_OUT_TOL = {torch.float16: 8e-3, torch.bfloat16: 4e-2}
SPEC_LSE_TOL = {torch.float16: 1e-2, torch.bfloat16: 6e-2}
FLT_MIN = torch.finfo(torch.float32).tiny
NON_NAN_E4M3 = [c for c in range(256) if c & 0x7F != 0x7F]
SUBNORMAL_E4M3 = list(range(8)) + list(range(0x80, 0x88))


def kv_scale_of(kv_format):
    return KV_SCALE if kv_format == "fp8" else None


def dtype_name(dtype):
    return str(dtype).split(".")[1]


# ----------------------------------------------------------------------------------- caches
def tile(codes, n):
    t = torch.tensor(codes, dtype=torch.uint8)
    return t.repeat(-(-n // t.numel()))[:n]


def edge_rows(kv_format, dtype, rows):
    """Stored rows (and int8 / int4 pairs) of edge content, in the layouts of random_rows."""
    if kv_format == "fp8":
        # every finite code (subnormals, +-0, +-448 included), subnormals only, +-0 only
        return torch.stack([tile(NON_NAN_E4M3, 576), tile(SUBNORMAL_E4M3, 576), tile([0x00, 0x80], 576)]), None
    if kv_format == "fp8_ds_mla":
        out = rows[:3].clone()  # keeps random bf16 rope
        out[0, :512] = tile(NON_NAN_E4M3, 512)
        out[0, 512:528] = torch.tensor([FLT_MIN, 0.1, 1e-3, 0.05]).view(torch.uint8)  # one tile at the scale floor
        out[1, :512] = tile(SUBNORMAL_E4M3, 512)
        out[1, 512:528] = torch.tensor([0.1, 0.1, 0.1, 0.1]).view(torch.uint8)
        out[2, :512] = tile([0x7E, 0xFE, 0x00, 0x80], 512)
        out[2, 512:528] = torch.tensor([1e-3, 2e-3, 1e-2, 5e-4]).view(torch.uint8)
        return out, None
    width, top = (576, 255) if kv_format == "int8" else (288, 15)
    alternating = [0x00, 0xFF] if kv_format == "int8" else [0x0F, 0xF0]
    codes = torch.stack([tile([0x00], width), tile([0xFF], width), tile(alternating, width), tile([0x5A, 0xA5], width)])
    # codes all 0 / all top / alternating at random_rows' middle scale, centred as build_cache centres
    # the random rows; a row of scale 0 (every value = zero)
    pairs = torch.tensor([[0.03, -0.015 * top]] * 3 + [[0.0, -0.0075 * top]]).to(dtype).view(torch.uint8)
    return codes, pairs


@dataclass
class Cache:
    """A quantized paged cache on the host: its bytes, the reader's float64 values of its rows
    ([num_blocks, block_size, 576] in the stored order, NaN where unseen), the block table (-1 past
    each sequence's blocks) and the kv lengths."""

    kv_format: str
    dtype: torch.dtype
    block_size: int
    bytes: torch.Tensor
    values: torch.Tensor
    table: torch.Tensor
    lens: list

    @property
    def kv_scale(self):
        return kv_scale_of(self.kv_format)


def build_cache(kv_format, dtype, lens, block_size, *, shared=0, spare_blocks=3, gen):
    """Random rows over shuffled blocks; the first ``shared`` blocks of every sequence are one set."""
    need = [max(1, -(-n // block_size)) for n in lens]
    num_blocks = shared + sum(n - shared for n in need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).int()
    table = torch.full((len(lens), max(need) + 2), -1, dtype=torch.int32)
    table[:, :shared] = perm[:shared]
    at = shared
    for b, n in enumerate(need):
        table[b, shared:n] = perm[at:at + n - shared]
        at += n - shared
    rows, pairs = random_rows(num_blocks * block_size, kv_format, dtype, gen)
    if pairs is not None:
        # Keep random_rows' scales, recentre its zeros (-2 .. 0) so that a row's values lie around 0
        # as a latent row's do: zero = -(0.3 .. 0.7) x the row's range. Otherwise every row shares a
        # large offset, and the scores mostly count how far each row's offset is from the others'.
        top = 255 if kv_format == "int8" else 15
        scale = pairs.view(dtype).double()[:, 0]
        zero = -scale * top * (0.3 + 0.4 * torch.rand(scale.shape[0], generator=gen, dtype=torch.float64))
        pairs = torch.stack([scale, zero], -1).to(dtype).view(torch.uint8)
    slots = layout.block_table_slots(table, torch.tensor(lens), block_size)
    seen = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for s in slots:
        seen[s] = True
    edge, edge_pairs = edge_rows(kv_format, dtype, rows)
    longest = max(range(len(lens)), key=lambda b: lens[b])
    at_slots = slots[longest][1:1 + edge.shape[0]]
    rows[at_slots] = edge
    if pairs is None:
        rows[~seen] = 0xFF
    else:
        pairs[at_slots] = edge_pairs
        pairs[~seen] = 0xFF
    values = decode_rows(rows, kv_format, pairs, dtype).view(num_blocks, block_size, 576)
    return Cache(kv_format, dtype, block_size, paged_bytes(rows, pairs, block_size), values, table, list(lens))


def rope_first(kv_format):
    """The row order behind block pointers: TurboMind's rope first, but fp8_ds_mla has latent first only."""
    return kv_format != "fp8_ds_mla"


def form_values(cache, form):
    """The reader's values of the rows as the kernels read them, latent first (the stored row is
    rope first behind block pointers)."""
    if form == "blocks" and rope_first(cache.kv_format):
        return layout.to_latent_first(cache.values)
    return cache.values


def query_std(cache):
    """The q std that spreads a query's scores over the seen rows by about SCORE_STD."""
    v = cache.values.view(-1, 576)
    v = v[torch.isfinite(v).all(-1)]
    spread = (v - v.mean(0)).norm(dim=-1).pow(2).mean().sqrt()
    return SCORE_STD / (SOFTMAX_SCALE * float(spread))


def references(cache, form, run):
    """(rounded, spec): ``run(kv_cache, **quantized)`` of the reference over the reader's values rounded
    to q's dtype, and of the spec over the bytes (for block pointers: the library's dequantized rows
    in the order the kernels read them)."""
    rounded = run(form_values(cache, form).to(cache.dtype).double())
    if form == "paged":
        spec = run(cache.bytes, kv_format=cache.kv_format, kv_scale=cache.kv_scale, scale_dtype=cache.dtype)
    else:
        rows = quant.dequantize_cache(cache.bytes, cache.kv_format, kv_scale=cache.kv_scale, scale_dtype=cache.dtype)
        spec = run(layout.to_latent_first(rows) if rope_first(cache.kv_format) else rows)
    return rounded, spec


# ------------------------------------------------------------------------------------ cases
DECODE_CASES = {
    # B = 3: a length-1 sequence, one at a block boundary (bs, bs + 1), a long one (several tiles; the
    # forced split cuts it into `splits` splits that end inside tiles)
    "sq1-h16-bs64": dict(s_q=1, heads=16, block_size=64, lens=[1, 64, 650], shared=0, splits=5),
    "sq2-h7-bs32": dict(s_q=2, heads=7, block_size=32, lens=[33, 1, 333], shared=1, splits=3),  # query 0 of b=1 sees no key
    "sq1-h20-bs16": dict(s_q=1, heads=20, block_size=16, lens=[16, 17, 300], shared=1, splits=4),
    # 30 (token, head) rows: past the narrow kernel's widest tile (N = 24), the 64-row kernel's
    "sq2-h15-bs64": dict(s_q=2, heads=15, block_size=64, lens=[2, 129, 200], shared=1, splits=2),
    # One split over 24 tiles: the narrow kernel's ring (4-10 stages) refilled twice or more per CTA,
    # at N = 16 by three warpgroups whose stages hold tiles of alternating warpgroups, at N = 24 by two.
    # (The cases above give a CTA at most 4 tiles, which no ring stage reuses.)
    "sq1-h16-long": dict(s_q=1, heads=16, block_size=64, lens=[3, 1500], shared=0, splits=1),
    "sq1-h20-long": dict(s_q=1, heads=20, block_size=64, lens=[1500, 70], shared=1, splits=1),
    # 128-row blocks, one split over 71 and 33 tiles: the narrow kernel's copy warp takes a tile as one
    # bulk copy of its block and holds the block bases of 32 tiles at a time, the next 32 read ahead;
    # the longer sequence crosses two window ends, the other's last tile lies alone in its window.
    "sq1-h20-bs128-windows": dict(s_q=1, heads=20, block_size=128, lens=[4500, 2100], shared=1, splits=1),
    # Two splits: the narrow kernel runs each pair of CTAs of the same rows as a cluster that merges
    # their rows and writes out / lse itself (no combine); at N = 16 and 24, with an empty second
    # split (b = 0, 1), a split ending inside a tile and one inside a block of 32 rows.
    "sq1-h16-bs64-pairs": dict(s_q=1, heads=16, block_size=64, lens=[1, 64, 650], shared=0, splits=2),
    "sq1-h20-bs32-pairs": dict(s_q=1, heads=20, block_size=32, lens=[33, 1, 333], shared=1, splits=2),
    # 40 splits: the narrow kernel's partials through the combine's many-split path (a row's columns over
    # two CTAs); b = 0 has 39 empty splits, b = 2 the splits past its 700 tokens.
    "sq1-h20-splits40": dict(s_q=1, heads=20, block_size=64, lens=[1, 2600, 700], shared=1, splits=40),
    # 72 sequences of 1-190 tokens in 3 splits: 216 narrow CTAs, a second wave on any Hopper GPU, many of
    # them with empty splits, all merged by one combine.
    "sq1-h16-combine": dict(s_q=1, heads=16, block_size=32, lens=[1 + (37 * i) % 190 for i in range(72)], shared=1,
                            splits=3),
}
PREFILL_CASE = dict(heads=20, block_size=32, q_lens=[5, 1, 37], kv_lens=[5 + 40, 1, 37 + 100], shared=1, splits=3,
                    pad=5)


def seed_of(*key):
    return zlib.crc32("/".join(map(str, key)).encode())


@functools.lru_cache(maxsize=None)
def decode_data(kv_format, dtype, case):
    """(cache, q_full [B, S_q, H + 3, 640] host, the q view's slices) of a decode case."""
    c = DECODE_CASES[case]
    gen = torch.Generator().manual_seed(seed_of("decode", kv_format, dtype, case))
    cache = build_cache(kv_format, dtype, c["lens"], c["block_size"], shared=c["shared"], gen=gen)
    batch = len(c["lens"])
    q_full = (torch.randn(batch, c["s_q"], c["heads"] + 3, 576 + 64, generator=gen) * query_std(cache)).to(dtype)
    return cache, q_full


def q_view(q_full, heads):
    """q strided on B, S_q and H (a slice of a wider tensor, 16-byte aligned)."""
    return q_full[:, :, 1:heads + 1, 32:32 + 576]


@functools.lru_cache(maxsize=None)
def decode_refs(kv_format, dtype, case, form):
    cache, q_full = decode_data(kv_format, dtype, case)
    q = q_view(q_full, DECODE_CASES[case]["heads"]).double()
    lens = torch.tensor(cache.lens, dtype=torch.int32)
    return references(cache, form, lambda kv, **fmt: reference.decode(q, kv, cache.table, lens, SOFTMAX_SCALE, **fmt))


@functools.lru_cache(maxsize=None)
def prefill_data(kv_format, dtype):
    """(cache, q [T, H, 576] host with T = cu_q_lens[B] + pad, cu_q_lens) of the prefill case."""
    c = PREFILL_CASE
    gen = torch.Generator().manual_seed(seed_of("prefill", kv_format, dtype))
    cache = build_cache(kv_format, dtype, c["kv_lens"], c["block_size"], shared=c["shared"], gen=gen)
    cu = torch.tensor([0] + c["q_lens"]).cumsum(0).int()
    q = (torch.randn(int(cu[-1]) + c["pad"], c["heads"], 576, generator=gen) * query_std(cache)).to(dtype)
    return cache, q, cu


@functools.lru_cache(maxsize=None)
def prefill_refs(kv_format, dtype, form, causal):
    cache, q, cu = prefill_data(kv_format, dtype)
    q = q[:int(cu[-1])].double()
    lens = torch.tensor(cache.lens, dtype=torch.int32)
    return references(cache, form, lambda kv, **fmt: reference.prefill(q, kv, cache.table, cu, lens, SOFTMAX_SCALE,
                                                                       causal=causal, **fmt))


# ---------------------------------------------------------------------------------- launches
class DeviceCache:
    """A host Cache on the GPU in one form: ``kwargs`` are the cache arguments of decode / prefill
    (kv_cache, block_table and, paged, kv_format / kv_scale); keeps the memory the pointers address."""

    def __init__(self, cache: Cache, form: str, num_layers: int = 2, layer: int = 1):
        self.cache, self.form = cache, form
        self.width_positions = cache.table.shape[1] * cache.block_size
        if form == "paged":
            self.memory = cache.bytes.cuda()
            self.kwargs = dict(kv_cache=self.memory, block_table=cache.table.cuda(), kv_format=cache.kv_format,
                               kv_scale=cache.kv_scale)
            return
        # Every block holds num_layers regions of the format's block bytes (int8 / int4: rows, then the
        # layer's (scale, zero) pairs), then 32 bytes; layer `layer` holds the rows, the others 0xFF
        # (NaN in every format), so a wrong layer or trailer offset reads NaN.
        region = cache.bytes.reshape(cache.bytes.shape[0], -1)
        size = region.shape[1]
        assert size == layout.block_bytes(cache.kv_format, cache.block_size, cache.dtype)
        pool = torch.full((region.shape[0], num_layers * size + 32), 0xFF, dtype=torch.uint8)
        pool[:, layer * size:(layer + 1) * size] = region
        self.memory = pool.cuda()
        counts = [-(-n // cache.block_size) for n in cache.lens]
        ids = torch.cat([cache.table[b, :n].long() for b, n in enumerate(counts)])
        blocks = layout.BlockPointerCache(
            (self.memory.data_ptr() + ids * self.memory.stride(0)).cuda(),
            torch.tensor([0] + counts).cumsum(0).int().cuda(), cache.block_size, layer * size, cache.dtype,
            rope_first=rope_first(cache.kv_format), kv_format=cache.kv_format, kv_scale=cache.kv_scale)
        self.kwargs = dict(kv_cache=blocks, block_table=None)

    def host_memory(self):
        return self.memory.cpu()


def schedules(splits, positions, tokens, heads, validate=True):
    """(None: the op's own schedule and workspace, validate=False) and a forced split of the table's
    positions (splits ending inside tiles) with a 0xFF workspace and ``validate`` (which rejects a
    sequence shorter than its queries)."""
    return [(None, False), (split_schedule(splits, -(-positions // splits), tokens, heads), validate)]


def launch_decode(q, dev, seq_lens, arch, schedule, validate):
    out, lse = nan_outputs(q, q.shape[:3])
    workspace = None if schedule is None else poisoned_workspace(schedule, q.device)
    return mla_kv.decode(q, seq_lens=seq_lens, softmax_scale=SOFTMAX_SCALE, out=out, lse=lse, workspace=workspace,
                         schedule=schedule, validate=validate, arch=arch, **dev.kwargs)


def launch_prefill(q, dev, cu, kv_lens, arch, schedule, validate, causal):
    out, lse = nan_outputs(q, q.shape[:2])
    workspace = None if schedule is None else poisoned_workspace(schedule, q.device)
    return mla_kv.prefill(q, cu_q_lens=cu, kv_lens=kv_lens, softmax_scale=SOFTMAX_SCALE, causal=causal, out=out,
                          lse=lse, workspace=workspace, schedule=schedule, validate=validate, arch=arch, **dev.kwargs)


def check_both(out, lse, refs, dtype, what, cu_q_lens=None):
    """out / lse (host) against the rounded-rows reference (16-bit tolerances) and the spec (widened)."""
    (rounded, spec) = refs
    check_attention(out, lse, *rounded, what, cu_q_lens=cu_q_lens)
    check_attention(out, lse, *spec, f"{what} vs the spec", cu_q_lens=cu_q_lens, out_tol=SPEC_OUT_TOL[dtype],
                    lse_tol=SPEC_LSE_TOL[dtype])


def narrow_kernel(arch, rows, schedule):
    """Whether the launch takes Hopper's narrow decode kernel (attention_sm90_narrow.cuh): uniform decode
    batches of up to 24 (token, head) rows over a quantized cache, with the default tile loads
    ("cp.async" keeps the 64-row kernel, whose dequantization the tests run so). It feeds its score
    MMAs the codes themselves and applies the scales in fp32 (fp8_ds_mla's tile scales too), and its
    value MMAs the codes themselves but for fp8_ds_mla, whose values it rounds to fp16 (up to ~2^-11
    of each): it then matches the spec at the 16-bit tolerances, and the reference over values rounded
    to q's dtype is not what it computes."""
    return (arch is None and torch.cuda.get_device_capability() == (9, 0) and rows <= 24
            and (schedule is None or schedule.tile_loads == "auto"))


def run_decode_case(kv_format, dtype, case, form, arch, plant=None, rounded_only=False):
    """The case's decode on every schedule; plant(cache, q_full, form) -> (cache, q_full) replaces its
    cache or queries. rounded_only: the 64-row kernel's runs are checked against the reference over the
    values rounded to q's dtype alone (what it computes), not also against the spec at the widened
    tolerance, which is calibrated for the cases' logits."""
    c = DECODE_CASES[case]
    cache, q_full = decode_data(kv_format, dtype, case)
    rows = c["s_q"] * c["heads"]
    if plant is None:
        refs = decode_refs(kv_format, dtype, case, form)
    else:
        cache, q_full = plant(cache, q_full, form)
        q64 = q_view(q_full, c["heads"]).double()
        lens = torch.tensor(cache.lens, dtype=torch.int32)
        refs = references(cache, form, lambda kv, **fmt: reference.decode(q64, kv, cache.table, lens, SOFTMAX_SCALE,
                                                                          **fmt))
    dev = DeviceCache(cache, form)
    before = dev.host_memory()
    q = q_view(q_full.cuda(), c["heads"])
    seq_lens = torch.tensor(cache.lens, dtype=torch.int32, device="cuda")
    runs = schedules(c["splits"], dev.width_positions, q.shape[0] * q.shape[1], c["heads"],
                     validate=min(cache.lens) >= c["s_q"])
    if narrow_kernel(arch, rows, None):  # the 64-row kernel as well
        runs.append((dataclasses.replace(runs[1][0], tile_loads="cp.async"), runs[1][1]))
    for schedule, validate in runs:
        out, lse = launch_decode(q, dev, seq_lens, arch, schedule, validate)
        split = "" if schedule is None else f" splits={schedule.num_splits}x{schedule.tokens_per_split}"
        what = f"{kv_format} {dtype_name(dtype)} {case} {form}{split}"
        if schedule is not None and schedule.tile_loads != "auto":
            what += f" tile_loads={schedule.tile_loads}"
        if narrow_kernel(arch, rows, schedule):
            check_attention(out.cpu(), lse.cpu(), *refs[1], f"{what} (narrow kernel) vs the spec")
        elif rounded_only:
            check_attention(out.cpu(), lse.cpu(), *refs[0], what)
        else:
            check_both(out.cpu(), lse.cpu(), refs, dtype, what)
    torch.cuda.synchronize()
    assert same_bytes(dev.host_memory(), before), f"{kv_format} {form}: the launches changed the cache's bytes"


# ------------------------------------------------------------------------------------- GPU
# Heads 0-4 of the longest sequence point at the key at these positions (those inside it): a sink (the
# first key), then keys in tiles 2, 4, 9 and 15 of 64, so that each Hopper warpgroup (tiles t mod 2, or
# mod 3 for the narrow kernel's three) meets a running max that moves far past 2^8 after its first tile,
# at tokens 40, 24, 56 and 4 of their tiles: each of a warpgroup's four warps holds one (the narrow
# kernel's warps vote whether the max moves); the key's score JUMP_SCORE nats.
JUMP_POSITIONS = (0, 168, 280, 632, 964)
JUMP_SCORE = 40.0
JUMP_MARGIN = 12.0  # nats the planted score must clear every other key of its row by


def plant_score_jumps(cache, q_full, form):
    """q_full with heads 0-3 of the longest sequence set to rows whose score against one key
    (JUMP_POSITIONS) is JUMP_SCORE, checked to clear every other key by JUMP_MARGIN: the row runs
    along that key less the keys' mean, made orthogonal to the other keys it scores highest (the
    edge rows of build_cache and the int formats' coarse codes share much of every key's direction)."""
    b = max(range(len(cache.lens)), key=lambda i: cache.lens[i])
    positions = [p for p in JUMP_POSITIONS if p < cache.lens[b]]
    assert len(positions) >= 4, "the case's longest sequence is too short for the planted keys"
    values = form_values(cache, form).reshape(-1, 576)
    keys = torch.stack([values[int(cache.table[b, p // cache.block_size]) * cache.block_size + p % cache.block_size]
                        for p in range(cache.lens[b])])
    q_full = q_full.clone()
    for h, pos in enumerate(positions):
        along, basis = keys[pos] - keys.mean(0), []
        for _ in range(32):
            q = (along * (JUMP_SCORE / (SOFTMAX_SCALE * along.dot(keys[pos])))).to(q_full.dtype)
            scores = SOFTMAX_SCALE * (keys @ q.double())
            others = scores.clone()
            others[pos] = -math.inf
            if scores[pos] - others.max() > JUMP_MARGIN:
                break
            v = keys[int(others.argmax())].clone()
            for u in basis:
                v -= v.dot(u) * u
            v /= v.norm()
            basis.append(v)
            along = along - along.dot(v) * v
        assert scores[pos] - others.max() > JUMP_MARGIN, f"head {h}: the planted key does not stand out"
        q_full[b, :, 1 + h, 32:32 + 576] = q
    return cache, q_full


SCALE_RISE_KEYS = 256  # the longest sequence's first four tiles of 64: one or two per Hopper warpgroup
SCALE_RISE = 2.0 ** -12


def scale_ds_rows(cache, positions, latent=1.0, rope=1.0):
    """fp8_ds_mla: the longest sequence's rows at ``positions`` with tile scales times ``latent`` and
    rope values times ``rope`` (powers of two: exact), the values decoded again from the bytes."""
    b = max(range(len(cache.lens)), key=lambda i: cache.lens[i])
    assert cache.lens[b] > max(positions), "the case's longest sequence is too short"
    blocks = cache.bytes.clone()
    for pos in positions:
        row = blocks[int(cache.table[b, pos // cache.block_size]), pos % cache.block_size]
        row[512:528] = (row[512:528].view(torch.float32) * latent).view(torch.uint8)
        row[528:656] = (row[528:656].view(torch.bfloat16) * rope).view(torch.uint8)
    values = decode_rows(blocks.reshape(-1, 656), "fp8_ds_mla").view(cache.values.shape)
    return dataclasses.replace(cache, bytes=blocks, values=values)


def plant_scale_rise(cache, q_full, form):
    """int8 / int4: the longest sequence's first SCALE_RISE_KEYS keys with scale and zero times
    SCALE_RISE (their values as much smaller), so that the scales' power of two rises 12 steps at
    the fifth tile (fp8_ds_mla: tile scales and rope alike); the cache's values are decoded again
    from the changed bytes."""
    if cache.kv_format == "fp8_ds_mla":
        return scale_ds_rows(cache, range(SCALE_RISE_KEYS), SCALE_RISE, SCALE_RISE), q_full
    b = max(range(len(cache.lens)), key=lambda i: cache.lens[i])
    assert cache.lens[b] > SCALE_RISE_KEYS + 64, "the case's longest sequence is too short"
    bs, width = cache.block_size, 576 if cache.kv_format == "int8" else 288
    blocks = cache.bytes.clone()
    pairs = blocks[:, bs * width:].reshape(-1, bs, 2, cache.dtype.itemsize)
    for pos in range(SCALE_RISE_KEYS):
        blk, slot = int(cache.table[b, pos // bs]), pos % bs
        pair = pairs[blk, slot].contiguous().view(cache.dtype) * SCALE_RISE
        pairs[blk, slot] = pair.view(torch.uint8).view(2, -1)
    blocks[:, bs * width:] = pairs.reshape(blocks.shape[0], -1)
    values = decode_rows(blocks[:, :bs * width].reshape(-1, width), cache.kv_format, blocks[:, bs * width:].reshape(-1, 4),
                         cache.dtype).view(cache.values.shape)
    return dataclasses.replace(cache, bytes=blocks, values=values), q_full


@GPU
@pytest.mark.parametrize("case", ["sq1-h16-bs64", "sq2-h7-bs32", "sq1-h16-bs64-pairs", "sq1-h20-bs32-pairs",
                                  "sq1-h20-splits40", "sq1-h16-combine"])
@pytest.mark.parametrize("form", ["paged", "blocks"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_format", FORMATS)
def test_decode_quantized(kv_format, dtype, form, case, arch):
    """Default schedule and a forced split; shared blocks, a -1-padded table, unseen rows NaN."""
    run_decode_case(kv_format, dtype, case, form, arch)


@GPU
@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("case", ["sq1-h20-splits40", "sq1-h16-combine"])
def test_decode_quantized_in_cuda_graph(kv_format, case, arch):
    """A split decode captured in a CUDA graph, then replayed into NaN outputs and a 0xFF workspace: the
    combine must read the partials of this replay's attention kernel (on Hopper it is launched as a
    programmatic dependent launch and waits for that grid in the kernel), and nothing of the capture."""
    dtype, c = (torch.float16 if arch in ("sm70", "sm75") else torch.bfloat16), DECODE_CASES[case]
    cache, q_full = decode_data(kv_format, dtype, case)
    dev = DeviceCache(cache, "paged")
    before = dev.host_memory()
    q = q_view(q_full.cuda(), c["heads"])
    seq_lens = torch.tensor(cache.lens, dtype=torch.int32, device="cuda")
    schedule = schedules(c["splits"], dev.width_positions, q.shape[0] * q.shape[1], c["heads"])[1][0]
    out, lse = nan_outputs(q, q.shape[:3])
    workspace = poisoned_workspace(schedule, q.device)
    graph = capture_graph(lambda: mla_kv.decode(q, seq_lens=seq_lens, softmax_scale=SOFTMAX_SCALE, out=out, lse=lse,
                                                workspace=workspace, schedule=schedule, arch=arch, **dev.kwargs))
    for buffer, value in ((out, float("nan")), (lse, float("nan")), (workspace, 0xFF)):
        buffer.fill_(value)
    graph.replay()
    torch.cuda.synchronize()
    what = f"{kv_format} {case} graph replay splits={schedule.num_splits}"
    refs = decode_refs(kv_format, dtype, case, "paged")
    if narrow_kernel(arch, c["s_q"] * c["heads"], schedule):
        check_attention(out.cpu(), lse.cpu(), *refs[1], f"{what} (narrow kernel) vs the spec")
    else:
        check_both(out.cpu(), lse.cpu(), refs, dtype, what)
    assert same_bytes(dev.host_memory(), before), f"{what}: the replay changed the cache's bytes"


@GPU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_format", FORMATS)
def test_decode_quantized_block_size_16(kv_format, dtype, arch):
    for form in ("paged", "blocks"):
        run_decode_case(kv_format, dtype, "sq1-h20-bs16", form, arch)


@GPU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("case", ["sq1-h16-bs64", "sq1-h16-long", "sq1-h16-bs64-pairs", "sq1-h20-splits40"])
def test_decode_quantized_score_jumps(kv_format, dtype, case, arch):
    """Heads whose running max moves by ~40 nats in a late tile (and a sink): O, the row sum and the
    int formats' zero-point term must all be rescaled (random scores never move the max that far).
    The long case's one split gives each warpgroup its jumps after tiles of its own; the pairs case's
    two splits, merged in the kernel, meet with lse far apart; at 40 splits each jump lies in a split of
    its own, so the merge weighs splits whose lse lie ~40 nats apart."""
    run_decode_case(kv_format, dtype, case, "paged", arch, plant=plant_score_jumps)


@GPU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_format", ["int8", "int4", "fp8_ds_mla"])
def test_decode_quantized_scale_rise(kv_format, dtype, arch):
    """Keys whose row scales (fp8_ds_mla: tile scales and rope) rise 2^12-fold after the fourth tile:
    the narrow kernel's O, kept in units of its scales' running power of two, must be rescaled when
    that power rises. The one-split case, so that each of the three warpgroups (tiles t = k mod 3; two
    for fp8_ds_mla) meets the rise after a tile of its own; the other cases' splits give a CTA at most
    4 tiles."""
    run_decode_case(kv_format, dtype, "sq1-h16-long", "paged", arch, plant=plant_scale_rise)


ROPE_LED_KEYS = range(64, 320)  # tiles 1-4 of 64 of the longest sequence
ROPE_LED_LATENT = 2.0 ** -16


@GPU
@pytest.mark.parametrize("case", ["sq1-h16-long", "sq1-h20-long"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_ds_mla_rope_sets_the_scale(dtype, case, arch):
    """fp8_ds_mla keys whose tile scales are 2^16 times smaller while their rope is not: the narrow
    kernel's fp16 products take a token's rope under a power of two of its own (under the latent's,
    2^-19 here, a rope of ~3 would be ~1.5e6: past fp16)."""
    run_decode_case("fp8_ds_mla", dtype, case, "paged", arch,
                    plant=lambda cache, q_full, form: (scale_ds_rows(cache, ROPE_LED_KEYS, ROPE_LED_LATENT), q_full))


@GPU
@pytest.mark.parametrize("case", ["sq1-h16-long", "sq1-h20-long", "sq1-h20-bs128-windows"])
@pytest.mark.parametrize("form", ["paged", "blocks"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_format", FORMATS)
def test_decode_quantized_long_context(kv_format, dtype, form, case, arch):
    """24 tiles and more in one CTA (the forced one-split schedule): every stage of the narrow kernel's
    ring is refilled while the other warpgroups still read theirs (a stage freed too early, or a
    warpgroup passing its wait on a stage's previous phase, reads the next tile's bytes); past 32
    tiles its copy warp's window of block bases is refilled."""
    run_decode_case(kv_format, dtype, case, form, arch)


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16])  # a parameter: the arch fixture skips sm75 / sm70 on it
@pytest.mark.parametrize("kv_format", FORMATS)
def test_decode_quantized_30_rows(kv_format, dtype, arch):
    run_decode_case(kv_format, dtype, "sq2-h15-bs64", "paged", arch)


def plant_rope_led_queries(cache, q_full, form):
    """Every other head's rope part (q_full features 544-607, the view's 512-575) times 2^8: those rows'
    largest values are rope values, 2^8 above their latent ones, as a trained model's q_pe can be."""
    q_full = q_full.clone()
    q_full[:, :, 2::2, 32 + 512:32 + 576] *= 256
    return cache, q_full


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16])  # a parameter: the arch fixture skips sm75 / sm70 on it
@pytest.mark.parametrize("kv_format", FORMATS)
def test_decode_bf16_query_whose_rope_part_leads(kv_format, dtype, arch):
    """bf16 q rows led by their rope part (plant_rope_led_queries): the narrow kernel's power of two per
    q row, which puts the row's largest value at 2^14 in fp16, must come from all 576 features; taken
    from the latent alone it would put those rows' rope values near 2^22, past fp16's largest. Those
    rows' logits reach ~900: the 64-row kernel's int values, rounded to bf16 (2^-9), then miss the spec
    by ~1.5 nats, so its runs are held to the rounded-values reference alone."""
    run_decode_case(kv_format, dtype, "sq1-h16-bs64", "paged", arch, plant=plant_rope_led_queries,
                    rounded_only=True)


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("power", [24, -24])
def test_decode_fp8_bf16_query_beyond_fp16(power, dtype, arch):
    """bf16 q times 2^24 (past fp16's largest value) or 2^-24 (under its smallest normal), softmax_scale
    divided by as much: the same logits, so the same answer as the case's reference. The narrow
    kernel's fp16 products see each q row through its own power of two."""
    case = "sq1-h16-bs64"
    cache, q_full = decode_data("fp8", dtype, case)
    refs = decode_refs("fp8", dtype, case, "paged")
    dev = DeviceCache(cache, "paged")
    q = q_view(q_full.cuda() * 2.0 ** power, DECODE_CASES[case]["heads"])
    out, lse = nan_outputs(q, q.shape[:3])
    mla_kv.decode(q, seq_lens=torch.tensor(cache.lens, dtype=torch.int32, device="cuda"),
                  softmax_scale=SOFTMAX_SCALE * 2.0 ** -power, out=out, lse=lse, arch=arch, **dev.kwargs)
    what = f"fp8 bfloat16 q x 2^{power}"
    if narrow_kernel(arch, DECODE_CASES[case]["heads"], None):
        check_attention(out.cpu(), lse.cpu(), *refs[1], f"{what} (narrow kernel) vs the spec")
    else:
        check_both(out.cpu(), lse.cpu(), refs, dtype, what)


@GPU
@pytest.mark.parametrize("form", ["paged", "blocks"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_format", FORMATS)
def test_prefill_quantized(kv_format, dtype, form, arch):
    """Packed causal prefill over a cached prefix (q lens 5, 1, 37 on kv lens 45, 1, 137), default and
    forced-split schedules, and once non-causal; q / out padded past cu_q_lens[B]: those rows stay NaN."""
    c = PREFILL_CASE
    cache, q_host, cu_host = prefill_data(kv_format, dtype)
    dev = DeviceCache(cache, form)
    before = dev.host_memory()
    q, cu = q_host.cuda(), cu_host.cuda()
    kv_lens = torch.tensor(cache.lens, dtype=torch.int32, device="cuda")
    used = int(cu_host[-1])
    runs = [(True, *s) for s in schedules(c["splits"], dev.width_positions, q.shape[0], c["heads"])]
    runs.append((False, None, False))
    for causal, schedule, validate in runs:
        out, lse = launch_prefill(q, dev, cu, kv_lens, arch, schedule, validate, causal)
        split = "" if schedule is None else f" splits={schedule.num_splits}x{schedule.tokens_per_split}"
        what = f"{kv_format} {dtype_name(dtype)} prefill {form} causal={causal}{split}"
        out, lse = out.cpu(), lse.cpu()
        check_both(out[:used], lse[:used], prefill_refs(kv_format, dtype, form, causal), dtype, what, cu_q_lens=cu_host)
        assert torch.isnan(out[used:]).all() and torch.isnan(lse[used:]).all(), \
            f"{what}: rows past cu_q_lens[B] were written"
    torch.cuda.synchronize()
    assert same_bytes(dev.host_memory(), before), f"{kv_format} {form}: the launches changed the cache's bytes"


@GPU
def test_quantized_attention_guards_on_gpu():
    """Checks made before a launch; a rejected call leaves out / lse untouched."""
    case = "sq1-h16-bs64"  # S_q = 1: validate=True accepts every length (it rejects seq_len < S_q)
    heads = DECODE_CASES[case]["heads"]
    cache, q_full = decode_data("int8", torch.float16, case)
    q = q_view(q_full.cuda(), heads)
    seq_lens = torch.tensor(cache.lens, dtype=torch.int32, device="cuda")
    paged, blocks = DeviceCache(cache, "paged"), DeviceCache(cache, "blocks")
    out, lse = nan_outputs(q, q.shape[:3])
    call = dict(seq_lens=seq_lens, softmax_scale=SOFTMAX_SCALE, out=out, lse=lse)
    # the table one block short of the longest sequence: validate must take the block size from the
    # bytes ([num_blocks, block_bytes] for int8), not from kv_cache.shape[1]
    need = -(-max(cache.lens) // cache.block_size)
    short = dict(paged.kwargs, block_table=paged.kwargs["block_table"][:, :need - 1].contiguous())
    with pytest.raises(ValueError, match="block_table"):
        mla_kv.decode(q, validate=True, **short, **call)
    # a BlockPointerCache carries its own format: the keywords are for the paged tensor only
    with pytest.raises(ValueError, match="kv_format"):
        mla_kv.decode(q, kv_format="int8", **blocks.kwargs, **call)
    bf16_cache, bf16_q = decode_data("int8", torch.bfloat16, case)
    with pytest.raises(TypeError, match="bfloat16"):  # the sm70 kernels compute in float16 only
        mla_kv.decode(q_view(bf16_q.cuda(), heads), arch="sm70", **DeviceCache(bf16_cache, "paged").kwargs,
                      seq_lens=seq_lens, softmax_scale=SOFTMAX_SCALE)
    fp8 = DeviceCache(decode_data("fp8", torch.float16, case)[0], "paged")
    storage = torch.zeros(fp8.memory.numel() + 16, dtype=torch.uint8, device="cuda")
    misaligned = storage[8:8 + fp8.memory.numel()].view(fp8.memory.shape)
    with pytest.raises(ValueError, match="kv_cache"):
        mla_kv.decode(q, **dict(fp8.kwargs, kv_cache=misaligned), **call)
    torch.cuda.synchronize()
    assert torch.isnan(out).all() and torch.isnan(lse).all(), "a rejected call wrote out / lse"


# ------------------------------------------------------------------------------------- CPU
def small_cache(kv_format, dtype, lens, seed):
    gen = torch.Generator().manual_seed(seed)
    cache = build_cache(kv_format, dtype, lens, 16, shared=1, gen=gen)
    return cache, gen


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_format", FORMATS)
def test_cpu_decode_runs_the_reference(kv_format, dtype):
    """CPU tensors: the op's result is the reference's over the bytes (scale_dtype q's dtype), and
    within the 16-bit tolerances of the float64 attention over the values this file's reader decodes."""
    cache, gen = small_cache(kv_format, dtype, [1, 16, 40], seed_of("cpu decode", kv_format, dtype))
    q = (torch.randn(3, 2, 4, 576, generator=gen) * query_std(cache)).to(dtype)
    lens = torch.tensor(cache.lens, dtype=torch.int32)
    out, lse = nan_outputs(q, (3, 2, 4))
    got = mla_kv.decode(q, cache.bytes, cache.table, lens, SOFTMAX_SCALE, out=out, lse=lse, kv_format=kv_format,
                        kv_scale=cache.kv_scale)  # (validate rejects the sequence of length 1 < S_q)
    want = reference.decode(q, cache.bytes, cache.table, lens, SOFTMAX_SCALE, kv_format=kv_format,
                            kv_scale=cache.kv_scale, scale_dtype=dtype)
    assert got[0] is out and got[1] is lse, "the op did not return the given out / lse"
    assert same_bytes(out, want[0]) and same_bytes(lse, want[1]), f"{kv_format}: the CPU op differs from the reference"
    check_attention(out, lse, *reference.decode(q.double(), cache.values, cache.table, lens, SOFTMAX_SCALE),
                    f"cpu {kv_format} {dtype_name(dtype)} vs the reader")


@pytest.mark.parametrize("kv_format", FORMATS)
def test_cpu_prefill_runs_the_reference_and_leaves_padded_rows(kv_format):
    dtype = torch.bfloat16 if kv_format in ("int8", "fp8_ds_mla") else torch.float16
    cache, gen = small_cache(kv_format, dtype, [5 + 20, 1, 17 + 30], seed_of("cpu prefill", kv_format))
    cu = torch.tensor([0, 5, 6, 23], dtype=torch.int32)
    q = (torch.randn(26, 3, 576, generator=gen) * query_std(cache)).to(dtype)
    lens = torch.tensor(cache.lens, dtype=torch.int32)
    bytes_before = cache.bytes.clone()
    for causal in (True, False):
        out, lse = nan_outputs(q, (26, 3))
        mla_kv.prefill(q, cache.bytes, cache.table, cu, lens, SOFTMAX_SCALE, causal=causal, out=out, lse=lse,
                       kv_format=kv_format, kv_scale=cache.kv_scale, validate=True)
        want = reference.prefill(q[:23], cache.bytes, cache.table, cu, lens, SOFTMAX_SCALE, causal=causal,
                                 kv_format=kv_format, kv_scale=cache.kv_scale, scale_dtype=dtype)
        what = f"cpu prefill {kv_format} causal={causal}"
        assert same_bytes(out[:23], want[0]) and same_bytes(lse[:23], want[1]), f"{what}: differs from the reference"
        assert torch.isnan(out[23:]).all() and torch.isnan(lse[23:]).all(), f"{what}: padded rows were written"
        ref = reference.prefill(q[:23].double(), cache.values, cache.table, cu, lens, SOFTMAX_SCALE, causal=causal)
        check_attention(out[:23], lse[:23], *ref, f"{what} vs the reader", cu_q_lens=cu)
    assert same_bytes(cache.bytes, bytes_before), "the op changed the cache's bytes"


def test_cpu_quantized_attention_arguments_are_checked():
    """Errors name the argument (messages: ops/_common.py _check_kv_format, layout.py
    cache_block_size / check_kv_scale)."""
    cache, _ = small_cache("int8", torch.float16, [1, 16, 40], 1)
    fp8, _ = small_cache("fp8", torch.float16, [1, 16, 40], 2)
    q = torch.randn(3, 1, 4, 576).half()
    lens = torch.tensor(cache.lens, dtype=torch.int32)
    table = cache.table

    def decode(kv_cache, **kw):
        return mla_kv.decode(q, kv_cache, table, lens, SOFTMAX_SCALE, **kw)

    with pytest.raises(ValueError, match="kv_scale"):
        decode(cache.bytes, kv_format="int8", kv_scale=0.5)
    with pytest.raises(ValueError, match="kv_scale"):
        decode(fp8.bytes, kv_format="fp8")
    for bad in (0.0, -1.0, math.inf, math.nan, True, "0.5"):
        with pytest.raises(ValueError, match="kv_scale"):
            decode(fp8.bytes, kv_format="fp8", kv_scale=bad)
    with pytest.raises(ValueError, match="kv_scale"):  # a scale without a format
        decode(torch.zeros(fp8.bytes.shape, dtype=torch.float16), kv_scale=0.5)
    with pytest.raises(ValueError, match="kv_format"):
        decode(fp8.bytes, kv_format="fp4", kv_scale=0.5)
    with pytest.raises(TypeError, match="kv_cache"):  # a 16-bit cache read as quantized
        decode(torch.zeros(fp8.bytes.shape, dtype=torch.float16), kv_format="fp8", kv_scale=0.5)
    with pytest.raises(TypeError, match="kv_cache"):  # quantized bytes without their format
        decode(fp8.bytes)
    with pytest.raises(ValueError, match="kv_cache"):  # fp8_ds_mla rows are 656 bytes
        decode(fp8.bytes, kv_format="fp8_ds_mla")
    with pytest.raises(ValueError, match="kv_cache"):
        decode(torch.zeros(fp8.bytes.shape[0], 16, 575, dtype=torch.uint8), kv_format="fp8", kv_scale=0.5)
    with pytest.raises(ValueError, match="kv_cache"):  # int8 blocks are [num_blocks, block_size x 580] bytes
        decode(fp8.bytes, kv_format="int8")
    with pytest.raises(ValueError, match="kv_cache"):
        decode(torch.zeros(cache.bytes.shape[0], cache.bytes.shape[1] + 1, dtype=torch.uint8), kv_format="int8")
    with pytest.raises(ValueError, match="kv_cache"):  # int4 blocks are block_size x 292 bytes, not 580
        decode(cache.bytes[:, :16 * 580 - 16], kv_format="int4")
    with pytest.raises(TypeError):  # the compute dtype (q's) must be float16 or bfloat16
        mla_kv.decode(q.float(), cache.bytes, table, lens, SOFTMAX_SCALE, kv_format="int8")
    with pytest.raises(ValueError, match="block_table"):  # one block short of the longest sequence
        mla_kv.decode(q, cache.bytes, table[:, :2].contiguous(), lens, SOFTMAX_SCALE, kv_format="int8", validate=True)

    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    qp = torch.randn(3, 4, 576).half()

    def prefill(kv_cache, **kw):
        return mla_kv.prefill(qp, kv_cache, table, cu, lens, SOFTMAX_SCALE, **kw)

    with pytest.raises(ValueError, match="kv_scale"):
        prefill(cache.bytes, kv_format="int4", kv_scale=1.0)
    with pytest.raises(ValueError, match="kv_scale"):
        prefill(fp8.bytes, kv_format="fp8")
    with pytest.raises(TypeError, match="kv_cache"):
        prefill(torch.zeros(fp8.bytes.shape, dtype=torch.bfloat16), kv_format="fp8_ds_mla")
    with pytest.raises(ValueError, match="kv_cache"):
        prefill(fp8.bytes, kv_format="fp8_ds_mla")


@pytest.mark.parametrize("kv_format", FORMATS)
def test_cpu_spec_tolerances_cover_the_rounding(kv_format):
    """On the GPU tests' caches and queries: the rounded-rows reference (a kernel with no error of its
    own, its out rounded to q's dtype and lse to float32) lies within SPEC_* minus the 16-bit
    tolerances of the spec, so a kernel within those of the rounded-rows reference passes both."""
    for dtype in DTYPES:
        out_room, lse_room = SPEC_OUT_TOL[dtype] - OUT_TOL[dtype], SPEC_LSE_TOL[dtype] - LSE_TOL
        for form in ("paged", "blocks"):
            pairs = [(f"decode {case}", None, decode_refs(kv_format, dtype, case, form))
                     for case in DECODE_CASES if case != "sq1-h20-bs16" or dtype == torch.float16]
            cu = prefill_data(kv_format, dtype)[2]
            pairs += [(f"prefill causal={causal}", cu, prefill_refs(kv_format, dtype, form, causal))
                      for causal in (True, False)]
            for what, cu_q_lens, (rounded, spec) in pairs:
                check_attention(rounded[0].to(dtype), rounded[1].float(), *spec,
                                f"{kv_format} {dtype_name(dtype)} {form} {what}: the rounding", cu_q_lens=cu_q_lens,
                                out_tol=out_room, lse_tol=lse_room)
