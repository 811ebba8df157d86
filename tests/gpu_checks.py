"""Shared helpers of the kernel tests: the attention variants to run, caches whose unwritten rows
are NaN, attention launches into fresh poisoned buffers, and the per-row comparison with the float64
reference.

Every attention launch made through run_decode / run_prefill gets its own out and lse filled with
NaN and its own workspace filled with 0xFF bytes (NaN as float32), so a row or split partial the
kernels fail to write shows up instead of a value left by an earlier launch.
"""
from __future__ import annotations

import math

import pytest
import torch

import mla_kv
from mla_kv.layout import LATENT_DIM, ROW_DIM, BlockPointerCache, BlockPool, block_table_slots, to_rope_first

# Per-row tolerance on out, relative to the row's reference norm. The kernels round P to the input
# dtype (up to 2^-8 relative in bf16, 2^-11 in fp16) and round out once more; the fp32 rows of
# merge_states only accumulate in fp32.
OUT_TOL = {torch.float16: 3e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}
# lse: elementwise, absolute plus a part relative to |lse|: scores come from fp32 sums of 576
# products, whose rounding grows with the score itself (large in the score-pattern tests).
LSE_TOL = 1e-3
LSE_REL_TOL = 1e-5
# A row's error is judged against max(its reference norm, this fraction of the median row norm).
# Rounding errors scale with the values a row averages: averaging many values shrinks the row's
# norm and its error alike, so only a row that cancels (or whose reference is exactly 0, such as a
# row that sees only zero rows) could fail by relative error alone; there 1% of a typical row's
# norm is the scale of the error it can carry.
ROW_NORM_FLOOR = 1e-2


# The attention kernels' variants for the `arch` fixture (tests/conftest.py): the GPU's best and
# every older one that runs here; on Hopper best takes the wgmma kernel, so sm80 keeps the mma.sync
# kernel covered (the fixture skips sm80 below sm90), and bf16 skips sm75 / sm70.
ATTENTION_ARCHS = pytest.mark.arch_variants("best", "sm80", "sm75", "sm70", bf16_needs_sm80=True)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's elements as same-size integers (a contiguous copy): equality is bit equality, NaN included."""
    return t.contiguous().view(_BITS[t.element_size()])


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN equals NaN of the same bits)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


# ----------------------------------------------------------------------------------- caches
def block_counts(lens, block_size):
    """Blocks each sequence's positions need (at least one: every table row gets a real block)."""
    return [max(1, -(-n // block_size)) for n in lens]


def random_table(need, num_blocks, gen=None, shared_prefix_blocks=0, device="cuda"):
    """Shuffled distinct blocks, need[b] for sequence b; the first shared_prefix_blocks are shared by
    all. Entries past a sequence's blocks hold an id outside the cache."""
    width = max(need) + 1
    perm = torch.randperm(num_blocks, generator=gen, device=device).int()
    table = torch.full((len(need), width), num_blocks + 7, dtype=torch.int32, device=device)
    shared, used = perm[:shared_prefix_blocks], shared_prefix_blocks
    for b, n in enumerate(need):
        own = n - shared_prefix_blocks
        table[b, :shared_prefix_blocks] = shared
        table[b, shared_prefix_blocks:n] = perm[used:used + own]
        used += own
    assert used <= num_blocks
    return table


def packed_batch(context, new, block_size):
    """A packed prefill batch over shuffled blocks: sequence b has context[b] cached positions and new[b] new
    tokens. -> (table int32 [B, max blocks], cu_q_lens int32 [B + 1], seq [T] (each token's sequence),
    positions [T], slots [T] int64, num_blocks: the table's blocks plus 2 spare)."""
    kv = [c + n for c, n in zip(context, new)]
    need = [max(1, -(-n // block_size)) for n in kv]
    num_blocks = len(kv) * max(need) + 2
    table = torch.randperm(num_blocks)[:len(kv) * max(need)].view(len(kv), -1).int()
    seq = torch.repeat_interleave(torch.arange(len(new)), torch.tensor(new))
    cu = torch.tensor([0, *new]).cumsum(0).int()
    positions = torch.tensor(context)[seq] + torch.arange(len(seq)) - cu[:-1].long()[seq]
    slots = table[seq, positions // block_size].long() * block_size + positions % block_size
    return table, cu, seq, positions, slots, num_blocks


def sequence_slots(table, lens, block_size, num_blocks):
    """Per sequence, the cache slots of its positions 0 .. len-1 that the table maps into the cache
    (host tensors; positions past the table or on block ids outside the cache are left out)."""
    width = table.shape[1]
    clipped = torch.as_tensor(lens).cpu().long().clamp(0, width * block_size)
    slots = block_table_slots(table, clipped, block_size)
    return [s[(s >= 0) & (s < num_blocks * block_size)] for s in slots]


def poison_unwritten(cache, table, lens):
    """NaN in every row of the paged cache that no sequence's positions < len map to (the tail of
    each last block, unused blocks): a kernel that reads one into its output shows NaN."""
    num_blocks, block_size = cache.shape[:2]
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for slots in sequence_slots(table, lens, block_size, num_blocks):
        written[slots] = True
    cache.view(-1, ROW_DIM)[~written.to(cache.device)] = float("nan")
    return cache


def random_cache(lens, block_size, dtype, *, shared_prefix_blocks=0, spare_blocks=4):
    """(cache, table, seq_lens): rows N(0, 0.5^2) at every position a sequence has, NaN elsewhere."""
    need = block_counts(lens, block_size)
    num_blocks = sum(need) + spare_blocks
    cache = (torch.randn(num_blocks, block_size, ROW_DIM, device="cuda") * 0.5).to(dtype)
    table = random_table(need, num_blocks, shared_prefix_blocks=shared_prefix_blocks)
    poison_unwritten(cache, table, lens)
    return cache, table, torch.tensor(lens, dtype=torch.int32, device="cuda")


def cache_with_rows(rows, block_size, *, spare_blocks=4):
    """(cache, table, seq_lens) holding rows[b] ([len_b, 576]) as sequence b's positions over
    shuffled blocks, NaN everywhere else."""
    lens = [r.shape[0] for r in rows]
    device, dtype = rows[0].device, rows[0].dtype
    need = block_counts(lens, block_size)
    num_blocks = sum(need) + spare_blocks
    cache = torch.full((num_blocks, block_size, ROW_DIM), float("nan"), dtype=dtype, device=device)
    table = random_table(need, num_blocks, device=device)
    flat = cache.view(-1, ROW_DIM)
    for slots, r in zip(sequence_slots(table, lens, block_size, num_blocks), rows):
        flat[slots.to(device)] = r
    return cache, table, torch.tensor(lens, dtype=torch.int32, device=device)


def block_pointer_copy(cache, table, lens, *, rope_first=True, num_layers=2, layer=1):
    """The paged cache's sequences as a block-pointer cache: a BlockPool whose layer ``layer`` holds
    the same rows (in the pool's row order) and whose other layers are NaN; each sequence owns the
    blocks of its table row that its length needs. Returns (pool, BlockPointerCache)."""
    num_blocks, block_size = cache.shape[:2]
    pool = BlockPool(num_blocks, num_layers, block_size, cache.dtype, cache.device, rope_first=rope_first)
    pool.storage.fill_(float("nan"))
    pool.storage[:, layer] = to_rope_first(cache) if rope_first else cache
    counts = [-(-max(int(n), 0) // block_size) for n in lens]
    ids = torch.cat([table[b, :n].cpu().long() for b, n in enumerate(counts)])
    cu_blocks = torch.tensor([0] + counts).cumsum(0).int()
    return pool, pool.cache(layer, ids, cu_blocks)


# ------------------------------------------------------------------------------ launches
def split_schedule(num_splits, tokens_per_split, total_q_tokens, heads):
    """A hand-made schedule (splits of tokens_per_split kv positions) with the workspace it needs."""
    return mla_kv.AttentionSchedule(num_splits, tokens_per_split,
                                    mla_kv.ops._C.attention_workspace_size(total_q_tokens, heads, num_splits))


def default_schedule(q, kv_cache, block_table, *, packed_batch=None, arch=None, smem_limits=None, kv_format=None,
                     block_size=None):
    """The schedule decode (packed_batch None) or prefill (packed_batch = B) picks when given none
    (the sizes ops.decode / ops.prefill pass to attention_schedule), so that a test can pass it
    with a poisoned workspace of its own; smem_limits: plan as a GPU with those limits would;
    kv_format / block_size: a quantized paged cache's (its shape does not give the block size)."""
    heads = q.shape[-2]
    if isinstance(kv_cache, BlockPointerCache):
        max_kv = kv_cache.block_ptrs.shape[0] * kv_cache.block_seq_len
    else:
        max_kv = block_table.shape[1] * (block_size or kv_cache.shape[1])
    if packed_batch is None:
        return mla_kv.attention_schedule(q.shape[0], q.shape[1], heads, max_kv, device=q.device, arch=arch,
                                         smem_limits=smem_limits, kv_format=kv_format)
    tokens = q.shape[0]
    return mla_kv.attention_schedule(packed_batch, max(1, -(-tokens // packed_batch)), heads, max_kv,
                                     total_q_tokens=tokens, device=q.device, arch=arch, smem_limits=smem_limits,
                                     kv_format=kv_format)


def poisoned_workspace(schedule, device):
    """A fresh workspace of 0xFF bytes (None when the schedule does not split the KV)."""
    if schedule.workspace_bytes == 0:
        return None
    return torch.full((schedule.workspace_bytes,), 0xFF, dtype=torch.uint8, device=device)


def nan_outputs(q, rows_shape):
    """Fresh out (q's dtype) and lse (float32) for ``rows_shape`` query rows, filled with NaN."""
    out = torch.full((*rows_shape, LATENT_DIM), float("nan"), dtype=q.dtype, device=q.device)
    return out, torch.full(rows_shape, float("nan"), dtype=torch.float32, device=q.device)


def run_decode(q, kv_cache, block_table, seq_lens, scale, *, arch=None, schedule=None, out=None, lse=None,
               validate=False):
    """mla_kv.decode into fresh NaN out/lse (unless given) with a fresh poisoned workspace."""
    if schedule is None:
        schedule = default_schedule(q, kv_cache, block_table, arch=arch)
    fresh_out, fresh_lse = nan_outputs(q, q.shape[:3])
    return mla_kv.decode(q, kv_cache, block_table, seq_lens, scale, out=fresh_out if out is None else out,
                         lse=fresh_lse if lse is None else lse, workspace=poisoned_workspace(schedule, q.device),
                         schedule=schedule, validate=validate, arch=arch)


def run_prefill(q, kv_cache, block_table, cu_q_lens, kv_lens, scale, *, causal=True, arch=None, schedule=None,
                out=None, lse=None, validate=False):
    """mla_kv.prefill into fresh NaN out/lse (unless given) with a fresh poisoned workspace."""
    if schedule is None:
        schedule = default_schedule(q, kv_cache, block_table, packed_batch=cu_q_lens.shape[0] - 1, arch=arch)
    fresh_out, fresh_lse = nan_outputs(q, q.shape[:2])
    return mla_kv.prefill(q, kv_cache, block_table, cu_q_lens, kv_lens, scale, causal=causal,
                          out=fresh_out if out is None else out, lse=fresh_lse if lse is None else lse,
                          workspace=poisoned_workspace(schedule, q.device), schedule=schedule,
                          validate=validate, arch=arch)


# ---------------------------------------------------------------------------- comparison
def _row_name(flat: int, shape, cu_q_lens) -> str:
    """(b, s, h) of flat row index ``flat`` of rows shaped ``shape`` ([B, S_q, H] or packed [T, H]
    with cu_q_lens)."""
    if cu_q_lens is not None:
        token, h = divmod(flat, shape[-1])
        cu = torch.as_tensor(cu_q_lens).cpu().long()
        b = int(torch.searchsorted(cu[1:], torch.tensor(token), right=True))
        return f"(b={b}, s={token - int(cu[b])}, h={h})"
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    names = {3: ("b", "s", "h"), 2: ("t", "h")}.get(len(shape), tuple(f"d{i}" for i in range(len(shape))))
    return "(" + ", ".join(f"{n}={i}" for n, i in zip(names, reversed(index))) + ")"


def check_attention(out, lse, ref_out, ref_lse, what, *, cu_q_lens=None, out_tol=None, lse_tol=LSE_TOL):
    """Compares every (sequence, query, head) row of out/lse with the float64 reference.

    Rows that see a key (finite reference lse) must be finite, within out_tol (default by out's
    dtype) of the reference relative to the row's own norm (floored, see ROW_NORM_FLOOR), and their
    lse within lse_tol + LSE_REL_TOL |lse|; rows that see none must be exactly 0 with lse -inf. A
    failure names the worst row as (b, s, h) (packed rows through cu_q_lens) and its error.
    """
    shape = tuple(lse.shape)
    assert tuple(out.shape[:-1]) == shape == tuple(ref_lse.shape) and out.shape == ref_out.shape, \
        f"{what}: shapes {tuple(out.shape)}, {shape} vs reference {tuple(ref_out.shape)}, {tuple(ref_lse.shape)}"
    tol = OUT_TOL[out.dtype] if out_tol is None else out_tol
    got, want = out.double().reshape(-1, out.shape[-1]), ref_out.double().reshape(-1, out.shape[-1])
    got_lse, want_lse = lse.double().reshape(-1), ref_lse.double().reshape(-1)
    sees = torch.isfinite(want_lse)

    def fail_worst(bad, score, message):
        if bool(bad.any()):
            worst = int(torch.where(bad, score, -math.inf).argmax())
            raise AssertionError(f"{what}: row {_row_name(worst, shape, cu_q_lens)} {message(worst)} "
                                 f"({int(bad.sum())} of {bad.numel()} rows)")

    not_finite = sees & ~(torch.isfinite(got).all(-1) & torch.isfinite(got_lse))
    fail_worst(not_finite, not_finite.double(), lambda i: f"not finite (lse {got_lse[i].item()}; the reference "
                                                          f"is finite): unwritten or bad math")
    not_empty = ~sees & ((got != 0).any(-1) | (got_lse != -math.inf))
    fail_worst(not_empty, not_empty.double(), lambda i: f"sees no key but has out max "
                                                        f"{got[i].abs().max().item():.3g}, lse {got_lse[i].item()}")
    norms = want.norm(dim=-1)
    nonzero = norms[sees & (norms > 0)]
    floor = ROW_NORM_FLOOR * (nonzero.median() if nonzero.numel() else norms.new_tensor(1.0))
    err = torch.where(sees, (got - want).norm(dim=-1) / norms.clamp_min(floor), 0.0)
    fail_worst(err > tol, err, lambda i: f"out error {err[i].item():.2e} > {tol:.1e} (reference norm "
                                         f"{norms[i].item():.3g})")
    lse_err = torch.where(sees, (got_lse - want_lse).abs(), 0.0)
    lse_bound = lse_tol + LSE_REL_TOL * torch.where(sees, want_lse.abs(), 0.0)
    fail_worst(lse_err > lse_bound, lse_err - lse_bound,
               lambda i: f"lse error {lse_err[i].item():.2e} > {lse_bound[i].item():.1e} "
                         f"(reference {want_lse[i].item():.4f})")


def capture_graph(step) -> torch.cuda.CUDAGraph:
    """Runs ``step`` once on a side stream (allocator and kernel warm-up, as torch asks before a
    capture), then captures it into a CUDA graph and returns the graph (not yet replayed)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph
