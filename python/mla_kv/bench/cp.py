"""Context parallelism over NCCL: the kernels with cp 2 / 4 / 8 against one GPU, and decode at ctx 128K
with cp 2 against cp 1 (latency and cache memory per rank).

One process per GPU (torch.multiprocessing.spawn, NCCL). Needs 2 or more CUDA GPUs and the compiled
kernels; exits 1 with a message otherwise, and 1 when a check fails.

check: per case, every rank of a cp group writes its tokens (cp_fused_write_kv) into its own cache of
shuffled blocks, runs cp_decode (S_q 1..3) or cp_prefill (cached prefix + prompt) and cp_merge;
the merged result is compared with the float64 reference and with one GPU running the ordinary
fused_write_kv + decode/prefill on the whole cache; every rank must end with the same bits.
bench: B x 128K tokens, bf16, page 64. cp 1 is one GPU's decode; cp 2 halves each rank's cache.
attn_ms = cp_decode alone (CUDA graph), merge_ms = cp_merge alone, step_ms = both (eager, as an
engine without graph capture of NCCL runs them); medians of CUDA-event timings, the slowest rank.
Usage: mla-kv bench cp [--gpus N] [--part all|check|bench] [--quick] [--json FILE]
(or python bench/bench_cp.py ... in a source tree)
"""
from __future__ import annotations

import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mla_kv
from mla_kv import parallel, reference, rope
from mla_kv.bench import common

PAGE = 64
CTX = 128 * 1024
SCALE = rope.mla_softmax_scale(128, 64)
REL_TOL = {torch.float16: 3e-3, torch.bfloat16: 1e-2}
LSE_TOL = 1e-3
# NVLink multicast stays off (it can take shared GPUs out of service).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# ------------------------------------------------------------------------------------ check
class Problem:
    """A batch with a cached prefix and new tokens per sequence, drawn on the host from a seed so that
    every rank builds the same one, then moved to this rank's GPU."""

    def __init__(self, seed, prefix_lens, new_lens, heads, dtype, device):
        gen = torch.Generator().manual_seed(seed)
        self.prefix_lens, self.new_lens, self.device = prefix_lens, new_lens, device
        self.kv_a_prefix = torch.randn(sum(prefix_lens), 576, generator=gen).to(device, dtype)
        self.kv_a_new = torch.randn(sum(new_lens), 576, generator=gen).to(device, dtype)
        self.q_new = torch.randn(sum(new_lens), heads, 576, generator=gen).to(device, dtype)
        self.rms_weight = (1 + 0.1 * torch.randn(512, generator=gen)).to(device, dtype)
        self.cos_sin = rope.cos_sin_cache(64, 16384, theta=1e4, device=device)
        self.total_lens = [p + n for p, n in zip(prefix_lens, new_lens)]

    def tensor(self, values):
        return torch.tensor(values, dtype=torch.int32, device=self.device)

    def cu(self, lens):
        return self.tensor([0] + lens).cumsum(0, dtype=torch.int32)


def shuffled_table(lens, gen, device):
    """(number of blocks, table) with distinct shuffled blocks per sequence; unused entries poisoned.

    Caches start as zeros rather than NaN: a kernel may load rows past a sequence's end into a tile
    and weight them by 0, which NaN would poison; a missed write still changes the result.
    """
    need = [-(-n // PAGE) for n in lens]
    num_blocks = sum(need) + 2
    order = torch.randperm(num_blocks, generator=gen).int()
    table = torch.full((len(lens), max(need) + 1), num_blocks + 5, dtype=torch.int32)
    taken = 0
    for b, n in enumerate(need):
        table[b, :n] = order[taken:taken + n]
        taken += n
    return num_blocks, table.to(device)


def write_single(pb: Problem, dtype, gen):
    """The whole batch in one cache through the ordinary fused_write_kv -> (cache, table, rotated q)."""
    num_blocks, table = shuffled_table(pb.total_lens, gen, pb.device)
    cache = torch.zeros(num_blocks, PAGE, 576, dtype=dtype, device=pb.device)
    q = pb.q_new.clone()
    for kv_a, starts, lens, q_arg in ((pb.kv_a_prefix, [0] * len(pb.prefix_lens), pb.prefix_lens, None),
                                      (pb.kv_a_new, pb.prefix_lens, pb.new_lens, q)):
        seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(pb.device)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)]).to(pb.device)
        slots = table[seq, positions // PAGE].long() * PAGE + positions % PAGE
        mla_kv.fused_write_kv(kv_a, pb.rms_weight, 1e-6, positions, pb.cos_sin, cache, slots, q=q_arg, validate=True)
    return cache, table, q


def write_rank(pb: Problem, dtype, cp, rank, gen):
    """This rank's cache: its tokens only, through cp_fused_write_kv -> (cache, local table, rotated q)."""
    local = [len(range(rank, n, cp)) for n in pb.total_lens]
    num_blocks, table = shuffled_table(local, gen, pb.device)
    cache = torch.zeros(num_blocks, PAGE, 576, dtype=dtype, device=pb.device)
    q = pb.q_new.clone()
    zeros = [0] * len(local)
    parallel.cp_fused_write_kv(pb.kv_a_prefix, pb.rms_weight, 1e-6, pb.cos_sin, cache, table, pb.cu(pb.prefix_lens),
                               pb.tensor(zeros), cp, rank, validate=True)
    parallel.cp_fused_write_kv(pb.kv_a_new, pb.rms_weight, 1e-6, pb.cos_sin, cache, table, pb.cu(pb.new_lens),
                               pb.tensor(pb.prefix_lens), cp, rank, q=q, validate=True)
    return cache, table, q


def errors(out, lse, ref_out, ref_lse):
    finite = torch.isfinite(ref_lse)
    rel = ((out.double() - ref_out).norm() / ref_out.norm()).item()
    lse_err = (lse.double()[finite] - ref_lse[finite]).abs().max().item()
    return rel, lse_err, bool(torch.isnan(out).any()) or not torch.equal(torch.isfinite(lse), finite)


def check_case(kind, heads, dtype, cp, rank, group, seed, device):
    """One check on this rank of the cp group -> its result row (combine_ranks joins the ranks' rows)."""
    if kind == "prefill":
        pb = Problem(seed, [0, 64, 300, 1200], [1, 17, 130, 513], heads, dtype, device)
    else:
        s_q = int(kind[-1])
        pb = Problem(seed, [0, 5, 700, 3000], [s_q] * 4, heads, dtype, device)
    cache, table, q = write_single(pb, dtype, torch.Generator().manual_seed(seed))
    local_cache, local_table, local_q = write_rank(pb, dtype, cp, rank, torch.Generator().manual_seed(seed + rank))
    kv_lens = pb.tensor(pb.total_lens)
    if kind == "prefill":
        cu = pb.cu(pb.new_lens)
        single = mla_kv.prefill(q, cache, table, cu, kv_lens, SCALE)
        partial = parallel.cp_prefill(local_q, local_cache, local_table, cu, kv_lens, SCALE, cp, rank)
        ref = reference.prefill(q.double(), cache.double(), table, cu, kv_lens, SCALE)
    else:
        shape = (len(pb.new_lens), pb.new_lens[0], heads, 576)
        single = mla_kv.decode(q.view(shape), cache, table, kv_lens, SCALE)
        partial = parallel.cp_decode(local_q.view(shape), local_cache, local_table, kv_lens, SCALE, cp, rank)
        ref = reference.decode(q.view(shape).double(), cache.double(), table, kv_lens, SCALE)
    merged = parallel.cp_merge(*partial, group)
    everyone = [torch.empty_like(merged[0]) for _ in range(cp)]
    dist.all_gather(everyone, merged[0].contiguous(), group=group)
    cp_rel, cp_lse, cp_bad = errors(*merged, *ref)
    one_rel, one_lse, one_bad = errors(*single, *ref)
    row = {"case": kind, "dtype": str(dtype).split(".")[1], "H": heads, "cp": cp,
           "cp_rel_err": cp_rel, "cp_lse_err": cp_lse, "1gpu_rel_err": one_rel, "1gpu_lse_err": one_lse,
           "cp_vs_1gpu": ((merged[0].double() - single[0].double()).norm() / single[0].double().norm()).item(),
           "q_same": torch.equal(local_q, q), "same_bits": all(bool((e == everyone[0]).all()) for e in everyone)}
    row["ok"] = (not cp_bad and not one_bad and cp_rel <= REL_TOL[dtype] and cp_lse <= LSE_TOL
                 and row["q_same"] and row["same_bits"])
    return row


# ------------------------------------------------------------------------------------ bench
def bench_case(batch, heads, cp, rank, group, dtype):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator(device="cuda").manual_seed(rank)
    local = CTX // cp
    num_blocks = batch * local // PAGE
    cache = torch.randn(num_blocks, PAGE, 576, device="cuda", dtype=dtype, generator=gen)
    table = torch.randperm(num_blocks, device="cuda", generator=gen).int().view(batch, -1)
    seq_lens = torch.full((batch,), CTX, dtype=torch.int32, device="cuda")
    q, schedule, workspace, out, lse = common.decode_buffers(batch, heads, local, dtype, gen)

    def attend(_):
        return parallel.cp_decode(q, cache, table, seq_lens, SCALE, cp, rank, out=out, lse=lse,
                                  workspace=workspace, schedule=schedule)

    attn = common.time_graph(attend, 1, calls=10, samples=11)
    merge = step = None
    if cp > 1:
        dist.barrier(group=group)
        merge = common.time_eager(lambda _: parallel.cp_merge(out, lse, group), 1, calls=10, samples=11)
        dist.barrier(group=group)
        step = common.time_eager(lambda i: parallel.cp_merge(*attend(i), group), 1, calls=10, samples=11)
    else:
        step = common.time_eager(attend, 1, calls=10, samples=11)
    return {"B": batch, "H": heads, "cp": cp, "attn_ms": attn * 1e3,
            "merge_ms": merge * 1e3 if merge is not None else None, "step_ms": step * 1e3,
            "cache_MiB/rank": cache.numel() * cache.element_size() / 2 ** 20,
            "peak_MiB/rank": torch.cuda.max_memory_allocated() / 2 ** 20}


def combine_ranks(rows, keys):
    """One row per case from the ranks' rows (same keys): the largest number, and bools all true."""
    cases = {}
    for r in rows:
        cases.setdefault(tuple(r[k] for k in keys), []).append(r)
    combined = []
    for same in cases.values():
        row = dict(same[0])
        for name, value in row.items():
            if isinstance(value, bool):
                row[name] = all(r[name] for r in same)
            elif isinstance(value, float):
                row[name] = max(r[name] for r in same)
        combined.append(row)
    return combined


# ----------------------------------------------------------------------------------- driver
def worker(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      **SAFE_ENV)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=device,
                            timeout=datetime.timedelta(minutes=5))
    try:
        sizes = [cp for cp in (2, 4, 8) if cp <= world]
        groups = {cp: dist.new_group(list(range(cp))) for cp in sizes}  # every rank creates every group
        groups[1] = None
        checks, benches = [], []
        if args.part in ("all", "check"):
            kinds = ["decode S_q=1", "decode S_q=3", "prefill"] if args.quick else \
                ["decode S_q=1", "decode S_q=2", "decode S_q=3", "prefill"]
            for cp in sizes:
                for dtype in (torch.float16, torch.bfloat16):
                    for heads in (16, 128):
                        for kind in kinds:
                            row = check_case(kind, heads, dtype, cp, rank, groups[cp], cp * 100 + heads, device) \
                                if rank < cp else None
                            checks.append(row)
                dist.barrier()
        if args.part in ("all", "bench"):
            grid = [(1, 16), (8, 128)] if args.quick else [(b, h) for h in (16, 128) for b in (1, 8)]
            for batch, heads in grid:
                for cp in (1, 2):
                    row = bench_case(batch, heads, cp, rank, groups[cp], torch.bfloat16) if rank < cp else None
                    every = [None] * world
                    dist.all_gather_object(every, row)
                    benches += [r for r in every if r is not None]
        everyone = [None] * world
        dist.all_gather_object(everyone, checks)
        if rank == 0:
            checks = combine_ranks([r for rows in everyone for r in rows if r is not None],
                                   ("case", "dtype", "H", "cp"))
            report(checks, combine_ranks(benches, ("B", "H", "cp")), world, args)
    finally:
        dist.destroy_process_group()


def report(checks, benches, world, args):
    failed = [r for r in checks if not r["ok"]]
    if checks:
        print(f"check: cp-merged kernels vs float64 reference and vs 1 GPU, {world} GPUs "
              "(tolerance: rel " + ", ".join(f"{str(d).split('.')[1]} {t:g}" for d, t in REL_TOL.items())
              + f", lse {LSE_TOL:g}); worst rank")
        common.print_table(checks, ["case", "dtype", "H", "cp", "cp_rel_err", "cp_lse_err", "1gpu_rel_err",
                                    "1gpu_lse_err", "cp_vs_1gpu", "q_same", "same_bits", "ok"])
    if benches:
        base = {(r["B"], r["H"]): r["step_ms"] for r in benches if r["cp"] == 1}
        for r in benches:
            r["speedup"] = base[(r["B"], r["H"])] / r["step_ms"]
        print(f"\nbench: decode S_q=1, ctx {CTX:,}, bf16, page {PAGE}; slowest rank")
        common.print_table(benches, ["B", "H", "cp", "attn_ms", "merge_ms", "step_ms", "speedup", "cache_MiB/rank",
                                     "peak_MiB/rank"])
    common.write_json(args.json, {"device": common.device_info(), "gpus": world, "checks": checks, "bench": benches})
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(checks)} checks failed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None, prog=None):
    name = prog or "bench_cp"
    ap = common.parser(__doc__, prog, plot=False)
    ap.add_argument("--gpus", type=int, default=0, help="GPUs to use (default: all visible, at most 8)")
    ap.add_argument("--part", choices=("all", "check", "bench"), default="all")
    args = ap.parse_args(argv)
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = min(args.gpus or found, found, 8)
    if world < 2:
        asked = f", --gpus {args.gpus}" if args.gpus else ""
        print(f"{name}: needs 2 or more CUDA GPUs (found {found}{asked}); run it on a multi-GPU machine "
              "(e.g. the device tool's nvidia-h200-x2 or larger)", file=sys.stderr)
        return 1
    if not mla_kv.kernels_available():
        print(f"{name}: mla_kv was built without its CUDA kernels", file=sys.stderr)
        return 1
    os.environ.update(SAFE_ENV)  # inherited by the spawned ranks
    try:
        mp.spawn(worker, args=(world, _free_port(), args), nprocs=world, join=True)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
