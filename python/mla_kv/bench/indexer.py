"""Benchmark of the DeepSeek Sparse Attention indexer: mla_kv.index_scores against the copy bandwidth and the
tensor-core ceiling measured in the same run and a torch-native scorer, then a whole sparse decode step
(index_scores + index_topk + sparse_attention) against mla_kv.decode over the whole context of the same layer.

Scores: decode (one query token per sequence) of B = 1, 8, 64 at 32 K and 128 K positions, 32 (GLM-5.x) and 64
(DeepSeek-V3.2) index heads, bf16 queries and e4m3 ones with per-head scales. Index caches hold random e4m3
codes and scales (page 64); every call of a graph takes its own shuffled block table into one pool of at
least 1 GiB of pages, so the keys it reads are mostly not in L2. Bytes: B x ctx x 132 read plus B x ctx x 4
of logits written; "% copy" = GB/s over the device copy bandwidth (read + write). FLOPs: 2 x B x H x ctx x
128; "% mma" of the fp16 mma.sync ceiling of the variant (every variant multiplies in fp16). torch: the same
logits from the dequantized keys gathered through the table, einsum, relu and the weighted head sum (B <= 8).

Step: per query token the scores over its 128 K positions, the top 2,048, sparse attention over them (128
attention heads with 64 index heads, 64 with 32; bf16 latent cache or fp8_ds_mla), against decode over all
128 K positions of the same latent cache; "x dense" = decode's time over the step's.
--archs: the kernel variants (default auto, the GPU's own); sm70 / sm75 are the older GPUs' code paths
measured on this one (the step's attention runs fp16 there).
Usage: mla-kv bench indexer [--quick] [--heads 32,64] [--archs auto,sm80,sm75,sm70] [--json FILE]
(or python bench/bench_indexer.py ... in a source tree)
"""
from __future__ import annotations

import json
import math
import sys

import torch

import mla_kv
from mla_kv import layout
from mla_kv.bench import common
from mla_kv.bench.decode import quantized_caches
from mla_kv.bench.sparse import comma_list, dtype_for

PAGE = 64
TOPK = 2048
POOL_BYTES = 1 << 30
ARCHS = ("auto", "sm70", "sm75", "sm80", "sm90")
ATTENTION_HEADS = {32: 64, 64: 128}  # index heads -> the model's attention heads (GLM-5.x, DeepSeek-V3.2)


def index_pool(pages: int, gen) -> torch.Tensor:
    """uint8 [pages, PAGE, 132]: random finite e4m3 codes, scales 2^-10 .. 2^-2 after each page's codes."""
    cache = torch.randint(0, 256, (pages, PAGE * layout.INDEX_ROW_BYTES), dtype=torch.uint8, device="cuda",
                          generator=gen)
    cache = torch.where((cache & 0x7F) == 0x7F, cache ^ 1, cache)
    scales = torch.exp2(torch.rand(pages, PAGE, device="cuda", generator=gen) * 8 - 10)
    cache[:, PAGE * layout.INDEX_DIM:] = scales.view(torch.uint8)
    return cache.view(pages, PAGE, layout.INDEX_ROW_BYTES)


def queries(batch, heads, kind, gen):
    """(q, q_scale) for one query kind: bf16 values, or e4m3 codes with per-(token, head) scales."""
    if kind == "e4m3":
        q = torch.randint(0, 126, (batch, heads, layout.INDEX_DIM), dtype=torch.uint8, device="cuda", generator=gen)
        return q, torch.rand(batch, heads, device="cuda", generator=gen) * 0.01
    return torch.randn(batch, heads, layout.INDEX_DIM, device="cuda", generator=gen).to(torch.bfloat16), None


def tables_for(batch, ctx, pages, bytes_per_set, gen):
    """Shuffled block tables [B, ctx / PAGE] into a pool of ``pages``, enough sets to spill L2."""
    per_seq = ctx // PAGE
    return [torch.randperm(pages, device="cuda", generator=gen)[:batch * per_seq].int().view(batch, per_seq)
            for _ in range(common.variants_for(bytes_per_set, cap=32))]


def torch_scores(q, q_scale, weights, cache, table, ctx):
    """The logits by torch ops: keys gathered through the table and dequantized, then einsum and the head sum."""
    codes, scales = layout.index_cache_parts(cache)
    pages = table.long()
    keys = codes[pages].view(torch.float8_e4m3fn).to(torch.bfloat16).flatten(1, 2)       # [B, ctx, 128]
    key_scales = scales[pages].flatten(1, 2)                                             # [B, ctx]
    qv = q.view(torch.float8_e4m3fn).to(torch.bfloat16) if q_scale is not None else q
    w = weights * q_scale if q_scale is not None else weights
    dots = torch.einsum("bhd,bsd->bhs", qv, keys).float().relu_()
    return torch.einsum("bhs,bh->bs", dots, w) * key_scales


def scores_case(batch, ctx, heads, kind, arch, gen, copy_bw, mma, pool):
    tag = None if arch == "auto" else arch
    nbytes = batch * ctx * (layout.INDEX_ROW_BYTES + 4)
    tables = tables_for(batch, ctx, pool.shape[0], batch * ctx * layout.INDEX_ROW_BYTES, gen)
    q, q_scale = queries(batch, heads, kind, gen)
    weights = torch.randn(batch, heads, device="cuda", generator=gen)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    out = torch.empty(batch, ctx, device="cuda")
    sec = common.time_graph(lambda i: mla_kv.index_scores(q, weights, pool, tables[i], lens, ctx, q_scale=q_scale,
                                                          out=out, arch=tag),
                            len(tables), calls=max(10, len(tables)), samples=11)
    flops = 2 * batch * heads * ctx * layout.INDEX_DIM
    row = {"arch": arch, "q": kind, "ctx": ctx, "B": batch, "H": heads, "us": sec * 1e6,
           "floor_us": nbytes / copy_bw * 1e6, "GB/s": nbytes / sec / 1e9, "% copy": 100 * nbytes / sec / copy_bw,
           "TFLOP/s": flops / sec / 1e12, "% mma": 100 * flops / sec / mma, "torch_us": None, "x torch": None}
    if batch <= 8:
        native = common.time_eager(lambda i: torch_scores(q, q_scale, weights, pool, tables[i], ctx), len(tables),
                                   calls=3, samples=5)
        row.update({"torch_us": native * 1e6, "x torch": native / sec})
    return row


def step_case(batch, ctx, heads, kv_format, arch, gen, pool):
    """One decode step of a DSA layer (scores, top-k, sparse attention) vs dense decode of the same layer."""
    tag = None if arch == "auto" else arch
    dtype = dtype_for(arch)
    attn_heads = ATTENTION_HEADS[heads]
    per_seq = ctx // PAGE
    blocks = max(batch * per_seq, -(-POOL_BYTES // (PAGE * layout.bytes_per_token(kv_format, dtype))))
    if kv_format is None:
        latent = torch.randn(blocks, PAGE, 576, device="cuda", dtype=dtype, generator=gen) * 0.5
    else:
        latent = quantized_caches(kv_format, 1, blocks, dtype, gen)[0]
    sets = common.variants_for(batch * ctx * layout.INDEX_ROW_BYTES, cap=16)
    tables = [torch.randperm(min(blocks, pool.shape[0]), device="cuda", generator=gen)[:batch * per_seq].int()
              .view(batch, per_seq) for _ in range(sets)]
    q_index, _ = queries(batch, heads, "bf16", gen)
    weights = torch.randn(batch, heads, device="cuda", generator=gen)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q, schedule, workspace, out, lse = common.decode_buffers(batch, attn_heads, ctx, dtype, gen, tag)
    fmt = dict(kv_format=kv_format)
    scale = 1 / math.sqrt(192)
    dense = common.time_graph(lambda i: mla_kv.decode(q, latent, tables[i], lens, scale, out=out, lse=lse,
                                                      workspace=workspace, schedule=schedule, arch=tag, **fmt),
                              sets, calls=max(10, sets), samples=11)
    logits = torch.empty(batch, ctx, device="cuda")
    indices = torch.empty(batch, TOPK, dtype=torch.int32, device="cuda")
    topk_ws = torch.zeros(max(mla_kv.index_topk_workspace_size(batch, ctx, TOPK), 16), dtype=torch.uint8,
                          device="cuda")
    sparse = mla_kv.sparse_attention_schedule(batch, attn_heads, TOPK, arch=tag)
    sparse_ws = torch.empty(max(sparse.workspace_bytes, 16), dtype=torch.uint8, device="cuda")
    tokens, s_out, s_lse = q.view(batch, attn_heads, 576), out.view(batch, attn_heads, 512), lse.view(batch, attn_heads)

    def step(i):
        mla_kv.index_scores(q_index, weights, pool, tables[i], lens, ctx, out=logits, arch=tag)
        mla_kv.index_topk(logits, lens, TOPK, block_table=tables[i], page_size=PAGE, out=indices, workspace=topk_ws,
                          arch=tag)
        mla_kv.sparse_attention(tokens, latent, indices, scale, out=s_out, lse=s_lse, workspace=sparse_ws,
                                schedule=sparse, arch=tag, **fmt)
    sec = common.time_graph(step, sets, calls=max(10, sets), samples=11)
    return {"arch": arch, "format": kv_format or str(dtype).split(".")[1], "ctx": ctx, "B": batch, "H_index": heads,
            "H": attn_heads, "step_us": sec * 1e6, "dense_us": dense * 1e6, "x dense": dense / sec}


def main(argv=None, prog=None):
    ap = common.parser(__doc__, prog, plot=False)
    ap.add_argument("--heads", default=[32, 64], type=comma_list(convert=int), metavar="H,...",
                    help="index heads (default 32,64: GLM-5.x, DeepSeek-V3.2)")
    ap.add_argument("--archs", default=["auto"], type=comma_list(ARCHS), metavar="A,...",
                    help="kernel variants (default auto: the GPU's own)")
    args = common.parse(ap, argv, prog or "bench_indexer")
    if args is None:
        return 1
    bad = [h for h in args.heads if h not in mla_kv.ops.indexer.INDEX_HEADS]
    if bad:
        ap.error(f"--heads: {bad} not among the kernels' {mla_kv.ops.indexer.INDEX_HEADS}")
    contexts = [131072] if args.quick else [32768, 131072]
    batches = [1, 64] if args.quick else [1, 8, 64]
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = common.copy_bandwidth()
    hopper = torch.cuda.get_device_capability()[0] == 9
    # Every variant multiplies with mma.sync: on Hopper the sm90 tag (and auto) run the sm80 kernel.
    mma = {a: common.mma_ceiling(torch.float16, "sm80" if hopper and a in ("auto", "sm90") else
                                 (None if a == "auto" else a)) for a in args.archs}
    pool = index_pool(max(POOL_BYTES // (PAGE * layout.INDEX_ROW_BYTES), 64 * 131072 // PAGE), gen)
    rows, steps = [], []
    for ctx in contexts:
        for batch in batches:
            for heads in args.heads:
                for kind in ("bf16", "e4m3"):
                    for arch in args.archs:
                        rows.append(scores_case(batch, ctx, heads, kind, arch, gen, copy_bw, mma[arch], pool))
                        print(json.dumps(rows[-1]), flush=True)
    for batch in batches:
        for heads in args.heads:
            for fmt in (None, "fp8_ds_mla"):
                for arch in args.archs:
                    steps.append(step_case(batch, 131072, heads, fmt, arch, gen, pool))
                    print(json.dumps(steps[-1]), flush=True)
                    torch.cuda.empty_cache()
    info = common.device_info()
    ceilings = ", ".join(f"{a} fp16 {v / 1e12:,.0f} TFLOP/s" for a, v in mma.items())
    print(f"{info['gpu']}: copy {copy_bw / 1e9:,.0f} GB/s (read+write); mma.sync ceiling {ceilings}")
    common.print_table(rows, ["arch", "q", "ctx", "B", "H", "us", "floor_us", "GB/s", "% copy", "TFLOP/s", "% mma",
                              "torch_us", "x torch"])
    common.print_table(steps, ["arch", "format", "ctx", "B", "H_index", "H", "step_us", "dense_us", "x dense"])
    common.write_json(args.json, {"device": info, "copy_GBps": copy_bw / 1e9,
                                  "mma_TFLOPs": {a: v / 1e12 for a, v in mma.items()}, "rows": rows, "steps": steps})
    return 0


if __name__ == "__main__":
    sys.exit(main())
