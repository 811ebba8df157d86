"""The attention family's one dispatch room (attention_launch, csrc/kernels/attention/attention.cu) against
README's table of which kernel a launch takes.

Each README row names a tag, GPU classes, a cache and a range of query rows per sequence; for every
class, cache kind and row count it covers (q_len 1 x H heads, and q_len 2 x H / 2), the C++ answer must be
the row's kernel, CTA shape, tiles in flight, tile loads and split-KV merge (at 1, 2 and 4 splits). Every
(tag, class, cache, rows) point must be covered by exactly one row, so a choice the room makes that the
table does not state fails too. Runs on the CPU: the room plans for a tag without a device.
"""
import re
from pathlib import Path

import pytest

import mla_kv
from mla_kv import gpus

_C = mla_kv.ops._C
needs_core = pytest.mark.skipif(_C is None, reason="mla_kv was built without its CUDA kernels")
README = Path(__file__).resolve().parent.parent / "README.md"
HEADER = "| tag | GPU class | cache | rows per sequence | kernel | CTA rows x keys / tiles in flight | tile loads | " \
         "split-KV merge |"
# A README cache cell -> the (addressing, format) launches it stands for.
QUANTIZED = ("fp8", "fp8_ds_mla", "int8", "int4")
KINDS = ("paged_table", "block_pointers", "sparse_slots", "sparse_blocks")
CACHES = {
    "16-bit, paged": [("paged_table", "none")],
    "16-bit, block pointers": [("block_pointers", "none")],
    "16-bit, dense or sparse": [(k, "none") for k in KINDS],
    "quantized, dense or sparse": [(k, f) for k in KINDS for f in QUANTIZED],
    "quantized, dense": [(k, f) for k in KINDS[:2] for f in QUANTIZED],
    "sparse, any format": [(k, f) for k in KINDS[2:] for f in ("none",) + QUANTIZED],
}
CACHES["any"] = sorted({c for v in CACHES.values() for c in v})
ROW_COUNTS = [1, 7, 16, 17, 20, 24, 25, 32, 33, 64, 100, 128]
MERGES = {"combine after": "after", "combine early": "early"}


def readme_rows():
    lines = README.read_text().splitlines()
    start = lines.index(HEADER) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def rows_in(cell):
    if cell == "any":
        return set(ROW_COUNTS)
    lo, hi = (int(x) for x in cell.split("-"))
    return {r for r in ROW_COUNTS if lo <= r <= hi}


def params(heads, q_len, splits, dtype, limits):
    p = _C.AttentionParams()
    p.dtype = getattr(_C.DType, dtype)
    p.batch, p.num_heads, p.q_len = 8, heads, q_len
    p.cu_q_lens, p.total_q_tokens = 0, 8 * q_len
    p.causal, p.softmax_scale = True, 0.1
    p.num_splits, p.tokens_per_split = splits, 1024
    p.smem_limits = gpus.c_limits(limits)
    return p


def launch(tag, rows_kind, fmt, heads, q_len, splits, limits):
    dtype = "float16" if tag in ("sm70", "sm75") else "bfloat16"
    p = params(heads, q_len, splits, dtype, limits)
    return _C.attention_launch(p, getattr(_C.CacheRows, rows_kind), getattr(_C.KvFormat, fmt), None,
                               getattr(_C.Arch, tag))


def check_row(row, classes):
    tag, class_cell, cache_cell, rows_cell, kernel, shape, loads, merge = row
    m = re.fullmatch(r"(\d+)x(\d+) / (\d+|ring)", shape)
    assert m, f"README row {row}: shape {shape!r} is not 'RxK / N'"
    want_rows, want_keys, want_flight = int(m[1]), int(m[2]), m[3]
    covered = set()
    for name in (c.strip() for c in class_cell.split(", ")):
        g = classes[name]
        assert g.arch == tag.lower(), f"README row {row}: {name} is {g.arch}, not {tag}"
        for rows_kind, fmt in CACHES[cache_cell]:
            for n in rows_in(rows_cell):
                covered.add((name, rows_kind, fmt, n))
                for heads, q_len in ((n, 1), (n // 2, 2)) if n % 2 == 0 and n > 2 else ((n, 1),):
                    for splits in (1, 2, 4):
                        got = launch(tag.lower(), rows_kind, fmt, heads, q_len, splits, g.smem)
                        what = f"{tag} {name} {rows_kind} {fmt} {q_len}x{heads} rows, {splits} splits"
                        assert got.ok, f"{what}: {got.status}"
                        assert got.kernel.name == kernel, f"{what}: {got.kernel.name}, README says {kernel}"
                        assert got.loads.name == loads, f"{what}: {got.loads.name}, README says {loads}"
                        assert got.rows_per_cta == want_rows, f"{what}: {got.rows_per_cta} rows per CTA"
                        if kernel != "wgmma_narrow":
                            flight = 1 if got.loads.name == "registers" else got.tiles.stages
                            assert (got.tiles.block_n, str(flight)) == (want_keys, want_flight), \
                                f"{what}: {got.tiles.block_n} keys / {flight}, README says {shape}"
                        pair = merge.startswith("2 splits: cluster pair")
                        want = "none" if splits == 1 or (pair and splits == 2) else \
                            "early" if pair else MERGES[merge]
                        assert got.combine.name == want, f"{what}: merge {got.combine.name}, README: {merge}"
                        assert got.pair_merge == (pair and splits == 2), what
    return covered


@needs_core
def test_readme_table_is_what_attention_launch_chooses():
    classes = gpus.gpu_classes()
    rows = readme_rows()
    assert rows, "README has no attention_launch table"
    seen = {}
    for row in rows:
        for point in check_row(row, classes):
            assert point not in seen, f"{point} is in two README rows: {seen.get(point)} and {row}"
            seen[point] = row
    for name, g in classes.items():
        for rows_kind, fmt in CACHES["any"]:
            for n in ROW_COUNTS:
                assert (name, rows_kind, fmt, n) in seen, f"README's table says nothing of {name} {rows_kind} {fmt} " \
                                                          f"at {n} rows per sequence"


@needs_core
def test_packed_plans_and_cp_async_take_the_64_row_kernel_on_sm90():
    h100 = gpus.gpu_classes()["H100 / H200"].smem
    p = params(16, 1, 2, "bfloat16", h100)
    p.cu_q_lens, p.total_q_tokens = 1, 64  # packed (the room reads no lengths)
    got = _C.attention_launch(p, _C.CacheRows.paged_table, _C.KvFormat.fp8, None, _C.Arch.sm90)
    assert (got.kernel.name, got.loads.name, got.rows_per_cta) == ("wgmma", "cp_async", 64)
    p = params(16, 1, 2, "bfloat16", h100)
    p.tile_loads = _C.TileLoads.cp_async
    got = _C.attention_launch(p, _C.CacheRows.paged_table, _C.KvFormat.none, None, _C.Arch.sm90)
    assert (got.kernel.name, got.loads.name) == ("wgmma", "cp_async")
    got = _C.attention_launch(p, _C.CacheRows.paged_table, _C.KvFormat.int4, None, _C.Arch.sm90)
    assert got.kernel.name == "wgmma"


@needs_core
def test_what_cannot_run_says_why():
    t4 = gpus.gpu_classes()["T4 / RTX 20"].smem
    got = _C.attention_launch(params(16, 1, 1, "bfloat16", t4), _C.CacheRows.paged_table, _C.KvFormat.none, None,
                              _C.Arch.sm75)
    assert not got.ok and "dtype" in got.status
    got = _C.attention_launch(params(16, 1, 1, "float32", t4), _C.CacheRows.paged_table, _C.KvFormat.none, None,
                              _C.Arch.sm80)
    assert not got.ok and "dtype" in got.status
    tiny = gpus.c_limits(gpus.SmemLimits(per_block=32 * 1024, per_sm=32 * 1024))
    p = params(16, 1, 1, "float16", t4)
    p.smem_limits = tiny
    got = _C.attention_launch(p, _C.CacheRows.paged_table, _C.KvFormat.none, None, _C.Arch.sm70)
    assert not got.ok and got.tiles.block_m == 0 and got.tiles.min_smem_bytes > 32 * 1024
