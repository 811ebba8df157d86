"""mla_kv.parallel on the CPU: context parallelism (positions, slots, write, decode, prefill, merge) and
the head-parallel recipe, against single-process attention through the reference ops.

The cp cases run twice: all ranks in this process merged by merge_partial_states, and as 2 and 4
gloo processes merged by cp_merge (tests/parallel_worker.py holds the shared scenarios).

The block-pointer form (each rank's cache a layout.BlockPointerCache into a BlockPool) runs its
scenarios twice too: on the GPU with the kernels (tests marked gpu), and on the CPU with CpuBlockOps
standing in for the block-pointer ops, which run on CUDA only, so that the class block lists cp_prefill
builds and the arguments the cp functions hand the ops are checked in CI.
"""
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

import mla_kv
import parallel_worker as pw
from mla_kv import layout, ops, parallel, reference
from mla_kv.layout import ROW_DIM, BlockPointerCache, BlockPool, block_slots, to_latent_first, to_rope_first
from mla_kv.rope import cos_sin_cache

from gpu_checks import (ATTENTION_ARCHS, OUT_TOL, cache_with_rows, check_attention, nan_outputs, poisoned_workspace,
                        same_bytes)

GPU = pytest.mark.gpu
# The write kernels' variants, as in tests/test_write.py: the device's best and, where the dtype allows,
# the Volta one.
WRITE_ARCHS = pytest.mark.arch_variants("best", "sm70", bf16_needs_sm80=True)


# ------------------------------------------------------------------------ positions and slots
def test_local_lens_hand_examples():
    lens = torch.tensor([0, 1, 5, 7], dtype=torch.int32)
    assert parallel.cp_local_lens(lens, 2, 0).tolist() == [0, 1, 3, 4]
    assert parallel.cp_local_lens(lens, 2, 1).tolist() == [0, 0, 2, 3]
    assert [parallel.cp_local_lens(lens, 4, r).tolist() for r in range(4)] == [
        [0, 1, 2, 2], [0, 0, 1, 2], [0, 0, 1, 2], [0, 0, 1, 1]]
    assert parallel.cp_local_lens(lens, 1, 0).tolist() == lens.tolist()
    assert parallel.cp_local_lens(lens, 2, 0).dtype == torch.int32


def test_local_lens_count_positions():
    lens = torch.randint(0, 300, (50,))
    for cp in (2, 3, 5, 8):
        counts = torch.stack([parallel.cp_local_lens(lens, cp, r) for r in range(cp)])
        assert torch.equal(counts.sum(0), lens.int())
        for n, row in zip(lens.tolist(), counts.t().tolist()):
            assert row == [sum(1 for t in range(n) if t % cp == r) for r in range(cp)]


def test_local_positions_hand_example():
    # Sequence 0: history 3, new tokens at positions 3, 4; sequence 1: no history, positions 0, 1, 2;
    # row 5 is padding.
    cu, hist = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([3, 0], dtype=torch.int32)
    one = parallel.cp_local_positions(cu, hist, 2, 1, num_tokens=6)
    assert one.seq_ids.tolist() == [0, 0, 1, 1, 1, 2]
    assert one.positions.tolist() == [3, 4, 0, 1, 2, 0]
    assert one.owned.tolist() == [True, False, False, True, False, False]
    assert one.local_positions.tolist() == [1, 2, 0, 0, 1, 0]
    zero = parallel.cp_local_positions(cu, hist, 2, 0)  # T read from cu_q_lens: no padding row
    assert zero.owned.tolist() == [False, True, True, False, True]

    # Block size 2. Rank 1 owns position 3 of seq 0 (local 1 -> block 5, offset 1) and position 1
    # of seq 1 (local 0 -> block 2).
    table1 = torch.tensor([[5, 7], [2, 9]], dtype=torch.int32)
    assert parallel.cp_slot_mapping(one, table1, 2).tolist() == [11, -1, -1, 4, -1, -1]
    # Rank 0: position 4 of seq 0 (local 2 -> block 3), positions 0 and 2 of seq 1 (local 0, 1 -> block 4).
    table0 = torch.tensor([[1, 3], [4, 6]], dtype=torch.int32)
    assert parallel.cp_slot_mapping(zero, table0, 2).tolist() == [-1, 6, 8, -1, 9]
    # A local position past the table is skipped, not written elsewhere.
    assert parallel.cp_slot_mapping(zero, table0[:, :1].contiguous(), 2).tolist() == [-1, -1, 8, -1, 9]


def test_every_token_has_one_owner_and_distinct_slots():
    batch = 5
    hist = torch.randint(0, 40, (batch,), dtype=torch.int32)
    new = torch.randint(0, 9, (batch,), dtype=torch.int32)
    cu = torch.nn.functional.pad(new.cumsum(0), (1, 0)).int()
    tokens = int(cu[-1]) + 3  # three padding rows
    for cp in (1, 2, 3, 4):
        owners = torch.zeros(tokens, dtype=torch.long)
        for rank in range(cp):
            t = parallel.cp_local_positions(cu, hist, cp, rank, num_tokens=tokens)
            owners += t.owned.long()
            assert torch.equal(t.positions[t.owned] % cp, torch.full_like(t.positions[t.owned], rank))
            width = 20
            table = torch.randperm(batch * width).int().view(batch, width)
            slots = parallel.cp_slot_mapping(t, table, 4)
            kept = slots[slots >= 0]
            assert torch.equal(slots >= 0, t.owned) and kept.unique().numel() == kept.numel()
        assert owners.tolist() == [1] * int(cu[-1]) + [0] * 3


@pytest.mark.parametrize("cp", [2, 3])
def test_rank_caches_hold_the_global_rows(cp):
    batch = pw.make_batch(int(torch.randint(0, 1 << 30, ())), [0, 9, 22], [5, 1, 7])
    global_cache, global_table, _ = pw.write_global(batch)
    lens = pw.total_lens(batch)
    global_rows = reference.gather_kv(global_cache, global_table, torch.nn.functional.pad(lens.cumsum(0), (1, 0)).int())
    for rank in range(cp):
        cache, table, _ = pw.write_rank(batch, cp, rank, seed=3)
        local = parallel.cp_local_lens(lens, cp, rank)
        rows = reference.gather_kv(cache, table, torch.nn.functional.pad(local.cumsum(0), (1, 0)).int())
        start, local_start = 0, 0
        for n, m in zip(lens.tolist(), local.tolist()):
            torch.testing.assert_close(rows[local_start:local_start + m], global_rows[start + rank:start + n:cp],
                                       rtol=0, atol=0)
            start, local_start = start + n, local_start + m


# -------------------------------------------------------------------------- cp attention
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_cp_attention_in_one_process(cp):
    seed = int(torch.randint(0, 1 << 30, ()))
    for name, batch, kind in pw.scenarios(seed):
        parts = [pw.rank_case(batch, kind, cp, rank, seed) for rank in range(cp)]
        truth_out, truth_lse, truth_q = pw.truth_case(batch, kind)
        for _, _, q in parts:
            assert torch.equal(q, truth_q), f"cp {cp}, {name}: q rotated differently from the single-process write"
        out, lse = parallel.merge_partial_states(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
        pw.check_merged(out, lse, truth_out, truth_lse, f"cp {cp}, {name}")


def test_cp_decode_rank_partial_is_attention_over_its_tokens():
    """One rank's partial result alone: the reference over only its positions <= each query's."""
    cp, rank, s_q = 3, 1, 3
    batch = pw.make_batch(11, [0, 4, 17], [s_q] * 3)
    out, lse, q = pw.rank_decode(batch, cp, rank, seed=2)
    cache, table, _ = pw.write_global(batch)
    for b, total in enumerate(pw.total_lens(batch).tolist()):
        for i in range(s_q):
            p = total - s_q + i
            keys = [t for t in range(p + 1) if t % cp == rank]
            rows = cache[table[b, torch.tensor(keys, dtype=torch.long) // pw.BLOCK_SIZE].long(),
                         torch.tensor(keys, dtype=torch.long) % pw.BLOCK_SIZE].double()
            scores = torch.einsum("hd,ld->hl", q.view(3, s_q, pw.HEADS, 576)[b, i].double(), rows) * pw.SCALE
            if not keys:
                assert torch.isinf(lse[b, i]).all() and (out[b, i] == 0).all()
                continue
            torch.testing.assert_close(lse[b, i].double(), torch.logsumexp(scores, -1), **pw.TOL)
            torch.testing.assert_close(out[b, i].double(), torch.softmax(scores, -1) @ rows[:, :512], **pw.TOL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4])
def test_cp_over_gloo_processes(world, monkeypatch):
    package_root = os.path.dirname(os.path.dirname(mla_kv.__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    seed = int(torch.randint(0, 1 << 30, ()))
    mp.spawn(pw.worker, args=(world, _free_port(), seed, mla_kv.__file__), nprocs=world, join=True)


def test_merge_partial_states_edges():
    outs = torch.randn(3, 2, 5, 512)
    lses = torch.randn(3, 2, 5)
    lses[1, 0] = float("-inf")  # rank 1 saw nothing for these rows
    out, lse = parallel.merge_partial_states(outs, lses)
    weights = torch.softmax(lses.double(), dim=0)
    torch.testing.assert_close(out.double(), (weights[..., None] * outs.double()).sum(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), torch.logsumexp(lses.double(), 0), rtol=1e-6, atol=1e-6)
    given_out, given_lse = torch.empty(2, 5, 512), torch.empty(2, 5)
    one = parallel.merge_partial_states(outs[:1], lses[:1], out=given_out, lse=given_lse)
    assert one[0] is given_out and torch.equal(given_out, outs[0]) and torch.equal(given_lse, lses[0])


# ------------------------------------------------------------- block pointers (TurboMind's form)
def test_class_block_pointers_hand_example():
    """Blocks 100..105; sequence 0 owns 100, 101, sequence 1 none, sequence 2 owns 102..104, entry 5
    nobody. Under cp 2, class (b, g) = b * 2 + g gets sequence b's list, each list twice in place."""
    ptrs = torch.arange(100, 106, dtype=torch.int64)
    class_ptrs, class_cu = parallel.cp_class_block_pointers(ptrs, torch.tensor([0, 2, 2, 5], dtype=torch.int32), 2)
    assert class_ptrs.tolist() == [100, 101, 100, 101, 102, 103, 104, 102, 103, 104, 0, 0]
    assert class_cu.tolist() == [0, 2, 4, 4, 4, 7, 10] and class_cu.dtype == torch.int32
    # A list starting past entry 0 (cu_block_nums[0] = 1): the entries before cp * 1 belong to no class.
    class_ptrs, class_cu = parallel.cp_class_block_pointers(ptrs, torch.tensor([1, 3], dtype=torch.int32), 3)
    assert class_ptrs.tolist() == [0, 0, 0, 101, 102, 101, 102, 101, 102] + [0] * 9
    assert class_cu.tolist() == [3, 5, 7, 9]
    # cp 1 is the lists themselves; no blocks at all is no entries.
    class_ptrs, class_cu = parallel.cp_class_block_pointers(ptrs, torch.tensor([0, 4, 6], dtype=torch.int32), 1)
    assert torch.equal(class_ptrs, ptrs) and class_cu.tolist() == [0, 4, 6]
    class_ptrs, class_cu = parallel.cp_class_block_pointers(ptrs[:0], torch.tensor([0, 0], dtype=torch.int32), 4)
    assert class_ptrs.shape == (0,) and class_cu.tolist() == [0] * 5


def test_class_block_pointers_repeat_every_list():
    for cp in (2, 3, 5):
        counts = torch.randint(0, 6, (7,))
        cu = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).int()
        ptrs = torch.randint(1, 1 << 40, (int(cu[-1]) + 3,))            # 3 entries past every list
        class_ptrs, class_cu = parallel.cp_class_block_pointers(ptrs, cu, cp)
        assert class_ptrs.shape == (cp * ptrs.shape[0],)
        for c in range(7 * cp):
            b = c // cp
            assert torch.equal(class_ptrs[int(class_cu[c]):int(class_cu[c + 1])], ptrs[int(cu[b]):int(cu[b + 1])])
        assert (class_ptrs[int(class_cu[-1]):] == 0).all()


class CpuBlockOps:
    """CPU stand-ins for the block-pointer forms of ops.fused_write_kv_blocks, ops.decode and ops.prefill
    (the ops run those on CUDA only), over one BlockPool: the pointers are read back as the pool's block
    ids and the reference runs on the pool's layer view, the write at the slots layout.block_slots gives
    (readonly_lens and cp_size / cp_rank included). Calls with CUDA tensors or a paged cache go to the
    real ops."""

    def __init__(self, pool: BlockPool, monkeypatch):
        self.pool = pool
        self.real = {name: getattr(ops, name) for name in ("fused_write_kv_blocks", "decode", "prefill")}
        for name in self.real:
            monkeypatch.setattr(ops, name, getattr(self, name))

    def _layer_and_ids(self, cache: BlockPointerCache):
        pool = self.pool
        layer = [l for l in range(pool.num_layers) if pool.layer_offset_bytes(l) == cache.layer_offset_bytes]
        assert len(layer) == 1 and cache.dtype == pool.dtype and cache.block_seq_len == pool.block_seq_len
        assert cache.rope_first == pool.rope_first
        # Entries no sequence owns (the class lists' padding) give ids outside the pool; nothing reads them.
        return layer[0], (cache.block_ptrs - pool.bytes.data_ptr()) // pool.bytes_per_block

    def fused_write_kv_blocks(self, kv_a, rms_weight, eps, positions, cos_sin_cache, cache, cu_q_lens, history_lens,
                              **kw):
        if kv_a.device.type != "cpu":
            return self.real["fused_write_kv_blocks"](kv_a, rms_weight, eps, positions, cos_sin_cache, cache,
                                                      cu_q_lens, history_lens, **kw)
        layer, ids = self._layer_and_ids(cache)
        slots = block_slots(cu_q_lens, history_lens, cache.cu_block_nums, ids, self.pool.block_seq_len,
                            readonly_lens=kw.get("readonly_lens"), cp_size=kw.get("cp_size", 1),
                            cp_rank=kw.get("cp_rank", 0))
        slots = torch.cat([slots, slots.new_full((kv_a.shape[0] - slots.shape[0],), -1)])  # rows past the batch
        view = self.pool.layer_view(layer)
        rows = to_latent_first(view) if self.pool.rope_first else view.clone()
        reference.fused_write_kv(kv_a, rms_weight, eps, positions, cos_sin_cache, rows, slots,
                                 rope_style=kw.get("rope_style", "interleaved"), q=kw.get("q"))
        view.copy_(to_rope_first(rows) if self.pool.rope_first else rows)

    def decode(self, q, kv_cache, block_table, seq_lens, softmax_scale, **kw):
        if q.device.type != "cpu" or not isinstance(kv_cache, BlockPointerCache):
            return self.real["decode"](q, kv_cache, block_table, seq_lens, softmax_scale, **kw)
        layer, ids = self._layer_and_ids(kv_cache)
        return reference.decode_blocks(q, self.pool, layer, ids, kv_cache.cu_block_nums, seq_lens, softmax_scale,
                                       out=kw.get("out"), lse=kw.get("lse"))

    def prefill(self, q, kv_cache, block_table, cu_q_lens, kv_lens, softmax_scale, **kw):
        if q.device.type != "cpu" or not isinstance(kv_cache, BlockPointerCache):
            return self.real["prefill"](q, kv_cache, block_table, cu_q_lens, kv_lens, softmax_scale, **kw)
        layer, ids = self._layer_and_ids(kv_cache)
        return reference.prefill_blocks(q, self.pool, layer, ids, kv_cache.cu_block_nums, cu_q_lens, kv_lens,
                                        softmax_scale, causal=kw.get("causal", True), out=kw.get("out"),
                                        lse=kw.get("lse"))


def mixed_pool(num_blocks, block_seq_len, dtype, device):
    """Layers [MLA, a non-MLA region of 1000 bytes rounded up to 16, MLA]: layer 2's offset is no
    multiple of an MLA layer's size, as TurboMind's summed offsets need not be."""
    rows = layout.block_bytes(None, block_seq_len, dtype)
    return BlockPool(num_blocks, 3, block_seq_len, dtype, device, layer_bytes=[rows, 1008, rows])


def cp_block_write_case(device, dtype, cp, rank, readonly, arch=None, pool_hook=None):
    """Rank ``rank`` of cp writes a batch through cp_fused_write_kv into a BlockPointerCache (layer 2 of a
    mixed pool, shuffled blocks), and the same batch through the paged form into a paged cache over the
    same block ids, and every position through the ordinary fused_write_kv into one global cache.

    Sequences (block 16): new tokens all past the read-only rows; a history ending cp positions below
    them (so the first cp new tokens land on the last read-only local row: the owner's is skipped); new
    tokens all inside read-only rows (nothing written); no read-only rows; two padding rows past the
    batch. Checks: the written rows equal the paged cp write's bit for bit, and the global write's rows
    at the rank's positions; with readonly the read-only local rows are skipped; every other byte of the
    pool (layer 0, the opaque region, other rows, unowned blocks) keeps its value; q is rotated for
    every row exactly as the paged and global writes rotate it. ``pool_hook(pool)`` runs once the pool
    exists (the CPU test installs CpuBlockOps there)."""
    gen = torch.Generator().manual_seed(61 + 7 * cp + rank + 100 * readonly)
    bsl, heads = 16, 3
    q_lens = [20, 9, 3, 33]
    readonly_rows = [2 * bsl, 2 * bsl, 3 * bsl, 0]                                # local rows
    hist = [cp * readonly_rows[0], cp * readonly_rows[1] - cp, 0, 5]              # global positions
    lens = torch.tensor([h + n for h, n in zip(hist, q_lens)])
    local_need = (parallel.cp_local_lens(lens, cp, rank).long() + bsl - 1) // bsl
    counts = [max(int(n), -(-r // bsl)) if readonly else int(n) for n, r in zip(local_need, readonly_rows)]
    num_blocks = sum(counts) + 3
    ids = torch.randperm(num_blocks, generator=gen)[:sum(counts)]
    cu_blocks = torch.tensor([0] + counts).cumsum(0).int()
    cu_q = torch.tensor([0] + q_lens).cumsum(0).int()
    hist_t = torch.tensor(hist, dtype=torch.int32)
    readonly_t = torch.tensor(readonly_rows, dtype=torch.int32) if readonly else None
    total = int(cu_q[-1])

    pool = mixed_pool(num_blocks, bsl, dtype, device)
    if pool_hook is not None:
        pool_hook(pool)
    pool.bytes.copy_(torch.randint(0, 256, pool.bytes.shape, generator=gen, dtype=torch.uint8))
    for layer in (0, 2):
        pool.layer_view(layer).copy_(torch.rand(num_blocks, bsl, ROW_DIM, generator=gen) * 8 + 3)
    before = pool.bytes.clone()
    kv_a = torch.randn(total + 2, 640, generator=gen).to(device, dtype)[:, 64:]
    q = torch.randn(total + 2, heads, 192 + 64, generator=gen).to(device, dtype)
    weight = (torch.rand(512, generator=gen) + 0.5).to(device, dtype)
    cs = cos_sin_cache(64, 512, 1e4, device=device)
    args = (cu_q.to(device), hist_t.to(device), cp, rank)

    q_blocks = q.clone()
    parallel.cp_fused_write_kv(kv_a, weight, 1e-6, cs, pool.cache(2, ids, cu_blocks), None, *args, q=q_blocks,
                               readonly_lens=None if readonly_t is None else readonly_t.to(device), validate=True,
                               arch=arch)
    table = torch.full((len(q_lens), max(counts) + 1), num_blocks + 7, dtype=torch.int32)  # poison past the end
    for b in range(len(q_lens)):
        table[b, :counts[b]] = ids[int(cu_blocks[b]):int(cu_blocks[b + 1])].int()
    expected = mixed_pool(num_blocks, bsl, dtype, device)
    expected.bytes.copy_(before)
    paged = to_latent_first(expected.layer_view(2))                    # the same rows, latent first
    q_paged = q.clone()
    parallel.cp_fused_write_kv(kv_a, weight, 1e-6, cs, paged, table.to(device), *args, q=q_paged, validate=True,
                               arch=arch)

    # Every position into one global cache: sequence b's position p at slot b * width * bsl + p.
    tokens = parallel.cp_local_positions(cu_q, hist_t, cp, rank, num_tokens=total + 2)
    width = -(-int(lens.max()) // bsl)
    global_slots = torch.where(tokens.seq_ids < len(q_lens), tokens.seq_ids * width * bsl + tokens.positions, -1)
    global_cache = torch.full((len(q_lens) * width, bsl, ROW_DIM), float("nan"), dtype=dtype, device=device)
    q_global = q.clone()
    mla_kv.fused_write_kv(kv_a, weight, 1e-6, tokens.positions.to(device), cs, global_cache,
                          global_slots.to(device), q=q_global, arch=arch)
    if device != "cpu":
        torch.cuda.synchronize()

    slots = block_slots(cu_q, hist_t, cu_blocks, ids, bsl, readonly_lens=readonly_t, cp_size=cp, cp_rank=rank)
    # The paged form writes the same slots, read-only rows included (it has none).
    every = block_slots(cu_q, hist_t, cu_blocks, ids, bsl, cp_size=cp, cp_rank=rank)
    assert torch.equal(parallel.cp_slot_mapping(tokens, table, bsl)[:total], every)
    assert torch.equal(every >= 0, tokens.owned[:total])
    if readonly:  # what the cases promise: sequence 2 writes nothing, sequence 1 skips its first cp tokens
        per_seq = [slots[int(cu_q[b]):int(cu_q[b + 1])] >= 0 for b in range(len(q_lens))]
        assert not per_seq[2].any() and not per_seq[1][:cp].any()
        assert torch.equal(per_seq[1][cp:], every[int(cu_q[1]) + cp:int(cu_q[2])] >= 0)
    ok = (slots >= 0).to(device)
    blk, off = (slots[slots >= 0] // bsl).to(device), (slots[slots >= 0] % bsl).to(device)
    got = pool.layer_view(2)[blk, off]
    assert same_bytes(got, to_rope_first(paged[blk, off])), "rows differ from the paged cp write's"
    assert same_bytes(got, to_rope_first(global_cache.view(-1, ROW_DIM)[global_slots[:total].to(device)[ok]])), \
        "rows differ from the global write's rows at this rank's positions"
    expected.layer_view(2)[blk, off] = got
    assert same_bytes(pool.bytes, expected.bytes), \
        "bytes outside the written rows changed (other layers, read-only rows, other ranks' rows, unowned blocks)"
    assert same_bytes(q_blocks, q_paged) and same_bytes(q_blocks, q_global), "q rotated differently"


@pytest.mark.parametrize("cp,rank,readonly", [(2, 1, False), (3, 0, True), (3, 2, True)])
def test_cp_block_write_on_cpu(cp, rank, readonly, monkeypatch):
    cp_block_write_case("cpu", torch.float32, cp, rank, readonly,
                        pool_hook=lambda pool: CpuBlockOps(pool, monkeypatch))


@GPU
@WRITE_ARCHS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cp,rank", [(2, 0), (2, 1), (3, 2), (4, 1)])
@pytest.mark.parametrize("readonly", [False, True])
def test_cp_block_write_equals_paged_and_global_writes(dtype, cp, rank, readonly, arch):
    """cp_fused_write_kv over block pointers: one fused_write_kv_blocks launch (cp_size, cp_rank,
    readonly_lens); see cp_block_write_case."""
    cp_block_write_case("cuda", dtype, cp, rank, readonly, arch)


def cp_block_attention_case(device, dtype, cp, kind, arch=None, pool_hook=None):
    """cp_decode (S_q 3) or cp_prefill (causal or not) of every rank over its block-pointer cache, merged
    over the ranks, against the float64 reference over one paged cache with every position.

    The ranks' caches are disjoint blocks of one BlockPool (layer 1, rope first, NaN everywhere the
    ranks' rows are not): rank r's sequence b holds the rows of positions r, r + cp, ... at local rows 0,
    1, ... Sequences include ones shorter than cp (ranks without a single row of them) and one with no
    cached prefix. Outputs start as NaN and the split-KV workspace as 0xFF (CUDA); the states are
    merged in float32 so that only the ranks' partials carry the dtype's rounding; the pool must not
    change."""
    gen = torch.Generator().manual_seed(71 + 5 * cp + len(kind))
    bsl, heads, scale = 16, 5, 0.0625
    if kind == "decode":
        kv_lens, q_lens = [3, 40, 97, 5], [3] * 4
    else:
        kv_lens, q_lens = [70, 5, 33, 130, 2], [3, 5, 1, 64, 2]
    rows = [(torch.randn(n, ROW_DIM, generator=gen) * 0.5).to(device, dtype) for n in kv_lens]
    whole, table, kv_lens_t = cache_with_rows(rows, bsl)

    counts = [[-(-len(range(r, n, cp)) // bsl) for n in kv_lens] for r in range(cp)]
    num_blocks = sum(map(sum, counts)) + 3
    pool = BlockPool(num_blocks, 2, bsl, dtype, device)
    if pool_hook is not None:
        pool_hook(pool)
    pool.bytes.fill_(0xFF)                                          # NaN in every dtype
    perm, taken, caches = torch.randperm(num_blocks, generator=gen), 0, []
    for r in range(cp):
        ids = perm[taken:taken + sum(counts[r])]
        taken += sum(counts[r])
        cu_blocks = torch.tensor([0] + counts[r]).cumsum(0).int()
        for b, seq_rows in enumerate(rows):
            local = torch.arange(len(range(r, kv_lens[b], cp)))
            pool.layer_view(1)[ids[int(cu_blocks[b]) + local // bsl].to(device), (local % bsl).to(device)] = \
                to_rope_first(seq_rows[r::cp])
        caches.append(pool.cache(1, ids, cu_blocks))
    before = pool.bytes.clone()
    cuda = device != "cpu"

    def launch_args(cache, batch, q_len, total):
        """out / lse of NaN, and on CUDA a schedule for these sizes with a poisoned workspace."""
        if not cuda:
            return {}
        schedule = mla_kv.attention_schedule(batch, q_len, heads, cache.block_ptrs.shape[0] * bsl,
                                             total_q_tokens=total, arch=arch)
        return dict(schedule=schedule, workspace=poisoned_workspace(schedule, device))

    states = []
    if kind == "decode":
        s_q = q_lens[0]
        q = torch.randn(len(kv_lens), s_q, heads, ROW_DIM, generator=gen).to(device, dtype)
        ref = reference.decode(q.double(), whole.double(), table, kv_lens_t, scale)
        for r in range(cp):
            out, lse = nan_outputs(q, q.shape[:3])
            states.append(parallel.cp_decode(q, caches[r], None, kv_lens_t, scale, cp, r, out=out, lse=lse,
                                             arch=arch, **launch_args(caches[r], len(kv_lens), -(-s_q // cp),
                                                                      len(kv_lens) * s_q)))
        cu_q = None
    else:
        causal = kind == "causal"
        cu_q = torch.tensor([0] + q_lens, device=device).cumsum(0).int()
        q = torch.randn(sum(q_lens), heads, ROW_DIM, generator=gen).to(device, dtype)
        ref = reference.prefill(q.double(), whole.double(), table, cu_q, kv_lens_t, scale, causal=causal)
        classes = len(q_lens) * cp if causal else len(q_lens)
        for r in range(cp):
            out, lse = nan_outputs(q, q.shape[:2])
            states.append(parallel.cp_prefill(q, caches[r], None, cu_q, kv_lens_t, scale, cp, r, causal=causal,
                                              out=out, lse=lse, arch=arch,
                                              **launch_args(caches[r], classes, -(-sum(q_lens) // classes),
                                                            sum(q_lens))))
    out, lse = parallel.merge_partial_states(torch.stack([o.float() for o, _ in states]),
                                             torch.stack([l for _, l in states]))
    check_attention(out, lse, *ref, f"cp {cp} {kind} over block pointers", cu_q_lens=cu_q,
                    out_tol=OUT_TOL[dtype])
    if cuda:
        torch.cuda.synchronize()
    assert same_bytes(pool.bytes, before), "attention changed the pool"


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("kind", ["decode", "causal", "full"])
def test_cp_block_attention_on_cpu(cp, kind, monkeypatch):
    cp_block_attention_case("cpu", torch.float32, cp, kind, pool_hook=lambda pool: CpuBlockOps(pool, monkeypatch))


@GPU
@ATTENTION_ARCHS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("kind", ["decode", "causal", "full"])
def test_cp_block_attention_merged_equals_single_rank(dtype, cp, kind, arch):
    """cp_decode and cp_prefill (causal: one prefill over the B x cp classes with repeated block lists;
    not causal: the local lengths) over block pointers; see cp_block_attention_case."""
    cp_block_attention_case("cuda", dtype, cp, kind, arch)


# ------------------------------------------------------------------------- head parallelism
NOPE, V, Q_LORA, HIDDEN, TP_HEADS = 16, 8, 24, 32, 4


def mla_attention_heads(x, q_b, kv_b, heads, positions, cos_sin, cache, table, seq_lens):
    """MLA attention of the heads whose weight rows are given -> per-head output [B, S, heads, v]."""
    batch, s_q, _ = x.shape
    q = (x @ q_b.t()).view(batch, s_q, heads, NOPE + 64)
    w_uk, w_uv = mla_kv.split_kv_b_proj(kv_b, heads, NOPE, V)
    q_lat = mla_kv.absorb_q(q[..., :NOPE], w_uk)
    q_pe = reference.apply_rope(q[..., NOPE:].flatten(0, 1), positions.flatten(), cos_sin).view(batch, s_q, heads, 64)
    o_lat, _ = mla_kv.decode(torch.cat([q_lat, q_pe], -1), cache, table, seq_lens, pw.SCALE)
    return mla_kv.project_out(o_lat, w_uv)


@pytest.mark.parametrize("tp", [2, 4])
def test_head_parallel_recipe(tp):
    """Each rank: its heads' rows of q_b_proj / kv_b_proj and columns of o_proj, the whole latent
    cache and the same block table. Concatenated heads and summed o_proj partials equal one rank."""
    f32 = dict(dtype=torch.float32)  # mla_kv.decode's CPU path returns float32 lse (float64 q fails there)
    q_b = torch.randn(TP_HEADS * (NOPE + 64), Q_LORA, **f32) / Q_LORA ** 0.5
    kv_b = torch.randn(TP_HEADS * (NOPE + V), 512, **f32) / NOPE ** 0.5
    o_proj = torch.randn(HIDDEN, TP_HEADS * V, **f32)
    batch, s_q = 3, 2
    seq_lens = torch.randint(s_q, 40, (batch,), dtype=torch.int32)
    table = torch.randperm(batch * 10).int().view(batch, 10)
    cache = torch.randn(batch * 10, pw.BLOCK_SIZE, 576, **f32)
    x = torch.randn(batch, s_q, Q_LORA, **f32)
    positions = seq_lens[:, None].long() - s_q + torch.arange(s_q)
    cos_sin = mla_kv.rope.cos_sin_cache(64, 64, theta=1e4, dtype=torch.float32)
    args = (positions, cos_sin, cache, table, seq_lens)

    whole = mla_attention_heads(x, q_b, kv_b, TP_HEADS, *args)
    per_rank = [mla_attention_heads(x, parallel.shard_heads(q_b, TP_HEADS, tp, r),
                                    parallel.shard_heads(kv_b, TP_HEADS, tp, r), TP_HEADS // tp, *args)
                for r in range(tp)]
    torch.testing.assert_close(torch.cat(per_rank, dim=2), whole, rtol=1e-5, atol=1e-5)
    hidden = sum(o.flatten(-2) @ parallel.shard_heads(o_proj, TP_HEADS, tp, r, dim=1).t()
                 for r, o in enumerate(per_rank))
    torch.testing.assert_close(hidden, whole.flatten(-2) @ o_proj.t(), rtol=1e-5, atol=1e-4)


# --------------------------------------------------------------------------- bad arguments
def test_bad_arguments_name_the_argument():
    cu, hist = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    table = torch.zeros(1, 2, dtype=torch.int32)
    kv_a, weight, cos_sin = torch.randn(2, 576), torch.ones(512), cos_sin_cache(64, 16, 1e4)
    paged = torch.full((2, 4, 576), 7.0)
    blocks = BlockPool(2, 1, 4, torch.float32).cache(0, torch.tensor([1]), torch.tensor([0, 1]))
    cases = [
        (lambda: parallel.cp_local_lens(torch.ones(2, dtype=torch.int32), 2, 2), ValueError, "rank"),
        (lambda: parallel.cp_local_lens(torch.ones(2, dtype=torch.int32), 0, 0), ValueError, "cp"),
        (lambda: parallel.cp_local_lens(torch.ones(2), 2, 0), TypeError, "lens"),
        (lambda: parallel.cp_local_positions(cu, hist, True, 0), TypeError, "cp"),
        (lambda: parallel.cp_local_positions(cu.long(), hist, 2, 0), TypeError, "cu_q_lens"),
        (lambda: parallel.cp_local_positions(cu, torch.ones(2, dtype=torch.int32), 2, 0), ValueError, "history_lens"),
        (lambda: parallel.cp_slot_mapping(parallel.cp_local_positions(cu, hist, 2, 0), table.long(), 4),
         TypeError, "block_table"),
        (lambda: parallel.cp_slot_mapping(parallel.cp_local_positions(cu, hist, 2, 0), table, 0),
         ValueError, "block_size"),
        (lambda: parallel.cp_slot_mapping((1, 2), table, 4), TypeError, "tokens"),
        (lambda: parallel.shard_heads(torch.zeros(20, 3), 20, 3, 0), ValueError, "tp"),
        (lambda: parallel.shard_heads(torch.zeros(21, 3), 20, 4, 0), ValueError, "weight"),
        (lambda: parallel.shard_heads(torch.zeros(20, 3), 20, 4, 0, dim=2), ValueError, "dim"),
        (lambda: parallel.cp_decode(torch.zeros(1, 1, 1, 576), torch.zeros(1, 4, 576), table,
                                    torch.ones(1, dtype=torch.int64), 0.1, 2, 0), TypeError, "seq_lens"),
        (lambda: parallel.cp_prefill(torch.zeros(2, 1, 576), torch.zeros(1, 4, 576), table, cu,
                                     torch.ones(2, dtype=torch.int32), 0.1, 2, 0), ValueError, "kv_lens"),
        (lambda: parallel.merge_partial_states(torch.zeros(2, 3, 8), torch.zeros(2, 4)), ValueError, "lses"),
        (lambda: parallel.cp_fused_write_kv(kv_a, weight, 1e-6, cos_sin, paged, table, cu, hist, 2, 0,
                                            readonly_lens=torch.zeros(1, dtype=torch.int32)),
         ValueError, "readonly_lens"),
        (lambda: parallel.cp_fused_write_kv(kv_a, weight, 1e-6, cos_sin, blocks, table, cu, hist, 2, 0),
         ValueError, "block_table"),
        (lambda: parallel.cp_prefill(torch.zeros(4, 1, 576), blocks, None, torch.tensor([0, 2, 4], dtype=torch.int32),
                                     torch.full((2,), 4, dtype=torch.int32), 0.1, 2, 0),
         ValueError, "kv_cache.cu_block_nums"),
        (lambda: parallel.cp_class_block_pointers(blocks.block_ptrs.int(), blocks.cu_block_nums, 2),
         TypeError, "block_ptrs"),
        (lambda: parallel.cp_class_block_pointers(blocks.block_ptrs, blocks.cu_block_nums.long(), 2),
         TypeError, "cu_block_nums"),
        (lambda: parallel.cp_class_block_pointers(blocks.block_ptrs, blocks.cu_block_nums[:1], 2),
         ValueError, "cu_block_nums"),
        (lambda: parallel.cp_class_block_pointers(blocks.block_ptrs, blocks.cu_block_nums, 0), ValueError, "cp"),
    ]
    for call, error, name in cases:
        with pytest.raises(error, match=name):
            call()
    assert (paged == 7.0).all(), "a refused write wrote"
