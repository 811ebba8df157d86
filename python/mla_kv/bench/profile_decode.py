"""Decode launches for a profiler.

  mla-kv bench profile_decode B CTX H [dtype] [--kv-format F]
                                                 three launches, for ncu (--launch-skip 2), over a
                                                 16-bit cache or one of format F
  mla-kv bench profile_decode --times            per-kernel GPU times (attention, combine) of the
                                                 decode cases RESULTS.md quotes, via torch.profiler
(or python bench/profile_decode.py ... in a source tree)
"""
import argparse
import itertools
import math
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import mla_kv
from mla_kv.bench import common
from mla_kv.bench.decode import quantized_caches

TIMED_CASES = [(64, 4096, 16), (64, 4096, 20), (64, 4096, 64), (64, 4096, 128), (1, 32768, 20), (8, 32768, 20),
               (1, 512, 20), (8, 4096, 20)]


def make_decode(batch, ctx, heads, dtype=torch.bfloat16, kv_format=None):
    """A decode call over random data (page 64, shuffled blocks) with its schedule and workspace.
    Successive calls read different caches (as bench_decode's replays do), so that no call finds
    its cache in L2."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks = ctx // 64
    row_bytes = 576 * dtype.itemsize if kv_format is None else mla_kv.layout.bytes_per_token(kv_format, dtype)
    sets = common.variants_for(batch * ctx * row_bytes, cap=8)
    if kv_format is None:
        caches = [torch.randn(batch * blocks, 64, 576, device="cuda", dtype=dtype, generator=gen) for _ in range(sets)]
    else:
        caches = quantized_caches(kv_format, sets, batch * blocks, dtype, gen)
    quantized = {} if kv_format is None else dict(kv_format=kv_format, kv_scale=0.05 if kv_format == "fp8" else None)
    table = torch.randperm(batch * blocks, device="cuda", generator=gen).int().view(batch, blocks)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q, schedule, workspace, out, lse = common.decode_buffers(batch, heads, ctx, dtype, gen)
    rotation = itertools.cycle(caches)
    call = lambda: mla_kv.decode(q, next(rotation), table, lens, 1 / math.sqrt(192),  # noqa: E731
                                 out=out, lse=lse, workspace=workspace, schedule=schedule, **quantized)
    return call, schedule


def kernel_times(batch, ctx, heads, calls=20):
    call, schedule = make_decode(batch, ctx, heads)
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    times = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            name = "combine" if "combine" in e.name else "attention" if "attention" in e.name else e.name[:40]
            times.setdefault(name, []).append(e.device_time)
    print(f"B={batch} ctx={ctx} H={heads} splits={schedule.num_splits}: "
          + ", ".join(f"{k} {sum(v) / len(v):.1f} us" for k, v in times.items()))


def main(argv=None, prog=None):
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0], epilog=__doc__.split("\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("batch", type=int, nargs="?", metavar="B", help="sequences")
    ap.add_argument("ctx", type=int, nargs="?", metavar="CTX", help="tokens per sequence (a multiple of 64)")
    ap.add_argument("heads", type=int, nargs="?", metavar="H", help="attention heads")
    ap.add_argument("dtype", nargs="?", default="bfloat16", choices=("float16", "bfloat16"), metavar="dtype",
                    help="float16 or bfloat16 (default %(default)s)")
    ap.add_argument("--kv-format", default=None, metavar="F", choices=[f for f in mla_kv.layout.KV_FORMATS if f],
                    help="a quantized cache of this format (fp8, fp8_ds_mla, int8, int4) instead of 16-bit rows")
    ap.add_argument("--times", action="store_true", help="per-kernel GPU times of the decode cases RESULTS.md quotes")
    args = ap.parse_args(argv)
    if not args.times and args.heads is None:
        ap.error("give B CTX H [dtype], or --times")
    if not common.kernels_present(prog or "profile_decode"):
        return 1
    if args.times:
        for case in TIMED_CASES:
            kernel_times(*case)
        return 0
    call, _ = make_decode(args.batch, args.ctx, args.heads, getattr(torch, args.dtype), args.kv_format)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
