"""Shared test setup: per-test seeds, the `gpu` marker's skip rule, the `arch` fixture and an
ulp-distance fixture.

Tests marked ``@pytest.mark.gpu`` run only where a CUDA device is visible and mla_kv was built with
its kernels (``mla_kv.kernels_available()``); elsewhere they are skipped with the reason. On the GPU
machine set ``MLA_KV_REQUIRE_GPU=1`` so that a missing device or build fails the run instead of
skipping every kernel test.

A test that takes the ``arch`` fixture runs once per kernel variant its file lists with the
``arch_variants`` marker (ids ``best`` for the GPU's own variant, arch=None, then ``sm80``, ``sm75``,
``sm70``); the fixture skips at setup, with the reason, the variants that do not run on this GPU
or for the test's dtype (nothing at collection needs CUDA).
"""
from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--sweep", default=os.environ.get("MLA_KV_SWEEP", "short"),
                     help="tests/test_sweep.py: 'short' (the default: a few dozen configurations per op), "
                          "'full' (1,000 per op), or comma-separated seeds to rerun (env MLA_KV_SWEEP)")


# The tools of scripts/ are modules there (scripts/check_sm70.py behind scripts/check-sm70, ...): their
# tests import them by name.
sys.path.append(str(Path(__file__).resolve().parent.parent / "scripts"))

# arch fixture ids -> the ``arch`` argument of the ops (None: the GPU's best variant)
ARCH_VARIANTS = {"best": None, "sm80": "sm80", "sm75": "sm75", "sm70": "sm70"}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "arch_variants(*names, bf16_needs_sm80): the kernel variants a test taking the `arch` "
                   "fixture runs on (names from best, sm80, sm75, sm70); bf16_needs_sm80: whether bfloat16 "
                   "skips the sm75/sm70 variants (ops that compute in the dtype) or runs on every one (copies)")


def pytest_generate_tests(metafunc):
    """Parametrizes ``arch`` over the variants of the test's arch_variants marker (ids: their names).
    Tests without the marker are left alone (one may parametrize an ``arch`` of its own)."""
    marker = metafunc.definition.get_closest_marker("arch_variants")
    if marker is None or "arch" not in metafunc.fixturenames:
        return
    if "bf16_needs_sm80" not in marker.kwargs or not marker.args or not set(marker.args) <= set(ARCH_VARIANTS):
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: arch_variants takes names from "
                                f"{list(ARCH_VARIANTS)} and bf16_needs_sm80=True/False, got {marker}")
    metafunc.parametrize("arch", list(marker.args), ids=list(marker.args), indirect=True)


def _arch_skip_reason(name, marker, dtype):
    """Why variant ``name`` does not run here for ``dtype`` (None: it runs). Called at setup only."""
    if name == "sm80" and torch.cuda.get_device_capability()[0] < 9:
        return ("sm80 runs apart from best only on sm90+ GPUs (there best takes the wgmma kernel): "
                "on this GPU best is the sm80 kernel or an older one")
    if name in ("sm75", "sm70") and dtype == torch.bfloat16 and marker.kwargs["bf16_needs_sm80"]:
        return f"{name}: bfloat16 needs the sm80 kernels"
    return None


@pytest.fixture
def arch(request):
    """The ``arch`` argument of one kernel variant (None: the GPU's best); see pytest_generate_tests."""
    name = getattr(request, "param", None)
    if name is None:
        pytest.fail(f"{request.node.nodeid} takes `arch` without an arch_variants marker", pytrace=False)
    reason = _arch_skip_reason(name, request.node.get_closest_marker("arch_variants"),
                               request.node.callspec.params.get("dtype"))
    if reason is not None:
        pytest.skip(reason)
    return ARCH_VARIANTS[name]


def _gpu_unavailable_reason():
    if not torch.cuda.is_available():
        return "no CUDA device"
    from mla_kv import ops  # imported late: a CPU-only run must not need the package importable
    if not ops.kernels_available():
        return "mla_kv was built without its CUDA kernels"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    reason = _gpu_unavailable_reason()
    if reason is None:
        return
    if os.environ.get("MLA_KV_REQUIRE_GPU") == "1":
        raise pytest.UsageError(f"MLA_KV_REQUIRE_GPU=1 but GPU tests cannot run: {reason}")
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed(request):
    """Seeds torch from the test's id: reruns see the same data, different tests different data."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


_INT_OF = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
           torch.float64: torch.int64}


def _ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise count of representable values of a's dtype between a and b (int64; 0 = equal).

    Floats are mapped to integers in value order (sign-magnitude bits -> two's complement), so the
    difference counts steps exactly, across binade edges and subnormals; +0 and -0 are 0 apart.
    """
    if a.dtype != b.dtype or a.dtype not in _INT_OF:
        raise TypeError(f"ulp_distance needs two tensors of one float dtype, got {a.dtype} and {b.dtype}")
    int_dtype = _INT_OF[a.dtype]
    magnitude_mask = torch.iinfo(int_dtype).max

    def ordered(x):
        bits = x.contiguous().view(int_dtype)
        return torch.where(bits < 0, -(bits & magnitude_mask), bits).to(torch.int64)

    return (ordered(a) - ordered(b)).abs()


@pytest.fixture
def ulp_distance():
    """The function ``ulp_distance(a, b)`` above, for tests comparing against a rounding tolerance."""
    return _ulp_distance
