"""The split-KV workspace an attention op allocates for itself lives until its kernels have run.

With torch's caching allocator a buffer freed before the launch is still mapped and the bug stays
hidden, so the direct check runs in a child process with the allocator off
(PYTORCH_NO_CUDA_MEMORY_CACHING=1: every free is a cudaFree, and a kernel writing into a freed
workspace faults or corrupts the result). scripts/sanitize repeats the calls under memcheck. Inside
graph capture the op's workspace comes from the graph's private pool; the capture test below has
later allocations of the same size that would take the block if it were handed back too early.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import mla_kv
from gpu_checks import capture_graph
from mla_kv import reference

pytestmark = pytest.mark.gpu

_CHILD = textwrap.dedent("""
    import torch, mla_kv
    from mla_kv import reference
    torch.manual_seed(0)
    dev, H = "cuda", 16
    cache = (torch.randn(40, 64, 576, device=dev) * 0.5).half()
    table = torch.randperm(40, device=dev).int()[:36].view(2, 18)
    lens = torch.tensor([1100, 700], dtype=torch.int32, device=dev)
    archs = [None, "sm80", "sm75", "sm70"]
    # four splits of the 18 blocks' positions, so the partials go through the workspace
    split4 = lambda tokens: mla_kv.AttentionSchedule(4, 18 * 64 // 4, mla_kv.ops._C.attention_workspace_size(tokens, H, 4))
    worst = 0.0
    for arch in archs:
        plan = split4(2)
        q = torch.randn(2, 1, H, 576, device=dev).half()
        # no workspace given: the op allocates it
        out, lse = mla_kv.decode(q, cache, table, lens, 0.07, schedule=plan, arch=arch)
        torch.cuda.synchronize()
        ref, _ = reference.decode(q.double(), cache.double(), table, lens, 0.07)
        worst = max(worst, ((out.double() - ref).norm() / ref.norm()).item())
        cu = torch.tensor([0, 5, 9], dtype=torch.int32, device=dev)
        qp = torch.randn(9, H, 576, device=dev).half()
        pplan = split4(9)
        out, lse = mla_kv.prefill(qp, cache, table, cu, lens, 0.07, schedule=pplan, arch=arch)
        torch.cuda.synchronize()
        ref, _ = reference.prefill(qp.double(), cache.double(), table, cu, lens, 0.07)
        worst = max(worst, ((out.double() - ref).norm() / ref.norm()).item())
    print("worst", worst)
    assert worst < 3e-3, worst
""")


def test_op_allocated_workspace_outlives_kernels_without_caching_allocator():
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    run = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"child failed:\n{run.stdout}\n{run.stderr[-4000:]}"


def test_op_allocated_workspace_in_graph_capture():
    gen = torch.Generator(device="cuda").manual_seed(11)
    heads = 16
    cache = (torch.randn(40, 64, 576, generator=gen, device="cuda") * 0.5).half()
    table = torch.randperm(40, generator=gen, device="cuda").int()[:36].view(2, 18)
    lens = torch.tensor([1100, 700], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 1, heads, 576, generator=gen, device="cuda").half()
    plan = mla_kv.attention_schedule(2, 1, heads, 18 * 64)
    assert plan.num_splits > 1
    out = torch.empty(2, 1, heads, 512, dtype=torch.half, device="cuda")
    lse = torch.empty(2, 1, heads, device="cuda")

    def step():
        mla_kv.decode(q, cache, table, lens, 0.07, out=out, lse=lse, schedule=plan)
        # same-size allocations right after the op: they would take its workspace's block if the
        # op had released it before its kernels were queued, and scribble over the partials
        junk = torch.full((plan.workspace_bytes // 4,), float("nan"), device="cuda")
        junk.add_(1.0)

    graph = capture_graph(step)
    q.copy_(torch.randn(q.shape, generator=gen, device="cuda").half())
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref, ref_lse = reference.decode(q.double(), cache.double(), table, lens, 0.07)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 3e-3, f"graph replay with an op-allocated workspace: relative error {err:.2e}"
    assert (lse.double() - ref_lse).abs().max().item() < 1e-3
