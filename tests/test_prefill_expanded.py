"""prefill_expanded (the expanded-route prefill op) against the float64 spec, reference.prefill_expanded.

CPU tests run the op's own chunked algorithm (new part, prefix chunks, merge_states) with its math
attention in place of torch's memory-efficient kernel, so they check the split into parts, the chunk
bounds and the merging in float64 and float32; GPU tests check the kernel path in fp16 / bf16. Every case
has padded rows past cu_q_lens[B] (they must come out 0 / lse -inf), NaN in the cache rows no sequence
owns, shuffled blocks, and a batch with a sequence without queries and one without a prefix.
check_attention (tests/gpu_checks.py) compares every (token, head) row.
"""
import math
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

import mla_kv
from mla_kv import layout, reference
from mla_kv.reference import quant

from gpu_checks import block_counts, block_pointer_copy, capture_graph, check_attention, poison_unwritten, \
    random_table, same_bytes

GPU = pytest.mark.gpu

# Cache rows N(0, 0.5^2) and W ~ N(0, 1/512) make every K and V element ~0.5; with the 1/sqrt(d_qk) scale
# q ~ N(0, 5^2) gives scores of std 2.5: softmax neither uniform nor one-hot.
ROW_STD, Q_STD = 0.5, 5.0
DIMS = {"deepseek": (128, 128), "glm": (192, 256)}           # (qk_nope, v) head dims, facts.md
WHOLE = ([37, 5, 64, 1], [37, 5, 64, 1])                    # (kv_lens, q_lens): whole prompts
# Extends: prefixes 32, 4, -, -, 0, 39, 40. With kv_chunk 16 sequence 0's prefix ends exactly on a chunk
# boundary, with kv_chunk 5 sequence 6's; sequence 2 is empty and 3 has no queries; max_kv_len 90 leaves
# the last chunks empty for every sequence.
EXTEND = ([52, 7, 0, 90, 33, 40, 45], [20, 3, 0, 0, 33, 1, 5])
FORMATS = ["fp8", "fp8_ds_mla", "int8", "int4"]
FP8_SCALE = 0.5
# 16-bit tolerances (per-row out error relative to the row's norm; lse absolute). The expanded route
# rounds the up-projected K and V to the dtype (unit roundoff u = 2^-11 fp16, 2^-8 bf16), which the
# absorbed kernels' tolerances in gpu_checks do not cover: each score moves by ~u/sqrt(3) x its std (2.5)
# in a random direction, up to ~4 std over a batch (7e-3 fp16... 2.3e-2 bf16 worst case, lse being a
# weighted mean of them); out adds V's, P's and each part's rounding (~u each) before the fp32 merge.
OUT_TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5, torch.float64: 1e-10}
LSE_TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5, torch.float64: 1e-10}


@dataclass
class Case:
    q: torch.Tensor
    cache: torch.Tensor
    table: torch.Tensor
    cu_q_lens: torch.Tensor
    kv_lens: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    scale: float
    kv_format: Optional[str]
    spec_rows: torch.Tensor          # the rows the spec reads: the cache, or its dequantized rows
    bounds: dict                     # max_q_len, max_kv_len: host ints (a CUDA graph capture cannot read them back)

    def run(self, **kwargs):
        kw = dict(self.bounds, kv_format=self.kv_format, kv_scale=FP8_SCALE if self.kv_format == "fp8" else None)
        kw.update(kwargs)
        return mla_kv.prefill_expanded(self.q, self.cache, self.table, self.cu_q_lens, self.kv_lens, self.w_uk,
                                       self.w_uv, self.scale, **kw)

    def reference(self, causal=True):
        return reference.prefill_expanded(self.q.double(), self.spec_rows.double(), self.table, self.cu_q_lens,
                                          self.kv_lens, self.w_uk.double(), self.w_uv.double(), self.scale,
                                          causal=causal)


def make_case(lens, heads, dims, dtype, *, device="cpu", block_size=16, shared_blocks=0, kv_format=None,
              padded_rows=2):
    kv_lens, q_lens = lens
    d_nope, d_v = DIMS[dims] if isinstance(dims, str) else dims
    need = block_counts(kv_lens, block_size)
    num_blocks = sum(need) + 3
    table = random_table(need, num_blocks, shared_prefix_blocks=shared_blocks, device=device)
    rows = torch.randn(num_blocks, block_size, layout.ROW_DIM) * ROW_STD
    if kv_format is None:
        cache = poison_unwritten(rows.to(device, dtype), table, kv_lens)
        spec_rows = cache
    else:
        cache = torch.zeros(layout.paged_cache_shape(kv_format, num_blocks, block_size, dtype), dtype=torch.uint8)
        quant.write_rows(cache, rows.view(-1, layout.ROW_DIM).to(dtype), torch.arange(num_blocks * block_size),
                         kv_format, kv_scale=FP8_SCALE if kv_format == "fp8" else None)
        spec_rows = quant.dequantize_cache(cache, kv_format, kv_scale=FP8_SCALE if kv_format == "fp8" else None,
                                           scale_dtype=dtype).to(dtype).to(device)
        cache = cache.to(device)
    tokens = sum(q_lens) + padded_rows
    q = (torch.randn(tokens, heads, d_nope + layout.ROPE_DIM) * Q_STD).to(device, dtype)
    w_uk = (torch.randn(heads, d_nope, layout.LATENT_DIM) / math.sqrt(layout.LATENT_DIM)).to(device, dtype)
    w_uv = (torch.randn(heads, d_v, layout.LATENT_DIM) / math.sqrt(layout.LATENT_DIM)).to(device, dtype)
    cu = torch.tensor([0] + q_lens, device=device).cumsum(0).int()
    return Case(q, cache, table, cu, torch.tensor(kv_lens, dtype=torch.int32, device=device), w_uk, w_uv,
                1 / math.sqrt(d_nope + layout.ROPE_DIM), kv_format, spec_rows,
                dict(max_q_len=max(max(q_lens), 1), max_kv_len=max(max(kv_lens), 1)))


def check(case, got, what, *, causal=True):
    dtype = case.q.dtype
    ref_out, ref_lse = case.reference(causal)
    out, lse = got
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    check_attention(out.cpu(), lse.cpu(), ref_out.cpu(), ref_lse.cpu(), what, cu_q_lens=case.cu_q_lens.cpu(),
                    out_tol=OUT_TOL[dtype], lse_tol=LSE_TOL[dtype])


# ------------------------------------------------------------------------------------ CPU
@pytest.mark.parametrize("dims", list(DIMS))
@pytest.mark.parametrize("heads", [1, 3, 20])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("batch,kv_chunk", [("whole", 8192), ("whole", 7), ("extend", 5), ("extend", 16),
                                            ("extend", 8192)])
def test_matches_reference(dims, heads, dtype, batch, kv_chunk):
    case = make_case(WHOLE if batch == "whole" else EXTEND, heads, dims, dtype, shared_blocks=int(batch == "extend"))
    check(case, case.run(kv_chunk=kv_chunk), f"{batch} kv_chunk={kv_chunk}")


def plant_sinks_and_jumps(case, factor):
    """Scales each sequence's first cached row (a sink in the first prefix chunk) and its last prefix row
    (in the last chunk) by `factor`: their scores grow by that factor, to the top of the softmax in some
    heads and the bottom in others, so the running max jumps between chunks as in real models."""
    block_size = case.cache.shape[1]
    for b, (kv_len, q_len) in enumerate(zip(case.kv_lens.tolist(), case.cu_q_lens.diff().tolist())):
        for pos in {0, kv_len - q_len - 1} if kv_len - q_len > 0 else ():
            case.cache[case.table[b, pos // block_size], pos % block_size] *= factor


@pytest.mark.parametrize("dims", list(DIMS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kv_chunk", [5, 16])
def test_sinks_and_score_jumps_across_chunks(dims, dtype, kv_chunk):
    case = make_case(EXTEND, 20, dims, dtype)
    live = int(case.cu_q_lens[-1])
    plain_lse = case.reference()[1][:live]
    plant_sinks_and_jumps(case, 6.0)
    planted_lse = case.reference()[1][:live]
    assert float((planted_lse - plain_lse).abs().max()) > 5, "the planted rows must dominate some heads"
    check(case, case.run(kv_chunk=kv_chunk), f"sinks and jumps kv_chunk={kv_chunk}")


@pytest.mark.parametrize("dims", list(DIMS))
def test_not_causal(dims):
    case = make_case(EXTEND, 3, dims, torch.float64)
    check(case, case.run(causal=False, kv_chunk=16), "causal=False", causal=False)


@pytest.mark.parametrize("dims,heads,lens,kv_chunk", [
    ("glm", 3, ([3000, 1200], [256, 1200]), 1024),            # prefix 2744: chunks end at 1024, 2048
    ("deepseek", 2, ([1500, 2500], [1500, 2500]), 8192)])     # whole prompts
def test_long_context(dims, heads, lens, kv_chunk):
    case = make_case(lens, heads, dims, torch.float32, block_size=64)
    check(case, case.run(kv_chunk=kv_chunk), f"long kv_chunk={kv_chunk}")


@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantized_cache_matches_reference_over_dequantized_rows(kv_format, dtype):
    case = make_case(EXTEND, 3, "glm", dtype, kv_format=kv_format, shared_blocks=1)
    check(case, case.run(kv_chunk=16), kv_format)


def test_given_outputs_and_workspace_are_used_and_looser_bounds_agree():
    case = make_case(EXTEND, 3, "deepseek", torch.float64)
    tokens, heads = case.q.shape[:2]
    size = mla_kv.prefill_expanded_workspace_size(tokens, 7, heads, 128, 128, max_kv_len=90, kv_chunk=16,
                                                  dtype=torch.float64)
    workspace = torch.full((size,), 0xFF, dtype=torch.uint8)  # NaN in every float part
    out = torch.full((tokens, heads, 128), float("nan"), dtype=torch.float64)
    lse = torch.full((tokens, heads), float("nan"), dtype=torch.float64)
    got = case.run(kv_chunk=16, out=out, lse=lse, workspace=workspace)
    assert got[0] is out and got[1] is lse
    check(case, got, "given out, lse and workspace")
    # Bounds above the batch's lengths add empty chunks and a larger max_seqlen: the same result.
    check(case, case.run(kv_chunk=16, max_q_len=100, max_kv_len=500), "loose bounds")


@pytest.mark.parametrize("lens,max_prefix_len,kv_chunk", [
    (WHOLE, 0, 8192), (WHOLE, 0, 7),            # whole prompts: no prefix chunk at all
    (EXTEND, 40, 16), (EXTEND, 40, 8192)])      # the longest prefix exactly: one chunk of 40 rows
def test_max_prefix_len_bounds_the_chunks(lens, max_prefix_len, kv_chunk):
    case = make_case(lens, 3, "glm", torch.float64)
    check(case, case.run(kv_chunk=kv_chunk, max_prefix_len=max_prefix_len), f"max_prefix_len={max_prefix_len}")


def _bad(case, **changes):
    args = dict(q=case.q, kv_cache=case.cache, block_table=case.table, cu_q_lens=case.cu_q_lens,
                kv_lens=case.kv_lens, w_uk=case.w_uk, w_uv=case.w_uv, softmax_scale=case.scale)
    kwargs = dict(case.bounds)
    for name, value in changes.items():
        (args if name in args else kwargs)[name] = value
    return lambda: mla_kv.prefill_expanded(*args.values(), **kwargs)


@pytest.mark.parametrize("change,error,match", [
    (lambda c: dict(w_uk=c.w_uk[:2]), ValueError, "w_uk: dim 0"),
    (lambda c: dict(w_uv=c.w_uv[..., :511]), ValueError, "w_uv: dim 2"),
    (lambda c: dict(w_uv=c.w_uv.float()), TypeError, "w_uv: expected dtype"),
    (lambda c: dict(w_uk=c.w_uk[0]), ValueError, "w_uk: expected 3 dims"),
    (lambda c: dict(q=c.q[..., :-8]), ValueError, "q: the last dim must be d_nope"),
    (lambda c: dict(q=c.q.half()), TypeError, "w_uk: expected dtype"),
    (lambda c: dict(q=c.q.int()), TypeError, "q: dtype"),
    (lambda c: dict(max_q_len=0), ValueError, "max_q_len"),
    (lambda c: dict(max_kv_len=90.0), TypeError, "max_kv_len"),
    (lambda c: dict(kv_chunk=True), TypeError, "kv_chunk"),
    (lambda c: dict(kv_chunk=0), ValueError, "kv_chunk"),
    (lambda c: dict(max_q_len=32), ValueError, "max_q_len: sequence 4"),     # the CPU always validates
    (lambda c: dict(max_kv_len=89), ValueError, "max_kv_len: sequence 3"),
    (lambda c: dict(max_prefix_len=39), ValueError, "max_prefix_len: sequence 6"),
    (lambda c: dict(max_prefix_len=-1), ValueError, "max_prefix_len"),
    (lambda c: dict(softmax_scale=0.0), ValueError, "softmax_scale"),
    (lambda c: dict(attention_kernel="cudnn"), ValueError, "attention_kernel"),
    (lambda c: dict(causal="yes"), TypeError, "causal"),
    (lambda c: dict(cu_q_lens=c.cu_q_lens.long()), TypeError, "cu_q_lens"),
    (lambda c: dict(kv_lens=c.kv_lens[:3]), ValueError, "kv_lens"),
    (lambda c: dict(kv_cache=c.cache.float()), TypeError, "kv_cache"),
    (lambda c: dict(block_table=c.table[:, :2]), ValueError, "block_table"),
    (lambda c: dict(kv_scale=0.5), ValueError, "kv_scale"),
    (lambda c: dict(out=torch.zeros(c.q.shape[0], c.q.shape[1], 127, dtype=c.q.dtype)), ValueError, "out"),
    (lambda c: dict(lse=torch.zeros(c.q.shape[:2])), TypeError, "lse"),
    (lambda c: dict(workspace=torch.zeros(1024, dtype=torch.uint8)), ValueError, "workspace: needs"),
    (lambda c: dict(workspace=torch.zeros(1 << 20)), TypeError, "workspace"),
])
def test_bad_input_raises_naming_the_argument(change, error, match):
    case = make_case(EXTEND, 3, "deepseek", torch.float64)
    with pytest.raises(error, match=match):
        _bad(case, **change(case))()


def test_nothing_is_written_on_error_and_block_pointers_need_cuda():
    case = make_case(EXTEND, 2, "deepseek", torch.float64)
    out = torch.full((case.q.shape[0], 2, 128), 3.0, dtype=torch.float64)
    with pytest.raises(ValueError, match="max_q_len"):
        case.run(out=out, max_q_len=1)
    assert bool((out == 3).all())
    blocks = layout.BlockPointerCache(torch.zeros(7, dtype=torch.int64), torch.zeros(8, dtype=torch.int32), 16, 0,
                                      torch.float64)
    with pytest.raises(ValueError, match="cache: block-pointer ops run on CUDA"):
        _bad(case, kv_cache=blocks, block_table=None)()


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(total_q_tokens=-1), ValueError, "total_q_tokens"), (dict(num_heads=0), ValueError, "num_heads"),
    (dict(kv_chunk=2.0), TypeError, "kv_chunk"), (dict(dtype=torch.int8), TypeError, "dtype")])
def test_workspace_size_rejects_bad_arguments(kwargs, error, match):
    args = dict(total_q_tokens=8, batch=2, num_heads=4, d_nope=128, d_v=128, max_kv_len=100)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        mla_kv.prefill_expanded_workspace_size(**args)


# ------------------------------------------------------------------------------------ GPU
def gpu_run(case, **kwargs):
    """The op into NaN out/lse with a 0xFF (NaN) workspace; checks that the cache bytes are unchanged."""
    tokens, heads = case.q.shape[:2]
    size = mla_kv.prefill_expanded_workspace_size(tokens, case.kv_lens.shape[0], heads, case.w_uk.shape[1],
                                                  case.w_uv.shape[1], max_kv_len=case.bounds["max_kv_len"],
                                                  kv_chunk=kwargs.get("kv_chunk", 8192),
                                                  max_prefix_len=kwargs.get("max_prefix_len"), dtype=case.q.dtype)
    out = torch.full((tokens, heads, case.w_uv.shape[1]), float("nan"), dtype=case.q.dtype, device="cuda")
    lse = torch.full((tokens, heads), float("nan"), device="cuda")
    cache_before = case.cache.clone()
    got = case.run(out=out, lse=lse, workspace=torch.full((size,), 0xFF, dtype=torch.uint8, device="cuda"),
                   **kwargs)
    torch.cuda.synchronize()
    assert same_bytes(case.cache, cache_before), "the op changed the cache"
    return got


@GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dims", list(DIMS))
@pytest.mark.parametrize("heads", [1, 3, 20])
@pytest.mark.parametrize("batch", ["whole", "extend"])
@pytest.mark.parametrize("kernel", ["flash", "mem_efficient"])
def test_gpu_matches_reference(dtype, dims, heads, batch, kernel):
    case = make_case(WHOLE if batch == "whole" else EXTEND, heads, dims, dtype, device="cuda",
                     shared_blocks=int(batch == "extend"))
    check(case, gpu_run(case, kv_chunk=16, attention_kernel=kernel), f"{batch} kv_chunk=16 {kernel}")


@GPU
@pytest.mark.parametrize("arch", ["sm70", "sm75"])
@pytest.mark.parametrize("dims", list(DIMS))
@pytest.mark.parametrize("heads", [3, 20])
@pytest.mark.parametrize("batch", ["whole", "extend"])
def test_gpu_own_kernel_matches_reference(arch, dims, heads, batch):
    """The op on mla_kv's own expanded-form kernel (what V100 / T4 take under "auto"), each variant."""
    case = make_case(WHOLE if batch == "whole" else EXTEND, heads, dims, torch.float16, device="cuda",
                     shared_blocks=int(batch == "extend"))
    check(case, gpu_run(case, kv_chunk=16, attention_kernel="mla_kv", arch=arch), f"{batch} {arch}")


@GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dims,heads,lens,kv_chunk,max_prefix_len", [
    ("glm", 20, ([4096], [4096]), 8192, 0),
    ("deepseek", 16, ([4096, 700], [512, 300]), 1024, None)])
def test_gpu_long_context(dtype, dims, heads, lens, kv_chunk, max_prefix_len):
    case = make_case(lens, heads, dims, dtype, device="cuda", block_size=64)
    check(case, gpu_run(case, kv_chunk=kv_chunk, max_prefix_len=max_prefix_len), f"long kv_chunk={kv_chunk}")


@GPU
@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_quantized_cache(kv_format, dtype):
    case = make_case(EXTEND, 3, "glm", dtype, device="cuda", kv_format=kv_format, shared_blocks=1)
    check(case, gpu_run(case, kv_chunk=16, validate=True), kv_format)


@GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rope_first", [True, False])
def test_gpu_block_pointers(dtype, rope_first):
    case = make_case(EXTEND, 3, "glm", dtype, device="cuda")
    pool, blocks = block_pointer_copy(case.cache, case.table, case.kv_lens.tolist(), rope_first=rope_first)
    out, lse = mla_kv.prefill_expanded(case.q, blocks, None, case.cu_q_lens, case.kv_lens, case.w_uk, case.w_uv,
                                       case.scale, kv_chunk=16, validate=True, **case.bounds)
    torch.cuda.synchronize()
    del pool  # referenced until the launches finished
    check(case, (out, lse), f"block pointers rope_first={rope_first}")


@GPU
def test_gpu_cuda_graph_replay_with_workspace():
    case = make_case(EXTEND, 5, "deepseek", torch.float16, device="cuda")
    tokens, heads = case.q.shape[:2]
    size = mla_kv.prefill_expanded_workspace_size(tokens, 7, heads, 128, 128, max_kv_len=90, kv_chunk=16)
    workspace = torch.empty(size, dtype=torch.uint8, device="cuda")
    out = torch.empty(tokens, heads, 128, dtype=torch.float16, device="cuda")
    lse = torch.empty(tokens, heads, device="cuda")
    graph = capture_graph(lambda: case.run(kv_chunk=16, out=out, lse=lse, workspace=workspace))
    case.q.copy_((torch.randn(case.q.shape) * Q_STD).to("cuda", torch.float16))  # new data, same graph
    for buffer, value in ((out, float("nan")), (lse, float("nan")), (workspace, 0xFF)):
        buffer.fill_(value)
    graph.replay()
    torch.cuda.synchronize()
    check(case, (out, lse), "graph replay")


@GPU
def test_gpu_rejects_what_the_kernel_cannot_take():
    case = make_case(EXTEND, 3, (120, 128), torch.float16, device="cuda")
    with pytest.raises(TypeError, match="q: dtype"):
        _bad(case, q=case.q.float(), w_uk=case.w_uk.float(), w_uv=case.w_uv.float())()
    odd = make_case(EXTEND, 3, (100, 128), torch.float16, device="cuda")
    with pytest.raises(ValueError, match="w_uk: its head dim"):
        odd.run()
    with pytest.raises(ValueError, match="max_kv_len: sequence 0"):
        case.run(max_kv_len=50, validate=True)
    wide = make_case(EXTEND, 3, (256, 264), torch.float16, device="cuda")
    with pytest.raises(ValueError, match="attention_kernel: flash needs"):
        wide.run(attention_kernel="flash")
    with pytest.raises(ValueError, match="attention_kernel: the mla_kv kernel takes"):
        case.run(attention_kernel="mla_kv")
    with pytest.raises(ValueError, match="arch: picks the variant"):
        case.run(attention_kernel="flash", arch="sm70")
