"""mla_kv.rope and the reference's RoPE/RMSNorm against HF transformers' own modules.

HF's rotary modules work in float32 and return cos/sin duplicated to the full rope_dim
(cat(freqs, freqs)); our table is float64-accurate and holds each half once. HF's interleaved
apply returns the rotated pairs de-interleaved ([evens | odds]); the reference keeps element order.
"""
from __future__ import annotations

import math

import pytest
import torch
from transformers import DeepseekV3Config, Glm4MoeLiteConfig
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_deepseek
from transformers.models.glm4_moe_lite import modeling_glm4_moe_lite as hf_glm

from mla_kv import reference
from mla_kv.rope import cos_sin_cache, mla_softmax_scale, rope_frequencies

ROPE_DIM = 64
HALF = ROPE_DIM // 2
FP32_EPS = torch.finfo(torch.float32).eps

# (model family, HF rope_parameters, max_position_embeddings); the dicts are copied before use.
ROPE_CASES = {
    "glm4.7-flash": ("glm", {"rope_type": "default", "rope_theta": 1e6}, 202752),
    "deepseek-v3-yarn": ("deepseek", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "mscale": 1.0,
                                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                      "beta_fast": 32, "beta_slow": 1}, 163840),
    "deepseek-v2-lite-yarn": ("deepseek", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0,
                                           "mscale": 0.707, "mscale_all_dim": 0.707,
                                           "original_max_position_embeddings": 4096}, 163840),
    "kimi-k2-yarn": ("deepseek", {"rope_type": "yarn", "rope_theta": 5e4, "factor": 32.0, "mscale": 1.0,
                                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}, 131072),
    # mscale ratio != 1, no truncation of the correction range, legacy "type" key
    "yarn-mscale-ratio": ("deepseek", {"type": "yarn", "rope_theta": 1e4, "factor": 16.0, "mscale": 1.0,
                                       "mscale_all_dim": 0.5, "truncate": False,
                                       "original_max_position_embeddings": 2048}, 32768),
    "yarn-no-mscale": ("deepseek", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0,
                                    "beta_fast": 16, "beta_slow": 2,
                                    "original_max_position_embeddings": 4096}, 32768),
    "yarn-attention-factor": ("deepseek", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                           "attention_factor": 0.9,
                                           "original_max_position_embeddings": 4096}, 16384),
    "linear": ("deepseek", {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}, 16384),
    "llama3": ("deepseek", {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 131072),
}


def _hf_config(family: str, rope_parameters: dict, max_position: int):
    config_class = Glm4MoeLiteConfig if family == "glm" else DeepseekV3Config
    # small projections: only the rope/attention-scale fields matter here
    return config_class(rope_parameters=dict(rope_parameters), max_position_embeddings=max_position,
                        hidden_size=64, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32,
                        kv_lora_rank=32, qk_nope_head_dim=128 if family == "deepseek" else 192,
                        qk_rope_head_dim=ROPE_DIM, v_head_dim=128)


def _hf_modules(family: str):
    return hf_glm if family == "glm" else hf_deepseek


def _hf_rotary(family: str, config):
    module = _hf_modules(family)
    rotary_class = module.Glm4MoeLiteRotaryEmbedding if family == "glm" else module.DeepseekV3RotaryEmbedding
    return rotary_class(config)


def _random_positions(max_position: int, count: int = 512) -> torch.Tensor:
    return torch.cat([torch.tensor([0, 1, max_position - 1]), torch.randint(0, max_position, (count,))])


# ------------------------------------------------------------------------------- cos/sin cache
@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_frequencies_match_hf(case):
    family, params, max_position = ROPE_CASES[case]
    rotary = _hf_rotary(family, _hf_config(family, params, max_position))
    inv_freq, attention_factor = rope_frequencies(ROPE_DIM, scaling=dict(params))
    assert inv_freq.dtype == torch.float64 and inv_freq.shape == (HALF,)
    # HF computes the frequencies in float32: a few float32 roundings apart
    torch.testing.assert_close(inv_freq, rotary.inv_freq.double(), rtol=4 * FP32_EPS, atol=0)
    assert attention_factor == pytest.approx(rotary.attention_scaling, rel=1e-14)


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_cos_sin_cache_matches_hf_rotary_embedding(case):
    family, params, max_position = ROPE_CASES[case]
    rotary = _hf_rotary(family, _hf_config(family, params, max_position))
    positions = _random_positions(max_position)
    hf_cos, hf_sin = rotary(torch.zeros(1), positions[None])
    hf_cos, hf_sin = hf_cos[0].double(), hf_sin[0].double()
    # HF's halves are one copy of the table's
    assert torch.equal(hf_cos[:, :HALF], hf_cos[:, HALF:]) and torch.equal(hf_sin[:, :HALF], hf_sin[:, HALF:])

    table = cos_sin_cache(ROPE_DIM, max_position, scaling=dict(params), dtype=torch.float64)
    assert table.shape == (max_position, ROPE_DIM) and table.dtype == torch.float64
    rows = table[positions]
    # HF's float32 angle p * inv_freq is off by a few float32 ulps of the angle itself
    angle = positions[:, None].double() * rotary.inv_freq.double()
    tolerance = 8 * FP32_EPS * (angle + 1) * rotary.attention_scaling
    assert ((rows[:, :HALF] - hf_cos[:, :HALF]).abs() <= tolerance).all()
    assert ((rows[:, HALF:] - hf_sin[:, :HALF]).abs() <= tolerance).all()


@pytest.mark.parametrize("scaling,position_divisor", [(None, 1.0), ({"rope_type": "linear", "factor": 4.0}, 4.0)])
def test_cos_sin_cache_is_float64_accurate(scaling, position_divisor):
    theta, max_position = 1e6, 202752
    table = cos_sin_cache(ROPE_DIM, max_position, theta, scaling, dtype=torch.float64)
    for p, i in zip(torch.randint(0, max_position, (200,)).tolist(), torch.randint(0, HALF, (200,)).tolist()):
        angle = (p / position_divisor) * theta ** (-2 * i / ROPE_DIM)
        assert table[p, i].item() == pytest.approx(math.cos(angle), abs=1e-11)
        assert table[p, HALF + i].item() == pytest.approx(math.sin(angle), abs=1e-11)


def test_cos_sin_cache_dtype_and_theta_precedence():
    params = {"rope_type": "default", "rope_theta": 1e4}
    from_dict = cos_sin_cache(ROPE_DIM, 1024, scaling=params, dtype=torch.float64)
    assert torch.equal(from_dict, cos_sin_cache(ROPE_DIM, 1024, 1e4, dtype=torch.float64))
    assert torch.equal(cos_sin_cache(ROPE_DIM, 1024, 1e6, scaling=params, dtype=torch.float64),
                       cos_sin_cache(ROPE_DIM, 1024, 1e6, dtype=torch.float64))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert torch.equal(cos_sin_cache(ROPE_DIM, 1024, scaling=params, dtype=dtype), from_dict.to(dtype))


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_mla_softmax_scale_matches_hf_attention(case):
    family, params, max_position = ROPE_CASES[case]
    config = _hf_config(family, params, max_position)
    module = _hf_modules(family)
    attention_class = module.Glm4MoeLiteAttention if family == "glm" else module.DeepseekV3Attention
    hf_scaling = attention_class(config, layer_idx=0).scaling
    ours = mla_softmax_scale(config.qk_nope_head_dim, config.qk_rope_head_dim, dict(params))
    assert ours == pytest.approx(hf_scaling, rel=1e-14)


def test_mla_softmax_scale_known_values():
    assert mla_softmax_scale(192, 64) == 1 / 16  # GLM-4.7-Flash
    mscale = 0.1 * math.log(40) + 1
    deepseek_v3 = {"rope_type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "original_max_position_embeddings": 4096}
    assert mla_softmax_scale(128, 64, deepseek_v3) == pytest.approx(mscale ** 2 / math.sqrt(192), rel=1e-15)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"rope_dim": 63}, ValueError, "rope_dim"),
    ({"rope_dim": 0}, ValueError, "rope_dim"),
    ({"rope_dim": 64.0}, TypeError, "rope_dim"),
    ({"max_position": 0}, ValueError, "max_position"),
    ({"theta": None}, ValueError, "theta"),
    ({"theta": -1.0}, ValueError, "theta"),
    ({"dtype": torch.int32}, TypeError, "dtype"),
    ({"scaling": [("rope_type", "linear")]}, TypeError, "scaling"),
    ({"scaling": {"rope_type": "dynamic", "factor": 2.0}}, ValueError, "dynamic"),
    ({"scaling": {"rope_type": "linear"}}, ValueError, "factor"),
    ({"scaling": {"rope_type": "linear", "factor": 0.0}}, ValueError, "factor"),
    ({"scaling": {"rope_type": "yarn", "factor": 40.0}}, ValueError, "original_max_position_embeddings"),
    ({"scaling": {"type": "yarn", "original_max_position_embeddings": 4096}}, ValueError, "factor"),
    ({"scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "original_max_position_embeddings": 8192}}, ValueError, "high_freq_factor"),
    ({"scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}}, ValueError, "high_freq_factor"),
])
def test_cos_sin_cache_rejects_bad_arguments(kwargs, error, match):
    arguments = {"rope_dim": ROPE_DIM, "max_position": 16, "theta": 1e4, **kwargs}
    with pytest.raises(error, match=match):
        cos_sin_cache(**arguments)


def test_mla_softmax_scale_rejects_bad_arguments():
    with pytest.raises(ValueError, match="qk_nope_head_dim"):
        mla_softmax_scale(0, 64)
    with pytest.raises(ValueError, match="factor"):
        mla_softmax_scale(128, 64, {"rope_type": "yarn", "mscale_all_dim": 1.0})


# ------------------------------------------------------------------------------- apply_rope
# HF's interleaved output at index j holds the reference's element INTERLEAVED_TO_HF[j]
INTERLEAVED_TO_HF = torch.cat([torch.arange(0, ROPE_DIM, 2), torch.arange(1, ROPE_DIM, 2)])


def _rope_inputs(dtype, tokens=48, heads=5, max_position=202752):
    table = cos_sin_cache(ROPE_DIM, max_position, 1e6, dtype=dtype)
    positions = torch.randint(0, max_position, (tokens,))
    q = torch.randn(tokens, heads, ROPE_DIM, dtype=dtype)
    k = torch.randn(tokens, ROPE_DIM, dtype=dtype)
    return table, positions, q, k


def _hf_rotate(apply_fn, q, k, positions, table):
    """HF's apply on our table: q [T, H, D] -> [1, H, T, D], k [T, D] -> [1, 1, T, D], cos/sin [1, T, D]."""
    cos = table[positions, :HALF].repeat(1, 2)[None]
    sin = table[positions, HALF:].repeat(1, 2)[None]
    q_hf, k_hf = apply_fn(q.permute(1, 0, 2)[None], k[None, None], cos, sin)
    return q_hf[0].permute(1, 0, 2), k_hf[0, 0]


@pytest.mark.parametrize("hf_module", [hf_glm, hf_deepseek], ids=["glm4_moe_lite", "deepseek_v3"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_apply_rope_interleaved_matches_hf_up_to_permutation(hf_module, dtype):
    table, positions, q, k = _rope_inputs(dtype)
    q_hf, k_hf = _hf_rotate(hf_module.apply_rotary_pos_emb_interleave, q, k, positions, table)
    q_ref = reference.apply_rope(q, positions, table, "interleaved")
    k_ref = reference.apply_rope(k, positions, table, "interleaved")
    assert q_ref.dtype == dtype and q_ref.shape == q.shape
    tight = {"rtol": 1e-13, "atol": 1e-13} if dtype == torch.float64 else {}
    torch.testing.assert_close(q_ref[..., INTERLEAVED_TO_HF], q_hf, **tight)
    torch.testing.assert_close(k_ref[..., INTERLEAVED_TO_HF], k_hf, **tight)
    # the orders really differ, and attention scores do not see it
    assert not torch.allclose(q_ref, q_hf)
    torch.testing.assert_close((q_ref * k_ref[:, None]).sum(-1), (q_hf * k_hf[:, None]).sum(-1), **tight)


@pytest.mark.parametrize("hf_module", [hf_glm, hf_deepseek], ids=["glm4_moe_lite", "deepseek_v3"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_apply_rope_neox_matches_hf_rotate_half(hf_module, dtype):
    table, positions, q, k = _rope_inputs(dtype)
    q_hf, k_hf = _hf_rotate(hf_module.apply_rotary_pos_emb, q, k, positions, table)
    tight = {"rtol": 1e-13, "atol": 1e-13} if dtype == torch.float64 else {}
    torch.testing.assert_close(reference.apply_rope(q, positions, table, "neox"), q_hf, **tight)
    torch.testing.assert_close(reference.apply_rope(k, positions, table, "neox"), k_hf, **tight)


def test_glm_k_pe_end_to_end_matches_hf():
    """GLM-4.7-Flash's k_pe as HF computes it (its rotary module, interleaved apply) vs table + reference."""
    family, params, max_position = ROPE_CASES["glm4.7-flash"]
    rotary = _hf_rotary(family, _hf_config(family, params, max_position))
    positions = torch.randint(0, 4096, (64,))
    k = torch.randn(64, ROPE_DIM)
    cos, sin = rotary(k, positions[None])
    _, k_hf = hf_glm.apply_rotary_pos_emb_interleave(k[None, None], k[None, None], cos, sin)
    table = cos_sin_cache(ROPE_DIM, max_position, scaling=dict(params))
    k_ref = reference.apply_rope(k, positions, table, "interleaved")
    # float32 angles below 4096 rad: within 8 float32 ulps of 4096
    torch.testing.assert_close(k_ref[:, INTERLEAVED_TO_HF], k_hf[0, 0], rtol=0, atol=4096 * 8 * FP32_EPS * 4)


def test_apply_rope_rejects_unknown_style():
    table, positions, q, _ = _rope_inputs(torch.float32)
    with pytest.raises(ValueError, match="rope_style"):
        reference.apply_rope(q, positions, table, "gptj")


# ------------------------------------------------------------------------------- rms_norm
RMS_NORMS = [(hf_glm.Glm4MoeLiteRMSNorm, 1e-5), (hf_deepseek.DeepseekV3RMSNorm, 1e-6)]
LATENT = reference.LATENT_DIM


def _kv_a(dtype, tokens=96):
    """Raw kv_a rows of varied magnitude; c_kv is the column slice [:512] (row stride 576) as in the models."""
    scales = torch.logspace(-3, 3, tokens, dtype=torch.float64)[:, None]
    return (torch.randn(tokens, reference.ROW_DIM, dtype=torch.float64) * scales).to(dtype)


@pytest.mark.parametrize("norm_class,eps", RMS_NORMS, ids=["glm4_moe_lite", "deepseek_v3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_matches_hf_within_one_ulp(norm_class, eps, dtype, ulp_distance):
    c_kv = _kv_a(dtype)[:, :LATENT]
    weight = (1 + 0.2 * torch.randn(LATENT)).to(dtype)
    hf_norm = norm_class(LATENT, eps=eps).to(dtype)
    with torch.no_grad():
        hf_norm.weight.copy_(weight)
        hf_out = hf_norm(c_kv)
    ours = reference.rms_norm(c_kv, weight, eps)
    assert ours.dtype == dtype == hf_out.dtype
    # HF rounds x/rms to the dtype before the weight multiply; the reference rounds once
    assert ulp_distance(ours, hf_out).max().item() <= 1


@pytest.mark.parametrize("norm_class,eps", RMS_NORMS, ids=["glm4_moe_lite", "deepseek_v3"])
def test_rms_norm_float64(norm_class, eps):
    c_kv = _kv_a(torch.float64)[:, :LATENT]
    weight = 1 + 0.2 * torch.randn(LATENT, dtype=torch.float64)
    ours = reference.rms_norm(c_kv, weight, eps)
    hf_norm = norm_class(LATENT, eps=eps).double()
    with torch.no_grad():
        hf_norm.weight.copy_(weight)
        # HF takes the mean of squares in float32 even for float64 input
        torch.testing.assert_close(ours, hf_norm(c_kv), rtol=4 * FP32_EPS, atol=0)
    # and the reference is float64-exact: w * x / sqrt(mean(x^2) + eps), row by row in Python floats
    for row in torch.randint(0, c_kv.shape[0], (4,)).tolist():
        x = c_kv[row].tolist()
        inv_rms = 1 / math.sqrt(math.fsum(v * v for v in x) / LATENT + eps)
        expected = torch.tensor([w * v * inv_rms for w, v in zip(weight.tolist(), x)], dtype=torch.float64)
        torch.testing.assert_close(ours[row], expected, rtol=1e-14, atol=0)
