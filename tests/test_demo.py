"""mla-kv demo: MLA layers through the library's ops vs HF transformers' attention on the same weights.

CPU tests run the reference ops (through mla_kv.ops, so a fault injected there reaches the demo);
the `gpu` test runs the CUDA kernels and their timings.
"""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

pytest.importorskip("transformers")

from mla_kv import cli, demo, ops  # noqa: E402
from test_cli import assert_usage_error, run_cli  # noqa: E402

SMALL = ["--layers", "1", "--prompt-len", "20", "--decode-steps", "2", "--block-size", "16"]
PHASE_ROW = re.compile(r"^(prefill|decode \d+) +(\d+) +(\d+) +(\S+) +(ok|FAIL)$", re.M)


def phase_rows(stdout: str) -> dict:
    """phase name -> (q tokens, kv len, max rel err, verdict) from the demo's table."""
    return {m[1]: (int(m[2]), int(m[3]), float(m[4]), m[5]) for m in PHASE_ROW.finditer(stdout)}


def test_demo_cpu_matches_hf_and_plans_the_seed_example():
    # 70 + 3 tokens span two blocks of 64 (the plan's block size too)
    r = run_cli("demo", "--device", "cpu", "--model", "glm-4.7-flash", "--layers", "2", "--prompt-len", "70",
                "--decode-steps", "3", "--gpu", "v100-32g", "--weights-gb", "18.4")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert "hidden 2048, 20 heads, q_lora 768, kv_lora 512, nope/rope/v 192/64/256" in r.stdout
    assert "softmax scale 0.0625" in r.stdout and "Glm4MoeLiteAttention" in r.stdout
    assert "the PyTorch reference ops" in r.stdout and "no CUDA GPU found" not in r.stdout  # cpu was asked for
    rows = phase_rows(r.stdout)
    assert list(rows) == ["prefill", "decode 1", "decode 2", "decode 3"]
    assert [rows[p][:2] for p in rows] == [(70, 70), (1, 71), (1, 72), (1, 73)]
    for name, (_, _, err, verdict) in rows.items():
        assert 0 < err < 1e-4 and verdict == "ok", name
    # the planner's table for the example (numbers in tests/test_cli.py and planner's docstring)
    plan = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line.split()}
    assert plan["latent"][1:7] == ["1,152", "54,144", "3,465,216", "3,188", "204,032", "202,752"]
    assert plan["expanded"][1:7] == ["46,080", "2,165,760", "138,608,640", "79", "5,056", "5,056"]


def test_demo_with_quantized_caches_states_each_formats_error():
    """--kv-format: the quantizing write's cache read by the reference's attention. Each format's error is
    within its tolerance and above the 16-bit cache's (so the quantized rows are what attention read), and
    they order as the formats' precision does: int8 < fp8 / fp8_ds_mla < int4."""
    small = ["demo", "--device", "cpu", "--dtype", "bf16", "--heads", "2", "--layers", "1", "--prompt-len", "24",
             "--decode-steps", "1", "--block-size", "16"]
    errors = {}
    for kv_format in (None, "fp8", "fp8_ds_mla", "int8", "int4"):
        r = run_cli(*small, *([] if kv_format is None else ["--kv-format", kv_format]))
        assert r.returncode == 0, r.stdout + r.stderr
        rows = phase_rows(r.stdout)
        assert list(rows) == ["prefill", "decode 1"] and all(v[3] == "ok" for v in rows.values())
        errors[kv_format] = max(v[2] for v in rows.values())
        if kv_format:
            assert f"{kv_format} cache (quantizing fused write" in r.stdout
            assert f"tolerance {demo.FORMAT_TOLERANCES[kv_format]:g}" in r.stdout
    assert errors[None] < errors["int8"] < min(errors["fp8"], errors["fp8_ds_mla"]) < errors["int4"], errors


def test_demo_quantized_cache_needs_16_bit_rows(capsys):
    assert_usage_error(["demo", "--device", "cpu", "--dtype", "fp32", "--kv-format", "int8"], capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback on a machine without a GPU")
def test_demo_without_gpu_says_so_and_runs_the_reference():
    r = run_cli("demo", "--model", "deepseek-v2-lite", *SMALL)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "no CUDA GPU found: running the PyTorch reference ops (mla_kv.reference) on the CPU"
    assert "16 heads, no q_lora (q_proj)" in r.stdout and "DeepseekV2Attention" in r.stdout
    assert all(v[3] == "ok" for v in phase_rows(r.stdout).values())
    assert "latent 1,152 B/token/layer" in r.stdout and "expanded per-head 36,864 B/token/layer" in r.stdout
    assert "no GPU found: pass --gpu" in r.stdout


def _scale_decode(monkeypatch):
    decode = ops.decode
    monkeypatch.setattr(ops, "decode", lambda q, c, t, lens, scale, **kw: decode(q, c, t, lens, scale * 1.01, **kw))


def _drop_newest_key(monkeypatch):
    decode = ops.decode
    monkeypatch.setattr(ops, "decode", lambda q, c, t, lens, scale, **kw: decode(q, c, t, lens - 1, scale, **kw))


def _neox_rope(monkeypatch):
    write = ops.fused_write_kv
    monkeypatch.setattr(ops, "fused_write_kv", lambda *a, rope_style, **kw: write(*a, rope_style="neox", **kw))


def _prefill_not_causal(monkeypatch):
    prefill = ops.prefill
    monkeypatch.setattr(ops, "prefill", lambda *a, **kw: prefill(*a, **dict(kw, causal=False)))


@pytest.mark.parametrize("fault, failing", [
    (None, []),
    (_scale_decode, ["decode 1", "decode 2"]),
    (_drop_newest_key, ["decode 1", "decode 2"]),
    (_neox_rope, ["prefill", "decode 1", "decode 2"]),
    (_prefill_not_causal, ["prefill"]),  # one layer: the decode steps do not see the prefill's output
], ids=["none", "decode-scale", "decode-drops-newest-key", "neox-rope", "prefill-not-causal"])
def test_an_injected_fault_fails_its_phases_with_exit_1(monkeypatch, capsys, fault, failing):
    if fault is not None:
        fault(monkeypatch)
    code = cli.main(["demo", "--device", "cpu", *SMALL])
    out, err = capsys.readouterr()
    rows = phase_rows(out)
    assert [name for name, row in rows.items() if row[3] == "FAIL"] == failing
    for name, (_, _, rel_err, _) in rows.items():
        assert (rel_err > 1e-3) if name in failing else (rel_err < 1e-4), name
    if failing:
        assert code == 1
        assert len(err.strip().splitlines()) == 1 and "above tolerance" in err
        assert all(name in err for name in failing)
    else:
        assert code == 0 and err == ""


BAD_ARGUMENTS = [
    ["demo", "--model", "glm-6"],
    ["demo", "--index-topk", "64"],                                   # GLM-4.7-Flash has no indexer
    ["demo", "--model", "glm-5", "--index-topk", "0"],
    ["demo", "--model", "llama-3.1-8b"],                              # GQA
    ["demo", "--layers", "0"],
    ["demo", "--layers", "48"],                                       # GLM-4.7-Flash has 47
    ["demo", "--heads", "-2"],
    ["demo", "--prompt-len", "ten"],
    ["demo", "--prompt-len", "202752"],                               # + 4 decode steps > max context
    ["demo", "--decode-steps", "0"],
    ["demo", "--dtype", "fp8"],
    ["demo", "--device", "tpu"],
    ["demo", "--gpu", "h200", "--gpu-mem-gib", "32"],
    ["demo", "--weights-gb", "-1"],
    ["demo", "--kv-format", "fp4"],
]


@pytest.mark.parametrize("args", BAD_ARGUMENTS, ids=" ".join)
def test_bad_arguments_one_line_exit_2(args, capsys):
    assert_usage_error(args, capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("extra", [[], ["--dtype", "fp16"]])
def test_cuda_without_gpu_exit_2_without_traceback(extra):
    r = run_cli("demo", "--device", "cuda", *extra)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == "mla-kv demo: error: --device cuda: no CUDA GPU found (--device cpu runs the " \
                               "reference ops)"


# ------------------------------------------------------------------------------------ presets
def _yarn_scale(factor, mscale_all_dim):
    return (0.1 * mscale_all_dim * math.log(factor) + 1) ** 2 / math.sqrt(128 + 64)


# Public config.json shapes: hidden, q_b_proj (or q_proj), kv_b_proj, o_proj, and the softmax scale.
PRESETS = {
    "glm-4.7-flash": (2048, (20 * 256, 768), (20 * (192 + 256), 512), (2048, 20 * 256), 1 / 16),
    "deepseek-v2-lite": (2048, (16 * 192, 2048), (16 * 256, 512), (2048, 16 * 128), _yarn_scale(40, 0.707)),
    "deepseek-v3": (7168, (128 * 192, 1536), (128 * 256, 512), (7168, 128 * 128), _yarn_scale(40, 1.0)),
    "kimi-k2": (7168, (64 * 192, 1536), (64 * 256, 512), (7168, 64 * 128), _yarn_scale(32, 1.0)),
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_have_the_models_shapes_and_scale(name):
    hidden, q_shape, kv_b_shape, o_shape, scale = PRESETS[name]
    spec = demo.resolve_model(name)
    config = demo.hf_attention_config(spec.config)
    _, attention_cls, _ = demo.hf_classes(spec.config["model_type"])
    with torch.device("meta"):
        attn = attention_cls(config, layer_idx=0)
    shapes = {k: tuple(v.shape) for k, v in attn.state_dict().items()}
    q_key = "q_proj.weight" if name == "deepseek-v2-lite" else "q_b_proj.weight"
    assert (config.hidden_size, shapes[q_key], shapes["kv_b_proj.weight"], shapes["o_proj.weight"]) == \
        (hidden, q_shape, kv_b_shape, o_shape)
    assert attn.scaling == pytest.approx(scale, rel=1e-12)
    assert demo.rope_style(config) == "interleaved"


# ---------------------------------------------------------------------------------- checkpoints
def _write_checkpoint(path, layers=2, extra=None):
    """A tiny DeepSeek-V3-style checkpoint: config.json and bf16 self_attn weights (plus an MLP tensor)."""
    from safetensors.torch import save_file

    heads, hidden, q_lora, nope, v = 4, 64, 32, 32, 48
    config = {"model_type": "deepseek_v3", "hidden_size": hidden, "num_attention_heads": heads,
              "num_key_value_heads": heads, "q_lora_rank": q_lora, "kv_lora_rank": 512, "qk_nope_head_dim": nope,
              "qk_rope_head_dim": 64, "v_head_dim": v, "num_hidden_layers": layers, "vocab_size": 100,
              "max_position_embeddings": 4096, "rope_theta": 10000.0, "architectures": ["DeepseekV3ForCausalLM"]}
    (path / "config.json").write_text(json.dumps(config))
    shapes = {"q_a_proj.weight": (q_lora, hidden), "q_a_layernorm.weight": (q_lora,),
              "q_b_proj.weight": (heads * (nope + 64), q_lora), "kv_a_proj_with_mqa.weight": (576, hidden),
              "kv_a_layernorm.weight": (512,), "kv_b_proj.weight": (heads * (nope + v), 512),
              "o_proj.weight": (hidden, heads * v)}
    tensors = {}
    for layer in range(layers):
        for name, shape in shapes.items():
            scale = 1 / math.sqrt(shape[1]) if len(shape) == 2 else 1.0
            values = torch.randn(shape) * scale if len(shape) == 2 else torch.rand(shape) + 0.5
            tensors[f"model.layers.{layer}.self_attn.{name}"] = values.to(torch.bfloat16)
        tensors[f"model.layers.{layer}.mlp.gate.weight"] = torch.randn(8, hidden)
    tensors.update(extra or {})
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


def test_demo_runs_a_checkpoints_weights(tmp_path, capsys):
    saved = _write_checkpoint(tmp_path)
    assert cli.main(["demo", "--device", "cpu", "--model", str(tmp_path), "--layers", "2", "--prompt-len", "12",
                     "--decode-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert f"weights from {tmp_path}" in out and "hidden 64, 4 heads, q_lora 32" in out
    assert all(v[3] == "ok" for v in phase_rows(out).values()) and len(phase_rows(out)) == 3

    stack = demo.build_stack(demo.resolve_model(str(tmp_path)), 2, torch.float32, "cpu")
    for layer, attn in enumerate(stack.hf_layers):
        for name, value in attn.state_dict().items():
            assert torch.equal(value, saved[f"model.layers.{layer}.self_attn.{name}"].float()), (layer, name)


@pytest.mark.parametrize("case", ["fp8-scales", "heads-override", "missing-layer"])
def test_bad_checkpoint_use_exit_2(tmp_path, capsys, case):
    extra = {"model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(1, 1)} if case == "fp8-scales" else None
    _write_checkpoint(tmp_path, extra=extra)
    args = ["demo", "--device", "cpu", "--model", str(tmp_path), "--prompt-len", "8", "--decode-steps", "1"]
    if case == "heads-override":
        args += ["--heads", "2"]
    if case == "missing-layer":  # config.json promises more layers than the weights hold
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=3)))
        args += ["--layers", "3"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert {"fp8-scales": "weight_scale_inv", "heads-override": "--heads",
            "missing-layer": "model.layers.2.self_attn"}[case] in err


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_demo_cuda_kernels_match_hf_and_are_timed(dtype):
    if dtype == "bf16" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 kernels need sm80+")
    r = run_cli("demo", "--device", "cuda", "--dtype", dtype, "--prompt-len", "700", "--decode-steps", "3")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = phase_rows(r.stdout)
    assert list(rows) == ["prefill", "decode 1", "decode 2", "decode 3"]
    assert all(v[3] == "ok" and v[2] > 0 for v in rows.values())
    timings = dict(re.findall(r"^(fused_write_kv|prefill|decode) .* ([\d.]+) us$", r.stdout, re.M))
    assert sorted(timings) == ["decode", "fused_write_kv", "prefill"]
    assert all(float(us) > 0 for us in timings.values())


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["fp8", "int4"])
def test_demo_cuda_quantized_cache(kv_format):
    """The quantizing write kernels' cache, read by the reference's attention on the GPU."""
    r = run_cli("demo", "--device", "cuda", "--dtype", "fp16", "--kv-format", kv_format, "--prompt-len", "100",
                "--decode-steps", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = phase_rows(r.stdout)
    assert list(rows) == ["prefill", "decode 1", "decode 2"]
    assert all(v[3] == "ok" and v[2] > 1e-3 for v in rows.values())


# ------------------------------------------------------------------------- DeepSeek Sparse Attention
DSA_SMALL = ["--device", "cpu", "--heads", "4", "--prompt-len", "100", "--decode-steps", "2", "--index-topk", "32",
             "--block-size", "32"]
DSA_ROW = re.compile(r"^(prefill|decode \d+) +(\d+) +(\d+) +(\S+) +(\S+) +([\d.]+)% +(\d+) +(ok|FAIL)$", re.M)


def dsa_rows(stdout: str) -> dict:
    """phase -> (q tokens, kv len, rel err, index err, top-k share of HF's in %, in band, verdict)."""
    return {m[1]: (int(m[2]), int(m[3]), float(m[4]), float(m[5]), float(m[6]), int(m[7]), m[8])
            for m in DSA_ROW.finditer(stdout)}


def test_demo_glm_5_2_sparse_layers_and_a_shared_one_match_hf(capsys):
    """GLM-5.2's layers 0-2 run the indexer, layer 3 reuses layer 2's top-k: write_index_keys, index_scores,
    index_topk and sparse_attention (the references) against GlmMoeDsaAttention attending to the same top-k,
    the selection against HF's own indexer. 100 tokens, top-k 32: the selection matters from position 32 on."""
    assert cli.main(["demo", "--model", "glm-5.2", "--layers", "4", *DSA_SMALL]) == 0
    out = capsys.readouterr().out
    assert "32 index heads x 128, top-k 32 (the model's 2,048), RoPE interleaved" in out
    assert "layers 3 reuse the previous indexed layer's top-k" in out and "GlmMoeDsaAttention" in out
    rows = dsa_rows(out)
    assert [rows[p][:2] for p in rows] == [(100, 100), (1, 101), (1, 102)]
    for name, (_, _, err, index_err, share, _, verdict) in rows.items():
        assert verdict == "ok" and 0 < err < 1e-4, name
        assert 1e-3 < index_err < demo.INDEX_TOLERANCE, name        # the e4m3 index cache's error
        assert share >= 80, name
    assert "index cache 132 B/token/layer" not in out              # no GPU: the plan is the bytes line


def _index_rope_wrong(monkeypatch):
    write = ops.write_index_keys
    monkeypatch.setattr(ops, "write_index_keys", lambda *a, rope_style, **kw: write(*a, rope_style="interleaved",
                                                                                      **kw))


def _topk_drops_the_best(monkeypatch):
    topk = ops.index_topk
    monkeypatch.setattr(ops, "index_topk", lambda logits, lens, k, **kw: topk(
        logits.masked_fill(logits == logits.max(dim=1, keepdim=True).values, -1e30), lens, k, **kw))


@pytest.mark.parametrize("fault", [None, _index_rope_wrong, _topk_drops_the_best],
                         ids=["none", "index-rope-interleaved", "topk-drops-the-best"])
def test_demo_deepseek_v3_2_sparse_and_injected_faults(monkeypatch, capsys, fault):
    """DeepSeek-V3.2 (neox index RoPE, 64 index heads): passes as is; an index key rotated in the wrong pairs
    fails on the logits' error, a top-k that leaves out the best position on the selection check."""
    if fault is not None:
        fault(monkeypatch)
    code = cli.main(["demo", "--model", "deepseek-v3.2", "--layers", "1", *DSA_SMALL])
    out, err = capsys.readouterr()
    assert "DeepseekV32Attention" in out and "RoPE neox on dims 0..63" in out
    rows = dsa_rows(out)
    assert len(rows) == 3
    if fault is None:
        assert code == 0 and err == "" and all(v[6] == "ok" for v in rows.values())
        return
    assert code == 1 and "above tolerance" in err
    assert any(v[6] == "FAIL" for v in rows.values())
    if fault is _index_rope_wrong:
        assert max(v[3] for v in rows.values()) > demo.INDEX_TOLERANCE


def test_check_selection_band():
    """A set that differs from HF's only within 2e of the k-th logit passes; one that differs outside fails."""
    exact = torch.tensor([5.0, 4.0, 3.0, 2.9, 1.0, 0.0], dtype=torch.float64)
    ours = exact + torch.tensor([0, 0, -0.1, 0.1, 0, 0], dtype=torch.float64)   # e = 0.1: 3 and 2 swap
    hf = torch.tensor([0, 1, 2])
    swapped = demo.check_selection(torch.tensor([0, 1, 3]), ours, hf, exact, 3)
    assert swapped.consistent and swapped.ambiguous == 2 and swapped.overlap == pytest.approx(2 / 3)
    assert not demo.check_selection(torch.tensor([0, 1, 4]), ours, hf, exact, 3).consistent
    assert demo.check_selection(torch.tensor([1, 0, -1]), exact[:2], hf, exact[:2], 3).consistent  # all visible


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["glm-5", "deepseek-v3.2"])
def test_demo_cuda_sparse_kernels_top_2048(model):
    """The kernels with the models' top-k 2,048 at 2,400 tokens (the defaults on cuda), timed."""
    r = run_cli("demo", "--device", "cuda", "--model", model, "--layers", "2", "--decode-steps", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = dsa_rows(r.stdout)
    assert [rows[p][:2] for p in rows] == [(2400, 2400), (1, 2401), (1, 2402)]
    assert all(v[6] == "ok" for v in rows.values())
    timings = dict(re.findall(r"^(write_index_keys|index_scores|index_topk|sparse_attention) .* ([\d.]+) us$",
                              r.stdout, re.M))
    assert sorted(timings) == ["index_scores", "index_topk", "sparse_attention", "write_index_keys"]
