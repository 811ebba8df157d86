"""mla_kv.expanded_attention, the expanded form's own flash-attention kernels (Volta mma.m8n8k4 "sm70",
Turing m16n8k8 "sm75", fp16), against the float64 spec reference.expanded_attention over the same fp16 inputs.

GPU tests (marker gpu) run both tags through the `arch` fixture (tests/conftest.py; an H200 runs both, sm70
slowly) at every supported (d_qk, d_v): causal (aligned bottom-right) and not, varlen batches whose lengths sit
on and around the 32-key tiles and 32/64-row CTAs, extends (q_len < k_len), q_len > k_len (queries that see no
key), sequences without queries or without keys, H 1 / 3 / 20, strided and head-major inputs and outputs, a
3,000-key context, planted score sinks that make the running max jump, and a CUDA graph replayed on new inputs.
Every launch writes into out / lse filled with NaN: the rows past cu_q_lens[B] must keep those bytes, every
other row must match (check_attention, tests/gpu_checks.py: finite, within tolerance, exactly 0 / -inf where a
query sees no key). The inputs hold NaN wherever no sequence owns a row (q past cu_q_lens[B], k / v past
cu_k_lens[B], the unused parts of the wider tensors that strided inputs are sliced from): a kernel that reads
one shows NaN. CPU tests: CPU tensors run the reference, and the argument checks that hold on every device.
"""
import math
from dataclasses import dataclass

import pytest
import torch

import mla_kv
from mla_kv import reference

from gpu_checks import capture_graph, check_attention, same_bytes

GPU = pytest.mark.gpu
# The op's own variants; arch=None (the GPU's best of them) has a test of its own below.
ARCHS = pytest.mark.arch_variants("sm75", "sm70", bf16_needs_sm80=True)
# Where the GPU tests put their tensors: a module setting, so that their logic can also be run on the CPU
# against a stand-in for the kernel.
DEVICE = "cuda"

DIM_PAIRS = [(192, 128), (256, 256), (128, 128)]          # the (d_qk, d_v) pairs the kernels support
DIM_IDS = [f"{a}-{b}" for a, b in DIM_PAIRS]
# K and V elements N(0, 1) and the 1 / sqrt(d_qk) scale give scores of std Q_STD: over 30 .. 3,000 keys the
# median row's largest weight is 0.4 .. 0.1, a softmax neither uniform nor one-hot
# (test_test_data_is_neither_uniform_nor_one_hot).
Q_STD = 2.5
# Tolerances (check_attention: per-row ||out - ref|| / ||ref||; lse absolute, plus 1e-5 |lse| added there).
# The reference runs in float64 on the very fp16 values the kernel reads, so only the kernel's own rounding
# counts: S = Q.K^T sums exact fp16 products in fp32 (a score error ~1e-6 relative, ~1e-4 at the planted
# sinks' scores of ~60), exp2 in fp32, P rounded to fp16 before P.V (each weight off by up to u = 2^-11,
# relative, of either sign) while the row sum stays fp32, O accumulated in fp32 and rounded to fp16 once. The
# weighted sum of the per-key P errors scales with the row's own norm whatever the softmax's shape, ~u/sqrt(3)
# relative, and the final rounding adds as much. An emulation of exactly this rounding (fp32 S, 32-key tiles,
# online softmax, P in fp16) over these tests' inputs gives out errors of 2.2e-4 median and 3.8e-4 at worst,
# lse errors below 3e-5. OUT_TOL 1.5e-3 leaves 4x over that worst case yet fails a kernel that rounds one step
# more coarsely: P in bf16 reaches 2.2e-3, O kept in fp16 across the tiles 2.4e-3 at 3,000 keys (both pass
# 3e-3, gpu_checks' fp16 tolerance, and prefill_expanded's 5e-3, which also covers K and V rounded to fp16:
# not done here, the inputs are fp16 already). LSE_TOL 1e-3 (gpu_checks') covers the score error at the sinks
# with room; a wrong lse (a missed tile, log2 for ln) is off by far more.
OUT_TOL = 1.5e-3
LSE_TOL = 1e-3
SINK_FACTOR = 6.0        # sink keys scaled by this: scores of std 6 x Q_STD = 15, up to ~60

# (q_len, k_len) per sequence, in batch order: one token; whole prompts of 31 .. 200 (around the 32-key tiles
# and the 32 / 64-row CTAs); extends; q_len > k_len (under the causal mask the first q_len - k_len queries see
# nothing); a sequence without queries, one without keys and an empty one, placed mid-batch so that the rows
# after them must be found through cu_q_lens / cu_k_lens.
VARLEN = [(1, 1), (31, 31), (0, 50), (32, 32), (33, 33), (40, 7), (63, 63), (64, 64), (6, 0), (65, 65),
          (127, 127), (200, 200), (1, 200), (31, 64), (0, 0), (33, 65), (64, 127), (65, 64), (5, 33), (33, 1)]
SMALL = [(33, 33), (17, 90), (0, 5), (40, 7), (64, 64), (1, 31)]


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_q_lens: torch.Tensor
    cu_k_lens: torch.Tensor
    scale: float
    max_q_len: int                   # host bounds: a CUDA graph capture cannot read the lengths back
    used: int                        # cu_q_lens[B]

    def run(self, **kwargs):
        return mla_kv.expanded_attention(self.q, self.k, self.v, self.cu_q_lens, self.cu_k_lens, self.scale,
                                         max_q_len=self.max_q_len, **kwargs)

    def reference(self, causal):
        return reference.expanded_attention(self.q.double(), self.k.double(), self.v.double(), self.cu_q_lens,
                                            self.cu_k_lens, self.scale, causal=causal)


def _place(values: torch.Tensor, layout: str, wider: int, heads_before: int, heads_after: int, offset: int,
           device) -> torch.Tensor:
    """values [rows, H, d] as a view: "packed" (contiguous), "strided" (heads heads_before.. of a NaN tensor
    [rows, heads_before + H + heads_after, d + wider], columns offset..) or "head_major" (a [H, rows, d] tensor
    transposed)."""
    rows, heads, d = values.shape
    if layout == "packed":
        return values.to(device).contiguous()
    if layout == "head_major":
        return values.transpose(0, 1).contiguous().to(device).transpose(0, 1)
    assert layout == "strided"
    big = torch.full((rows, heads_before + heads + heads_after, d + wider), math.nan, dtype=values.dtype,
                     device=device)
    view = big[:, heads_before:heads_before + heads, offset:offset + d]
    view.copy_(values)
    return view


def make_batch(seqs, heads, dims, *, layout="packed", padded_rows=3, spare_keys=5, q_std=Q_STD, device=None):
    """fp16 q / k / v of the (q_len, k_len) sequences packed in order; NaN in the padded q rows past
    cu_q_lens[B], in the spare k / v rows past cu_k_lens[B] and (layout "strided") around the views."""
    device = DEVICE if device is None else device
    d_qk, d_v = dims
    q_lens, k_lens = [n for n, _ in seqs], [m for _, m in seqs]
    used_q, used_k = sum(q_lens), sum(k_lens)
    q = (torch.randn(used_q + padded_rows, heads, d_qk) * q_std).half()
    k = torch.randn(used_k + spare_keys, heads, d_qk).half()
    v = torch.randn(used_k + spare_keys, heads, d_v).half()
    q[used_q:], k[used_k:], v[used_k:] = math.nan, math.nan, math.nan
    if layout == "strided":
        # q: one head and 32 columns before, 32 after; k and v side by side in one [N, H + 2, d_qk + d_v]
        # tensor, k in heads 2.., v in heads 1..: head strides d + 64 / d_qk + d_v, 16-byte aligned offsets.
        q = _place(q, layout, 64, 1, 0, 32, device)
        kv = torch.full((k.shape[0], heads + 2, d_qk + d_v), math.nan, dtype=torch.float16, device=device)
        kv[:, 2:, :d_qk] = k.to(device)
        kv[:, 1:heads + 1, d_qk:] = v.to(device)
        k, v = kv[:, 2:, :d_qk], kv[:, 1:heads + 1, d_qk:]
    else:
        q, k, v = (_place(t, layout, 0, 0, 0, 0, device) for t in (q, k, v))
    cu_q = torch.tensor([0] + q_lens).cumsum(0).int().to(device)
    cu_k = torch.tensor([0] + k_lens).cumsum(0).int().to(device)
    return Batch(q, k, v, cu_q, cu_k, 1 / math.sqrt(d_qk), max(max(q_lens), 1), used_q)


def nan_outputs(batch, layout="packed"):
    """NaN out [T, H, d_v] (fp16) and lse [T, H] (fp32); out as a view when layout is not "packed" (for
    "strided", of a [T, H, d_v + 16] tensor from column 8, returned as the third value)."""
    tokens, heads = batch.q.shape[:2]
    d_v = batch.v.shape[-1]
    lse = torch.full((tokens, heads), math.nan, device=batch.q.device)
    if layout == "strided":
        big = torch.full((tokens, heads, d_v + 16), math.nan, dtype=torch.float16, device=batch.q.device)
        return big[..., 8:8 + d_v], lse, big
    out = torch.full((tokens, heads, d_v), math.nan, dtype=torch.float16, device=batch.q.device)
    if layout == "head_major":
        out = out.transpose(0, 1).contiguous().transpose(0, 1)
    return out, lse, None


def nan_like(t):
    return torch.full(t.shape, math.nan, dtype=t.dtype, device=t.device)


def run_op(batch, *, causal, arch, out=None, lse=None):
    """The op into NaN out / lse (fresh unless given, then refilled); checks that it returned them, left the
    rows past cu_q_lens[B] NaN and changed no input."""
    if out is None or lse is None:
        out, lse, _ = nan_outputs(batch)
    out.fill_(math.nan)
    lse.fill_(math.nan)
    inputs = (batch.q, batch.k, batch.v, batch.cu_q_lens, batch.cu_k_lens)
    before = [t.clone() for t in inputs]
    got = batch.run(causal=causal, arch=arch, out=out, lse=lse)
    sync()
    assert got[0] is out and got[1] is lse, "the op must return the out / lse it was given"
    for name, t, kept in zip(("q", "k", "v", "cu_q_lens", "cu_k_lens"), inputs, before):
        assert same_bytes(t, kept), f"the op changed {name}"
    check_padding_untouched(batch, out, lse)
    return got


def check_padding_untouched(batch, out, lse):
    u = batch.used
    assert same_bytes(out[u:], nan_like(out[u:])), f"out rows {u}.. (past cu_q_lens[B]) were written"
    assert same_bytes(lse[u:], nan_like(lse[u:])), f"lse rows {u}.. (past cu_q_lens[B]) were written"


def check(batch, got, what, *, causal):
    out, lse = got
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    ref_out, ref_lse = batch.reference(causal)
    u = batch.used
    check_attention(out[:u].cpu(), lse[:u].cpu(), ref_out[:u].cpu(), ref_lse[:u].cpu(), what,
                    cu_q_lens=batch.cu_q_lens.cpu(), out_tol=OUT_TOL, lse_tol=LSE_TOL)


# ------------------------------------------------------------------------------------ GPU
@GPU
@ARCHS
@pytest.mark.parametrize("dims", DIM_PAIRS, ids=DIM_IDS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", [1, 3, 20])
def test_gpu_matches_reference(dims, causal, heads, arch):
    batch = make_batch(VARLEN, heads, dims)
    check(batch, run_op(batch, causal=causal, arch=arch), f"varlen {dims} causal={causal} H={heads} {arch}",
          causal=causal)


@GPU
@pytest.mark.parametrize("dims", DIM_PAIRS, ids=DIM_IDS)
def test_gpu_default_arch_matches_reference(dims):
    batch = make_batch(SMALL, 3, dims)
    check(batch, run_op(batch, causal=True, arch=None), f"arch=None {dims}", causal=True)


@GPU
@ARCHS
@pytest.mark.parametrize("dims", DIM_PAIRS, ids=DIM_IDS)
@pytest.mark.parametrize("layout", ["strided", "head_major"])
def test_gpu_strided_inputs_and_output(dims, layout, arch):
    batch = make_batch(SMALL, 3, dims, layout=layout)
    assert not batch.q.is_contiguous() and not batch.k.is_contiguous() and not batch.v.is_contiguous()
    out, lse, big = nan_outputs(batch, layout)
    assert not out.is_contiguous()
    got = run_op(batch, causal=True, arch=arch, out=out, lse=lse)
    check(batch, got, f"{layout} {dims} {arch}", causal=True)
    if big is not None:
        d_v = out.shape[-1]
        assert same_bytes(big[..., :8], nan_like(big[..., :8])), "columns before out's view were written"
        assert same_bytes(big[..., 8 + d_v:], nan_like(big[..., 8 + d_v:])), "columns after out's view were written"


@GPU
@ARCHS
@pytest.mark.parametrize("dims", DIM_PAIRS, ids=DIM_IDS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gpu_long_context(dims, causal, arch):
    # 200 new queries over 3,000 keys (~94 tiles of 32), a whole prompt, one decode-like query over 1,500.
    batch = make_batch([(200, 3000), (64, 64), (1, 1500)], 2, dims)
    check(batch, run_op(batch, causal=causal, arch=arch), f"long {dims} causal={causal} {arch}", causal=causal)


def sink_positions(q_len, k_len):
    """Keys to scale: the first two (the running max starts high), the last cached one before the new tokens
    (seen by every query), and two late ones (the max jumps after many tiles)."""
    late = {k_len - 2, k_len - 1, k_len - q_len - 1}
    return sorted(p for p in {0, 1} | late if 0 <= p < k_len)


def plant_sinks(batch, seqs, factor):
    """Scales the sink keys of every sequence by `factor` in every head: their scores grow by that factor, to
    the top of the softmax in some heads and the bottom in others, as attention sinks and score outliers do."""
    starts = batch.cu_k_lens.tolist()
    for b, (n, m) in enumerate(seqs):
        for p in sink_positions(n, m):
            batch.k[starts[b] + p] *= factor


@GPU
@ARCHS
@pytest.mark.parametrize("dims", DIM_PAIRS, ids=DIM_IDS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gpu_sinks_and_running_max_jumps(dims, causal, arch):
    seqs = [(64, 700), (100, 100), (1, 333), (48, 208)]
    batch = make_batch(seqs, 4, dims)
    plain_lse = batch.reference(causal)[1][:batch.used]
    plant_sinks(batch, seqs, SINK_FACTOR)
    planted_lse = batch.reference(causal)[1][:batch.used]
    seen = torch.isfinite(plain_lse)
    assert float((planted_lse - plain_lse)[seen].abs().max()) > 10, "the sinks must dominate some rows"
    check(batch, run_op(batch, causal=causal, arch=arch), f"sinks {dims} causal={causal} {arch}", causal=causal)


def replay_and_check(graph, batch, out, lse, what):
    out.fill_(math.nan)
    lse.fill_(math.nan)
    graph.replay()
    sync()
    check_padding_untouched(batch, out, lse)
    check(batch, (out, lse), what, causal=True)


@GPU
@ARCHS
def test_gpu_cuda_graph_replay_on_new_inputs(arch):
    seqs = [(33, 90), (64, 64), (0, 7), (20, 5)]
    batch = make_batch(seqs, 4, (192, 128), padded_rows=8, spare_keys=40)
    tokens, keys = batch.q.shape[0], batch.k.shape[0]
    out, lse, _ = nan_outputs(batch)
    graph = capture_graph(lambda: batch.run(causal=True, arch=arch, out=out, lse=lse))

    def load(new_seqs):
        """New values (and lengths) copied into the captured buffers: same T, N, B and max_q_len."""
        padded, spare = tokens - sum(n for n, _ in new_seqs), keys - sum(m for _, m in new_seqs)
        fresh = make_batch(new_seqs, 4, (192, 128), padded_rows=padded, spare_keys=spare)
        assert fresh.max_q_len <= batch.max_q_len
        for dst, src in ((batch.q, fresh.q), (batch.k, fresh.k), (batch.v, fresh.v),
                         (batch.cu_q_lens, fresh.cu_q_lens), (batch.cu_k_lens, fresh.cu_k_lens)):
            dst.copy_(src)
        batch.used = fresh.used

    load(seqs)
    replay_and_check(graph, batch, out, lse, f"graph replay, new values {arch}")
    # New lengths under the captured bounds, fewer q rows in use: the graph must leave more padding untouched.
    load([(64, 64), (1, 130), (30, 10), (0, 0)])
    replay_and_check(graph, batch, out, lse, f"graph replay, new lengths {arch}")


def _other_dims(d_qk, d_v):
    """q / k / v (and an out to match) of head dims the kernels lack: only the dims may be refused."""
    return lambda b: dict(q=b.q.new_zeros(b.q.shape[0], b.q.shape[1], d_qk),
                          k=b.k.new_zeros(b.k.shape[0], b.k.shape[1], d_qk),
                          v=b.v.new_zeros(b.v.shape[0], b.v.shape[1], d_v),
                          out=b.q.new_full((b.q.shape[0], b.q.shape[1], d_v), math.nan))


def _sliced(name, shape_of, pad, start):
    """Tensor `name` rebuilt as a slice [..., start:start + d] of a [..., d + pad] tensor."""
    def change(b):
        t = getattr(b, name) if name != "out" else None
        shape = shape_of(b)
        wide = torch.zeros(*shape[:-1], shape[-1] + pad, dtype=torch.float16, device=b.q.device)
        view = wide[..., start:start + shape[-1]]
        if t is not None:
            view.copy_(t)
        return {name: view}
    return change


def _shape(name):
    return lambda b: (tuple(b.q.shape[:2]) + (b.v.shape[-1],)) if name == "out" else tuple(getattr(b, name).shape)


@GPU
@pytest.mark.parametrize("change,error,match", [
    (lambda b: dict(q=b.q.bfloat16(), k=b.k.bfloat16(), v=b.v.bfloat16()), TypeError, r"^q\b"),
    (lambda b: dict(q=b.q.float(), k=b.k.float(), v=b.v.float()), TypeError, r"^q\b"),
    (_other_dims(64, 64), ValueError, r"^(q|v)\b"),
    (_other_dims(192, 256), ValueError, r"^(q|v)\b"),
    (_other_dims(256, 128), ValueError, r"^(q|v)\b"),
    (_other_dims(576, 512), ValueError, r"^(q|v)\b"),
    (lambda b: dict(q=torch.zeros(*b.q.shape[:2], 2 * b.q.shape[2], dtype=torch.float16,
                                  device=b.q.device)[..., ::2]), ValueError, r"^q\b"),   # last dim strided
    (_sliced("q", _shape("q"), 4, 0), ValueError, r"^q\b"),          # head stride d_qk + 4: not a multiple of 8
    (_sliced("q", _shape("q"), 8, 4), ValueError, r"^q\b"),          # data 8 bytes off a 16-byte boundary
    (_sliced("k", _shape("k"), 8, 4), ValueError, r"^k\b"),
    (_sliced("v", _shape("v"), 4, 0), ValueError, r"^v\b"),
    (_sliced("out", _shape("out"), 8, 4), ValueError, r"^out\b"),
    (lambda b: dict(k=b.k.cpu()), ValueError, r"^k\b"),
    (lambda b: dict(cu_k_lens=b.cu_k_lens.cpu()), ValueError, r"^cu_k_lens\b"),
    (lambda b: dict(cu_q_lens=b.cu_q_lens.long()), TypeError, r"^cu_q_lens\b"),
    (lambda b: dict(arch="sm80"), ValueError, r"^arch\b"),
    (lambda b: dict(arch="volta"), ValueError, r"^arch\b"),
])
def test_gpu_rejects_what_the_kernels_cannot_take(change, error, match):
    batch = make_batch([(5, 9), (3, 3)], 2, (192, 128))
    out, lse, _ = nan_outputs(batch)
    kwargs = dict(q=batch.q, k=batch.k, v=batch.v, cu_q_lens=batch.cu_q_lens, cu_k_lens=batch.cu_k_lens,
                  softmax_scale=batch.scale, max_q_len=batch.max_q_len, out=out, lse=lse)
    kwargs.update(change(batch))
    outputs = [kwargs["out"], kwargs["lse"]]
    before = [t.clone() for t in outputs]
    with pytest.raises(error, match=match):
        mla_kv.expanded_attention(**kwargs)
    sync()
    assert all(same_bytes(t, kept) for t, kept in zip(outputs, before)), "out / lse written on error"


# ------------------------------------------------------------------------------------ CPU
def test_test_data_is_neither_uniform_nor_one_hot():
    """The scores the GPU tests draw (Q_STD): a row's largest softmax weight is far above uniform and far below
    one, so a kernel that flattens or sharpens the softmax fails the comparison."""
    for n, m in [(64, 64), (64, 700), (200, 3000)]:
        batch = make_batch([(n, m)], 4, (192, 128), padded_rows=0, spare_keys=0, device="cpu")
        scores = torch.einsum("nhd,mhd->nhm", batch.q.double(), batch.k.double()) * batch.scale
        top = scores.softmax(-1).amax(-1)
        assert 5 / m < float(top.median()) < 0.7, (n, m, float(top.median()))
        assert float(top.max()) < 0.999, (n, m)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dims", [(192, 128), (40, 24)], ids=["192-128", "40-24"])   # any dims on the CPU
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_cpu_op_runs_the_reference(dtype, dims, causal):
    seqs = [(5, 5), (3, 9), (0, 4), (9, 4), (4, 0), (1, 1)]
    batch = make_batch(seqs, 3, dims, device="cpu")
    batch.q, batch.k, batch.v = batch.q.to(dtype), batch.k.to(dtype), batch.v.to(dtype)
    want_out, want_lse = reference.expanded_attention(batch.q, batch.k, batch.v, batch.cu_q_lens, batch.cu_k_lens,
                                                      batch.scale, causal=causal)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.full((*batch.q.shape[:2], dims[1]), math.nan, dtype=dtype)
    lse = torch.full(batch.q.shape[:2], math.nan, dtype=lse_dtype)
    got = batch.run(causal=causal, out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    u = batch.used
    assert same_bytes(out[:u], want_out[:u]) and same_bytes(lse[:u], want_lse[:u]), "the CPU op is the reference"
    check_padding_untouched(batch, out, lse)
    fresh_out, fresh_lse = batch.run(causal=causal)
    assert fresh_out.dtype == dtype and fresh_lse.dtype == lse_dtype
    assert same_bytes(fresh_out[:u], want_out[:u]) and same_bytes(fresh_lse[:u], want_lse[:u])


def _cpu_args(batch, change):
    kwargs = dict(q=batch.q, k=batch.k, v=batch.v, cu_q_lens=batch.cu_q_lens, cu_k_lens=batch.cu_k_lens,
                  softmax_scale=batch.scale, max_q_len=batch.max_q_len)
    kwargs.update(change(batch))
    return kwargs


_T, _H, _N = 11, 2, 17        # the CPU batch below: q rows (8 used), heads, k rows (12 used)


@pytest.mark.parametrize("change,error,match", [
    (lambda b: dict(q=b.q[0]), ValueError, r"^q\b"),
    (lambda b: dict(q=b.q.int()), TypeError, r"^q\b"),
    (lambda b: dict(k=b.k[:, :1]), ValueError, r"^k\b"),                  # heads differ from q's
    (lambda b: dict(k=b.k[..., :-8]), ValueError, r"^k\b"),               # d_qk differs from q's
    (lambda b: dict(k=b.k[None]), ValueError, r"^k\b"),
    (lambda b: dict(k=b.k.float()), TypeError, r"^k\b"),
    (lambda b: dict(v=b.v[:-1]), ValueError, r"^v\b"),                    # rows differ from k's
    (lambda b: dict(v=b.v[:, :1]), ValueError, r"^v\b"),
    (lambda b: dict(v=b.v.double()), TypeError, r"^v\b"),
    (lambda b: dict(cu_q_lens=b.cu_q_lens.long()), TypeError, r"^cu_q_lens\b"),
    (lambda b: dict(cu_q_lens=b.cu_q_lens.float()), TypeError, r"^cu_q_lens\b"),
    (lambda b: dict(cu_k_lens=b.cu_k_lens.long()), TypeError, r"^cu_k_lens\b"),
    (lambda b: dict(cu_q_lens=b.cu_q_lens[None]), ValueError, r"^cu_q_lens\b"),
    (lambda b: dict(cu_k_lens=b.cu_k_lens[:-1]), ValueError, r"^cu_k_lens\b"),   # B + 1 entries like cu_q_lens
    (lambda b: dict(softmax_scale=0.0), ValueError, r"^softmax_scale\b"),
    (lambda b: dict(softmax_scale=math.nan), ValueError, r"^softmax_scale\b"),
    (lambda b: dict(softmax_scale="0.1"), TypeError, r"^softmax_scale\b"),
    (lambda b: dict(causal="yes"), TypeError, r"^causal\b"),
    (lambda b: dict(max_q_len=9.0), TypeError, r"^max_q_len\b"),
    (lambda b: dict(max_q_len=True), TypeError, r"^max_q_len\b"),
    (lambda b: dict(max_q_len=-1), ValueError, r"^max_q_len\b"),
    (lambda b: dict(max_q_len=4), ValueError, r"^max_q_len: sequence 0 has 5 queries"),  # a host bound too small
    (lambda b: dict(validate=1), TypeError, r"^validate\b"),
    (lambda b: dict(out=torch.zeros(_T, _H, 120, dtype=torch.float16)), ValueError, r"^out\b"),
    (lambda b: dict(out=torch.zeros(_T - 1, _H, 128, dtype=torch.float16)), ValueError, r"^out\b"),
    (lambda b: dict(out=torch.zeros(_T, _H, 128, dtype=torch.float32)), TypeError, r"^out\b"),
    (lambda b: dict(lse=torch.zeros(_T, _H, dtype=torch.float16)), TypeError, r"^lse\b"),
    (lambda b: dict(lse=torch.zeros(_T, _H + 1)), ValueError, r"^lse\b"),
])
def test_cpu_bad_input_raises_naming_the_argument(change, error, match):
    """Checks of shapes, dtypes and scalars, made on every device before anything runs."""
    batch = make_batch([(5, 9), (3, 3)], _H, (192, 128), device="cpu")
    assert (batch.q.shape[0], batch.k.shape[0]) == (_T, _N)
    with pytest.raises(error, match=match):
        mla_kv.expanded_attention(**_cpu_args(batch, change))


@pytest.mark.parametrize("change,match", [
    (lambda b: dict(cu_q_lens=torch.tensor([0, 5, 12], dtype=torch.int32)), r"^cu_q_lens\b"),   # past q's 11 rows
    (lambda b: dict(cu_k_lens=torch.tensor([0, 9, 18], dtype=torch.int32)), r"^cu_k_lens\b"),   # past k's 17 rows
    (lambda b: dict(cu_q_lens=torch.tensor([0, 5, 4], dtype=torch.int32)), r"^cu_q_lens\b"),    # decreasing
    (lambda b: dict(cu_k_lens=torch.tensor([2, 9, 12], dtype=torch.int32)), r"^cu_k_lens\b"),   # not from 0
])
def test_cpu_lengths_are_checked(change, match):
    """On the CPU the lengths are host data, always checked (as validate=True checks them on CUDA);
    nothing is written on error."""
    batch = make_batch([(5, 9), (3, 3)], _H, (192, 128), device="cpu")
    out = torch.full((_T, _H, 128), 3.0, dtype=torch.float16)
    lse = torch.full((_T, _H), 3.0)
    kwargs = _cpu_args(batch, change)
    kwargs["max_q_len"] = _T   # above every q_len here: only the lengths themselves may be refused
    with pytest.raises(ValueError, match=match):
        mla_kv.expanded_attention(**kwargs, out=out, lse=lse)
    assert bool((out == 3).all()) and bool((lse == 3).all())


@GPU
@pytest.mark.parametrize("change,match", [
    (lambda b: dict(cu_q_lens=torch.tensor([0, 5, 12], dtype=torch.int32, device="cuda")), r"^cu_q_lens\b"),
    (lambda b: dict(cu_k_lens=torch.tensor([0, 9, 18], dtype=torch.int32, device="cuda")), r"^cu_k_lens\b"),
    (lambda b: dict(max_q_len=4), r"^max_q_len: sequence 0"),
])
def test_gpu_validate_refuses_lengths_the_kernel_would_read_past(change, match):
    """validate=True: the device lengths checked on the host before the launch; nothing is written."""
    batch = make_batch([(5, 9), (3, 3)], _H, (192, 128), device="cuda")
    out = torch.full((_T, _H, 128), 3.0, dtype=torch.float16, device="cuda")
    lse = torch.full((_T, _H), 3.0, device="cuda")
    kwargs = dict(q=batch.q, k=batch.k, v=batch.v, cu_q_lens=batch.cu_q_lens, cu_k_lens=batch.cu_k_lens,
                  softmax_scale=batch.scale, max_q_len=_T)
    kwargs.update(change(batch))
    with pytest.raises(ValueError, match=match):
        mla_kv.expanded_attention(**kwargs, out=out, lse=lse, validate=True)
    assert bool((out == 3).all()) and bool((lse == 3).all())
