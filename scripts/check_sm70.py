#!/usr/bin/env python3
"""The sm_70 / sm_75 compile gate.

Compiles every csrc/kernels/**/*.cu and the benchmark probe (csrc/bench/*.cu) device-only for sm_70
and sm_75 with clang++-19 (CUDA 13's nvcc has no sm_70 target) against a CUDA 12.9 root assembled from PyPI wheels, and for sm_80 and sm_90
with nvcc. ptxas rejects instructions a target lacks (ldmatrix below sm_75; cp.async and
mma m16n8k16 below sm_80), and CUDA's bf16 arithmetic does not compile below sm_80 under clang, so
a Volta path that uses them fails here instead of on a V100. Only code emitted for the target is
checked: a kernel template that no .cu instantiates is not. Every output is checked to be a cubin
for the intended arch, and the nvcc compiles' ptxas report to show no wgmma wait inserted by ptxas
and no register spill in the attention kernels (both would silently slow them); the attention kernels
of every compile (clang's included, which has no such report) use no local memory.

Each cubin's kernels are then checked against every GPU class its target serves (GPU_CLASSES: the
sm_70 cubin runs on V100, sm_75 on T4 / RTX 20, sm_80 on A100 and on the sm_86 / sm_89 parts, whose
SMs have fewer threads and less shared memory, sm_90a on H100 / H200). Read from the cubin's ELF
(registers per thread, static shared memory, local memory, the __launch_bounds__ max threads per
block), a kernel fails the gate if it declares no max threads per block (its launch could then need
more registers than an SM has), if its block of max threads holds more registers than the SM (at the
hardware's allocation granularity), if that block has more threads than a block or the SM may, or
if its static shared memory passes 48 KB (what a launch gets without opting in) or the class's
per-block limit. Each violation is one line naming kernel, arch, GPU class, resource, used and
limit; a table of the margins per arch closes the run. Dynamic shared memory is not in a cubin: the
attention kernels' static_asserts (csrc/kernels/attention/tile_config.h) check theirs. Exits non-zero on any failure.

Usage: scripts/check-sm70 [-j N]
Environment: MLA_KV_TOOLCHAIN_DIR (the CUDA 12.9 root; default <repo>/.toolchain/cuda-12.9).
"""

import argparse
import concurrent.futures
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent
CLANG = "clang++-19"
CLANG_ARCHS = (70, 75)
NVCC_ARCHS = (80, 90)
# The build (CMakeLists.txt) gives kernels the list of compiled targets; arch.cu requires it.
COMMON_FLAGS = ["-std=c++17", "-O3", "-I", str(REPO / "csrc" / "include"),
                '-DMLA_KV_CUDA_ARCHS="70,75,80,90"']
# --expt-relaxed-constexpr mirrors the CMake build's nvcc flags (clang allows this by default).
NVCC_FLAGS = ["--expt-relaxed-constexpr"]
# clang 19 knows CUDA up to 12.5 and warns about 12.9; the parts it uses work unchanged.
# -fno-crash-diagnostics: a ptxas error is the expected failure, not a clang crash to report.
CLANG_FLAGS = ["-x", "cuda", "--cuda-device-only", "-Wno-unknown-cuda-version", "-fno-crash-diagnostics"]

# CUDA 12.9 parts: ptxas, crt headers and libdevice (nvcc), runtime headers and libraries,
# CCCL headers, and cuRAND headers (clang's CUDA wrapper includes curand_mtgp32_kernel.h).
TOOLCHAIN_WHEELS = [
    "nvidia-cuda-nvcc-cu12==12.9.86",
    "nvidia-cuda-runtime-cu12==12.9.79",
    "nvidia-cuda-cccl-cu12==12.9.27",
    "nvidia-curand-cu12==10.3.10.19",
]
TOOLCHAIN_VERSION_TEXT = "CUDA Version 12.9.86\n"
# What clang's CUDA detection and a device-only compile need inside the root.
TOOLCHAIN_REQUIRED = ["bin/ptxas", "include/cuda.h", "include/cuda_runtime.h",
                      "include/curand_mtgp32_kernel.h", "nvvm/libdevice/libdevice.10.bc", "lib64",
                      "version.txt"]

EM_CUDA = 190
ELFOSABI_CUDA_V8 = 0x41  # CUDA 12.8+ ELF ABI: arch in e_flags bits 8..15 (older: bits 0..7)


@dataclass(frozen=True)
class GpuClass:
    name: str
    smem_per_block_optin: int  # bytes a block may get after cudaFuncSetAttribute opts it in
    smem_per_sm: int
    regs_per_sm: int
    threads_per_sm: int


# The GPUs each compiled target serves (a cubin runs on its own SM major version, minor version at
# or above it: the sm_80 cubin is what A10 / A40 / RTX 30 (8.6) and L40 / RTX 40 (8.9) load). The
# numbers are what cudaDeviceGetAttribute reports there for cudaDevAttrMaxSharedMemoryPerBlockOptin,
# cudaDevAttrMaxSharedMemoryPerMultiprocessor, cudaDevAttrMaxRegistersPerMultiprocessor and
# cudaDevAttrMaxThreadsPerMultiprocessor (CUDA C++ Programming Guide, "Technical Specifications per
# Compute Capability"). The one table of them: the checks below read nothing else.
GPU_CLASSES: Dict[int, Tuple[GpuClass, ...]] = {
    70: (GpuClass("V100", 98_304, 98_304, 65_536, 2_048),),
    75: (GpuClass("T4 / RTX 20", 65_536, 65_536, 65_536, 1_024),),
    80: (GpuClass("A100", 166_912, 167_936, 65_536, 2_048),
         GpuClass("A10 / A40 / RTX 30 (sm_86)", 101_376, 102_400, 65_536, 1_536),
         GpuClass("L40 / RTX 40 (sm_89)", 101_376, 102_400, 65_536, 1_536)),
    90: (GpuClass("H100 / H200", 232_448, 233_472, 65_536, 2_048),),
}
MAX_THREADS_PER_BLOCK = 1_024  # cudaDevAttrMaxThreadsPerBlock, every class above
STATIC_SMEM_LIMIT = 49_152  # what a launch gets without opting in; static __shared__ cannot opt in
# Registers are allocated per warp in units of 256, i.e. 8 per thread (CUDA occupancy calculator).
REG_ALLOC_UNIT_PER_THREAD = 8
WARP = 32

# The cubin's ELF layout, as ptxas writes it (clang's device compile runs the same ptxas).
ELF64_SHDR = struct.Struct("<IIQQQQIIQQ")  # name, type, flags, addr, offset, size, link, info, align, entsize
ELF64_SYM = struct.Struct("<IBBHQQ")  # name, info, other, shndx, value, size
STO_CUDA_ENTRY = 0x10  # st_other of a __global__ function
# .nv.info attributes: 4-byte header (format, attribute, then a u16 value or, for EIFMT_SVAL, the
# size of the value that follows).
EIFMT_SVAL = 0x04
EIATTR_MAX_THREADS = 0x05  # .maxntid x, y, z: __launch_bounds__'s first argument
EIATTR_REQNTID = 0x10  # .reqntid x, y, z
EIATTR_FRAME_SIZE = 0x11  # .nv.info: symbol index, bytes of stack frame
EIATTR_MIN_STACK_SIZE = 0x12  # .nv.info: symbol index, bytes of stack with the callees'
EIATTR_REGCOUNT = 0x2F  # .nv.info: symbol index, registers per thread


@dataclass(frozen=True)
class KernelResources:
    name: str  # the mangled name
    registers: int  # per thread
    static_smem: int  # bytes of static __shared__ per block
    local: int  # bytes of local memory per thread: stack frame (spills, local arrays) and .nv.local
    max_threads: Optional[int]  # declared max threads per block; None: no __launch_bounds__


class CubinError(Exception):
    """A cubin whose layout this reader does not know."""


def nv_info_attributes(blob):
    """The (attribute, value bytes) entries of a .nv.info section; a u16 value comes as 2 bytes."""
    entries, pos = [], 0
    while pos + 4 <= len(blob):
        fmt, attr = blob[pos], blob[pos + 1]
        if fmt == EIFMT_SVAL:
            (size,) = struct.unpack_from("<H", blob, pos + 2)
            if pos + 4 + size > len(blob):
                raise CubinError(f"EIATTR 0x{attr:02x} runs past its .nv.info section")
            entries.append((attr, blob[pos + 4:pos + 4 + size]))
            pos += 4 + size
        else:
            entries.append((attr, blob[pos + 2:pos + 4]))
            pos += 4
    return entries


def cubin_kernels(data):
    """The resources of each __global__ function of a cubin (bytes), read from its ELF sections:
    registers from EIATTR_REGCOUNT (or the .text section's sh_info bits 24..31), static shared memory
    from the size of .nv.shared.<kernel>, local memory from EIATTR_MIN_STACK_SIZE / EIATTR_FRAME_SIZE
    plus .nv.local.<kernel>, max threads from EIATTR_MAX_THREADS or EIATTR_REQNTID in
    .nv.info.<kernel> (what cuobjdump -elf shows; this reads clang's and nvcc's cubins alike)."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2:
        raise CubinError("not a 64-bit ELF")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shentsize != ELF64_SHDR.size or shoff + shnum * shentsize > len(data) or shstrndx >= shnum:
        raise CubinError("bad section header table")
    sections = [ELF64_SHDR.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]

    def cstr(table_offset, offset):
        end = data.index(b"\0", table_offset + offset)
        return data[table_offset + offset:end].decode("utf-8", "replace")

    shstr_offset = sections[shstrndx][4]
    by_name = {}
    symtab = None
    for index, sh in enumerate(sections):
        name = cstr(shstr_offset, sh[0])
        by_name[name] = sh
        if sh[1] == 2:  # SHT_SYMTAB
            symtab = (index, sh)
    if symtab is None:
        return []
    _, symtab_sh = symtab
    str_offset = sections[symtab_sh[6]][4]
    symbols = []  # (index, name, other, shndx)
    for i in range(symtab_sh[5] // ELF64_SYM.size):
        st_name, st_info, st_other, st_shndx, _, _ = ELF64_SYM.unpack_from(data, symtab_sh[4] + i * ELF64_SYM.size)
        symbols.append((i, cstr(str_offset, st_name), st_other, st_info & 0xF))

    def section_bytes(sh):
        return data[sh[4]:sh[4] + sh[5]]

    # .nv.info: per-function attributes keyed by symbol index.
    per_symbol: Dict[int, Dict[int, int]] = {}
    if ".nv.info" in by_name:
        for attr, value in nv_info_attributes(section_bytes(by_name[".nv.info"])):
            if attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE, EIATTR_MIN_STACK_SIZE) and len(value) >= 8:
                sym, amount = struct.unpack_from("<II", value)
                per_symbol.setdefault(sym, {})[attr] = amount

    kernels = []
    for index, name, other, kind in symbols:
        if kind != 2 or not other & STO_CUDA_ENTRY:  # STT_FUNC entries only
            continue
        attrs = per_symbol.get(index, {})
        text = by_name.get(f".text.{name}")
        registers = attrs.get(EIATTR_REGCOUNT)
        if registers is None:
            if text is None:
                raise CubinError(f"kernel {name} has neither EIATTR_REGCOUNT nor a .text section")
            registers = text[7] >> 24
        shared = by_name.get(f".nv.shared.{name}")
        local_section = by_name.get(f".nv.local.{name}")
        local = max(attrs.get(EIATTR_MIN_STACK_SIZE, 0), attrs.get(EIATTR_FRAME_SIZE, 0))
        local += local_section[5] if local_section else 0
        max_threads = None
        info = by_name.get(f".nv.info.{name}")
        if info is not None:
            for attr, value in nv_info_attributes(section_bytes(info)):
                if attr in (EIATTR_MAX_THREADS, EIATTR_REQNTID) and len(value) >= 12:
                    x, y, z = struct.unpack_from("<III", value)
                    threads = x * max(y, 1) * max(z, 1)
                    max_threads = threads if max_threads is None else min(max_threads, threads)
        kernels.append(KernelResources(name, registers, shared[5] if shared else 0, local, max_threads))
    return kernels


def allocated_registers(registers, threads):
    """Registers a block of `threads` threads holds: per thread rounded up to the allocation unit,
    threads rounded up to whole warps."""
    per_thread = -(-registers // REG_ALLOC_UNIT_PER_THREAD) * REG_ALLOC_UNIT_PER_THREAD
    return per_thread * (-(-threads // WARP) * WARP)


def local_memory_problems(arch, kernels, describe=lambda name: name):
    """One line per attention kernel of an sm_<arch> cubin with local memory: their registers are sized
    to hold every value of the main loop, so local memory is a spill or a value clang left behind an
    outlined lambda (MLA_KV_INLINE_LAMBDA), read from memory on every use."""
    return [f"local memory in an attention kernel: {describe(k.name)}  sm_{arch}  {k.local:,} B per thread"
            for k in kernels if k.local > 0]


def resource_violations(arch, kernels, describe=lambda name: name):
    """One line per limit a kernel of an sm_<arch> cubin exceeds on a GPU class that cubin serves:
    no declared max threads per block (without __launch_bounds__ a launch may use more threads than
    its registers allow), registers of a full block over the SM's, threads per block over the
    block's or the SM's, static shared memory over 48 KB or the class's per-block opt-in limit."""
    classes = GPU_CLASSES[arch]
    lines = []

    def add(kernel, cls, resource, used, limit):
        used = f"{used:,}" if isinstance(used, int) else used
        limit = f"{limit:,}" if isinstance(limit, int) else limit
        lines.append(f"resource violation: {describe(kernel.name)}  sm_{arch}  {cls}  {resource}: "
                     f"used {used}, limit {limit}")

    for k in kernels:
        if k.max_threads is None:  # one line for all the classes: the bound is the kernel's, not theirs
            add(k, ", ".join(c.name for c in classes), "max threads per block",
                "undeclared (no __launch_bounds__)", "must be declared")
        for c in classes:
            if k.max_threads is not None:
                if k.max_threads > MAX_THREADS_PER_BLOCK:
                    add(k, c.name, "threads per block", k.max_threads, MAX_THREADS_PER_BLOCK)
                if k.max_threads > c.threads_per_sm:
                    add(k, c.name, "threads per SM", k.max_threads, c.threads_per_sm)
                regs = allocated_registers(k.registers, k.max_threads)
                if regs > c.regs_per_sm:
                    add(k, c.name, f"registers per SM ({k.registers} x {k.max_threads} threads)", regs,
                        c.regs_per_sm)
            smem_limit = min(STATIC_SMEM_LIMIT, c.smem_per_block_optin)
            if k.static_smem > smem_limit:
                add(k, c.name, "static shared memory per block", k.static_smem, smem_limit)
    return lines


def demangler():
    """A function from mangled to readable kernel names (c++filt / llvm-cxxfilt-19 if present)."""
    tool = shutil.which("c++filt") or shutil.which("llvm-cxxfilt-19")
    if not tool:
        return lambda name: name
    cache = {}
    lock = threading.Lock()

    def describe(name):
        with lock:
            if name not in cache:
                out = subprocess.run([tool, name], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                cache[name] = out.stdout.strip() or name
            return cache[name]
    return describe


def short_name(name):
    """A kernel's bare function name: 'attention_kernel' of 'void mla_kv::detail::attention_kernel<...>(...)'."""
    head = re.split(r"[<(]", name, maxsplit=1)[0]
    return head.split()[-1].rsplit("::", 1)[-1] if head.split() else name


def resource_table(kernels_by_arch, describe=lambda name: name):
    """The margins, one row per arch: kernel count; the largest registers per thread, static shared
    memory, local memory and declared threads per block; and the kernel whose full block holds the
    most registers, against the SM's (the tightest of the arch's GPU classes)."""
    rows = [("arch", "kernels", "max regs", "max static smem", "max local", "max threads",
             "worst regs x threads / regs per SM")]
    for arch in sorted(kernels_by_arch):
        kernels = kernels_by_arch[arch]
        bounded = [k for k in kernels if k.max_threads is not None]
        regs_sm = min(c.regs_per_sm for c in GPU_CLASSES[arch])
        threads_sm = min(c.threads_per_sm for c in GPU_CLASSES[arch])
        worst = max(bounded, key=lambda k: allocated_registers(k.registers, k.max_threads), default=None)
        worst_text = "-" if worst is None else (
            f"{allocated_registers(worst.registers, worst.max_threads):,} / {regs_sm:,} "
            f"({worst.registers} x {worst.max_threads}, {short_name(describe(worst.name))})")
        max_threads = max((k.max_threads for k in bounded), default=0)
        rows.append((f"sm_{arch}", str(len(kernels)), str(max((k.registers for k in kernels), default=0)),
                     f"{max((k.static_smem for k in kernels), default=0):,} B",
                     f"{max((k.local for k in kernels), default=0):,} B",
                     f"{max_threads:,} / {threads_sm:,}" + (f" ({len(kernels) - len(bounded)} undeclared)"
                                                            if len(bounded) < len(kernels) else ""),
                     worst_text))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


class GateError(Exception):
    """A setup problem that stops the gate before any compile."""


def log(msg):
    print(msg, flush=True)


def missing_toolchain_parts(root):
    return [p for p in TOOLCHAIN_REQUIRED if not (root / p).exists()]


def toolchain_member_target(name):
    """Where a wheel member goes in the CUDA root (relative path), or None to skip it.

    Wheels lay files out as nvidia/<component>/{bin,include,lib,nvvm}/...; the root merges them."""
    parts = name.split("/")
    if len(parts) < 3 or parts[0] != "nvidia" or name.endswith("/") or parts[-1] == "__init__.py":
        return None
    component, rel = parts[1], "/".join(parts[2:])
    if rel == "bin/ptxas" or rel.startswith(("include/", "nvvm/libdevice/")):
        return rel
    if component == "cuda_runtime" and rel.startswith("lib/"):
        return "lib64/" + rel[len("lib/"):]
    return None


def assemble_toolchain(root):
    log(f"check-sm70: assembling the CUDA 12.9 root in {root} from PyPI wheels")
    start = time.monotonic()
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cuda-wheels-") as wheel_dir:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
               "--only-binary=:all:", "--dest", wheel_dir, *TOOLCHAIN_WHEELS]
        result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if result.returncode != 0:
            raise GateError(f"pip download of the CUDA 12.9 wheels failed:\n{result.stdout}")
        # Assembled beside the final place and renamed into it, so an interrupted run never leaves
        # a half-filled root that a later run would take as complete.
        staging = Path(tempfile.mkdtemp(prefix=root.name + ".partial-", dir=root.parent))
        try:
            for wheel in sorted(Path(wheel_dir).glob("*.whl")):
                with zipfile.ZipFile(wheel) as zf:
                    for name in zf.namelist():
                        rel = toolchain_member_target(name)
                        if rel is None:
                            continue
                        dest = staging / rel
                        dest.parent.mkdir(parents=True, exist_ok=True)
                        with zf.open(name) as src, open(dest, "wb") as dst:
                            shutil.copyfileobj(src, dst)
            (staging / "lib64").mkdir(exist_ok=True)
            (staging / "bin" / "ptxas").chmod(0o755)
            (staging / "version.txt").write_text(TOOLCHAIN_VERSION_TEXT)
            missing = missing_toolchain_parts(staging)
            if missing:
                raise GateError(f"the CUDA 12.9 wheels lacked {', '.join(missing)}")
            try:
                staging.rename(root)
            except OSError:
                if missing_toolchain_parts(root):  # not a concurrent run that finished first
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    log(f"check-sm70: CUDA 12.9 root ready ({time.monotonic() - start:.1f} s)")


def ensure_toolchain():
    root = Path(os.environ.get("MLA_KV_TOOLCHAIN_DIR") or REPO / ".toolchain" / "cuda-12.9")
    if not root.exists():
        assemble_toolchain(root)
    missing = missing_toolchain_parts(root)
    if missing:
        raise GateError(f"{root} exists but is not a complete CUDA root (missing {', '.join(missing)}); "
                        "remove it and check-sm70 assembles it again")
    return root


def ensure_clang():
    path = shutil.which(CLANG)
    if path:
        return path
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise GateError(f"{CLANG} not found: install Debian's clang-19 (as root: apt-get install clang-19)")
    log(f"check-sm70: {CLANG} not found; installing clang-19 with apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "clang-19"]):
        result = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        if result.returncode != 0:
            raise GateError(f"{' '.join(cmd)} failed:\n{result.stdout}")
    path = shutil.which(CLANG)
    if not path:
        raise GateError(f"clang-19 installed but {CLANG} is not on PATH")
    return path


def find_nvcc():
    path = shutil.which("nvcc") or shutil.which("nvcc", path="/usr/local/cuda/bin")
    if not path:
        raise GateError("nvcc not found (on PATH or /usr/local/cuda/bin) for the sm_80/sm_90 compiles")
    return path


def version_line(exe):
    out = subprocess.run([exe, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True).stdout
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    return next((line for line in lines if "version" in line or "release" in line), lines[0] if lines else "?")


def cubin_arch(path):
    """The SM number a CUDA ELF (cubin) was built for, or None if the file is no cubin."""
    with open(path, "rb") as f:
        header = f.read(52)
    if len(header) < 52 or header[:4] != b"\x7fELF" or header[4] != 2:
        return None
    (machine,) = struct.unpack_from("<H", header, 18)
    (flags,) = struct.unpack_from("<I", header, 48)
    if machine != EM_CUDA:
        return None
    return (flags >> 8) & 0xFF if header[7] == ELFOSABI_CUDA_V8 else flags & 0xFF


def is_attention(source):
    """Whether a translation unit holds attention kernels (the absorbed and the expanded families),
    whose registers are sized to hold their accumulators: no spill and no local memory allowed."""
    return bool({"attention", "expanded"} & set(source.parts))


def register_problem(ptxas_report, attention):
    """What ptxas -v reports that the kernels must not do, or "": a wgmma wait ptxas injected because
    registers of an in-flight wgmma are touched (C7517: it serializes the tensor cores), or, in the
    attention kernels, a spill to local memory (their registers are sized to hold the accumulators;
    the write kernels' register cap trades a small bf16 spill for occupancy, see RESULTS.md)."""
    for line in ptxas_report.splitlines():
        m = re.search(r"(\d+) bytes spill stores", line)
        if attention and m and int(m.group(1)) > 0:
            return f"register spill: {line.strip()}"
        if "C7517" in line:
            return f"injected wgmma wait: {line.strip()}"
    return ""


def compile_one(source, arch, out_dir, clang, nvcc, cuda_root, describe=lambda name: name):
    """Compiles one translation unit for one arch and checks its kernels' resources; returns
    (ok, seconds, compiler output, the kernels' resources)."""
    out = Path(out_dir) / f"{source.relative_to(REPO).as_posix().replace('/', '__')}.sm_{arch}.cubin"
    if arch in CLANG_ARCHS:
        cmd = [clang, *CLANG_FLAGS, f"--cuda-path={cuda_root}", f"--cuda-gpu-arch=sm_{arch}",
               *COMMON_FLAGS, "-c", str(source), "-o", str(out)]
    else:
        # sm_90 is built as sm_90a, as CMakeLists.txt does: wgmma exists only there.
        target = f"{arch}a" if arch == 90 else str(arch)
        cmd = [nvcc, f"-gencode=arch=compute_{target},code=sm_{target}", "-cubin", "-Xptxas", "-v", *NVCC_FLAGS,
               *COMMON_FLAGS, str(source), "-o", str(out)]
    start = time.monotonic()
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    seconds = time.monotonic() - start
    if result.returncode != 0:
        return False, seconds, result.stdout, []
    problem = register_problem(result.stdout, is_attention(source))
    if problem:
        return False, seconds, f"{result.stdout}{problem}\n", []
    built = cubin_arch(out)
    if built != arch:
        what = "no CUDA ELF" if built is None else f"a cubin for sm_{built}"
        return False, seconds, f"{result.stdout}output {out.name} is {what}, not an sm_{arch} cubin\n", []
    try:
        kernels = cubin_kernels(out.read_bytes())
    except CubinError as e:
        return False, seconds, f"{result.stdout}output {out.name}: cannot read its kernels' resources: {e}\n", []
    violations = resource_violations(arch, kernels, describe)
    if is_attention(source):
        violations += local_memory_problems(arch, kernels, describe)
    if violations:
        return False, seconds, result.stdout + "".join(line + "\n" for line in violations), kernels
    return True, seconds, result.stdout, kernels


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-j", "--jobs", type=int, default=2, help="parallel compiles (default 2)")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error("-j/--jobs must be at least 1")

    start = time.monotonic()
    try:
        sources = sorted((REPO / "csrc" / "kernels").rglob("*.cu")) + sorted((REPO / "csrc" / "bench").rglob("*.cu"))
        if not sources:
            raise GateError(f"no .cu sources under {REPO / 'csrc' / 'kernels'}")
        clang = ensure_clang()
        cuda_root = ensure_toolchain()
        nvcc = find_nvcc()
    except GateError as e:
        log(f"check-sm70: error: {e}")
        return 2
    log(f"check-sm70: {version_line(clang)} with {cuda_root} ({version_line(cuda_root / 'bin' / 'ptxas')})")
    log(f"check-sm70: nvcc {nvcc} ({version_line(nvcc)})")
    log(f"check-sm70: {len(sources)} translation units x sm_{', sm_'.join(map(str, CLANG_ARCHS + NVCC_ARCHS))}, "
        f"{args.jobs} jobs")

    # nvcc compiles are the slow ones: start them first so the pool drains evenly.
    jobs = [(s, a) for a in NVCC_ARCHS + CLANG_ARCHS for s in sources]
    width = max(len(s.relative_to(REPO).as_posix()) for s in sources)
    failures = []
    kernels_by_arch: Dict[int, List[KernelResources]] = {a: [] for a in CLANG_ARCHS + NVCC_ARCHS}
    print_lock = threading.Lock()
    describe = demangler()
    with tempfile.TemporaryDirectory(prefix="check-sm70-") as out_dir, \
            concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(compile_one, s, a, out_dir, clang, nvcc, cuda_root, describe): (s, a)
                   for s, a in jobs}
        for future in concurrent.futures.as_completed(futures):
            source, arch = futures[future]
            ok, seconds, output, kernels = future.result()
            kernels_by_arch[arch].extend(kernels)
            rel = source.relative_to(REPO).as_posix()
            compiler = "clang" if arch in CLANG_ARCHS else "nvcc"
            with print_lock:
                log(f"{'ok  ' if ok else 'FAIL'}  sm_{arch}  {compiler:5}  {rel:{width}}  {seconds:6.1f} s")
                if not ok:
                    failures.append(f"sm_{arch} {rel}")
                    log(output.rstrip())
    log("check-sm70: kernel resources (every GPU class of each arch checked; table in GPU_CLASSES):")
    log(resource_table(kernels_by_arch, describe))
    total = time.monotonic() - start
    if failures:
        log(f"check-sm70: {len(failures)} of {len(jobs)} compiles FAILED ({total:.1f} s): {'; '.join(failures)}")
        return 1
    log(f"check-sm70: all {len(jobs)} compiles ok ({total:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
