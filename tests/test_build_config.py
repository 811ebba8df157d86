"""CMakeLists.txt's answers to MLA_KV_CUDA_ARCHS, at configure time (no compile), and the ptxas note filter.

An unknown arch stops the configure before any compiler is looked for, with one line of the project's
own; an arch the found nvcc cannot target (sm_70 with CUDA 13) stops it with one line naming the arch,
the compiler and the ways out. Each configure takes a few seconds; skipped without cmake (and the sm_70
case without an nvcc that lacks sm_70).
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CMAKE = shutil.which("cmake")
needs_cmake = pytest.mark.skipif(CMAKE is None, reason="needs cmake")


def configure(build_dir, archs=None, env_archs=None):
    env = {k: v for k, v in os.environ.items() if k != "MLA_KV_CUDA_ARCHS"}
    if env_archs is not None:
        env["MLA_KV_CUDA_ARCHS"] = env_archs
    args = [CMAKE, "-S", str(ROOT), "-B", str(build_dir)]
    if archs is not None:
        args.append(f"-DMLA_KV_CUDA_ARCHS={archs}")
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)


def error_lines(run):
    """The lines of the project's error message (they start with 'mla_kv:' after CMake's indent)."""
    return [line.strip() for line in run.stderr.splitlines() if "mla_kv:" in line]


@needs_cmake
@pytest.mark.parametrize("archs, env_archs, bad", [("banana", None, "banana"), (None, "80,banana", "banana"),
                                                   ("sm_90", None, "sm_90"), ("90a", None, "90a")])
def test_unknown_arch_is_one_line(tmp_path, archs, env_archs, bad):
    run = configure(tmp_path / "build", archs, env_archs)
    assert run.returncode != 0
    lines = error_lines(run)
    assert len(lines) == 1, run.stderr
    assert f'unknown arch "{bad}"' in lines[0] and "70 75 80 86 89 90" in lines[0] and lines[0].endswith(")")
    assert "CUDA compiler" not in run.stdout  # stopped before looking for one


@needs_cmake
def test_the_environment_replaces_a_cached_value(tmp_path):
    """pip reuses build/<wheel tag>: a later MLA_KV_CUDA_ARCHS must not be shadowed by the first one's cache."""
    build = tmp_path / "build"
    assert configure(build, env_archs="none").returncode == 0
    run = configure(build, env_archs="banana")
    assert run.returncode != 0 and 'unknown arch "banana"' in run.stderr


def _nvcc_without_sm70():
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        return None
    listed = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True).stdout
    return nvcc if listed and "compute_70" not in listed else None


@needs_cmake
@pytest.mark.skipif(_nvcc_without_sm70() is None, reason="needs an nvcc that cannot target sm_70 (CUDA 13+)")
def test_sm70_with_an_nvcc_that_lacks_it_is_one_line(tmp_path):
    run = configure(tmp_path / "build", "70")
    assert run.returncode != 0
    lines = error_lines(run)
    assert len(lines) == 1, run.stderr
    line = lines[0]
    assert "asks for sm_70" in line and re.search(r"nvcc \(CUDA \d+\.\d+\) cannot target", line), line
    assert "CUDA 12.x nvcc" in line and "scripts/check-sm70" in line
    assert "Unsupported gpu architecture" not in run.stderr  # stopped before CMake's own compiler checks


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX sh")
def test_quiet_ptxas_drops_only_the_c7519_notes():
    note = ("ptxas info    : (C7519) warpgroup.arrive is injected in around line 26116 by compiler to allow use "
            "of registers in GMMA in function 'k'")
    script = f"printf '%s\\n' \"{note}\" 'ptxas warning : something else' >&2; echo out; exit 3"
    run = subprocess.run(["sh", str(ROOT / "cmake" / "quiet-ptxas.sh"), "sh", "-c", script], capture_output=True,
                         text=True)
    assert run.returncode == 3 and run.stdout == "out\n"
    assert run.stderr == "ptxas warning : something else\n"
