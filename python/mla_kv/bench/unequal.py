"""Benchmark of mla_kv.decode on batches of unequal lengths: the length-aware plan (made once per step,
timed apart, reused by every layer) against the uniform split and the copy floor measured in the same
run, with FlashMLA's dense kernel side by side on Hopper (its metadata once per step, timed apart).

Floor: the batch's cache bytes (sum of lengths x bytes per token) at the device copy bandwidth.
Batches: one 128 K sequence among 63 lognormal ones (128-16 K), four very different lengths (S_q 1
and 4), eight from 1 K to 128 K, and two uniform ones (the uniform grid's regression check).
FlashMLA: set MLA_KV_FLASHMLA_PEER to the folder holding flashmla_peer.py and build/libflashmla_peer.so
(bf16, S_q 1 and 4); without it the column stays empty.
Usage: mla-kv bench unequal [--quick] [--heads 16,64,128] [--kv-formats fp8_ds_mla] [--json FILE]
"""
from __future__ import annotations

import importlib.util
import math
import os
import random
import sys

import torch

import mla_kv
from mla_kv import layout as cache_layout
from mla_kv.bench import common
from mla_kv.bench.decode import quantized_caches

PAGE = 64
SCALE = 1 / math.sqrt(192)


def lognormal_batch(seed: int = 0):
    """One 131,072-token sequence among 63 drawn from a lognormal (median 2.5 K, clipped to 128-16 K)."""
    rng = random.Random(seed)
    return [131072] + [int(min(16384, max(128, rng.lognormvariate(math.log(2500), 1.0)))) for _ in range(63)]


BATCHES = {
    "1x128K+63 lognormal": (lognormal_batch(), 1),
    "4 mixed S_q=1": ([4641, 45118, 1730, 1696], 1),
    "4 mixed S_q=4": ([4641, 45118, 1730, 1696], 4),
    "8 from 1K to 128K": ([1024 << i for i in range(8)], 1),
    "uniform 64x4K": ([4096] * 64, 1),
    "uniform 8x32K": ([32768] * 8, 1),
}


def flashmla_peer():
    """FlashMLA's ctypes peer module (MLA_KV_FLASHMLA_PEER), or None."""
    where = os.environ.get("MLA_KV_FLASHMLA_PEER")
    if not where:
        return None
    spec = importlib.util.spec_from_file_location("flashmla_peer", os.path.join(where, "flashmla_peer.py"))
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    peer.load()
    return peer


def caches_for(lens, dtype, kv_format, gen):
    """Rotating caches (past L2) holding the batch's rows, a shared shuffled block table, the lengths."""
    blocks = [-(-n // PAGE) for n in lens]
    num_blocks = sum(blocks)
    per_token = 576 * 2 if kv_format is None else cache_layout.bytes_per_token(kv_format, dtype)
    nbytes = sum(lens) * per_token
    variants = common.variants_for(nbytes, cap=4)
    if kv_format is None:
        caches = [(torch.randn(num_blocks, PAGE, 576, device="cuda", dtype=dtype, generator=gen) * 0.5)
                  for _ in range(variants)]
    else:
        caches = quantized_caches(kv_format, variants, num_blocks, dtype, gen)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).int()
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device="cuda")
    at = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[at:at + n]
        at += n
    return caches, table, torch.tensor(lens, dtype=torch.int32, device="cuda"), nbytes


def run_case(name, lens, s_q, heads, dtype, kv_format, gen, copy_bw, peer):
    caches, table, seq_lens, nbytes = caches_for(lens, dtype, kv_format, gen)
    batch, max_kv = len(lens), table.shape[1] * PAGE
    q = torch.randn(batch, s_q, heads, 576, device="cuda", dtype=dtype, generator=gen) / 4
    out = torch.empty(batch, s_q, heads, 512, device="cuda", dtype=dtype)
    lse = torch.empty(batch, s_q, heads, device="cuda")
    fmt = dict(kv_format=kv_format, kv_scale=None)
    variants = len(caches)

    lengths = mla_kv.attention_schedule(batch, s_q, heads, max_kv, kv_format=kv_format)
    ws = torch.empty(lengths.workspace_bytes, dtype=torch.uint8, device="cuda")
    plan = mla_kv.attention_plan(lengths, seq_lens, workspace=ws)
    planned = common.time_graph(lambda i: mla_kv.decode(q, caches[i], table, seq_lens, SCALE, out=out, lse=lse,
                                                        plan=plan, **fmt), variants, calls=10, samples=11)
    plan_time = common.time_graph(lambda i: mla_kv.attention_plan(lengths, seq_lens, workspace=ws), 1,
                                  calls=20, samples=11)
    uniform = mla_kv.attention_schedule(batch, s_q, heads, max_kv, kv_format=kv_format, split="uniform")
    uws = torch.empty(max(uniform.workspace_bytes, 16), dtype=torch.uint8, device="cuda")
    even = common.time_graph(lambda i: mla_kv.decode(q, caches[i], table, seq_lens, SCALE, out=out, lse=lse,
                                                     schedule=uniform, workspace=uws, **fmt),
                             variants, calls=10, samples=11)
    fm = fm_meta = None
    if peer is not None and kv_format is None and dtype == torch.bfloat16:
        fws = peer.Workspace(batch, s_q, heads, dtype=dtype)
        peer.plan(fws, seq_lens)
        causal = s_q > 1
        fm = common.time_graph(lambda i: peer.decode(q, caches[i], table, seq_lens, SCALE, causal=causal,
                                                     workspace=fws, compute_metadata=False),
                               variants, calls=10, samples=11)
        fm_meta = common.time_graph(lambda i: peer.plan(fws, seq_lens), 1, calls=20, samples=11)
    floor = nbytes / copy_bw
    return {"batch": name, "format": kv_format or str(dtype).split(".")[1], "H": heads, "S_q": s_q,
            "tokens": sum(lens), "floor_us": floor * 1e6, "us": planned * 1e6, "% floor": 100 * floor / planned,
            "plan_us": plan_time * 1e6, "uniform_us": even * 1e6, "x uniform": even / planned,
            "flashmla_us": fm * 1e6 if fm else None, "x flashmla": fm / planned if fm else None,
            "flashmla_meta_us": fm_meta * 1e6 if fm_meta else None}


def main(argv=None, prog=None):
    ap = common.parser(__doc__, prog, plot=False)
    ap.add_argument("--heads", default="16,64,128", help="head counts (comma-separated)")
    ap.add_argument("--kv-formats", default="fp8_ds_mla", metavar="F,...",
                    help="quantized formats measured beside bf16 (empty: bf16 only)")
    args = common.parse(ap, argv, prog or "bench_unequal")
    if args is None:
        return 1
    formats = [f for f in args.kv_formats.split(",") if f]
    for f in formats:
        cache_layout.check_kv_format(f, "--kv-formats")
    heads = [int(h) for h in args.heads.split(",")]
    names = list(BATCHES) if not args.quick else ["1x128K+63 lognormal", "uniform 64x4K"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = common.copy_bandwidth()
    peer = flashmla_peer()
    rows = []
    for name in names:
        lens, s_q = BATCHES[name]
        for h in heads:
            for fmt in [None, *formats]:
                rows.append(run_case(name, lens, s_q, h, torch.bfloat16, fmt, gen, copy_bw, peer))
                print(rows[-1], file=sys.stderr, flush=True)
                torch.cuda.empty_cache()
    info = common.device_info()
    print(f"{info['gpu']}: copy {copy_bw / 1e9:.0f} GB/s; FlashMLA {'side by side' if peer else 'not loaded'}")
    common.print_table(rows, ["batch", "format", "H", "S_q", "tokens", "floor_us", "us", "% floor", "plan_us",
                              "uniform_us", "x uniform", "flashmla_us", "x flashmla", "flashmla_meta_us"])
    if args.json:
        common.write_json(args.json, {"device": info, "copy_GBps": copy_bw / 1e9, "rows": rows})
    return 0
