#!/usr/bin/env python3
"""What the decode kernels' tile loops cost per tile, counted in their SASS (no GPU needed).

--arch 90 (default): the narrow Hopper decode over the quantized caches
(csrc/kernels/attention/attention_sm90_narrow.cuh). A tile is one math warpgroup's work. Its four
warps sit on the SM's four schedulers, and each issues the tile loop's instructions once per tile.
A scheduler issues at most one instruction a cycle, so one SM finishes at most one tile per I
cycles, I the instructions a warp issues per tile, however many warpgroups take turns:
  - the tile loop is the shortest loop (a backward branch's span) that holds every mma of the kernel;
  - the vote block is the block a forward branch skips right after the first barrier that follows the
    softmax's VOTE.ANY. Only tiles that move a column's running max or the warpgroup's scale power
    run it (each warpgroup's first tile, rarely a later one), so it is left out of I;
  - I = the loop's instructions less the vote block's (the common path), each issued once a tile:
    the loop holds no inner loop (checked), and its waits (mbarrier retries) branch out of line,
    where they add stalls, not instructions; the few that other forward branches of the common
    path may skip are reported beside I.
issue floor (us per tile and SM) = I / clock. Beside it the memory floor: a tile's cache bytes for
each of 128 CTAs (one per SM, as the bench's shapes launch) at the H200's device copy rate. A
measured time per tile over the higher floor says what is left; a target time per tile below the
issue floor cannot be met without cutting instructions.

--arch 70: the Sm70 (V100) mma.m8n8k4 decode, the 16-bit cache and every quantized format, for the
V100 projection of bench/RESULTS.md. Its eight warps all work on each 32-row tile (two per
scheduler), and every instruction of its tile loop runs once per tile. clang's loop there is entered
at the tile's dequantization, its back edge a uniform branch (BRA.U). The detours a diverged warp takes
for a shuffle (from a BRA.DIV) branch back into it and are not counted, nor are the e4m3 decode's
per-value fallbacks (dequant.cuh): blocks a guarded branch skips, holding a NaN select (FSEL of +QNAN)
and no branch, which only NaN codes and scales of 2^8 or more run. Per tile and SM, in cycles:
  - issue: 2 I;
  - MIO (the 128 B/clk shared-memory / L1 pipe): 8 x the sum over the loop's shared, global and
    local loads and stores of max(1, a warp's bytes / 128);
  - HMMA: 2 warps x 2 clk per HMMA.884 step;
  - F2F (16 conversions a clock per SM): 2 warps x 8 clk per F2F.
The memory time is the tile's cache bytes with 64 SMs busy (B = 64, one CTA per sequence, no split)
sharing 900 GB/s. The tile takes the largest of them; that projects the decode's rate and its ratio to
the 16-bit cache. The sm_70 cubin comes from clang++-19 with the CUDA 12.9 root of scripts/check-sm70
(which assembles it). nvdisasm 13 (PyPI has no older one) refuses sm_70, but its SM75 decoder reads
Volta's encoding, so the cubin's arch byte is set to 75 first: treat the SASS as near-exact, not certified.

Usage: scripts/issue-floor [--arch 90|70] [--source F.cu ... | --cubin F ...] [--kernel REGEX]
                           [--clock-ghz G] [--json F]
  --source   compiled here (90: nvcc for sm_90a with the CMake build's flags; 70: clang++-19), by
             default attention_sm90_bf16_quant.cu (the bench's bf16 q) or attention_sm70{,_quant}.cu
  --cubin    read existing cubins instead (70: built for sm_70)
  --kernel   kernels whose mangled name matches (default: the arch's decode kernels, paged rows)
  --clock-ghz  the SM clock (default: 1.78, the H200's under this load on 2026-12-04; 1.53, V100's boost)
Needs cuobjdump (90) or nvdisasm (70): on PATH, in /usr/local/cuda/bin, or from `pip download --no-deps
nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm` (unzip; their nvidia/cu13/bin).
Exit status: 0 a table printed, 1 a compile, disassembly or loop search failed, 2 bad arguments.
"""

import argparse
import collections
import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent
ATTENTION = REPO / "csrc" / "kernels" / "attention"
KV_FORMATS = {"0": "16-bit", "1": "fp8", "2": "fp8_ds_mla", "3": "int8", "4": "int4"}  # KvFormat (mla_kv/layout.h)
# wgmma (16-bit, integer, fp8) and mma.sync
MMA_OPCODES = ("HGMMA", "IGMMA", "QGMMA", "HMMA", "IMMA")

# Instruction classes of the report: the conversions (dequantization and packing), fp32 math, integer
# and address math, the uniform datapath, shared-memory loads and stores, the mma's own instructions,
# and control.
CLASSES = {
    "convert/bitwise": {"LOP3", "HADD2", "HFMA2", "HMUL2", "F2FP", "PRMT", "SHF", "I2F", "F2F", "I2FP", "F2I", "SGXT"},
    "fp32": {"FMUL", "FADD", "FFMA", "FMNMX", "MUFU", "FSETP", "FSEL", "FCHK"},
    "integer": {"IMAD", "IADD3", "ISETP", "LEA", "VIADD", "SEL", "IMNMX", "MOV", "CS2R", "S2R", "IABS", "POPC", "FLO"},
    "uniform": None,  # U* instructions and R2UR / S2UR
    "lds": {"LDS", "LDSM"},
    "sts": {"STS"},
    "global": {"LDG", "STG", "LD", "ST", "LDL", "STL"},
    "mma": {"HGMMA", "IGMMA", "QGMMA", "HMMA", "IMMA", "WARPGROUP", "WARPSYNC"},
    "control": {"BAR", "SYNCS", "BSYNC", "BSSY", "VOTE", "BRA", "SHFL", "FENCE", "MEMBAR", "NOP", "DEPBAR", "YIELD"},
}


def op_class(op: str) -> str:
    if op.startswith("U") or op in ("R2UR", "S2UR"):
        return "uniform"
    for name, ops in CLASSES.items():
        if ops and op in ops:
            return name
    return "other"


@dataclass
class Instruction:
    address: int
    text: str  # without its predicate guard
    guard: str = ""  # "@P0", "@!PT", ... or ""

    @property
    def opcode(self) -> str:
        return self.text.split()[0].split(".")[0]

    def branch_target(self) -> Optional[int]:
        if self.opcode != "BRA":
            return None
        m = re.search(r"0x([0-9a-f]+)\s*$", self.text)
        return int(m.group(1), 16) if m else None


_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:(@!?U?P[T0-9]+)\s+)?(.*?)\s*;")


def parse_sass(text: str) -> Dict[str, List[Instruction]]:
    """cuobjdump -sass output -> {mangled kernel name: its instructions in address order}."""
    kernels: Dict[str, List[Instruction]] = {}
    current: Optional[List[Instruction]] = None
    for line in text.splitlines():
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            current = kernels.setdefault(m.group(1), [])
            continue
        m = _LINE.match(line)
        if m and current is not None:
            current.append(Instruction(int(m.group(1), 16), m.group(3), m.group(2) or ""))
    return kernels


def parse_nvdisasm(text: str) -> Dict[str, List[Instruction]]:
    """nvdisasm -c output -> {mangled kernel name: instructions}, its label operands (`(.L_x_N))
    replaced by the labels' addresses, as cuobjdump writes them."""
    kernels: Dict[str, List[Instruction]] = {}
    for name, body in re.findall(r"//-+ \.text\.(\S+) -+\n(.*?)(?=\n//-+ \.text\.|\Z)", text, re.S):
        ins: List[Instruction] = []
        labels: Dict[str, int] = {}
        pending: List[str] = []
        for line in body.splitlines():
            m = re.match(r"^(\.L_x_\d+):", line)
            if m:
                pending.append(m.group(1))
                continue
            m = _LINE.match(line)
            if m:
                address = int(m.group(1), 16)
                labels.update((label, address) for label in pending)
                pending = []
                ins.append(Instruction(address, m.group(3), m.group(2) or ""))
        for x in ins:
            x.text = re.sub(r"`\((\.L_x_\d+)\)", lambda m: f"{labels.get(m.group(1), -1):#x}", x.text)
        kernels[name] = ins
    return kernels


class LoopError(Exception):
    pass


@dataclass
class TileLoop:
    first: int  # index of the loop's first instruction
    last: int  # index of its backward branch
    vote_block: Tuple[int, int] = (0, 0)  # [start, end) indices of the skipped block, empty if none
    fallbacks: List[Tuple[int, int]] = field(default_factory=list)  # [start, end): rare paths left out
    skippable: int = 0  # common-path instructions that other forward branches inside the loop may skip
    mix: Dict[str, int] = field(default_factory=dict)  # the common path's instructions by class

    @property
    def length(self) -> int:
        return self.last - self.first + 1

    @property
    def vote_length(self) -> int:
        return self.vote_block[1] - self.vote_block[0]

    @property
    def fallback_length(self) -> int:
        return sum(end - start for start, end in self.fallbacks)

    @property
    def common_path(self) -> int:
        return self.length - self.vote_length - self.fallback_length

    def common(self, ins: List[Instruction]) -> List[Instruction]:
        left_out = [self.vote_block, *self.fallbacks]
        return [ins[i] for i in range(self.first, self.last + 1) if not any(a <= i < b for a, b in left_out)]


def find_tile_loop(ins: List[Instruction], vote: bool = True) -> TileLoop:
    """The shortest loop holding every mma; vote: leave out the narrow kernel's vote block. The e4m3
    decode's per-value fallbacks are always left out (find_e4m3_fallbacks)."""
    index = {x.address: i for i, x in enumerate(ins)}
    mmas = [i for i, x in enumerate(ins) if x.opcode in MMA_OPCODES]
    if not mmas:
        raise LoopError("no wgmma / mma instruction")
    detours = divergent_detours(ins, index)
    best: Optional[Tuple[int, int]] = None
    for i, x in enumerate(ins):
        target = x.branch_target()
        if target is None or target >= x.address or target not in index or i in detours:
            continue
        first = index[target]
        if first <= mmas[0] and mmas[-1] <= i and (best is None or i - first < best[1] - best[0]):
            best = (first, i)
    if best is None:
        raise LoopError("no loop holds every wgmma")
    loop = TileLoop(*best)
    inner = [i for i in range(loop.first, loop.last)
             if (t := ins[i].branch_target()) is not None and ins[loop.first].address <= t <= ins[i].address]
    if inner:
        raise LoopError(f"the tile loop has an inner loop (backward branch at {ins[inner[0]].address:#x}): "
                        "its instructions are not issued once a tile")
    if vote:
        loop.vote_block = find_vote_block(ins, loop.first, loop.last, index)
    loop.fallbacks = find_e4m3_fallbacks(ins, loop.first, loop.last, index)
    left_out = [loop.vote_block, *loop.fallbacks]
    for i in range(loop.first, loop.last):
        target = ins[i].branch_target()
        if not any(a - 1 <= i < b for a, b in left_out) and target is not None and target > ins[i].address \
                and target in index and index[target] <= loop.last:
            loop.skippable += index[target] - i - 1
    loop.mix = dict(collections.Counter(op_class(x.opcode) for x in loop.common(ins)).most_common())
    return loop


def divergent_detours(ins: List[Instruction], index: Dict[int, int]) -> set:
    """The instructions only a diverged warp runs: from each BRA.DIV's target to the first unguarded
    branch (clang's sm_70 code takes that path for a shuffle when the warp has diverged, then jumps
    back). The kernels keep their warps converged there, so a back edge inside one is no tile loop."""
    out = set()
    for x in ins:
        if x.opcode == "BRA" and ".DIV" in x.text.split()[0] and x.branch_target() in index:
            i = index[x.branch_target()]
            while i < len(ins):
                out.add(i)
                if ins[i].opcode == "BRA" and not ins[i].guard:
                    break
                i += 1
    return out


def find_vote_block(ins: List[Instruction], first: int, last: int, index: Dict[int, int]) -> Tuple[int, int]:
    vote = next((i for i in range(first, last) if ins[i].opcode == "VOTE" and ".ANY" in ins[i].text), None)
    if vote is None:
        return (0, 0)
    barrier = next((i for i in range(vote, last) if ins[i].opcode == "BAR"), None)
    if barrier is None:
        return (0, 0)
    branch = next((i for i in range(barrier, last) if ins[i].opcode == "BRA"), None)
    target = ins[branch].branch_target() if branch is not None else None
    if target is None or target not in index or not branch < index[target] <= last:
        return (0, 0)
    return (branch + 1, index[target])


def find_e4m3_fallbacks(ins: List[Instruction], first: int, last: int, index: Dict[int, int]) -> List[Tuple[int, int]]:
    """The blocks of dequant.cuh's fp8_values_soft that only NaN codes and scales of 2^8 or more run
    (the per-value decode, which selects a NaN): each is skipped by a guarded forward branch, holds
    an FSEL of +QNAN and no branch, and leaves by an unguarded branch past the path every other vector
    takes."""
    blocks = []
    for i in range(first, last):
        target = ins[i].branch_target()
        if not ins[i].guard or target is None or target not in index or not i < index[target] <= last:
            continue
        end = index[target]
        closing = ins[end - 1]
        if closing.branch_target() is None or closing.guard or closing.branch_target() <= ins[end].address:
            continue
        body = ins[i + 1:end - 1]
        if any(x.opcode == "FSEL" and "QNAN" in x.text for x in body) and not any(x.opcode == "BRA" for x in body):
            blocks.append((i + 1, end))
    return blocks


def kv_format(name: str) -> str:
    m = re.search(r"KvFormatE(\d)E", name)
    return KV_FORMATS.get(m.group(1), "format " + m.group(1)) if m else "?"


def describe(name: str) -> str:
    m = re.search(r"KvFormatE(\d)ELi(\d+)ELb(\d)", name)  # the narrow kernel: <..., F, N, kPair>
    if m:
        return f"{kv_format(name)} N={m.group(2)}" + (" pair" if m.group(3) == "1" else "")
    cta = sm70_cta_rows(name)
    return f"{kv_format(name)}, {cta}-row CTA" if cta else name


def sm70_cta_rows(name: str) -> Optional[int]:
    """The query rows of an Sm70 mma.sync kernel's CTA (its template's config index), else None."""
    m = re.search(r"Sm70E6__halfLi(\d)E", name)  # attention_kernel<Sm70, T, config, Rows, F>
    return SM70_CTA_ROWS.get(int(m.group(1))) if m else None


# The narrow kernel's memory floor: 64-row tiles, the bench's 128 CTAs (B = 64 at two splits, B = 8 at
# 16), the H200's device copy rate as measured on 2026-12-04.
NARROW_TILE_ROWS = 64
H200_CTAS = 128
H200_COPY_GBS = 4230.0

# --------------------------------------------------------------------------- the V100 model
V100_HBM_GBS = 900.0
V100_BUSY_SMS = 64  # B = 64: one CTA per sequence, no split
SM70_TILE_ROWS = 32  # tile_config.h: both Sm70 configurations take 32-row tiles, 8 warps
SM70_CTA_ROWS = {0: 16, 1: 32}  # config index -> query rows per CTA (H = 16 / H = 20 take them)
SM70_WARPS_PER_SCHEDULER = 2
_MEMORY_OPS = CLASSES["lds"] | CLASSES["sts"] | CLASSES["global"]


def mio_units(x: Instruction) -> int:
    """One warp's load / store in 128-byte units of the MIO pipe (at least one)."""
    width = 4
    for part in x.text.split()[0].split(".")[1:]:
        m = re.fullmatch(r"[US]?(8|16|32|64|128)", part)
        if m:
            width = int(m.group(1)) // 8
    return max(1, 32 * width // 128)


def token_bytes(fmt: str) -> int:
    """A cached token's bytes in one layer, int8 / int4's (scale, zero) pair included (mla_kv.layout;
    the package from this checkout when it is not installed)."""
    try:
        from mla_kv import layout
    except ImportError:
        sys.path.insert(0, str(REPO / "python"))
        from mla_kv import layout
    return layout.bytes_per_token(None if fmt == "16-bit" else fmt)


def v100_model(ins: List[Instruction], loop: TileLoop, clock_ghz: float, row_bytes: int) -> dict:
    body = loop.common(ins)
    count = collections.Counter(x.opcode for x in body)
    units = sum(mio_units(x) for x in body if x.opcode in _MEMORY_OPS)
    warps = 4 * SM70_WARPS_PER_SCHEDULER
    cycles = {"issue": SM70_WARPS_PER_SCHEDULER * len(body), "mio": warps * units,
              "hmma": SM70_WARPS_PER_SCHEDULER * 2 * count["HMMA"], "f2f": SM70_WARPS_PER_SCHEDULER * 8 * count["F2F"]}
    us = {k: v / (clock_ghz * 1e3) for k, v in cycles.items()}
    tile_bytes = SM70_TILE_ROWS * row_bytes
    us["memory"] = tile_bytes * V100_BUSY_SMS / (V100_HBM_GBS * 1e3)
    binding = max(us, key=us.get)
    return {"instructions": len(body), "mio_units": units, "hmma_steps": count["HMMA"], "f2f": count["F2F"],
            "us": us, "binding": binding, "tile_us": us[binding],
            "gbs": tile_bytes * V100_BUSY_SMS / (us[binding] * 1e3)}


# --------------------------------------------------------------------------- building and reading
def load_check_sm70():
    """scripts/check_sm70.py (the compile gate) as a module: its CUDA 12.9 root, clang and flags build the
    sm_70 cubins."""
    import check_sm70

    return check_sm70


def find_tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/local/cuda/bin")
    if not found:
        hint = "" if name == "nvcc" else f": `pip download --no-deps nvidia-cuda-{name}`, unzip it, put its nvidia/cu13/bin on PATH"
        raise LoopError(f"{name} not found (PATH, /usr/local/cuda/bin){hint}")
    return found


def run(cmd: List[str], what: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise LoopError(f"{what} failed:\n{(done.stderr or done.stdout)[-4000:]}")
    return done.stdout


def compile_sm90(source: Path, out: Path) -> None:
    nvcc = find_tool("nvcc")
    # The CMake build's nvcc options for csrc/kernels (CMakeLists.txt), sm_90 built as sm_90a.
    run([nvcc, "-O3", "-lineinfo", "--expt-relaxed-constexpr", "-std=c++17", "-arch=sm_90a",
         '-DMLA_KV_CUDA_ARCHS="90"', f"-I{REPO / 'csrc' / 'include'}", "-cubin", "-o", str(out), str(source)],
        f"nvcc on {source}")


def compile_sm70(source: Path, out: Path, gate) -> None:
    try:
        root, clang = gate.ensure_toolchain(), gate.ensure_clang()
    except gate.GateError as e:
        raise LoopError(str(e)) from e
    run([clang, *gate.CLANG_FLAGS, f"--cuda-path={root}", "--cuda-gpu-arch=sm_70", *gate.COMMON_FLAGS,
         "-c", str(source), "-o", str(out)], f"clang on {source}")


def as_sm75(cubin: Path, gate) -> bytes:
    """The sm_70 cubin with its ELF arch set to 75, for nvdisasm's SM75 decoder (Volta's encoding)."""
    arch = gate.cubin_arch(cubin)
    if arch != 70:
        raise LoopError(f"{cubin}: " + ("no cubin" if arch is None else f"a cubin for sm_{arch}, not sm_70"))
    data = bytearray(cubin.read_bytes())
    shift = 8 if data[7] == gate.ELFOSABI_CUDA_V8 else 0  # where check-sm70's cubin_arch found the arch
    (flags,) = struct.unpack_from("<I", data, 48)
    struct.pack_into("<I", data, 48, (flags & ~(0xFF << shift)) | (75 << shift))
    return bytes(data)


def read_kernels(arch: int, sources: List[Path], cubins: List[Path]) -> Dict[str, List[Instruction]]:
    kernels: Dict[str, List[Instruction]] = {}
    gate = load_check_sm70() if arch == 70 else None
    tool = find_tool("cuobjdump" if arch == 90 else "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        paths = list(cubins)
        for i, source in enumerate(sources):
            paths.append(Path(tmp) / f"{i}.cubin")
            (compile_sm90 if arch == 90 else lambda s, o: compile_sm70(s, o, gate))(source, paths[-1])
        for path in paths:
            if arch == 90:
                kernels.update(parse_sass(run([tool, "-sass", str(path)], f"cuobjdump on {path}")))
            else:
                patched = Path(tmp) / "sm75.cubin"
                patched.write_bytes(as_sm75(path, gate))
                kernels.update(parse_nvdisasm(run([tool, "-c", str(patched)], f"nvdisasm on {path}")))
    return kernels


# --------------------------------------------------------------------------- reports
def report(kernels: Dict[str, List[Instruction]], pattern: str, clock_ghz: float) -> List[dict]:
    rows = []
    for name in sorted((n for n in kernels if re.search(pattern, n)), key=describe):
        ins = kernels[name]
        loop = find_tile_loop(ins)
        fmt = kv_format(name)
        tile_bytes = NARROW_TILE_ROWS * token_bytes(fmt) if fmt in KV_FORMATS.values() else None
        rows.append({"kernel": name, "label": describe(name), "loop": loop.length, "vote_block": loop.vote_length,
                     "common_path": loop.common_path, "skippable": loop.skippable,
                     "floor_us": loop.common_path / (clock_ghz * 1e3), "tile_bytes": tile_bytes,
                     "memory_floor_us": tile_bytes * H200_CTAS / (H200_COPY_GBS * 1e3) if tile_bytes else None,
                     "mix": loop.mix})
    return rows


def report_v100(kernels: Dict[str, List[Instruction]], pattern: str, clock_ghz: float) -> List[dict]:
    rows = []
    for name in (n for n in kernels if re.search(pattern, n)):
        fmt, cta = kv_format(name), sm70_cta_rows(name)
        if fmt not in KV_FORMATS.values() or cta is None:
            raise LoopError(f"{name}: not an Sm70 attention kernel (no cache format or configuration in its name)")
        loop = find_tile_loop(kernels[name], vote=False)
        rows.append({"kernel": name, "label": describe(name), "format": fmt, "cta_rows": cta, "mix": loop.mix,
                     "fallback": loop.fallback_length,
                     **v100_model(kernels[name], loop, clock_ghz, token_bytes(fmt))})
    rows.sort(key=lambda r: (r["cta_rows"], r["label"]))
    base = {r["cta_rows"]: r["tile_us"] for r in rows if r["format"] == "16-bit"}
    for r in rows:  # the ratio to the 16-bit cache's kernel of the same CTA
        r["vs_16bit"] = base[r["cta_rows"]] / r["tile_us"] if r["cta_rows"] in base else None
    return rows


def print_floor(rows: List[dict], clock_ghz: float) -> None:
    print(f"| kernel | tile loop | vote block | common path I (branches may skip) | issue floor at {clock_ghz:g} GHz "
          f"(us / tile) | tile bytes | memory floor (us / tile) | common path by class |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        mix = ", ".join(f"{k} {v}" for k, v in r["mix"].items())
        memory = f"{r['tile_bytes']:,} | {r['memory_floor_us']:.2f}" if r["tile_bytes"] else "- | -"
        print(f"| {r['label']} | {r['loop']} | {r['vote_block']} | {r['common_path']} ({r['skippable']}) "
              f"| {r['floor_us']:.2f} | {memory} | {mix} |")
    print(f"(memory floor: a tile's cache bytes for each of {H200_CTAS} CTAs, one per SM, at the H200's device "
          f"copy rate, {H200_COPY_GBS:g} GB/s)")


def print_v100(rows: List[dict], clock_ghz: float) -> None:
    print(f"| kernel | I per warp | e4m3 fallback (left out) | MIO units | HMMA steps | F2F | issue | MIO | HMMA | F2F "
          f"| memory | tile (us, binding) | GB/s, format bytes | x the 16-bit cache |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    for r in rows:
        us = r["us"]
        ratio = f"{r['vs_16bit']:.2f}" if r["vs_16bit"] is not None else "-"
        print(f"| {r['label']} | {r['instructions']} | {r['fallback']} | {r['mio_units']} | {r['hmma_steps']} | {r['f2f']} | {us['issue']:.2f} "
              f"| {us['mio']:.2f} | {us['hmma']:.2f} | {us['f2f']:.2f} | {us['memory']:.2f} | {r['tile_us']:.2f}, {r['binding']} "
              f"| {r['gbs']:.0f} | {ratio} |")
    print(f"(us per tile and SM at {clock_ghz:g} GHz; memory: {SM70_TILE_ROWS} rows x the format's bytes, "
          f"{V100_BUSY_SMS} SMs sharing {V100_HBM_GBS:g} GB/s)")


DEFAULTS = {
    90: ([ATTENTION / "attention_sm90_bf16_quant.cu"], r"attention_narrow_kernel.*PagedTableRows", 1.78),
    70: ([ATTENTION / "attention_sm70.cu", ATTENTION / "attention_sm70_quant.cu"],
         r"attention_kernel.*Sm70E6__half.*PagedTableRows", 1.53),
}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, choices=sorted(DEFAULTS), default=90)
    given = parser.add_mutually_exclusive_group()
    given.add_argument("--cubin", type=Path, action="append")
    given.add_argument("--source", type=Path, action="append")
    parser.add_argument("--kernel")
    parser.add_argument("--clock-ghz", type=float)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    default_sources, default_kernel, default_clock = DEFAULTS[args.arch]
    clock = args.clock_ghz if args.clock_ghz is not None else default_clock
    if clock <= 0:
        parser.error("--clock-ghz must be positive")
    pattern = args.kernel or default_kernel
    try:
        re.compile(pattern)
    except re.error as e:
        parser.error(f"--kernel: {e}")
    sources = [] if args.cubin else (args.source or default_sources)
    try:
        kernels = read_kernels(args.arch, sources, args.cubin or [])
        rows = (report if args.arch == 90 else report_v100)(kernels, pattern, clock)
    except LoopError as e:
        print(f"issue-floor: {e}", file=sys.stderr)
        return 1
    if not rows:
        print(f"issue-floor: no kernel matches {pattern!r}", file=sys.stderr)
        return 1
    (print_floor if args.arch == 90 else print_v100)(rows, clock)
    if args.json:
        args.json.write_text(json.dumps({"arch": args.arch, "clock_ghz": clock, "kernels": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
