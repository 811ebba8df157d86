"""Which prefill route is faster for a chunk: "absorbed" (absorb_q, mla_kv.prefill over the latent cache,
project_out) or "expanded" (mla_kv.prefill_expanded: up-project the latent, then ordinary attention).

The decision comes from end-to-end times measured by ``mla-kv bench prefill --routes`` (both routes,
graph-timed, per arch tag, head dims, head count, chunk q_len and cached prefix) and kept in the package
as prefill_routes.json. Counting FLOPs alone, expanding a chunk over a cached prefix pays from ~171
queries per chunk at DeepSeek dims and ~398 at GLM dims (the up-projection of the prefix costs
2 x 512 x H x (d_nope + d_v) per key, the absorbed kernel 2,176 - 2 (d_qk + d_v) more per (query, key,
head)); the measured table replaces that estimate, since the kernels' efficiencies differ by arch.

Between measured points the log of the time ratio is interpolated bilinearly in (log q_len,
log(prefix + 1)) and clamped at the grid's edges; the nearest measured head count of the same dims is
used. A tag without measurements falls back to the FLOP rule.
"""
from __future__ import annotations

import functools
import json
import math
from bisect import bisect_right
from pathlib import Path
from typing import Dict, Optional, Tuple

from ._checks import integer

TABLE = Path(__file__).with_name("prefill_routes.json")
ROUTES = ("absorbed", "expanded")
ABSORBED_FLOPS_PER_PAIR = 2176


@functools.lru_cache(maxsize=None)
def measured_table(path: Optional[str] = None) -> dict:
    """The measured table: {"tags": {tag: {"d_nope/d_v": {heads: {"q_lens": [...], "prefixes": [...],
    "log_ratio": [[ln(expanded / absorbed) per prefix] per q_len]}}}}, "measured": {tag: "date, GPU, command"}}."""
    with open(path or TABLE) as f:
        return json.load(f)


def flop_rule(q_len: int, prefix: int, d_nope: int, d_v: int) -> str:
    """The FLOP count's answer (per head): the expanded route spends 2 (d_qk + d_v) per causal (query, key)
    pair and 2 x 512 x (d_nope + d_v) per key up-projected (prefix and chunk); the absorbed route 2,176 per
    pair and the same per query (absorb_q and project_out)."""
    pairs = q_len * prefix + q_len * (q_len + 1) // 2
    projection = 2 * 512 * (d_nope + d_v)
    expanded = 2 * (d_nope + 64 + d_v) * pairs + projection * (prefix + q_len)
    absorbed = ABSORBED_FLOPS_PER_PAIR * pairs + projection * q_len
    return "expanded" if expanded <= absorbed else "absorbed"


def _interpolate(grid: dict, q_len: int, prefix: int) -> float:
    """ln(expanded / absorbed) at (q_len, prefix), bilinear in (ln q, ln(prefix + 1)), clamped."""
    xs = [math.log(q) for q in grid["q_lens"]]
    ys = [math.log(p + 1) for p in grid["prefixes"]]
    z = grid["log_ratio"]

    def bracket(values, v):
        v = min(max(v, values[0]), values[-1])
        i = min(max(bisect_right(values, v) - 1, 0), max(len(values) - 2, 0))
        if len(values) == 1:
            return 0, 0, 0.0
        return i, i + 1, (v - values[i]) / (values[i + 1] - values[i])

    i0, i1, tx = bracket(xs, math.log(max(q_len, 1)))
    j0, j1, ty = bracket(ys, math.log(prefix + 1))
    top = z[i0][j0] * (1 - ty) + z[i0][j1] * ty
    bottom = z[i1][j0] * (1 - ty) + z[i1][j1] * ty
    return top * (1 - tx) + bottom * tx


def choose_prefill_route(q_len: int, kv_len: int, num_heads: int, d_nope: int, d_v: int, *,
                         arch: Optional[str] = None, table: Optional[dict] = None) -> str:
    """"absorbed" or "expanded" for a chunk of q_len new tokens whose sequence then holds kv_len positions
    (prefix = kv_len - q_len), at num_heads heads of dims (d_nope + 64, d_v). ``arch``: the kernel variant
    (sm70 ... sm90), default the current GPU's best (the FLOP rule without a GPU). ``table``: a
    measured_table()-shaped dict instead of the package's."""
    q_len, kv_len = integer("q_len", q_len, 1), integer("kv_len", kv_len, 1)
    if kv_len < q_len:
        raise ValueError(f"kv_len: must include the chunk's q_len = {q_len} tokens, got {kv_len}")
    num_heads, d_nope, d_v = (integer(n, v, 1) for n, v in (("num_heads", num_heads), ("d_nope", d_nope), ("d_v", d_v)))
    prefix = kv_len - q_len
    tag = arch if arch is not None else _device_tag()
    grids = (table or measured_table()).get("tags", {}).get(tag or "", {}).get(f"{d_nope}/{d_v}")
    if not grids:
        return flop_rule(q_len, prefix, d_nope, d_v)
    heads = min(grids, key=lambda h: (abs(math.log(int(h) / num_heads)), int(h)))
    return "expanded" if _interpolate(grids[heads], q_len, prefix) < 0 else "absorbed"


def _device_tag() -> Optional[str]:
    """The current GPU's best attention variant (sm70 ... sm90), None without one."""
    import torch

    from ._compiled import _C

    if _C is None or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    tag = _C.resolve_arch(_C.Arch.auto, major * 10 + minor)
    return None if tag == _C.Arch.auto else tag.name


def grid_from_rows(rows) -> Dict[str, Dict[str, dict]]:
    """{"d_nope/d_v": {heads: grid}} from bench rows with keys d_nope, d_v, H, q_len, prefix, absorbed_ms,
    expanded_ms (a full q_len x prefix grid per (dims, heads))."""
    out: Dict[str, Dict[str, dict]] = {}
    cells: Dict[Tuple[str, str], Dict[Tuple[int, int], float]] = {}
    for r in rows:
        key = (f"{r['d_nope']}/{r['d_v']}", str(r["H"]))
        cells.setdefault(key, {})[(r["q_len"], r["prefix"])] = math.log(r["expanded_ms"] / r["absorbed_ms"])
    for (dims, heads), c in cells.items():
        q_lens, prefixes = sorted({q for q, _ in c}), sorted({p for _, p in c})
        missing = [(q, p) for q in q_lens for p in prefixes if (q, p) not in c]
        if missing:
            raise ValueError(f"rows: the {dims} H={heads} grid lacks (q_len, prefix) {missing[:3]}")
        out.setdefault(dims, {})[heads] = {"q_lens": q_lens, "prefixes": prefixes,
                                           "log_ratio": [[round(c[(q, p)], 4) for p in prefixes] for q in q_lens]}
    return out
