"""decode / prefill / split-KV with the score shapes of real models against the float64 reference.

Random caches give scores within a few nats of each other, where an online softmax that mishandles
its running max still looks right. Here the scores are built: a sweep of one key jumping J log2
units above everything before it, logits growing along the sequence (the running max moves in most
tiles), attention sinks on a flat background, queries scaled x1 .. x8. Each runs on every kernel
variant (the `arch` fixture) and dtype, both cache addressings, the default schedule and forced splits (of 256 keys: 3-4
splits, the few-split combine, TMA loads on Hopper's paged path; of 48 keys: 16-22 splits, the
many-split combine, splits ending inside tiles, cp.async loads), every row compared by
check_attention.
The CPU tests check that the generated data scores what the patterns claim.
"""
import math
from dataclasses import replace

import pytest
import torch

from mla_kv import gpus, reference
from mla_kv.layout import ROW_DIM

from gpu_checks import (ATTENTION_ARCHS, block_pointer_copy, cache_with_rows, check_attention, default_schedule,
                        run_decode, run_prefill, split_schedule)

pytestmark = ATTENTION_ARCHS  # the variants of the tests taking `arch` (the GPU ones)

SCALE = 1.0 / math.sqrt(192 + 64)  # DeepSeek/GLM: nope 192 + rope 64
ALONG = 8.0          # q's component along its sequence's score direction u
QUERY_DIMS = 64      # q's other directions (orthogonal to u and to the rows' random parts)
QUERY_SPREAD = 16.0  # norm of q's part in those directions
ROW_SPREAD = 0.5     # per-element std of a row's random part (its own latent value)
BLOCK_SIZE = 64
RESCALE_LOG2 = 8.0   # common.cuh kRescaleLog2: the running max moves when a tile beats it by more


def scored_batch(targets, q_lens, multipliers, heads, dtype, device):
    """Queries and cache rows whose scores are the targets: query row (s, h) of sequence b scores key
    j at multipliers(q_len_b, heads)[s, h] * targets[b][j] log2 units, up to the 16-bit rounding.

    Per sequence, an orthonormal basis [u | E] of 1 + QUERY_DIMS directions: q = m (ALONG u + E z)
    with random z, and row j = a_j u + r_j with r_j random in the basis' complement, so that
    scale * q . row_j = m * ALONG * a_j * scale exactly; a_j = target_j ln 2 / (ALONG scale). The
    r_j give each row its own value; E z gives q parts that cancel in Q.K^T like real ones do.
    Returns q [sum q_lens, H, 576] and per sequence rows [len_b, 576], both in dtype.
    """
    f64 = dict(dtype=torch.float64, device=device)
    queries, rows = [], []
    for target, q_len in zip(targets, q_lens):
        basis = torch.linalg.qr(torch.randn(ROW_DIM, 1 + QUERY_DIMS, **f64)).Q
        u, spread = basis[:, 0], basis[:, 1:]
        z = torch.randn(q_len, heads, QUERY_DIMS, **f64) * (QUERY_SPREAD / math.sqrt(QUERY_DIMS))
        q = multipliers(q_len, heads, device)[..., None] * (ALONG * u + z @ spread.T)
        own = torch.randn(target.shape[0], ROW_DIM, **f64) * ROW_SPREAD
        own -= (own @ basis) @ basis.T
        along = target * math.log(2) / (ALONG * SCALE)
        queries.append(q.to(dtype))
        rows.append((along[:, None] * u + own).to(dtype))
    return torch.cat(queries), rows


# ------------------------------------------------------------------------------ patterns
def jump_sweep(device):
    """J = 2, 4, .., 40 log2 units, one sequence each (640 + 7 i keys, 10-12 tiles): the key at 400
    or 465 (tile 6 or 7: later tiles of the second 256-key split) scores J above every key before
    it, the key 5 later J - 1 above them; the background is N(0, 0.5^2)."""
    targets = []
    for i, jump in enumerate(range(2, 41, 2)):
        target = torch.randn(640 + 7 * i, dtype=torch.float64, device=device) * 0.5
        at = 400 if i % 2 == 0 else 465
        top = target[:at].max()
        target[at], target[at + 5] = top + jump, top + jump - 1
        targets.append(target)
    return targets


GROWING_SLOPES = ((0.1, 600), (0.13, 650), (0.15, 700), (0.2, 450), (-0.1, 600))  # (log2 per key, keys)


def growing_logits(device):
    """Logits rising by `slope` log2 units per key (plus N(0, 0.3^2)): 0.13-0.2 per key (8.3-12.8 per
    64-key tile) beat the running max by more than RESCALE_LOG2 in (nearly) every tile, 0.1 in every
    other one, -0.1 never after the first. Centered on 0 so that |score| stays below ~36 nats."""
    targets = []
    for slope, n in GROWING_SLOPES:
        pos = torch.arange(n, dtype=torch.float64, device=device)
        targets.append(slope * (pos - n / 2) + torch.randn(n, dtype=torch.float64, device=device) * 0.3)
    return targets


SINKS = ((500, {0: 10}), (700, {0: 14, 1: 14, 2: 14, 3: 14}), (640, {628: 10}), (900, {0: 20, 888: 6}),
         (300, {299: 16}), (800, {0: 4, 256: 12}))  # (keys, {position: log2 units above the background})


def sinks(device):
    """Sinks on a flat background (target 0): early (position 0, or 0-3), late (12 before the end:
    every decode query sees it; the last position: only the last query does), on the boundary of
    256-key splits, 4 to 20 log2 units high."""
    targets = []
    for n, peaks in SINKS:
        target = torch.zeros(n, dtype=torch.float64, device=device)
        for at, height in peaks.items():
            target[at] = height
        targets.append(target)
    return targets


def random_with_peaks(device):
    """Random logits N(0, 1) with a sink (+8 at position 0) and a spike (+6 at 2/3 of the sequence);
    with scaled_heads up to ~90 log2 units (62 nats)."""
    targets = []
    for n in (500, 650, 777, 900):
        target = torch.randn(n, dtype=torch.float64, device=device)
        target[0] += 8
        target[2 * n // 3] += 6
        targets.append(target)
    return targets


def varied_heads(q_len, heads, device):
    """Score multipliers 0.6 .. 1 over a query's heads (no two alike), shifted from token to token."""
    s = torch.arange(q_len, device=device)[:, None]
    h = torch.arange(heads, device=device)[None, :]
    return 1 - 0.4 * ((h + 3 * s) % heads).double() / heads


def scaled_heads(q_len, heads, device):
    """q scaled x1 .. x8 over the heads, shifted from token to token."""
    s = torch.arange(q_len, device=device)[:, None]
    h = torch.arange(heads, device=device)[None, :]
    return (1 + (h + s) % 8).double()


PATTERNS = {"jump_sweep": (jump_sweep, varied_heads), "growing": (growing_logits, varied_heads),
            "sinks": (sinks, varied_heads), "q_scaled": (random_with_peaks, scaled_heads)}
DECODE_HEADS, PREFILL_HEADS = 16, 8


def prefill_q_lens(lens):
    """A full prompt, an extend of 100, a decode-like token and a sequence without queries, in turn."""
    return [[n, min(n, 100), min(n, 1), 0][b % 4] for b, n in enumerate(lens)]


# ----------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("s_q", [1, 3, 8, None], ids=["decode1", "decode3", "decode8", "prefill"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_score_patterns(pattern, s_q, dtype, arch):
    check_score_patterns(pattern, s_q, dtype, arch)


# The Sm80 kernel's register-staged tiles of the 99 KB GPUs (A10 / A40 / RTX 30, L40 / RTX 40), which
# the H200's own limits never pick: the same patterns under that class's shared-memory limits.
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("s_q", [1, 3, None], ids=["decode1", "decode3", "prefill"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_score_patterns_on_the_99kb_tiles(pattern, s_q, dtype):
    check_score_patterns(pattern, s_q, dtype, "sm80", gpu="A10 / A40 / RTX 30")


def check_score_patterns(pattern, s_q, dtype, arch, gpu=None):
    """Every pattern x split x addressing of one variant against the reference; gpu: a GPU class whose
    shared-memory limits the launches plan under (mla_kv.gpus), None: this GPU's."""
    make_targets, multipliers = PATTERNS[pattern]
    targets = make_targets("cuda")
    lens = [t.shape[0] for t in targets]
    batch = len(lens)
    q_lens = [s_q] * batch if s_q else prefill_q_lens(lens)
    heads = DECODE_HEADS if s_q else PREFILL_HEADS
    q, rows = scored_batch(targets, q_lens, multipliers, heads, dtype, "cuda")
    cache, table, seq_lens = cache_with_rows(rows, BLOCK_SIZE)
    _, blocks = block_pointer_copy(cache, table, lens)
    cu = None
    if s_q:
        q = q.view(batch, s_q, heads, ROW_DIM)
        ref_out, ref_lse = reference.decode(q.double(), cache.double(), table, seq_lens, SCALE)
    else:
        cu = torch.tensor([0] + q_lens, device="cuda").cumsum(0).int()
        ref_out, ref_lse = reference.prefill(q.double(), cache.double(), table, cu, seq_lens, SCALE)
    positions = table.shape[1] * BLOCK_SIZE
    for tokens_per_split in (None, 256, 48):
        for kv_cache, block_table, addressing in ((cache, table, "paged"), (blocks, None, "block pointers")):
            if tokens_per_split is not None:
                schedule = replace(split_schedule(-(-positions // tokens_per_split), tokens_per_split, sum(q_lens),
                                                  heads), smem_limits=gpus.smem_limits(gpu))
            elif gpu is not None:
                schedule = default_schedule(q, kv_cache, block_table, packed_batch=None if s_q else batch,
                                            arch=arch, smem_limits=gpu)
            else:
                schedule = None
            what = f"{pattern} S_q={s_q or 'prefill'} split={tokens_per_split} {addressing} gpu={gpu}"
            if s_q:
                out, lse = run_decode(q, kv_cache, block_table, seq_lens, SCALE, arch=arch, schedule=schedule)
            else:
                out, lse = run_prefill(q, kv_cache, block_table, cu, seq_lens, SCALE, arch=arch,
                                       schedule=schedule)
            check_attention(out, lse, ref_out, ref_lse, what, cu_q_lens=cu)


# ----------------------------------------------------------------------------------- CPU
def realized_scores(q, rows):
    """log2-unit scores [q rows, H, keys] of one sequence's 16-bit queries and rows."""
    return SCALE * torch.einsum("shd,kd->shk", q.double(), rows.double()) / math.log(2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_patterns_score_what_they_claim(pattern, dtype):
    """After rounding to 16 bits the scores stay within 0.1 log2 units of multiplier x target (the jump
    sweep steps by 2)."""
    make_targets, multipliers = PATTERNS[pattern]
    targets = make_targets("cpu")
    q_lens = [3] * len(targets)
    q, rows = scored_batch(targets, q_lens, multipliers, 4, dtype, "cpu")
    for b, (target, r) in enumerate(zip(targets, rows)):
        want = multipliers(3, 4, "cpu")[..., None] * target
        err = (realized_scores(q[3 * b:3 * b + 3], r) - want).abs().max().item()
        assert err <= 0.1, f"{pattern} sequence {b}: scores {err:.3f} log2 units off their targets"


def test_growing_logits_move_the_running_max_in_most_tiles():
    """The kernels' rule (common.cuh raised_max) applied to the generated scores, tile by tile."""
    for (slope, _), target in zip(GROWING_SLOPES, growing_logits("cpu")):
        running, moves = -math.inf, 0
        tile_maxes = target[:target.shape[0] // BLOCK_SIZE * BLOCK_SIZE].view(-1, BLOCK_SIZE).max(-1).values
        for tile_max in tile_maxes.tolist():
            if tile_max > running + RESCALE_LOG2:
                running, moves = tile_max, moves + 1
        share = (moves - 1) / (tile_maxes.shape[0] - 1)  # after the first tile, which always moves it
        if slope * BLOCK_SIZE > RESCALE_LOG2:
            assert share >= 0.75, f"slope {slope}: the max moved in {share:.0%} of the tiles"
        elif slope > 0:
            assert 0.3 <= share <= 0.7, f"slope {slope}: the max moved in {share:.0%} of the tiles"
        else:
            assert share == 0, f"slope {slope}: the max moved in {share:.0%} of the tiles"
