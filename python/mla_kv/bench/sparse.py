"""Benchmark of mla_kv.sparse_attention (DeepSeek Sparse Attention: DeepSeek-V3.2 at 128 heads, GLM-5 at
64) against mla_kv.decode over the whole context of the same cache, the bytes floor and the tensor-core
ceiling measured in the same run, with FlashMLA's sparse decode side by side on Hopper (its metadata
once per step, timed apart).

Shapes: decode (S_q 1) of B = 1, 8, 64 tokens at 128 K and 32 K positions per sequence, top-k 2,048 per
token: distinct random positions < ctx through the sequence's shuffled block table (page 64) to physical
slots. Dense and sparse read the same cache with the same q (N(0, 1)): 16-bit rows N(0, 0.25), quantized
rows written by write_kv from N(0, 1) values; bf16 and each --kv-formats format. Every call of a graph
takes its own block table and indices into one pool of at least 2 GiB of blocks, so the rows it reads
are mostly not in L2. "x dense" = decode's time over sparse_attention's.
Floor: T x k x row bytes (1,152 for 16-bit rows, 656 for fp8_ds_mla) read once, at the device copy
bandwidth (read + write) of the same run; "% copy" = GB/s over it. The Sm90 kernel takes 64 heads per
CTA, so at H 128 two CTAs read each token's rows: it moves twice the floor's bytes.
FLOPs: 2 x T x H x k x (576 + 512); "% mma" of the tensor-core instruction of the kernel variant.
--archs: the kernel variants (default sm90 on Hopper, else the GPU's own): sm80, sm75 and sm70 are the
older GPUs' code paths measured on this one; sm70 / sm75 take fp16 q and caches, the others bf16.
FlashMLA: set MLA_KV_FLASHMLA_PEER to the folder holding flashmla_sparse_peer.py and
build/libflashmla_peer.so (built with WITH_SPARSE=1; fp8_ds_mla rows, bf16 q, H 64 or 128, top-k a
multiple of 64); "x flashmla" = FlashMLA's time over sparse_attention's (> 1: mla_kv is faster). Without
it those columns stay empty. mla_kv's sparse schedule comes from sizes alone: nothing to time per step.
Usage: mla-kv bench sparse [--quick] [--heads 64,128] [--kv-formats fp8_ds_mla] [--archs sm90,sm80,sm75,sm70]
[--topk 2048] [--json FILE] (or python bench/bench_sparse.py ... in a source tree)
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys

import torch

import mla_kv
from mla_kv import layout as cache_layout
from mla_kv.bench import common
from mla_kv.bench.decode import quantized_caches

PAGE = 64
SCALE = 1 / math.sqrt(192)
POOL_BYTES = 2 << 30  # rows drawn at random from a pool this large hit an H100's L2 (50 MB) ~3% of the time
FLOPS_PER_ROW = 2 * (576 + 512)  # per query head and index: scores over 576 dims, P.V over 512
ARCHS = ("auto", "sm70", "sm75", "sm80", "sm90")
FP16_ONLY = ("sm70", "sm75")
FLASHMLA_COLUMNS = ("flashmla_us", "x flashmla", "flashmla_meta_us", "flashmla_TFLOP/s")


def comma_list(allowed=None, convert=str):
    """An argparse type: comma-separated values, each converted and (given ``allowed``) checked."""
    def parse(text):
        try:
            values = [convert(v) for v in text.split(",") if v]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        bad = [v for v in values if allowed is not None and v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{', '.join(map(str, bad))}: not one of {', '.join(map(str, allowed))}")
        return values
    return parse


def dtype_for(arch: str) -> torch.dtype:
    """The 16-bit type a variant runs: fp16 on sm70 / sm75 (and on a GPU older than sm80 by default)."""
    if arch in FP16_ONLY or (arch == "auto" and torch.cuda.get_device_capability()[0] < 8):
        return torch.float16
    return torch.bfloat16


def flashmla_sparse_peer():
    """FlashMLA's sparse decode peer module (in the folder MLA_KV_FLASHMLA_PEER names), or None."""
    where = os.environ.get("MLA_KV_FLASHMLA_PEER")
    if not where:
        return None
    # The peer imports its dense sibling (flashmla_peer.py, load()) by module name from that folder.
    sys.path.insert(0, os.path.abspath(where))
    peer = importlib.import_module("flashmla_sparse_peer")
    peer.load()
    return peer


def sparse_inputs(batch, ctx, topk, kv_format, dtype, gen):
    """A pool of random cache blocks and the (block table, indices) sets its calls rotate among.

    Each set: a shuffled table of ctx / PAGE blocks per sequence drawn from the pool, and per token topk
    distinct positions < ctx mapped through it to slots. Enough sets that the rows they name total
    several times the L2. Returns (cache, tables, indices, bytes per row)."""
    row = cache_layout.bytes_per_token(kv_format, dtype)
    per_seq = ctx // PAGE
    num_blocks = max(batch * per_seq, -(-POOL_BYTES // (PAGE * row)))
    if kv_format is None:
        cache = torch.randn(num_blocks, PAGE, 576, device="cuda", dtype=dtype, generator=gen) * 0.5
    else:
        cache = quantized_caches(kv_format, 1, num_blocks, dtype, gen)[0]
    tables, indices = [], []
    for _ in range(common.variants_for(batch * topk * row, cap=64)):
        table = torch.randperm(num_blocks, device="cuda", generator=gen)[:batch * per_seq].int().view(batch, per_seq)
        pos = torch.rand(batch, ctx, device="cuda", generator=gen).topk(topk, dim=1).indices
        indices.append((torch.gather(table, 1, pos // PAGE) * PAGE + pos % PAGE).int())
        tables.append(table)
    return cache, tables, indices, row


def run_case(inputs, heads, kv_format, arch, gen, copy_bw, mma):
    """mla_kv.sparse_attention and mla_kv.decode (whole context) of one variant on the same cache and q."""
    cache, tables, indices, row = inputs
    batch, topk = indices[0].shape
    ctx = tables[0].shape[1] * PAGE
    dtype = dtype_for(arch)
    tag = None if arch == "auto" else arch
    fmt = dict(kv_format=kv_format, kv_scale=0.05 if kv_format == "fp8" else None)
    # Every variant once per graph replay: the rows of the calls before are then mostly out of L2.
    variants = len(indices)
    calls = max(10, variants)
    q, schedule, workspace, out, lse = common.decode_buffers(batch, heads, ctx, dtype, gen, tag)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    dense = common.time_graph(lambda i: mla_kv.decode(q, cache, tables[i], lens, SCALE, out=out, lse=lse,
                                                      workspace=workspace, schedule=schedule, arch=tag, **fmt),
                              variants, calls=calls, samples=11)
    sparse = mla_kv.sparse_attention_schedule(batch, heads, topk, arch=tag)
    sparse_ws = torch.empty(max(sparse.workspace_bytes, 16), dtype=torch.uint8, device="cuda")
    tokens, sparse_out, sparse_lse = q.view(batch, heads, 576), out.view(batch, heads, 512), lse.view(batch, heads)
    sec = common.time_graph(lambda i: mla_kv.sparse_attention(tokens, cache, indices[i], SCALE, out=sparse_out,
                                                              lse=sparse_lse, workspace=sparse_ws, schedule=sparse,
                                                              arch=tag, **fmt),
                            variants, calls=calls, samples=11)
    nbytes = batch * topk * row
    flops = batch * heads * topk * FLOPS_PER_ROW
    return {"arch": arch, "dtype": str(dtype).split(".")[1], "format": kv_format or "16-bit", "ctx": ctx, "B": batch,
            "H": heads, "topk": topk, "splits": sparse.num_splits, "bytes": nbytes, "us": sec * 1e6,
            "floor_us": nbytes / copy_bw * 1e6, "GB/s": nbytes / sec / 1e9, "% copy": 100 * nbytes / sec / copy_bw,
            "TFLOP/s": flops / sec / 1e12, "% mma": 100 * flops / sec / mma, "dense_us": dense * 1e6,
            "x dense": dense / sec}


def flashmla_case(peer, inputs, heads, gen):
    """FlashMLA's sparse decode over the same fp8_ds_mla rows and indices: split-KV + combine per call
    with the schedule planned once, and its scheduler kernel alone (once per step)."""
    cache, _, indices, _ = inputs
    batch, topk = indices[0].shape
    q = torch.randn(batch, 1, heads, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
    rows = cache.unsqueeze(2)  # FlashMLA's [num_blocks, page, 1, 656] view of the same bytes
    ws = peer.DecodeWorkspace(batch, 1, heads, topk, device=q.device)
    peer.plan_decode(ws)
    sec = common.time_graph(lambda i: peer.sparse_decode(q, rows, indices[i], SCALE, workspace=ws,
                                                         compute_metadata=False),
                            len(indices), calls=max(10, len(indices)), samples=11)
    meta = common.time_graph(lambda i: peer.plan_decode(ws), 1, calls=20, samples=11)
    return {"flashmla_us": sec * 1e6, "flashmla_meta_us": meta * 1e6,
            "flashmla_TFLOP/s": batch * heads * topk * FLOPS_PER_ROW / sec / 1e12}


def flashmla_runs(peer, kv_format, dtype, heads, topk) -> bool:
    """Whether FlashMLA's sparse decode (sm_90a, fp8_ds_mla, bf16 q, H 64 / 128, top-k % 64) takes the case."""
    return (peer is not None and kv_format == "fp8_ds_mla" and dtype == torch.bfloat16 and heads in peer.HEADS
            and topk % peer.DECODE_TOPK_MULT == 0 and torch.cuda.get_device_capability() == (9, 0))


def rows_of(inputs, kv_format, dtype, heads_list, archs, gen, copy_bw, mma, peer):
    """The rows of one pool: each head count on each variant that runs its dtype, FlashMLA's beside them."""
    rows = []
    topk = inputs[2][0].shape[1]
    for heads in heads_list:
        fm = flashmla_case(peer, inputs, heads, gen) if flashmla_runs(peer, kv_format, dtype, heads, topk) else {}
        for arch in (a for a in archs if dtype_for(a) == dtype):
            r = run_case(inputs, heads, kv_format, arch, gen, copy_bw, mma[arch])
            r.update(dict.fromkeys(FLASHMLA_COLUMNS))
            if fm:
                r.update(fm)
                r["x flashmla"] = fm["flashmla_us"] / r["us"]
            rows.append(r)
            print(json.dumps(r), flush=True)
    return rows


def main(argv=None, prog=None):
    ap = common.parser(__doc__, prog, plot=False)
    ap.add_argument("--heads", default=[64, 128], type=comma_list(convert=int), metavar="H,...",
                    help="head counts (default 64,128: GLM-5, DeepSeek-V3.2)")
    ap.add_argument("--kv-formats", default=["fp8_ds_mla"], type=comma_list(cache_layout.KV_FORMATS[1:]),
                    metavar="F,...", help="quantized formats measured beside the 16-bit cache (empty: 16-bit only)")
    ap.add_argument("--archs", default=None, type=comma_list(ARCHS), metavar="A,...",
                    help="kernel variants (default sm90 on Hopper, else auto: the GPU's own); sm70 / sm75 run fp16")
    ap.add_argument("--topk", default=2048, type=int, help="indices per token (default 2048)")
    args = common.parse(ap, argv, prog or "bench_sparse")
    if args is None:
        return 1
    contexts = [131072] if args.quick else [131072, 32768]
    if not 0 < args.topk <= min(contexts):
        ap.error(f"--topk: 1 to {min(contexts)} (distinct positions of the shortest context), got {args.topk}")
    archs = args.archs or (["sm90"] if torch.cuda.get_device_capability()[0] == 9 else ["auto"])
    batches = [1, 64] if args.quick else [1, 8, 64]
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = common.copy_bandwidth()
    mma = {a: common.mma_ceiling(dtype_for(a), None if a == "auto" else a) for a in archs}
    peer = flashmla_sparse_peer()
    rows = []
    for ctx in contexts:
        for batch in batches:
            for fmt in [None, *args.kv_formats]:
                for dtype in dict.fromkeys(dtype_for(a) for a in archs):
                    inputs = sparse_inputs(batch, ctx, args.topk, fmt, dtype, gen)
                    rows += rows_of(inputs, fmt, dtype, args.heads, archs, gen, copy_bw, mma, peer)
                    del inputs
                    torch.cuda.empty_cache()
    info = common.device_info()
    named = {f"{a} {str(dtype_for(a)).split('.')[1]}": v / 1e12 for a, v in mma.items()}
    ceilings = ", ".join(f"{name} {v:,.0f} TFLOP/s" for name, v in named.items())
    print(f"{info['gpu']}: copy {copy_bw / 1e9:,.0f} GB/s (read+write); tensor-core ceiling {ceilings}; FlashMLA "
          f"{'side by side' if peer else 'not loaded (MLA_KV_FLASHMLA_PEER)'}")
    common.print_table(rows, ["arch", "dtype", "format", "ctx", "B", "H", "splits", "us", "floor_us", "GB/s",
                              "% copy", "TFLOP/s", "% mma", "dense_us", "x dense", "flashmla_us", "x flashmla",
                              "flashmla_meta_us"])
    common.write_json(args.json, {"device": info, "copy_GBps": copy_bw / 1e9, "mma_TFLOPs": named,
                                  "flashmla": peer is not None, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
