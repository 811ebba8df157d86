"""decode / prefill / merge_states kernels against the float64 reference (mla_kv.reference).

The tests taking `arch` run once per kernel variant (ATTENTION_ARCHS; the test id names it), each
on the paged cache and on a block-pointer copy of it. Unwritten cache rows are NaN (random_cache),
every launch gets fresh NaN outputs and a 0xFF workspace (run_decode / run_prefill), and
check_attention compares every (sequence, query, head) row with the reference: tolerances in
tests/gpu_checks.py.
"""
import math

import pytest
import torch

import mla_kv
from mla_kv import reference

from gpu_checks import (ATTENTION_ARCHS, block_pointer_copy, capture_graph, check_attention, nan_outputs,
                        poisoned_workspace, random_cache, run_decode, run_prefill, split_schedule)

pytestmark = [pytest.mark.gpu, ATTENTION_ARCHS]


def addressings(cache, table, lens):
    """The pool a block-pointer copy of the paged cache points into (the caller keeps it referenced
    while it launches) and (kv_cache, block_table, name) of both addressings."""
    pool, blocks = block_pointer_copy(cache, table, lens)
    return pool, ((cache, table, "paged"), (blocks, None, "block pointers"))


def decode_case(lens, heads, s_q, block_size, dtype, *, shared=0, scale=1.0 / math.sqrt(192 + 64)):
    """Inputs (q strided on B, S_q and H) and the float64 reference of a decode batch."""
    cache, table, seq_lens = random_cache(lens, block_size, dtype, shared_prefix_blocks=shared)
    q_full = torch.randn(len(lens), s_q, heads + 3, 576 + 64, device="cuda").to(dtype)
    q = q_full[:, :, 1:heads + 1, 32:32 + 576]
    ref = reference.decode(q.double(), cache.double(), table, seq_lens, scale)
    return (q, cache, table, seq_lens, scale), ref


def check_decode_case(case, ref, arch, what, *, schedules=(None,)):
    """Variant arch, every addressing x schedule (None: the default one) of a decode_case."""
    q, cache, table, seq_lens, scale = case
    pool, caches = addressings(cache, table, seq_lens.tolist())
    for kv_cache, block_table, addressing in caches:
        for schedule in schedules:
            out, lse = run_decode(q, kv_cache, block_table, seq_lens, scale, arch=arch, schedule=schedule)
            split = "" if schedule is None else f" splits={schedule.num_splits}x{schedule.tokens_per_split}"
            check_attention(out, lse, *ref, f"{what} {addressing}{split}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [1, 5, 16, 20, 64, 128])
@pytest.mark.parametrize("s_q", [1, 2, 4])
def test_decode_heads_and_query_lengths(dtype, heads, s_q, arch):
    lens = [s_q, 1 + s_q, 63 + s_q, 64, 65, 200, 1000]
    case, ref = decode_case(lens, heads, s_q, 64, dtype)
    check_decode_case(case, ref, arch, f"H={heads} S_q={s_q}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,s_q", [(33, 1), (33, 3), (100, 1), (100, 3)])
def test_decode_odd_head_counts_across_cta_rows(dtype, heads, s_q, arch):
    """Head counts that do not divide the 64-row CTA (the Sm90 kernel's, and the Sm80 kernel's above
    32 rows): a CTA's rows end inside a query token, the last CTA of a sequence is part padding."""
    case, ref = decode_case([s_q, 64 + s_q, 700], heads, s_q, 64, dtype)
    check_decode_case(case, ref, arch, f"H={heads} S_q={s_q}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32, 48, 64, 128])  # 48: the division path of odd sizes
def test_decode_block_sizes_shared_blocks_and_empty_sequences(dtype, block_size, arch):
    """Whole-box tile loads (Hopper's TMA, blocks of 16, 32 or multiples of 64) read the NaN rows past
    a sequence's end in its last block: they must not reach the output (0 x NaN is NaN, so masking
    scores is not enough)."""
    lens = [0, 1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]
    case, ref = decode_case(lens, 20, 1, block_size, dtype)
    check_decode_case(case, ref, arch, f"bs={block_size}")
    lens_shared = [2 * block_size + 3, 2 * block_size + 40, 5 * block_size]
    case, ref = decode_case(lens_shared, 128, 2, block_size, dtype, shared=2)
    check_decode_case(case, ref, arch, f"shared bs={block_size}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,lens,s_q", [(16, [32768], 1), (128, [8191, 20000], 1), (20, [262144], 1),
                                            (4, [70001], 4)])
def test_decode_long_contexts_split_kv(dtype, heads, lens, s_q, arch):
    """Contexts of 64K and more also run split 1024 ways (the most a launch may have)."""
    case, ref = decode_case(lens, heads, s_q, 64, dtype)
    positions = case[2].shape[1] * 64
    schedules = (None,) if max(lens) < 65536 else (None, split_schedule(1024, -(-positions // 1024),
                                                                         len(lens) * s_q, heads))
    check_decode_case(case, ref, arch, f"long H={heads}", schedules=schedules)


def test_decode_forced_splits_match_reference(arch):
    lens = [0, 5, 100, 333, 1024]  # random_table gives 17 blocks of 64 = 1088 positions per sequence
    case, ref = decode_case(lens, 20, 3, 64, torch.float16)
    # Splits that end inside 32-token tiles too; (2, 576): whole 64-token tiles (TMA loads on
    # Hopper) in a two-way split whose second split is empty for every sequence but the last.
    schedules = [split_schedule(splits, tokens, len(lens) * 3, 20)
                 for splits, tokens in [(2, 544), (2, 576), (8, 136), (33, 33)]]
    check_decode_case(case, ref, arch, "forced splits", schedules=schedules)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rope_first", [True, False])
def test_decode_block_pointers_with_validation(dtype, rope_first, arch):
    """Both row orders; validate=True (the host sizes the schedule check from the block lists)."""
    lens, heads, s_q = [2, 64, 130, 700], 20, 2
    cache, table, seq_lens = random_cache(lens, 64, dtype)
    pool, blocks = block_pointer_copy(cache, table, lens, rope_first=rope_first)
    q = torch.randn(len(lens), s_q, heads, 576, device="cuda").to(dtype)
    ref = reference.decode(q.double(), cache.double(), table, seq_lens, 0.07)
    out, lse = run_decode(q, blocks, None, seq_lens, 0.07, arch=arch, validate=True)
    check_attention(out, lse, *ref, f"blocks rope_first={rope_first}")


def test_decode_in_cuda_graph_with_workspace():
    dtype, heads, lens = torch.float16, 16, [3000, 17]
    cache, table, seq_lens = random_cache(lens, 64, dtype)
    q = torch.randn(2, 1, heads, 576, device="cuda").to(dtype)
    schedule = mla_kv.attention_schedule(2, 1, heads, table.shape[1] * 64)
    assert schedule.num_splits > 1, "small batch with a long context should split the KV"
    workspace = poisoned_workspace(schedule, "cuda")
    out, lse = nan_outputs(q, (2, 1, heads))
    run = lambda: mla_kv.decode(q, cache, table, seq_lens, 0.1, out=out, lse=lse, workspace=workspace,
                                schedule=schedule)
    graph = capture_graph(run)
    q.copy_(torch.randn(q.shape, device="cuda").to(dtype))  # new data, same graph
    for buffer, value in ((out, float("nan")), (lse, float("nan")), (workspace, 0xFF)):
        buffer.fill_(value)  # the replay must write every result anew
    graph.replay()
    torch.cuda.synchronize()
    ref = reference.decode(q.double(), cache.double(), table, seq_lens, 0.1)
    check_attention(out, lse, *ref, "graph replay")


def prefill_case(q_lens, kv_lens, heads, block_size, dtype, *, causal=True, shared=0, scale=0.0625):
    """Inputs and the float64 reference of a packed prefill batch."""
    cache, table, kv = random_cache(kv_lens, block_size, dtype, shared_prefix_blocks=shared)
    cu = torch.tensor([0] + q_lens, device="cuda").cumsum(0).int()
    q = torch.randn(sum(q_lens), heads, 576, device="cuda").to(dtype)
    ref = reference.prefill(q.double(), cache.double(), table, cu, kv, scale, causal=causal)
    return (q, cache, table, cu, kv, scale, causal), ref


def check_prefill_case(case, ref, arch, what, *, schedules=(None,), validate=False):
    """Variant arch, every addressing x schedule (None: the default one) of a prefill_case."""
    q, cache, table, cu, kv, scale, causal = case
    pool, caches = addressings(cache, table, kv.tolist())
    for kv_cache, block_table, addressing in caches:
        for schedule in schedules:
            out, lse = run_prefill(q, kv_cache, block_table, cu, kv, scale, causal=causal, arch=arch,
                                   schedule=schedule, validate=validate)
            split = "" if schedule is None else f" splits={schedule.num_splits}x{schedule.tokens_per_split}"
            check_attention(out, lse, *ref, f"{what} {addressing}{split}", cu_q_lens=cu)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [5, 16, 20, 64, 128])
def test_prefill_mixed_batch(dtype, heads, arch):
    # a full prompt, an extend over a cached prefix, a decode-like row, a length-1 prompt
    case, ref = prefill_case([300, 65, 1, 1], [300, 65 + 128, 700, 1], heads, 64, dtype)
    check_prefill_case(case, ref, arch, f"prefill H={heads}", validate=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_empty_sequences_and_whole_prompts(dtype, causal, arch):
    """Sequences without queries (kv_len 0 and kv_len 100), prompts with q_len == kv_len (5, 64, 1),
    an extend; the default schedule and a forced 3-way split."""
    q_lens, kv_lens = [0, 0, 5, 64, 130, 1, 0], [0, 100, 5, 64, 300, 1, 64]
    case, ref = prefill_case(q_lens, kv_lens, 16, 64, dtype, causal=causal)
    positions = case[2].shape[1] * 64
    schedules = (None, split_schedule(3, -(-positions // 3), sum(q_lens), 16))
    check_prefill_case(case, ref, arch, f"empty sequences causal={causal}", schedules=schedules)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_non_causal_shared_prefix_and_block_sizes(dtype, arch):
    for block_size in (16, 32, 128):
        case, ref = prefill_case([40, 70], [3 * block_size + 40, 3 * block_size + 70], 16, block_size, dtype,
                                 shared=3)
        check_prefill_case(case, ref, arch, f"shared prefix bs={block_size}")
        case, ref = prefill_case([33], [100], 20, block_size, dtype, causal=False)
        check_prefill_case(case, ref, arch, f"non-causal bs={block_size}")


def test_prefill_in_chunks_over_the_cached_prefix():
    """A 1000-token prompt at once and in 4 chunks, each attending to the prefix already in the cache."""
    dtype, heads, total = torch.float16, 20, 1000
    (q, cache, table, cu, kv, scale, _), (ref_out, ref_lse) = prefill_case([total], [total], heads, 64, dtype)
    out, lse = run_prefill(q, cache, table, cu, kv, scale)
    check_attention(out, lse, ref_out, ref_lse, "one shot", cu_q_lens=cu)
    start = 0
    for end in (137, 512, 513, 1000):
        chunk_cu = torch.tensor([0, end - start], dtype=torch.int32, device="cuda")
        chunk_kv = torch.tensor([end], dtype=torch.int32, device="cuda")
        out, lse = run_prefill(q[start:end], cache, table, chunk_cu, chunk_kv, scale)
        check_attention(out, lse, ref_out[start:end], ref_lse[start:end], f"chunk {start}..{end}",
                        cu_q_lens=chunk_cu)
        start = end


@pytest.mark.parametrize("splits", [1, 4, 12])
def test_prefill_leaves_padded_rows_untouched(splits, arch):
    """q/out with more rows than cu_q_lens[B] (a CUDA-graph batch padded to a fixed T): rows past
    the last sequence keep their bytes, with and without split-KV (whose combine step must skip them;
    4 splits take the warp-per-row combine, 12 the many-split one)."""
    dtype, heads, q_lens, kv_lens, pad = torch.float16, 20, [70, 1], [200, 90], 13
    cache, table, kv = random_cache(kv_lens, 64, dtype)
    cu = torch.tensor([0] + q_lens, device="cuda").cumsum(0).int()
    tokens = sum(q_lens) + pad
    q = torch.randn(tokens, heads, 576, device="cuda").to(dtype)
    ref = reference.prefill(q[:-pad].double(), cache.double(), table, cu, kv, 0.0625)
    schedule = split_schedule(splits, -(-table.shape[1] * 64 // splits), tokens, heads)
    out, lse = nan_outputs(q, (tokens, heads))
    out[-pad:] = torch.randn(pad, heads, 512, device="cuda").to(dtype)
    lse[-pad:] = torch.randn(pad, heads, device="cuda")
    out_pad, lse_pad = out[-pad:].clone(), lse[-pad:].clone()
    run_prefill(q, cache, table, cu, kv, 0.0625, arch=arch, schedule=schedule, out=out, lse=lse)
    check_attention(out[:-pad], lse[:-pad], *ref, f"padded prefill splits={splits}", cu_q_lens=cu)
    assert torch.equal(out[-pad:], out_pad) and torch.equal(lse[-pad:], lse_pad), "padded rows were written"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,q_len,kv_len", [(16, 4096, 4096), (128, 16, 32768), (2, 16, 70001)])
def test_prefill_long(dtype, heads, q_len, kv_len, arch):
    """Long prompts and extends; the 70K context also split 1024 ways."""
    case, ref = prefill_case([q_len], [kv_len], heads, 64, dtype)
    positions = case[2].shape[1] * 64
    schedules = (None,) if kv_len < 65536 else (None, split_schedule(1024, -(-positions // 1024), q_len, heads))
    check_prefill_case(case, ref, arch, f"long prefill H={heads}", schedules=schedules)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_merge_states_matches_reference_and_whole_attention(dtype):
    out_a = torch.randn(3, 7, 512, device="cuda").to(dtype)
    out_b = torch.randn(3, 7, 512, device="cuda").to(dtype)
    lse_a = torch.randn(3, 7, device="cuda") * 3
    lse_b = torch.randn(3, 7, device="cuda") * 3
    lse_a[0, 0] = float("-inf")
    lse_a[1, 1] = lse_b[1, 1] = float("-inf")
    out_a[0, 0] = out_a[1, 1] = out_b[1, 1] = float("nan")  # a side with lse -inf is not read
    out, lse = nan_outputs(out_a, (3, 7))
    mla_kv.merge_states(out_a, lse_a, out_b, lse_b, out=out, lse=lse)
    ref = reference.merge_states(out_a.double(), lse_a.double(), out_b.double(), lse_b.double())
    check_attention(out, lse, *ref, f"merge_states {dtype}", lse_tol=1e-5)

    # Attention over a split KV merged by merge_states equals attention over the whole KV.
    cache, table, seq_lens = random_cache([700], 64, torch.float16)
    q = torch.randn(1, 1, 8, 576, device="cuda").half()
    whole_out, whole_lse = reference.decode(q.double(), cache.double(), table, seq_lens, 0.1)
    cu = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    # keys 0..255 by decode, keys 256..699 by a non-causal prefill over the table shifted 4 blocks
    head = run_decode(q, cache, table, torch.tensor([256], dtype=torch.int32, device="cuda"), 0.1)
    rest = run_prefill(q[0], cache, table[:, 4:], cu, torch.tensor([700 - 256], dtype=torch.int32, device="cuda"),
                       0.1, causal=False)
    merged, merged_lse = nan_outputs(q, (8,))
    mla_kv.merge_states(head[0][0, 0], head[1][0, 0], rest[0][0], rest[1][0], out=merged, lse=merged_lse)
    check_attention(merged, merged_lse, whole_out[0, 0], whole_lse[0, 0], "decode + prefill merged")


def test_bad_attention_input_raises_before_launch():
    cache, _, _ = random_cache([256], 64, torch.float16, spare_blocks=0)
    table = torch.arange(4, dtype=torch.int32, device="cuda").view(1, 4)
    lens = torch.tensor([100], dtype=torch.int32, device="cuda")
    q = torch.randn(1, 1, 16, 576, device="cuda").half()
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
