"""The mla_kv reference pipeline equals HF transformers' MLA attention (CPU, float64, tiny random configs).

HF expands the latent per head (k = [W_UK c_kv | k_pe], v = W_UV c_kv) and runs standard attention.
mla_kv keeps only [c_kv | k_pe] in a paged cache and attends in the absorbed form:
fused_write_kv (RMSNorm + RoPE + cache write, q_pe rotated in place) -> absorb_q -> prefill / decode
-> project_out -> o_proj. Configs are tiny except for what the 576-value cache row fixes
(kv_lora_rank 512, qk_rope_head_dim 64).

Precision: even for a float64 module, HF's RMSNorm normalizes in float32 and its eager softmax runs
in float32, while mla_kv computes in float64, so as shipped the two agree to float32 rounding (~1e-7
relative, checked at 1e-6). The "float64" mode runs HF's SDPA attention (float64 softmax) with its
RMSNorm evaluated in the input's dtype (the same formula, patched for the test) and must agree to
1e-12. HF's rotary module also computes its angles in float32: both sides are fed mla_kv.rope's
float64 table, which is checked against HF's rotary module separately.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import DeepseekV3Config, Glm4MoeLiteConfig  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    DeepseekV3Attention, DeepseekV3RMSNorm, DeepseekV3RotaryEmbedding)
from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import (  # noqa: E402
    Glm4MoeLiteAttention, Glm4MoeLiteRMSNorm, Glm4MoeLiteRotaryEmbedding)

from mla_kv.reference import decode, fused_write_kv, prefill  # noqa: E402
from mla_kv.rope import cos_sin_cache, mla_softmax_scale  # noqa: E402
from mla_kv.weights import absorb_q, project_out, split_kv_b_proj  # noqa: E402

ROW, ROPE = 576, 64
HEADS, NOPE, V = 5, 32, 48

YARN_V3 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
           "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
           "mscale": 1.0, "mscale_all_dim": 1.0}
# mscale != mscale_all_dim makes the cos/sin table carry an attention factor != 1 as well.
YARN_UNEQUAL_MSCALE = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
                       "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707}
MAX_POSITIONS = 163840  # 40 x 4096 (DeepSeek-V3); the factor-32 case uses 32 x 4096

CASES = {
    # GLM-4.7-Flash: q_lora, default rope with theta 1e6, interleaved
    "glm4_moe_lite": (Glm4MoeLiteConfig, Glm4MoeLiteAttention, Glm4MoeLiteRotaryEmbedding,
                      dict(q_lora_rank=48, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # DeepSeek-V3 / Kimi-K2: q_lora, YaRN with mscale_all_dim (the softmax scale grows by mscale^2)
    "deepseek_v3_yarn": (DeepseekV3Config, DeepseekV3Attention, DeepseekV3RotaryEmbedding,
                         dict(q_lora_rank=48, rope_parameters=YARN_V3)),
    # DeepSeek-V2-Lite style: no q_lora (q_proj), YaRN
    "deepseek_no_q_lora": (DeepseekV3Config, DeepseekV3Attention, DeepseekV3RotaryEmbedding,
                           dict(q_lora_rank=None, rope_parameters=YARN_UNEQUAL_MSCALE,
                                max_position_embeddings=32 * 4096)),
    # neox (half-split) rope instead of interleaved pairs
    "deepseek_neox": (DeepseekV3Config, DeepseekV3Attention, DeepseekV3RotaryEmbedding,
                      dict(q_lora_rank=48, rope_interleave=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}


def _rms_norm_in_input_dtype(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture(params=["hf", "float64"])
def precision(request, monkeypatch):
    """(HF attention implementation, relative tolerance) of a precision mode (module docstring)."""
    if request.param == "hf":
        return "eager", 1e-6
    for norm_cls in (DeepseekV3RMSNorm, Glm4MoeLiteRMSNorm):
        monkeypatch.setattr(norm_cls, "forward", _rms_norm_in_input_dtype)
    return "sdpa", 1e-12


def build(case, attn_implementation="eager"):
    config_cls, attention_cls, rotary_cls, extra = CASES[case]
    kwargs = dict(hidden_size=64, num_attention_heads=HEADS, num_key_value_heads=HEADS, kv_lora_rank=512,
                  qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=V, num_hidden_layers=1,
                  vocab_size=32, intermediate_size=64, max_position_embeddings=MAX_POSITIONS)
    config = config_cls(**{**kwargs, **extra})
    config._attn_implementation = attn_implementation
    attn = attention_cls(config, layer_idx=0)
    with torch.no_grad():
        for norm in (attn.kv_a_layernorm, attn.q_a_layernorm):
            if norm is not None:
                norm.weight.uniform_(0.5, 1.5)
    return config, attn.double().eval(), rotary_cls(config)


def hf_cos_sin(table, positions):
    """HF's position_embeddings (cos, sin) [1, T, 64] from mla_kv's [cos (32) | sin (32)] table."""
    half = table[positions]
    cos, sin = half[:, :ROPE // 2], half[:, ROPE // 2:]
    return torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]


def run_hf(attn, hidden, positions, table):
    t = hidden.shape[0]
    causal = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    out, _ = attn(hidden[None], position_embeddings=hf_cos_sin(table, positions), attention_mask=causal)
    return out[0]


def mla_queries(attn, hidden):
    """[q_nope | q_pe] per head [T, H, nope + 64] from HF's own q projections (q_pe not yet rotated)."""
    if attn.q_lora_rank is None:
        q = attn.q_proj(hidden)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden)))
    return q.view(hidden.shape[0], HEADS, NOPE + ROPE)


class PagedCache:
    """A float64 paged cache with a random block table, and the slots of each sequence's positions."""

    def __init__(self, lens, block_size=8):
        needed = [(n + block_size - 1) // block_size for n in lens]
        ids = torch.randperm(sum(needed) + 3)  # a few blocks stay unused
        self.cache = torch.full((ids.numel(), block_size, ROW), float("nan"), dtype=torch.float64)
        self.block_size = block_size
        self.table = torch.zeros(len(lens), max(needed), dtype=torch.int32)
        start = 0
        for b, count in enumerate(needed):
            self.table[b, :count] = ids[start:start + count]
            start += count

    def slots(self, b, positions):
        table = self.table[b].long()
        return table[positions // self.block_size] * self.block_size + positions % self.block_size


def write(attn, config, paged, b, hidden, kv_positions, rope_positions, table, q=None):
    """Fused RMSNorm + RoPE + write of the tokens' kv_a rows; rotates q's rope part in place."""
    kv_a = attn.kv_a_proj_with_mqa(hidden)
    style = "interleaved" if config.rope_interleave else "neox"
    fused_write_kv(kv_a, attn.kv_a_layernorm.weight, attn.kv_a_layernorm.variance_epsilon, rope_positions,
                   table, paged.cache, paged.slots(b, kv_positions), rope_style=style, q=q)


def rel_err(got, want):
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("case", list(CASES))
def test_scale_and_rope_table_match_hf(case):
    config, attn, rotary = build(case)
    assert mla_softmax_scale(NOPE, ROPE, config.rope_parameters) == pytest.approx(attn.scaling, rel=1e-14)
    positions = torch.arange(0, 4000, 37)
    table = cos_sin_cache(ROPE, 4000, scaling=config.rope_parameters, dtype=torch.float64)
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=torch.float64), positions[None])
    ours_cos, ours_sin = hf_cos_sin(table, positions)
    # HF's angles are float32 products position * inv_freq: a few float32 ulps of angles up to ~4000.
    assert torch.allclose(hf_cos.double(), ours_cos, rtol=0, atol=5e-4)
    assert torch.allclose(hf_sin.double(), ours_sin, rtol=0, atol=5e-4)
    early = positions < 64
    assert torch.allclose(hf_cos.double()[:, early], ours_cos[:, early], rtol=0, atol=5e-6)
    assert torch.allclose(hf_sin.double()[:, early], ours_sin[:, early], rtol=0, atol=5e-6)


def absorbed_queries(attn, hidden, w_uk):
    """[q_lat | q_pe] per head: the q the absorbed attention ops take."""
    q = mla_queries(attn, hidden)
    return torch.cat([absorb_q(q[..., :NOPE], w_uk), q[..., NOPE:]], -1)


def pipeline(case, attn_implementation, lens):
    """What both pipeline tests start from: the HF module, the MLA scale and rope table, the split
    kv_b_proj, an empty paged cache for `lens` and random hidden states per sequence."""
    config, attn, _ = build(case, attn_implementation)
    scale = mla_softmax_scale(NOPE, ROPE, config.rope_parameters)
    table = cos_sin_cache(ROPE, 128, scaling=config.rope_parameters, dtype=torch.float64)
    w_uk, w_uv = split_kv_b_proj(attn.kv_b_proj.weight, HEADS, NOPE, V, 512)
    hidden = [torch.randn(n, config.hidden_size, dtype=torch.float64) for n in lens]
    return config, attn, scale, table, w_uk, w_uv, PagedCache(lens), hidden


@torch.no_grad()
@pytest.mark.parametrize("case", list(CASES))
def test_prefill_pipeline_matches_hf(case, precision):
    attn_implementation, rel_tol = precision
    lens = [13, 21]
    offsets = [0, 40]  # rope positions of a sequence's first token
    config, attn, scale, table, w_uk, w_uv, paged, hidden = pipeline(case, attn_implementation, lens)
    queries = []
    for b, n in enumerate(lens):
        q_full = absorbed_queries(attn, hidden[b], w_uk)
        positions = torch.arange(n)
        write(attn, config, paged, b, hidden[b], positions, offsets[b] + positions, table, q=q_full)
        queries.append(q_full)
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    o_lat, lse = prefill(torch.cat(queries), paged.cache, paged.table, cu,
                         torch.tensor(lens, dtype=torch.int32), scale)
    assert torch.isfinite(lse).all()
    out = attn.o_proj(project_out(o_lat, w_uv).flatten(-2))

    for b, n in enumerate(lens):
        want = run_hf(attn, hidden[b], offsets[b] + torch.arange(n), table)
        got = out[int(cu[b]):int(cu[b + 1])]
        assert rel_err(got, want) < rel_tol, f"sequence {b}"


@torch.no_grad()
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("s_q", [1, 2])
def test_decode_pipeline_matches_hf(case, s_q, precision):
    attn_implementation, rel_tol = precision
    lens = [17, 9, 24]  # 17 and 24 run past one and two blocks of 8
    config, attn, scale, table, w_uk, w_uv, paged, hidden = pipeline(case, attn_implementation, lens)
    new_q = []
    for b, n in enumerate(lens):
        cached = torch.arange(n - s_q)  # the prompt so far, already in the cache
        write(attn, config, paged, b, hidden[b][:n - s_q], cached, cached, table)
        new = torch.arange(n - s_q, n)
        q_full = absorbed_queries(attn, hidden[b][n - s_q:], w_uk)
        write(attn, config, paged, b, hidden[b][n - s_q:], new, new, table, q=q_full)
        new_q.append(q_full)
    o_lat, lse = decode(torch.stack(new_q), paged.cache, paged.table, torch.tensor(lens, dtype=torch.int32),
                        scale)
    assert torch.isfinite(lse).all()
    out = attn.o_proj(project_out(o_lat, w_uv).flatten(-2))

    for b, n in enumerate(lens):
        want = run_hf(attn, hidden[b], torch.arange(n), table)[n - s_q:]
        assert rel_err(out[b], want) < rel_tol, f"sequence {b}"


# ---- DeepSeek Sparse Attention: the demo's float64 index logits against HF's indexers -----------------

@torch.no_grad()
@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_exact_index_logits_give_hf_indexers_top_k(model_type):
    """mla_kv.demo.exact_index_logits (float64, the reference of the demo's selection check) has the top-k
    HF's Indexer returns (neox index RoPE for DeepSeek-V3.2, interleaved for GLM-5) and HF's relu-weighted
    sum's values (HF's scale sits inside the relu, the demo's in the weights)."""
    from mla_kv import demo

    config_cls, attention_cls, rotary_cls = demo.hf_classes(model_type)
    config = config_cls(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
                        kv_lora_rank=512, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=V,
                        num_hidden_layers=1, index_n_heads=16, index_head_dim=128, index_topk=8,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    attn = attention_cls(config, layer_idx=0).eval()
    torch.manual_seed(0)
    for p in attn.indexer.parameters():
        p.normal_(0, 1 / p.shape[-1] ** 0.5) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    tokens = 40
    hidden, q_resid = torch.randn(1, tokens, 64), torch.randn(1, tokens, 48)
    position_embeddings = rotary_cls(config)(hidden, torch.arange(tokens)[None])
    mask = torch.full((tokens, tokens), float("-inf")).triu(1)[None]
    hf = attn.indexer(hidden, q_resid, position_embeddings, mask, None)[0]
    exact = demo.exact_index_logits(attn.indexer, hidden[0], q_resid[0], position_embeddings,
                                    demo.index_rope_style(model_type))
    for t in range(8, tokens):  # rows with more visible positions than the top-k
        assert set(hf[t].tolist()) == set(exact[t, :t + 1].topk(8).indices.tolist()), t
    other = demo.exact_index_logits(attn.indexer, hidden[0], q_resid[0], position_embeddings,
                                    "interleaved" if model_type == "deepseek_v32" else "neox")
    assert any(set(hf[t].tolist()) != set(other[t, :t + 1].topk(8).indices.tolist()) for t in range(8, tokens))
