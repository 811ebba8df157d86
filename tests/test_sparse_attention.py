"""sparse_attention (DeepSeek Sparse Attention) against the float64 reference, on every kernel variant.

Each token's indices are distinct random slots of a cache over shuffled blocks; every row that no
token reads is NaN, so a kernel that reads a masked, padded or out-of-range entry (or one past a
token's topk_lens) shows NaN. Patterns: -1 in the middle and at the end, repeated indices, indices past
the cache and negative ones other than -1, a token with no row, a sink row scoring ~40 nats above the
rest and a jump in a later tile (the running max moves), odd head counts, k from 1 to 3,000 (tile and
split boundaries). Both addressings (physical slots, block-pointer positions with cu_q_lens), every
cache format (fp8_ds_mla with raw and power-of-two scales), CUDA-graph replay with new indices, each GPU
class's tiles, the dense kernels' result when the indices list every visible position, canaries around
out / lse, and the argument checks (CPU).
"""
import math

import pytest
import torch

import mla_kv
from mla_kv import gpus, layout, reference
from mla_kv.reference import quant

from gpu_checks import (ATTENTION_ARCHS, block_pointer_copy, capture_graph, check_attention, nan_outputs,
                        poisoned_workspace, random_cache, sequence_slots)

GPU = pytest.mark.gpu
SCALE = 1.0 / math.sqrt(192 + 64)
# out / lse tolerances of the quantized caches against the spec (the reader's values, rounded to q's
# dtype before the products): as tests/test_attention_quant.py's
SPEC_OUT_TOL = {torch.float16: 8e-3, torch.bfloat16: 4e-2}
SPEC_LSE_TOL = {torch.float16: 1e-2, torch.bfloat16: 6e-2}

CASES = {  # name -> (tokens, heads, topk, pattern)
    "t1-h16-k1": (1, 16, 1, "plain"),
    "t3-h20-k63-pad": (3, 20, 63, "pad"),
    "t2-h64-k64-repeats": (2, 64, 64, "repeats"),
    "t5-h16-k65-range": (5, 16, 65, "out_of_range"),
    "t6-h7-k200-empty": (6, 7, 200, "empty_token"),
    "t9-h32-k500-lens": (9, 32, 500, "lens"),
    "t4-h128-k2048-pad": (4, 128, 2048, "pad"),
    "t2-h64-k3000-sink": (2, 64, 3000, "sink"),
}


def make_indices(tokens, topk, num_slots, cache_slots, pattern, gen):
    """(indices int32 [T, k] on the host, topk_lens or None): distinct slots < num_slots per token, then
    the pattern's edits (out_of_range: slots past the cache's cache_slots, negative ones)."""
    idx = torch.stack([torch.randperm(num_slots, generator=gen)[:topk] for _ in range(tokens)]).int()
    lens = None
    if pattern == "pad":
        idx[:, topk - topk // 4:] = -1
        idx[torch.rand(idx.shape, generator=gen) < 0.15] = -1
    elif pattern == "repeats":
        half = topk // 2
        idx[:, half:2 * half] = idx[:, :half]
    elif pattern == "out_of_range":
        bad = torch.tensor([cache_slots, cache_slots + 3, -7, 2 ** 30, -(2 ** 31)], dtype=torch.int32)
        where = torch.rand(idx.shape, generator=gen) < 0.2
        idx[where] = bad[torch.randint(0, bad.numel(), (int(where.sum()),), generator=gen)]
    elif pattern == "empty_token":
        idx[1] = -1
    elif pattern == "lens":
        lens = torch.randint(0, topk + 1, (tokens,), generator=gen).int()
        lens[0], lens[1] = 0, topk
    return idx, lens


def read_slots(idx, lens, num_slots):
    """Every slot some token reads (within its length, inside the cache)."""
    counts = torch.full((idx.shape[0],), idx.shape[1]) if lens is None else lens.long()
    read = (torch.arange(idx.shape[1])[None, :] < counts[:, None]) & (idx >= 0) & (idx < num_slots)
    return idx[read].long().unique()


def sparse_cache(tokens, heads, topk, pattern, dtype, *, block_size=64, gen):
    """(q, cache, indices, topk_lens): a cache with NaN in every row no token reads; the sink pattern
    gives each token's first index a row that scores ~40 nats above the rest, and its index at 1,500 a
    row that scores ~20 above that one (the running max moves in a later tile)."""
    num_slots = max(2 * topk, 256)
    num_blocks = -(-num_slots // block_size) + 2
    cache = (torch.randn(num_blocks, block_size, 576, generator=gen) * 0.5).to(dtype)
    q = torch.randn(tokens, heads, 576, generator=gen).to(dtype)
    idx, lens = make_indices(tokens, topk, num_slots, num_blocks * block_size, pattern, gen)
    if lens is not None:  # entries past a token's length name rows nobody reads (NaN below)
        past = torch.arange(topk)[None, :] >= lens[:, None].long()
        idx[past] = torch.randint(num_slots, num_blocks * block_size, (int(past.sum()),), generator=gen).int()
    flat = cache.view(-1, 576)
    if pattern == "sink":
        for t in range(tokens):
            direction = q[t].float().mean(0)  # every head's scores of the row ~ nats
            for j, nats in ((0, 40.0), (1500, 60.0)):
                row = direction * (nats / (SCALE * float(direction.norm() ** 2)))
                flat[int(idx[t, j])] = row.to(dtype)
    keep = torch.zeros(flat.shape[0], dtype=torch.bool)
    keep[read_slots(idx, lens, num_blocks * block_size)] = True
    flat[~keep] = float("nan")
    return q.cuda(), cache.cuda(), idx.cuda(), None if lens is None else lens.cuda()


def run_sparse(q, kv_cache, indices, *, topk_lens=None, cu_q_lens=None, arch=None, smem_limits=None, **kw):
    """mla_kv.sparse_attention into NaN out / lse with a 0xFF workspace of its schedule."""
    schedule = mla_kv.sparse_attention_schedule(q.shape[0], q.shape[1], indices.shape[1], device=q.device, arch=arch,
                                                smem_limits=smem_limits)
    out, lse = nan_outputs(q, q.shape[:2])
    return mla_kv.sparse_attention(q, kv_cache, indices, SCALE, topk_lens=topk_lens, cu_q_lens=cu_q_lens, out=out,
                                   lse=lse, workspace=poisoned_workspace(schedule, q.device), schedule=schedule,
                                   arch=arch, **kw)


def reference_of(q, cache, indices, topk_lens=None, **kw):
    return reference.sparse_attention(q.double(), cache if kw else cache.double(), indices, SCALE,
                                      topk_lens=topk_lens, **kw)


# ------------------------------------------------------------------------------------ GPU
@GPU
@ATTENTION_ARCHS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_sparse_attention(case, dtype, arch):
    tokens, heads, topk, pattern = CASES[case]
    gen = torch.Generator().manual_seed(hash(case) % 2 ** 31)
    q, cache, idx, lens = sparse_cache(tokens, heads, topk, pattern, dtype, gen=gen)
    out, lse = run_sparse(q, cache, idx, topk_lens=lens, arch=arch)
    ref = reference_of(q, cache, idx, lens)
    check_attention(out, lse, *ref, f"{case} {dtype} {arch}")
    if pattern == "empty_token":
        assert bool((out[1] == 0).all()) and bool((lse[1] == -math.inf).all())


@GPU
@ATTENTION_ARCHS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sparse_attention_block_pointers(dtype, arch):
    """Positions of each token's sequence behind block pointers: 3 sequences (one of 0 tokens), a padded
    token past cu_q_lens[B], positions past a sequence's blocks and -1."""
    gen = torch.Generator().manual_seed(7)
    lens, q_lens, heads, topk = [700, 90, 1300], [2, 0, 3], 20, 257
    cache, table, seq_lens = random_cache(lens, 64, dtype)
    tokens = sum(q_lens) + 1
    cu = torch.tensor([0] + q_lens).cumsum(0).int()
    token_seq = [b for b, n in enumerate(q_lens) for _ in range(n)]
    pos = torch.full((tokens, topk), -1, dtype=torch.int32)
    for t, b in enumerate(token_seq):
        pos[t] = torch.randperm(lens[b], generator=gen)[:topk].int() if lens[b] >= topk else \
            torch.cat([torch.randperm(lens[b], generator=gen), torch.full((topk - lens[b],), -1)]).int()
    pos[0, 5] = 64 * 11 + 3       # past sequence 0's 11 blocks
    pos[2, 9] = 2 ** 30
    pos[tokens - 1] = torch.arange(topk).int()  # the padded token: reads nothing
    q = torch.randn(tokens, heads, 576, generator=gen).to(dtype).cuda()
    pool, blocks = block_pointer_copy(cache, table, lens)
    counts = [-(-n // 64) for n in lens]
    ids = torch.cat([table[b, :n].cpu().long() for b, n in enumerate(counts)])
    cu_blocks = torch.tensor([0] + counts).cumsum(0)
    ref = reference.sparse_attention_blocks(q.double(), pool, 1, ids, cu_blocks, cu, pos, SCALE)
    out, lse = run_sparse(q, blocks, pos.cuda(), cu_q_lens=cu.cuda(), arch=arch)
    check_attention(out, lse, *ref, f"block pointers {dtype} {arch}")
    assert bool((out[-1] == 0).all()) and bool((lse[-1] == -math.inf).all())


def pow2_ds_mla(rows):
    """fp8_ds_mla bytes of rows [N, 576] with power-of-two tile scales (DeepSeek's ue8m0 style)."""
    x = rows.float()
    tiles = x[:, :512].reshape(-1, 4, 128)
    scale = torch.clamp(tiles.abs().amax(-1) / 448.0, min=torch.finfo(torch.float32).tiny)
    scale = torch.exp2(torch.ceil(torch.log2(scale)))
    codes = quant.e4m3_codes(tiles / scale[..., None]).reshape(-1, 512)
    rope = x[:, 512:].to(torch.bfloat16).contiguous().view(torch.uint8).reshape(-1, 128)
    return torch.cat([codes, scale.contiguous().view(torch.uint8).reshape(-1, 16), rope], -1)


QUANT = ["fp8", "fp8_ds_mla", "fp8_ds_mla-pow2", "int8", "int4"]


@GPU
@ATTENTION_ARCHS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", QUANT)
@pytest.mark.parametrize("case", ["t3-h20-k63-pad", "t4-h128-k2048-pad", "t5-h16-k65-range"])
def test_sparse_attention_quantized(case, fmt, dtype, arch):
    tokens, heads, topk, pattern = CASES[case]
    kv_format = fmt.split("-")[0]
    gen = torch.Generator().manual_seed(len(case) * 31 + len(fmt))
    q, rows, idx, lens = sparse_cache(tokens, heads, topk, pattern, dtype, gen=gen)
    num_blocks, block_size = rows.shape[:2]
    flat = rows.view(-1, 576).cpu()
    kv_scale = 0.02 if kv_format == "fp8" else None
    data = torch.zeros(layout.paged_cache_shape(kv_format, num_blocks, block_size, dtype), dtype=torch.uint8)
    live = torch.isfinite(flat).all(-1)
    slots = live.nonzero().flatten()
    if fmt == "fp8_ds_mla-pow2":
        data.view(-1, 656)[slots] = pow2_ds_mla(flat[slots])
    else:
        quant.write_rows(data, flat[slots].to(dtype), slots, kv_format, kv_scale=kv_scale)
    if kv_format in ("fp8", "fp8_ds_mla"):  # rows nobody reads: NaN codes
        data.view(num_blocks * block_size, -1)[~live, :512] = 0x7F
    ref = reference_of(q, data.cuda(), idx, lens, kv_format=kv_format, kv_scale=kv_scale, scale_dtype=dtype)
    out, lse = run_sparse(q, data.cuda(), idx, topk_lens=lens, arch=arch, kv_format=kv_format, kv_scale=kv_scale)
    check_attention(out, lse, *ref, f"{case} {fmt} {dtype} {arch}", out_tol=SPEC_OUT_TOL[dtype],
                    lse_tol=SPEC_LSE_TOL[dtype])


@GPU
@ATTENTION_ARCHS
@pytest.mark.parametrize("heads", [16, 128])
def test_sparse_equals_dense_when_every_position_is_listed(heads, arch):
    """Indices listing each sequence's positions in order: decode's result (same kernels, other splits)."""
    lens = [1, 64, 650, 2000]
    cache, table, seq_lens = random_cache(lens, 64, torch.float16)
    q = torch.randn(len(lens), 1, heads, 576, device="cuda").half()
    topk = max(lens)
    idx = torch.full((len(lens), topk), -1, dtype=torch.int32)
    for b, s in enumerate(sequence_slots(table, lens, 64, cache.shape[0])):
        idx[b, :s.numel()] = s.int()
    dense_out, dense_lse = mla_kv.decode(q, cache, table, seq_lens, SCALE, arch=arch)
    out, lse = run_sparse(q[:, 0], cache, idx.cuda(), arch=arch)
    check_attention(out, lse, dense_out[:, 0].double(), dense_lse[:, 0].double(), f"sparse vs decode H={heads} {arch}",
                    out_tol=2e-3, lse_tol=1e-4)


@GPU
def test_sparse_attention_in_cuda_graph_with_new_indices():
    gen = torch.Generator().manual_seed(3)
    tokens, heads, topk = 4, 64, 300
    q, cache, idx, _ = sparse_cache(tokens, heads, topk, "pad", torch.bfloat16, gen=gen)
    schedule = mla_kv.sparse_attention_schedule(tokens, heads, topk, device=q.device)
    workspace = poisoned_workspace(schedule, q.device)
    out, lse = nan_outputs(q, q.shape[:2])
    step_idx = idx.clone()
    graph = capture_graph(lambda: mla_kv.sparse_attention(q, cache, step_idx, SCALE, out=out, lse=lse,
                                                          workspace=workspace, schedule=schedule))
    for step in range(3):
        new = idx[:, torch.randperm(topk, generator=gen)]  # the same rows (all finite) in another order ...
        new[:, :step * 50] = -1                            # ... fewer of them each step
        step_idx.copy_(new)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        check_attention(out, lse, *reference_of(q, cache, new), f"graph replay {step}")


def runnable(g):
    cc = torch.cuda.get_device_capability()
    return int(g.arch[2:]) <= cc[0] * 10 + cc[1] and g.smem.per_block <= mla_kv.ops._C.device_smem_limits().per_block


@GPU
@pytest.mark.parametrize("name", list(gpus.gpu_classes()))
def test_sparse_attention_under_each_gpu_class(name):
    g = gpus.gpu_classes()[name]
    if not runnable(g):
        pytest.skip(f"{name}: its variant or shared memory exceeds this GPU")
    gen = torch.Generator().manual_seed(11)
    for tokens, heads, topk in ((2, 16, 300), (3, 20, 129), (1, 128, 2048)):
        q, cache, idx, _ = sparse_cache(tokens, heads, topk, "pad", torch.float16, gen=gen)
        schedule = mla_kv.sparse_attention_schedule(tokens, heads, topk, device=q.device, arch=g.arch,
                                                    smem_limits=name)
        assert schedule.tiles.smem_bytes <= g.smem.per_block
        out, lse = run_sparse(q, cache, idx, arch=g.arch, smem_limits=name)
        check_attention(out, lse, *reference_of(q, cache, idx), f"{name} {g.arch} H={heads} tiles={schedule.tiles}")


@GPU
def test_sparse_attention_writes_only_its_rows():
    gen = torch.Generator().manual_seed(5)
    q, cache, idx, _ = sparse_cache(3, 20, 100, "pad", torch.float16, gen=gen)
    big_out = torch.full((5, 20, 512), 7.0, dtype=torch.float16, device="cuda")
    big_lse = torch.full((5, 20), 7.0, device="cuda")
    mla_kv.sparse_attention(q, cache, idx, SCALE, out=big_out[1:4], lse=big_lse[1:4])
    for t in (0, 4):
        assert bool((big_out[t] == 7).all()) and bool((big_lse[t] == 7).all())
    check_attention(big_out[1:4], big_lse[1:4], *reference_of(q, cache, idx), "canaries")


@GPU
def test_sparse_attention_validate_names_the_bad_index():
    gen = torch.Generator().manual_seed(1)
    q, cache, idx, _ = sparse_cache(2, 16, 64, "plain", torch.float16, gen=gen)
    bad = idx.clone()
    bad[1, 7] = cache.shape[0] * cache.shape[1]
    out, lse = nan_outputs(q, q.shape[:2])
    with pytest.raises(ValueError, match=r"indices: \[1, 7\]"):
        mla_kv.sparse_attention(q, cache, bad, SCALE, out=out, lse=lse, validate=True)
    assert bool(out.isnan().all()) and bool(lse.isnan().all())  # nothing written


# ------------------------------------------------------------------------------------ CPU
def test_reference_equals_dense_decode_when_every_position_is_listed():
    gen = torch.Generator().manual_seed(2)
    lens = [1, 5, 130]
    cache = torch.randn(16, 32, 576, generator=gen, dtype=torch.float64)
    table = torch.randperm(16, generator=gen)[:15].view(3, 5).int()
    q = torch.randn(3, 1, 4, 576, generator=gen, dtype=torch.float64)
    slots = layout.block_table_slots(table, torch.tensor(lens), 32)
    idx = torch.full((3, 130), -1, dtype=torch.int32)
    for b, s in enumerate(slots):
        idx[b, torch.randperm(s.numel(), generator=gen)] = s.int()  # any order
    ref_out, ref_lse = reference.decode(q, cache, table, torch.tensor(lens).int(), SCALE)
    out, lse = reference.sparse_attention(q[:, 0], cache, idx, SCALE)
    torch.testing.assert_close(out, ref_out[:, 0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse[:, 0], rtol=1e-12, atol=1e-12)


def test_reference_masks_missing_rows_and_counts_repeats():
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(2, 16, 576, generator=gen, dtype=torch.float64)
    q = torch.randn(3, 2, 576, generator=gen, dtype=torch.float64)
    idx = torch.tensor([[3, -1, 40, 5], [-1, -1, -1, -1], [3, 3, 9, 1]], dtype=torch.int32)
    out, lse = reference.sparse_attention(q, cache, idx, SCALE, topk_lens=torch.tensor([4, 4, 3]))
    flat = cache.view(-1, 576)
    for t, rows in ((0, [3, 5]), (2, [3, 3, 9])):
        s = q[t] @ flat[rows].T * SCALE
        torch.testing.assert_close(lse[t], torch.logsumexp(s, -1))
        torch.testing.assert_close(out[t], torch.softmax(s, -1) @ flat[rows, :512])
    assert bool((out[1] == 0).all()) and bool((lse[1] == -math.inf).all())


def test_reference_block_slots():
    ids, cu_blocks = torch.tensor([5, 2, 7]), torch.tensor([0, 2, 3])
    cu_q = torch.tensor([0, 1, 3])
    pos = torch.tensor([[0, 17, 32, -1], [15, 16, 0, 99], [3, -2, 1, 0]], dtype=torch.int32)
    slots = reference.sparse.block_slots(pos, ids, cu_blocks, cu_q, 16)
    assert slots.tolist() == [[80, 33, -1, -1], [127, -1, 112, -1], [115, -1, 113, 112]]


def test_sparse_attention_arguments_are_checked():
    q = torch.randn(3, 4, 576)
    cache = torch.randn(4, 16, 576)
    idx = torch.zeros(3, 8, dtype=torch.int32)
    with pytest.raises(TypeError, match="indices"):
        mla_kv.sparse_attention(q, cache, idx.long(), SCALE)
    with pytest.raises(ValueError, match="indices"):
        mla_kv.sparse_attention(q, cache, idx[:2], SCALE)
    with pytest.raises(ValueError, match="indices"):
        mla_kv.sparse_attention(q, cache, idx[:, None], SCALE)
    with pytest.raises(ValueError, match="topk_lens"):
        mla_kv.sparse_attention(q, cache, idx, SCALE, topk_lens=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_q_lens"):
        mla_kv.sparse_attention(q, cache, idx, SCALE, cu_q_lens=torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="softmax_scale"):
        mla_kv.sparse_attention(q, cache, idx, -1.0)
    with pytest.raises(ValueError, match="q"):
        mla_kv.sparse_attention(q[:, :, :512], cache, idx, SCALE)
    bad = idx.clone()
    bad[2, 3] = 64
    with pytest.raises(ValueError, match=r"indices: \[2, 3\] = 64"):
        mla_kv.sparse_attention(q, cache, bad, SCALE, validate=True)
    with pytest.raises(ValueError, match="topk_lens"):
        mla_kv.sparse_attention(q, cache, idx, SCALE, topk_lens=torch.tensor([1, 9, 0], dtype=torch.int32),
                                validate=True)
    out, lse = mla_kv.sparse_attention(q, cache, idx, SCALE)  # CPU: the reference
    torch.testing.assert_close(out, reference.sparse_attention(q, cache, idx, SCALE)[0])
