"""The decode kernels' copy path alone: a paged cache's tiles into a shared-memory ring, one CTA per SM,
by each Hopper copy mechanism, against the device copy bandwidth measured in the same run.

Why: the narrow quantized decode (attention_sm90_narrow.cuh) waited on landing tiles at about one tile per
CTA per ~3,000 cycles whatever the tile's size (H200, 2026-12-03), with free
ring stages. Here the copy warp's work is only the block-table lookup and the copy; consumers (two
warpgroups taking alternate tiles) wait for a tile, read 16 bytes a thread and free it. The answer
(H200, 2026-12-03): every method moves tiles at 78-100% of copy, twice the rate the decode takes them.
Methods (mla_kv._C TileCopy): bulk (one cp.async.bulk per tile from one warp: the narrow kernel's way),
pieces (N cp.async.bulk per tile, a lane each), bulk-4-warps (four copy warps, every fourth tile),
cp.async (16 bytes a thread from a 128-thread copy warpgroup). Tiles: 64 rows of int4 (18,432 bytes),
fp8 (36,864) and bf16 (73,728) latent rows; each a random block of a >= 1 GiB pool (no L2 reuse).
Bytes counted: the tile bytes moved (read once; the ring is not written back), so "% copy" compares a
read-only stream with a copy's read + write rate: 50% means the DRAM moves as many bytes per second.
Usage: mla-kv bench tile_copy [--quick] [--json FILE]   (sm_90 only; not in the full run)
"""
from __future__ import annotations

import sys
from typing import List, Optional

import torch

from mla_kv.bench import common

METHODS = {"bulk": 0, "pieces": 1, "bulk-4-warps": 2, "cp.async": 3}
TILES = {"int4": 64 * 288, "fp8": 64 * 576, "bf16": 64 * 1152}
ALIGN_SLACK = 1024  # the ring's alignment to a swizzle atom (tile_copy.cu reserves it as well)


def ring_bytes(tile_bytes, stages):
    """The probe's dynamic shared memory: the ring, a full and an empty mbarrier per stage, the slack."""
    return stages * tile_bytes + 16 * stages + ALIGN_SLACK


def run_case(c, method, tile_bytes, stages, pieces, tiles, sms, pool, sink):
    blocks = pool.numel() // tile_bytes
    gen = torch.Generator(device="cuda").manual_seed(tile_bytes + stages)
    tables = [torch.randint(0, blocks, (sms * tiles,), device="cuda", dtype=torch.int32, generator=gen)
              for _ in range(4)]
    stream = torch.cuda.current_stream().cuda_stream
    moved = []

    def call(i):
        moved.append(c.tile_copy_throughput(METHODS[method], pool.data_ptr(), tables[i].data_ptr(), tile_bytes,
                                            tile_bytes, sms, tiles, stages, pieces, sink.data_ptr(), stream))

    seconds = common.time_eager(call, len(tables))
    return moved[-1] / seconds


def main(argv: Optional[List[str]] = None, prog: Optional[str] = None) -> int:
    ap = common.parser(__doc__, prog, plot=False)
    args = common.parse(ap, argv, "tile_copy")
    if args is None:
        return 1
    if torch.cuda.get_device_capability() < (9, 0):
        print("tile_copy: needs an sm_90 GPU (cp.async.bulk and mbarriers with transaction counts)", file=sys.stderr)
        return 1
    from mla_kv._compiled import _C as c
    copy = common.copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_block = c.device_smem_limits().per_block
    pool = torch.randint(0, 255, (1 << 30,), dtype=torch.uint8, device="cuda")
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    rows = []
    tile_counts = (32,) if args.quick else (32, 256)
    for name, tile_bytes in TILES.items():
        for stages in (2, 4, 8, 12):
            if ring_bytes(tile_bytes, stages) > per_block:
                continue
            for method in METHODS:
                if method == "bulk-4-warps" and stages % 4:
                    continue
                for pieces in ((4, 9) if method == "pieces" else (1,)):
                    for tiles in tile_counts:
                        rate = run_case(c, method, tile_bytes, stages, pieces, tiles, sms, pool, sink)
                        rows.append(dict(tile=name, tile_bytes=tile_bytes, stages=stages, method=method,
                                         pieces=pieces if method == "pieces" else None, tiles=tiles,
                                         GBps=rate / 1e9, pct_copy=100 * rate / copy,
                                         us_per_tile=1e6 * tile_bytes / (rate / sms)))
    print(f"device copy bandwidth (read+write): {copy / 1e9:,.0f} GB/s; {sms} CTAs, one per SM")
    common.print_table(rows, ["tile", "stages", "method", "pieces", "tiles", "GBps", "pct_copy", "us_per_tile"])
    if args.json:
        common.write_json(args.json, dict(copy_bandwidth=copy, sms=sms, rows=rows, device=common.device_info()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
