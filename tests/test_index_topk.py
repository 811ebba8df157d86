"""index_topk (the indexer's top-k selection) against mla_kv.reference.index_topk and an independent
brute-force selection.

The selected SET of a row is unique (equal logits prefer the smaller position), so rows are compared
as sets: sorted. CPU tests check the reference against a Python sort of (logit, position) pairs on
random logits, heavy ties, -inf / NaN rows, short rows, decode and packed (causal) prefill and slots
through a shuffled block table, and every argument check. GPU tests run each arch tag (one kernel:
all must dispatch) over the issue's sizes, poison the memory around ``out`` and the positions past
each token's own (+inf: selecting one shows), and replay a captured CUDA graph with new logits.
"""
import pytest
import torch

import mla_kv
from mla_kv import reference

from gpu_checks import capture_graph

GPU = pytest.mark.gpu
pytestmark = pytest.mark.arch_variants("best", "sm80", "sm75", "sm70", bf16_needs_sm80=False)
NAN, INF = float("nan"), float("inf")


# ------------------------------------------------------------------------------- helpers
def token_positions(kv_lens, cu_q_lens, rows):
    """(sequence, position) of every logits row, by a loop over the tokens (-1, -1 outside every sequence)."""
    seq, pos = [-1] * rows, [-1] * rows
    lens = [int(x) for x in kv_lens]
    cu = list(range(len(lens) + 1)) if cu_q_lens is None else [int(x) for x in cu_q_lens]
    for b, n in enumerate(lens):
        q_len = cu[b + 1] - cu[b]
        for i in range(q_len):
            seq[cu[b] + i], pos[cu[b] + i] = b, n - q_len + i
    return seq, pos


def brute_force(logits, kv_lens, k, cu_q_lens=None, block_table=None, page_size=None):
    """Each row's selection as a sorted list, by sorting (-logit, position) pairs in Python."""
    seq, pos = token_positions(kv_lens, cu_q_lens, logits.shape[0])
    rows = []
    for t, values in enumerate(logits.tolist()):
        visible = pos[t] + 1 if seq[t] >= 0 else 0
        pairs = sorted((-(-INF if v != v else v), s) for s, v in enumerate(values[:max(visible, 0)]))
        chosen = [s for _, s in pairs[:k]]
        if block_table is not None:
            table = block_table[seq[t]].tolist() if seq[t] >= 0 else []
            chosen = [table[s // page_size] * page_size + s % page_size
                      if s // page_size < len(table) and table[s // page_size] >= 0 else -1 for s in chosen]
        rows.append(sorted(chosen + [-1] * (k - len(chosen))))
    return rows


def as_sets(indices):
    return torch.sort(indices.cpu().long(), dim=1).values.tolist()


def draw_logits(rows, columns, kind, gen):
    """float32 logits: "random", "ties" (five values), "special" (ties, -inf, NaN, -0 and +0 mixed in)."""
    x = torch.randn(rows, columns, generator=gen)
    if kind == "random":
        return x
    x = torch.randint(-2, 3, (rows, columns), generator=gen).float()
    if kind == "special":
        pick = torch.randint(0, 6, (rows, columns), generator=gen)
        x = torch.where(pick == 0, torch.full_like(x, -INF), x)
        x = torch.where(pick == 1, torch.full_like(x, NAN), x)
        x = torch.where(pick == 2, torch.full_like(x, -0.0), x)
        x = torch.where(pick == 3, torch.zeros_like(x), x)
    return x


def decode_batch(rows, columns, k, gen):
    """kv_lens for one token per sequence: full rows, rows shorter than k, empty and single ones."""
    lens = torch.randint(1, columns + 1, (rows,), generator=gen)
    special = [columns, min(columns, k), max(0, min(columns, k) - 1), 0, 1]
    lens[:min(rows, len(special))] = torch.tensor(special[:rows])
    return lens.int()


def prefill_batch(q_lens, columns, gen):
    """cu_q_lens and kv_lens of packed sequences (each kv length >= its q length, <= columns)."""
    kv = [int(torch.randint(q, columns + 1, (1,), generator=gen)) for q in q_lens]
    return torch.tensor([0] + q_lens).cumsum(0).int(), torch.tensor(kv).int()


def shuffled_table(batch, columns, page_size, gen):
    width = -(-columns // page_size) + 1
    return torch.randperm(batch * width + 3, generator=gen)[:batch * width].view(batch, width).int()


def hide_past_positions(logits, kv_lens, cu_q_lens, value=INF):
    """Fills every column past each token's own position (it may hold anything) with ``value``."""
    seq, pos = token_positions(kv_lens, cu_q_lens, logits.shape[0])
    hidden = logits.clone()
    for t in range(logits.shape[0]):
        hidden[t, max(pos[t] + 1, 0) if seq[t] >= 0 else 0:] = value
    return hidden


# ---------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("kind", ["random", "ties", "special"])
@pytest.mark.parametrize("k", [1, 5, 16, 40])
@pytest.mark.parametrize("layout", ["decode", "prefill", "slots"])
def test_reference_matches_brute_force(kind, k, layout):
    gen = torch.Generator().manual_seed(k * 7 + len(kind) + len(layout))
    columns = 37
    if layout == "decode":
        cu, lens = None, decode_batch(6, columns, k, gen)
        rows = 6
    else:
        cu, lens = prefill_batch([3, 1, 5, 2], columns, gen)
        rows = int(cu[-1]) + 2  # two rows past the last sequence: all -1
    logits = hide_past_positions(draw_logits(rows, columns, kind, gen), lens, cu)
    table, page = (shuffled_table(lens.shape[0], columns, 8, gen), 8) if layout == "slots" else (None, None)
    got = reference.index_topk(logits, lens, k, cu_q_lens=cu, block_table=table, page_size=page)
    assert got.dtype == torch.int32 and got.shape == (rows, k)
    assert as_sets(got) == brute_force(logits, lens, k, cu, table, page)
    # the op's CPU path is the reference, into a given out too
    out = torch.full((rows, k), 7, dtype=torch.int32)
    assert mla_kv.index_topk(logits, lens, k, cu_q_lens=cu, block_table=table, page_size=page, out=out,
                             validate=True) is out
    assert torch.equal(out, got)


def test_ties_prefer_the_smaller_position_and_nan_counts_as_minus_infinity():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 3.0],
                           [NAN, -INF, 0.0, NAN, -INF, -1.0],
                           [-0.0, 0.0, -0.0, 0.0, NAN, 0.0]])
    lens = torch.tensor([6, 6, 6], dtype=torch.int32)
    assert as_sets(reference.index_topk(logits, lens, 3)) == [[1, 2, 4], [0, 2, 5], [0, 1, 2]]
    # NaN and -inf tie: positions decide among them
    assert as_sets(reference.index_topk(logits[1:2], lens[:1], 5)) == [[0, 1, 2, 3, 5]]


def test_rows_see_only_their_own_past():
    """Causal: token i of a 4-token chunk over 10 positions sees 7 + i of them; +inf past it never counts."""
    logits = hide_past_positions(torch.arange(10.0).flip(0).repeat(4, 1), torch.tensor([10]), torch.tensor([0, 4]))
    got = reference.index_topk(logits, torch.tensor([10], dtype=torch.int32), 8,
                               cu_q_lens=torch.tensor([0, 4], dtype=torch.int32))
    assert as_sets(got) == [[-1, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7],
                            [0, 1, 2, 3, 4, 5, 6, 7]]


def test_slots_the_table_does_not_cover_are_minus_one():
    logits = torch.arange(12.0)[None]
    table = torch.tensor([[3, -1]], dtype=torch.int32)  # a negative id, and no third block
    got = reference.index_topk(logits, torch.tensor([12], dtype=torch.int32), 12, block_table=table, page_size=4)
    assert as_sets(got) == [[-1] * 8 + [12, 13, 14, 15]]


def good_args():
    logits = torch.randn(4, 20)
    return dict(logits=logits, kv_lens=torch.tensor([20, 5], dtype=torch.int32), k=4,
                cu_q_lens=torch.tensor([0, 3, 4], dtype=torch.int32),
                block_table=torch.zeros(2, 2, dtype=torch.int32), page_size=16)


@pytest.mark.parametrize("change,error,name", [
    (dict(logits=[[1.0]]), TypeError, "logits"),
    (dict(logits=torch.randn(4, 20, dtype=torch.float64)), TypeError, "logits"),
    (dict(logits=torch.randn(4, 20, 2)), ValueError, "logits"),
    (dict(logits=torch.randn(20, 4).t()), ValueError, "logits"),
    (dict(k=0), ValueError, "k"),
    (dict(k=2.0), TypeError, "k"),
    (dict(k=True), TypeError, "k"),
    (dict(k=2**31), ValueError, "k"),
    (dict(kv_lens=torch.tensor([20, 5])), TypeError, "kv_lens"),
    (dict(kv_lens=torch.tensor([20], dtype=torch.int32)), ValueError, "kv_lens"),
    (dict(cu_q_lens=torch.tensor([0, 3, 4])), TypeError, "cu_q_lens"),
    (dict(cu_q_lens=torch.tensor([0], dtype=torch.int32)), ValueError, "cu_q_lens"),
    (dict(block_table=torch.zeros(3, 2, dtype=torch.int32)), ValueError, "block_table"),
    (dict(block_table=torch.zeros(2, 2)), TypeError, "block_table"),
    (dict(page_size=None), ValueError, "page_size"),
    (dict(page_size=0), ValueError, "page_size"),
    (dict(block_table=None), ValueError, "page_size"),
    (dict(out=torch.zeros(4, 5, dtype=torch.int32)), ValueError, "out"),
    (dict(out=torch.zeros(4, 4, dtype=torch.int64)), TypeError, "out"),
    (dict(out=torch.zeros(4, 8, dtype=torch.int32)[:, ::2]), ValueError, "out"),
    (dict(workspace=torch.zeros(8, dtype=torch.int32)), TypeError, "workspace"),
    (dict(arch="sm71"), ValueError, "arch"),
    (dict(arch=70), TypeError, "arch"),
])
def test_bad_arguments_raise_naming_them(change, error, name):
    args = {**good_args(), **change}
    with pytest.raises(error, match=f"^{name}"):
        mla_kv.index_topk(**args)


def test_decode_rows_must_match_the_lengths():
    with pytest.raises(ValueError, match="^kv_lens"):
        mla_kv.index_topk(torch.randn(3, 10), torch.tensor([4, 4], dtype=torch.int32), 2)


@pytest.mark.parametrize("change,name", [
    (dict(kv_lens=torch.tensor([21, 5], dtype=torch.int32)), "kv_lens"),
    (dict(kv_lens=torch.tensor([-1, 5], dtype=torch.int32)), "kv_lens"),
    (dict(cu_q_lens=torch.tensor([0, 3, 5], dtype=torch.int32)), "cu_q_lens"),
    (dict(cu_q_lens=torch.tensor([1, 3, 4], dtype=torch.int32)), "cu_q_lens"),
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int32)), "block_table"),
    (dict(block_table=torch.tensor([[0, -1], [0, 0]], dtype=torch.int32)), "block_table"),
    (dict(block_table=torch.tensor([[2**27, 0], [0, 0]], dtype=torch.int32)), "block_table"),
])
def test_validate_checks_device_data(change, name):
    args = {**good_args(), **change}
    with pytest.raises(ValueError, match=f"^{name}"):
        mla_kv.index_topk(**args, validate=True)


def test_a_padded_decode_row_sees_nothing():
    got = mla_kv.index_topk(torch.randn(2, 6), torch.tensor([0, 6], dtype=torch.int32), 3, validate=True)
    assert as_sets(got)[0] == [-1, -1, -1]


def test_workspace_size_arguments():
    with pytest.raises(ValueError, match="^num_tokens"):
        mla_kv.index_topk_workspace_size(-1, 10, 2)
    with pytest.raises(ValueError, match="^k"):
        mla_kv.index_topk_workspace_size(1, 10, 0)


# ---------------------------------------------------------------------------------- GPU
def poisoned_out(rows, k, gen):
    """(buffer, out): out [rows, k] is a window of a buffer of random ints 2 rows and 8 columns wider
    on each side."""
    buffer = torch.randint(-2**31, 2**31 - 1, (rows + 4, k + 16), generator=gen, dtype=torch.int32).cuda()
    return buffer, buffer[2:rows + 2, 8:8 + k]


def check_selection(logits, lens, k, cu, table, page, arch, gen, workspace=None):
    """Runs the kernel into a poisoned out window and checks the set, the values and the bytes around it."""
    rows = logits.shape[0]
    buffer, out = poisoned_out(rows, k, gen)
    before = buffer.clone()
    got = mla_kv.index_topk(logits, lens, k, cu_q_lens=cu, block_table=table, page_size=page, out=out,
                            workspace=workspace, arch=arch)
    assert got is out
    want = reference.index_topk(logits, lens, k, cu_q_lens=cu, block_table=table, page_size=page)
    assert as_sets(got) == as_sets(want), "selected sets differ"
    outside = torch.ones_like(buffer, dtype=torch.bool)
    outside[2:rows + 2, 8:8 + k] = False
    assert torch.equal(buffer[outside], before[outside]), "bytes outside out written"
    if table is None:  # the selected logits are torch.topk's, as multisets
        seq, pos = token_positions(lens, cu, rows)
        for t in range(rows):
            visible = pos[t] + 1 if seq[t] >= 0 else 0
            if visible < k:
                continue
            row = logits[t, :visible].nan_to_num(nan=-INF, posinf=INF)
            chosen = logits[t, got[t].long()].nan_to_num(nan=-INF, posinf=INF)
            assert torch.equal(chosen.sort().values, torch.topk(row, k).values.sort().values), f"row {t} values"
    return got


@GPU
@pytest.mark.parametrize("k", [1, 64, 2048])
@pytest.mark.parametrize("columns", [1, 100, 2048, 2049, 5000, 131072])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_index_topk_matches_reference(k, columns, rows, arch):
    gen = torch.Generator().manual_seed(k + columns + rows)
    lens = decode_batch(rows, columns, k, gen).cuda()
    logits = hide_past_positions(draw_logits(rows, columns, "random", gen), lens.cpu(), None).cuda()
    check_selection(logits, lens, k, None, None, None, arch, gen)


@GPU
@pytest.mark.parametrize("kind", ["ties", "special"])
@pytest.mark.parametrize("k,columns", [(1, 5000), (64, 2049), (2048, 5000), (2048, 131072)])
def test_heavy_ties_nan_and_inf(kind, k, columns, arch):
    gen = torch.Generator().manual_seed(k + columns + len(kind))
    lens = decode_batch(3, columns, k, gen).cuda()
    logits = hide_past_positions(draw_logits(3, columns, kind, gen), lens.cpu(), None).cuda()
    check_selection(logits, lens, k, None, None, None, arch, gen)
    # one value everywhere: the k smallest positions
    same = torch.full((1, columns), 0.5, device="cuda")
    got = mla_kv.index_topk(same, torch.tensor([columns], dtype=torch.int32, device="cuda"), k, arch=arch)
    assert as_sets(got) == [[-1] * max(0, k - columns) + list(range(min(k, columns)))]


@GPU
@pytest.mark.parametrize("k", [64, 2048])
@pytest.mark.parametrize("with_table", [False, True])
def test_packed_prefill_and_slots(k, with_table, arch):
    gen = torch.Generator().manual_seed(k + with_table)
    columns, page = 9000, 64
    cu, lens = prefill_batch([5, 1, 40, 3, 17], columns, gen)
    logits = hide_past_positions(draw_logits(int(cu[-1]) + 3, columns, "ties", gen), lens, cu)
    table = shuffled_table(lens.shape[0], columns, page, gen).cuda() if with_table else None
    check_selection(logits.cuda(), lens.cuda(), k, cu.cuda(), table, page if with_table else None, arch, gen)


@GPU
@pytest.mark.parametrize("rows,columns", [
    (1, 1_200_000),  # split rows whose chunks do not fit shared memory
    (130, 10_000),   # one CTA per row, re-read from L2
    (127, 131072),   # the most rows still split
])
def test_launch_paths_and_the_workspace_left_zeroed(rows, columns, arch):
    gen = torch.Generator().manual_seed(rows + columns)
    k = 2048
    lens = decode_batch(rows, columns, k, gen).cuda()
    logits = hide_past_positions(draw_logits(rows, columns, "random", gen), lens.cpu(), None).cuda()
    size = mla_kv.index_topk_workspace_size(rows, columns, k)
    assert (size > 0) == (rows < 128) and mla_kv.index_topk_workspace_size(rows, k, k) == 0
    workspace = torch.zeros(size + 64, dtype=torch.uint8, device="cuda")
    for _ in range(2):  # the second call finds the counters the first one left
        check_selection(logits, lens, k, None, None, None, arch, gen, workspace=workspace)
        assert not bool(workspace.any()), "workspace not left zeroed"


@GPU
def test_cuda_graph_replays_with_new_logits(arch):
    gen = torch.Generator().manual_seed(5)
    rows, columns, k = 4, 131072, 2048
    lens = torch.tensor([columns, 70_000, 2047, 9000], dtype=torch.int32, device="cuda")
    logits = torch.empty(rows, columns, device="cuda")
    workspace = torch.zeros(mla_kv.index_topk_workspace_size(rows, columns, k), dtype=torch.uint8, device="cuda")
    out = torch.full((rows, k), -7, dtype=torch.int32, device="cuda")
    logits.copy_(draw_logits(rows, columns, "random", gen))
    graph = capture_graph(lambda: mla_kv.index_topk(logits, lens, k, out=out, workspace=workspace, arch=arch))
    for kind in ("random", "ties", "special", "random"):
        logits.copy_(hide_past_positions(draw_logits(rows, columns, kind, gen), lens.cpu(), None))
        graph.replay()
        torch.cuda.synchronize()
        assert as_sets(out) == as_sets(reference.index_topk(logits, lens, k)), kind
    assert not bool(workspace.any())


@GPU
def test_cuda_tensors_on_other_devices_and_errors():
    logits = torch.randn(2, 10, device="cuda")
    with pytest.raises(ValueError, match="^kv_lens"):
        mla_kv.index_topk(logits, torch.tensor([10, 10], dtype=torch.int32), 3)
    with pytest.raises(ValueError, match="^workspace"):
        mla_kv.index_topk(torch.randn(1, 100_000, device="cuda"), torch.tensor([5], dtype=torch.int32, device="cuda"),
                          2048, workspace=torch.zeros(4, dtype=torch.uint8, device="cuda"))
    with pytest.raises(ValueError, match="^workspace"):
        mla_kv.index_topk(torch.randn(1, 100_000, device="cuda"), torch.tensor([5], dtype=torch.int32, device="cuda"),
                          2048, workspace=torch.ones(10**7, dtype=torch.uint8, device="cuda"), validate=True)
