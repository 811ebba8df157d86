"""Benchmark of prefill: the absorbed kernel (mla_kv.prefill) against the tensor-core ceiling measured
in the same run, and the absorbed and expanded routes end to end side by side.

FLOPs of the absorbed kernel: 2176 per visible (query, key, head) triple (2 x 576 for the score and
2 x 512 for P.V); causally, query i of a sequence with q_len queries over kv_len keys sees
kv_len - q_len + i + 1 keys, so a whole prompt counts q(q+1)/2 pairs, not q^2.
Routes, both from the q_b_proj output [q_nope | q_pe] to the per-head attention output [T, H, v]:
  absorbed: q_lat = absorb_q(q_nope) (weights.py), prefill over the latent cache, project_out.
  expanded: gather_kv -> kv_b_proj GEMM over c_kv (per-head K_nope and V) -> K = [K_nope | k_pe
            broadcast to every head] -> torch SDPA (causal, bottom-right aligned for extends).
  expanded op: mla_kv.prefill_expanded (graph-timed, workspace given) with its default attention
            kernel (flash on sm80+), and on torch's memory-efficient kernel (what sm70 / sm75 run)
            beside that kernel alone over the same K and V ("mem-eff attn"): "mem-eff op overhead" is
            what the op's gathers, up-projections and merges add to it.
Random weights of the models' shapes: H=20 as GLM-4.7-Flash (nope 192, v 256), H=16 and H=128 as
DeepSeek (nope 128, v 128). Both routes compute the same attention; their relative difference is
printed as a check. Each case packs B sequences, B = max(1, 16K / kv_len).
Usage: mla-kv bench prefill [--quick] [--json FILE] [--plot FILE]
(or python bench/bench_prefill.py ... in a source tree)

--routes [--arch TAG] [--table FILE] measures the route chooser's table instead (mla_kv.routes): both
routes end to end (absorbed: absorb_q, prefill, project_out; expanded: prefill_expanded), graph-timed,
over q_len x cached prefix x {GLM H=20, DeepSeek H=16 and 128} for the absorbed kernel of TAG and the
expanded route's kernel on this GPU (the own Sm70 / Sm75 kernel for those tags, fp16; else torch's flash
kernel, bf16), and merges the TAG grid into FILE (the package's prefill_routes.json when it is given so).
The Sm70 / Sm75 tags run a smaller grid: on a newer GPU their mma instructions are emulated, slowly.
--routes --check times both routes at points between the table's (and at H=64, which it lacks) and
reports how much slower than the faster one choose_prefill_route's pick is.
"""
from __future__ import annotations

import datetime
import json
import math
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


import mla_kv
from mla_kv import routes
from mla_kv.bench import common
from mla_kv.weights import absorb_q, project_out, split_kv_b_proj

PAGE = 64
TOKENS_PER_CASE = 16384
MODELS = {16: ("DeepSeek", 128, 128), 20: ("GLM-4.7-Flash", 192, 256), 64: ("DeepSeek", 128, 128),
          128: ("DeepSeek", 128, 128)}
FLOPS_PER_PAIR = 2176
TARGET = (128, 8192, torch.bfloat16, 250.0)  # H, q = kv, dtype, TFLOP/s (issue 4)


def visible_pairs(q_len: int, kv_len: int) -> int:
    """Causal (query, key) pairs of one sequence whose q_len queries are its last kv positions."""
    return q_len * (kv_len - q_len) + q_len * (q_len + 1) // 2


def timed(fn, graph: bool) -> float:
    """Median seconds per call, with calls and samples scaled to the op (cases span 0.1 to 200 ms)."""
    fn(0)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(0)
    end.record()
    end.synchronize()
    estimate = start.elapsed_time(end) / 1e3
    calls = max(1, min(20, int(0.05 / max(estimate, 1e-6))))
    samples = 5 if estimate > 0.02 else 11
    timer = common.time_graph if graph else common.time_eager
    return timer(fn, 1, calls=calls, samples=samples, warmup=1)


def route_case(q_len, prefix, heads, dtype, arch, gen) -> dict:
    """Both routes end to end for one chunk of q_len new tokens over `prefix` cached ones, each sequence
    of a batch that fills TOKENS_PER_CASE new tokens (at most 16 sequences)."""
    model, nope, v_dim = MODELS[heads]
    kv_len = prefix + q_len
    batch = max(1, min(16, TOKENS_PER_CASE // q_len))
    t_q = batch * q_len
    scale = 1 / math.sqrt(nope + 64)
    blocks_per_seq = -(-kv_len // PAGE)
    cache = torch.randn(batch * blocks_per_seq, PAGE, 576, device="cuda", dtype=dtype, generator=gen)
    table = torch.randperm(batch * blocks_per_seq, device="cuda", generator=gen).int().view(batch, blocks_per_seq)
    cu_q = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * q_len
    kv_lens = torch.full((batch,), kv_len, device="cuda", dtype=torch.int32)
    q = torch.randn(t_q, heads, nope + 64, device="cuda", dtype=dtype, generator=gen)
    w_kv_b = torch.randn(heads * (nope + v_dim), 512, device="cuda", dtype=dtype, generator=gen) / math.sqrt(512)
    w_uk, w_uv = (w.contiguous() for w in split_kv_b_proj(w_kv_b, heads, nope, v_dim))
    schedule = mla_kv.attention_schedule(batch, q_len, heads, blocks_per_seq * PAGE, total_q_tokens=t_q, arch=arch)
    workspace = torch.empty(max(schedule.workspace_bytes, 16), dtype=torch.uint8, device="cuda")
    o_lat = torch.empty(t_q, heads, 512, device="cuda", dtype=dtype)
    lse = torch.empty(t_q, heads, device="cuda")

    def absorbed(i):
        q_lat = torch.cat([absorb_q(q[..., :nope], w_uk), q[..., nope:]], dim=-1)
        o = mla_kv.prefill(q_lat, cache, table, cu_q, kv_lens, scale, out=o_lat, lse=lse, workspace=workspace,
                           schedule=schedule, arch=arch)[0]
        return project_out(o, w_uv)

    bounds = dict(max_q_len=q_len, max_kv_len=kv_len, max_prefix_len=prefix)
    op_ws = torch.empty(mla_kv.prefill_expanded_workspace_size(t_q, batch, heads, nope, v_dim, dtype=dtype, **{
        k: v for k, v in bounds.items() if k != "max_q_len"}), dtype=torch.uint8, device="cuda")
    op_out = torch.empty(t_q, heads, v_dim, device="cuda", dtype=dtype)
    op_lse = torch.empty(t_q, heads, device="cuda")
    own = arch in ("sm70", "sm75")

    def expanded(i):
        return mla_kv.prefill_expanded(q, cache, table, cu_q, kv_lens, w_uk, w_uv, scale, out=op_out, lse=op_lse,
                                       workspace=op_ws, arch=arch if own else None, **bounds)[0]

    want = absorbed(0).float()
    diff = ((expanded(0).float() - want).norm() / want.norm()).item()
    t_abs, t_exp = timed(absorbed, graph=True), timed(expanded, graph=True)
    return {"tag": arch, "model": model, "d_nope": nope, "d_v": v_dim, "H": heads, "B": batch, "q_len": q_len,
            "prefix": prefix, "absorbed_ms": t_abs * 1e3, "expanded_ms": t_exp * 1e3,
            "expanded/absorbed": t_exp / t_abs, "winner": "absorbed" if t_abs <= t_exp else "expanded",
            "flop rule": routes.flop_rule(q_len, prefix, nope, v_dim), "rel_diff": diff}


ROUTE_GRIDS = {  # (q_lens, prefixes, head counts): the mma.sync tags of newer GPUs, and the emulated ones
    "native": ((128, 512, 2048, 8192), (0, 2048, 16384, 65536), (20, 16, 128)),
    "emulated": ((128, 512, 2048), (0, 2048, 16384), (20, 16)),
    # --routes --check: points between the table's (and H=64, which it lacks), where the chooser
    # interpolates
    "check": ((256, 1024, 4096), (1024, 8192, 32768), (20, 16, 64, 128)),
}


def routes_main(args) -> int:
    arch = args.arch or common.kernel_arch(torch.float16).name
    emulated = arch in ("sm70", "sm75") and torch.cuda.get_device_capability() >= (8, 0)
    if args.check:
        return routes_check(arch, torch.float16 if arch in ("sm70", "sm75") else torch.bfloat16, args)
    q_lens, prefixes, head_counts = ROUTE_GRIDS["emulated" if emulated else "native"]
    dtype = torch.float16 if arch in ("sm70", "sm75") else torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for heads in head_counts:
        for q_len in q_lens:
            for prefix in prefixes:
                rows.append(route_case(q_len, prefix, heads, dtype, arch, gen))
                torch.cuda.empty_cache()
    common.print_table(rows, ["tag", "model", "H", "B", "q_len", "prefix", "absorbed_ms", "expanded_ms",
                              "expanded/absorbed", "winner", "flop rule", "rel_diff"])
    agree = sum(r["winner"] == r["flop rule"] for r in rows)
    print(f"the FLOP rule picks the faster route in {agree} of {len(rows)} cases")
    common.write_json(args.json, {"device": common.device_info(), "rows": rows})
    if args.table:
        try:
            with open(args.table) as f:
                table = json.load(f)
        except FileNotFoundError:
            table = {"tags": {}, "measured": {}}
        table["tags"][arch] = routes.grid_from_rows(rows)
        table["measured"][arch] = (f"{datetime.date.today()}, {common.device_info()['gpu']}, "
                                   f"mla-kv bench prefill --routes --arch {arch}")
        with open(args.table, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"wrote the {arch} grid to {args.table}")
    return 0


def routes_check(arch, dtype, args) -> int:
    """Both routes at the "check" grid's points against choose_prefill_route's pick (the package table):
    how much slower than the faster route the pick is."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    q_lens, prefixes, head_counts = ROUTE_GRIDS["check"]
    rows = []
    for heads in head_counts:
        for q_len in q_lens:
            for prefix in prefixes:
                r = route_case(q_len, prefix, heads, dtype, arch, gen)
                pick = routes.choose_prefill_route(q_len, q_len + prefix, heads, r["d_nope"], r["d_v"], arch=arch)
                r["pick"] = pick
                r["pick loss %"] = 100 * (r[f"{pick}_ms"] / min(r["absorbed_ms"], r["expanded_ms"]) - 1)
                rows.append(r)
                torch.cuda.empty_cache()
    common.print_table(rows, ["tag", "model", "H", "B", "q_len", "prefix", "absorbed_ms", "expanded_ms", "winner",
                              "pick", "pick loss %", "flop rule"])
    worst = max(rows, key=lambda r: r["pick loss %"])
    print(f"choose_prefill_route: the faster route in {sum(r['pick'] == r['winner'] for r in rows)} of {len(rows)} "
          f"points; worst {worst['pick loss %']:.1f}% slower (H={worst['H']} q={worst['q_len']} "
          f"prefix={worst['prefix']}); within 5% at {sum(r['pick loss %'] <= 5 for r in rows)}")
    common.write_json(args.json, {"device": common.device_info(), "rows": rows})
    return 0


def run_case(label, q_len, kv_len, heads, dtype, gen):
    model, nope, v_dim = MODELS[heads]
    batch = max(1, TOKENS_PER_CASE // kv_len)
    t_q, t_kv = batch * q_len, batch * kv_len
    scale = 1 / math.sqrt(nope + 64)
    blocks_per_seq = -(-kv_len // PAGE)
    num_blocks = batch * blocks_per_seq
    cache = torch.randn(num_blocks, PAGE, 576, device="cuda", dtype=dtype, generator=gen)
    table = torch.randperm(num_blocks, device="cuda", generator=gen).int().view(batch, blocks_per_seq)
    cu_q = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * q_len
    cu_kv = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * kv_len
    kv_lens = torch.full((batch,), kv_len, device="cuda", dtype=torch.int32)
    q_nope = torch.randn(t_q, heads, nope, device="cuda", dtype=dtype, generator=gen)
    q_pe = torch.randn(t_q, heads, 64, device="cuda", dtype=dtype, generator=gen)
    w_kv_b = torch.randn(heads * (nope + v_dim), 512, device="cuda", dtype=dtype, generator=gen) / math.sqrt(512)
    w_uk, w_uv = split_kv_b_proj(w_kv_b, heads, nope, v_dim)

    # Absorbed: the kernel alone (graph-timed), and with the per-token weight products around it.
    q_abs = torch.cat([absorb_q(q_nope, w_uk), q_pe], dim=-1)
    schedule = mla_kv.attention_schedule(batch, q_len, heads, blocks_per_seq * PAGE, total_q_tokens=t_q)
    workspace = torch.empty(max(schedule.workspace_bytes, 16), dtype=torch.uint8, device="cuda")
    o_lat = torch.empty(t_q, heads, 512, device="cuda", dtype=dtype)
    lse = torch.empty(t_q, heads, device="cuda")

    def prefill(q):
        return mla_kv.prefill(q, cache, table, cu_q, kv_lens, scale, out=o_lat, lse=lse, workspace=workspace,
                              schedule=schedule)[0]

    def absorbed_route(i):
        return project_out(prefill(torch.cat([absorb_q(q_nope, w_uk), q_pe], dim=-1)), w_uv)

    # Expanded: per-head K and V materialized from the gathered latent rows.
    q_exp = torch.cat([q_nope, q_pe], dim=-1).view(batch, q_len, heads, nope + 64).transpose(1, 2)
    rows = torch.empty(t_kv, 576, device="cuda", dtype=dtype)
    mask = None if q_len == kv_len else causal_lower_right(q_len, kv_len)

    def expanded_route(i):
        mla_kv.gather_kv(cache, table, cu_kv, out=rows)
        kv = torch.matmul(rows[:, :512], w_kv_b.t()).view(t_kv, heads, nope + v_dim)
        k = torch.cat([kv[..., :nope], rows[:, None, 512:].expand(t_kv, heads, 64)], dim=-1)
        k = k.view(batch, kv_len, heads, nope + 64).transpose(1, 2)
        v = kv[..., nope:].view(batch, kv_len, heads, v_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q_exp, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
        return o.transpose(1, 2).reshape(t_q, heads, v_dim)

    # The expanded-route op, and torch's memory-efficient kernel alone over the whole K and V.
    q_packed = torch.cat([q_nope, q_pe], dim=-1)
    w_uk_op, w_uv_op = w_uk.contiguous(), w_uv.contiguous()  # an engine keeps them so, once
    bounds = dict(max_q_len=q_len, max_kv_len=kv_len, max_prefix_len=kv_len - q_len)
    op_ws = torch.empty(mla_kv.prefill_expanded_workspace_size(t_q, batch, heads, nope, v_dim, dtype=dtype, **{
        k: v for k, v in bounds.items() if k != "max_q_len"}), dtype=torch.uint8, device="cuda")
    op_out = torch.empty(t_q, heads, v_dim, device="cuda", dtype=dtype)
    op_lse = torch.empty(t_q, heads, device="cuda")

    def expanded_op(i, kernel="auto"):
        return mla_kv.prefill_expanded(q_packed, cache, table, cu_q, kv_lens, w_uk_op, w_uv_op, scale, out=op_out,
                                       lse=op_lse, workspace=op_ws, attention_kernel=kernel, **bounds)[0]

    mla_kv.gather_kv(cache, table, cu_kv, out=rows)
    kv_all = torch.matmul(rows[:, :512], w_kv_b.t()).view(t_kv, heads, nope + v_dim)
    k_all = torch.cat([kv_all[..., :nope], rows[:, None, 512:].expand(t_kv, heads, 64)], dim=-1)[None]
    v_all = kv_all[..., nope:].contiguous()[None]

    def mem_efficient_attention(i):  # custom_mask_type 2: causal, bottom-right aligned
        return torch.ops.aten._efficient_attention_forward(q_packed[None], k_all, v_all, None, cu_q, cu_kv, q_len,
                                                           kv_len, 0.0, 2, True, scale=scale)[0]

    want = expanded_route(0).float()
    rel_diff = ((absorbed_route(0).float() - want).norm() / want.norm()).item()
    op_diff = ((expanded_op(0).float() - want).norm() / want.norm()).item()
    kernel = timed(lambda i: prefill(q_abs), graph=True)
    absorbed = timed(absorbed_route, graph=False)
    expanded = timed(expanded_route, graph=False)
    op = timed(expanded_op, graph=True)
    op_mem_efficient = timed(lambda i: expanded_op(i, "mem_efficient"), graph=True)
    attention = timed(mem_efficient_attention, graph=True)
    flops = batch * visible_pairs(q_len, kv_len) * heads * FLOPS_PER_PAIR
    return {"case": label, "model": model, "dtype": str(dtype).split(".")[1], "B": batch, "q_len": q_len,
            "kv_len": kv_len, "H": heads, "kernel_ms": kernel * 1e3, "TFLOP/s": flops / kernel / 1e12,
            "absorbed_ms": absorbed * 1e3, "expanded_ms": expanded * 1e3,
            "expanded/absorbed": expanded / absorbed, "winner": "absorbed" if absorbed <= expanded else "expanded",
            "rel_diff": rel_diff, "op_ms": op * 1e3, "op mem-eff_ms": op_mem_efficient * 1e3,
            "mem-eff attn_ms": attention * 1e3, "mem-eff op overhead %": 100 * (op_mem_efficient / attention - 1),
            "op_diff": op_diff}


def recommendation(rows) -> str:
    """One line: per head count, the cases where each route wins end to end (dtypes averaged)."""
    ratios = {}
    for r in rows:
        ratios.setdefault((r["H"], r["case"]), []).append(r["expanded/absorbed"])
    parts = []
    for heads in sorted({h for h, _ in ratios}):
        cases = [(case, statistics.fmean(v)) for (h, case), v in ratios.items() if h == heads]
        expanded_wins = [f"{case} (x{1 / ratio:.2f})" for case, ratio in cases if ratio < 1]
        if not expanded_wins:
            best = min(ratio for _, ratio in cases)
            parts.append(f"H={heads}: absorbed everywhere (>= x{best:.2f})")
        elif len(expanded_wins) == len(cases):
            parts.append(f"H={heads}: expanded everywhere")
        else:
            parts.append(f"H={heads}: expanded for {', '.join(expanded_wins)}, absorbed otherwise")
    return "recommendation (end to end, faster route): " + "; ".join(parts)


def main(argv=None, prog=None):
    ap = common.parser(__doc__, prog)
    ap.add_argument("--routes", action="store_true", help="measure the route chooser's table instead")
    ap.add_argument("--arch", default=None, choices=("sm70", "sm75", "sm80", "sm90"),
                    help="--routes: the absorbed kernel's variant (default: the GPU's best)")
    ap.add_argument("--table", default="", metavar="FILE", help="--routes: merge the grid into FILE")
    ap.add_argument("--check", action="store_true",
                    help="--routes: time both routes between the table's points against choose_prefill_route")
    args = common.parse(ap, argv, prog or "bench_prefill")
    if args is None:
        return 1
    if args.routes:
        return routes_main(args)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ceilings = {d: common.mma_ceiling(d) for d in (torch.float16, torch.bfloat16)}
    if args.quick:
        shapes = [("q=kv=4K", 4096, 4096), ("q=kv=8K", 8192, 8192), ("extend q512/kv16K", 512, 16384)]
        grid = [(s, h, torch.bfloat16) for s in shapes for h in (20, 128)]
    else:
        shapes = [("q=kv=1K", 1024, 1024), ("q=kv=4K", 4096, 4096), ("q=kv=8K", 8192, 8192),
                  ("q=kv=16K", 16384, 16384), ("extend q512/kv16K", 512, 16384)]
        grid = [(s, h, d) for d in (torch.float16, torch.bfloat16) for h in (16, 20, 128) for s in shapes]
    rows = []
    for (label, q_len, kv_len), heads, dtype in grid:
        r = run_case(label, q_len, kv_len, heads, dtype, gen)
        r["% mma"] = 100 * r["TFLOP/s"] * 1e12 / ceilings[dtype]
        rows.append(r)
        torch.cuda.empty_cache()
    print("tensor-core ceiling (the instruction the kernel uses): " + common.tflops_text(ceilings))
    common.print_table(rows, ["case", "model", "dtype", "B", "H", "kernel_ms", "TFLOP/s", "% mma", "absorbed_ms",
                              "expanded_ms", "expanded/absorbed", "winner", "rel_diff", "op_ms",
                              "op mem-eff_ms", "mem-eff attn_ms", "mem-eff op overhead %", "op_diff"])
    heads, seq, dtype, goal = TARGET
    name = str(dtype).split(".")[1]
    hit = [r for r in rows if r["H"] == heads and r["q_len"] == r["kv_len"] == seq and r["dtype"] == name]
    if hit:
        print(f"target H={heads} q=kv={seq} {name}: {hit[0]['TFLOP/s']:.0f} TFLOP/s "
              f"({'met' if hit[0]['TFLOP/s'] >= goal else 'MISSED'}, goal {goal:.0f})")
    print(recommendation(rows))
    common.write_json(args.json, {"device": common.device_info(),
                                  "mma_TFLOPs": {str(k): v / 1e12 for k, v in ceilings.items()}, "rows": rows})
    common.write_plot(args.plot, f"prefill (absorbed kernel) on {common.device_info()['gpu']}", rows,
                      ["case", "dtype", "H"], ["% mma"], "tensor-core ceiling " + common.tflops_text(ceilings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
