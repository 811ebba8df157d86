"""The public functions (mla_kv.write_kv, mla_kv.decode, ...) under torch.compile(fullgraph=True).

While Dynamo traces one of them, the call goes to its torch.ops.mla_kv form (ops._common.traceable); the
op's real implementation is the function, so arguments are still checked before anything runs, now at
run time of the compiled graph. CPU tests run the reference; the CUDA variants need a GPU and the kernels.
Also here: ``arch`` is checked on every device, so a typo fails on the CPU as it would on a GPU.
"""
import pytest
import torch

import mla_kv
from mla_kv.layout import BlockPool
from mla_kv.ops._common import TRACED
from mla_kv.rope import cos_sin_cache

from gpu_checks import packed_batch, same_bytes

GPU = pytest.mark.gpu
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
SCALE = 0.1
EPS = 1e-6
BACKENDS = ["eager", "aot_eager"]
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]


def compiled(fn, backend):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return torch.compile(fn, backend=backend, fullgraph=True)


def clones(values):
    return tuple(v.clone() if isinstance(v, torch.Tensor) else v for v in values)


def dtype_for(device):
    return torch.float16 if device == "cuda" else torch.float32


def decode_inputs(device, lens=(5, 17, 30, 1), block_size=16, heads=4):
    dtype = dtype_for(device)
    need = [-(-n // block_size) for n in lens]
    num_blocks = len(lens) * max(need) + 3
    table = torch.randperm(num_blocks)[:len(lens) * max(need)].view(len(lens), -1).int()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    positions = (seq_lens - 1).long()
    b = torch.arange(len(lens))
    slots = table[b, positions // block_size].long() * block_size + positions % block_size
    values = (torch.randn(len(lens), 512), torch.randn(len(lens), 64), torch.randn(num_blocks, block_size, 576),
              slots, torch.randn(len(lens), 1, heads, 576), table, seq_lens)
    return tuple(v.to(device, dtype) if v.is_floating_point() else v.to(device) for v in values)


def write_then_decode(kv_c, k_pe, kv_cache, slots, q, table, seq_lens):
    mla_kv.write_kv(kv_c, k_pe, kv_cache, slots)
    out, lse = mla_kv.decode(q, kv_cache, table, seq_lens, SCALE)
    return out * 2, lse


def test_every_public_op_has_a_traced_form():
    assert set(TRACED) >= {"write_kv", "fused_write_kv", "write_kv_blocks", "fused_write_kv_blocks", "decode",
                           "prefill", "prefill_expanded", "merge_states", "expanded_attention", "gather_kv"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_write_and_decode_match_eager(device, backend):
    inputs = decode_inputs(device)
    eager_inputs, compiled_inputs = clones(inputs), clones(inputs)
    want = write_then_decode(*eager_inputs)
    got = compiled(write_then_decode, backend)(*compiled_inputs)
    assert not torch._dynamo.utils.counters["graph_break"]
    for name, g, w in zip(("out", "lse"), got, want):
        assert same_bytes(g, w), f"{name} differs from eager"
    assert same_bytes(compiled_inputs[2], eager_inputs[2]), "the cache differs from eager"
    assert not torch.equal(compiled_inputs[2], inputs[2]), "the write wrote nothing"


def test_compiled_write_and_decode_with_inductor():
    pytest.importorskip("torch._inductor")
    import shutil
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        pytest.skip("inductor needs a C++ compiler")
    inputs = decode_inputs("cpu")
    eager_inputs, compiled_inputs = clones(inputs), clones(inputs)
    want = write_then_decode(*eager_inputs)
    got = compiled(write_then_decode, "inductor")(*compiled_inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert same_bytes(compiled_inputs[2], eager_inputs[2])


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_fused_write_decode_with_out_and_lse(device):
    """The fused write rotates q in place; decode fills the given out / lse and returns them."""
    dtype = dtype_for(device)
    kv_c, k_pe, cache, slots, q, table, seq_lens = decode_inputs(device)
    kv_a = torch.randn(kv_c.shape[0], 576, device=device, dtype=dtype)
    weight = torch.rand(512, device=device, dtype=dtype) + 0.5
    cos_sin = cos_sin_cache(64, 64, 10000.0).to(device)
    positions = (seq_lens - 1).long()

    def step(kv_a, cache, q, out, lse):
        mla_kv.fused_write_kv(kv_a, weight, EPS, positions, cos_sin, cache, slots, q=q[:, 0])
        result = mla_kv.decode(q, cache, table, seq_lens, SCALE, out=out, lse=lse)
        return result[0] + 0, result[1] + 0

    def fresh():
        return (kv_a, cache.clone(), q.clone(), torch.full((*q.shape[:-1], 512), float("nan"), device=device,
                                                           dtype=dtype),
                torch.full(q.shape[:-1], float("nan"), device=device))

    eager, comp = fresh(), fresh()
    want = step(*eager)
    got = compiled(step, "aot_eager")(*comp)
    for name, g, w in (("out", got[0], want[0]), ("lse", got[1], want[1]), ("given out", comp[3], eager[3]),
                       ("given lse", comp[4], eager[4]), ("q", comp[2], eager[2]), ("cache", comp[1], eager[1])):
        assert same_bytes(g, w), f"{name} differs from eager"
    assert not torch.isnan(comp[3]).any()


def prefill_inputs(device, context=(7, 0, 20), new=(3, 2, 4), block_size=16, heads=4):
    dtype = dtype_for(device)
    kv = [c + n for c, n in zip(context, new)]
    table, cu, seq, _, slots, num_blocks = packed_batch(context, new, block_size)
    tokens = len(seq)
    values = dict(kv_c=torch.randn(tokens, 512), k_pe=torch.randn(tokens, 64),
                  cache=torch.randn(num_blocks, block_size, 576), slots=slots, q=torch.randn(tokens, heads, 576),
                  table=table, cu=cu, kv_lens=torch.tensor(kv, dtype=torch.int32),
                  context_lens=torch.tensor(context, dtype=torch.int32))
    return {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in values.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_prefill_gather_merge_match_eager(device, backend):
    """write_kv, prefill (whole and context-only), gather_kv into a given out, merge_states: one graph."""
    x = prefill_inputs(device)

    def step(cache, rows):
        mla_kv.write_kv(x["kv_c"], x["k_pe"], cache, x["slots"])
        whole = mla_kv.prefill(x["q"], cache, x["table"], x["cu"], x["kv_lens"], SCALE)
        context = mla_kv.prefill(x["q"], cache, x["table"], x["cu"], x["context_lens"], SCALE, causal=False)
        gathered = mla_kv.gather_kv(cache, x["table"], x["cu"], starts=x["context_lens"], out=rows)
        merged = mla_kv.merge_states(*context, *whole)
        return whole, merged, gathered + 0

    def fresh():
        return x["cache"].clone(), torch.zeros(x["q"].shape[0], 576, device=device, dtype=x["cache"].dtype)

    eager, comp = fresh(), fresh()
    want = step(*eager)
    got = compiled(step, backend)(*comp)
    assert not torch._dynamo.utils.counters["graph_break"]
    flat_want = (*want[0], *want[1], want[2], *eager)
    flat_got = (*got[0], *got[1], got[2], *comp)
    for i, (g, w) in enumerate(zip(flat_got, flat_want)):
        assert same_bytes(g, w), f"result {i} differs from eager"


def test_compiled_gather_without_out_says_why():
    x = prefill_inputs("cpu")

    def step(cache):
        return mla_kv.gather_kv(cache, x["table"], x["cu"])

    with pytest.raises(Exception, match="out: required under torch.compile"):
        compiled(step, "eager")(x["cache"])


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_expanded_attention_matches_eager(device):
    dtype = torch.float16 if device == "cuda" else torch.float32
    heads, d_qk, d_v, q_lens, k_lens = 2, 192, 128, (3, 5), (7, 5)
    q = torch.randn(sum(q_lens), heads, d_qk, device=device, dtype=dtype)
    k = torch.randn(sum(k_lens), heads, d_qk, device=device, dtype=dtype)
    v = torch.randn(sum(k_lens), heads, d_v, device=device, dtype=dtype)
    cu_q = torch.tensor([0, *q_lens], device=device).cumsum(0).int()
    cu_k = torch.tensor([0, *k_lens], device=device).cumsum(0).int()

    def step(q, k, v):
        out, lse = mla_kv.expanded_attention(q, k, v, cu_q, cu_k, SCALE, max_q_len=max(q_lens))
        return out * 1, lse

    want = step(q, k, v)
    got = compiled(step, "aot_eager")(q, k, v)
    for g, w in zip(got, want):
        assert same_bytes(g, w)


def test_compiled_prefill_expanded_matches_eager():
    heads, d_nope, d_v, block_size = 2, 32, 32, 16
    lens = (9, 20)
    q_lens = (3, 20)
    table = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32)  # 9 and 20 rows: 1 and 2 blocks of 16
    cache = torch.randn(4, block_size, 576)
    q = torch.randn(sum(q_lens), heads, d_nope + 64)
    w_uk, w_uv = torch.randn(heads, d_nope, 512) * 0.05, torch.randn(heads, d_v, 512) * 0.05
    cu = torch.tensor([0, *q_lens]).cumsum(0).int()
    kv_lens = torch.tensor(lens, dtype=torch.int32)

    def step(q, cache):
        out, lse = mla_kv.prefill_expanded(q, cache, table, cu, kv_lens, w_uk, w_uv, SCALE, max_q_len=20,
                                           max_kv_len=20)
        return out + 0, lse

    want = step(q, cache)
    got = compiled(step, "aot_eager")(q, cache)
    for g, w in zip(got, want):
        assert same_bytes(g, w)


def test_compiled_function_still_checks_its_arguments():
    """A wrong argument raises the function's own error, naming it, when the compiled graph runs."""
    inputs = list(decode_inputs("cpu"))
    inputs[6] = inputs[6].long()  # seq_lens: int32 expected
    with pytest.raises(TypeError, match="seq_lens: expected dtype torch.int32"):
        compiled(write_then_decode, "aot_eager")(*inputs)


def test_compiled_block_pointer_write_traces_and_needs_cuda():
    """write_kv_blocks with a BlockPointerCache traces into its op; on CPU tensors the op raises as the
    function does."""
    pool = BlockPool(4, 2, 16, torch.float32)
    cache = pool.cache(1, torch.tensor([2, 0, 3]), torch.tensor([0, 1, 3]))
    cu, hist = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([3, 20], dtype=torch.int32)

    def step(kv_c, k_pe):
        mla_kv.write_kv_blocks(kv_c, k_pe, cache, cu, hist)

    with pytest.raises(ValueError, match="block-pointer ops run on CUDA tensors only"):
        compiled(step, "aot_eager")(torch.randn(2, 512), torch.randn(2, 64))


@pytest.mark.parametrize("device", DEVICES)
def test_eager_calls_check_before_writing(device):
    """Outside torch.compile the function runs as written: a bad argument raises before the cache is touched."""
    kv_c, k_pe, cache, slots, *_ = decode_inputs(device)
    before = cache.clone()
    with pytest.raises(ValueError, match="arch"):
        mla_kv.write_kv(kv_c, k_pe, cache, slots, arch="banana")
    assert same_bytes(cache, before)


# ------------------------------------------------------------------------------------- arch
BAD_ARCHS = [("banana", ValueError), ("sm60", ValueError), ("SM70", ValueError), (70, TypeError),
             ("", ValueError)]


def arch_calls():
    """name -> a call of that public function on small valid CPU tensors, taking ``arch``."""
    kv_c, k_pe, cache, slots, q, table, seq_lens = decode_inputs("cpu")
    x = prefill_inputs("cpu")
    rows = torch.zeros(x["q"].shape[0], 576)
    q3, k3, v3 = torch.randn(4, 2, 192), torch.randn(4, 2, 192), torch.randn(4, 2, 128)
    cu2 = torch.tensor([0, 4], dtype=torch.int32)
    w_uk, w_uv = torch.randn(4, 32, 512), torch.randn(4, 32, 512)
    kv_a, weight, cos_sin = torch.randn(4, 576), torch.ones(512), cos_sin_cache(64, 64, 10000.0)
    return {
        "write_kv": lambda arch: mla_kv.write_kv(kv_c, k_pe, cache.clone(), slots, arch=arch),
        "fused_write_kv": lambda arch: mla_kv.fused_write_kv(kv_a, weight, EPS, (seq_lens - 1).long(), cos_sin,
                                                             cache.clone(), slots, arch=arch),
        "decode": lambda arch: mla_kv.decode(q, cache, table, seq_lens, SCALE, arch=arch),
        "prefill": lambda arch: mla_kv.prefill(x["q"], x["cache"], x["table"], x["cu"], x["kv_lens"], SCALE,
                                               arch=arch),
        "gather_kv": lambda arch: mla_kv.gather_kv(x["cache"], x["table"], x["cu"], out=rows, arch=arch),
        "expanded_attention": lambda arch: mla_kv.expanded_attention(q3, k3, v3, cu2, cu2, SCALE, max_q_len=4,
                                                                     arch=arch),
        "prefill_expanded": lambda arch: mla_kv.prefill_expanded(
            torch.randn(x["q"].shape[0], 4, 96), x["cache"], x["table"], x["cu"], x["kv_lens"], w_uk, w_uv,
            SCALE, max_q_len=4, max_kv_len=24, arch=arch),
        "attention_schedule": lambda arch: mla_kv.attention_schedule(4, 1, 4, 30, arch=arch),
    }


CALLS = ["write_kv", "fused_write_kv", "decode", "prefill", "gather_kv", "expanded_attention", "prefill_expanded",
         "attention_schedule"]


@pytest.mark.parametrize("name", [n for n in CALLS if n != "attention_schedule"])  # a schedule needs CUDA
def test_valid_calls_run_on_the_cpu(name):
    arch_calls()[name](None)


@pytest.mark.parametrize("name", CALLS)
@pytest.mark.parametrize("arch,error", BAD_ARCHS, ids=[repr(a) for a, _ in BAD_ARCHS])
def test_bad_arch_raises_on_the_cpu(name, arch, error):
    with pytest.raises(error, match=r"^arch: .*" + ("int" if error is TypeError else repr(arch))):
        arch_calls()[name](arch)


@pytest.mark.parametrize("name", ["write_kv", "decode", "prefill", "gather_kv"])
def test_known_arch_tags_pass_on_the_cpu(name):
    for arch in ("sm70", "sm75", "sm80", "sm90"):
        arch_calls()[name](arch)


def test_arch_error_lists_the_tags():
    with pytest.raises(ValueError) as e:
        arch_calls()["decode"]("SM70")
    for tag in ("'sm70'", "'sm75'", "'sm80'", "'sm90'"):
        assert tag in str(e.value)

