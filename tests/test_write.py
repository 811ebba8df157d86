"""write_kv / fused_write_kv (paged and block-pointer forms) against mla_kv.reference.

GPU tests poison the whole cache first, then check every target row against the reference and
every other byte for being unchanged. CPU tests cover validation (errors before anything is written)
and the CPU dispatch to the reference.
"""
import pytest
import torch

import mla_kv
from mla_kv import reference
from mla_kv.layout import BlockPool, block_slots, to_latent_first, to_rope_first
from mla_kv.rope import cos_sin_cache

from gpu_checks import same_bytes

GPU = pytest.mark.gpu

TOL = {torch.float16: 2e-3, torch.bfloat16: 8e-3, torch.float32: 2e-6}


# Kernel variants of the tests taking `arch` (tests/conftest.py): the device's best and, where the
# dtype allows, the Volta one (sm75 runs it too; sm90 runs the sm80 kernel, best on Ampere and newer).
pytestmark = pytest.mark.arch_variants("best", "sm70", bf16_needs_sm80=True)


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


def slot_mask(slots, num_blocks, block_size):
    """[num_blocks, block_size] True at the non-negative slots."""
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=slots.device)
    written[slots[slots >= 0]] = True
    return written.view(num_blocks, block_size)


def fused_reference_layer(layer_before, rope_first, kv_a, weight, eps, positions, cos_sin, slots, q=None):
    """float64 reference.fused_write_kv into a copy of one pool layer [blocks, bsl, 576] (rows in
    the pool's order; the reference writes latent-first rows); q (float64) is rotated in place."""
    layer = (to_latent_first(layer_before) if rope_first else layer_before).double()
    reference.fused_write_kv(kv_a.double(), weight.double(), eps, positions, cos_sin.double(), layer, slots, q=q)
    return to_rope_first(layer) if rope_first else layer


# ------------------------------------------------------------------------------- GPU
@GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 1000])
def test_write_kv_paged_exact(dtype, block_size, num_tokens, arch):
    gen = torch.Generator().manual_seed(num_tokens * 131 + block_size)
    num_blocks = (num_tokens * 2) // block_size + 3
    cache = poison_like(torch.empty(num_blocks, block_size, 576, dtype=dtype, device="cuda"), gen)
    want = cache.clone()
    kv_c = torch.randn(num_tokens + 3, 700, generator=gen).to("cuda", dtype)[:, 100:612]
    k_pe = torch.randn(num_tokens + 3, 64, generator=gen).to("cuda", dtype)
    slots = shuffled_slots(num_tokens, block_size, num_blocks, gen, pad_every=5).cuda()
    mla_kv.write_kv(kv_c, k_pe, cache, slots, arch=arch)
    reference.write_kv(kv_c, k_pe, want, slots)
    assert torch.equal(cache, want), "plain write must be bit-exact"


@GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rope_style", ["interleaved", "neox"])
@pytest.mark.parametrize("num_tokens,block_size", [(1, 64), (63, 16), (129, 32), (4097, 128), (70000, 64)])
@pytest.mark.parametrize("cos_fp32", [True, False])
def test_fused_write_kv_paged(dtype, rope_style, num_tokens, block_size, cos_fp32, arch):
    gen = torch.Generator().manual_seed(num_tokens + block_size + (7 if cos_fp32 else 0))
    num_blocks = (num_tokens * 3) // (2 * block_size) + 2
    cs = cos_sin_cache(64, 4096, 1e4, dtype=torch.float32 if cos_fp32 else dtype, device="cuda")
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
    written = slot_mask(slots, *cache.shape[:2])
    assert torch.equal(cache[~written], want_cache[~written]), "untouched rows changed"
    assert_close_rows(cache[written][:, :512], ref64[written][:, :512], dtype, "c_kv")
    assert_close_rows(cache[written][:, 512:], ref64[written][:, 512:], dtype, "k_pe")
    assert_close_rows(q[..., -64:], q64[..., -64:], dtype, "q_pe")
    assert torch.equal(q[..., :-64], q_untouched), "q_nope changed"


@GPU
def test_nan_row_poisons_only_its_slot(arch):
    gen = torch.Generator().manual_seed(3)
    dtype = torch.float16
    cs = cos_sin_cache(64, 4096, 1e4, device="cuda")
    kv_a, q, positions, weight = make_inputs(64, dtype, "cuda", gen)
    kv_a[10, 5] = float("nan")
    cache = poison_like(torch.empty(8, 16, 576, dtype=dtype, device="cuda"), gen)
    slots = shuffled_slots(64, 16, 8, gen).cuda()
    mla_kv.fused_write_kv(kv_a, weight, 1e-6, positions, cs, cache, slots, arch=arch)
    flat = cache.view(-1, 576)
    nan_rows = torch.isnan(flat).any(-1).nonzero().flatten().tolist()
    assert nan_rows == [int(slots[10])], f"NaN rows {nan_rows}"
    assert torch.isnan(flat[int(slots[10]), :512]).all()


def write_rows(fused, kv_a, weight, positions, cos_sin, cache, *, slots=None, cu_q=None, hist=None, q=None,
               arch=None, validate=False):
    """write_kv (rows kv_a as they are) or fused_write_kv (eps 1e-6) into a paged cache through
    slots, or into a BlockPointerCache through cu_q / hist (host tensors)."""
    if isinstance(cache, torch.Tensor):
        if fused:
            mla_kv.fused_write_kv(kv_a, weight, 1e-6, positions, cos_sin, cache, slots, q=q, arch=arch,
                                  validate=validate)
        else:
            mla_kv.write_kv(kv_a[:, :512], kv_a[:, 512:], cache, slots, arch=arch, validate=validate)
    elif fused:
        mla_kv.fused_write_kv_blocks(kv_a, weight, 1e-6, positions, cos_sin, cache, cu_q.cuda(), hist.cuda(), q=q,
                                     arch=arch, validate=validate)
    else:
        mla_kv.write_kv_blocks(kv_a[:, :512], kv_a[:, 512:], cache, cu_q.cuda(), hist.cuda(), arch=arch,
                               validate=validate)


MAX_POSITION = 100  # rope table rows of the guard tests
# (slot, rope position) per token over a cache of 6 blocks x 16 = 96 slots
OUT_OF_RANGE_TOKENS = [(5, 10), (-1, 11), (17, -1), (-7, 12), (95, MAX_POSITION - 1), (96, 13), (96 + 3 * 16, 14),
                       (2 ** 40, 15), (40, MAX_POSITION), (-2 ** 62, 16), (0, 2 ** 40), (63, 17)]


@GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fused", [False, True])
def test_paged_writes_skip_slots_and_positions_out_of_range(dtype, fused, arch):
    """Without validation a token writes its row only for a slot in [0, capacity) and (fused) a rope
    position in [0, max_position); a bad position leaves its q alone too, a padded slot does not.
    The cache lies between canary blocks: every byte but the written rows' keeps its value.
    validate=True raises for the same calls and writes nothing."""
    gen = torch.Generator().manual_seed(31 + fused)
    slots = torch.tensor([s for s, _ in OUT_OF_RANGE_TOKENS], dtype=torch.int64, device="cuda")
    positions = torch.tensor([p for _, p in OUT_OF_RANGE_TOKENS], device="cuda")
    in_cache = (slots >= 0) & (slots < 6 * 16)
    in_table = (positions >= 0) & (positions < MAX_POSITION)
    written = in_cache & in_table if fused else in_cache
    assert int(written.sum()) == (3 if fused else 6)
    cs = cos_sin_cache(64, MAX_POSITION, 1e4, device="cuda")
    kv_a, q, _, weight = make_inputs(len(OUT_OF_RANGE_TOKENS), dtype, "cuda", gen, row_stride=640)
    storage = poison_like(torch.empty(8, 16, 576, dtype=dtype, device="cuda"), gen)
    cache = storage[1:-1]
    before, q_arch = storage.clone(), q.clone()
    write_rows(fused, kv_a, weight, positions, cs, cache, slots=slots, q=q_arch, arch=arch)
    expect = before.clone()
    target_rows = cache.reshape(-1, 576)[slots[written]]
    if fused:
        ref64, q64 = before[1:-1].double(), q.double()
        reference.fused_write_kv(kv_a.double(), weight.double(), 1e-6, positions, cs.double(), ref64, slots,
                                 q=q64)
        assert_close_rows(target_rows, ref64.view(-1, 576)[slots[written]], dtype, "rows")
        assert_close_rows(q_arch[in_table], q64[in_table], dtype, "q")
        assert same_bytes(q_arch[~in_table], q[~in_table]), "q of a skipped token changed"
        expect[1:-1].view(-1, 576)[slots[written]] = target_rows
    else:
        expect[1:-1].view(-1, 576)[slots[written]] = kv_a[written]
    assert same_bytes(storage, expect), "bytes outside the written rows changed"
    with pytest.raises(ValueError, match="slot_mapping"):
        write_rows(fused, kv_a, weight, positions, cs, cache, slots=slots, q=q_arch, arch=arch, validate=True)
    if fused:  # slots in range: the positions are checked next
        with pytest.raises(ValueError, match="positions"):
            write_rows(fused, kv_a, weight, positions, cs, cache, slots=slots.where(in_cache, -1), q=q_arch,
                       arch=arch, validate=True)
    torch.cuda.synchronize()
    assert same_bytes(storage, expect), "a call that failed validation wrote"


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
def test_fused_write_kv_blocks(dtype, rope_first, block_seq_len, arch):
    gen = torch.Generator().manual_seed(block_seq_len + rope_first)
    q_lens, hist = [1, 0, 300, 64, 5], [0, 17, 63, 1000, 127]
    ids, cu_blocks, cu_q, hist_t = make_block_batch(q_lens, hist, block_seq_len, 64, gen)
    total = int(cu_q[-1])
    cs = cos_sin_cache(64, 4096, 1e6, device="cuda")
    pool = BlockPool(64, 3, block_seq_len, dtype, "cuda", rope_first=rope_first)
    pool.storage.copy_(poison_like(pool.storage, gen))
    before = pool.storage.clone()
    kv_a, q, positions, weight = make_inputs(total + 4, dtype, "cuda", gen, row_stride=640)
    cache = pool.cache(1, ids, cu_blocks)
    q_before = q.clone()
    mla_kv.fused_write_kv_blocks(kv_a, weight, 1e-5, positions, cs, cache, cu_q.cuda(),
                                 hist_t.cuda(), q=q, arch=arch, validate=True)
    slots = block_slots(cu_q, hist_t, cu_blocks, ids, block_seq_len).cuda()
    layer_before = before[:, 1]
    ref_layer = fused_reference_layer(layer_before, rope_first, kv_a, weight, 1e-5, positions, cs, slots)
    written = slot_mask(slots, 64, block_seq_len)
    got = pool.storage[:, 1]
    for layer in (0, 2):
        assert torch.equal(pool.storage[:, layer], before[:, layer]), f"layer {layer} touched"
    assert torch.equal(got[~written], layer_before[~written]), "untouched rows changed"
    assert_close_rows(got[written], ref_layer[written], dtype, "block rows")
    q_ref = reference.apply_rope(q_before[:total, :, -64:].double(), positions[:total], cs.double())
    assert_close_rows(q[:total, :, -64:], q_ref, dtype, "q_pe")


# (cp_size, cp_rank) of the block-write addressing tests: no context parallelism, and ranks of 2 and 3
CP_RANKS = [(1, 0), (2, 1), (3, 0), (3, 2)]


@GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("cp_size,cp_rank", CP_RANKS)
def test_block_writes_keep_readonly_rows_and_other_ranks_tokens(dtype, fused, cp_size, cp_rank, arch):
    """TurboMind's protocol: rows below readonly_lens[b] (shared prefix blocks) are never written, and
    under context parallelism a rank writes only the positions p with p % cp_size == cp_rank, at local
    row p // cp_size. Sequences: new tokens all past the read-only rows; a recomputed last cached token
    (history one below the read-only length: its row is skipped, the rest written); new tokens all
    inside read-only rows (nothing written); no read-only rows. Two of them share their read-only
    blocks, as a prefix cache shares them. Every written row equals the reference at the slot
    layout.block_slots gives; every other byte of the pool (other layers, shared blocks, other ranks'
    rows) keeps its value; q is rotated for every token, skipped or not."""
    gen = torch.Generator().manual_seed(53 + 7 * cp_size + cp_rank + fused)
    bsl = 16
    q_lens = [20, 9, 3, 33]
    readonly = [2 * bsl, 2 * bsl, 3 * bsl, 0]          # local rows (TurboMind: readonly blocks x block_len)
    hist = [cp_size * readonly[0], cp_size * readonly[1] - 1, 0, 5]   # global positions
    local_need = [-(-((h + n + cp_size - 1 - cp_rank) // cp_size) // bsl) for h, n in zip(hist, q_lens)]
    counts = [max(c, -(-r // bsl)) for c, r in zip(local_need, readonly)]
    num_blocks = sum(counts) + 4
    ids = torch.randperm(num_blocks, generator=gen)[:sum(counts)]
    ids[counts[0]:counts[0] + 2] = ids[:2]             # sequence 1 shares sequence 0's read-only blocks
    cu_blocks = torch.tensor([0] + counts).cumsum(0).int()
    cu_q = torch.tensor([0] + q_lens).cumsum(0).int()
    hist_t, readonly_t = torch.tensor(hist, dtype=torch.int32), torch.tensor(readonly, dtype=torch.int32)
    total = int(cu_q[-1])
    pool = BlockPool(num_blocks, 3, bsl, dtype, "cuda")
    pool.storage.copy_(poison_like(pool.storage, gen))
    before = pool.storage.clone()
    kv_a, q, _, weight = make_inputs(total + 2, dtype, "cuda", gen, row_stride=640)
    positions = torch.cat([torch.arange(h, h + n) for h, n in zip(hist, q_lens)] + [torch.zeros(2, dtype=torch.long)])
    positions = positions.cuda()
    cs = cos_sin_cache(64, 4096, 1e4, device="cuda")
    cache = pool.cache(1, ids, cu_blocks)
    q_before = q.clone()
    targets = dict(readonly_lens=readonly_t.cuda(), cp_size=cp_size, cp_rank=cp_rank, arch=arch, validate=True)
    if fused:
        mla_kv.fused_write_kv_blocks(kv_a, weight, 1e-6, positions, cs, cache, cu_q.cuda(), hist_t.cuda(), q=q,
                                     **targets)
    else:
        mla_kv.write_kv_blocks(kv_a[:, :512], kv_a[:, 512:], cache, cu_q.cuda(), hist_t.cuda(), **targets)
    slots = block_slots(cu_q, hist_t, cu_blocks, ids, bsl, readonly_lens=readonly_t, cp_size=cp_size,
                        cp_rank=cp_rank)
    # what the cases promise, whatever block_slots says: sequence 2 writes nothing, sequence 1 skips its
    # first token, the others write exactly their rank's tokens
    owned = (positions[:total].cpu() % cp_size == cp_rank)
    per_seq = [slots[int(cu_q[b]):int(cu_q[b + 1])] >= 0 for b in range(4)]
    assert not per_seq[2].any()
    assert not per_seq[1][0] and torch.equal(per_seq[1][1:], owned[int(cu_q[1]) + 1:int(cu_q[2])])
    for b in (0, 3):
        assert torch.equal(per_seq[b], owned[int(cu_q[b]):int(cu_q[b + 1])]), f"sequence {b}"
    slots = slots.cuda()
    layer_before = before[:, 1]
    if fused:
        want = fused_reference_layer(layer_before, True, kv_a, weight, 1e-6, positions, cs, slots)
    else:
        want = to_latent_first(layer_before).double()
        reference.write_kv(kv_a[:, :512].double(), kv_a[:, 512:].double(), want, slots)
        want = to_rope_first(want)
    written = slot_mask(slots, num_blocks, bsl)
    got = pool.storage[:, 1]
    for layer in (0, 2):
        assert torch.equal(pool.storage[:, layer], before[:, layer]), f"layer {layer} touched"
    assert torch.equal(got[~written], layer_before[~written]), "a read-only, other rank's or unused row changed"
    assert_close_rows(got[written], want[written], dtype, "block rows")
    if fused:
        q_ref = reference.apply_rope(q_before[:, :, -64:].double(), positions, cs.double())
        assert_close_rows(q[:, :, -64:], q_ref, dtype, "q_pe (every token, skipped ones too)")


@GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fused", [False, True])
def test_block_pointer_writes_skip_positions_past_the_blocks(dtype, fused, arch):
    """Tokens whose position (history + i) lies past their sequence's blocks, the tokens of a sequence
    without blocks, input rows past cu_q_lens[B] and (fused) a rope position outside the table write
    nothing; the other layers, the blocks nobody owns and the unwritten rows keep their bytes.
    validate=True raises and writes nothing."""
    gen = torch.Generator().manual_seed(41 + fused)
    block_seq_len, num_blocks = 32, 12
    # sequence 0: position 64 is past its 2 blocks; 1: no blocks; 2: all fit; 3: position 32 past its block
    q_lens, hist, counts = [5, 3, 40, 2], [60, 0, 10, 31], [2, 0, 2, 1]
    ids = torch.randperm(num_blocks, generator=gen)[:sum(counts)]
    cu_blocks = torch.tensor([0] + counts).cumsum(0).int()
    cu_q = torch.tensor([0] + q_lens).cumsum(0).int()
    hist_t = torch.tensor(hist, dtype=torch.int32)
    total = int(cu_q[-1])
    kv_a, q, positions, weight = make_inputs(total + 6, dtype, "cuda", gen, row_stride=640,
                                             max_position=MAX_POSITION)  # 6 rows past the batch
    positions[20] = MAX_POSITION  # a token of sequence 2
    cs = cos_sin_cache(64, MAX_POSITION, 1e4, device="cuda")
    slots = block_slots(cu_q, hist_t, cu_blocks, ids, block_seq_len).cuda()
    written = (slots >= 0) & (positions[:total] < MAX_POSITION) if fused else slots >= 0
    assert int(written.sum()) == 4 + 40 + 1 - fused
    blk, off = slots[written] // block_seq_len, slots[written] % block_seq_len
    pool = BlockPool(num_blocks, 3, block_seq_len, dtype, "cuda")
    pool.storage.copy_(poison_like(pool.storage, gen))
    before, q_arch = pool.storage.clone(), q.clone()
    cache = pool.cache(1, ids, cu_blocks)
    write_rows(fused, kv_a, weight, positions, cs, cache, cu_q=cu_q, hist=hist_t, q=q_arch, arch=arch)
    expect = before.clone()
    got_rows = pool.storage[:, 1][blk, off]
    if fused:
        q64 = q.double()
        ref = fused_reference_layer(before[:, 1], True, kv_a, weight, 1e-6, positions, cs, slots, q=q64)
        assert_close_rows(got_rows, ref[blk, off], dtype, "block rows")
        rotated = positions < MAX_POSITION
        assert_close_rows(q_arch[:total][rotated[:total]], q64[:total][rotated[:total]], dtype, "q")
        assert same_bytes(q_arch[20], q[20]), "q of the token outside the rope table changed"
        expect[:, 1][blk, off] = got_rows
    else:
        expect[:, 1][blk, off] = to_rope_first(kv_a[:total][written])
    assert same_bytes(pool.storage, expect), "bytes outside the written rows changed"
    with pytest.raises(ValueError, match="cache.cu_block_nums"):
        write_rows(fused, kv_a, weight, positions, cs, cache, cu_q=cu_q, hist=hist_t, q=q_arch, arch=arch,
                   validate=True)
    torch.cuda.synchronize()
    assert same_bytes(pool.storage, expect), "a call that failed validation wrote"


@GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("addressing", ["paged", "blocks"])
def test_writes_of_zero_huge_and_subnormal_rows_at_the_last_rope_position(dtype, addressing, arch, ulp_distance):
    """Rows (and q_pe) of zeros, of magnitude ~1e4 and of subnormals, and one 1e4 latent with a
    subnormal rope part, all at rope position max_position - 1: write_kv stores them bit for bit;
    fused_write_kv's results (no NaN, no overflow, subnormals not flushed) are within 1 ulp of the
    float64 reference for 16-bit dtypes (their cos/sin table makes the rope products exact in fp32,
    so only the final rounding differs) and within TOL row by row for fp32."""
    gen = torch.Generator().manual_seed(53)
    max_position = 4096
    cs = cos_sin_cache(64, max_position, 1e4, dtype=dtype, device="cuda")
    tiny = torch.finfo(dtype).smallest_normal

    def special_rows(width):
        """Zeros, +-1e4 .. 1.5e4, +-(0.25 .. 0.75) x the smallest normal, the last two halves mixed."""
        sign = torch.randint(0, 2, (width,), generator=gen) * 2 - 1
        huge = sign * 1e4 * (1 + 0.5 * torch.rand(width, generator=gen))
        subnormal = sign * tiny * (0.25 + 0.5 * torch.rand(width, generator=gen))
        mixed = torch.cat([huge[:width - 64], subnormal[width - 64:]])
        return torch.stack([torch.zeros(width), huge, subnormal, mixed]).to("cuda", dtype)

    kv_a = special_rows(576)
    q = torch.cat([torch.randn(4, 2, 128, generator=gen).to("cuda", dtype),
                   torch.stack([special_rows(64), special_rows(64)], 1)], -1)
    positions = torch.full((4,), max_position - 1, device="cuda")
    weight = (torch.rand(512, generator=gen) + 0.5).to("cuda", dtype)
    num_blocks, block_size = 4, 16
    cu_q, hist = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([13], dtype=torch.int32)
    ids, cu_blocks = torch.tensor([2, 0]), torch.tensor([0, 2], dtype=torch.int32)
    slots = (torch.tensor([3, 20, 37, 63]) if addressing == "paged" else
             block_slots(cu_q, hist, cu_blocks, ids, block_size)).cuda()  # blocks: positions 13..16
    blk, off = slots // block_size, slots % block_size
    rope_first = addressing == "blocks"  # BlockPool's default row order

    def assert_rounded_like(got, want64, what):
        if dtype == torch.float32:
            for i in range(got.shape[0]):
                assert_close_rows(got[i], want64[i], dtype, f"{what} row {i}")
        else:
            distance = ulp_distance(got, want64.to(dtype))
            assert int(distance.max()) <= 1, f"{what}: {int(distance.max())} ulp from the reference"

    for fused in (False, True):
        if addressing == "paged":
            layer = cache = poison_like(torch.empty(num_blocks, block_size, 576, dtype=dtype, device="cuda"), gen)
        else:
            pool = BlockPool(num_blocks, 1, block_size, dtype, "cuda")
            pool.storage.copy_(poison_like(pool.storage, gen))
            layer, cache = pool.storage[:, 0], pool.cache(0, ids, cu_blocks)
        before, q_arch = layer.clone(), q.clone()
        write_rows(fused, kv_a, weight, positions, cs, cache, slots=slots, cu_q=cu_q, hist=hist, q=q_arch,
                   arch=arch)
        stored, what = layer[blk, off], f"fused={fused}"
        if fused:
            q64 = q.double()
            ref = fused_reference_layer(before, rope_first, kv_a, weight, 1e-6, positions, cs, slots, q=q64)
            assert_rounded_like(stored, ref[blk, off], f"{what} rows")
            assert_rounded_like(q_arch.flatten(0, 1), q64.flatten(0, 1), f"{what} q")
            assert (stored[0] == 0).all() and (q_arch[0, :, 128:] == 0).all(), f"{what}: zeros not kept"
        else:
            assert same_bytes(stored, to_rope_first(kv_a) if rope_first else kv_a), \
                f"{what}: rows not stored bit for bit"
        written = slot_mask(slots, num_blocks, block_size)
        assert same_bytes(layer[~written], before[~written]), f"{what}: other rows changed"


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
