"""The C++ engine step (tests/cpp/engine_step.cu, built by CMake as mla_kv_engine_step).

The program runs the MLA layers of an engine on a block pool laid out as TurboMind lays one out: a
prefill that hits a cached prefix of read-only blocks, then decode steps. It calls mla_kv's
torch-free invoke* API and nothing else, and checks every written row, q's rotated part, every
out / lse row and every byte it must not touch against its own CPU reference in double precision.
The tests here check that it runs, passes, and covers every arch tag this GPU runs, and that its
source stays free of torch.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]  # not the cwd: scripts/gpu-check runs pytest from /tmp
SOURCE = ROOT / "tests" / "cpp" / "engine_step.cu"
BUILD_HINT = (f"it is built with the package: `pip install -v .` in {ROOT} puts it in build/<wheel_tag>/ "
              "(or a CMake build with MLA_KV_BUILD_ENGINE_STEP=ON in its build directory); set "
              "MLA_KV_ENGINE_STEP to use another binary")
TAGS = ("sm70", "sm75", "sm80", "sm90")
STEPS = ("prefix", "prefill", "decode 1", "decode 2", "decode 3")


def engine_step_binary() -> Optional[Path]:
    """$MLA_KV_ENGINE_STEP, else the newest <repo>/build/*/mla_kv_engine_step (None: none built)."""
    given = os.environ.get("MLA_KV_ENGINE_STEP")
    if given:
        return Path(given)
    built = sorted((ROOT / "build").glob("*/mla_kv_engine_step"), key=lambda p: p.stat().st_mtime)
    return built[-1] if built else None


def runnable_tags():
    """{tag: dtypes} for the arch tags this GPU runs in the installed build (the binary is built with
    it, from the same MLA_KV_CUDA_ARCHS): the program must run each of them."""
    import torch
    from mla_kv import ops

    major, minor = torch.cuda.get_device_capability()
    tags = {}
    for name in TAGS:
        tag = getattr(ops._C.Arch, name)
        if ops._C.resolve_arch(tag, major * 10 + minor) == tag:
            tags[name] = ("fp16", "bf16") if ops._C.tag_has_bf16(tag) else ("fp16",)
    return tags


@pytest.mark.gpu
def test_engine_step_passes_on_every_arch_tag():
    binary = engine_step_binary()
    if binary is None:
        pytest.fail(f"no mla_kv_engine_step under {ROOT / 'build'}: {BUILD_HINT}", pytrace=False)
    if not binary.is_file():
        pytest.fail(f"MLA_KV_ENGINE_STEP={binary} is not a file: {BUILD_HINT}", pytrace=False)
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode == 0, f"{binary} exited {result.returncode}:\n{log[-8000:]}"
    assert re.search(r"^engine_step: ok$", result.stdout, flags=re.M), log[-8000:]
    ran = re.search(r"^ran:(.*)$", result.stdout, flags=re.M)
    assert ran is not None, f"{binary} printed no 'ran:' line:\n{log[-8000:]}"
    ran = set(ran.group(1).split())
    want = runnable_tags()
    assert want, "this GPU runs no arch tag of the build, yet the gpu tests run"
    for tag, dtypes in want.items():
        for dt in dtypes:
            assert f"{tag}/{dt}" in ran, f"{tag} {dt} runs on this GPU but the program did not run it:\n{log[-8000:]}"
            for step in STEPS:  # one checked line per step
                line = re.search(rf"^{tag} {dt} {step} .*  ok$", result.stdout, flags=re.M)
                assert line is not None, f"no passing line for {tag} {dt} {step}:\n{log[-8000:]}"


def test_engine_step_uses_only_the_torch_free_api():
    """The program goes through the invoke* API alone: it includes mla_kv's public headers, the CUDA
    runtime and fp16/bf16 headers and the C++ standard library; nothing of torch, pybind11 or the
    kernels' internals."""
    includes = re.findall(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', SOURCE.read_text(), flags=re.M)
    assert "mla_kv/turbomind.h" in includes and "mla_kv/attention.h" in includes and "mla_kv/write.h" in includes
    allowed_cuda = {"cuda_runtime.h", "cuda_fp16.h", "cuda_bf16.h"}
    for inc in includes:
        public = inc.startswith("mla_kv/") and (ROOT / "csrc" / "include" / inc).is_file()
        std = "/" not in inc and "." not in inc  # <vector>, <cstdio>, ...
        assert public or std or inc in allowed_cuda, f"{SOURCE.name} includes {inc}: not the torch-free API"
