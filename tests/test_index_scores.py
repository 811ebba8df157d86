"""index_scores (the DeepSeek Sparse Attention indexer's logits) against the float64 reference, on every kernel
variant; the reference against a scorer that reads the cache's bytes itself.

Caches hold random e4m3 codes and scales over shuffled pages; every byte a call must not read (unused pages,
positions past a sequence's length) holds NaN codes, so a stray read shows as NaN. Outputs start as NaN and
every column of every scored row is checked (its -inf past the token's position included), the rows past
cu_q_lens and the columns past max_kv_len of a wider buffer must stay untouched. Shapes: 16, 32 and 64 heads,
page sizes 4, 16 and 64, lengths 1 to 131,072 (tile, chunk and page boundaries), decode and packed prefill
with cached prefixes, fp16 / bf16 / e4m3 queries, missing pages, CUDA-graph replay, argument checks.
"""
import numpy as np
import pytest
import torch

import mla_kv
from mla_kv import layout, reference
from mla_kv.reference.quant import e4m3_values

from gpu_checks import capture_graph

GPU = pytest.mark.gpu
ALL_ARCHS = pytest.mark.arch_variants("best", "sm80", "sm75", "sm70", bf16_needs_sm80=False)
NAN_CODE = 0x7F
# The kernel's products are exact (fp16 operands) and its sums fp32: errors stay within a few fp32 ulps of
# the sum of the terms' magnitudes.
REL_TOL = 1e-5


def random_codes(shape, gen, device):
    codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8, device="cpu").to(device)
    return torch.where((codes & 0x7F) == 0x7F, codes ^ 0x01, codes)  # no NaN codes


def index_cache_for(kv_lens, page_size, gen, *, device="cuda", spare=3, stride_pad=0, max_kv_len=0):
    """(index_cache, block_table): shuffled pages for each sequence's positions, random codes and scales there,
    NaN codes (and NaN scales) wherever no call may read; table entries past a sequence's pages are outside
    the cache."""
    need = [max(1, -(-n // page_size)) for n in kv_lens]
    num_blocks = sum(need) + spare
    page_bytes = page_size * layout.INDEX_ROW_BYTES
    pitch = page_bytes + stride_pad
    storage = torch.full((num_blocks, pitch), NAN_CODE, dtype=torch.uint8, device=device)
    cache = storage[:, :page_bytes].unflatten(1, (page_size, layout.INDEX_ROW_BYTES))
    nan_scale = torch.tensor([float("nan")], dtype=torch.float32).view(torch.uint8)
    storage[:, page_size * layout.INDEX_DIM:page_bytes] = nan_scale.repeat(page_size).to(device)
    perm = torch.randperm(num_blocks, generator=gen).int()
    width = max(max(need), -(-max_kv_len // page_size)) + 1
    table = torch.full((len(kv_lens), width), num_blocks + 7, dtype=torch.int32)
    used = 0
    for b, n in enumerate(kv_lens):
        pages = perm[used:used + need[b]]
        used += need[b]
        table[b, :need[b]] = pages
        for i, page in enumerate(pages.tolist()):
            live = min(page_size, n - i * page_size)
            if live <= 0:
                continue
            storage[page, :live * layout.INDEX_DIM] = random_codes((live * layout.INDEX_DIM,), gen, device)
            scales = torch.exp2(torch.rand(live, generator=gen) * 8 - 10).float()
            start = page_size * layout.INDEX_DIM
            storage[page, start:start + 4 * live] = scales.view(torch.uint8).to(device)
    return cache, table.to(device)


def random_queries(tokens, heads, kind, gen, device="cuda"):
    """(q, q_scale) of one kind: fp16 / bf16 values, or e4m3 codes with per-(token, head) scales."""
    if kind == "e4m3":
        q = random_codes((tokens, heads, layout.INDEX_DIM), gen, device)
        return q, (torch.rand(tokens, heads, generator=gen) * 0.1 + 0.01).to(device)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[kind]
    q = torch.randn(tokens, heads, layout.INDEX_DIM, generator=gen) * (3.0 if kind == "bf16" else 1.0)
    return q.to(dtype).to(device), None


def magnitude_bound(q, weights, cache, table, kv_lens, max_kv_len, cu_q_lens, q_scale):
    """The reference over |q|, |w| and |k|: the sum of the terms' magnitudes, which bounds the rounding."""
    magnitude = cache.clone()
    codes, _ = layout.index_cache_parts(magnitude)
    codes &= 0x7F
    abs_q = q & 0x7F if q_scale is not None else q.abs()
    bound = reference.index_scores(abs_q, weights.abs(), magnitude, table, kv_lens, max_kv_len, cu_q_lens=cu_q_lens,
                                   q_scale=q_scale)
    return bound.double().nan_to_num(0.0, posinf=0.0, neginf=0.0)


def check_scores(got, q, weights, cache, table, kv_lens, max_kv_len, cu_q_lens=None, q_scale=None):
    want = reference.index_scores(q.cpu(), weights.cpu(), cache.cpu(), table.cpu(), kv_lens.cpu(), max_kv_len,
                                  cu_q_lens=None if cu_q_lens is None else cu_q_lens.cpu(),
                                  q_scale=None if q_scale is None else q_scale.cpu()).double()
    bound = magnitude_bound(q.cpu(), weights.cpu(), cache.cpu(), table.cpu(), kv_lens.cpu(), max_kv_len,
                            None if cu_q_lens is None else cu_q_lens.cpu(),
                            None if q_scale is None else q_scale.cpu())
    rows = want.shape[0] if cu_q_lens is None else int(cu_q_lens[-1])
    got, want, bound = got[:rows].double().cpu(), want[:rows], bound[:rows]
    masked = torch.isinf(want)
    assert torch.equal(torch.isneginf(got), masked), (
        f"-inf columns differ: got {int(torch.isneginf(got).sum())}, want {int(masked.sum())}; first at "
        f"{(torch.isneginf(got) != masked).nonzero()[0].tolist()}")
    assert not torch.isnan(got).any(), f"NaN at {torch.isnan(got).nonzero()[0].tolist()} (an unread byte was read)"
    err = torch.where(masked, 0.0, (got - want).abs())
    tol = REL_TOL * bound + 1e-30
    worst = (err - tol).argmax()
    t, s = divmod(int(worst), want.shape[1])
    assert (err <= tol).all(), (f"logit [{t}, {s}] = {got[t, s].item():.6e}, reference {want[t, s].item():.6e} "
                                f"(bound {bound[t, s].item():.3e})")


def run_case(kv_lens, q_lens, heads, page_size, kind, arch, *, decode, max_kv_len=None, stride_pad=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache, table = index_cache_for(kv_lens, page_size, gen, stride_pad=stride_pad, max_kv_len=max_kv_len or 0)
    tokens = sum(q_lens)
    q, q_scale = random_queries(tokens, heads, kind, gen)
    weights = (torch.randn(tokens, heads, generator=gen) * 0.1).cuda()
    lens = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    cu = None if decode else torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32, device="cuda")
    width = max_kv_len or max(kv_lens)
    out = torch.full((tokens, width + 5), float("nan"), device="cuda")[:, :width]
    got = mla_kv.index_scores(q, weights, cache, table, lens, width, cu_q_lens=cu,
                              max_q_len=None if decode else max(q_lens), q_scale=q_scale, out=out, arch=arch)
    assert got.data_ptr() == out.data_ptr()
    assert torch.isnan(out.as_strided((tokens, 5), (out.stride(0), 1), out.storage_offset() + width)).all(), \
        "columns past max_kv_len were written"
    check_scores(got, q, weights, cache, table, lens, width, cu, q_scale)


# ------------------------------------------------------------------------------------------------ GPU
DECODE_CASES = {  # name -> (kv_lens, heads, page_size)
    "b1-len1-h64": ([1], 64, 64),
    "b3-h32-tile-edges": ([63, 64, 65], 32, 64),
    "b4-h16-page4": ([1, 130, 257, 2], 16, 4),
    "b2-h64-page16-chunks": ([4097, 1000], 64, 16),
    "b5-h32-mixed": ([3000, 1, 640, 129, 2049], 32, 64),
}


@GPU
@ALL_ARCHS
@pytest.mark.parametrize("kind", ["fp16", "bf16", "e4m3"])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_scores(case, kind, arch):
    kv_lens, heads, page_size = DECODE_CASES[case]
    run_case(kv_lens, [1] * len(kv_lens), heads, page_size, kind, arch, decode=True)


PREFILL_CASES = {  # name -> (kv_lens, q_lens, heads, page_size)
    "mtp2-h64": ([300, 77], [2, 2], 64, 64),
    "prefill-h32-prefix": ([70, 200, 5], [7, 64, 5], 32, 64),
    "prefill-h16-odd": ([33, 129], [33, 3], 16, 16),
    "prefill-h64-long": ([1500], [129], 64, 64),
}


@GPU
@ALL_ARCHS
@pytest.mark.parametrize("kind", ["fp16", "bf16", "e4m3"])
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_scores(case, kind, arch):
    kv_lens, q_lens, heads, page_size = PREFILL_CASES[case]
    run_case(kv_lens, q_lens, heads, page_size, kind, arch, decode=False)


@GPU
@pytest.mark.parametrize("kind", ["bf16", "e4m3"])
@pytest.mark.parametrize("heads", [32, 64])
def test_long_context(heads, kind):
    run_case([131072], [1], heads, 64, kind, None, decode=True)


@GPU
@ALL_ARCHS
def test_wider_logits_padded_stride_and_missing_pages(arch):
    """max_kv_len past every length (-inf there), a padded page stride, a page id outside the cache (a zero key:
    logits 0 on its positions), rows past cu_q_lens untouched."""
    gen = torch.Generator().manual_seed(5)
    kv_lens, q_lens, heads = [150, 40], [3, 2], 32
    cache, table = index_cache_for(kv_lens, 64, gen, stride_pad=48, max_kv_len=300)
    table[0, 1] = -3  # positions 64..127 of sequence 0 have no page
    tokens = sum(q_lens) + 2  # two padded rows past cu_q_lens
    q, _ = random_queries(tokens, heads, "fp16", gen)
    weights = torch.rand(tokens, heads, generator=gen).cuda()
    lens = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 3, 5], dtype=torch.int32, device="cuda")
    out = torch.full((tokens, 300), float("nan"), device="cuda")
    mla_kv.index_scores(q, weights, cache, table, lens, 300, cu_q_lens=cu, max_q_len=3, out=out, arch=arch)
    check_scores(out, q, weights, cache, table, lens, 300, cu)
    assert torch.isnan(out[5:]).all(), "rows past cu_q_lens were written"
    assert (out[:3, 64:128] == 0).all(), "a missing page must read as zero keys"


@GPU
def test_deep_chunks_wrap_the_load_ring():
    """Chunks of many tiles (here 8 a CTA on an H100), so that every slot of the Sm80 tag's cp.async ring is
    refilled several times within a CTA."""
    run_case([131072, 131071, 100000, 130000], [1] * 4, 64, 64, "bf16", None, decode=True)


@GPU
@ALL_ARCHS
@pytest.mark.parametrize("page_size, holes", [
    (64, [(0, 3, -1), (0, 9, "past"), (1, 4, -1)]),
    (4, [(0, 50, -1), (0, 150, "past"), (1, 70, -7)]),
])
def test_missing_pages_inside_the_load_ring(page_size, holes, arch):
    """Table entries without a page (negative, or past the cache) at tiles the ring loads after its first ones,
    and in a sequence's partial last tile: zero keys there, logit 0."""
    gen = torch.Generator().manual_seed(9)
    kv_lens, heads = [1000, 300], 32
    cache, table = index_cache_for(kv_lens, page_size, gen)
    for b, page, value in holes:
        table[b, page] = cache.shape[0] if value == "past" else value
    q, _ = random_queries(2, heads, "fp16", gen)
    weights = torch.rand(2, heads, generator=gen).cuda()
    lens = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    out = torch.full((2, 1000), float("nan"), device="cuda")
    mla_kv.index_scores(q, weights, cache, table, lens, 1000, out=out, arch=arch)
    check_scores(out, q, weights, cache, table, lens, 1000)
    for b, page, _ in holes:
        cols = slice(page * page_size, min((page + 1) * page_size, kv_lens[b]))
        assert (out[b, cols] == 0).all(), f"sequence {b}'s missing page {page} must read as zero keys"


@GPU
def test_cuda_graph_replay():
    gen = torch.Generator().manual_seed(9)
    kv_lens, heads = [701, 65, 2007], 64  # the longest lengths the replays take: their keys are written
    cache, table = index_cache_for(kv_lens, 64, gen, max_kv_len=2048)
    q, _ = random_queries(3, heads, "bf16", gen)
    weights = torch.randn(3, heads, generator=gen).cuda()
    lens = torch.tensor([700, 65, 2000], dtype=torch.int32, device="cuda")
    out = torch.full((3, 2048), float("nan"), device="cuda")
    graph = capture_graph(lambda: mla_kv.index_scores(q, weights, cache, table, lens, 2048, out=out))
    for step in range(2):
        fresh, _ = random_queries(3, heads, "bf16", gen)
        q.copy_(fresh)
        lens.copy_(torch.tensor([700 + step, 65 - step, 2000 + 7 * step], dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_scores(out, q, weights, cache, table, lens, 2048)


@GPU
def test_validate_catches_device_data():
    gen = torch.Generator().manual_seed(2)
    cache, table = index_cache_for([100], 64, gen, max_kv_len=128)
    q, _ = random_queries(1, 32, "fp16", gen)
    w = torch.ones(1, 32, device="cuda")
    lens = torch.tensor([129], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="max_kv_len"):
        mla_kv.index_scores(q, w, cache, table, lens, 128, validate=True)
    lens.fill_(100)
    table[0, 0] = 10_000
    with pytest.raises(ValueError, match="block_table"):
        mla_kv.index_scores(q, w, cache, table, lens, 128, validate=True)


# ------------------------------------------------------------------------------------------------ CPU
def e4m3_decode(byte: int) -> float:
    """OCP E4M3 by its definition: bias 7, subnormals at exponent 0, 0x7F / 0xFF NaN."""
    byte = int(byte)
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return float("nan")
    if exp == 0:
        return sign * man / 8 * 2.0 ** -6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def scores_from_bytes(q, weights, cache_bytes, table, kv_lens, q_lens, width):
    """logits from the cache's raw bytes, as sparse-mla.md describes them (numpy, one position at a time)."""
    pages = cache_bytes.reshape(cache_bytes.shape[0], -1)
    page_size = cache_bytes.shape[1]
    decode = np.vectorize(e4m3_decode)
    out = np.full((q.shape[0], width), -np.inf)
    row = 0
    for b, (n, m) in enumerate(zip(kv_lens, q_lens)):
        for i in range(m):
            p = n - m + i
            for s in range(p + 1):
                page, off = table[b, s // page_size], s % page_size
                key = decode(pages[page, off * 128:(off + 1) * 128]) * \
                    pages[page, page_size * 128 + off * 4:page_size * 128 + off * 4 + 4].view(np.float32)[0]
                out[row, s] = sum(weights[row, h] * max(float(q[row, h] @ key), 0.0) for h in range(q.shape[1]))
            row += 1
    return out


def test_reference_against_bytes():
    gen = torch.Generator().manual_seed(1)
    kv_lens, q_lens, heads = [5, 9], [2, 3], 4
    cache, table = index_cache_for(kv_lens, 4, gen, device="cpu")
    q = torch.randn(5, heads, 128, generator=gen, dtype=torch.float64)
    w = torch.randn(5, heads, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, 2, 5])
    got = reference.index_scores(q, w, cache, table, torch.tensor(kv_lens), 12, cu_q_lens=cu)
    want = scores_from_bytes(q.numpy(), w.numpy(), cache.numpy(), table.numpy(), kv_lens, q_lens, 12)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)


def test_reference_e4m3_queries_equal_their_values():
    gen = torch.Generator().manual_seed(3)
    cache, table = index_cache_for([37], 16, gen, device="cpu")
    codes, scale = random_queries(1, 8, "e4m3", gen, device="cpu")
    values = e4m3_values(codes).double() * scale.double()[..., None]
    w = torch.rand(1, 8, dtype=torch.float64)
    lens = torch.tensor([37])
    a = reference.index_scores(codes, w, cache, table, lens, 40, q_scale=scale)
    b = reference.index_scores(values, w, cache, table, lens, 40)
    torch.testing.assert_close(a, b.float(), rtol=1e-6, atol=0)


def test_cpu_op_runs_the_reference():
    gen = torch.Generator().manual_seed(4)
    cache, table = index_cache_for([10, 3], 4, gen, device="cpu")
    q = torch.randn(4, 16, 128, generator=gen)
    w = torch.randn(4, 16, generator=gen)
    lens, cu = torch.tensor([10, 3], dtype=torch.int32), torch.tensor([0, 2, 4], dtype=torch.int32)
    got = mla_kv.index_scores(q, w, cache, table, lens, 12, cu_q_lens=cu, max_q_len=2)
    want = reference.index_scores(q, w, cache, table, lens, 12, cu_q_lens=cu)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.isneginf(got[0, 9:]).all() and torch.isfinite(got[1, :10]).all()


def _args():
    gen = torch.Generator().manual_seed(6)
    cache, table = index_cache_for([10], 4, gen, device="cpu")
    return dict(q=torch.randn(1, 16, 128), weights=torch.randn(1, 16), index_cache=cache, block_table=table,
                kv_lens=torch.tensor([10], dtype=torch.int32), max_kv_len=12)


@pytest.mark.parametrize("change, name", [
    (dict(q=torch.randn(1, 16, 64)), "q"),
    (dict(q=torch.randint(0, 9, (1, 16, 128), dtype=torch.int32)), "q"),
    (dict(weights=torch.randn(1, 8)), "weights"),
    (dict(weights=torch.randn(1, 16, dtype=torch.float64)), "weights"),
    (dict(index_cache=torch.zeros(3, 4, 128, dtype=torch.uint8)), "index_cache"),
    (dict(index_cache=torch.zeros(3, 4, 132)), "index_cache"),
    (dict(kv_lens=torch.tensor([10, 2], dtype=torch.int32)), "kv_lens"),
    (dict(kv_lens=torch.tensor([10])), "kv_lens"),
    (dict(max_kv_len=0), "max_kv_len"),
    (dict(max_kv_len=40), "block_table"),
    (dict(q_scale=torch.ones(1, 16)), "q"),
    (dict(cu_q_lens=torch.tensor([0, 1], dtype=torch.int32)), "max_q_len"),
    (dict(cu_q_lens=torch.tensor([0, 1, 1], dtype=torch.int32), max_q_len=1), "cu_q_lens"),
    (dict(max_q_len=2), "max_q_len"),
    (dict(out=torch.empty(1, 11)), "out"),
    (dict(arch="sm60"), "arch"),
])
def test_bad_arguments_name_themselves(change, name):
    args = {**_args(), **change}
    with pytest.raises((ValueError, TypeError), match=rf"^{name}\b"):
        mla_kv.index_scores(args.pop("q"), args.pop("weights"), args.pop("index_cache"), args.pop("block_table"),
                            args.pop("kv_lens"), args.pop("max_kv_len"), **args)
