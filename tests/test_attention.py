"""decode / prefill / merge_states kernels against the float64 reference (mla_kv.reference).

Outputs are poisoned (NaN) before each launch so an unwritten element fails; every case draws fresh
random data. Tolerances: ||out - ref|| / ||ref|| <= 3e-3 (fp16), 1e-2 (bf16); |lse - ref| <= 1e-3.
"""
import math

import pytest
import torch

import mla_kv
from mla_kv import reference
from mla_kv.layout import BlockPool

pytestmark = pytest.mark.gpu

REL_TOL = {torch.float16: 3e-3, torch.bfloat16: 1e-2}
LSE_TOL = 1e-3


def archs_for(dtype):
    """The GPU's best variant (None) and every older one that runs here: on Hopper None takes the
    wgmma kernel, so sm80 keeps the mma.sync kernel covered."""
    older = ["sm80"] if torch.cuda.get_device_capability()[0] >= 9 else []
    return [None] + older + ([] if dtype == torch.bfloat16 else ["sm75", "sm70"])


def random_cache(num_blocks, block_size, dtype, gen):
    return (torch.randn(num_blocks, block_size, 576, generator=gen, device="cuda") * 0.5).to(dtype)


def random_table(lens, block_size, num_blocks, gen, shared_prefix_blocks=0):
    """Shuffled distinct blocks per sequence; the first shared_prefix_blocks are shared by all."""
    need = [max(1, -(-n // block_size)) for n in lens]
    width = max(need) + 1
    perm = torch.randperm(num_blocks, generator=gen, device="cuda").int()
    table = torch.full((len(lens), width), num_blocks + 7, dtype=torch.int32, device="cuda")  # poison
    shared, used = perm[:shared_prefix_blocks], shared_prefix_blocks
    for b, n in enumerate(need):
        own = n - shared_prefix_blocks
        table[b, :shared_prefix_blocks] = shared
        table[b, shared_prefix_blocks:n] = perm[used:used + own]
        used += own
    assert used <= num_blocks
    return table


def check(out, lse, ref_out, ref_lse, dtype, what):
    assert not torch.isnan(out).any(), f"{what}: NaN in out (unwritten or bad math)"
    ref_norm = ref_out.norm()
    err = ((out.double() - ref_out).norm() / ref_norm).item() if ref_norm > 0 else out.double().abs().max().item()
    assert err <= REL_TOL[dtype], f"{what}: relative error {err:.2e}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{what}: lse -inf pattern differs"
    if finite.any():
        lerr = (lse.double()[finite] - ref_lse[finite]).abs().max().item()
        assert lerr <= LSE_TOL, f"{what}: lse error {lerr:.2e}"
    assert (out[~finite] == 0).all(), f"{what}: rows that see no key must be 0"


def run_decode_case(lens, heads, s_q, block_size, dtype, gen, *, shared=0, arch=None, schedule=None):
    num_blocks = sum(max(1, -(-n // block_size)) for n in lens) + 4
    cache = random_cache(num_blocks, block_size, dtype, gen)
    table = random_table(lens, block_size, num_blocks, gen, shared)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q_full = torch.randn(len(lens), s_q, heads + 3, 576 + 64, generator=gen, device="cuda").to(dtype)
    q = q_full[:, :, 1:heads + 1, 32:32 + 576]  # strided on B, S_q and H
    scale = 1.0 / math.sqrt(192 + 64)
    out = torch.full((len(lens), s_q, heads, 512), float("nan"), dtype=dtype, device="cuda")
    lse = torch.full((len(lens), s_q, heads), float("nan"), device="cuda")
    mla_kv.decode(q, cache, table, seq_lens, scale, out=out, lse=lse, arch=arch, schedule=schedule)
    ref_out, ref_lse = reference.decode(q.double(), cache.double(), table, seq_lens, scale)
    return out, lse, ref_out, ref_lse


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [1, 5, 16, 20, 64, 128])
@pytest.mark.parametrize("s_q", [1, 2, 4])
def test_decode_heads_and_query_lengths(dtype, heads, s_q):
    gen = torch.Generator(device="cuda").manual_seed(heads * 10 + s_q)
    lens = [s_q, 1 + s_q, 63 + s_q, 64, 65, 200, 1000]
    for arch in archs_for(dtype):
        out, lse, ref_out, ref_lse = run_decode_case(lens, heads, s_q, 64, dtype, gen, arch=arch)
        check(out, lse, ref_out, ref_lse, dtype, f"H={heads} S_q={s_q} arch={arch}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,s_q", [(33, 1), (33, 3), (100, 1), (100, 3)])
def test_decode_odd_head_counts_across_cta_rows(dtype, heads, s_q):
    """Head counts that do not divide the 64-row CTA (the Sm90 kernel's, and the Sm80 kernel's above
    32 rows): a CTA's rows end inside a query token, the last CTA of a sequence is part padding."""
    gen = torch.Generator(device="cuda").manual_seed(heads + s_q)
    lens = [s_q, 64 + s_q, 700]
    for arch in archs_for(dtype):
        out, lse, ref_out, ref_lse = run_decode_case(lens, heads, s_q, 64, dtype, gen, arch=arch)
        check(out, lse, ref_out, ref_lse, dtype, f"H={heads} S_q={s_q} arch={arch}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32, 48, 64, 128])  # 48: the division path of odd sizes
def test_decode_block_sizes_shared_blocks_and_empty_sequences(dtype, block_size):
    gen = torch.Generator(device="cuda").manual_seed(block_size)
    lens = [0, 1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]
    for arch in archs_for(dtype):
        out, lse, ref_out, ref_lse = run_decode_case(lens, 20, 1, block_size, dtype, gen, arch=arch)
        check(out, lse, ref_out, ref_lse, dtype, f"bs={block_size} arch={arch}")
        lens_shared = [2 * block_size + 3, 2 * block_size + 40, 5 * block_size]
        out, lse, ref_out, ref_lse = run_decode_case(lens_shared, 16, 2, block_size, dtype, gen, shared=2,
                                                     arch=arch)
        check(out, lse, ref_out, ref_lse, dtype, f"shared bs={block_size} arch={arch}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,lens", [(16, [32768]), (128, [8191, 20000]), (20, [262144])])
def test_decode_long_contexts_split_kv(dtype, heads, lens):
    gen = torch.Generator(device="cuda").manual_seed(len(lens) + heads)
    for arch in archs_for(dtype)[:2]:
        out, lse, ref_out, ref_lse = run_decode_case(lens, heads, 1, 64, dtype, gen, arch=arch)
        check(out, lse, ref_out, ref_lse, dtype, f"long H={heads} arch={arch}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 64, 128])
def test_decode_ignores_nan_past_sequence_ends(dtype, block_size):
    """A cache from torch.empty holds anything where nothing was written: every slot past a
    sequence's length (in its last block, in unused blocks) is NaN here. Whole-box tile loads (TMA)
    read those slots; they must not reach the output (0 x NaN is NaN, so masking scores is not
    enough)."""
    gen = torch.Generator(device="cuda").manual_seed(block_size + 3)
    lens = [1, block_size - 1, 2 * block_size + 7, 700, 1500]
    num_blocks = sum(-(-n // block_size) for n in lens) + 4
    cache = random_cache(num_blocks, block_size, dtype, gen)
    table = random_table(lens, block_size, num_blocks, gen)
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool, device="cuda")
    for b, n in enumerate(lens):
        slots = torch.arange(n, device="cuda")
        written[table[b, slots // block_size].long(), slots % block_size] = True
    clean = cache.masked_fill(~written[..., None], 0.0)
    cache = cache.masked_fill(~written[..., None], float("nan"))
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    scale = 1.0 / math.sqrt(192)
    for heads in (20, 128):
        q = torch.randn(len(lens), 1, heads, 576, generator=gen, device="cuda").to(dtype)
        ref_out, ref_lse = reference.decode(q.double(), clean.double(), table, seq_lens, scale)
        for arch in archs_for(dtype):
            out = torch.full((len(lens), 1, heads, 512), float("nan"), dtype=dtype, device="cuda")
            lse = torch.full((len(lens), 1, heads), float("nan"), device="cuda")
            mla_kv.decode(q, cache, table, seq_lens, scale, out=out, lse=lse, arch=arch)
            check(out, lse, ref_out, ref_lse, dtype, f"NaN past ends bs={block_size} H={heads} arch={arch}")


def test_decode_forced_splits_match_reference():
    gen = torch.Generator(device="cuda").manual_seed(5)
    lens = [0, 5, 100, 333, 1024]  # random_table gives 17 blocks of 64 = 1088 positions per sequence
    # Splits that end inside 32-token tiles too; (2, 576): whole 64-token tiles (TMA loads on
    # Hopper) in a two-way split whose second split is empty for every sequence but the last.
    for splits, tokens in [(2, 544), (2, 576), (8, 136), (33, 33)]:
        bytes_needed = mla_kv.ops._C.attention_workspace_size(len(lens) * 3, 20, splits)
        schedule = mla_kv.AttentionSchedule(splits, tokens, bytes_needed)
        out, lse, ref_out, ref_lse = run_decode_case(lens, 20, 3, 64, torch.float16, gen, schedule=schedule)
        check(out, lse, ref_out, ref_lse, torch.float16, f"splits={splits}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rope_first", [True, False])
def test_decode_block_pointers(dtype, rope_first):
    gen = torch.Generator(device="cuda").manual_seed(7 + rope_first)
    cpu_gen = torch.Generator().manual_seed(7)
    lens, heads, s_q, bsl = [2, 64, 130, 700], 20, 2, 64
    pool = BlockPool(40, 2, bsl, dtype, "cuda", rope_first=rope_first)
    pool.storage.copy_(torch.randn(pool.storage.shape, generator=gen, device="cuda") * 0.5)
    counts = [-(-n // bsl) for n in lens]
    ids = torch.randperm(40, generator=cpu_gen)[: sum(counts)]
    cu_blocks = torch.tensor([0] + counts).cumsum(0).int()
    cache = pool.cache(1, ids, cu_blocks)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lens), s_q, heads, 576, generator=gen, device="cuda").to(dtype)
    for arch in archs_for(dtype):
        out = torch.full((len(lens), s_q, heads, 512), float("nan"), dtype=dtype, device="cuda")
        out, lse = mla_kv.decode(q, cache, None, seq_lens, 0.07, out=out, validate=True, arch=arch)
        ref_out, ref_lse = reference.decode_blocks(q.double(), pool, 1, ids, cu_blocks, seq_lens, 0.07)
        check(out, lse, ref_out.double(), ref_lse.double(), dtype, f"blocks rope_first={rope_first} arch={arch}")


def test_decode_in_cuda_graph_with_workspace():
    gen = torch.Generator(device="cuda").manual_seed(9)
    dtype, heads, lens = torch.float16, 16, [3000, 17]
    cache = random_cache(60, 64, dtype, gen)
    table = random_table(lens, 64, 60, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(2, 1, heads, 576, generator=gen, device="cuda").to(dtype)
    schedule = mla_kv.attention_schedule(2, 1, heads, table.shape[1] * 64)
    assert schedule.num_splits > 1, "small batch with a long context should split the KV"
    workspace = torch.empty(schedule.workspace_bytes, dtype=torch.uint8, device="cuda")
    out = torch.empty(2, 1, heads, 512, dtype=dtype, device="cuda")
    lse = torch.empty(2, 1, heads, device="cuda")
    run = lambda: mla_kv.decode(q, cache, table, seq_lens, 0.1, out=out, lse=lse, workspace=workspace,
                                schedule=schedule)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    q.copy_(torch.randn(q.shape, generator=gen, device="cuda").to(dtype))  # new data, same graph
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_lse = reference.decode(q.double(), cache.double(), table, seq_lens, 0.1)
    check(out, lse, ref_out, ref_lse, dtype, "graph replay")


def run_prefill_case(q_lens, kv_lens, heads, block_size, dtype, gen, *, causal=True, arch=None, shared=0):
    num_blocks = sum(max(1, -(-n // block_size)) for n in kv_lens) + 4
    cache = random_cache(num_blocks, block_size, dtype, gen)
    table = random_table(kv_lens, block_size, num_blocks, gen, shared)
    cu = torch.tensor([0] + q_lens, device="cuda").cumsum(0).int()
    kv = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), heads, 576, generator=gen, device="cuda").to(dtype)
    out = torch.full((sum(q_lens), heads, 512), float("nan"), dtype=dtype, device="cuda")
    out, lse = mla_kv.prefill(q, cache, table, cu, kv, 0.0625, causal=causal, out=out, arch=arch, validate=True)
    ref_out, ref_lse = reference.prefill(q.double(), cache.double(), table, cu, kv, 0.0625, causal=causal)
    return out, lse, ref_out, ref_lse, (q, cache, table, cu, kv)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [5, 16, 20, 64, 128])
def test_prefill_mixed_batch(dtype, heads):
    gen = torch.Generator(device="cuda").manual_seed(heads)
    # a full prompt, an extend over a cached prefix, a decode-like row, a length-1 prompt
    q_lens, kv_lens = [300, 65, 1, 1], [300, 65 + 128, 700, 1]
    for arch in archs_for(dtype):
        out, lse, ref_out, ref_lse, _ = run_prefill_case(q_lens, kv_lens, heads, 64, dtype, gen, arch=arch)
        check(out, lse, ref_out, ref_lse, dtype, f"prefill H={heads} arch={arch}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_non_causal_shared_prefix_and_block_sizes(dtype):
    gen = torch.Generator(device="cuda").manual_seed(3)
    for block_size in (16, 32, 128):
        for arch in archs_for(dtype):
            out, lse, ref_out, ref_lse, _ = run_prefill_case([40, 70], [3 * block_size + 40, 3 * block_size + 70],
                                                             16, block_size, dtype, gen, arch=arch, shared=3)
            check(out, lse, ref_out, ref_lse, dtype, f"shared prefix bs={block_size} arch={arch}")
        out, lse, ref_out, ref_lse, _ = run_prefill_case([33], [100], 20, block_size, dtype, gen, causal=False)
        check(out, lse, ref_out, ref_lse, dtype, f"non-causal bs={block_size}")


def test_prefill_chunked_equals_one_shot():
    gen = torch.Generator(device="cuda").manual_seed(4)
    dtype, heads, total = torch.float16, 20, 1000
    out, lse, ref_out, ref_lse, (q, cache, table, cu, kv) = run_prefill_case([total], [total], heads, 64, dtype, gen)
    check(out, lse, ref_out, ref_lse, dtype, "one shot")
    pieces, start = [], 0
    for end in (137, 512, 513, 1000):  # 4 chunks, each attending to the prefix already in the cache
        chunk_cu = torch.tensor([0, end - start], dtype=torch.int32, device="cuda")
        chunk_kv = torch.tensor([end], dtype=torch.int32, device="cuda")
        o, l = mla_kv.prefill(q[start:end], cache, table, chunk_cu, chunk_kv, 0.0625)
        pieces.append((o, l))
        start = end
    chunked_out = torch.cat([p[0] for p in pieces])
    chunked_lse = torch.cat([p[1] for p in pieces])
    assert (chunked_out.float() - out.float()).abs().max() <= 2e-3
    assert (chunked_lse - lse).abs().max() <= 1e-4


@pytest.mark.parametrize("splits", [1, 4, 12])
def test_prefill_leaves_padded_rows_untouched(splits):
    """q/out with more rows than cu_q_lens[B] (a CUDA-graph batch padded to a fixed T): rows past
    the last sequence keep their bytes, with and without split-KV (whose combine step must skip them;
    4 splits take the warp-per-row combine, 12 the many-split one)."""
    gen = torch.Generator(device="cuda").manual_seed(40 + splits)
    dtype, heads, q_lens, kv_lens, pad = torch.float16, 20, [70, 1], [200, 90], 13
    num_blocks = 12
    cache = random_cache(num_blocks, 64, dtype, gen)
    table = random_table(kv_lens, 64, num_blocks, gen)
    cu = torch.tensor([0] + q_lens, device="cuda").cumsum(0).int()
    kv = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    tokens = sum(q_lens) + pad
    q = torch.randn(tokens, heads, 576, generator=gen, device="cuda").to(dtype)
    out = torch.randn(tokens, heads, 512, generator=gen, device="cuda").to(dtype)
    lse = torch.randn(tokens, heads, generator=gen, device="cuda")
    out_pad, lse_pad = out[-pad:].clone(), lse[-pad:].clone()
    per_split = -(-table.shape[1] * 64 // splits)
    schedule = mla_kv.AttentionSchedule(splits, per_split,
                                        mla_kv.ops._C.attention_workspace_size(tokens, heads, splits))
    mla_kv.prefill(q, cache, table, cu, kv, 0.0625, out=out, lse=lse, schedule=schedule)
    ref_out, ref_lse = reference.prefill(q[:-pad].double(), cache.double(), table, cu, kv, 0.0625)
    check(out[:-pad], lse[:-pad], ref_out, ref_lse, dtype, f"padded prefill splits={splits}")
    assert torch.equal(out[-pad:], out_pad) and torch.equal(lse[-pad:], lse_pad), "padded rows were written"


@pytest.mark.parametrize("heads,q_len,kv_len", [(16, 4096, 4096), (128, 16, 32768)])
def test_prefill_long(heads, q_len, kv_len):
    gen = torch.Generator(device="cuda").manual_seed(heads)
    for arch in (None, "sm70"):
        out, lse, ref_out, ref_lse, _ = run_prefill_case([q_len], [kv_len], heads, 64, torch.float16, gen, arch=arch)
        check(out, lse, ref_out, ref_lse, torch.float16, f"long prefill arch={arch}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_block_pointers(dtype):
    gen = torch.Generator(device="cuda").manual_seed(12)
    q_lens, kv_lens, heads, bsl = [100, 1, 64], [100, 300, 192], 16, 64
    pool = BlockPool(30, 3, bsl, dtype, "cuda")
    pool.storage.copy_(torch.randn(pool.storage.shape, generator=gen, device="cuda") * 0.5)
    counts = [-(-n // bsl) for n in kv_lens]
    ids = torch.randperm(30, generator=torch.Generator().manual_seed(1))[: sum(counts)]
    cu_blocks = torch.tensor([0] + counts).cumsum(0).int()
    cache = pool.cache(2, ids, cu_blocks)
    cu = torch.tensor([0] + q_lens, device="cuda").cumsum(0).int()
    kv = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), heads, 576, generator=gen, device="cuda").to(dtype)
    for arch in archs_for(dtype):
        out, lse = mla_kv.prefill(q, cache, None, cu, kv, 0.08, arch=arch)
        ref_out, ref_lse = reference.prefill_blocks(q.double(), pool, 2, ids, cu_blocks, cu, kv, 0.08)
        check(out, lse, ref_out.double(), ref_lse.double(), dtype, f"prefill blocks arch={arch}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_merge_states_matches_reference_and_whole_attention(dtype):
    gen = torch.Generator(device="cuda").manual_seed(1)
    out_a = torch.randn(3, 7, 512, generator=gen, device="cuda").to(dtype)
    out_b = torch.randn(3, 7, 512, generator=gen, device="cuda").to(dtype)
    lse_a = torch.randn(3, 7, generator=gen, device="cuda") * 3
    lse_b = torch.randn(3, 7, generator=gen, device="cuda") * 3
    lse_a[0, 0] = float("-inf")
    lse_a[1, 1] = lse_b[1, 1] = float("-inf")
    out, lse = mla_kv.merge_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = reference.merge_states(out_a.double(), lse_a.double(), out_b.double(), lse_b.double())
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert ((out.double() - ref_out).norm() / ref_out.norm()) <= tol
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
    assert (out[1, 1] == 0).all() and lse[1, 1] == float("-inf")
    fin = torch.isfinite(ref_lse)
    assert (lse.double()[fin] - ref_lse[fin]).abs().max() <= 1e-5

    # Attention over a split KV merged by merge_states equals attention over the whole KV.
    lens = [700]
    cache = random_cache(12, 64, torch.float16, gen)
    table = random_table(lens, 64, 12, gen)
    q = torch.randn(1, 1, 8, 576, generator=gen, device="cuda").half()
    whole = mla_kv.decode(q, cache, table, torch.tensor(lens, dtype=torch.int32, device="cuda"), 0.1)
    cu = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    # keys 0..255 by decode, keys 256..699 by a non-causal prefill over the table shifted 4 blocks
    rest_table = table[:, 4:]
    rest = mla_kv.prefill(q[0], cache, rest_table, cu, torch.tensor([700 - 256], dtype=torch.int32, device="cuda"),
                          0.1, causal=False)
    head = mla_kv.decode(q, cache, table, torch.tensor([256], dtype=torch.int32, device="cuda"), 0.1)
    merged, merged_lse = mla_kv.merge_states(head[0][0, 0], head[1][0, 0], rest[0][0], rest[1][0])
    assert (merged.float() - whole[0][0, 0].float()).abs().max() <= 2e-3
    assert (merged_lse - whole[1][0, 0]).abs().max() <= 1e-4


def test_bad_attention_input_raises_before_launch():
    gen = torch.Generator(device="cuda").manual_seed(2)
    cache = random_cache(4, 64, torch.float16, gen)
    table = torch.arange(4, dtype=torch.int32, device="cuda").view(1, 4)
    lens = torch.tensor([100], dtype=torch.int32, device="cuda")
    q = torch.randn(1, 1, 16, 576, generator=gen, device="cuda").half()
    with pytest.raises(ValueError, match="softmax_scale"):
        mla_kv.decode(q, cache, table, lens, 0.0)
    with pytest.raises(TypeError, match="q"):
        mla_kv.decode(q.float(), cache, table, lens, 0.1)
    with pytest.raises(TypeError, match="kv_cache"):
        mla_kv.decode(q, cache.bfloat16(), table, lens, 0.1)
    with pytest.raises(ValueError, match="block_table"):
        mla_kv.decode(q, cache, table[:, :1], lens, 0.1, validate=True)
    with pytest.raises(ValueError, match="seq_lens"):
        mla_kv.decode(torch.randn(1, 4, 16, 576, device="cuda").half(), cache, table,
                      torch.tensor([3], dtype=torch.int32, device="cuda"), 0.1, validate=True)
    with pytest.raises(ValueError, match="out"):
        mla_kv.decode(q, cache, table, lens, 0.1, out=torch.empty(1, 1, 15, 512, device="cuda").half())
    with pytest.raises(TypeError, match="bfloat16"):
        mla_kv.decode(q.bfloat16(), cache.bfloat16(), table, lens, 0.1, arch="sm70")
    # hand-made schedules: too few kv positions (would drop keys) or no room for the split partials
    out = torch.full((1, 1, 16, 512), float("nan"), device="cuda").half()
    for bad in (mla_kv.AttentionSchedule(1, 128, 0), mla_kv.AttentionSchedule(4, 64, 0),
                mla_kv.AttentionSchedule(0, 256, 0)):
        with pytest.raises(ValueError, match="schedule"):
            mla_kv.decode(q, cache, table, lens, 0.1, out=out, schedule=bad)
    assert torch.isnan(out).all(), "a rejected call wrote out"
