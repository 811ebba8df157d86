#!/usr/bin/env python3
"""The calls scripts/sanitize runs under compute-sanitizer, and the reader of the tools' reports.

  sanitize_calls.py list                     the calls, one per op x kernel variant (runs nothing)
  sanitize_calls.py run RESULTS [--only RE] [--shard I/N]
                                             runs them (each checked against the float64 reference,
                                             tests/sweep_cases.py) and writes one JSON line per call
  sanitize_calls.py report DIR ALLOW TOOL... reads DIR/TOOL/shard*/{log.txt,calls.jsonl,rc}, prints
                                             the call x tool table, writes DIR/table.txt; exit 1 on a
                                             report no ALLOW entry matches, a wrong result or an
                                             unfinished run

Every input is initialized (random data, NaN where no sequence reads), so initcheck reports only
what the kernels leave unwritten themselves. The driver prints "mla_kv-sanitize: begin NAME" before
each call; a report is charged to the call whose marker precedes it in the log.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
MARKER = "mla_kv-sanitize: begin "
PREFIX = "========="
ARCH_TAGS = (None, "sm80", "sm75", "sm70")  # None: the GPU's best (sm90's wgmma attention on the H200)


# ------------------------------------------------------------------------------------- the calls
def _sweep_cases():
    """tests/sweep_cases.py, which imports torch and mla_kv (the report's parsers need neither)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import sweep_cases
    return sweep_cases


def calls() -> List[Tuple[str, object]]:
    """(name, case) of every call: small shapes, every kernel variant the H200 can launch."""
    sc = _sweep_cases()
    BlockWriteCase, CacheSpec, CpCase, DecodeCase = sc.BlockWriteCase, sc.CacheSpec, sc.CpCase, sc.DecodeCase
    QuantCase, ExpandedCase = sc.QuantCase, sc.ExpandedCase
    GatherCase, MergeCase, PrefillCase, RopeSpec, WriteCase = (sc.GatherCase, sc.MergeCase, sc.PrefillCase,
                                                               sc.RopeSpec, sc.WriteCase)

    def dtypes(arch, fp32=False):
        return ["float16"] + (["bfloat16"] if arch in (None, "sm80") else []) + (["float32"] if fp32 else [])

    rope = RopeSpec(q_heads=5, q_dim=256, positions_out_of_range=2, q_pad=(1, 1, 8))
    write = WriteCase(tokens=40, block_size=16, num_blocks=4, padded_slots=5, slots_past_cache=2, extra_rows=2,
                      cache_pad=(1, 1, 8))
    blocks_write = BlockWriteCase(q_lens=[3, 70, 0], history=[60, 0, 5], extra_blocks=[0, -1, 1], extra_rows=4)
    paged = CacheSpec(block_size=64, shared_blocks=1, extra_blocks=2, table_poison="neg")
    pointers = CacheSpec(blocks=True, block_size=64, layers=2, layer=1, extra_blocks=1)
    given = dict(give_out=True, out_pad=(1, 0, 1, 8), lse_pad=(0, 1, 1))
    decodes = {  # name -> case: CTA shapes of 16 / 32 / 64 query rows, one split / few / many
        "s1-h8": DecodeCase(lens=[0, 1, 63, 130], s_q=1, heads=8, cache=paged),
        "s3-h20-split3-given": DecodeCase(lens=[5, 200, 300], s_q=3, heads=20, cache=paged, schedule=(3, 64),
                                          give_workspace=True, q_pad=(0, 1, 1, 8), **given),
        "s1-h20-split12": DecodeCase(lens=[1, 400], s_q=1, heads=20, cache=paged, schedule=(12, 1)),
    }
    prefills = {
        "causal-padded-given": PrefillCase(q_lens=[40, 1, 0], kv_lens=[40, 130, 7], pad_rows=5, heads=8, cache=paged,
                                           give_out=True, out_pad=(1, 0, 8), lse_pad=(0, 1)),
        "full-split4": PrefillCase(q_lens=[33, 2], kv_lens=[100, 300], causal=False, heads=16, cache=paged,
                                   schedule=(4, 64), give_workspace=True),
    }
    out: List[Tuple[str, object]] = []
    for arch in ARCH_TAGS:
        a = arch or "best"
        for dt in dtypes(arch, fp32=True):
            out += [(f"write_kv/{a}/{dt}", replace(write, arch=arch, dtype=dt)),
                    (f"fused_write_kv/{a}/{dt}", replace(write, fused=True, arch=arch, dtype=dt, rope=rope)),
                    (f"write_kv_blocks/{a}/{dt}", replace(blocks_write, arch=arch, dtype=dt)),
                    (f"fused_write_kv_blocks/{a}/{dt}", replace(blocks_write, fused=True, arch=arch, dtype=dt,
                                                                rope=rope, rope_first=dt != "float32"))]
        out += [(f"fused_write_kv_blocks/{a}/float16/readonly-cp2", replace(blocks_write, fused=True, arch=arch,
                                                                          rope=rope, readonly=[1, 30, 0], cp=(2, 1))),
                (f"write_kv/{a}/float16/2-element", replace(write, arch=arch, input_pad=2, input_offset=2)),
                (f"fused_write_kv/{a}/float16/2-element-neox-cos16",
                 replace(write, fused=True, arch=arch, input_pad=2, input_offset=2,
                         rope=replace(rope, style="neox", cos_sin_fp32=False, q_pad=(0, 1, 2))))]
        for dt in dtypes(arch):
            out += [(f"decode/paged/{a}/{dt}/{n}", replace(c, arch=arch, dtype=dt)) for n, c in decodes.items()]
            out.append((f"decode/blocks/{a}/{dt}/s2-h20-split2-given",
                        DecodeCase(arch=arch, dtype=dt, lens=[2, 64, 130], s_q=2, heads=20, cache=pointers,
                                   schedule=(2, 64), **given)))
            out += [(f"prefill/paged/{a}/{dt}/{n}", replace(c, arch=arch, dtype=dt)) for n, c in prefills.items()]
            out.append((f"prefill/blocks/{a}/{dt}/causal", PrefillCase(arch=arch, dtype=dt, q_lens=[20, 1],
                                                                        kv_lens=[20, 100], heads=16, cache=pointers)))
        for dt in ("float16", "bfloat16", "float32"):  # a copy: every dtype on every tag
            out += [(f"gather_kv/paged/{a}/{dt}", GatherCase(arch=arch, dtype=dt, counts=[0, 5, 70], starts=[3, 0, 10],
                                                               cache=replace(paged, row_pad=2), give_out=True,
                                                               out_extra_rows=3)),
                    (f"gather_kv/blocks/{a}/{dt}", GatherCase(arch=arch, dtype=dt, counts=[9, 130], cache=pointers))]
        out.append((f"gather_kv/paged/{a}/float16/2-element", GatherCase(arch=arch, counts=[7, 33], give_out=True,
                                                                          out_pad=2)))
    # The Hopper kernel's tile paths: TMA boxes of 16 / 64 / 128-row blocks, cp.async for 48-row blocks
    # and for splits that end inside a 64-token tile; the combine's 2- and 8-chunk forms (>= 16, >= 64 splits).
    for bs, plan in ((16, None), (128, (2, 64)), (48, None), (64, (5, 16)), (64, (20, 64)), (16, (70, 16))):
        spec = CacheSpec(block_size=bs, shared_blocks=1, extra_blocks=1, table_poison="oob")
        out.append((f"decode/paged/best/float16/bs{bs}-split{plan[0] if plan else 'auto'}",
                    DecodeCase(lens=[3, 100, 600], s_q=2, heads=16, cache=spec, schedule=plan)))
    out += [("decode/paged/best/bfloat16/h128-s4", DecodeCase(dtype="bfloat16", lens=[64, 65], s_q=4, heads=128,
                                                                cache=paged, **given)),
            ("prefill/paged/best/float16/split12-padded", PrefillCase(q_lens=[70, 1], kv_lens=[200, 90], pad_rows=13,
                                                                       heads=20, cache=paged, schedule=(12, 64),
                                                                       give_out=True))]
    # The tiles of the smaller GPUs (their shared-memory limits imposed): Turing's P-in-scores tile,
    # the register-staged Sm80 tiles of the 99 KB GPUs, an A100's three-stage ring and 64-row CTA.
    for gpu, arch in (("T4 / RTX 20", "sm75"), ("L40 / RTX 40", "sm80"), ("A100", "sm80")):
        g = gpu.split()[0]
        out += [(f"decode/paged/{arch}/float16/{g}-s2-h20", DecodeCase(arch=arch, lens=[3, 100, 600], s_q=2, heads=20,
                                                                        cache=paged, gpu=gpu)),
                (f"prefill/paged/{arch}/float16/{g}-h16", PrefillCase(arch=arch, q_lens=[33, 2], kv_lens=[100, 300],
                                                                       heads=16, cache=paged, gpu=gpu))]
    out += [(f"merge_states/{dt}", MergeCase(dtype=dt, shape=(3, 7), give_out=True))
            for dt in ("float16", "bfloat16", "float32")]
    out.append(("merge_states/float16/dim31-strided", MergeCase(shape=(2, 3, 5), dim=31, pads=(1, 7, 2))))
    # Quantized caches: the quantizing write, the dequantizing gather and decode (Hopper's and the
    # mma.sync kernel's dequantizing tile loads), every format, both tags' paths.
    out += [(f"quantized/{fmt}/{arch or 'best'}/{dt}", QuantCase(kv_format=fmt, arch=arch, dtype=dt))
            for fmt in ("fp8", "fp8_ds_mla", "int8", "int4") for arch in (None, "sm70")
            for dt in ("float16",) + (("bfloat16",) if arch is None else ())]
    # Hopper's copy warp on 64-row blocks: a tile a bulk copy of one block, the block table read a window ahead.
    out += [(f"quantized/{fmt}/best/float16/bs64", QuantCase(kv_format=fmt, block_size=64, num_blocks=5))
            for fmt in ("fp8", "fp8_ds_mla", "int8", "int4")]
    # Hopper's decode at 4 forced splits of 80 positions (b = 0 with 3 empty ones), merged by the combine.
    out += [(f"quantized/{fmt}/best/float16/splits4", QuantCase(kv_format=fmt, block_size=64, num_blocks=5, splits=4))
            for fmt in ("fp8", "fp8_ds_mla", "int8", "int4")]
    # The expanded-form kernel: both tags, every head-dim pair, 64- and 32-row CTAs (the T4's limits),
    # packed sequences with none / more queries than keys, padded rows and strided rows.
    for arch in ("sm70", "sm75"):
        for dims in ((192, 128), (256, 256), (128, 128)):
            name = f"expanded_attention/{arch}/float16/{dims[0]}x{dims[1]}"
            case = ExpandedCase(arch=arch, dims=dims, q_lens=[40, 1, 0, 9], k_lens=[40, 130, 7, 3], pad_rows=3,
                                pads=(8, 0, 8, 8))
            out += [(name, case), (f"{name}/full-T4", replace(case, causal=False, gpu="T4 / RTX 20"))]
    # Sparse attention: every tag, 16-bit and quantized caches (Hopper's copy warpgroup writes the row bits),
    # one token's rows split over CTAs.
    out += [(f"sparse_attention/{arch or 'best'}/{fmt or '16-bit'}", sc.SparseCase(arch=arch, kv_format=fmt))
            for arch in ARCH_TAGS for fmt in (None, "fp8_ds_mla", "int4")]
    out += [("sparse_attention/best/bfloat16/h128-split", sc.SparseCase(dtype="bfloat16", tokens=1, heads=128,
                                                                       topk=300, splits=True)),
            ("sparse_attention/sm80/bfloat16/h64-split", sc.SparseCase(arch="sm80", dtype="bfloat16", tokens=2,
                                                                      heads=64, topk=300, splits=True))]
    # Index scores: every tag and query kind; 64 heads (one token per CTA) with 4-token pages once.
    out += [(f"index_scores/{arch or 'best'}/{kind}", sc.IndexScoresCase(arch=arch, q_kind=kind))
            for arch in ARCH_TAGS for kind in ("float16", "bfloat16", "e4m3")]
    out += [("index_scores/best/bfloat16/h64-page4", sc.IndexScoresCase(heads=64, q_kind="bfloat16", page_size=4,
                                                                        kv_lens=(70, 200), q_lens=(1, 3)))]
    # Index top-k: every tag over decode rows split across CTAs and packed prefill slots with ties; on the
    # device's best also split rows too long for shared memory and one CTA per row (re-read from L2).
    out += [(f"index_topk/{arch or 'best'}/decode-split", sc.IndexTopkCase(arch=arch)) for arch in ARCH_TAGS]
    out += [(f"index_topk/{arch or 'best'}/prefill-slots-ties",
             sc.IndexTopkCase(arch=arch, kv_lens=(3000, 40, 2200), q_lens=(5, 40, 3), k=64, page_size=64, ties=True))
            for arch in ARCH_TAGS]
    out += [("index_topk/best/decode-split-l2", sc.IndexTopkCase(kv_lens=(1_200_000,))),
            ("index_topk/best/rows-l2", sc.IndexTopkCase(kv_lens=(9000,) * 129 + (100,), k=256, ties=True))]
    # Index keys: every tag and dtype, paged (16-token pages, padded slots and slots past the cache) and block
    # pointers (readonly rows, a context-parallel rank, 1-token pages), with 64 query heads.
    for arch in ARCH_TAGS:
        for dt in dtypes(arch):
            out += [(f"write_index_keys/{arch or 'best'}/{dt}", sc.IndexKeysCase(arch=arch, dtype=dt, heads=64)),
                    (f"write_index_keys_blocks/{arch or 'best'}/{dt}",
                     sc.IndexKeysCase(arch=arch, dtype=dt, blocks=True, page_size=1, readonly=(3, 0, 2), cp=(2, 1),
                                      rope_style="interleaved", scale_fmt="ue8m0"))]
    out += [("cp_decode/best/float16/cp2", CpCase(kv_lens=[70, 5], q_lens=[3, 3])),
            ("cp_prefill/best/float16/cp2", CpCase(prefill=True, kv_lens=[40, 9], q_lens=[7, 9]))]
    return out


def run_calls(results: Path, only: Optional[str], shard: Tuple[int, int], device: str) -> int:
    """Runs the calls whose names match ``only`` and whose position among those is ``shard[0]`` modulo
    ``shard[1]`` (the shards of a selection stay even), one JSON line each in ``results``; 1 if any
    failed. A call's data seed is its index in the whole list."""
    import torch
    run = _sweep_cases().run

    matched = [(i, n, c) for i, (n, c) in enumerate(calls()) if only is None or re.search(only, n)]
    selected = matched[shard[0]::shard[1]]
    failed = 0
    with results.open("w") as log:
        for index, name, case in selected:
            print(f"{MARKER}{name}", flush=True)
            start = time.perf_counter()
            try:
                outcome = run(case, device, index)
                problems, canary, fatal = outcome.problems, outcome.canary_bytes, outcome.fatal
            except Exception as error:  # noqa: BLE001 - a harness error fails this call, not the run
                problems, canary, fatal = [f"harness error {type(error).__name__}: {error}"], 0, False
            if device == "cuda":
                torch.cuda.synchronize()  # every report of this call comes before the next marker
            ok = not problems and not canary
            failed += not ok
            record = dict(call=name, ok=ok, problems=problems, canary_bytes=canary,
                          seconds=round(time.perf_counter() - start, 2))
            log.write(json.dumps(record) + "\n")
            log.flush()
            print(f"mla_kv-sanitize: end {name} {'ok' if ok else 'FAIL ' + '; '.join(problems)}", flush=True)
            if fatal:
                break
        log.write(json.dumps(dict(done=True, calls=len(selected))) + "\n")
    return 1 if failed else 0


def _shard(text: str) -> Tuple[int, int]:
    m = re.fullmatch(r"(\d+)/(\d+)", text)
    if not m or not int(m[1]) < int(m[2]):
        raise argparse.ArgumentTypeError(f"expected I/N with 0 <= I < N, got {text!r}")
    return int(m[1]), int(m[2])


# ----------------------------------------------------------------------------------- allow list
@dataclass
class AllowEntry:
    line: int
    tool: str
    kernel: str               # a substring, "re:REGEX", or "*"
    sites: Optional[Dict[str, List[Tuple[int, int]]]]  # file -> line ranges; None: any
    reason: str
    used: int = 0

    def kernel_matches(self, functions: List[str]) -> bool:
        if self.kernel == "*":
            return True
        if self.kernel.startswith("re:"):
            return any(re.search(self.kernel[3:], f) for f in functions)
        return any(self.kernel in f for f in functions)

    def covers(self, frame: "Frame") -> bool:
        ranges = self.sites.get(os.path.basename(frame.file or ""), []) if self.sites else []
        return any(lo <= (frame.line or -1) <= hi for lo, hi in ranges)


class AllowListError(ValueError):
    pass


# A source line whose comment holds "sanitize-allow: NAME" is site @NAME of its file; "NAME {" on one line
# and "NAME }" on a later one mark every line from the first to the second. The allow list names sites
# so, rather than by number, and an edit above them no longer moves them out of its entries.
_SITE_MARK = re.compile(r"sanitize-allow:\s*([\w-]+)(?:\s*([{}]))?")


def marked_sites(text: str, file: str) -> Dict[str, List[Tuple[int, int]]]:
    """NAME -> the line ranges (1-based, inclusive) that file's text marks as site @NAME."""
    sites: Dict[str, List[Tuple[int, int]]] = {}
    open_at: Dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        for m in _SITE_MARK.finditer(line):
            name, brace = m[1], m[2]
            if brace == "{":
                if name in open_at:
                    raise AllowListError(f"{file}:{number}: site @{name} opened again before its '}}'")
                open_at[name] = number
            elif brace == "}":
                if name not in open_at:
                    raise AllowListError(f"{file}:{number}: site @{name} closed but not opened")
                sites.setdefault(name, []).append((open_at.pop(name), number))
            else:
                sites.setdefault(name, []).append((number, number))
    if open_at:
        name, number = next(iter(open_at.items()))
        raise AllowListError(f"{file}:{number}: site @{name} opened but never closed")
    return sites


def source_sites(root: Path = ROOT / "csrc") -> Dict[str, Optional[Dict[str, List[Tuple[int, int]]]]]:
    """File name (as compute-sanitizer prints it) -> its marked sites, over the sources under root; None
    for a name that several sources share (a site there is ambiguous, which only an entry naming one is)."""
    out: Dict[str, Optional[Dict[str, List[Tuple[int, int]]]]] = {}
    for path in sorted(root.rglob("*")):
        if path.suffix in (".cu", ".cuh", ".h") and path.is_file():
            sites = marked_sites(path.read_text(), str(path.relative_to(root.parent)))
            out[path.name] = None if path.name in out else sites
    return out


def parse_allow_list(text: str, name: str = "sanitize-allow.txt",
                     sources: Optional[Dict[str, Dict[str, List[Tuple[int, int]]]]] = None) -> List[AllowEntry]:
    """Entries ``tool | kernel | sites | reason``, one a line; '#' starts a comment. sites:
    FILE:SITE[,SITE...] groups separated by ';', or '*'; a SITE is LINE, LINE-LINE or @NAME, a site
    that FILE's comments mark (marked_sites; sources: source_sites(), read when an entry names one).
    The reason is mandatory."""
    entries = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = [f.strip() for f in line.split("|")]
        where = f"{name}:{number}"
        if len(fields) != 4:
            raise AllowListError(f"{where}: expected 'tool | kernel | sites | reason', got {len(fields)} fields")
        tool, kernel, sites, reason = fields
        if tool not in TOOLS:
            raise AllowListError(f"{where}: tool must be one of {', '.join(TOOLS)}, got {tool!r}")
        if not kernel:
            raise AllowListError(f"{where}: the kernel field is empty (use * for any)")
        if kernel.startswith("re:"):
            try:
                re.compile(kernel[3:])
            except re.error as error:
                raise AllowListError(f"{where}: bad regex {kernel[3:]!r}: {error}") from None
        if not reason:
            raise AllowListError(f"{where}: an entry needs a reason")
        if sites != "*" and "@" in sites and sources is None:
            sources = source_sites()
        entries.append(AllowEntry(number, tool, kernel, None if sites == "*" else _parse_sites(sites, where, sources),
                                  reason))
    return entries


def _parse_sites(text: str, where: str, sources) -> Dict[str, List[Tuple[int, int]]]:
    sites: Dict[str, List[Tuple[int, int]]] = {}
    for group in filter(None, (g.strip() for g in text.split(";"))):
        file, sep, lines = group.rpartition(":")
        if not sep or not file:
            raise AllowListError(f"{where}: a site is FILE:LINE[-LINE][,...] or FILE:@NAME, got {group!r}")
        file = os.path.basename(file.strip())
        for part in lines.split(","):
            marked = re.fullmatch(r"\s*@([\w-]+)\s*", part)
            if marked:
                if file in (sources or {}) and sources[file] is None:
                    raise AllowListError(f"{where}: several sources are named {file}: site @{marked[1]} is ambiguous")
                ranges = (sources or {}).get(file, {}).get(marked[1])
                if not ranges:
                    raise AllowListError(f"{where}: no line of {file} marks site @{marked[1]} "
                                         f"(a comment 'sanitize-allow: {marked[1]}')")
                sites.setdefault(file, []).extend(ranges)
                continue
            m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
            if not m:
                raise AllowListError(f"{where}: bad line number or range {part!r} in {group!r}")
            lo, hi = int(m[1]), int(m[2] or m[1])
            if hi < lo:
                raise AllowListError(f"{where}: empty range {part!r}")
            sites.setdefault(file, []).append((lo, hi))
    if not sites:
        raise AllowListError(f"{where}: no sites (use * for any)")
    return sites


# ---------------------------------------------------------------------------------- the reports
@dataclass
class Frame:
    function: str
    file: Optional[str] = None
    line: Optional[int] = None


@dataclass
class Report:
    tool: str
    call: Optional[str]
    headline: str
    sites: List[List[Frame]] = field(default_factory=list)  # per access: its frame, then its callers
    text: List[str] = field(default_factory=list)

    @property
    def functions(self) -> List[str]:
        return [f.function for site in self.sites for f in site]

    def matches(self, entry: AllowEntry) -> bool:
        if entry.tool != self.tool or not entry.kernel_matches(self.functions):
            return False
        if entry.sites is None:
            return True
        return bool(self.sites) and all(any(entry.covers(f) for f in site) for site in self.sites)

    def key(self) -> str:
        """The report without its call: same tool, headline kind and sites."""
        where = " / ".join(" < ".join(f"{os.path.basename(f.file)}:{f.line}" for f in site if f.file) or
                           (site[0].function if site else "?") for site in self.sites)
        kind = self.headline.split(" at ", 1)[0] if _RACE.match(self.headline) else self.headline
        return f"{self.tool}: {re.sub(r'0x[0-9a-f]+', '0x..', kind)} at {where or '-'}"


_NEW_LOCATION = re.compile(r"^(?P<function>.+?)\+0x[0-9a-fA-F]+(?: in (?P<file>.+):(?P<line>\d+))?$")
_OLD_LOCATION = re.compile(r"^(?:0x[0-9a-fA-F]+ in )?(?P<file>[^\s:]+\.\w+):(?P<line>\d+):(?P<function>.+)$")
_ADDRESS_ONLY = re.compile(r"^0x[0-9a-fA-F]+ in (?P<function>.+)$")
_RACE = re.compile(r"^(?:Error|Warning): Race reported between (?:\w+ )?access at (?P<where>.+)$")
_AND = re.compile(r"^and (?:\w+ )?access at (?P<where>.+)$")
_SUMMARY = re.compile(r"^(?:ERROR SUMMARY: (?P<errors>\d+) errors?"
                      r"|RACECHECK SUMMARY: (?P<hazards>\d+) hazards? displayed.*)")
_BENIGN = ("COMPUTE-SANITIZER", "Target application returned an error")


def parse_location(text: str) -> Frame:
    """'FUNC+0x1a0 in FILE:LINE' (compute-sanitizer 2023+), 'FUNC+0x1a0', '0x1a0 in FILE:LINE:FUNC'
    (older, with line info) or '0x150 in FUNC'; a trailing '[N hazards]' is dropped."""
    text = re.sub(r"\s*\[\d+ hazards?\]\s*$", "", text.strip())
    for pattern in (_NEW_LOCATION, _OLD_LOCATION):
        m = pattern.match(text)
        if m:
            return Frame(m["function"], m["file"], int(m["line"]) if m["line"] else None)
    m = _ADDRESS_ONLY.match(text)
    return Frame(m["function"] if m else text)


@dataclass
class ToolLog:
    reports: List[Report]
    summary_errors: Optional[int]   # ERROR SUMMARY / RACECHECK SUMMARY count, None if absent
    calls_seen: List[str]
    tail: List[str]                 # the log's last lines


def parse_log(tool: str, text: str) -> ToolLog:
    """The reports of one compute-sanitizer log (its output and the driver's markers, interleaved)."""
    reports: List[Report] = []
    summary, call, seen = None, None, []
    current: Optional[Report] = None
    for raw in text.splitlines():
        if raw.startswith(MARKER):
            call = raw[len(MARKER):].strip()
            seen.append(call)
            current = None
            continue
        if not raw.startswith(PREFIX):
            continue
        body = raw[len(PREFIX):]
        if not body.strip():
            current = None
            continue
        if body.startswith(" ") and not body.startswith("  "):  # a headline
            head = body.strip()
            m = _SUMMARY.match(head)
            if m:  # racecheck may print both summaries: the larger count is the displayed one
                summary = max(summary or 0, int(m["errors"] or m["hazards"]))
                current = None
                continue
            if head.startswith(_BENIGN):
                current = None
                continue
            current = Report(tool, call, head, text=[raw])
            race = _RACE.match(head)
            if race:
                current.sites.append([parse_location(race["where"])])
            reports.append(current)
            continue
        if current is None:
            continue
        current.text.append(raw)
        detail = body.strip()
        if detail.startswith("at "):
            current.sites.append([parse_location(detail[3:])])
        elif detail.startswith("Device Frame:") and current.sites:
            current.sites[-1].append(parse_location(detail[len("Device Frame:"):]))
        else:
            m = _AND.match(detail)
            if m:
                current.sites.append([parse_location(m["where"])])
    return ToolLog(reports, summary, seen, text.splitlines()[-40:])


@dataclass
class ToolRun:
    """What the shard processes of one tool left: reports, per-call results, process problems."""

    reports: List[Report] = field(default_factory=list)
    records: Dict[str, dict] = field(default_factory=dict)
    problems: List[str] = field(default_factory=list)
    last_words: List[str] = field(default_factory=list)  # the driver's last lines where a shard failed


def read_tool_run(directory: Path, tool: str) -> ToolRun:
    """Reads DIRECTORY/TOOL/shard*/ (log.txt, calls.jsonl, rc) of one tool."""
    run = ToolRun()
    shards = sorted((directory / tool).glob("shard*"))
    if not shards:
        run.problems.append("no run")
    for shard in shards:
        log_path, calls_path, rc_path = shard / "log.txt", shard / "calls.jsonl", shard / "rc"
        parsed = parse_log(tool, log_path.read_text(errors="replace") if log_path.exists() else "")
        done, ran, records = False, 0, {}
        for line in calls_path.read_text().splitlines() if calls_path.exists() else []:
            record = json.loads(line)
            if record.get("done"):
                done, ran = True, record["calls"]
            else:
                records[record["call"]] = record
        if done and ran == 0:
            # a selection of fewer calls than shards: this process had none, and the sanitizer's one
            # complaint is that no CUDA call came
            continue
        run.reports += parsed.reports
        run.records.update(records)
        rc = rc_path.read_text().strip() if rc_path.exists() else "?"
        problems = []
        if rc not in ("0", "1", "99"):  # 1: the driver found a wrong result (listed per call)
            problems.append(f"exit {rc}" + (" (timeout)" if rc in ("124", "137") else ""))
        if not done:
            problems.append("unfinished")
        if parsed.summary_errors is None:
            problems.append("no summary line")
        elif parsed.summary_errors > len(parsed.reports):
            problems.append(f"its summary counts {parsed.summary_errors} reports, its log shows {len(parsed.reports)} "
                            f"(raise --print-limit)")
        if problems:
            run.problems.append(f"{shard.name}: " + ", ".join(problems))
            run.last_words += [line for line in parsed.tail if not line.startswith(PREFIX)][-8:]
    return run


def report(directory: Path, allow_path: Path, tools: List[str]) -> int:
    entries = parse_allow_list(allow_path.read_text(), allow_path.name)
    names = [n for n, _ in calls()]
    cells: Dict[Tuple[str, str], str] = {}
    unallowed: List[Report] = []
    status_lines, failed = [], False
    for tool in tools:
        run = read_tool_run(directory, tool)
        per_call: Dict[Optional[str], List[int]] = {}  # call -> [allowed, not allowed]
        for r in run.reports:
            allowed = next((e for e in entries if r.matches(e)), None)
            counts = per_call.setdefault(r.call, [0, 0])
            counts[allowed is None] += 1
            if allowed:
                allowed.used += 1
            else:
                unallowed.append(r)
        for name in names + [None]:
            allowed, bad = per_call.get(name, [0, 0])
            record = run.records.get(name) if name else None
            if record is None and not allowed and not bad:
                continue  # not run by this tool (an --only selection, or the process ended first)
            if name is not None and record is None:
                cell = "FAIL unfinished"  # its reports came, its result did not: the process ended in it
            else:
                cell = "FAIL" if bad or (record and not record["ok"]) else "ok"
                cell += " check" if record and not record["ok"] else ""
            cell += (f" {bad}r" if bad else "") + (f" +{allowed}a" if allowed else "")
            cells[(name or "(outside calls)", tool)] = cell
        wrong = sum(not r["ok"] for r in run.records.values())
        problems = run.problems + ([f"{wrong} calls wrong"] if wrong else [])
        failed |= bool(problems) or any(bad for _, bad in per_call.values())
        status_lines.append(f"{tool:10s} {len(run.reports)} reports ({sum(a for a, _ in per_call.values())} allowed), "
                            f"{len(run.records)} calls" + (": FAIL " + "; ".join(problems) if problems else ""))
        status_lines += [f"    {line}" for line in run.last_words]
    lines = _table(names + ["(outside calls)"], tools, cells)
    lines += ["", *status_lines]
    if unallowed:
        lines += ["", "reports no allow-list entry matches (tool: kind at sites; count; first call):"]
        groups: Dict[str, List[Report]] = {}
        for r in unallowed:
            groups.setdefault(r.key(), []).append(r)
        for key, group in groups.items():
            lines.append(f"  {key}; {len(group)}x; {group[0].call or '(outside calls)'}")
            lines += [f"      {t}" for t in group[0].text[:6]]
    for entry in entries:
        if not entry.used:
            lines.append(f"note: allow-list entry on line {entry.line} matched nothing this run")
    lines.append("sanitize: " + ("FAIL" if failed else "ok"))
    text = "\n".join(lines)
    print(text)
    (directory / "table.txt").write_text(text + "\n")
    return 1 if failed else 0


def _table(rows: List[str], tools: List[str], cells: Dict[Tuple[str, str], str]) -> List[str]:
    shown = [r for r in rows if any((r, t) in cells for t in tools)]
    width = max([len(r) for r in shown] + [4])
    lines = [f"{'call':{width}s}  " + "  ".join(f"{t:14s}" for t in tools)]
    lines += [f"{r:{width}s}  " + "  ".join(f"{cells.get((r, t), '-'):14s}" for t in tools) for r in shown]
    lines.append("ok: no report, result checked; +Na: N allowed reports; Nr: N reports no entry allows; "
                 "check: wrong result or changed canary bytes; -: not run")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="print the calls")
    run_p = sub.add_parser("run", help="run the calls (under compute-sanitizer)")
    run_p.add_argument("results", type=Path, help="JSON lines, one per call")
    run_p.add_argument("--only", help="a regex: run the calls whose names match")
    run_p.add_argument("--shard", type=_shard, default=(0, 1), help="I/N: the calls whose index is I modulo N")
    run_p.add_argument("--device", default="cuda", help="cpu: the paged calls through the reference (a smoke test)")
    rep = sub.add_parser("report", help="read the tools' logs, print the table")
    rep.add_argument("directory", type=Path)
    rep.add_argument("allow", type=Path)
    rep.add_argument("tools", nargs="+", choices=TOOLS)
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, case in calls():
            print(f"{name:60s} {case!r}")
        return 0
    if args.command == "run":
        return run_calls(args.results, args.only, args.shard, args.device)
    try:
        return report(args.directory, args.allow, args.tools)
    except AllowListError as error:
        print(f"sanitize: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
