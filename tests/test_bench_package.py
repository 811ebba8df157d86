"""The benchmarks as a subpackage (mla_kv.bench) behind ``mla-kv bench``: what runs without a GPU.

The timings themselves need a CUDA GPU (scripts/gpu-check runs bench/bench_*.py there); here: the
options and help of every op, the dispatch of a full run, the messages without a GPU or matplotlib,
the file names of --json / --plot, and that the modules import from the package alone.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mla_kv
import mla_kv.bench.write
from mla_kv import _plot, bench
from mla_kv.bench import common
from test_cli import run_cli

ROOT = Path(__file__).resolve().parents[1]

# Options each op must keep (scripts/gpu-check, RESULTS.md and docs/ call them).
OPTIONS = {
    "write": ["--quick", "--json", "--plot", "--heads-q", "--kv-formats"],
    "decode": ["--quick", "--json", "--plot", "--arch", "--gpu", "--only", "--kv-formats"],
    "gather": ["--quick", "--json", "--plot"],
    "prefill": ["--quick", "--json", "--plot", "--routes", "--arch", "--table", "--check"],
    "expanded": ["--quick", "--json", "--plot"],
    "cp": ["--quick", "--json", "--gpus", "--part"],
    "profile_decode": ["--times", "--kv-format"],
    "tile_copy": ["--quick", "--json"],
    "unequal": ["--quick", "--json", "--heads", "--kv-formats"],
    "sparse": ["--quick", "--json", "--heads", "--kv-formats", "--archs", "--topk"],
    "indexer": ["--quick", "--json", "--heads", "--archs"],
    "index_topk": ["--quick", "--json", "--archs"],
}


def test_every_op_has_its_options_listed():
    assert set(OPTIONS) == set(bench.OPS)
    assert set(bench.ALL) <= set(bench.OPS) and set(bench.PLOTTED) <= set(bench.ALL)


def test_bench_help_lists_every_op():
    r = run_cli("bench", "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: mla-kv bench")
    listed = {line.split()[0] for line in r.stdout.splitlines() if line.startswith("  ") and line.split()}
    assert set(bench.OPS) <= listed, r.stdout
    assert all(option in r.stdout for option in ("--quick", "--json", "--plot", "mla_kv[plot]"))


@pytest.mark.parametrize("op", list(OPTIONS))
def test_op_help_without_gpu(op):
    r = run_cli("bench", op, "--help", cwd="/tmp")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: mla-kv bench {op} ")
    assert all(option in r.stdout for option in OPTIONS[op]), r.stdout
    assert ("--plot" in r.stdout) == (op in bench.PLOTTED)


@pytest.mark.parametrize("script", ["bench_write", "bench_decode", "bench_gather", "bench_prefill", "bench_expanded",
                                    "bench_cp", "profile_decode"])
def test_entry_points_in_bench_call_the_package(script):
    """bench/*.py stay for scripts/gpu-check and source-tree use: a call of the package's main, no code."""
    path = ROOT / "bench" / f"{script}.py"
    op = script.replace("bench_", "")
    assert f"from mla_kv.bench.{op} import main" in path.read_text()
    assert len([line for line in path.read_text().splitlines() if line.strip()]) <= 5
    r = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, cwd="/tmp",
                       env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: {script}.py ")


def test_gpu_check_benchmarks_have_entry_points():
    text = (ROOT / "scripts" / "gpu-check").read_text()
    assert 'python3 "$ROOT/bench/bench_$b.py" ${BENCH_ARGS:-} --json' in text
    for b in ("write", "decode", "gather", "prefill"):
        assert (ROOT / "bench" / f"bench_{b}.py").is_file()


def _env() -> dict:
    env = dict(os.environ)
    package_root = str(Path(mla_kv.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def test_modules_import_from_the_package_alone():
    """From another directory, with no bench/ on the path: the modules and their helpers are in mla_kv."""
    code = ("import sys, mla_kv, mla_kv.bench.common, mla_kv.bench.write, mla_kv.bench.decode, "
            "mla_kv.bench.gather, mla_kv.bench.prefill, mla_kv.bench.expanded, mla_kv.bench.cp, "
            "mla_kv.bench.profile_decode\n"
            "print(mla_kv.__file__); print(mla_kv.bench.decode.__file__); print('common' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/tmp", env=_env(),
                       timeout=300)
    assert r.returncode == 0, r.stderr
    package, module, stray_common = r.stdout.split()
    assert Path(module).parent == Path(package).parent / "bench"
    assert stray_common == "False"  # no top-level "common" (the old bench/common.py) was needed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("op", ["write", "decode", "gather", "prefill", "expanded", "profile_decode"])
def test_op_without_gpu_exits_1_with_one_line(op, capsys):
    argv = ["--times"] if op == "profile_decode" else ["--quick"]
    assert bench.main([op, *argv]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [f"mla-kv bench {op}: needs a CUDA GPU and the compiled kernels"]


@pytest.mark.parametrize("argv", [["--quick", "--plot", "out.png"], ["decode", "--plot", "out"]], ids=" ".join)
def test_plot_without_matplotlib_names_the_extra(monkeypatch, capsys, argv):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert bench.main(argv) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.strip().endswith("--plot needs matplotlib: pip install mla_kv[plot]")


@pytest.mark.parametrize("path, says", [("missing-dir/out.png", "no folder"), ("out.unknown-format", "does not write")])
def test_bad_plot_path_is_refused_before_measuring(tmp_path, capsys, path, says):
    pytest.importorskip("matplotlib")
    assert bench.main(["gather", "--plot", str(tmp_path / path)]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and says in err and "needs a CUDA GPU" not in err


@pytest.mark.parametrize("argv", [["frobnicate"], ["--quick", "decode"], ["--quik"]], ids=" ".join)
def test_bad_bench_arguments_exit_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1 and "error:" in captured.err


def test_profile_decode_refuses_an_unknown_kv_format_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["profile_decode", "1", "64", "16", "--kv-format", "fp9"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-format" in err and "'fp9'" in err and "int4" in err and "needs a CUDA GPU" not in err


@pytest.mark.parametrize("path, written", [
    ("out", "out.png"), ("out.", "out.png"), ("out.png", "out.png"), ("plots/out.pdf", "plots/out.pdf"),
    ("v1.2/out", "v1.2/out.png"), ("out.svg", "out.svg"),
])
def test_written_path(path, written):
    assert _plot.written_path(path) == written


@pytest.mark.parametrize("path, op, named", [
    ("out.json", "write", "out_write.json"), ("runs/b.png", "decode", "runs/b_decode.png"), ("out", "cp", "out_cp"),
    ("", "write", ""),
])
def test_op_path(path, op, named):
    assert bench.op_path(path, op) == named


ROWS = [{"op": "write_kv", "dtype": "float16", "T": 64, "% copy": 41.5, "native % copy": None},
        {"op": "write_kv", "dtype": "float16", "T": 65536, "% copy": 92.0, "native % copy": 60.0}]


def test_write_plot_writes_and_prints_the_file(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    written = common.write_plot(str(tmp_path / "write"), "write_kv on a test", ROWS, ["op", "dtype", "T"],
                                ["% copy", "native % copy"], "device copy bandwidth 4,000 GB/s")
    assert written == str(tmp_path / "write.png")
    assert (tmp_path / "write.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "write").exists()
    assert capsys.readouterr().out == f"plot written to {tmp_path / 'write.png'}\n"
    assert common.write_plot("", "no file", ROWS, ["op"], ["% copy"], "-") == ""


class _FakeCuda:
    """What a full run asks of torch.cuda, on a machine with ``count`` GPUs."""

    def __init__(self, count):
        self.count = count

    def apply(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(mla_kv, "kernels_available", lambda: True)


@pytest.mark.parametrize("gpus", [1, 2])
def test_full_run_dispatches_in_process(monkeypatch, capsys, tmp_path, gpus):
    pytest.importorskip("matplotlib")
    _FakeCuda(gpus).apply(monkeypatch)
    calls = []

    def run(op, argv, prog):
        calls.append((op, argv, prog))
        if op == "decode":
            raise RuntimeError("a decode failure")
        return 1 if op == "gather" else 0

    monkeypatch.setattr(bench, "run", run)
    out_json, out_png = str(tmp_path / "b.json"), str(tmp_path / "b.png")
    assert bench.main(["--quick", "--json", out_json, "--plot", out_png]) == 1
    expected = [op for op in bench.ALL if op != "cp" or gpus >= 2]
    assert [c[0] for c in calls] == expected
    for op, argv, prog in calls:
        want = ["--quick", "--json", str(tmp_path / f"b_{op}.json")]
        want += ["--plot", str(tmp_path / f"b_{op}.png")] if op in bench.PLOTTED else []
        assert (argv, prog) == (want, "mla-kv bench")
    captured = capsys.readouterr()
    assert "RuntimeError: a decode failure" in captured.err  # reported, and the others still ran
    assert captured.err.strip().splitlines()[-1] == "mla-kv bench: failed: decode, gather"
    assert ("cp: not run" in captured.out) == (gpus < 2)


def test_run_calls_the_ops_main(monkeypatch):
    seen = {}
    monkeypatch.setattr(bench.write, "main", lambda argv, prog: seen.update(argv=argv, prog=prog) or 7)
    assert bench.run("write", ["--quick"]) == 7
    assert seen == {"argv": ["--quick"], "prog": "mla-kv bench write"}



# ---- each op's main with the measurements faked: its table, JSON keys and plot on the CPU ----------
def _decode_row(batch, ctx, heads, dtype, layout, gen, arch=None, gpu=None, kv_format=None):
    return {"arch": arch or "auto", "gpu": gpu or "-", "tiles": "64x64/2 226K", "layout": layout,
            "dtype": str(dtype).split(".")[1], "B": batch, "ctx": ctx, "H": heads, "splits": 1, "ms": 0.1,
            "GB/s": 3000.0, "TFLOP/s": 50.0, "native_ms": None, "native_GB/s": None}


def _gather_row(rows, dtype, layout, gen):
    native = 2000.0 if layout == "paged" else None
    return {"layout": layout, "dtype": str(dtype).split(".")[1], "rows": rows, "B": 1, "us": 10.0, "GB/s": 3500.0,
            "native_us": 20.0 if native else None, "native_GB/s": native}


def _prefill_row(label, q_len, kv_len, heads, dtype, gen):
    return {"case": label, "model": "m", "dtype": str(dtype).split(".")[1], "B": 1, "q_len": q_len, "kv_len": kv_len,
            "H": heads, "kernel_ms": 1.0, "TFLOP/s": 300.0, "absorbed_ms": 1.2, "expanded_ms": 1.5,
            "expanded/absorbed": 1.25, "winner": "absorbed", "rel_diff": 1e-3, "op_ms": 1.4, "op mem-eff_ms": 1.6,
            "mem-eff attn_ms": 1.3, "mem-eff op overhead %": 23.1, "op_diff": 1e-3}


def _expanded_rows(label, model, heads, batch, q_len, kv_len, gen, tags, ceilings):
    return [{"case": label, "model": model, "H": heads, "B": batch, "q_len": q_len, "kv_len": kv_len,
             "kernel": "mla_kv expanded", "tag": tag, "ms": 1.0, "TFLOP/s": 50.0, "% mma": 40.0, "x absorbed": 2.0,
             "x mem-eff": 0.5, "rel_diff": 1e-4} for tag in tags]


def _write_rows(tokens, dtypes, heads_q, kv_formats):
    return [{"op": op, "dtype": str(d).split(".")[1], "T": t, "us": 5.0, "bytes": t * 2312, "GB/s": 1000.0,
             "/ 16-bit": 1.0 if "[" in op else None, "torch_native_us": None, "torch_native_GB/s": None}
            for d in dtypes for t in tokens
            for op in ("write_kv", "fused_write_kv", *(f"fused_write_kv[{f}]" for f in kv_formats))]


# op -> (the function faked, its fake, the JSON keys the op has always written)
FAKED = {
    "write": ("run", _write_rows, {"device", "copy_GBps", "rows"}),
    "decode": ("run_case", _decode_row, {"device", "copy_GBps", "mma_TFLOPs", "rows"}),
    "gather": ("run_case", _gather_row, {"device", "copy_GBps", "rows"}),
    "prefill": ("run_case", _prefill_row, {"device", "mma_TFLOPs", "rows"}),
    "expanded": ("run_case", _expanded_rows, {"device", "mma_TFLOPs", "rows"}),
}


@pytest.mark.parametrize("op", list(FAKED))
def test_op_main_writes_table_json_and_plot(op, monkeypatch, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    import importlib

    module = importlib.import_module(f"mla_kv.bench.{op}")
    name, fake, keys = FAKED[op]
    monkeypatch.setattr(module, name, fake)
    monkeypatch.setattr(common, "kernels_present", lambda name: True)
    monkeypatch.setattr(common, "copy_bandwidth", lambda: 4e12)
    monkeypatch.setattr(common, "mma_ceiling", lambda dtype, arch=None: 1e15)
    monkeypatch.setattr(common, "device_info", lambda: {"gpu": "Fake GPU"})
    cpu_generator = torch.Generator
    monkeypatch.setattr(torch, "Generator", lambda device=None: cpu_generator())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    out_json, out_plot = tmp_path / f"{op}.json", tmp_path / op
    assert module.main(["--quick", "--json", str(out_json), "--plot", str(out_plot)], prog=f"mla-kv bench {op}") == 0
    payload = json.loads(out_json.read_text())
    assert set(payload) == keys and payload["rows"]
    ceiling_columns = {"write": ["% copy"], "decode": ["% copy", "% mma"], "gather": ["% copy", "native % copy"],
                       "prefill": ["% mma"], "expanded": ["% mma"]}[op]
    assert all(c in payload["rows"][0] for c in ceiling_columns)
    assert (tmp_path / f"{op}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert f"plot written to {tmp_path / (op + '.png')}" in out and " | " in out  # the table and the file
