"""docs/engine.md's C++ examples compile against the torch-free headers (nvcc, no GPU needed)."""
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC = os.environ.get("CUDACXX") or shutil.which("nvcc")


def cpp_blocks(path):
    with open(path) as f:
        return re.findall(r"```cpp\n(.*?)```", f.read(), flags=re.S)


@pytest.mark.skipif(NVCC is None, reason="no CUDA compiler (nvcc) on PATH or in CUDACXX")
def test_engine_example_compiles(tmp_path):
    blocks = cpp_blocks(os.path.join(ROOT, "docs", "engine.md"))
    assert len(blocks) == 2 and "invokeAttentionBlocks" in blocks[0] and "invokeAttentionPlan" in blocks[0], \
        "docs/engine.md lost its TurboMind example"
    assert all(f in blocks[1] for f in ("invokeWriteIndexKeysPaged", "invokeIndexScores", "invokeIndexTopk",
                                        "invokeSparseAttention")), "docs/engine.md lost its sparse decode step"
    for n, block in enumerate(blocks):
        src = tmp_path / f"engine_example_{n}.cu"
        src.write_text(block)
        result = subprocess.run([NVCC, "-std=c++17", "-c", str(src), "-I", os.path.join(ROOT, "csrc", "include"),
                                 "-o", str(tmp_path / f"engine_example_{n}.o")], capture_output=True, text=True)
        assert result.returncode == 0, f"block {n}: {result.stderr[-4000:]}"
