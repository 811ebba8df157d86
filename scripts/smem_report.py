#!/usr/bin/env python3
"""Measures, with Nsight Compute, the shared memory of every attention launch under each GPU class's
limits, and fails if one exceeds the limit of the class it runs for.

For each GPU class (mla_kv.gpus.gpu_classes()) whose variant this GPU can run, a child process makes
decode and prefill calls of several CTA heights with that class's limits imposed
(attention_schedule(smem_limits=CLASS)), under `ncu --metrics launch__shared_mem_per_block_dynamic,...`;
each attention kernel launch's dynamic shared memory is then checked against the class's per-block
limit. Every call's result is checked against the float64 reference as well, so a launch that fits
but computes garbage fails too.

Usage: scripts/smem-report OUT_DIR       writes OUT_DIR/smem.json and OUT_DIR/smem.txt; exit 1 on a
                                          launch over its limit, a wrong result or a class with no launch
       scripts/smem-report --worker CLASS  (the child: makes the calls)
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = "regex:attention_(wgmma_)?kernel"
METRICS = ("launch__shared_mem_per_block_dynamic", "launch__registers_per_thread", "launch__block_size",
           "launch__grid_size", "launch__occupancy_limit_shared_mem")
# (kind, batch lens, q tokens per sequence, heads): 16-, 32- and 64-row CTAs, one split and several.
CALLS = (("decode", [1, 77, 300], 1, 16), ("decode", [513, 64], 1, 20), ("decode", [1000, 3], 2, 20),
         ("decode", [2500], 1, 128), ("prefill", [40, 100], [5, 33], 20))


def worker(name: str) -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from mla_kv import gpus, reference
    from gpu_checks import check_attention, default_schedule, random_cache, run_decode, run_prefill

    g = gpus.gpu_classes()[name]
    torch.manual_seed(0)
    scale = 1 / math.sqrt(192)
    for kind, lens, q_len, heads in CALLS:
        cache, table, kv = random_cache(lens, 32, torch.float16)
        if kind == "decode":
            q = torch.randn(len(lens), q_len, heads, 576, device="cuda").half()
            s = default_schedule(q, cache, table, arch=g.arch, smem_limits=name)
            out, lse = run_decode(q, cache, table, kv, scale, arch=g.arch, schedule=s)
            ref = reference.decode(q.double(), cache.double(), table, kv, scale)
            check_attention(out, lse, *ref, f"{name} decode H={heads} S_q={q_len}")
        else:
            cu = torch.tensor([0] + q_len, device="cuda").cumsum(0).int()
            q = torch.randn(sum(q_len), heads, 576, device="cuda").half()
            s = default_schedule(q, cache, table, packed_batch=len(lens), arch=g.arch, smem_limits=name)
            out, lse = run_prefill(q, cache, table, cu, kv, scale, arch=g.arch, schedule=s)
            ref = reference.prefill(q.double(), cache.double(), table, cu, kv, scale)
            check_attention(out, lse, *ref, f"{name} prefill H={heads}", cu_q_lens=cu)
        print(f"smem-report: {name} {kind} H={heads} tiles={s.tiles}", flush=True)
    torch.cuda.synchronize()
    return 0


def parse_ncu_csv(text: str):
    """[{kernel, metric: value, ...}] per launch from `ncu --csv --print-units base` output."""
    start = text.find('"ID"')
    if start < 0:
        return []
    launches = {}
    for row in csv.DictReader(io.StringIO(text[start:])):
        launch = launches.setdefault(row["ID"], {"kernel": row["Kernel Name"]})
        value = row["Metric Value"].replace(",", "")
        try:
            launch[row["Metric Name"]] = float(value)
        except ValueError:
            launch[row["Metric Name"]] = value
    return list(launches.values())


def check_launches(name: str, per_block: int, launches) -> list:
    """Problems of one class's launches: none measured, or one over the per-block limit."""
    problems = []
    if not launches:
        problems.append(f"{name}: no attention launch was measured")
    for launch in launches:
        used = launch.get("launch__shared_mem_per_block_dynamic")
        if not isinstance(used, float) or used > per_block:
            problems.append(f"{name}: {launch['kernel'][:60]} uses {used} B of shared memory, the limit is {per_block}")
    return problems


def main(argv) -> int:
    if len(argv) == 3 and argv[1] == "--worker":
        return worker(argv[2])
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir = Path(argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    import torch
    from mla_kv import _C, gpus

    cc = torch.cuda.get_device_capability()
    have = _C.device_smem_limits().per_block
    results, problems, lines = {}, [], []
    for name, g in gpus.gpu_classes().items():
        if int(g.arch[2:]) > cc[0] * 10 + cc[1] or g.smem.per_block > have:
            lines.append(f"{name:20s} skipped: its variant or shared memory exceeds this GPU")
            continue
        cmd = [ncu, "--csv", "--print-units", "base", "--kernel-name", KERNELS, "--metrics", ",".join(METRICS),
               sys.executable, str(Path(__file__).resolve()), "--worker", name]
        run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        (out_dir / f"ncu-{g.arch}-{name.split()[0]}.log").write_text(run.stdout + run.stderr)
        launches = parse_ncu_csv(run.stdout)
        if run.returncode != 0:
            problems.append(f"{name}: the worker failed (exit {run.returncode}); see the log")
        problems += check_launches(name, g.smem.per_block, launches)
        used = sorted({int(x["launch__shared_mem_per_block_dynamic"]) for x in launches
                       if isinstance(x.get("launch__shared_mem_per_block_dynamic"), float)})
        regs = sorted({int(x["launch__registers_per_thread"]) for x in launches
                       if isinstance(x.get("launch__registers_per_thread"), float)})
        results[name] = {"arch": g.arch, "limit_per_block": g.smem.per_block, "launches": len(launches),
                         "smem_bytes": used, "registers_per_thread": regs}
        lines.append(f"{name:20s} {g.arch}: {len(launches):3d} launches, shared memory {used} B "
                     f"(limit {g.smem.per_block}), registers {regs}")
    (out_dir / "smem.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "classes": results,
                                                   "problems": problems}, indent=2))
    text = "\n".join(lines + [f"PROBLEM {p}" for p in problems] + [f"smem-report: {'FAILED' if problems else 'ok'}"])
    (out_dir / "smem.txt").write_text(text + "\n")
    print(text)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
