"""Benchmark of the prefill attention kernels of both routes, attention alone, fp16, causal: the absorbed
kernel (mla_kv.prefill, each variant) over the latent cache against the expanded-form kernels over
per-head K and V (mla_kv.expanded_attention's Sm70 / Sm75 variants, torch's memory-efficient and flash
kernels), each against the tensor-core ceiling of its own instruction measured in the same run.

FLOPs: the absorbed kernel does 2176 per visible (query, key, head) (2 x 576 + 2 x 512), the expanded
form 2 x (d_qk + d_v): 640 at DeepSeek / Kimi dims (192 / 128), 1,024 at GLM-4.7-Flash's (256 / 256).
Each row's TFLOP/s counts its own form's FLOPs; "x absorbed" is the absorbed kernel of the same tag's
time over the row's (the issue's target: >= 1.8x at GLM dims and >= 2.8x at DeepSeek dims for Sm70 /
Sm75), "x mem-eff" torch's memory-efficient kernel's time over the row's. The flash kernel runs
where torch has one (sm80+), with V zero-padded to d_qk at DeepSeek dims (it takes one head dim).
Ceilings: the Sm70 / Sm75 / Sm80 mma.sync and Sm90 wgmma rates; torch's kernels use m16n8k16 (Sm80) from Ampere
up, the GPU's own tag's instruction below.
"rel_diff": each row's out against the memory-efficient kernel's (a check, not a tolerance).
"prefill_expanded (K)": the whole expanded route from the latent cache (gather_kv, the up-projection
GEMMs, kernel K on the new tokens and on each prefix chunk, the merges), "op overhead %" what it adds to
K alone over the same keys.
Usage: mla-kv bench expanded [--quick] [--json FILE] [--plot FILE]
"""
from __future__ import annotations

import math
import sys

import torch

import mla_kv
from mla_kv.bench import common
from mla_kv.bench.prefill import timed, visible_pairs

PAGE = 64
DIMS = {"GLM": (192, 256), "DeepSeek": (128, 128)}  # (nope, v)
ABSORBED_FLOPS_PER_PAIR = 2176
CAUSAL_BOTTOM_RIGHT = 2  # _efficient_attention_forward's custom_mask_type


def run_case(label, model, heads, batch, q_len, kv_len, gen, tags, ceilings):
    nope, d_v = DIMS[model]
    d_qk, dtype = nope + 64, torch.float16
    t_q, t_kv = batch * q_len, batch * kv_len
    scale = 1 / math.sqrt(d_qk)
    pairs = batch * visible_pairs(q_len, kv_len) * heads
    cu_q = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * q_len
    cu_k = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * kv_len
    # Scores of std ~2.5: softmax neither uniform nor one-hot.
    q = torch.randn(t_q, heads, d_qk, device="cuda", dtype=dtype, generator=gen) * (2.5 / d_qk ** 0.25)
    k = torch.randn(t_kv, heads, d_qk, device="cuda", dtype=dtype, generator=gen) / d_qk ** 0.25
    v = torch.randn(t_kv, heads, d_v, device="cuda", dtype=dtype, generator=gen)
    rows = []

    def mem_efficient(i):
        return torch.ops.aten._efficient_attention_forward(q[None], k[None], v[None], None, cu_q, cu_k, q_len, kv_len,
                                                           0.0, CAUSAL_BOTTOM_RIGHT, True, scale=scale)[0][0]

    want = mem_efficient(0).float()
    t_mem = timed(mem_efficient, graph=True)

    def row(kernel, tag, seconds, flops_per_pair, ceiling, out, absorbed_s=None):
        tflops = pairs * flops_per_pair / seconds / 1e12
        diff = None if out is None else ((out.float() - want).norm() / want.norm()).item()
        rows.append({"case": label, "model": model, "H": heads, "B": batch, "q_len": q_len, "kv_len": kv_len,
                     "kernel": kernel, "tag": tag, "ms": seconds * 1e3, "TFLOP/s": tflops,
                     "% mma": 100 * tflops * 1e12 / ceiling,
                     "x absorbed": None if absorbed_s is None else absorbed_s / seconds,
                     "x mem-eff": t_mem / seconds, "rel_diff": diff})

    expanded_flops = 2 * (d_qk + d_v)
    # torch's kernels run their build for this GPU: the mma.sync of sm80 (m16n8k16) from Ampere up, the
    # GPU's own tag's below.
    torch_tag = "sm80" if "sm80" in tags else tags[-1]
    row("torch mem-efficient", torch_tag, t_mem, expanded_flops, ceilings[torch_tag], want)
    alone = {}  # kernel -> seconds, for the whole op's overhead below
    if torch.cuda.get_device_capability() >= (8, 0):
        width = max(d_qk, d_v)
        pad = lambda t: t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))
        qf, kf, vf = pad(q), pad(k), pad(v)

        def flash(i):
            return torch.ops.aten._flash_attention_forward(qf, kf, vf, cu_q, cu_k, q_len, kv_len, 0.0, True, False,
                                                           scale=scale)[0]
        alone["flash"] = timed(flash, graph=True)
        row("torch flash", "sm80", alone["flash"], expanded_flops, ceilings["sm80"], flash(0)[..., :d_v])

    # The absorbed kernel over a latent cache with the same attention shape (its own random data: the
    # time, not the values, is compared).
    blocks_per_seq = -(-kv_len // PAGE)
    cache = torch.randn(batch * blocks_per_seq, PAGE, 576, device="cuda", dtype=dtype, generator=gen) * 0.5
    table = torch.randperm(batch * blocks_per_seq, device="cuda", generator=gen).int().view(batch, blocks_per_seq)
    kv_lens = torch.full((batch,), kv_len, device="cuda", dtype=torch.int32)
    q_abs = torch.randn(t_q, heads, 576, device="cuda", dtype=dtype, generator=gen) * 0.1
    absorbed = {}
    for tag in tags:
        schedule = mla_kv.attention_schedule(batch, q_len, heads, blocks_per_seq * PAGE, total_q_tokens=t_q, arch=tag)
        ws = torch.empty(max(schedule.workspace_bytes, 16), dtype=torch.uint8, device="cuda")
        o_lat = torch.empty(t_q, heads, 512, device="cuda", dtype=dtype)
        lse = torch.empty(t_q, heads, device="cuda")

        def prefill(i, tag=tag, schedule=schedule, ws=ws, o_lat=o_lat, lse=lse):
            return mla_kv.prefill(q_abs, cache, table, cu_q, kv_lens, scale, out=o_lat, lse=lse, workspace=ws,
                                  schedule=schedule, arch=tag)[0]
        absorbed[tag] = timed(prefill, graph=True)
        row("mla_kv absorbed", tag, absorbed[tag], ABSORBED_FLOPS_PER_PAIR, ceilings[tag], None)
    out = torch.empty(t_q, heads, d_v, device="cuda", dtype=dtype)
    lse = torch.empty(t_q, heads, device="cuda")
    own_tags = [t for t in ("sm70", "sm75") if t in tags]
    for tag in own_tags:
        def own(i, tag=tag):
            return mla_kv.expanded_attention(q, k, v, cu_q, cu_k, scale, causal=True, max_q_len=q_len, out=out,
                                             lse=lse, arch=tag)[0]
        out.fill_(float("nan"))
        got = own(0).clone()
        alone[tag] = timed(own, graph=True)
        row("mla_kv expanded", tag, alone[tag], expanded_flops, ceilings[tag], got, absorbed[tag])

    # The whole expanded route from the latent cache (prefill_expanded: gather, up-projections, the
    # attention, merges), on the best own kernel and on flash: "op overhead %" is what it adds to that
    # kernel alone.
    w_uk = torch.randn(heads, nope, 512, device="cuda", dtype=dtype, generator=gen) / 512 ** 0.5
    w_uv = torch.randn(heads, d_v, 512, device="cuda", dtype=dtype, generator=gen) / 512 ** 0.5
    bounds = dict(max_q_len=q_len, max_kv_len=kv_len, max_prefix_len=kv_len - q_len)
    op_ws = torch.empty(mla_kv.prefill_expanded_workspace_size(t_q, batch, heads, nope, d_v, dtype=dtype, **{
        n: b for n, b in bounds.items() if n != "max_q_len"}), dtype=torch.uint8, device="cuda")
    kernels = [(own_tags[-1], "mla_kv", own_tags[-1])] + ([("flash", "flash", None)] if "flash" in alone else [])
    for name, kernel, arch in kernels:
        def op(i, kernel=kernel, arch=arch):
            return mla_kv.prefill_expanded(q, cache, table, cu_q, kv_lens, w_uk, w_uv, scale, out=out, lse=lse,
                                           workspace=op_ws, attention_kernel=kernel, arch=arch, **bounds)[0]
        seconds, tag = timed(op, graph=True), arch or "sm80"
        row(f"prefill_expanded ({name})", tag, seconds, expanded_flops, ceilings[tag], None, absorbed[tag])
        rows[-1]["op overhead %"] = 100 * (seconds / alone[name] - 1)
    return rows


def main(argv=None, prog=None):
    args = common.parse(common.parser(__doc__, prog), argv, prog or "bench_expanded")
    if args is None:
        return 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    cc = torch.cuda.get_device_capability()
    tags = [t for t, need in (("sm70", (7, 0)), ("sm75", (7, 5)), ("sm80", (8, 0)), ("sm90", (9, 0))) if cc >= need]
    ceilings = {t: common.mma_ceiling(torch.float16, t) for t in tags}
    # (label, model, H, B, q_len, kv_len)
    cases = [("B4 x 4K", "GLM", 20, 4, 4096, 4096), ("B4 x 4K", "DeepSeek", 20, 4, 4096, 4096),
             ("extend B4 q512/kv8K", "GLM", 20, 4, 512, 8192)]
    if not args.quick:
        cases += [("1 x 16K", "GLM", 20, 1, 16384, 16384), ("1 x 16K", "DeepSeek", 20, 1, 16384, 16384),
                  ("2 x 8K", "DeepSeek", 128, 2, 8192, 8192)]
    rows = []
    for case in cases:
        rows += run_case(*case, gen, tags, ceilings)
        torch.cuda.empty_cache()
    print("tensor-core ceilings (fp16): " + ", ".join(f"{t} {v / 1e12:,.0f} TFLOP/s" for t, v in ceilings.items()))
    common.print_table(rows, ["case", "model", "H", "kernel", "tag", "ms", "TFLOP/s", "% mma", "x absorbed",
                              "x mem-eff", "rel_diff", "op overhead %"])
    common.write_json(args.json, {"device": common.device_info(),
                                  "mma_TFLOPs": {t: v / 1e12 for t, v in ceilings.items()}, "rows": rows})
    common.write_plot(args.plot, f"prefill attention, both routes, on {common.device_info()['gpu']}", rows,
                      ["case", "model", "kernel", "tag"], ["% mma"], "each kernel's own mma ceiling")
    return 0


if __name__ == "__main__":
    sys.exit(main())
