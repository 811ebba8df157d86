"""Benchmark of gather_kv (paged tensor and block pointers) against the device copy bandwidth measured
in the same run, with the torch-native gather (index_select of the block table's pages) side by side.

Bytes moved: every gathered row is read once and written once, 2 x 576 x element size per row (the
block table and cu_kv_lens are not counted). Sequences of up to 4,096 rows in shuffled 64-row pages;
the block-pointer cache has rope-first rows, so its gather also reorders each row to latent first.
Target: >= 85% of the copy bandwidth from 64K rows up.
Usage: mla-kv bench gather [--quick] [--json FILE] [--plot FILE]
(or python bench/bench_gather.py ... in a source tree)
"""
from __future__ import annotations

import sys

import torch


import mla_kv
from mla_kv.bench import common
from mla_kv.layout import BlockPointerCache

PAGE = 64
SEQ_ROWS = 4096
TARGET_PERCENT, TARGET_MIN_ROWS = 85.0, 65536


def run_case(rows, dtype, layout, gen):
    batch = max(1, rows // SEQ_ROWS)
    seq_rows = rows // batch
    blocks_per_seq = seq_rows // PAGE
    num_blocks = batch * blocks_per_seq
    es = torch.empty((), dtype=dtype).element_size()
    nbytes = 2 * rows * 576 * es
    # Caches and outputs rotate over sets several times the L2, so neither side is cache-resident.
    variants = common.variants_for(nbytes)
    caches = [torch.randn(num_blocks, PAGE, 576, device="cuda", dtype=dtype, generator=gen) for _ in range(variants)]
    outs = [torch.empty(rows, 576, device="cuda", dtype=dtype) for _ in range(variants)]
    table = torch.randperm(num_blocks, device="cuda", generator=gen).int().view(batch, blocks_per_seq)
    cu = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * seq_rows
    native = None
    if layout == "blocks":
        storage = caches  # the pointers below do not keep their tensors alive
        caches = [BlockPointerCache(
            block_ptrs=c.data_ptr() + table.view(-1).long() * c.stride(0) * c.element_size(),
            cu_block_nums=torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * blocks_per_seq,
            block_seq_len=PAGE, layer_offset_bytes=0, dtype=dtype, rope_first=True) for c in storage]
        sec = common.time_graph(lambda i: mla_kv.gather_kv(caches[i], None, cu, out=outs[i]), variants)
        del storage
    else:
        sec = common.time_graph(lambda i: mla_kv.gather_kv(caches[i], table, cu, out=outs[i]), variants)
        # What an engine does without the op: whole pages through the block table, into the same out.
        pages = table.view(-1).long()
        native = common.time_graph(
            lambda i: torch.index_select(caches[i], 0, pages, out=outs[i].view(num_blocks, PAGE, 576)), variants)
    return {"layout": layout, "dtype": str(dtype).split(".")[1], "rows": rows, "B": batch, "us": sec * 1e6,
            "GB/s": nbytes / sec / 1e9, "native_us": native * 1e6 if native else None,
            "native_GB/s": nbytes / native / 1e9 if native else None}


def main(argv=None, prog=None):
    args = common.parse(common.parser(__doc__, prog), argv, prog or "bench_gather")
    if args is None:
        return 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    row_counts = [4096, 65536, 1 << 20] if args.quick else [4096, 65536, 262144, 1 << 20]
    dtypes = [torch.float16] if args.quick else [torch.float16, torch.bfloat16]
    copy_bw = common.copy_bandwidth()
    rows = []
    for dtype in dtypes:
        for layout in ("paged", "blocks"):
            for n in row_counts:
                r = run_case(n, dtype, layout, gen)
                r["% copy"] = 100 * r["GB/s"] * 1e9 / copy_bw
                r["native % copy"] = 100 * r["native_GB/s"] * 1e9 / copy_bw if r["native_GB/s"] else None
                rows.append(r)
                torch.cuda.empty_cache()
    print(f"device copy bandwidth (read+write): {copy_bw / 1e9:,.0f} GB/s")
    common.print_table(rows, ["layout", "dtype", "rows", "B", "us", "GB/s", "% copy", "native_us", "native_GB/s",
                              "native % copy"])
    judged = [r for r in rows if r["rows"] >= TARGET_MIN_ROWS]
    worst = min(judged, key=lambda r: r["% copy"])
    print(f"target >= {TARGET_PERCENT:.0f}% of copy bandwidth from {TARGET_MIN_ROWS} rows: "
          f"{'met' if worst['% copy'] >= TARGET_PERCENT else 'MISSED'} (lowest {worst['% copy']:.1f}%: "
          f"{worst['layout']} {worst['dtype']} {worst['rows']} rows)")
    common.write_json(args.json, {"device": common.device_info(), "copy_GBps": copy_bw / 1e9, "rows": rows})
    common.write_plot(args.plot, f"gather_kv on {common.device_info()['gpu']}", rows, ["layout", "dtype", "rows"],
                      ["% copy", "native % copy"], f"device copy bandwidth {copy_bw / 1e9:,.0f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
