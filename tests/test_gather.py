"""gather_kv (paged and block-pointer forms) against mla_kv.reference and an independent indexing.

GPU tests poison ``out`` (and the memory around it) first, then check every gathered row bit for bit
and every other byte for being unchanged; each runs once per variant (the `arch` fixture): the
device's best and the Volta one (a copy, so bf16 runs on the Sm70 variant too). CPU tests cover
validation (errors before anything is written) and the CPU dispatch to the reference.
"""
import pytest
import torch

import mla_kv
from mla_kv import reference
from mla_kv.layout import BlockPool, to_latent_first

from gpu_checks import capture_graph, random_table, same_bytes

GPU = pytest.mark.gpu
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# Kernel variants of the tests taking `arch` (tests/conftest.py): the device's best and the Volta one,
# through both tags that run it (sm75 too: both must dispatch); a copy, so bf16 runs on every one.
pytestmark = pytest.mark.arch_variants("best", "sm75", "sm70", bf16_needs_sm80=False)


def poison(shape, dtype, device, gen):
    """Random finite values, never zero, so unwritten or misplaced rows show."""
    return (torch.rand(shape, generator=gen) * 8 + 3).to(device, dtype)


def packed_positions(cu, starts):
    """(sequence, cache position) of every packed row, computed on the host."""
    cu, counts = cu.cpu().long(), cu.cpu().long().diff()
    seq = torch.repeat_interleave(torch.arange(counts.shape[0]), counts)
    return seq, starts.cpu().long()[seq] + torch.arange(int(cu[-1])) - cu[seq]


def expected_paged(cache, table, cu, starts):
    """(rows, covered) by direct indexing: rows the table does not cover are zeros, covered False."""
    seq, pos = packed_positions(cu, starts)
    table = table.cpu().long()
    size, idx = cache.shape[1], (pos // cache.shape[1]).clamp(min=0)
    covered = (pos >= 0) & (idx < table.shape[1])
    block = torch.where(covered, table[seq, idx.clamp(max=table.shape[1] - 1)], -1)
    covered &= (block >= 0) & (block < cache.shape[0])
    rows = cache.cpu()[block.clamp(0, cache.shape[0] - 1), pos.clamp(min=0) % size]
    return torch.where(covered[:, None], rows, torch.zeros_like(rows)), covered


def expected_blocks(pool, layer, ids, cu_blocks, cu, starts):
    """expected_paged for a block pool: latent-first rows and which positions the blocks cover."""
    seq, pos = packed_positions(cu, starts)
    cu_b, bsl = cu_blocks.long(), pool.block_seq_len
    covered = (pos >= 0) & (pos // bsl < (cu_b[1:] - cu_b[:-1])[seq])
    entry = torch.where(covered, cu_b[seq] + pos.clamp(min=0) // bsl, 0)
    rows = pool.layer_view(layer).cpu()[ids.long()[entry], pos.clamp(min=0) % bsl]
    if pool.rope_first:
        rows = to_latent_first(rows)
    return torch.where(covered[:, None], rows, torch.zeros_like(rows)), covered


def batch_for(lens, block_size, gen, with_starts):
    """cu_kv_lens, starts and per-sequence block needs for rows of the given lengths."""
    starts = (torch.randint(0, 3 * block_size, (len(lens),), generator=gen) if with_starts
              else torch.zeros(len(lens), dtype=torch.long))
    cu = torch.tensor([0] + lens).cumsum(0)
    needs = [max(1, -(-(int(s) + n) // block_size)) for s, n in zip(starts, lens)]
    return cu.int(), starts.int(), needs


def out_window(rows, dtype, gen, want, covered):
    """(buffer, out, expected buffer): out [rows, 576] is a window of a poisoned buffer 2 rows and 8
    columns larger on each side; afterwards the covered rows must hold want, every other byte stay."""
    wide = poison((rows + 4, 576 + 16), dtype, "cuda", gen)
    out = wide[2:rows + 2, 8:8 + 576]
    expect = wide.clone()
    expect[2:rows + 2, 8:8 + 576][covered.cuda()] = want[covered].cuda()
    return wide, out, expect


# ------------------------------------------------------------------------------- GPU
@GPU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 24, 32, 64, 128])  # 24: the division path of odd sizes
@pytest.mark.parametrize("with_starts", [False, True])
def test_gather_paged_matches_reference(dtype, block_size, with_starts, arch):
    gen = torch.Generator().manual_seed(block_size * 2 + with_starts)
    lens = [0, 1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 2]
    cu, starts, needs = batch_for(lens, block_size, gen, with_starts)
    num_blocks = sum(needs) + 5
    cache = poison((num_blocks, block_size, 576), dtype, "cuda", gen)
    # all share a first block (prefix cache)
    table = random_table(needs, num_blocks, gen, shared_prefix_blocks=1, device="cpu").cuda()
    cu, starts = cu.cuda(), starts.cuda()
    total = int(cu[-1])
    want = reference.gather_kv(cache, table, cu, starts=starts)
    assert torch.equal(want.cpu(), expected_paged(cache, table, cu, starts)[0]), "reference vs indexing"
    out = poison((total + 9, 576), dtype, "cuda", gen)
    before = out.clone()
    got = mla_kv.gather_kv(cache, table, cu, starts=starts if with_starts else None, out=out, arch=arch,
                           validate=True)
    assert got is out
    assert torch.equal(out[:total], want), "gathered rows differ"
    assert torch.equal(out[total:], before[total:]), "rows past total_kv written"
    fresh = mla_kv.gather_kv(cache, table, cu, starts=starts if with_starts else None, arch=arch)
    assert fresh.shape == (total, 576) and torch.equal(fresh, want), "allocated out"


@GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("width,offset", [(704, 64), (700, 2)])  # 16-byte path, two-element path
def test_gather_strided_out_and_layer_of_a_pool(dtype, width, offset, arch):
    gen = torch.Generator().manual_seed(width + offset)
    lens, block_size = [5, 200, 64, 1], 64
    cu, starts, needs = batch_for(lens, block_size, gen, True)
    num_blocks = sum(needs) + 2
    pool = poison((num_blocks, 3, block_size, 576), dtype, "cuda", gen)
    cache = pool[:, 2]  # one layer of a [blocks, layers, block_size, 576] pool: block stride 3 x rows
    table = random_table(needs, num_blocks, gen, device="cpu").cuda()
    cu, starts = cu.cuda(), starts.cuda()
    total = int(cu[-1])
    want = reference.gather_kv(cache, table, cu, starts=starts)
    wide = poison((total + 3, width), dtype, "cuda", gen)
    before = wide.clone()
    out = wide[:, offset:offset + 576]
    mla_kv.gather_kv(cache, table, cu, starts=starts, out=out, arch=arch)
    assert torch.equal(out[:total], want), "gathered rows differ"
    expect = before.clone()
    expect[:total, offset:offset + 576] = want
    assert torch.equal(wide, expect), "bytes outside the gathered rows changed"


@GPU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope_first", [True, False])
@pytest.mark.parametrize("block_seq_len", [16, 48, 64, 128])
def test_gather_block_pointers(dtype, rope_first, block_seq_len, arch):
    gen = torch.Generator().manual_seed(block_seq_len + rope_first)
    lens = [1, 0, block_seq_len, block_seq_len + 1, 2 * block_seq_len - 1, 300]
    cu, starts, needs = batch_for(lens, block_seq_len, gen, True)
    pool = BlockPool(sum(needs) + 3, 3, block_seq_len, dtype, "cuda", rope_first=rope_first)
    pool.storage.copy_(poison(pool.storage.shape, dtype, "cuda", gen))
    ids = torch.randperm(pool.storage.shape[0], generator=gen)[:sum(needs)]
    ids[needs[0] + needs[1]] = ids[0]  # sequence 2 shares sequence 0's first block
    cu_blocks = torch.tensor([0] + needs).cumsum(0).int()
    cache = pool.cache(1, ids, cu_blocks)
    total = int(cu[-1])
    want = reference.gather_kv_blocks(pool, 1, ids, cu_blocks, cu, starts=starts)
    assert torch.equal(want.cpu(), expected_blocks(pool, 1, ids, cu_blocks, cu, starts)[0])
    before = pool.storage.clone()
    out = poison((total + 4, 576), dtype, "cuda", gen)
    out_before = out.clone()
    mla_kv.gather_kv(cache, None, cu.cuda(), starts=starts.cuda(), out=out, arch=arch, validate=True)
    assert torch.equal(out[:total], want.cuda()), "gathered rows differ"
    assert torch.equal(out[total:], out_before[total:]), "rows past total_kv written"
    assert torch.equal(pool.storage, before), "the cache changed"


@GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gather_large_batch_and_short_out(dtype, arch):
    gen = torch.Generator().manual_seed(17)
    lens = torch.randint(0, 4000, (37,), generator=gen).tolist()
    lens[5], lens[6] = 0, 1
    cu, starts, needs = batch_for(lens, 64, gen, True)
    num_blocks = sum(needs) + 8
    cache = poison((num_blocks, 64, 576), dtype, "cuda", gen)
    table = random_table(needs, num_blocks, gen, device="cpu").cuda()
    cu, starts = cu.cuda(), starts.cuda()
    total = int(cu[-1])
    want, covered = expected_paged(cache, table, cu, starts)
    assert bool(covered.all())
    # a poisoned out of its own: an allocated one may get the memory of another variant's result (same gen)
    got = mla_kv.gather_kv(cache, table, cu, starts=starts, out=poison((total, 576), dtype, "cuda", gen), arch=arch)
    assert torch.equal(got.cpu(), want), f"{total} rows differ"
    # Without validate an out shorter than total_kv receives its first rows and nothing past its
    # end (the front of a larger buffer whose tail must keep its bytes); validate refuses it.
    buffer = poison((total, 576), dtype, "cuda", gen)
    tail = buffer[total - 100:].clone()
    short = buffer[:total - 100]
    mla_kv.gather_kv(cache, table, cu, starts=starts, out=short, arch=arch)
    assert torch.equal(short.cpu(), want[:total - 100]), "short out"
    assert torch.equal(buffer[total - 100:].view(torch.int16), tail.view(torch.int16)), \
        "rows past a short out were written"
    with pytest.raises(ValueError, match="out"):
        mla_kv.gather_kv(cache, table, cu, starts=starts, out=short, arch=arch, validate=True)


@GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # bf16 shares the fp16 instantiation
def test_gather_skips_rows_the_cache_does_not_cover(dtype, arch):
    """Without validation, rows whose position has no block (past the table; ids -1, num_blocks,
    2^31 - 1) or is negative leave their out rows untouched. out is a window of a larger buffer, the
    cache one of a larger tensor (canary blocks on both sides): nothing outside the covered rows'
    out bytes changes. validate=True raises for both kinds and writes nothing."""
    gen = torch.Generator().manual_seed(23)
    block_size = 32
    lens = [40, 70, 33, 10]
    cu, starts, needs = batch_for(lens, block_size, gen, False)
    num_blocks = sum(needs) + 2
    storage = poison((num_blocks + 2, block_size, 576), dtype, "cuda", gen)
    cache = storage[1:-1]
    table = random_table(needs, num_blocks, gen, device="cpu")[:, :2]  # sequence 1's last 6 rows: past the table
    table[0, 1] = -1                                                    # sequence 0's rows 32..39
    table[1, 0] = 2 ** 31 - 1                                           # sequence 1's rows 0..31
    table[2, 1] = num_blocks                                            # sequence 2's row 32
    starts[3] = -4                                                      # sequence 3's first 4 positions
    table, cu, starts = table.cuda(), cu.cuda(), starts.cuda()
    want, covered = expected_paged(cache, table, cu, starts)
    assert int((~covered).sum()) == 8 + 32 + 6 + 1 + 4
    total, storage_before = int(cu[-1]), storage.clone()
    wide, out, expect = out_window(total, dtype, gen, want, covered)
    mla_kv.gather_kv(cache, table, cu, starts=starts, out=out, arch=arch)
    assert torch.equal(out.cpu()[covered], want[covered]), "covered rows differ"
    assert same_bytes(wide, expect), "uncovered rows or bytes around out written"
    for bad_starts, bad_table, name in ((starts.clamp(min=0), table, "block_table"),
                                        (starts, table[:, :1].contiguous(), "starts")):
        with pytest.raises(ValueError, match=name):
            mla_kv.gather_kv(cache, bad_table, cu, starts=bad_starts, out=out, arch=arch, validate=True)
    torch.cuda.synchronize()
    assert same_bytes(wide, expect), "a call that failed validation wrote"
    assert same_bytes(storage, storage_before), "the cache changed"


@GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gather_block_pointers_skip_rows_past_the_blocks(dtype, arch):
    """Sequence 1 owns one block fewer than its rows need, sequence 2 none, sequence 3 starts at -4:
    those rows of out stay untouched, as do the bytes around out and the pool (other layers, blocks
    nobody owns). validate=True raises."""
    gen = torch.Generator().manual_seed(29)
    block_size = 32
    lens = [40, 70, 33, 10]
    cu, starts, needs = batch_for(lens, block_size, gen, False)
    starts[3] = -4
    counts = list(needs)
    counts[1] -= 1
    counts[2] = 0
    pool = BlockPool(sum(needs) + 2, 3, block_size, dtype, "cuda")
    pool.storage.copy_(poison(pool.storage.shape, dtype, "cuda", gen))
    ids = torch.randperm(pool.storage.shape[0], generator=gen)[:sum(counts)]
    cu_blocks = torch.tensor([0] + counts).cumsum(0).int()
    cache = pool.cache(1, ids, cu_blocks)
    want, covered = expected_blocks(pool, 1, ids, cu_blocks, cu, starts)
    assert int((~covered).sum()) == (70 - 2 * block_size) + 33 + 4
    cu, starts = cu.cuda(), starts.cuda()
    total, pool_before = int(cu[-1]), pool.storage.clone()
    wide, out, expect = out_window(total, dtype, gen, want, covered)
    mla_kv.gather_kv(cache, None, cu, starts=starts, out=out, arch=arch)
    assert torch.equal(out.cpu()[covered], want[covered]), "covered rows differ"
    assert same_bytes(wide, expect), "uncovered rows or bytes around out written"
    with pytest.raises(ValueError, match="starts"):
        mla_kv.gather_kv(cache, None, cu, starts=starts, out=out, arch=arch, validate=True)
    with pytest.raises(ValueError, match="cache.cu_block_nums"):
        mla_kv.gather_kv(cache, None, cu, starts=starts.clamp(min=0), out=out, arch=arch, validate=True)
    torch.cuda.synchronize()
    assert same_bytes(wide, expect), "a call that failed validation wrote"
    assert same_bytes(pool.storage, pool_before), "the pool changed"


@GPU
def test_gather_in_cuda_graph():
    gen = torch.Generator().manual_seed(29)
    dtype, lens = torch.bfloat16, [100, 1, 640]
    cu, starts, needs = batch_for(lens, 64, gen, True)
    num_blocks = sum(needs) + 4
    cache = poison((num_blocks, 64, 576), dtype, "cuda", gen)
    table = random_table(needs, num_blocks, gen, device="cpu").cuda()
    cu, starts = cu.cuda(), starts.cuda()
    out = torch.zeros(800, 576, dtype=dtype, device="cuda")
    graph = capture_graph(lambda: mla_kv.gather_kv(cache, table, cu, starts=starts, out=out))
    # New cache contents, lengths and starts, same buffers: the replay follows the device data.
    cache.copy_(poison(cache.shape, dtype, "cuda", gen))
    new_cu = torch.tensor([0, 30, 30, 630], dtype=torch.int32)
    new_starts = torch.tensor([70, 0, 0], dtype=torch.int32)
    cu.copy_(new_cu)
    starts.copy_(new_starts)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = reference.gather_kv(cache, table, new_cu, starts=new_starts)
    assert torch.equal(out[:630], want)
    assert torch.isnan(out[630:]).all()


@GPU
def test_gather_bad_input_on_gpu_writes_nothing():
    gen = torch.Generator().manual_seed(31)
    cache = poison((4, 64, 576), torch.float16, "cuda", gen)
    table = torch.arange(4, dtype=torch.int32, device="cuda").view(1, 4)
    cu = torch.tensor([0, 100], dtype=torch.int32, device="cuda")
    out = poison((100, 580), torch.float16, "cuda", gen)
    before = out.clone()
    with pytest.raises(TypeError, match="out"):
        mla_kv.gather_kv(cache, table, cu, out=out[:, :576].float())
    with pytest.raises(ValueError, match="out"):
        mla_kv.gather_kv(cache, table, cu, out=out[:, :576].cpu())
    with pytest.raises(ValueError, match="out"):
        mla_kv.gather_kv(cache, table, cu, out=out[:, 1:577])  # odd element offset: no 2-element access
    with pytest.raises(ValueError, match="cu_kv_lens"):
        mla_kv.gather_kv(cache, table, cu.cpu(), out=out[:, :576])
    with pytest.raises(ValueError, match="arch"):
        mla_kv.gather_kv(cache, table, cu, out=out[:, :576], arch="sm60")
    with pytest.raises(ValueError, match="block_table"):
        mla_kv.gather_kv(cache, table, cu, out=out[:, :576], validate=True,
                         starts=torch.tensor([200], dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(out, before)


# ------------------------------------------------------------------------------- CPU
def cpu_case(dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    lens = [3, 0, 17, 16]
    cu, starts, needs = batch_for(lens, 16, gen, True)
    cache = poison((sum(needs) + 2, 16, 576), dtype, "cpu", gen)
    table = random_table(needs, cache.shape[0], gen, device="cpu")
    return cache, table, cu, starts


def test_cpu_tensors_run_the_reference():
    cache, table, cu, starts = cpu_case()
    total = int(cu[-1])
    want, covered = expected_paged(cache, table, cu, starts)
    assert bool(covered.all())
    assert torch.equal(mla_kv.gather_kv(cache, table, cu, starts=starts), want)
    out = poison((total + 3, 576), cache.dtype, "cpu", torch.Generator().manual_seed(4))
    before = out.clone()
    assert mla_kv.gather_kv(cache, table, cu, starts=starts, out=out, validate=True) is out
    assert torch.equal(out[:total], want) and torch.equal(out[total:], before[total:])
    from_zero = mla_kv.gather_kv(cache, table, cu)
    assert torch.equal(from_zero, expected_paged(cache, table, cu, torch.zeros_like(starts))[0])


@pytest.mark.parametrize("mutate,exc,name", [
    (lambda a: a.update(cu_kv_lens=a["cu_kv_lens"].long()), TypeError, "cu_kv_lens"),
    (lambda a: a.update(cu_kv_lens=a["cu_kv_lens"][:1]), ValueError, "cu_kv_lens"),
    (lambda a: a.update(cu_kv_lens=a["cu_kv_lens"].view(1, -1)), ValueError, "cu_kv_lens"),
    (lambda a: a.update(starts=a["starts"][:2]), ValueError, "starts"),
    (lambda a: a.update(starts=a["starts"].long()), TypeError, "starts"),
    (lambda a: a.update(block_table=a["block_table"].long()), TypeError, "block_table"),
    (lambda a: a.update(block_table=a["block_table"][:2]), ValueError, "block_table"),
    (lambda a: a.update(block_table=None), TypeError, "block_table"),
    (lambda a: a.update(kv_cache=a["kv_cache"].view(-1, 576)), ValueError, "kv_cache"),
    (lambda a: a.update(kv_cache=a["kv_cache"][..., :512]), ValueError, "kv_cache"),
    (lambda a: a.update(kv_cache=a["kv_cache"].int()), TypeError, "kv_cache"),
    (lambda a: a.update(kv_cache=[a["kv_cache"]]), TypeError, "kv_cache"),
    (lambda a: a.update(out=a["out"].half()), TypeError, "out"),
    (lambda a: a.update(out=a["out"][:, :512]), ValueError, "out"),
    (lambda a: a.update(out=a["out"].view(1, -1, 576)), ValueError, "out"),
    (lambda a: a.update(out=a["out"][:10]), ValueError, "out"),
    (lambda a: a.update(out=a["out"][:10], validate=True), ValueError, "out"),
    (lambda a: a.update(cu_kv_lens=a["cu_kv_lens"].flip(0).contiguous(), validate=True), ValueError, "cu_kv_lens"),
    (lambda a: a.update(starts=a["starts"] - 100, validate=True), ValueError, "starts"),
    (lambda a: a.update(starts=a["starts"] + 100, validate=True), ValueError, "block_table"),
    (lambda a: a.update(block_table=a["block_table"] + 100, validate=True), ValueError, "block_table"),
])
def test_gather_rejects_bad_input_before_writing(mutate, exc, name):
    cache, table, cu, starts = cpu_case()
    out = torch.zeros(int(cu[-1]) + 2, 576)
    args = dict(kv_cache=cache, block_table=table, cu_kv_lens=cu, starts=starts, out=out, validate=False)
    mutate(args)
    before = out.clone()
    with pytest.raises(exc, match=name):
        mla_kv.gather_kv(args.pop("kv_cache"), args.pop("block_table"), args.pop("cu_kv_lens"), **args)
    assert torch.equal(out, before)


def test_gather_block_pointer_input_checks():
    gen = torch.Generator().manual_seed(5)
    pool = BlockPool(4, 1, 16, torch.float16, "cpu")
    ids, cu_blocks = torch.tensor([2, 0, 1]), torch.tensor([0, 2, 3], dtype=torch.int32)
    cu = torch.tensor([0, 20, 25], dtype=torch.int32)
    cache = pool.cache(0, ids, cu_blocks)
    with pytest.raises(ValueError, match="CUDA"):
        mla_kv.gather_kv(cache, None, cu)
    with pytest.raises(ValueError, match="block_table"):
        mla_kv.gather_kv(cache, torch.zeros(2, 2, dtype=torch.int32), cu)
    with pytest.raises(ValueError, match="cu_kv_lens"):
        mla_kv.gather_kv(cache, None, torch.tensor([0, 20], dtype=torch.int32))
    with pytest.raises(TypeError, match="out"):
        mla_kv.gather_kv(cache, None, cu, out=poison((25, 576), torch.float32, "cpu", gen))
