"""What the wheel carries for type checkers and at run time: py.typed (PEP 561), the route table, the build info.

Builds a reference-only wheel (MLA_KV_CUDA_ARCHS=none: no CUDA compile, a few seconds) with the build
backend of this environment; skipped where scikit-build-core, pybind11 or cmake is missing.
"""
import importlib.util
import inspect
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import mla_kv

ROOT = Path(__file__).resolve().parents[1]


def test_the_package_is_marked_typed():
    assert (ROOT / "python" / "mla_kv" / "py.typed").is_file()


def test_public_functions_are_annotated():
    for name in mla_kv.__all__:
        fn = getattr(mla_kv, name)
        if not inspect.isfunction(fn):
            continue
        signature = inspect.signature(fn)
        assert signature.return_annotation is not inspect.Signature.empty, f"{name}: no return annotation"
        bare = [p for p, v in signature.parameters.items() if v.annotation is inspect.Parameter.empty]
        assert not bare, f"{name}: unannotated {bare}"


@pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("scikit_build_core", "pybind11"))
                    or shutil.which("cmake") is None, reason="needs scikit-build-core, pybind11 and cmake")
def test_wheel_carries_py_typed(tmp_path):
    env = dict(os.environ, MLA_KV_CUDA_ARCHS="none")
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
                          "-C", f"build-dir={tmp_path / 'build'}", "-w", str(tmp_path), str(ROOT)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    wheel, = tmp_path.glob("mla_kv-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for member in ("mla_kv/py.typed", "mla_kv/prefill_routes.json", "mla_kv/_build_info.py", "mla_kv/cli.py"):
        assert member in names, f"{member} missing from {wheel.name}"
