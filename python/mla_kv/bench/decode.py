"""Benchmark of mla_kv.decode (paged tensor and block pointers) against the copy bandwidth and the
mma.sync ceiling measured in the same run, with the torch-native decode side by side.

Cache bytes read: B x ctx x (bytes per token of the cache's format: 576 x 2 for 16-bit rows); FLOPs:
B x H x S_q x ctx x 2176 (2 x 576 for scores plus 2 x 512 for P.V per query-key-head).
--kv-formats F,...: the quantized-cache table instead (the memory-bound cases, bf16 and each format
side by side in one run, "x bf16" = the 16-bit time over the format's).
Usage: mla-kv bench decode [--quick] [--arch A] [--gpu CLASS] [--only bf16-paged] [--kv-formats F,...]
[--json FILE] [--plot FILE] (or python bench/bench_decode.py ... in a source tree)
"""
from __future__ import annotations

import math
import sys

import torch


import mla_kv
from mla_kv import layout as cache_layout
from mla_kv.bench import common
from mla_kv.layout import BlockPointerCache

PAGE = 64


def torch_native_decode(q, cache, table, lens, scale, ctx):
    """Gather pages, then matmul, fp32 softmax, matmul: what an engine without a kernel does."""
    rows = cache[table.long()].view(q.shape[0], -1, 576)[:, :ctx]       # [B, ctx, 576]
    scores = torch.matmul(q[:, 0], rows.transpose(1, 2)).float() * scale   # [B, H, ctx]
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, rows[..., :512])


def quantized_caches(kv_format, count, num_blocks, dtype, gen):
    """Paged caches of kv_format holding random rows, written by the quantizing write."""
    slots = torch.arange(num_blocks * PAGE, device="cuda")
    caches = []
    for _ in range(count):
        cache = torch.empty(cache_layout.paged_cache_shape(kv_format, num_blocks, PAGE, dtype), dtype=torch.uint8,
                            device="cuda")
        kv_c = torch.randn(slots.numel(), 512, device="cuda", dtype=dtype, generator=gen)
        k_pe = torch.randn(slots.numel(), 64, device="cuda", dtype=dtype, generator=gen)
        mla_kv.write_kv(kv_c, k_pe, cache, slots, kv_format=kv_format, kv_scale=0.05 if kv_format == "fp8" else None)
        caches.append(cache)
    return caches


def run_case(batch, ctx, heads, dtype, layout, gen, arch=None, gpu=None, kv_format=None):
    blocks_per_seq = ctx // PAGE
    nbytes = batch * ctx * (576 * 2 if kv_format is None else cache_layout.bytes_per_token(kv_format, dtype))
    variants = common.variants_for(nbytes, cap=8)
    num_blocks = batch * blocks_per_seq
    if kv_format is None:
        caches = [torch.randn(num_blocks, PAGE, 576, device="cuda", dtype=dtype, generator=gen) * 0.5
                  for _ in range(variants)]
    else:
        caches = quantized_caches(kv_format, variants, num_blocks, dtype, gen)
    quantized = {} if kv_format is None else dict(kv_format=kv_format, kv_scale=0.05 if kv_format == "fp8" else None)
    table = torch.randperm(num_blocks, device="cuda", generator=gen).int().view(batch, blocks_per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q, schedule, workspace, out, lse = common.decode_buffers(batch, heads, blocks_per_seq * PAGE, dtype, gen, arch, gpu)
    scale = 1 / math.sqrt(192)
    if layout == "blocks":
        ptr_sets = [BlockPointerCache(
            block_ptrs=(c.data_ptr() + table.view(-1).long() * c.stride(0) * c.element_size()),
            cu_block_nums=torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * blocks_per_seq,
            block_seq_len=PAGE, layer_offset_bytes=0, dtype=dtype, rope_first=False) for c in caches]
        fn = lambda i: mla_kv.decode(q, ptr_sets[i], None, lens, scale, out=out, lse=lse, workspace=workspace,
                                     schedule=schedule, arch=arch)
    else:
        fn = lambda i: mla_kv.decode(q, caches[i], table, lens, scale, out=out, lse=lse, workspace=workspace,
                                     schedule=schedule, arch=arch, **quantized)
    sec = common.time_graph(fn, variants, calls=10, samples=11)
    native = None
    if layout == "paged" and kv_format is None and batch * ctx <= 1 << 20:
        native = common.time_eager(lambda i: torch_native_decode(q, caches[i], table, lens, scale, ctx), variants,
                                   calls=3, samples=5)
    flops = batch * heads * ctx * 2176
    t = schedule.tiles
    return {"arch": arch or "auto", "gpu": gpu or "-", "tiles": f"{t.block_m}x{t.block_n}/{t.stages} {t.smem_bytes // 1024}K",
            "layout": layout, "dtype": str(dtype).split(".")[1], "format": kv_format or "16-bit", "B": batch, "ctx": ctx, "H": heads,
            "splits": schedule.num_splits, "ms": sec * 1e3, "GB/s": nbytes / sec / 1e9,
            "TFLOP/s": flops / sec / 1e12, "native_ms": native * 1e3 if native else None,
            "native_GB/s": nbytes / native / 1e9 if native else None}


def main(argv=None, prog=None):
    ap = common.parser(__doc__, prog)
    ap.add_argument("--arch", default=None, choices=["sm70", "sm75", "sm80", "sm90"],
                    help="force a kernel variant (sm70 on a newer GPU shows the Volta code path's cost)")
    ap.add_argument("--gpu", default=None, choices=sorted(mla_kv.gpus.gpu_classes()),
                    help="plan and launch under this GPU class's shared-memory limits (its tile configuration; "
                         "the variant defaults to the class's)")
    ap.add_argument("--only", default=None, choices=["bf16-paged"],
                    help="full grid restricted to one dtype and layout (the table RESULTS.md shows)")
    ap.add_argument("--kv-formats", default="", metavar="F,...",
                    help="the quantized-cache table: bf16 and these formats (of fp8, fp8_ds_mla, int8, int4) "
                         "at the memory-bound shapes")
    args = common.parse(ap, argv, prog or "bench_decode")
    if args is None:
        return 1
    if args.gpu and args.arch is None:
        args.arch = mla_kv.gpus.gpu_classes()[args.gpu].arch
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = common.copy_bandwidth()
    dtypes = (torch.float16,) if args.arch in ("sm70", "sm75") else (torch.float16, torch.bfloat16)
    ceilings = {d: common.mma_ceiling(d, args.arch) for d in dtypes}
    formats = [f for f in args.kv_formats.split(",") if f]
    for f in formats:
        cache_layout.check_kv_format(f, "--kv-formats")
    if formats:
        d = dtypes[-1]
        shapes = [(64, 4096, 16), (64, 4096, 20), (8, 32768, 20)]
        if args.quick:
            shapes = shapes[1:2]
        grid = [(b, c, h, d, "paged", f) for b, c, h in shapes for f in [None, *formats]]
    elif args.quick:
        d = dtypes[-1]
        grid = [(64, 4096, h, d, "paged") for h in (16, 20, 64, 128)]
        grid += [(1, 32768, 20, d, "paged"), (8, 32768, 20, d, "paged"), (64, 4096, 20, torch.float16, "blocks")]
    else:
        grid = [(b, c, h, d, lay) for d in dtypes for lay in ("paged", "blocks")
                for h in (16, 20, 64, 128) for b in (1, 8, 64, 256) for c in (512, 4096, 32768)
                if lay == "paged" or (h in (20, 128) and c == 4096)]
        if args.only == "bf16-paged":
            grid = [g for g in grid if g[3] == torch.bfloat16 and g[4] == "paged"]
    rows = []
    for case in grid:
        b, c, h, d, lay = case[:5]
        r = run_case(b, c, h, d, lay, gen, args.arch, args.gpu, case[5] if len(case) > 5 else None)
        r["% copy"] = 100 * r["GB/s"] * 1e9 / copy_bw
        r["% mma"] = 100 * r["TFLOP/s"] * 1e12 / ceilings[d]
        if formats:
            base = next(x for x in rows if x["format"] == "16-bit" and (x["B"], x["ctx"], x["H"]) == (b, c, h)) \
                if r["format"] != "16-bit" else r
            r["x bf16"] = base["ms"] / r["ms"]
        rows.append(r)
        torch.cuda.empty_cache()
    print(f"device copy bandwidth (read+write): {copy_bw / 1e9:,.0f} GB/s; tensor-core ceiling: "
          + common.tflops_text(ceilings))
    if formats:
        common.print_table(rows, ["arch", "tiles", "dtype", "format", "B", "ctx", "H", "splits", "ms", "GB/s",
                                  "% copy", "x bf16", "TFLOP/s", "% mma"])
    else:
        common.print_table(rows, ["arch", "gpu", "tiles", "layout", "dtype", "B", "ctx", "H", "splits", "ms", "GB/s",
                                  "% copy", "TFLOP/s", "% mma", "native_ms", "native_GB/s"])
    common.write_json(args.json, {"device": common.device_info(), "copy_GBps": copy_bw / 1e9,
                                  "mma_TFLOPs": {str(k): v / 1e12 for k, v in ceilings.items()}, "rows": rows})
    variant = " ".join(v for v in (args.arch, args.gpu) if v)
    common.write_plot(args.plot, f"decode on {common.device_info()['gpu']}" + (f" ({variant})" if variant else ""),
                      rows, ["layout", "dtype", "B", "ctx", "H"], ["% copy", "% mma"],
                      f"copy bandwidth {copy_bw / 1e9:,.0f} GB/s (% copy), tensor-core ceiling "
                      f"{common.tflops_text(ceilings)} (% mma)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
