"""Shared benchmark helpers: CUDA-event timing of graph replays, and the ceilings measured in the
same run (device copy bandwidth, tensor-core throughput) that every table is reported against."""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from typing import Callable, List

import torch

import mla_kv
from mla_kv.timing import time_graph  # noqa: F401  (re-exported for the bench scripts)


def time_eager(fn: Callable[[int], None], variants: int, calls: int = 10, samples: int = 21,
               warmup: int = 3) -> float:
    """Like time_graph for code that cannot be captured (torch-native peers with host syncs)."""
    for i in range(warmup):
        fn(i % variants)
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(i % variants)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def parser(doc: str) -> argparse.ArgumentParser:
    """The options every benchmark takes: --quick (a small grid) and --json FILE."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small grid")
    ap.add_argument("--json", default="", help="also write the rows and ceilings to FILE")
    return ap


def kernels_present(name: str) -> bool:
    """False, after saying why on stderr, when there is no GPU or the kernels were not built."""
    if torch.cuda.is_available() and mla_kv.kernels_available():
        return True
    print(f"{name}: needs a CUDA GPU and the compiled kernels", file=sys.stderr)
    return False


def variants_for(bytes_per_set: int, l2_bytes: int = 60 << 20, cap: int = 64) -> int:
    """Input sets to rotate among so that their total is several times the L2 (not cache-resident)."""
    return max(2, min(cap, math.ceil(4 * l2_bytes / max(bytes_per_set, 1))))


def decode_buffers(batch: int, heads: int, max_kv: int, dtype: torch.dtype, gen: torch.Generator, arch=None,
                   smem_limits=None):
    """Random q [B, 1, H, 576] and what a graph-captured decode needs besides the cache: the
    schedule for max_kv positions (under smem_limits: a GPU class's tiles), its workspace, and the
    out / lse tensors."""
    q = torch.randn(batch, 1, heads, 576, device="cuda", dtype=dtype, generator=gen)
    schedule = mla_kv.attention_schedule(batch, 1, heads, max_kv, arch=arch, smem_limits=smem_limits)
    workspace = torch.empty(max(schedule.workspace_bytes, 16), dtype=torch.uint8, device="cuda")
    out = torch.empty(batch, 1, heads, 512, device="cuda", dtype=dtype)
    lse = torch.empty(batch, 1, heads, device="cuda")
    return q, schedule, workspace, out, lse


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = time_eager(lambda i: dst.copy_(src), 1, calls=5)
    return 2 * nbytes / t


def print_table(rows: List[dict], columns: List[str], out=sys.stdout) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print(" | ".join(c.rjust(w) for c, w in zip(columns, widths)), file=out)
    print("-|-".join("-" * w for w in widths), file=out)
    for r in rows:
        print(" | ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths)), file=out)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.3g}"
    return str(v)


def write_json(path: str, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=1)


def device_info() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "sm_count": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}", "torch": torch.__version__}


def mma_ceiling(dtype: torch.dtype, arch=None) -> float:
    """FLOP/s of the tensor-core instruction the attention kernel of ``arch`` (default: the GPU's
    best) uses: mma.sync m16n8k16 (sm80) or wgmma m64n256k16 (sm90)."""
    from mla_kv import ops

    c = ops._C
    tag = ops._kernel_arch(torch.device("cuda", torch.cuda.current_device()), dtype, arch)
    blocks = 4 * torch.cuda.get_device_properties(0).multi_processor_count
    stream = torch.cuda.current_stream().cuda_stream
    ctype = ops._c_dtype(dtype)
    c.mma_throughput(tag, ctype, blocks, 100, stream)  # warm-up
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        flops = c.mma_throughput(tag, ctype, blocks, 20000, stream)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return flops / statistics.median(times)
