"""layout.BlockPool with layers of different sizes (TurboMind sums its layers' actual sizes for the
per-layer offset inside a block: quantized or non-MLA layers are smaller or larger than an MLA one).

CPU tests: the offsets are running sums, misaligned layouts are refused naming layer_bytes and the
layer, every layer view aliases exactly its own bytes, opaque regions have no view, ``storage`` keeps
its meaning for uniform pools, and the reference block ops read the right layer. GPU tests: the
block-pointer writes and attention over the layer after an opaque region equal the reference on its
layer view, and no byte outside the written rows changes (the other layers and the opaque region
included).
"""
import pytest
import torch

import mla_kv
from mla_kv import layout, reference
from mla_kv.layout import ROW_DIM, BlockPool, block_slots, to_latent_first, to_rope_first
from mla_kv.rope import cos_sin_cache

from gpu_checks import ATTENTION_ARCHS, check_attention, random_cache, run_decode, run_prefill, same_bytes

GPU = pytest.mark.gpu
# The write kernels' variants, as in tests/test_write.py: the device's best and, where the dtype allows,
# the Volta one.
WRITE_ARCHS = pytest.mark.arch_variants("best", "sm70", bf16_needs_sm80=True)
WRITE_TOL = {torch.float16: 2e-3, torch.bfloat16: 8e-3, torch.float32: 2e-6}

OPAQUE = -(-1000 // 16) * 16  # a non-MLA layer of 1000 bytes per block, rounded up to 16 (1008)


def mla_bytes(block_seq_len, dtype):
    """One MLA layer's region of a block: block_seq_len unquantized rows."""
    return layout.block_bytes(None, block_seq_len, dtype)


def mixed_pool(num_blocks, block_seq_len, dtype, device="cpu", **kw):
    """Layers [MLA, an opaque 1008-byte region, MLA]: layer 2 starts at no multiple of an MLA layer."""
    rows = mla_bytes(block_seq_len, dtype)
    return BlockPool(num_blocks, 3, block_seq_len, dtype, device, layer_bytes=[rows, OPAQUE, rows], **kw)


def random_bytes(pool, gen):
    """Every byte of the pool random (NaN and all in the typed views)."""
    pool.bytes.copy_(torch.randint(0, 256, pool.bytes.shape, generator=gen, dtype=torch.uint8))


# ---------------------------------------------------------------------------------- CPU
def test_offsets_are_running_sums_of_layer_bytes():
    bsl, dtype = 16, torch.float16
    rows = mla_bytes(bsl, dtype)                                   # 18,432
    int8 = layout.block_bytes("int8", bsl, dtype)                  # 16 x 576 codes + 16 (scale, zero)
    sizes = [rows, OPAQUE, rows + 64, int8, rows]
    pool = BlockPool(5, 5, bsl, dtype, layer_bytes=sizes)
    assert pool.layer_bytes == tuple(sizes) and pool.num_layers == 5 and pool.num_blocks == 5
    assert [pool.layer_offset_bytes(l) for l in range(5)] == [0, rows, rows + OPAQUE, 2 * rows + OPAQUE + 64,
                                                              2 * rows + OPAQUE + 64 + int8]
    assert pool.bytes.dtype == torch.uint8 and tuple(pool.bytes.shape) == (5, sum(sizes))
    assert pool.bytes_per_block == sum(sizes)
    ids, cu = torch.tensor([3, 0, 4]), torch.tensor([0, 1, 3])
    for layer in (0, 2, 4):
        cache = pool.cache(layer, ids, cu)
        assert cache.layer_offset_bytes == pool.layer_offset_bytes(layer)
        assert cache.block_ptrs.tolist() == [pool.bytes[i].data_ptr() for i in ids.tolist()]
        view = pool.layer_view(layer)
        for i, block in enumerate(ids.tolist()):
            address = int(cache.block_ptrs[i]) + cache.layer_offset_bytes + 5 * cache.row_stride_bytes
            assert view[block, 5].data_ptr() == address


def test_default_layout_is_every_layer_its_rows():
    pool = BlockPool(4, 3, 8, torch.bfloat16, rope_first=False)
    rows = mla_bytes(8, torch.bfloat16)
    assert pool.layer_bytes == (rows,) * 3 and [pool.layer_offset_bytes(l) for l in range(3)] == [0, rows, 2 * rows]
    storage = pool.storage
    assert tuple(storage.shape) == (4, 3, 8, ROW_DIM) and storage.dtype == torch.bfloat16 and storage.is_contiguous()
    assert storage.data_ptr() == pool.bytes.data_ptr()
    storage[2, 1, 3] = 7.0                                         # a view: writes land in the pool
    assert torch.equal(pool.layer_view(1)[2, 3], torch.full((ROW_DIM,), 7.0, dtype=torch.bfloat16))
    for layer in range(3):
        assert same_bytes(pool.layer_view(layer), storage[:, layer])


def test_uniform_pool_with_padded_layers_keeps_storage():
    """Layers of one size larger than their rows (padding after each layer's rows) still form a 4-D view."""
    rows = mla_bytes(4, torch.float32)
    pool = BlockPool(3, 2, 4, torch.float32, layer_bytes=[rows + 32] * 2)
    pool.bytes.zero_()
    storage = pool.storage
    assert storage.stride() == ((2 * rows + 64) // 4, (rows + 32) // 4, ROW_DIM, 1)
    storage.fill_(1.0)
    padding = pool.bytes.view(3, 2, rows + 32)[:, :, rows:]
    assert (padding == 0).all(), "storage reaches past a layer's rows"
    assert (pool.layer_view(1) == 1.0).all()


def test_misaligned_layouts_name_layer_bytes_and_the_layer():
    rows = mla_bytes(16, torch.float16)
    cases = [
        ([rows, 1000, rows], ValueError, r"layer_bytes: layer 2 starts at byte 19432"),
        ([8, 8, rows], ValueError, r"layer_bytes: layer 1 starts at byte 8"),
        ([rows, rows, 1000], ValueError, r"layer_bytes: the block's .* layer 2 ending there"),
        ([rows, rows], ValueError, r"layer_bytes: 2 entries for num_layers = 3"),
        ([rows, 0, rows], ValueError, r"layer_bytes\[1\]"),
        ([rows, 16.0, rows], TypeError, r"layer_bytes\[1\]"),
        (torch.tensor([rows] * 3), TypeError, r"layer_bytes"),
        (rows, TypeError, r"layer_bytes"),
    ]
    for sizes, error, message in cases:
        with pytest.raises(error, match=message):
            BlockPool(2, 3, 16, torch.float16, layer_bytes=sizes)
    for name, args in (("num_blocks", (-1, 3, 16)), ("num_layers", (2, 0, 16)), ("block_seq_len", (2, 3, 0))):
        with pytest.raises(ValueError, match=name):
            BlockPool(*args, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_layer_views_alias_only_their_layer(dtype):
    """Writing through layer l's view changes exactly the bytes [offset, offset + rows) of every
    block, holding the written values; the opaque region and the other layers keep theirs."""
    gen = torch.Generator().manual_seed(5)
    bsl = 8
    rows = mla_bytes(bsl, dtype)
    pool = BlockPool(6, 4, bsl, dtype, layer_bytes=[rows, OPAQUE, rows + 48, rows])  # layer 2 padded
    random_bytes(pool, gen)
    for layer in (0, 2, 3):
        before = pool.bytes.clone()
        values = torch.randn(6, bsl, ROW_DIM, generator=gen).to(dtype)
        view = pool.layer_view(layer)
        assert tuple(view.shape) == (6, bsl, ROW_DIM) and view.dtype == dtype
        view.copy_(values)
        offset = pool.layer_offset_bytes(layer)
        expected = before.clone()
        expected[:, offset:offset + rows] = values.view(torch.uint8).reshape(6, rows)
        assert torch.equal(pool.bytes, expected), f"layer {layer}: the view wrote outside its rows"
        assert same_bytes(pool.layer_view(layer), values)


def test_opaque_layer_has_no_view_and_no_cache():
    pool = mixed_pool(3, 16, torch.float16)
    ids, cu = torch.tensor([0, 2]), torch.tensor([0, 2])
    for call in (lambda: pool.layer_view(1), lambda: pool.cache(1, ids, cu)):
        with pytest.raises(ValueError, match=r"layer: layer 1 is an opaque region of 1008 bytes"):
            call()
    with pytest.raises(ValueError, match=r"storage: .*layer_bytes"):
        pool.storage
    assert pool.layer_offset_bytes(1) == mla_bytes(16, torch.float16)   # its place is known all the same
    for bad in (3, -1, True, 1.0):
        with pytest.raises(ValueError, match=r"layer: must be an int in \[0, 3\)"):
            pool.layer_view(bad)


def test_int8_sized_layer_is_opaque_to_a_16_bit_view():
    """A quantized layer (layout.block_bytes("int8", ...)) is smaller than 16-bit rows: no typed view."""
    bsl = 32
    pool = BlockPool(2, 2, bsl, torch.float16, layer_bytes=[mla_bytes(bsl, torch.float16),
                                                             layout.block_bytes("int8", bsl, torch.float16)])
    with pytest.raises(ValueError, match="layer: layer 1 is an opaque region"):
        pool.layer_view(1)


def test_storage_assignment_moves_the_pool_into_that_memory():
    """How tests put a pool inside a canaried buffer: the block and layer strides come from the view."""
    buffer = torch.zeros(5 * 3 * 18 * ROW_DIM + 100, dtype=torch.float16)
    view = buffer[:5 * 3 * 18 * ROW_DIM].view(5, 3, 18, ROW_DIM)[:, :, :16]  # 2 padding rows per layer
    pool = BlockPool(0, 3, 16, torch.float16)
    pool.storage = view
    assert pool.num_blocks == 5 and pool.bytes.data_ptr() == view.data_ptr()
    assert pool.bytes_per_block == 3 * 18 * ROW_DIM * 2 and pool.layer_offset_bytes(2) == 2 * 18 * ROW_DIM * 2
    assert pool.storage.stride() == view.stride() and pool.storage.data_ptr() == view.data_ptr()
    pool.layer_view(2)[4, 15] = 3.0
    assert (view[4, 2, 15] == 3.0).all() and int((buffer != 0).sum()) == ROW_DIM
    cache = pool.cache(1, torch.tensor([4]), torch.tensor([0, 1]))
    assert int(cache.block_ptrs[0]) + cache.layer_offset_bytes == view[4, 1].data_ptr()
    with pytest.raises(ValueError, match="storage"):
        pool.storage = view[:, :2]
    with pytest.raises(ValueError, match="storage"):
        pool.storage = view.float()


def test_reference_block_ops_read_the_layer_after_an_opaque_region():
    """reference.decode_blocks / gather_kv_blocks over layer 2 of a mixed pool equal the paged ops on
    the rows put there; the opaque layer is refused."""
    gen = torch.Generator().manual_seed(9)
    bsl, lens = 4, [3, 9]
    pool = mixed_pool(8, bsl, torch.float32)
    random_bytes(pool, gen)
    rows = [torch.randn(n, ROW_DIM, generator=gen) for n in lens]
    ids, cu = torch.tensor([5, 1, 7, 2]), torch.tensor([0, 1, 4])
    paged = torch.full((8, bsl, ROW_DIM), float("nan"))
    table = torch.tensor([[5, 0, 0], [1, 7, 2]], dtype=torch.int32)
    for b, r in enumerate(rows):
        pos = torch.arange(lens[b])
        paged[table[b, pos // bsl].long(), pos % bsl] = r
    pool.layer_view(2).copy_(to_rope_first(paged))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(2, 1, 3, ROW_DIM, generator=gen)
    out, lse = reference.decode_blocks(q, pool, 2, ids, cu, seq_lens, 0.1)
    want_out, want_lse = reference.decode(q, paged, table, seq_lens, 0.1)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    gathered = reference.gather_kv_blocks(pool, 2, ids, cu, torch.tensor([0] + lens).cumsum(0))
    assert torch.equal(gathered, torch.cat(rows)), "gather_kv_blocks: not the rows put in layer 2"
    with pytest.raises(ValueError, match="layer: layer 1 is an opaque region"):
        reference.decode_blocks(q, pool, 1, ids, cu, seq_lens, 0.1)


# ---------------------------------------------------------------------------------- GPU
def assert_close_rows(got, want, dtype, what):
    assert not torch.isnan(got).any(), f"{what}: NaN written"
    err = (got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)
    assert err <= WRITE_TOL[dtype], f"{what}: relative error {err:.3e} > {WRITE_TOL[dtype]:.1e}"


@GPU
@WRITE_ARCHS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fused", [False, True])
def test_block_writes_into_the_layer_after_an_opaque_region(dtype, fused, arch):
    """write_kv_blocks (bit-exact) and fused_write_kv_blocks (the float64 reference's tolerance) into
    layer 2 of a [MLA, opaque 1008 B, MLA] pool equal the reference on layer_view(2) at the slots
    layout.block_slots gives; every other byte of the pool (layer 0, the opaque region, unwritten
    rows, blocks nobody owns) keeps its value, and q is rotated like the reference."""
    gen = torch.Generator().manual_seed(17 + fused)
    bsl, num_blocks = 64, 24
    q_lens, hist = [1, 0, 150, 64, 5], [0, 17, 63, 200, 127]
    need = [-(-(h + n) // bsl) for h, n in zip(hist, q_lens)]
    ids = torch.randperm(num_blocks, generator=gen)[:sum(need)]
    cu_blocks = torch.tensor([0] + need).cumsum(0).int()
    cu_q = torch.tensor([0] + q_lens).cumsum(0).int()
    hist_t = torch.tensor(hist, dtype=torch.int32)
    total = int(cu_q[-1])
    pool = mixed_pool(num_blocks, bsl, dtype, "cuda")
    random_bytes(pool, gen)
    for layer in (0, 2):  # finite rows, so the reference of the rows it does not write stays comparable
        pool.layer_view(layer).copy_(torch.rand(num_blocks, bsl, ROW_DIM, generator=gen) * 8 + 3)
    before = pool.bytes.clone()
    kv_a = torch.randn(total + 3, 640, generator=gen).to("cuda", dtype)[:, 64:]      # 3 rows past the batch
    q = torch.randn(total + 3, 5, 256, generator=gen).to("cuda", dtype)
    positions = torch.cat([torch.arange(h, h + n) for h, n in zip(hist, q_lens)] + [torch.tensor([5, 0, 9])]).cuda()
    weight = (torch.rand(512, generator=gen) + 0.5).to("cuda", dtype)
    cs = cos_sin_cache(64, 4096, 1e6, device="cuda")
    cache = pool.cache(2, ids, cu_blocks)
    q_before = q.clone()
    if fused:
        mla_kv.fused_write_kv_blocks(kv_a, weight, 1e-6, positions, cs, cache, cu_q.cuda(), hist_t.cuda(), q=q,
                                     arch=arch, validate=True)
    else:
        mla_kv.write_kv_blocks(kv_a[:, :512], kv_a[:, 512:], cache, cu_q.cuda(), hist_t.cuda(), arch=arch,
                               validate=True)
    torch.cuda.synchronize()
    slots = block_slots(cu_q, hist_t, cu_blocks, ids, bsl).cuda()
    assert int((slots >= 0).sum()) == total
    written = torch.zeros(num_blocks * bsl, dtype=torch.bool, device="cuda")
    written[slots] = True
    written = written.view(num_blocks, bsl)
    expected = mixed_pool(num_blocks, bsl, dtype, "cuda")
    expected.bytes.copy_(before)
    got = pool.layer_view(2)
    if fused:
        layer64 = to_latent_first(expected.layer_view(2)).double()
        reference.fused_write_kv(kv_a.double(), weight.double(), 1e-6, positions, cs.double(), layer64, slots)
        assert_close_rows(got[written], to_rope_first(layer64)[written], dtype, "layer 2 rows")
        expected.layer_view(2)[written] = got[written]  # judged above; every other byte must stay
        q_ref = reference.apply_rope(q_before[:, :, -64:].double(), positions, cs.double())
        assert_close_rows(q[:, :, -64:], q_ref, dtype, "q_pe")
        assert same_bytes(q[:, :, :-64], q_before[:, :, :-64]), "q's nope part changed"
    else:
        rows = to_latent_first(expected.layer_view(2))
        reference.write_kv(kv_a[:, :512], kv_a[:, 512:], rows, slots)
        expected.layer_view(2).copy_(to_rope_first(rows))
    assert same_bytes(pool.bytes, expected.bytes), \
        "bytes outside layer 2's written rows changed (or a plain row is not bit-exact)"


@GPU
@ATTENTION_ARCHS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_over_the_layer_after_an_opaque_region(dtype, arch):
    """decode and prefill over layer 2 of a [MLA, opaque 1008 B, MLA] pool (rope first) equal the float64
    reference over the paged cache whose rows it holds; layer 0 is NaN and the opaque region random
    bytes, so a read of the wrong layer shows; nothing in the pool changes."""
    gen = torch.Generator().manual_seed(23)
    bsl, lens, heads = 64, [1, 64, 130, 700], 20
    cache, table, seq_lens = random_cache(lens, bsl, dtype)   # NaN at every row no sequence has
    num_blocks = cache.shape[0]
    pool = mixed_pool(num_blocks, bsl, dtype, "cuda")
    random_bytes(pool, gen)
    pool.layer_view(0).fill_(float("nan"))
    pool.layer_view(2).copy_(to_rope_first(cache))
    counts = [-(-n // bsl) for n in lens]
    ids = torch.cat([table[b, :n].cpu().long() for b, n in enumerate(counts)])
    blocks = pool.cache(2, ids, torch.tensor([0] + counts).cumsum(0).int())
    assert blocks.layer_offset_bytes == mla_bytes(bsl, dtype) + OPAQUE
    before = pool.bytes.clone()

    q = torch.randn(len(lens), 1, heads, ROW_DIM, generator=gen).to("cuda", dtype)
    ref = reference.decode(q.double(), cache.double(), table, seq_lens, 0.07)
    out, lse = run_decode(q, blocks, None, seq_lens, 0.07, arch=arch, validate=True)
    check_attention(out, lse, *ref, "decode over layer 2")

    q_lens = [1, 10, 30, 64]
    cu_q = torch.tensor([0] + q_lens, device="cuda").cumsum(0).int()
    qp = torch.randn(sum(q_lens), heads, ROW_DIM, generator=gen).to("cuda", dtype)
    ref = reference.prefill(qp.double(), cache.double(), table, cu_q, seq_lens, 0.07)
    out, lse = run_prefill(qp, blocks, None, cu_q, seq_lens, 0.07, arch=arch, validate=True)
    check_attention(out, lse, *ref, "prefill over layer 2", cu_q_lens=cu_q)
    torch.cuda.synchronize()
    assert same_bytes(pool.bytes, before), "attention changed the pool"
