"""Benchmark of index_topk (the indexer's top-2048 per query token) with torch.topk side by side.

Decode rows (one token per sequence, each seeing all L positions) of T in {1, 8, 64} at L 32K and 128K,
k 2048, logits rotated over sets several times the L2 so they come from device memory. Bandwidth counts
the logits read once (T x L x 4 bytes); "% copy" puts that against the device copy bandwidth measured in
the same run (bytes read plus bytes written of a device-to-device copy). The issue's target: top-k of
2,048 over 128 K logits in at most a quarter of the index-score time of the same tokens.
--archs: the kernel variants (one kernel for every tag; default the GPU's own).
Usage: mla-kv bench index_topk [--quick] [--json FILE] [--archs sm90,sm70]
(or python bench/bench_index_topk.py ... in a source tree)
"""
from __future__ import annotations

import sys

import torch

import mla_kv
from mla_kv.bench import common
from mla_kv.bench.sparse import comma_list

K = 2048
ARCHS = ("auto", "sm70", "sm75", "sm80", "sm90")


def run_case(tokens, columns, arch, gen):
    nbytes = tokens * columns * 4
    variants = common.variants_for(nbytes)
    logits = [torch.randn(tokens, columns, device="cuda", generator=gen) for _ in range(variants)]
    lens = torch.full((tokens,), columns, dtype=torch.int32, device="cuda")
    outs = [torch.empty(tokens, K, dtype=torch.int32, device="cuda") for _ in range(variants)]
    workspace = torch.zeros(mla_kv.index_topk_workspace_size(tokens, columns, K), dtype=torch.uint8, device="cuda")
    tag = None if arch == "auto" else arch
    sec = common.time_graph(lambda i: mla_kv.index_topk(logits[i], lens, K, out=outs[i], workspace=workspace,
                                                        arch=tag), variants)
    values = [torch.empty(tokens, K, device="cuda") for _ in range(variants)]
    picked = [torch.empty(tokens, K, dtype=torch.int64, device="cuda") for _ in range(variants)]
    native = common.time_graph(lambda i: torch.topk(logits[i], K, dim=1, out=(values[i], picked[i])), variants)
    return {"arch": arch, "T": tokens, "L": columns, "k": K, "us": sec * 1e6, "GB/s": nbytes / sec / 1e9,
            "torch_us": native * 1e6, "torch_GB/s": nbytes / native / 1e9, "x torch": native / sec}


def main(argv=None, prog=None):
    ap = common.parser(__doc__, prog, plot=False)
    ap.add_argument("--archs", default=["auto"], type=comma_list(ARCHS), metavar="A,...",
                    help=f"kernel variants to time, from {', '.join(ARCHS)} (default auto: the GPU's own)")
    args = common.parse(ap, argv, prog or "bench_index_topk")
    if args is None:
        return 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    token_counts = [1, 64] if args.quick else [1, 8, 64]
    column_counts = [131072] if args.quick else [32768, 131072]
    copy_bw = common.copy_bandwidth()
    rows = []
    for arch in args.archs:
        for columns in column_counts:
            for tokens in token_counts:
                r = run_case(tokens, columns, arch, gen)
                r["% copy"] = 100 * r["GB/s"] * 1e9 / copy_bw
                rows.append(r)
                torch.cuda.empty_cache()
    print(f"device copy bandwidth (read+write): {copy_bw / 1e9:,.0f} GB/s")
    common.print_table(rows, ["arch", "T", "L", "k", "us", "GB/s", "% copy", "torch_us", "torch_GB/s", "x torch"])
    common.write_json(args.json, {"device": common.device_info(), "copy_GBps": copy_bw / 1e9, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
