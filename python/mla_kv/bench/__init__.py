"""The kernel benchmarks behind ``mla-kv bench``, one module per op family (CUDA GPU only).

    mla-kv bench [--quick] [--json PATH] [--plot PATH]    every benchmark in turn (cp only with 2+ GPUs)
    mla-kv bench OP [OP's options]                       one of them: mla-kv bench OP --help

Each module's ``main(argv, prog)`` parses its own options and returns the exit status; bench/bench_*.py
in a source tree are thin entry points to them. Shared helpers (timing, ceilings, table, JSON, plot)
are in ``mla_kv.bench.common``.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import textwrap
import traceback
from typing import List, Optional

# op -> what it measures. The modules import torch and the kernels; they are imported when run.
OPS = {
    "write": "write_kv, fused_write_kv vs the copy bandwidth",
    "decode": "decode vs the copy bandwidth and the tensor-core ceiling",
    "gather": "gather_kv vs the copy bandwidth",
    "prefill": "prefill vs the tensor-core ceiling; absorbed vs expanded",
    "expanded": "prefill attention kernels of both routes (absorbed, own expanded, torch) vs their ceilings",
    "cp": "context parallel decode/prefill over NCCL (2+ GPUs)",
    "profile_decode": "decode launches for ncu / torch.profiler (not in the full run)",
    "tile_copy": "the decode kernels' copy path alone: tiles into a shared-memory ring, by copy mechanism (sm_90; not in the full run)",
    "unequal": "decode on batches of unequal lengths: the length-aware plan vs the uniform split, FlashMLA and the copy floor",
    "sparse": "sparse_attention over top-k indices vs dense decode, the copy floor and FlashMLA's sparse decode",
    "indexer": "index_scores vs the copy floor, the mma ceiling and torch; a sparse decode step vs dense decode",
    "index_topk": "index_topk (the indexer's top-2048) vs the copy bandwidth and torch.topk",
}
# What ``mla-kv bench`` without an op runs, in this order.
ALL = ("write", "decode", "gather", "prefill", "expanded", "cp")
# The ops whose rows have a ceiling to plot against (--plot).
PLOTTED = ("write", "decode", "gather", "prefill", "expanded")


class _Parser(argparse.ArgumentParser):
    """Errors as one line ("mla-kv bench: error: ...") with exit code 2, as the rest of mla-kv."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser(prog: str) -> _Parser:
    ops = "\n".join(f"  {name:<15} {what}" for name, what in OPS.items())
    ap = _Parser(prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
                 usage=f"{prog} [--quick] [--json PATH] [--plot PATH]\n       {prog} OP [OP's options]",
                 description=textwrap.fill(
                     "Runs the kernel benchmarks (CUDA GPU only) in this process, each printing its table against "
                     f"the ceilings measured in the same run: all of {', '.join(ALL)} (cp only with 2 or more "
                     "GPUs), or the OP named first.", 80),
                 epilog=f"ops:\n{ops}\n\n{prog} OP --help lists an op's own options (--arch, --gpu, --only, ...).")
    ap.add_argument("--quick", action="store_true", help="a small grid for every benchmark")
    ap.add_argument("--json", default="", metavar="PATH",
                    help="write each benchmark's rows and ceilings to PATH with the op added to the name "
                         "(out.json -> out_write.json, ...)")
    ap.add_argument("--plot", default="", metavar="PATH",
                    help=f"plot the rows of {', '.join(PLOTTED)} against their ceilings, to PATH with the op "
                         "added (out.png -> out_write.png; .png without an extension; needs matplotlib: "
                         "pip install mla_kv[plot])")
    ap.add_argument("op", nargs="?", choices=list(OPS), help=argparse.SUPPRESS)
    return ap


def op_path(path: str, op: str) -> str:
    """``path`` for one op of a full run: the op joined to the file name, before its extension
    (bench.json -> bench_write.json, out -> out_write); '' stays ''."""
    if not path:
        return ""
    stem, ext = os.path.splitext(path)
    return f"{stem}_{op}{ext}"


def run(op: str, argv: List[str], prog: str = "mla-kv bench") -> int:
    """Runs one benchmark in this process -> its exit status."""
    module = importlib.import_module(f"{__name__}.{op}")
    return module.main(argv, prog=f"{prog} {op}")


def main(argv: Optional[List[str]] = None, prog: str = "mla-kv bench") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in OPS:
        return run(argv[0], argv[1:], prog)
    ap = _parser(prog)
    args = ap.parse_args(argv)
    if args.op is not None:  # options before the op: they belong to the op
        ap.error(f"the op comes first: {prog} {args.op} [options]")

    from .. import _plot

    trouble = _plot.problem(args.plot) if args.plot else None
    if trouble:
        print(f"{prog}: {trouble}", file=sys.stderr)
        return 1
    import torch

    from .. import kernels_available

    if not torch.cuda.is_available():
        print(f"{prog}: no CUDA GPU found; the benchmarks time the CUDA kernels and need one", file=sys.stderr)
        return 1
    if not kernels_available():
        print(f"{prog}: this mla_kv install has no CUDA kernels (built without a CUDA compiler)", file=sys.stderr)
        return 1
    ops = [op for op in ALL if op != "cp" or torch.cuda.device_count() >= 2]
    failed = []
    for i, op in enumerate(ops, 1):
        done = "#" * (20 * (i - 1) // len(ops))
        print(f"[{done:<20}] {i}/{len(ops)} {op}", flush=True)
        op_argv = ["--quick"] if args.quick else []
        op_argv += ["--json", op_path(args.json, op)] if args.json else []
        op_argv += ["--plot", op_path(args.plot, op)] if args.plot and op in PLOTTED else []
        try:
            status = run(op, op_argv, prog)
        except Exception:  # noqa: BLE001 - one benchmark's failure must not stop the others
            traceback.print_exc()
            status = 1
        if status != 0:
            failed.append(op)
        torch.cuda.empty_cache()
    print(f"[{'#' * 20}] {len(ops)}/{len(ops)} done", flush=True)
    if "cp" not in ops:
        print(f"cp: not run (it needs 2 or more CUDA GPUs, found {torch.cuda.device_count()}): {prog} cp on a "
              "multi-GPU machine")
    if failed:
        print(f"{prog}: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
