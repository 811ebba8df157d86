"""Shared benchmark helpers: CUDA-event timing of graph replays, the ceilings measured in the same
run (device copy bandwidth, tensor-core throughput) that every table is reported against, and the
table, JSON and plot output."""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from typing import Callable, List, Optional

import torch

import mla_kv
from mla_kv import _plot
from mla_kv.timing import time_graph  # noqa: F401  (re-exported for the benchmarks)


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


def parser(doc: str, prog: Optional[str] = None, plot: bool = True) -> argparse.ArgumentParser:
    """The options every benchmark takes: --quick (a small grid), --json FILE and (where the rows have
    a ceiling to plot against) --plot FILE."""
    ap = argparse.ArgumentParser(prog=prog, description=" ".join(doc.split("\n\n")[0].split()))
    ap.add_argument("--quick", action="store_true", help="a small grid")
    ap.add_argument("--json", default="", help="also write the rows and ceilings to FILE")
    if plot:
        ap.add_argument("--plot", default="", metavar="FILE",
                        help="also plot the rows against the ceiling to FILE (.png added without an "
                             "extension; needs matplotlib: pip install mla_kv[plot])")
    return ap


def kernels_present(name: str) -> bool:
    """False, after saying why on stderr, when there is no GPU or the kernels were not built."""
    if torch.cuda.is_available() and mla_kv.kernels_available():
        return True
    print(f"{name}: needs a CUDA GPU and the compiled kernels", file=sys.stderr)
    return False


def parse(ap: argparse.ArgumentParser, argv: Optional[List[str]], name: str) -> Optional[argparse.Namespace]:
    """ap.parse_args(argv), or None after one line on stderr saying why the benchmark ``name`` cannot
    run: --plot cannot be written (checked before anything is measured), no GPU or no kernels."""
    args = ap.parse_args(argv)
    trouble = _plot.problem(args.plot) if getattr(args, "plot", "") else None
    if trouble:
        print(f"{name}: {trouble}", file=sys.stderr)
        return None
    return args if kernels_present(name) else None


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


def print_table(rows: List[dict], columns: List[str], out=None) -> None:
    out = out or sys.stdout  # looked up at the call, so that a redirected stdout gets the table
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


def write_plot(path: str, title: str, rows: List[dict], labels: List[str], percents: List[str],
               ceiling: str) -> str:
    """Each row's ``percents`` columns (its share of the ceilings measured in the run) as horizontal
    bars against the 100% line; ``labels``: the columns that name a row, ``ceiling``: what 100% is.
    Saves to _plot.written_path(path) and prints and returns that path; does nothing without one."""
    if not path:
        return ""
    from matplotlib.figure import Figure

    out = _plot.written_path(path)
    width = 0.8 / len(percents)
    fig = Figure(figsize=(11, 1.8 + len(rows) * (0.15 + 0.1 * len(percents))))
    ax = fig.subplots()
    for k, column in enumerate(percents):
        offset = (k - (len(percents) - 1) / 2) * width
        values = [math.nan if r.get(column) is None else r[column] for r in rows]
        ax.barh([i + offset for i in range(len(rows))], values, height=width, label=column)
    ax.axvline(100, color="black", linestyle="--", label="100%")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([" ".join(r[c] if isinstance(r[c], str) else f"{c}={r[c]}" for c in labels)
                        for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, max([105.0] + [1.05 * r[c] for r in rows for c in percents if r.get(c) is not None]))
    ax.set_xlabel("% of the ceiling measured in the same run")
    ax.set_title(f"{title}\n100% = {ceiling}", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot written to {out}")
    return out


def device_info() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "sm_count": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}", "torch": torch.__version__}


def tflops_text(ceilings: dict) -> str:
    """The ceilings of mma_ceiling, {torch dtype: FLOP/s}, as 'float16 1,000 TFLOP/s, bfloat16 ...'."""
    return ", ".join(f"{str(d).split('.')[1]} {v / 1e12:,.0f} TFLOP/s" for d, v in ceilings.items())


def kernel_arch(dtype: torch.dtype, arch: Optional[str] = None):
    """The _C.Arch of the attention kernel that runs ``dtype`` on the current GPU, as the ops pick it:
    ``arch`` (sm70 ... sm90) or the best compiled variant at or below the GPU."""
    from mla_kv._compiled import _C

    major, minor = torch.cuda.get_device_capability()
    tag = _C.resolve_arch(getattr(_C.Arch, arch) if arch else _C.Arch.auto, major * 10 + minor)
    if tag == _C.Arch.auto or (dtype == torch.bfloat16 and int(tag) < 80):
        raise ValueError(f"no {arch or 'kernel'} variant for {dtype} runs on this sm_{major}{minor} GPU in this "
                         f"build (compiled for {_C.compiled_cuda_archs()}; bfloat16 needs sm80)")
    return tag


def mma_ceiling(dtype: torch.dtype, arch=None) -> float:
    """FLOP/s of the tensor-core instruction the attention kernel of ``arch`` (default: the GPU's
    best) uses: mma.sync m16n8k16 (sm80) or wgmma m64n256k16 (sm90)."""
    from mla_kv._compiled import _C as c

    tag = kernel_arch(dtype, arch)
    blocks = 4 * torch.cuda.get_device_properties(0).multi_processor_count
    stream = torch.cuda.current_stream().cuda_stream
    ctype = getattr(c.DType, str(dtype).split(".")[1])
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
