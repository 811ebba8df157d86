"""Benchmark of write_kv and fused_write_kv (paged and block-pointer forms) against the device copy
bandwidth measured in the same run and the torch-native equivalent.

Bytes moved per token: the 576-value input row read plus the 576-value cache row written (slot and
position indices and cos/sin rows are counted too; q rotation adds 2 x H x 64 values). The quantizing
fused writes (fused_write_kv[fp8], ...) count the format's bytes per token written
(mla_kv.layout.bytes_per_token) instead of the 16-bit row.
Usage: mla-kv bench write [--quick] [--heads-q H] [--json FILE] [--plot FILE]
(or python bench/bench_write.py ... in a source tree)
"""
from __future__ import annotations

import sys

import torch


import mla_kv
from mla_kv import layout, reference
from mla_kv.bench import common
from mla_kv.rope import cos_sin_cache


def torch_native_fused(kv_a, weight, positions, cs, cache, slots):
    """What an engine does without the fused kernel: RMSNorm, RoPE and an index write in torch."""
    kv_c = torch.nn.functional.rms_norm(kv_a[:, :512].float(), (512,), weight.float(), 1e-6).to(kv_a.dtype)
    k_pe = reference.apply_rope(kv_a[:, 512:], positions, cs)
    cache.view(-1, 576)[slots] = torch.cat([kv_c, k_pe], dim=-1)


def quantized_cache(kv_format, num_blocks, block_size, dtype, gen):
    """A paged cache of kv_format filled with random bytes."""
    return torch.randint(0, 256, layout.paged_cache_shape(kv_format, num_blocks, block_size, dtype), device="cuda",
                         dtype=torch.uint8, generator=gen)


def run(tokens, dtypes, heads_q, kv_formats=()):
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for dtype in dtypes:
        es = torch.empty((), dtype=dtype).element_size()
        for t in tokens:
            per_set = t * 576 * es * 2
            n = common.variants_for(per_set)
            kv_a = [torch.randn(t, 576, device="cuda", dtype=dtype, generator=gen) for _ in range(n)]
            caches = [torch.randn(t // 64 * 2 + 2, 64, 576, device="cuda", dtype=dtype, generator=gen)
                      for _ in range(n)]
            slots = [torch.randperm(c.shape[0] * 64, device="cuda", generator=gen)[:t] for c in caches]
            positions = [torch.randint(0, 8192, (t,), device="cuda", generator=gen) for _ in range(n)]
            cs = cos_sin_cache(64, 8192, 1e4, device="cuda")
            weight = torch.rand(512, device="cuda", dtype=dtype, generator=gen) + 0.5
            qs = [torch.randn(t, heads_q, 256, device="cuda", dtype=dtype, generator=gen) for _ in range(n)]
            # Bytes: rows in and out, 8-byte slot and position, a 256-byte fp32 cos/sin row.
            base_bytes = t * (2 * 576 * es + 8)
            fused_bytes = base_bytes + t * (8 + 256)
            cases = [
                ("write_kv", base_bytes,
                 lambda i: mla_kv.write_kv(kv_a[i][:, :512], kv_a[i][:, 512:], caches[i], slots[i])),
                ("fused_write_kv", fused_bytes,
                 lambda i: mla_kv.fused_write_kv(kv_a[i], weight, 1e-6, positions[i], cs, caches[i], slots[i])),
                (f"fused_write_kv+q(H={heads_q})", fused_bytes + t * heads_q * 64 * es * 2,
                 lambda i: mla_kv.fused_write_kv(kv_a[i], weight, 1e-6, positions[i], cs, caches[i], slots[i],
                                                 q=qs[i])),
            ]
            for kv_format in kv_formats:
                per_token = layout.bytes_per_token(kv_format, dtype)
                q_caches = [quantized_cache(kv_format, c.shape[0], 64, dtype, gen) for c in caches]
                scale = 0.5 if kv_format == "fp8" else None
                cases.append((f"fused_write_kv[{kv_format}]", t * (576 * es + per_token + 16 + 256),
                              lambda i, c=q_caches, f=kv_format, s=scale: mla_kv.fused_write_kv(
                                  kv_a[i], weight, 1e-6, positions[i], cs, c[i], slots[i], kv_format=f, kv_scale=s)))
            native = common.time_eager(lambda i: torch_native_fused(kv_a[i], weight, positions[i], cs,
                                                                     caches[i], slots[i]), n)
            times = {}
            for name, nbytes, fn in cases:
                sec = times[name] = common.time_graph(fn, n)
                rows.append({"op": name, "dtype": str(dtype).split(".")[1], "T": t, "us": sec * 1e6,
                             "bytes": nbytes, "GB/s": nbytes / sec / 1e9,
                             # a quantizing write's time over the 16-bit fused write's (target: <= 1.1)
                             "/ 16-bit": sec / times["fused_write_kv"] if name.startswith("fused_write_kv[") else None,
                             "torch_native_us": native * 1e6 if name == "fused_write_kv" else None,
                             "torch_native_GB/s": fused_bytes / native / 1e9 if name == "fused_write_kv" else None})
    return rows


def main(argv=None, prog=None):
    ap = common.parser(__doc__, prog)
    ap.add_argument("--heads-q", type=int, default=20)
    ap.add_argument("--kv-formats", default="fp8,fp8_ds_mla,int8,int4",
                    help="quantized formats of the fused write rows (comma-separated; 'none' for none)")
    args = common.parse(ap, argv, prog or "bench_write")
    if args is None:
        return 1
    tokens = [1, 64, 65536] if args.quick else [1, 16, 64, 1024, 16384, 65536]
    dtypes = [torch.float16] if args.quick else [torch.float16, torch.bfloat16]
    copy_bw = common.copy_bandwidth()
    kv_formats = [] if args.kv_formats == "none" else args.kv_formats.split(",")
    for f in kv_formats:
        if f not in layout.KV_FORMATS[1:]:
            print(f"bench write: --kv-formats: {f!r} is not one of {', '.join(layout.KV_FORMATS[1:])}", file=sys.stderr)
            return 2
    rows = run(tokens, dtypes, args.heads_q, kv_formats)
    for r in rows:
        r["% copy"] = 100 * r["GB/s"] * 1e9 / copy_bw
    print(f"device copy bandwidth (read+write): {copy_bw / 1e9:,.0f} GB/s")
    common.print_table(rows, ["op", "dtype", "T", "us", "GB/s", "% copy", "/ 16-bit", "torch_native_us",
                              "torch_native_GB/s"])
    common.write_json(args.json, {"device": common.device_info(), "copy_GBps": copy_bw / 1e9, "rows": rows})
    common.write_plot(args.plot, f"write_kv / fused_write_kv on {common.device_info()['gpu']}", rows,
                      ["op", "dtype", "T"], ["% copy"], f"device copy bandwidth {copy_bw / 1e9:,.0f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
