"""The mla-kv command line, run as ``python -m mla_kv.cli`` in a subprocess (bad-argument matrix in-process).

The subprocess imports the same mla_kv the tests import (installed or from the source tree).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mla_kv
from mla_kv import cli

SEED_EXAMPLE = ["plan", "--model", "glm-4.7-flash", "--gpu-mem-gib", "32", "--weights-gb", "18.4", "--ratio", "0.8"]


def run_cli(*args, cwd=None):
    env = dict(os.environ)
    package_root = str(Path(mla_kv.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "mla_kv.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def test_plan_table():
    r = run_cli(*SEED_EXAMPLE)
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line.split()}
    # layout, B/token/layer, B/token, B/block, blocks, max tokens, session_len
    assert rows["latent"][1:7] == ["1,152", "54,144", "3,465,216", "3,188", "204,032", "202,752"]
    assert rows["expanded"][1:7] == ["46,080", "2,165,760", "138,608,640", "79", "5,056", "5,056"]
    assert "(truncated)" in " ".join(rows["expanded"]) and "(truncated)" not in " ".join(rows["latent"])


def test_plan_json():
    r = run_cli(*SEED_EXAMPLE, "--json", "--tp", "4", "--cp", "2", "--block-size", "32")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    latent, expanded = out["latent"], out["expanded"]
    assert (latent["bytes_per_token"], expanded["bytes_per_token"]) == (47 * 1_152, 47 * 5 * 2 * 1_152)
    cache = (32 * 2 ** 30 - 18_400_000_000 // 4 - 2 * 2 ** 30) * 4 // 5
    assert latent["max_tokens"] == cache // (32 * 47 * 1_152) * 32 * 2
    assert expanded["max_tokens"] == cache // (32 * 47 * 11_520) * 32 * 2
    assert latent["session_len"] == 202_752 and expanded["session_len"] == expanded["max_tokens"]
    assert (out["tp"], out["cp"], out["model"]["name"]) == (4, 2, "glm-4.7-flash")


# bytes per token and layer of each cache format, from its byte layout (fp16 compute dtype)
FORMAT_BYTES = {"fp16": 576 * 2, "fp8": 576, "fp8_ds_mla": 512 + 4 * 4 + 64 * 2, "int8": 576 + 2 * 2,
                "int4": 576 // 2 + 2 * 2}
KV_FORMAT_ALL = ["plan", "--model", "glm-4.7-flash", "--gpu", "v100-32g", "--weights-gb", "18.4", "--kv-format", "all"]


def test_plan_kv_format_all_table():
    r = run_cli(*KV_FORMAT_ALL)
    assert r.returncode == 0, r.stderr
    table = r.stdout.split("\n\n")[1].splitlines()
    assert table[0].split()[:2] == ["format", "B/token/layer"]
    assert [line.split()[0] for line in table[1:]] == list(FORMAT_BYTES)      # five rows, one per format
    cache = (32 * 2 ** 30 - 18_400_000_000 - 2 * 2 ** 30) * 4 // 5
    for line in table[1:]:
        name, *cells = line.split()
        per_layer = FORMAT_BYTES[name]
        blocks = cache // (64 * 47 * per_layer)
        assert cells == [f"{n:,}" for n in (per_layer, 47 * per_layer, 64 * 47 * per_layer, blocks, blocks * 64,
                                            202_752)], line


def test_plan_kv_format_all_json():
    r = run_cli(*KV_FORMAT_ALL, "--json", "--block-size", "16")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [f["kv_format"] for f in out["kv_formats"]] == [None, "fp8", "fp8_ds_mla", "int8", "int4"]
    cache = (32 * 2 ** 30 - 18_400_000_000 - 2 * 2 ** 30) * 4 // 5
    assert out["cache_bytes"] == cache and out["gpu"] == "v100-32g"
    for f, per_layer in zip(out["kv_formats"], FORMAT_BYTES.values()):
        assert (f["bytes_per_token_per_layer"], f["bytes_per_block"]) == (per_layer, 16 * 47 * per_layer)
        assert f["max_tokens"] == cache // (16 * 47 * per_layer) * 16


def test_plan_one_kv_format(capsys):
    assert cli.main(SEED_EXAMPLE + ["--kv-format", "int8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_format"] == "int8" and "expanded" not in out
    assert (out["latent"]["bytes_per_token"], out["latent"]["num_blocks"]) == (47 * 580, 6_333)
    assert cli.main(SEED_EXAMPLE + ["--kv-format", "fp8_ds_mla"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.split()}
    assert rows["latent"][1:4] == ["656", "30,832", "1,973,248"] and "expanded" not in rows


@pytest.mark.parametrize("spelling", ["16bit", "none"])
def test_plan_kv_format_16bit_is_the_default_output(capsys, spelling):
    for extra in ([], ["--json"]):
        assert cli.main(SEED_EXAMPLE + extra) == 0
        default = capsys.readouterr().out
        assert cli.main(SEED_EXAMPLE + extra + ["--kv-format", spelling]) == 0
        assert capsys.readouterr().out == default
    assert "expanded" in default and "kv_format" not in default


def test_plan_gpu_preset_and_config_path(tmp_path):
    config = {"model_type": "deepseek_v2", "num_hidden_layers": 27, "num_attention_heads": 16, "kv_lora_rank": 512,
              "qk_rope_head_dim": 64, "max_position_embeddings": 163840}
    (tmp_path / "config.json").write_text(json.dumps(config))
    r = run_cli("plan", "--model", str(tmp_path), "--gpu", "t4", "--weights-gb", "10", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    cache = (16 * 2 ** 30 - 10_000_000_000 - 2 * 2 ** 30) * 4 // 5
    assert out["latent"]["max_tokens"] == cache // (64 * 27 * 1_152) * 64
    assert out["expanded"]["max_tokens"] == cache // (64 * 27 * 16 * 2 * 1_152) * 64


def test_plan_v4_checkpoint_folder_as_the_preset(tmp_path, capsys):
    from transformers import DeepseekV4Config

    # HF's defaults are V4-Flash's sizes; the layer types are the published checkpoint's
    DeepseekV4Config(compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0]).save_pretrained(tmp_path)
    for extra in (["--kv-format", "v4_fp8"], ["--kv-format", "all"], ["--json", "--mtp"]):
        outputs = []
        for model in ("deepseek-v4-flash", str(tmp_path)):
            assert cli.main(["plan", "--model", model, "--gpu", "h200", "--weights-gb", "160", "--tp", "2", *extra]) == 0
            outputs.append(capsys.readouterr().out.replace(str(tmp_path / "config.json"), "deepseek-v4-flash"))
        assert outputs[0] == outputs[1]
    assert json.loads(outputs[0])["model"]["layer_types"].count("csa") == 21


def test_plan_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "context.png"
    r = run_cli(*SEED_EXAMPLE, "--plot", str(png))
    assert r.returncode == 0, r.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plan_plot_without_extension_says_the_file_it_wrote(tmp_path):
    # matplotlib adds .png to a name without an extension; the message must name that file
    pytest.importorskip("matplotlib")
    r = run_cli(*SEED_EXAMPLE, "--plot", str(tmp_path / "context"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "context").exists()
    assert r.stdout.strip().splitlines()[-1] == f"plot written to {tmp_path / 'context.png'}"


def test_plan_plot_without_matplotlib_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert cli.main(SEED_EXAMPLE + ["--plot", "context.png"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines() == ["mla-kv plan: --plot needs matplotlib: pip install mla_kv[plot]"]


@pytest.mark.parametrize("name", ["missing-dir/context.png", "context.unknown-format"])
def test_plot_to_a_bad_path_exit_2(tmp_path, capsys, name):
    pytest.importorskip("matplotlib")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(SEED_EXAMPLE + ["--plot", str(tmp_path / name)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--plot" in err


def test_info():
    r = run_cli("info")
    assert r.returncode == 0, r.stderr
    assert f"mla_kv       {mla_kv.__version__}" in r.stdout
    assert "kernels" in r.stdout and "GPU" in r.stdout
    if not torch.cuda.is_available():
        assert "none found" in r.stdout


def test_version():
    r = run_cli("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"mla_kv {mla_kv.__version__}\n" and r.stderr == ""


def test_help_lists_and_describes_every_command():
    parser = cli._build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands = list(action.choices)
    assert {"plan", "demo", "info", "bench"} <= set(commands)
    helps = {c.dest: c.help for c in action._choices_actions}  # a command without help is not listed
    assert set(helps) == set(commands) and all(helps.values())
    r = run_cli("--help")
    assert r.returncode == 0, r.stderr
    listed = {line.split()[0] for line in r.stdout.splitlines() if line.startswith("    ") and line.split()}
    assert set(commands) <= listed, r.stdout
    description = parser.description
    assert all(re.search(rf"\b{name}\b", description) for name in commands), description
    assert "--version" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("args", [["bench", "--quick"], ["bench", "decode", "--quick"],
                                  ["bench", "write", "--quick", "--json", "out.json"]], ids=" ".join)
def test_bench_without_gpu_exits_1_with_one_line(tmp_path, args):
    r = run_cli(*args, cwd=tmp_path)  # any directory: the benchmarks are in the package
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert ("no CUDA GPU" in r.stderr or "needs a CUDA GPU" in r.stderr) and "Traceback" not in r.stderr
    assert r.stderr.startswith("mla-kv bench") and not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("args", [
    ["plan", "--model", "glm-6", "--gpu-mem-gib", "32", "--weights-gb", "18.4"],
    ["plan", "--model", "glm-4.7-flash", "--gpu-mem-gib", "-32", "--weights-gb", "18.4"],
])
def test_bad_arguments_subprocess(args):
    r = run_cli(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "error" in r.stderr and r.stdout == ""


BAD_ARGUMENTS = [
    [],
    ["frobnicate"],
    ["plan", "--gpu-mem-gib", "32", "--weights-gb", "18.4"],                                 # no --model
    ["plan", "--model", "glm-4.7-flash", "--gpu-mem-gib", "32"],                             # no --weights-gb
    ["plan", "--model", "glm-6", "--gpu-mem-gib", "32", "--weights-gb", "18.4"],
    ["plan", "--model", "/no/such/dir/config.json", "--gpu-mem-gib", "32", "--weights-gb", "18.4"],
    ["plan", "--model", "glm-4.7-flash", "--gpu-mem-gib", "0", "--weights-gb", "18.4"],
    ["plan", "--model", "glm-4.7-flash", "--gpu-mem-gib", "inf", "--weights-gb", "18.4"],
    ["plan", "--model", "glm-4.7-flash", "--gpu-mem-gib", "32", "--weights-gb", "-1"],
    ["plan", "--model", "glm-4.7-flash", "--gpu-mem-gib", "32", "--weights-gb", "lots"],
    ["plan", "--model", "glm-4.7-flash", "--gpu-mem-gib", "32", "--weights-gb", "18.4", "--ratio", "0"],
    ["plan", "--model", "glm-4.7-flash", "--gpu-mem-gib", "32", "--weights-gb", "18.4", "--ratio", "1.2"],
    ["plan", "--model", "glm-4.7-flash", "--gpu-mem-gib", "32", "--weights-gb", "18.4", "--tp", "3"],
    ["plan", "--model", "glm-4.7-flash", "--gpu-mem-gib", "32", "--weights-gb", "18.4", "--cp", "0"],
    ["plan", "--model", "glm-4.7-flash", "--gpu-mem-gib", "32", "--weights-gb", "18.4", "--block-size", "1.5"],
    ["plan", "--model", "glm-4.7-flash", "--gpu-mem-gib", "32", "--weights-gb", "18.4", "--reserved-gib", "-1"],
    ["plan", "--model", "glm-4.7-flash", "--gpu-mem-gib", "32", "--weights-gb", "18.4", "--dtype", "fp8"],
    ["plan", "--model", "glm-4.7-flash", "--gpu", "v100-48g", "--weights-gb", "18.4"],
    ["plan", "--model", "glm-4.7-flash", "--gpu", "h200", "--gpu-mem-gib", "32", "--weights-gb", "18.4"],
    ["plan", "--model", "glm-4.7-flash", "--gpu", "h200", "--weights-gb", "18.4", "--kv-format", "fp16"],
    ["info", "--verbose"],
]


def assert_usage_error(args, capsys) -> str:
    """The CLI's contract for bad arguments: exit 2, nothing on stdout, one error line on stderr
    (returned)."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1 and "error:" in captured.err
    return captured.err


@pytest.mark.parametrize("args", BAD_ARGUMENTS, ids=lambda a: " ".join(a) or "no-command")
def test_bad_arguments_one_line_exit_2(args, capsys):
    assert_usage_error(args, capsys)


PLAN = ["plan", "--model", "glm-4.7-flash"]
DEMO = ["demo", "--device", "cpu"]


@pytest.mark.parametrize("args, option", [
    (PLAN + ["--gpu-mem-gib", "1e300", "--weights-gb", "1"], "--gpu-mem-gib"),      # was an OverflowError
    (PLAN + ["--gpu-mem-gib", "32", "--weights-gb", "1e300"], "--weights-gb"),      # named "weight_bytes"
    (PLAN + ["--gpu-mem-gib", "32", "--weights-gb", "1", "--reserved-gib", "1e300"], "--reserved-gib"),
    (PLAN + ["--gpu-mem-gib", "32", "--weights-gb", "1", "--tp", "3"], "--tp"),     # named "tp"
    (PLAN + ["--gpu-mem-gib", "32", "--weights-gb", "1", "--kv-format", "int3"], "--kv-format"),
    (PLAN + ["--gpu-mem-gib", "32", "--weights-gb", "1", "--kv-format", "int8", "--dtype", "fp32"], "--dtype"),
    (PLAN + ["--gpu-mem-gib", "32", "--weights-gb", "1", "--kv-format", "all", "--dtype", "fp32"], "--dtype"),
    (["plan", "--model", "llama-3.1-8b", "--gpu-mem-gib", "32", "--weights-gb", "1", "--kv-format", "fp8"],
     "--kv-format"),                                                                 # named "kv_format"
    (PLAN + ["--gpu-mem-gib", "32", "--weights-gb", "1", "--kv-format", "all", "--plot", "c.png"], "--plot"),
    (DEMO + ["--gpu-mem-gib", "1e300", "--weights-gb", "1"], "--gpu-mem-gib"),
    (DEMO + ["--gpu-mem-gib", "32", "--weights-gb", "1e300"], "--weights-gb"),
    (DEMO + ["--seed", "9" * 30], "--seed"),                                         # torch's overflow
    (DEMO + ["--heads", "21"], "--heads"),                                           # glm-4.7-flash has 20
    (DEMO + ["--block-size", "300000"], "--block-size"),                             # > its max context
], ids=lambda a: " ".join(a) if isinstance(a, list) else a)
def test_bad_numeric_option_exit_2_naming_it(args, option, capsys):
    assert option in assert_usage_error(args, capsys)


@pytest.mark.parametrize("command", [["plan", "--gpu-mem-gib", "32", "--weights-gb", "1"], DEMO], ids=["plan", "demo"])
@pytest.mark.parametrize("content, says", [
    (json.dumps({"model_type": "glm4_moe_lite", "num_hidden_layers": 0, "num_attention_heads": 20,
                 "max_position_embeddings": 4096, "kv_lora_rank": 512, "qk_rope_head_dim": 64}).encode(),
     "num_hidden_layers"),                                                           # was a ZeroDivisionError
    (b'{"model_type": "\xff"}', "UTF-8"),                                             # was a bare codec error
], ids=["0 layers", "not UTF-8"])
def test_bad_config_exit_2_naming_the_file(tmp_path, capsys, command, content, says):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    err = assert_usage_error(command + ["--model", str(tmp_path)], capsys)
    assert str(path) in err and says in err


def test_bad_config_file_exit_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "num_hidden_layers": 4}))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "--model", str(tmp_path), "--gpu-mem-gib", "32", "--weights-gb", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "mamba" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the current GPU is used when one is present")
def test_plan_without_gpu_or_memory_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "--model", "glm-4.7-flash", "--weights-gb", "18.4"])
    assert exit_info.value.code == 2
    assert "--gpu-mem-gib" in capsys.readouterr().err


# ---- unknown options, plans that do not fit, --json PATH, a closed stdout ------------------------

@pytest.mark.parametrize("args, unknown, hint", [
    (["plan", "--modle", "glm-4.7-flash"], "--modle", "did you mean --model?"),   # was: --model is required
    (["plan", "--model", "glm-4.7-flash", "--weight-gb", "1", "--gpu", "h200"], "--weight-gb", "--weights-gb?"),
    (["demo", "--kvformat", "int8"], "--kvformat", "--kv-format?"),
    (["info", "--verbose"], "--verbose", ""),
], ids=lambda a: " ".join(a) if isinstance(a, list) else None)
def test_unknown_option_is_reported_first(args, unknown, hint, capsys):
    err = assert_usage_error(args, capsys)
    assert f"unrecognized arguments: {unknown}" in err and hint in err
    assert "required" not in err, err


def test_missing_required_options_are_still_reported(capsys):
    err = assert_usage_error(["plan", "--gpu", "h200"], capsys)
    assert "required: --model, --weights-gb" in err


@pytest.mark.parametrize("extra", [[], ["--json"], ["--kv-format", "all"], ["--tp", "2"]], ids=" ".join)
def test_plan_with_weights_larger_than_the_gpu_exit_2(extra, capsys):
    err = assert_usage_error(PLAN + ["--gpu-mem-gib", "24", "--weights-gb", "400", *extra], capsys)
    assert "the weights do not fit" in err and "24.00 GiB" in err
    assert ("/ tp 2" in err) == ("--tp" in extra)


def test_plan_with_no_room_left_after_the_reserved_memory_exit_2(capsys):
    err = assert_usage_error(PLAN + ["--gpu-mem-gib", "24", "--weights-gb", "20", "--reserved-gib", "8"], capsys)
    assert "no memory is left for the KV cache" in err and "--reserved-gib" in err


@pytest.mark.parametrize("kv_format", ["16bit", "all"])
def test_plan_json_path_writes_what_json_alone_prints(tmp_path, capsys, kv_format):
    """--json PATH (bench's form) writes the JSON and prints the table; --json alone prints the JSON."""
    args = SEED_EXAMPLE + ["--kv-format", kv_format]
    assert cli.main(args + ["--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert cli.main(args + ["--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out) == printed
    assert cli.main(args) == 0
    table = capsys.readouterr().out
    path = tmp_path / "plan.json"
    assert cli.main(args + ["--json", str(path)]) == 0
    assert capsys.readouterr().out == table
    assert json.loads(path.read_text()) == printed


def test_plan_json_to_a_bad_path_exit_2(tmp_path, capsys):
    err = assert_usage_error(SEED_EXAMPLE + ["--json", str(tmp_path / "no" / "such" / "plan.json")], capsys)
    assert "--json" in err


class _ClosingStdout:
    """A stdout whose reader goes away after ``lines`` lines, as ``| head -N`` does."""

    def __init__(self, lines):
        self.left, self.text = lines, []

    def write(self, s):
        if self.left <= 0:
            raise BrokenPipeError(32, "Broken pipe")
        self.text.append(s)
        self.left -= s.count("\n")
        return len(s)

    def flush(self):
        if self.left <= 0:
            raise BrokenPipeError(32, "Broken pipe")


def test_plan_into_a_closed_pipe_stops_quietly(monkeypatch, capsys):
    fake = _ClosingStdout(3)
    monkeypatch.setattr(sys, "stdout", fake)
    assert cli.main(SEED_EXAMPLE) == 141
    assert "".join(fake.text).count("\n") >= 3 and capsys.readouterr().err == ""


@pytest.mark.parametrize("args", [SEED_EXAMPLE, ["demo", "--device", "cpu", "--layers", "1", "--prompt-len", "8",
                                                 "--decode-steps", "1", "--block-size", "16", "--heads", "2"]],
                         ids=["plan", "demo"])
def test_closed_stdout_gives_no_traceback(args):
    """``mla-kv demo | head -3``, the reader gone before the first line: no BrokenPipeError traceback."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    package_root = str(Path(mla_kv.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-m", "mla_kv.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_demo_help_describes_the_quantized_caches(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--kv-format" in text and "for now" not in text and "read by the kernels on cuda" in text


def test_info_names_the_gpus_the_build_cannot_run(monkeypatch, capsys):
    """A V100 under a build without sm_70, and an sm_86 GPU under a 90-only build: no variant runs there,
    and info says so with the way to a build that runs (a stand-in module replaces the kernels)."""
    import types

    class Arch:
        auto, sm80, sm90 = (types.SimpleNamespace(name=n) for n in ("auto", "sm80", "sm90"))

    compiled = types.SimpleNamespace(Arch=Arch, resolve_arch=lambda requested, cc: Arch.sm90 if cc >= 90 else
                                     Arch.auto, device_smem_limits=lambda: types.SimpleNamespace(per_block=1,
                                                                                                 per_sm=1),
                                     attention_tiles=lambda *a: types.SimpleNamespace(block_m=0),
                                     SmemLimits=lambda: None)
    build_info = types.SimpleNamespace(WITH_CUDA=True, CUDA_ARCHS=["90"], CUDA_COMPILER="NVIDIA 13.0")
    monkeypatch.setitem(sys.modules, "mla_kv._C", compiled)
    monkeypatch.setitem(sys.modules, "mla_kv._build_info", build_info)
    monkeypatch.setattr(mla_kv, "_C", compiled, raising=False)
    monkeypatch.setattr(mla_kv, "_build_info", build_info, raising=False)
    monkeypatch.setattr(mla_kv._compiled, "_C", compiled)
    monkeypatch.setattr(mla_kv._compiled, "load_error", None)
    gpus = [types.SimpleNamespace(name="Tesla V100", major=7, minor=0, total_memory=32 * 2 ** 30),
            types.SimpleNamespace(name="RTX A6000", major=8, minor=6, total_memory=48 * 2 ** 30)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: gpus[i])
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    v100, a6000 = (line for line in out.splitlines() if line.startswith("GPU "))
    assert "sm_70" in v100 and "this build (sm_90) cannot run on this GPU" in v100 and "CUDA 12.x nvcc" in v100
    assert "sm_86" in a6000 and "MLA_KV_CUDA_ARCHS=86" in a6000


def test_plan_dsa_model_shows_its_index_cache():
    r = run_cli("plan", "--model", "glm-5.2", "--gpu", "h200", "--weights-gb", "700", "--tp", "8", "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("model        glm-5.2: MLA + DSA, 78 cached layers, 64 heads")
    assert lines[1] == ("indexer      32 index heads x 128, top-k 2,048, 21 indexed layers (57 reuse the previous "
                        "one's top-k): index cache 132 B/token/layer, 2,772 B/token in every layout")
    header = next(line for line in lines if line.startswith("layout"))
    assert header.split()[:4] == ["layout", "B/token/layer", "index", "B/token"]
    rows = {line.split()[0]: line.split() for line in lines if line.split()}
    cache = int((141 * 2 ** 30 - 700e9 // 8 - 2 * 2 ** 30) * 0.8)
    per_token = 78 * 1_152 + 21 * 132
    assert rows["latent"][1:4] == ["1,152", "2,772", f"{per_token:,}"]
    assert rows["latent"][5] == f"{cache // (64 * per_token):,}"


def test_plan_dsa_json_and_kv_format_all():
    r = run_cli("plan", "--model", "deepseek-v3.2", "--gpu", "h200", "--weights-gb", "690", "--tp", "8", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["latent"]["index_bytes_per_token"] == out["expanded"]["index_bytes_per_token"] == 61 * 132
    assert out["model"]["index_n_heads"] == 64 and out["model"]["index_layers"] == list(range(61))
    r = run_cli("plan", "--model", "glm-5", "--gpu", "h200", "--weights-gb", "750", "--tp", "8", "--kv-format", "all")
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line.split()}
    assert rows["fp8_ds_mla"][1:4] == ["656", "10,296", f"{78 * 656 + 78 * 132:,}"]
