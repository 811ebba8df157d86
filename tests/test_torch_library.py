"""torch.ops.mla_kv.* (mla_kv.ops.library): schemas, torch.library.opcheck, torch.compile and CUDA graphs.

CPU tests (CI) opcheck every op that has a CPU path (the reference), check the fakes' shapes and the
flattened-argument helpers, and compile small layers (fused write + decode; write + prefill +
gather + merge_states) with ``fullgraph=True`` on the eager, aot_eager and inductor backends: no
graph break, and the same results as eager. The block-pointer ops run on CUDA only: on the CPU they
are traced (one graph) and raise like the functions. GPU tests repeat opcheck and the compiled
layers on CUDA, for the paged and block-pointer forms, and capture a compiled step in a CUDA graph.
"""
import inspect
import operator
import shutil

import pytest
import torch

import mla_kv
from mla_kv import reference
from mla_kv.gpus import SmemLimits
from mla_kv.layout import BlockPool, to_latent_first
from mla_kv.ops import library
from mla_kv.ops.library import block_pointer_args, block_pointer_kwargs, schedule_kwargs
from mla_kv.rope import cos_sin_cache

from gpu_checks import block_pointer_copy, capture_graph, check_attention, packed_batch, random_cache, same_bytes

GPU = pytest.mark.gpu
# inductor's own imports use torch.jit.script_method, deprecated in torch 2.13
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
OPS = torch.ops.mla_kv
# The arguments each op writes (its schema's (a!) annotations).
WRITES = {
    "write_kv": {"kv_cache"}, "fused_write_kv": {"kv_cache", "q"},
    "write_kv_blocks": {"block_ptrs"}, "fused_write_kv_blocks": {"block_ptrs", "q"},
    "write_index_keys": {"index_cache", "q"}, "write_index_keys_blocks": {"block_ptrs", "q"},
    "decode": {"workspace"}, "decode_blocks": {"workspace"}, "prefill": {"workspace"},
    "prefill_blocks": {"workspace"}, "prefill_expanded": {"workspace"}, "merge_states": set(), "gather_kv": {"out"}, "gather_kv_blocks": {"out"},
    "expanded_attention": set(), "sparse_attention": {"workspace"}, "sparse_attention_blocks": {"workspace"},
    "index_scores": set(), "index_topk": {"workspace"},
}
HAVE_CXX = any(shutil.which(c) for c in ("g++", "c++", "clang++"))
BACKENDS = ["eager", "aot_eager",
            pytest.param("inductor", marks=pytest.mark.skipif(not HAVE_CXX, reason="inductor needs a C++ compiler"))]
SCALE = 0.1
EPS = 1e-6


def opcheck(op, args, kwargs=None):
    """torch.library.opcheck: schema (mutations and aliasing as annotated), autograd registration,
    the fake against the real op, and the op under aot_dispatch with dynamic shapes."""
    result = torch.library.opcheck(op, args, kwargs)
    assert set(result.values()) == {"SUCCESS"}, result


def compile_checked(fn, backend, *example):
    """fn compiled with fullgraph=True (a graph break raises); explain() on clones of ``example``
    confirms one graph and no breaks."""
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*clones(example))
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return torch.compile(fn, backend=backend, fullgraph=True)


def eager_and_compiled(layer, backend, inputs):
    """(eager results, eager inputs after the call, compiled results, compiled inputs after the call),
    each run on its own clones of ``inputs``; the compiled run had no graph break."""
    compiled = compile_checked(layer, backend, *inputs)
    eager_inputs, compiled_inputs = clones(inputs), clones(inputs)
    want, got = layer(*eager_inputs), compiled(*compiled_inputs)
    assert_no_graph_breaks()
    return want, eager_inputs, got, compiled_inputs


def clones(values):
    return tuple(v.clone() if isinstance(v, torch.Tensor) else v for v in values)


def assert_no_graph_breaks():
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


def paged_slots(table, positions, block_size):
    """Slots of position positions[b] of sequence b under the block table."""
    b = torch.arange(table.shape[0], device=table.device)
    positions = positions.long()
    return table[b, positions // block_size].long() * block_size + positions % block_size


# --------------------------------------------------------------------------- registration
def test_every_op_is_registered_with_its_mutations():
    assert set(library.REGISTERED) == set(WRITES)
    for name, writes in WRITES.items():
        schema = getattr(OPS, name).default._schema
        written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert written == writes, f"{name}: {schema}"
        assert all(r.alias_info is None for r in schema.returns), f"{name} returns an alias: {schema}"


def test_written_optional_tensors_have_no_default():
    """An optional tensor an op writes (q, workspace) has no default value: torch < 2.13 drops a defaulted
    argument before its version-counter bump and raises IndexError (pytorch issue 176078); the calls
    must be the same on every torch."""
    for name in WRITES:
        for arg in getattr(OPS, name).default._schema.arguments:
            if arg.alias_info is not None and arg.alias_info.is_write:
                assert not arg.has_default_value(), f"{name}.{arg.name}"
    q = torch.randn(1, 1, 2, 576)
    cache, table, lens = torch.randn(1, 16, 576), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="missing value for argument 'workspace'"):
        OPS.decode(q, cache, table, lens, SCALE)


def test_ops_take_the_functions_leading_arguments():
    """The paged ops' positional arguments start with the Python function's positional ones."""
    functions = {"write_kv": mla_kv.write_kv, "fused_write_kv": mla_kv.fused_write_kv, "decode": mla_kv.decode,
                 "write_index_keys": mla_kv.write_index_keys,
                 "prefill": mla_kv.prefill, "prefill_expanded": mla_kv.prefill_expanded,
                 "merge_states": mla_kv.merge_states, "gather_kv": mla_kv.gather_kv}
    for name, fn in functions.items():
        leading = [p.name for p in inspect.signature(fn).parameters.values()
                   if p.kind == p.POSITIONAL_OR_KEYWORD]
        schema = [a.name for a in getattr(OPS, name).default._schema.arguments]
        assert schema[:len(leading)] == leading, name


# ---------------------------------------------------------------------------- CPU inputs
def write_inputs(dtype, tokens=6, heads=3, q_dim=576, block_size=16, num_blocks=5):
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(num_blocks, block_size, 576, generator=gen).to(dtype)
    kv_a = torch.randn(tokens, 600, generator=gen).to(dtype)[:, 24:]  # a column slice, row stride 600
    weight = (torch.rand(512, generator=gen) + 0.5).to(dtype)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[1] = -1  # a padded token
    q = torch.randn(tokens, heads, q_dim, generator=gen).to(dtype)
    return kv_a, weight, positions, cos_sin_cache(64, 64, 10000.0), cache, slots, q


def attention_inputs(dtype, lens=(5, 0, 33), heads=4, s_q=2, block_size=16):
    gen = torch.Generator().manual_seed(5)
    need = [max(1, -(-n // block_size)) for n in lens]
    num_blocks = len(lens) * max(need) + 2
    cache = torch.randn(num_blocks, block_size, 576, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[:len(lens) * max(need)].view(len(lens), -1).int()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), s_q, heads, 576, generator=gen).to(dtype)
    return q, cache, table, seq_lens


# ----------------------------------------------------------------------------- CPU opcheck
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_write_kv(dtype):
    kv_a, _, _, _, cache, slots, _ = write_inputs(dtype)
    opcheck(OPS.write_kv.default, (kv_a[:, :512], kv_a[:, 512:], cache, slots))
    opcheck(OPS.write_kv.default, (kv_a[:, :512], kv_a[:, 512:], cache, slots), dict(validate=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_dim", [None, 576, 192])
@pytest.mark.parametrize("rope_style", ["interleaved", "neox"])
def test_opcheck_fused_write_kv(dtype, q_dim, rope_style):
    kv_a, weight, positions, cos_sin, cache, slots, q = write_inputs(dtype, q_dim=q_dim or 576)
    args = (kv_a, weight, EPS, positions, cos_sin, cache, slots, None if q_dim is None else q)
    opcheck(OPS.fused_write_kv.default, args, dict(rope_style=rope_style))


def test_fused_write_kv_op_matches_the_function():
    kv_a, weight, positions, cos_sin, cache, slots, q = write_inputs(torch.bfloat16)
    cache2, q2 = cache.clone(), q.clone()
    OPS.fused_write_kv(kv_a, weight, EPS, positions, cos_sin, cache, slots, q, rope_style="neox")
    mla_kv.fused_write_kv(kv_a, weight, EPS, positions, cos_sin, cache2, slots, q=q2, rope_style="neox")
    assert same_bytes(cache, cache2) and same_bytes(q, q2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_decode(dtype):
    q, cache, table, seq_lens = attention_inputs(dtype)
    opcheck(OPS.decode.default, (q, cache, table, seq_lens, SCALE, None))
    # q strided on B, S_q and H; a workspace and a schedule, which the reference ignores
    wide = torch.randn(3, 2, 6, 640, dtype=dtype)[:, :, 1:5, 32:608]
    workspace = torch.zeros(64, dtype=torch.uint8)
    opcheck(OPS.decode.default, (wide, cache, table, seq_lens, SCALE, workspace),
            dict(num_splits=2, tokens_per_split=16, smem_limits=[100_000, 200_000], tile_loads="cp.async"))
    out, lse = OPS.decode(q, cache, table, seq_lens, SCALE, None)
    ref_out, ref_lse = mla_kv.decode(q, cache, table, seq_lens, SCALE)
    assert same_bytes(out, ref_out) and same_bytes(lse, ref_lse)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


def test_opcheck_sparse_attention():
    gen = torch.Generator().manual_seed(8)
    q, cache = torch.randn(3, 4, 576, generator=gen), torch.randn(5, 16, 576, generator=gen)
    idx = torch.randint(-1, 80, (3, 20), generator=gen, dtype=torch.int32)
    lens = torch.tensor([20, 0, 7], dtype=torch.int32)
    opcheck(OPS.sparse_attention.default, (q, cache, idx, SCALE, None, None))
    opcheck(OPS.sparse_attention.default, (q, cache, idx, SCALE, lens, None))
    out, lse = OPS.sparse_attention(q, cache, idx, SCALE, lens, None)
    ref_out, ref_lse = mla_kv.sparse_attention(q, cache, idx, SCALE, topk_lens=lens)
    assert same_bytes(out, ref_out) and same_bytes(lse, ref_lse)
    layer = lambda q, cache, idx: mla_kv.sparse_attention(q, cache, idx, SCALE)  # noqa: E731
    want, _, got, _ = eager_and_compiled(layer, "aot_eager", (q, cache, idx))
    assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1])


def test_opcheck_index_topk():
    gen = torch.Generator().manual_seed(13)
    logits = torch.randint(-3, 3, (4, 40), generator=gen).float()  # many ties
    lens, cu = torch.tensor([40, 9], dtype=torch.int32), torch.tensor([0, 3, 4], dtype=torch.int32)
    table = torch.tensor([[4, 1, 0], [2, 3, 5]], dtype=torch.int32)
    opcheck(OPS.index_topk.default, (logits, lens, 8, cu, None, None))
    opcheck(OPS.index_topk.default, (logits, lens, 8, cu, table, None), dict(page_size=16))
    opcheck(OPS.index_topk.default, (logits[:2], lens, 50, None, None, None))
    got = OPS.index_topk(logits, lens, 8, cu, table, None, page_size=16)
    assert torch.equal(got, mla_kv.index_topk(logits, lens, 8, cu_q_lens=cu, block_table=table, page_size=16))
    layer = lambda x: mla_kv.index_topk(x, lens, 8, cu_q_lens=cu)  # noqa: E731
    want, _, got, _ = eager_and_compiled(layer, "aot_eager", (logits,))
    assert torch.equal(got, want)


def test_opcheck_index_scores():
    gen = torch.Generator().manual_seed(12)
    cache = torch.randint(0, 126, (4, 8, 132), generator=gen, dtype=torch.uint8)
    cache.view(4, -1)[:, 8 * 128:] = torch.full((4, 8), 0.01).view(torch.uint8)
    q, w = torch.randn(3, 16, 128, generator=gen), torch.randn(3, 16, generator=gen)
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    lens, cu = torch.tensor([9, 16], dtype=torch.int32), torch.tensor([0, 1, 3], dtype=torch.int32)
    opcheck(OPS.index_scores.default, (q, w, cache, table, lens, 16, cu, None), dict(max_q_len=2))
    opcheck(OPS.index_scores.default, (q[:2], w[:2], cache, table, lens, 16, None, None))
    got = OPS.index_scores(q, w, cache, table, lens, 16, cu, None, max_q_len=2)
    assert same_bytes(got, mla_kv.index_scores(q, w, cache, table, lens, 16, cu_q_lens=cu, max_q_len=2))
    layer = lambda q, w: mla_kv.index_scores(q, w, cache, table, lens, 16, cu_q_lens=cu, max_q_len=2)  # noqa: E731
    want, _, compiled, _ = eager_and_compiled(layer, "aot_eager", (q, w))
    assert same_bytes(compiled, want)


@pytest.mark.parametrize("causal", [True, False])
def test_opcheck_prefill(causal):
    q, cache, table, kv_lens = attention_inputs(torch.float32)
    q = q.reshape(-1, *q.shape[2:])[:5]  # 5 packed tokens
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)  # ends at T: no rows left unspecified
    opcheck(OPS.prefill.default, (q, cache, table, cu, kv_lens, SCALE, None), dict(causal=causal))
    out, lse = OPS.prefill(q, cache, table, cu, kv_lens, SCALE, None, causal=causal)
    ref_out, ref_lse = mla_kv.prefill(q, cache, table, cu, kv_lens, SCALE, causal=causal)
    assert same_bytes(out, ref_out) and same_bytes(lse, ref_lse)


def expanded_inputs(dtype, d_nope=16, d_v=24, heads=3):
    """attention_inputs' cache and table with 5 packed tokens of q [T, H, d_nope + 64] and the kv_b_proj halves."""
    _, cache, table, kv_lens = attention_inputs(dtype)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(5, heads, d_nope + 64, generator=gen).to(dtype)
    w_uk = (torch.randn(heads, d_nope, 512, generator=gen) / 8).to(dtype)
    w_uv = (torch.randn(heads, d_v, 512, generator=gen) / 8).to(dtype)
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    return q, cache, table, cu, kv_lens.clamp(min=3), w_uk, w_uv


@pytest.mark.parametrize("kv_chunk", [4, 8192])
def test_opcheck_prefill_expanded(kv_chunk):
    q, cache, table, cu, kv_lens, w_uk, w_uv = expanded_inputs(torch.float32)
    kwargs = dict(max_q_len=3, max_kv_len=33, kv_chunk=kv_chunk)
    opcheck(OPS.prefill_expanded.default, (q, cache, table, cu, kv_lens, w_uk, w_uv, SCALE, None), kwargs)
    out, lse = OPS.prefill_expanded(q, cache, table, cu, kv_lens, w_uk, w_uv, SCALE, None, **kwargs)
    ref_out, ref_lse = mla_kv.prefill_expanded(q, cache, table, cu, kv_lens, w_uk, w_uv, SCALE, **kwargs)
    assert out.shape == (5, 3, 24) and same_bytes(out, ref_out) and same_bytes(lse, ref_lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_opcheck_merge_states(dtype):
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out_a, out_b = torch.randn(2, 7, 3, 512).to(dtype)
    lse_a, lse_b = torch.randn(2, 7, 3, dtype=lse_dtype)
    lse_a[0, 0] = lse_b[1] = float("-inf")  # sides that saw nothing
    opcheck(OPS.merge_states.default, (out_a, lse_a, out_b, lse_b))


@pytest.mark.parametrize("causal", [True, False])
def test_opcheck_expanded_attention(causal):
    gen = torch.Generator().manual_seed(11)
    q, k = torch.randn(6, 2, 80, generator=gen), torch.randn(9, 2, 80, generator=gen)
    v = torch.randn(9, 2, 40, generator=gen)
    cu_q, cu_k = torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    kwargs = dict(max_q_len=4, causal=causal)
    opcheck(OPS.expanded_attention.default, (q, k, v, cu_q, cu_k, SCALE), kwargs)
    out, lse = OPS.expanded_attention(q, k, v, cu_q, cu_k, SCALE, smem_limits=[100_000, 200_000], **kwargs)
    ref_out, ref_lse = mla_kv.expanded_attention(q, k, v, cu_q, cu_k, SCALE, **kwargs)
    assert out.shape == (6, 2, 40) and same_bytes(out, ref_out) and same_bytes(lse, ref_lse)


@pytest.mark.parametrize("with_starts", [False, True])
def test_opcheck_gather_kv(with_starts):
    _, cache, table, _ = attention_inputs(torch.bfloat16)
    cu = torch.tensor([0, 4, 4, 20], dtype=torch.int32)
    starts = torch.tensor([1, 0, 13], dtype=torch.int32) if with_starts else None
    out = torch.full((23, 576), 7.0, dtype=torch.bfloat16)  # 3 rows past cu[-1], left untouched
    opcheck(OPS.gather_kv.default, (cache, table, cu, out, starts))
    OPS.gather_kv(cache, table, cu, out, starts)
    assert torch.equal(out[:20], reference.gather_kv(cache, table, cu, starts=starts))
    assert (out[20:] == 7).all()


# ------------------------------------------------------------------------------- fakes
def test_fakes_give_the_output_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(3, 2, 16, 576, dtype=torch.bfloat16)
        cache = torch.empty(10, 64, 576, dtype=torch.bfloat16)
        table, lens = torch.empty(3, 4, dtype=torch.int32), torch.empty(3, dtype=torch.int32)
        out, lse = OPS.decode(q, cache, table, lens, SCALE, None)
        assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((3, 2, 16, 512), torch.bfloat16, (3, 2, 16),
                                                              torch.float32)
        packed = torch.empty(9, 16, 576, dtype=torch.float64)
        cu = torch.empty(4, dtype=torch.int32)
        out, lse = OPS.prefill(packed, cache.double(), table, cu, lens, SCALE, None)
        assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((9, 16, 512), torch.float64, (9, 16), torch.float64)
        ptrs = torch.empty(12, dtype=torch.int64)
        out, lse = OPS.decode_blocks(q, ptrs, cu, 64, 0, lens, SCALE, None)
        assert out.shape == (3, 2, 16, 512) and lse.shape == (3, 2, 16)
        out, lse = OPS.prefill_blocks(packed, ptrs, cu, 64, 0, cu, lens, SCALE, None)
        assert out.shape == (9, 16, 512) and lse.dtype == torch.float64
        out, lse = OPS.merge_states(out, lse, out, lse)
        assert out.shape == (9, 16, 512) and lse.shape == (9, 16)
        q_exp = torch.empty(9, 16, 192, dtype=torch.bfloat16)
        w_uk, w_uv = torch.empty(16, 128, 512, dtype=torch.bfloat16), torch.empty(16, 256, 512, dtype=torch.bfloat16)
        out, lse = OPS.prefill_expanded(q_exp, cache, table, cu, lens, w_uk, w_uv, SCALE, None, max_q_len=4,
                                        max_kv_len=64)
        assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((9, 16, 256), torch.bfloat16, (9, 16), torch.float32)
        assert OPS.gather_kv(cache, table, cu, torch.empty(5, 576, dtype=torch.bfloat16)) is None


def test_fakes_check_q():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        cache, lens = torch.empty(10, 64, 576), torch.empty(3, dtype=torch.int32)
        with pytest.raises(ValueError, match="q: expected 4 dims"):
            OPS.decode(torch.empty(3, 16, 576), cache, torch.empty(3, 4, dtype=torch.int32), lens, SCALE, None)
        with pytest.raises(ValueError, match="q: dim 2 must be 576"):
            OPS.prefill(torch.empty(3, 16, 512), cache, torch.empty(3, 4, dtype=torch.int32), lens, lens, SCALE, None)


# ------------------------------------------------------------------ flattened arguments
def test_block_pointer_helpers_flatten_the_cache():
    pool = BlockPool(6, 3, 16, torch.bfloat16, rope_first=False)
    cache = pool.cache(2, torch.tensor([4, 1, 0]), torch.tensor([0, 1, 3]))
    ptrs, cu, size, offset = block_pointer_args(cache)
    assert ptrs is cache.block_ptrs and cu is cache.cu_block_nums
    assert (size, offset) == (16, pool.layer_offset_bytes(2))
    assert block_pointer_kwargs(cache) == dict(dtype=torch.bfloat16, rope_first=False, row_stride_bytes=1152,
                                               kv_format=None, kv_scale=None)
    rebuilt = library._cache(torch.empty(0, dtype=torch.bfloat16), "q", *block_pointer_args(cache),
                             **block_pointer_kwargs(cache))
    assert rebuilt == cache
    # dtype None: the inputs' dtype; row_stride_bytes None: the row's of the format (None: unquantized)
    default = library._cache(torch.empty(0, dtype=torch.float16), "q", ptrs, cu, 16, 0, None, True, None, None, None)
    assert (default.dtype, default.row_stride_bytes, default.rope_first) == (torch.float16, 1152, True)


@pytest.mark.skipif(not mla_kv.kernels_available(), reason="the workspace size comes from the compiled module")
def test_schedule_kwargs_flatten_the_schedule():
    q = torch.empty(3, 2, 16, 576, dtype=torch.float16)
    for limits in (None, SmemLimits(101_376, 167_936, 1024)):
        schedule = mla_kv.AttentionSchedule(4, 128, 0, None, limits, "cp.async")
        kwargs = schedule_kwargs(schedule)
        rebuilt = library._schedule(q, 4, **kwargs)
        assert (rebuilt.num_splits, rebuilt.tokens_per_split) == (4, 128)
        assert (rebuilt.smem_limits, rebuilt.tile_loads) == (limits, "cp.async")
        # a reference-only install sizes no workspace (the reference takes none)
        compiled = mla_kv.ops._C
        assert rebuilt.workspace_bytes == (0 if compiled is None else compiled.attention_workspace_size(6, 16, 4))
    assert library._schedule(q, 4, None, None, None, "auto") is None  # the op's default schedule


def test_schedule_arguments_come_whole():
    q, cache, table, lens = attention_inputs(torch.float32)
    with pytest.raises(ValueError, match="num_splits / tokens_per_split: pass both"):
        OPS.decode(q, cache, table, lens, SCALE, None, num_splits=2)
    with pytest.raises(ValueError, match="smem_limits / tile_loads: belong to a schedule"):
        OPS.decode(q, cache, table, lens, SCALE, None, tile_loads="cp.async")
    with pytest.raises(ValueError, match=r"smem_limits: expected a GPU class name.* got \(1,\)"):
        OPS.decode(q, cache, table, lens, SCALE, None, num_splits=1, tokens_per_split=64, smem_limits=[1])


def test_op_errors_are_the_functions():
    q, cache, table, lens = attention_inputs(torch.float32)
    with pytest.raises(ValueError, match="softmax_scale: must be > 0"):
        OPS.decode(q, cache, table, lens, -1.0, None)
    kv_a, _, _, _, cache, slots, _ = write_inputs(torch.float32)
    slots[0] = cache.shape[0] * cache.shape[1]
    with pytest.raises(ValueError, match="slot_mapping: slot"):
        OPS.write_kv(kv_a[:, :512], kv_a[:, 512:], cache, slots, validate=True)
    with pytest.raises(TypeError, match="cache: dtype torch.float16 differs from the inputs' torch.float32"):
        OPS.decode_blocks(q, torch.zeros(3, dtype=torch.int64), torch.zeros(4, dtype=torch.int32), 16, 0, lens,
                          SCALE, None, dtype=torch.float16)


# ------------------------------------------------------------------------ compiled layers
class DecodeLayer(torch.nn.Module):
    """Projections, the fused write (which rotates q's rope part in place), decode and o_proj."""

    def __init__(self, hidden=64, heads=4, dtype=torch.float32):
        super().__init__()
        self.heads = heads
        self.kv_a_proj = torch.nn.Linear(hidden, 576, bias=False, dtype=dtype)
        self.q_proj = torch.nn.Linear(hidden, heads * 576, bias=False, dtype=dtype)  # absorbed: [q_lat | q_pe]
        self.o_proj = torch.nn.Linear(heads * 512, hidden, bias=False, dtype=dtype)
        self.kv_norm = torch.nn.Parameter(torch.rand(512, dtype=dtype) + 0.5)
        self.register_buffer("cos_sin", cos_sin_cache(64, 256, 10000.0))
        self.requires_grad_(False)

    def forward(self, x, positions, kv_cache, slots, block_table, seq_lens):
        tokens = x.shape[0]
        kv_a = self.kv_a_proj(x)
        q = self.q_proj(x).view(tokens, self.heads, 576)
        OPS.fused_write_kv(kv_a, self.kv_norm, EPS, positions, self.cos_sin, kv_cache, slots, q)
        out, lse = OPS.decode(q.unsqueeze(1), kv_cache, block_table, seq_lens, SCALE, None)
        return self.o_proj(out.reshape(tokens, -1)), out, lse, q


def decode_step_inputs(lens=(5, 17, 30, 1), block_size=16, hidden=64):
    need = [-(-n // block_size) for n in lens]
    num_blocks = len(lens) * max(need) + 3
    table = torch.randperm(num_blocks)[:len(lens) * max(need)].view(len(lens), -1).int()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    positions = (seq_lens - 1).long()
    cache = torch.randn(num_blocks, block_size, 576)
    return (torch.randn(len(lens), hidden), positions, cache, paged_slots(table, positions, block_size), table,
            seq_lens)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_decode_layer_matches_eager(backend):
    inputs = decode_step_inputs()
    want, eager_inputs, got, compiled_inputs = eager_and_compiled(DecodeLayer(), backend, inputs)
    for name, g, w in zip(("y", "out", "lse", "q"), got, want):
        assert same_bytes(g, w), f"{backend}: {name} differs from eager"
    assert same_bytes(compiled_inputs[2], eager_inputs[2]), f"{backend}: the cache differs from eager"
    assert not torch.equal(compiled_inputs[2], inputs[2]), "the step wrote nothing"


@pytest.mark.skipif(not HAVE_CXX, reason="inductor needs a C++ compiler")
def test_inductor_writes_the_cache_in_place(monkeypatch):
    """Inductor reinplaces the functionalized write: the kernel (here the reference) gets the caller's
    cache itself, not a copy to be copied back."""
    seen = []
    original = mla_kv.ops.write.fused_write_kv

    def record(*args, **kwargs):
        seen.append(args[5].data_ptr())
        return original(*args, **kwargs)

    monkeypatch.setattr(mla_kv.ops.write, "fused_write_kv", record)
    layer, inputs = DecodeLayer(), decode_step_inputs()
    torch._dynamo.reset()
    torch.compile(layer, backend="inductor", fullgraph=True)(*inputs)
    assert seen == [inputs[2].data_ptr()]


class PrefillLayer(torch.nn.Module):
    """Chunked prefill: write the new rows (RMSNorm in torch), attention over the whole kv (causal)
    and, apart, over the cached context (non-causal) merged with attention over the gathered new
    rows (computed in torch, float32): the merge must equal the whole."""

    def __init__(self, hidden=64, heads=4, dtype=torch.float32):
        super().__init__()
        self.heads = heads
        self.kv_a_proj = torch.nn.Linear(hidden, 576, bias=False, dtype=dtype)
        self.q_proj = torch.nn.Linear(hidden, heads * 576, bias=False, dtype=dtype)
        self.kv_norm = torch.nn.Parameter(torch.rand(512, dtype=dtype) + 0.5)
        self.requires_grad_(False)

    def forward(self, x, kv_cache, slots, block_table, cu_q_lens, kv_lens, context_lens, new_mask):
        tokens = x.shape[0]
        kv_a = self.kv_a_proj(x)
        kv_c = reference.rms_norm(kv_a[:, :512], self.kv_norm, EPS)
        OPS.write_kv(kv_c, kv_a[:, 512:], kv_cache, slots)
        q = self.q_proj(x).view(tokens, self.heads, 576)
        whole = OPS.prefill(q, kv_cache, block_table, cu_q_lens, kv_lens, SCALE, None)
        context = OPS.prefill(q, kv_cache, block_table, cu_q_lens, context_lens, SCALE, None, causal=False)
        rows = kv_cache.new_empty(tokens, 576)
        OPS.gather_kv(kv_cache, block_table, cu_q_lens, rows, context_lens)
        scores = torch.einsum("thd,sd->ths", q.float(), rows.float()) * SCALE
        scores = scores.masked_fill(~new_mask[:, None, :], float("-inf"))
        lse_new = torch.logsumexp(scores, dim=-1)
        out_new = torch.einsum("ths,sd->thd", torch.softmax(scores, dim=-1), rows[:, :512].float())
        merged = OPS.merge_states(*context, out_new.to(q.dtype), lse_new)
        return whole, merged, rows, q


def prefill_step_inputs(context=(7, 0, 20), new=(3, 2, 4), block_size=16, hidden=64):
    kv = [c + n for c, n in zip(context, new)]
    table, cu, seq, positions, slots, num_blocks = packed_batch(context, new, block_size)
    new_mask = (seq[:, None] == seq[None, :]) & (positions[None, :] <= positions[:, None])
    return (torch.randn(len(seq), hidden), torch.randn(num_blocks, block_size, 576), slots, table, cu,
            torch.tensor(kv, dtype=torch.int32), torch.tensor(context, dtype=torch.int32), new_mask)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_prefill_layer_matches_eager(backend):
    (whole, merged, rows, _), eager_inputs, (c_whole, c_merged, c_rows, _), compiled_inputs = eager_and_compiled(
        PrefillLayer(), backend, prefill_step_inputs())
    # inductor fuses the torch-side RMSNorm and softmax, which may round differently: the rows it writes
    # and everything computed from them then agree with eager to float32 rounding, not bit for bit
    same = same_bytes if backend != "inductor" else (
        lambda g, w: torch.allclose(g, w, rtol=1e-5, atol=1e-5, equal_nan=True))
    for name, g, w in (("cache", compiled_inputs[1], eager_inputs[1]), ("gathered rows", c_rows, rows),
                       ("whole out", c_whole[0], whole[0]), ("whole lse", c_whole[1], whole[1]),
                       ("merged out", c_merged[0], merged[0]), ("merged lse", c_merged[1], merged[1])):
        assert same(g, w), f"{backend}: {name} differs from eager"
    torch.testing.assert_close(merged[0], whole[0], rtol=1e-4, atol=1e-5)  # the composition is right
    torch.testing.assert_close(merged[1], whole[1], rtol=1e-5, atol=1e-5)


def test_compiled_with_dynamic_shapes():
    """The fakes work with symbolic sizes: one dynamic graph serves two batch sizes."""
    layer = DecodeLayer()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)
    for lens in [(5, 17, 30, 1), (9, 20)]:
        inputs = decode_step_inputs(lens)
        eager_inputs = clones(inputs)
        for g, w in zip(compiled(*inputs), layer(*eager_inputs)):
            assert same_bytes(g, w)
        assert same_bytes(inputs[2], eager_inputs[2])
    assert_no_graph_breaks()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_block_pointer_ops_trace_into_one_graph_and_need_cuda():
    """From a BlockPointerCache through the helpers, a write + decode + gather over block pointers is one
    graph in which the reads take the block_ptrs the write returns (so they stay after it); on CPU tensors
    the ops then raise at run time, as the functions do."""
    from torch._dynamo.backends.common import aot_autograd
    pool = BlockPool(4, 2, 16, torch.float32)
    cache = pool.cache(1, torch.tensor([2, 0, 3]), torch.tensor([0, 1, 3]))
    q, kv_a = torch.randn(2, 1, 4, 576), torch.randn(2, 576)
    cu, hist, lens = (torch.tensor(v, dtype=torch.int32) for v in ([0, 1, 2], [3, 20], [4, 21]))
    out = torch.empty(25, 576)
    weight, positions, cos_sin = torch.ones(512), hist.long(), cos_sin_cache(64, 64, 10000.0)
    graphs = []

    def step(q, kv_a, cache):
        args, kwargs = block_pointer_args(cache), block_pointer_kwargs(cache)
        OPS.fused_write_kv_blocks(kv_a, weight, EPS, positions, cos_sin, *args, cu, hist, q.squeeze(1), **kwargs)
        attention = OPS.decode_blocks(q, *args, lens, SCALE, None, **kwargs)
        OPS.gather_kv_blocks(*args, torch.tensor([0, 4, 25], dtype=torch.int32), out, **kwargs)
        return attention

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=lambda gm, example: graphs.append(gm) or gm)
    with pytest.raises(ValueError, match="block-pointer ops run on CUDA tensors only"):
        torch.compile(step, backend=backend, fullgraph=True)(q, kv_a, cache)
    assert len(graphs) == 1
    # functionalized: each op runs through auto_functionalized(_v2), whose first argument is the op
    calls = {str(n.args[0]).split(".")[1]: n for n in graphs[0].graph.nodes
             if n.op == "call_function" and "auto_functionalized" in str(n.target)}
    assert set(calls) == {"fused_write_kv_blocks", "decode_blocks", "gather_kv_blocks"}, calls
    for read in ("decode_blocks", "gather_kv_blocks"):
        source = calls[read].kwargs["block_ptrs"]
        assert source.target is operator.getitem and source.args[0] is calls["fused_write_kv_blocks"], read
    for op, args in ((OPS.write_kv_blocks, (kv_a[:, :512], kv_a[:, 512:], *block_pointer_args(cache), cu, hist)),
                     (OPS.prefill_blocks, (q.squeeze(1), *block_pointer_args(cache), cu, lens, SCALE, None))):
        with pytest.raises(ValueError, match="CUDA tensors only"):
            op(*args, **block_pointer_kwargs(cache))


# ===================================================================================== GPU
def gpu_decode_case(dtype, lens=(5, 70, 200, 1), heads=16, block_size=64):
    """A paged cache holding every sequence's history (rows past it NaN), and one new token per
    sequence at position len - 1 (whose row random_cache filled, and the write replaces)."""
    cache, table, seq_lens = random_cache(list(lens), block_size, dtype)
    positions = (seq_lens - 1).long()
    slots = paged_slots(table, positions, block_size)
    kv_a = torch.randn(len(lens), 576, device="cuda").to(dtype)
    q = torch.randn(len(lens), heads, 576, device="cuda").to(dtype)
    weight = (torch.rand(512, device="cuda") + 0.5).to(dtype)
    cos_sin = cos_sin_cache(64, 4096, 10000.0).cuda()
    return cache, table, seq_lens, positions, slots, kv_a, q, weight, cos_sin


def paged_step(kv_a, q_in, weight, positions, cos_sin, cache, slots, table, seq_lens, workspace=None, schedule=None):
    """Fused write + decode on the paged cache; q_in is copied first (the write rotates q in place)."""
    q = q_in.clone()
    OPS.fused_write_kv(kv_a, weight, EPS, positions, cos_sin, cache, slots, q)
    out, lse = OPS.decode(q.unsqueeze(1), cache, table, seq_lens, SCALE, workspace, **(schedule or {}))
    return out, lse, q


def blocks_step(kv_a, q_in, weight, positions, cos_sin, cache, cu_q, seq_lens, workspace=None, schedule=None):
    """paged_step over a BlockPointerCache (history = position)."""
    q = q_in.clone()
    args, kwargs = block_pointer_args(cache), block_pointer_kwargs(cache)
    OPS.fused_write_kv_blocks(kv_a, weight, EPS, positions, cos_sin, *args, cu_q, positions.int(), q, **kwargs)
    out, lse = OPS.decode_blocks(q.unsqueeze(1), *args, seq_lens, SCALE, workspace, **kwargs, **(schedule or {}))
    return out, lse, q


def latent_first_layer(pool, layer=1):
    view = pool.layer_view(layer)
    return to_latent_first(view) if pool.rope_first else view


@GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_opcheck_paged_ops(dtype):
    cache, table, seq_lens, positions, slots, kv_a, q, weight, cos_sin = gpu_decode_case(dtype)
    opcheck(OPS.write_kv.default, (kv_a[:, :512], kv_a[:, 512:], cache, slots))
    opcheck(OPS.fused_write_kv.default, (kv_a, weight, EPS, positions, cos_sin, cache, slots, q[:, :, 384:]))
    q4 = q.unsqueeze(1)
    opcheck(OPS.decode.default, (q4, cache, table, seq_lens, SCALE, None))
    schedule = mla_kv.attention_schedule(q4.shape[0], 1, q4.shape[2], table.shape[1] * cache.shape[1])
    workspace = torch.empty(max(schedule.workspace_bytes, 16), dtype=torch.uint8, device="cuda")
    opcheck(OPS.decode.default, (q4, cache, table, seq_lens, SCALE, workspace), schedule_kwargs(schedule))
    cu = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32, device="cuda")
    opcheck(OPS.prefill.default, (q, cache, table, cu, seq_lens, SCALE, None))
    out, lse = OPS.decode(q4, cache, table, seq_lens, SCALE, None)
    opcheck(OPS.merge_states.default, (out, lse, out.flip(0), lse.flip(0)))
    gather_cu = torch.cat([seq_lens.new_zeros(1), seq_lens.cumsum(0).int()])
    rows = torch.zeros(int(gather_cu[-1]) + 3, 576, dtype=dtype, device="cuda")
    opcheck(OPS.gather_kv.default, (cache, table, gather_cu, rows))
    idx = paged_slots(table, seq_lens - 1, cache.shape[1]).int()[:, None].repeat(1, 3)
    idx[:, 1] = -1
    opcheck(OPS.sparse_attention.default, (q, cache, idx, SCALE, None, None))


@GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_opcheck_prefill_expanded(dtype):
    args = [t.cuda() for t in expanded_inputs(dtype)]
    kwargs = dict(max_q_len=3, max_kv_len=33, kv_chunk=8)
    opcheck(OPS.prefill_expanded.default, (*args[:7], SCALE, None), kwargs)
    out, lse = OPS.prefill_expanded(*args[:7], SCALE, None, **kwargs)
    ref_out, ref_lse = mla_kv.prefill_expanded(*args[:7], SCALE, **kwargs)
    assert same_bytes(out, ref_out) and same_bytes(lse, ref_lse)


@GPU
@pytest.mark.parametrize("rope_first", [True, False])
def test_gpu_opcheck_block_pointer_ops(rope_first):
    dtype = torch.bfloat16
    cache, table, seq_lens, positions, slots, kv_a, q, weight, cos_sin = gpu_decode_case(dtype)
    pool, blocks = block_pointer_copy(cache, table, seq_lens.tolist(), rope_first=rope_first)
    args, kwargs = block_pointer_args(blocks), block_pointer_kwargs(blocks)
    cu = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device="cuda")
    hist = positions.int()
    opcheck(OPS.write_kv_blocks.default, (kv_a[:, :512], kv_a[:, 512:], *args, cu, hist), kwargs)
    opcheck(OPS.fused_write_kv_blocks.default, (kv_a, weight, EPS, positions, cos_sin, *args, cu, hist, q), kwargs)
    readonly = (hist // 2).contiguous()
    opcheck(OPS.write_kv_blocks.default, (kv_a[:, :512], kv_a[:, 512:], *args, cu, hist, readonly),
            dict(kwargs, cp_size=2, cp_rank=1))
    opcheck(OPS.fused_write_kv_blocks.default, (kv_a, weight, EPS, positions, cos_sin, *args, cu, hist, q, readonly),
            dict(kwargs, cp_size=3, cp_rank=2))
    opcheck(OPS.decode_blocks.default, (q.unsqueeze(1), *args, seq_lens, SCALE, None), kwargs)
    opcheck(OPS.prefill_blocks.default, (q, *args, cu, seq_lens, SCALE, None), dict(kwargs, causal=False))
    gather_cu = torch.cat([seq_lens.new_zeros(1), seq_lens.cumsum(0).int()])
    rows = torch.zeros(int(gather_cu[-1]), 576, dtype=dtype, device="cuda")
    opcheck(OPS.gather_kv_blocks.default, (*args, gather_cu, rows), kwargs)
    pos = torch.stack([seq_lens - 1, seq_lens * 0 - 1, seq_lens // 2]).T.int().contiguous()
    opcheck(OPS.sparse_attention_blocks.default, (q, *args, pos, cu, SCALE, None, None), kwargs)
    # the ops are the functions
    out, lse = OPS.decode_blocks(q.unsqueeze(1), *args, seq_lens, SCALE, None, **kwargs)
    ref = reference.decode(q.unsqueeze(1).double(), latent_first_layer(pool).double(), table, seq_lens, SCALE)
    check_attention(out, lse, *ref, f"decode_blocks rope_first={rope_first}")
    OPS.gather_kv_blocks(*args, gather_cu, rows, **kwargs)
    assert same_bytes(rows, reference.gather_kv(latent_first_layer(pool), table, gather_cu))


@GPU
@pytest.mark.parametrize("addressing", ["paged", "blocks"])
@pytest.mark.parametrize("forced_splits", [False, True])
def test_gpu_compiled_decode_step_matches_eager(addressing, forced_splits):
    dtype = torch.bfloat16
    cache, table, seq_lens, positions, slots, kv_a, q, weight, cos_sin = gpu_decode_case(dtype)
    heads, lens = q.shape[1], seq_lens.tolist()
    schedule = workspace = None
    if forced_splits:
        plan = mla_kv.AttentionSchedule(4, 128, mla_kv.ops._C.attention_workspace_size(len(lens), heads, 4))
        schedule = schedule_kwargs(plan)
        workspace = torch.empty(plan.workspace_bytes, dtype=torch.uint8, device="cuda")
    if addressing == "paged":
        eager_cache, compiled_cache = cache.clone(), cache.clone()
        step, tail = paged_step, lambda c: (c, slots, table, seq_lens)
        pools = (None, None)
    else:
        (eager_pool, eager_cache), (pool, compiled_cache) = (block_pointer_copy(cache, table, lens) for _ in range(2))
        cu_q = torch.arange(len(lens) + 1, dtype=torch.int32, device="cuda")
        step, tail = blocks_step, lambda c: (c, cu_q, seq_lens)
        pools = (eager_pool, pool)
    head = (kv_a, q, weight, positions, cos_sin)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    got = compiled(*head, *tail(compiled_cache), workspace, schedule)
    want = step(*head, *tail(eager_cache), workspace, schedule)
    assert_no_graph_breaks()
    for name, g, w in zip(("out", "lse", "rotated q"), got, want):
        assert same_bytes(g, w), f"{addressing}: compiled {name} differs from eager"
    if addressing == "paged":
        assert same_bytes(compiled_cache, eager_cache)
        ref_cache = compiled_cache
    else:
        assert same_bytes(pools[1].storage, pools[0].storage)
        ref_cache = latent_first_layer(pools[1])
    ref = reference.decode(got[2].unsqueeze(1).double(), ref_cache.double(), table, seq_lens, SCALE)
    check_attention(got[0], got[1], *ref, f"compiled {addressing}")


@GPU
def test_gpu_compiled_prefill_layer_matches_eager():
    """On CUDA inductor fuses the torch-side RMSNorm and softmax: compiled and eager agree to rounding,
    and each matches the float64 reference."""
    dtype = torch.float16
    layer = PrefillLayer(dtype=dtype).cuda()
    inputs = prefill_step_inputs(context=(70, 16, 200), new=(30, 9, 64), block_size=64)
    inputs = tuple(t.cuda().to(dtype) if t.is_floating_point() else t.cuda() for t in inputs)
    want, eager_inputs, got, compiled_inputs = eager_and_compiled(layer, "inductor", inputs)
    results = {"eager": (want, eager_inputs[1]), "compiled": (got, compiled_inputs[1])}
    cu, kv_lens, table = inputs[4], inputs[5], inputs[3]
    for name, ((whole, merged, rows, q), cache) in results.items():
        ref = reference.prefill(q.double(), cache.double(), table, cu, kv_lens, SCALE)
        check_attention(*whole, *ref, f"{name} prefill", cu_q_lens=cu)
        check_attention(*merged, *ref, f"{name} merged", cu_q_lens=cu, out_tol=1e-2)
        assert same_bytes(rows, reference.gather_kv(cache, table, cu, starts=inputs[6]))
    torch.testing.assert_close(results["compiled"][1], results["eager"][1], rtol=2e-3, atol=2e-3)


@GPU
@pytest.mark.parametrize("addressing", ["paged", "blocks"])
@pytest.mark.parametrize("given_workspace", [False, True])
def test_gpu_compiled_step_in_cuda_graph(addressing, given_workspace):
    """A compiled write + decode step captured in a CUDA graph; replayed one token later with new
    inputs in the same buffers, it gives what eager gives on the same cache."""
    dtype = torch.float16
    cache, table, seq_lens, positions, slots, kv_a, q, weight, cos_sin = gpu_decode_case(dtype, lens=(5, 70, 200))
    heads, lens = q.shape[1], seq_lens.tolist()
    schedule, workspace = None, None
    if given_workspace:
        plan = mla_kv.attention_schedule(len(lens), 1, heads, table.shape[1] * cache.shape[1])
        schedule = schedule_kwargs(plan)
        workspace = torch.empty(max(plan.workspace_bytes, 16), dtype=torch.uint8, device="cuda")
    if addressing == "paged":
        step, tail, state = paged_step, (cache, slots, table, seq_lens), (lambda: cache)
    else:
        pool, blocks = block_pointer_copy(cache, table, [n + 1 for n in lens])  # blocks for the next token too
        cu_q = torch.arange(len(lens) + 1, dtype=torch.int32, device="cuda")
        step, tail, state = blocks_step, (blocks, cu_q, seq_lens), (lambda: pool.storage)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    results = {}

    def run():
        results["out"] = compiled(kv_a, q, weight, positions, cos_sin, *tail, workspace, schedule)

    graph = capture_graph(run)  # compiles in the warm-up run, then captures
    assert_no_graph_breaks()
    # One token later: new rows and queries, positions and lengths + 1, in the captured buffers.
    kv_a.copy_(torch.randn_like(kv_a))
    q.copy_(torch.randn_like(q))
    positions.add_(1)
    seq_lens.add_(1)
    slots.copy_(paged_slots(table, positions, cache.shape[1]))
    before = state().clone()
    graph.replay()
    torch.cuda.synchronize()
    replayed, got = state().clone(), tuple(t.clone() for t in results["out"])
    state().copy_(before)
    want = step(kv_a, q, weight, positions, cos_sin, *tail, workspace, schedule)  # eager, same cache
    torch.cuda.synchronize()
    assert same_bytes(replayed, state()), f"{addressing}: the replay wrote other cache bytes than eager"
    for name, g, w in zip(("out", "lse", "rotated q"), got, want):
        assert same_bytes(g, w), f"{addressing}: replayed {name} differs from eager"
    ref_cache = cache if addressing == "paged" else latent_first_layer(pool)
    ref = reference.decode(got[2].unsqueeze(1).double(), ref_cache.double(), table, seq_lens, SCALE)
    check_attention(got[0], got[1], *ref, f"graph replay {addressing}")
