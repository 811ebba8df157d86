"""The end-to-end check behind ``mla-kv demo``: a few MLA attention layers run over the paged latent
cache through the library's ops, compared step by step with HF transformers' attention module.

The library side runs each layer the way an engine would::

    q     = q_b_proj(RMSNorm(q_a_proj(h)))  (or q_proj(h))  -> [q_nope | q_pe] per head
    q_lat = absorb_q(q_nope, W_UK)                          -> q = [q_lat | q_pe]   [T, H, 576]
    fused_write_kv(kv_a_proj_with_mqa(h), ...)              RMSNorm + RoPE + paged write; rotates q_pe
    o_lat = prefill(q, cache, ...) or decode(q, cache, ...) [T, H, 512]
    out   = o_proj(project_out(o_lat, W_UV))

and stacks layers with a residual, h <- h + out. The reference is HF's attention module of the same
model type (Glm4MoeLiteAttention, DeepseekV2Attention, DeepseekV3Attention), eager, holding the same
weight values and fed position embeddings by HF's own rotary module; it expands the latent per head
and attends over the whole sequence with a causal mask, so its output at position t is the reference
for whichever step computed t (prefill for the prompt, one decode step per later token).

Weights are random with the model's real shapes (or read from a local checkpoint), rounded to the demo
dtype, and both sides hold exactly those values. The library's ops run in the demo dtype (cache rows,
queries and attention output in fp16/bf16 on CUDA); the projections around them, which are an
engine's GEMMs rather than this library's, run in float32 like the HF reference. So the error shown is
that of the library: its cache dtype, its fused write and its attention kernels.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from . import layout, ops, planner, rope
from .timing import time_graph
from .layout import LATENT_DIM, ROPE_DIM, ROW_DIM
from .reference import rms_norm
from .weights import absorb_q, load_attention_weights, project_out, split_kv_b_proj

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

# The reference's dtype. (HF computes RoPE angles, RMSNorm and softmax in float32 even in a float64
# module, so float64 would not make it much more exact.)
HF_DTYPE = torch.float32

# Largest accepted ||out - ref|| / ||ref|| per demo dtype. fp16/bf16: the kernels' tolerances.
# fp32: agreement is at float32 rounding (~1e-6); 1e-4 leaves room for long prompts, while a wrong
# weight, position or scale shows as 1e-3 or more.
TOLERANCES = {torch.float16: 3e-3, torch.bfloat16: 1e-2, torch.float32: 1e-4}
# With a quantized cache (--kv-format): the format's own error dominates. Bounds a few times what the
# random-weight presets show (docs/demo.md lists the measured errors); a wrong byte layout is O(1).
FORMAT_TOLERANCES = {"fp8": 1e-1, "fp8_ds_mla": 1e-1, "int8": 5e-2, "int4": 6e-1}
FP8_KV_SCALE = 1.0  # the demo's fp8 dequant scale (engines calibrate one; the rows here stay far below 448)

# The attention fields of each planner preset's public HF config.json that the planner does not keep
# (it keeps layers, heads, kv_lora_rank, qk_rope_head_dim and max_position_embeddings).
_YARN = {"type": "yarn", "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}
PRESET_ATTENTION: Dict[str, dict] = {
    "glm-4.7-flash": dict(model_type="glm4_moe_lite", hidden_size=2048, q_lora_rank=768, qk_nope_head_dim=192,
                          v_head_dim=256, rope_theta=1e6, rms_norm_eps=1e-5),
    "deepseek-v2-lite": dict(model_type="deepseek_v2", hidden_size=2048, q_lora_rank=None, qk_nope_head_dim=128,
                             v_head_dim=128, rope_theta=1e4, rms_norm_eps=1e-6,
                             rope_scaling=dict(_YARN, factor=40, mscale=0.707, mscale_all_dim=0.707)),
    "deepseek-v3": dict(model_type="deepseek_v3", hidden_size=7168, q_lora_rank=1536, qk_nope_head_dim=128,
                        v_head_dim=128, rope_theta=1e4, rms_norm_eps=1e-6,
                        rope_scaling=dict(_YARN, factor=40, mscale=1.0, mscale_all_dim=1.0)),
    "kimi-k2": dict(model_type="kimi_k2", hidden_size=7168, q_lora_rank=1536, qk_nope_head_dim=128,
                    v_head_dim=128, rope_theta=5e4, rms_norm_eps=1e-6,
                    rope_scaling=dict(_YARN, factor=32, mscale=1.0, mscale_all_dim=1.0, beta_fast=1)),
    "deepseek-v3.2": dict(model_type="deepseek_v32", hidden_size=7168, q_lora_rank=1536, qk_nope_head_dim=128,
                          v_head_dim=128, rope_theta=1e4, rms_norm_eps=1e-6,
                          rope_scaling=dict(_YARN, factor=40, mscale=1.0, mscale_all_dim=1.0)),
    **{name: dict(model_type="glm_moe_dsa", hidden_size=6144, q_lora_rank=2048, qk_nope_head_dim=192, v_head_dim=256,
                  rope_theta=1e6, rms_norm_eps=1e-5) for name in ("glm-5", "glm-5.1", "glm-5.2")},
}

# config.json keys that shape an MLA attention module; everything else (MoE, vocabulary) is ignored.
_ATTENTION_KEYS = ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                   "qk_rope_head_dim", "v_head_dim", "rope_theta", "rope_scaling", "rope_parameters",
                   "rope_interleave", "rms_norm_eps", "max_position_embeddings", "attention_bias",
                   "num_hidden_layers", "index_n_heads", "index_head_dim", "index_topk", "indexer_types")

# DeepSeek Sparse Attention (DSA) runs: the indexer's top-k and the prompt, per device, when not given. The CPU
# runs a smaller top-k than the models' 2,048 so that selection matters at a context the reference ops run
# in seconds; both prompts pass the top-k, so the later prefill tokens and every decode step select.
DSA_DEFAULTS = {"cpu": dict(topk=64, prompt_len=200), "cuda": dict(topk=2048, prompt_len=2400)}
DENSE_PROMPT_LEN = 64
# Largest accepted relative error of the library's index logits (fp8 keys of the index cache) against the
# float64 logits of the unquantized keys: ||ours - ref|| / ||ref|| over a phase's tokens and visible positions.
# e4m3 keeps 3 mantissa bits of each key value; the random-weight presets show about 1e-2 (docs/demo.md);
# a wrong rope, Hadamard or weight scale shows as order 1.
INDEX_TOLERANCE = 8e-2


# ------------------------------------------------------------------------------------ models
@dataclass(frozen=True)
class ModelSpec:
    """What the demo runs: a name, its HF config.json fields, the planner's view, and its weights."""

    name: str
    config: dict                      # config.json fields (the text model's, for multimodal configs)
    model: planner.MlaModel
    checkpoint: Optional[str] = None  # directory with .safetensors, or None for random weights


def preset_config(name: str) -> dict:
    """config.json fields of a planner preset: the planner's shapes plus PRESET_ATTENTION[name]."""
    if name not in PRESET_ATTENTION:
        raise ValueError(f"model {name!r} has no demo preset ({', '.join(PRESET_ATTENTION)})")
    m = planner.MODELS[name]
    config = dict(PRESET_ATTENTION[name], num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                  max_position_embeddings=m.max_context, kv_lora_rank=m.kv_lora_rank,
                  qk_rope_head_dim=m.qk_rope_head_dim, num_nextn_predict_layers=m.num_mtp_layers)
    if m.sparse:
        indexed = set(m.index_layers)
        config.update(index_n_heads=m.index_n_heads, index_head_dim=m.index_head_dim, index_topk=m.index_topk)
        if len(indexed) < m.num_layers:
            config["indexer_types"] = ["full" if i in indexed else "shared" for i in range(m.num_layers)]
    return config


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset name, a config.json, or a checkpoint directory (config.json + .safetensors) -> ModelSpec."""
    model = planner.load_model(name_or_path)  # presets and paths, with the planner's error messages
    if model.attention != "mla":
        raise ValueError(f"model {name_or_path}: the demo runs MLA models, this one is {model.attention.upper()}")
    if name_or_path in planner.MODELS:
        return ModelSpec(name_or_path, preset_config(name_or_path), model)
    is_dir = os.path.isdir(name_or_path)
    with open(os.path.join(name_or_path, "config.json") if is_dir else name_or_path, encoding="utf-8") as f:
        raw = json.load(f)  # valid: the planner has read it
    config = raw.get("text_config") or raw
    config.setdefault("model_type", raw.get("model_type"))
    has_weights = is_dir and any(f.endswith(".safetensors") for f in os.listdir(name_or_path))
    return ModelSpec(name_or_path, config, model, checkpoint=name_or_path if has_weights else None)


def hf_classes(model_type: str):
    """(config class, attention class, rotary class) of HF transformers for an MLA model_type."""
    if importlib.util.find_spec("transformers") is None:
        raise ImportError("the demo compares against HF transformers: pip install transformers")
    if model_type == "glm4_moe_lite":
        from transformers import Glm4MoeLiteConfig as config_cls
        from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import (
            Glm4MoeLiteAttention as attention_cls, Glm4MoeLiteRotaryEmbedding as rotary_cls)
    elif model_type == "deepseek_v2":
        from transformers import DeepseekV2Config as config_cls
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
            DeepseekV2Attention as attention_cls, DeepseekV2RotaryEmbedding as rotary_cls)
    elif model_type in ("deepseek_v3", "kimi_k2"):  # Kimi-K2 is the DeepSeek-V3 architecture
        from transformers import DeepseekV3Config as config_cls
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3Attention as attention_cls, DeepseekV3RotaryEmbedding as rotary_cls)
    elif model_type in planner.DSA_MODEL_TYPES:
        if importlib.util.find_spec(f"transformers.models.{model_type}") is None:
            raise ImportError(f"the demo of a {model_type} model compares against HF transformers' {model_type} "
                              "attention, which this transformers lacks: pip install 'transformers>=5.25'")
        if model_type == "deepseek_v32":
            from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config as config_cls
            from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
                DeepseekV32Attention as attention_cls, DeepseekV32RotaryEmbedding as rotary_cls)
        else:
            from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig as config_cls
            from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
                GlmMoeDsaAttention as attention_cls, GlmMoeDsaRotaryEmbedding as rotary_cls)
    else:
        raise ValueError(f"model_type {model_type!r} is not an MLA model the demo knows "
                         f"({', '.join(planner.MLA_MODEL_TYPES)})")
    return config_cls, attention_cls, rotary_cls


def hf_attention_config(config: dict, num_heads: Optional[int] = None, index_topk: Optional[int] = None):
    """The HF config object (eager attention) of config.json fields; ``num_heads`` overrides the heads and
    ``index_topk`` a DSA model's top-k."""
    config_cls, _, _ = hf_classes(config.get("model_type"))
    kwargs = {k: config[k] for k in _ATTENTION_KEYS if k in config}
    if num_heads is not None:
        kwargs["num_attention_heads"] = num_heads
    if index_topk is not None:
        kwargs["index_topk"] = index_topk
    kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]  # MLA: every head reads the one latent
    hf_config = config_cls(**kwargs)
    if hf_config.kv_lora_rank != LATENT_DIM or hf_config.qk_rope_head_dim != ROPE_DIM:
        raise ValueError(f"model: the latent cache row is {LATENT_DIM} + {ROPE_DIM}; this config has "
                         f"kv_lora_rank {hf_config.kv_lora_rank}, qk_rope_head_dim {hf_config.qk_rope_head_dim}")
    hf_config._attn_implementation = "eager"
    return hf_config


def rope_style(hf_config) -> str:
    """How the model pairs its rope dims: interleaved pairs unless the config says rope_interleave=False
    (DeepSeek-V2's complex-number RoPE has no flag and is interleaved)."""
    return "neox" if getattr(hf_config, "rope_interleave", None) is False else "interleaved"


def index_rope_style(model_type: str) -> str:
    """How a DSA model's indexer pairs the rope dims of its keys and queries: DeepSeek-V3.2 in halves (neox),
    GLM-5.x in interleaved pairs, whatever its attention does."""
    return "neox" if model_type == "deepseek_v32" else "interleaved"


def random_attention_state(shapes: Dict[str, torch.Size], generator: torch.Generator) -> Dict[str, torch.Tensor]:
    """Random float32 weights for an attention module's parameters (name -> shape).

    Projections are normal with std 1/sqrt(fan_in), so activations keep unit scale and the softmax is
    far from uniform (nn.Linear's default init gives nearly flat attention); norm weights are
    uniform in [0.5, 1.5], so a norm applied without its weight shows; biases are small normals.
    """
    state = {}
    for name, shape in shapes.items():
        if len(shape) == 2:
            state[name] = torch.randn(shape, generator=generator) / math.sqrt(shape[1])
        elif name.endswith("norm.weight"):
            state[name] = torch.rand(shape, generator=generator) + 0.5
        else:
            state[name] = 0.1 * torch.randn(shape, generator=generator)
    return state


# ------------------------------------------------------------------------------ library layer
Linear = Tuple[torch.Tensor, Optional[torch.Tensor]]  # (weight, bias)


class MlaLayer:
    """One MLA attention layer run over the latent cache with the library's ops (module docstring).

    The projections around the ops are an engine's GEMMs, not this library's: they run in float32 on
    the HF module's own (already rounded) weights, and what they hand to the ops (kv_a, q) is rounded
    to ``dtype``, as an engine's would be. So the error measured is the library's: the cache rows and
    queries in ``dtype``, the fused write, the attention kernels and their output in ``dtype``.
    """

    def __init__(self, attn: torch.nn.Module, dtype: torch.dtype):
        def linear(module) -> Linear:
            return module.weight.detach(), None if module.bias is None else module.bias.detach()

        self.dtype, self.num_heads, self.nope = dtype, attn.num_heads, attn.qk_nope_head_dim
        if attn.q_lora_rank is None:
            self.q_a, self.q_a_norm, self.q_a_eps = None, None, None
            self.q_b = linear(attn.q_proj)
        else:
            self.q_a, self.q_b = linear(attn.q_a_proj), linear(attn.q_b_proj)
            self.q_a_norm = attn.q_a_layernorm.weight.detach()
            self.q_a_eps = attn.q_a_layernorm.variance_epsilon
        self.kv_a = linear(attn.kv_a_proj_with_mqa)
        self.kv_a_norm = attn.kv_a_layernorm.weight.detach().to(dtype)  # an op input: the cache's dtype
        self.kv_a_eps = attn.kv_a_layernorm.variance_epsilon
        self.w_uk, self.w_uv = split_kv_b_proj(attn.kv_b_proj.weight.detach(), attn.num_heads,
                                               attn.qk_nope_head_dim, attn.v_head_dim, LATENT_DIM)
        self.o = linear(attn.o_proj)

    def queries(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] -> q [T, H, 576] = [q_lat | q_pe] in ``dtype``, q_pe not yet rotated."""
        if self.q_a is None:
            q = F.linear(h, *self.q_b)
        else:
            q = F.linear(rms_norm(F.linear(h, *self.q_a), self.q_a_norm, self.q_a_eps), *self.q_b)
        q = q.view(h.shape[0], self.num_heads, -1)
        return torch.cat([absorb_q(q[..., :self.nope], self.w_uk), q[..., self.nope:]], dim=-1).to(self.dtype)

    def latent(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] -> kv_a [T, 576] = [c_kv | k_pe] in ``dtype``, not yet normalized and rotated."""
        return F.linear(h, *self.kv_a).to(self.dtype)

    def write(self, kv_a: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, style: str,
              cache: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, kv_format: Optional[str] = None) -> None:
        """Writes the tokens' normalized, rotated rows at ``slots`` (quantized into kv_format); rotates q's
        rope part in place."""
        ops.fused_write_kv(kv_a, self.kv_a_norm, self.kv_a_eps, positions, table, cache, slots,
                           rope_style=style, q=q, kv_format=kv_format,
                           kv_scale=FP8_KV_SCALE if kv_format == "fp8" else None)

    def output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """o_lat [T, H, 512] (``dtype``) -> the layer's output [T, hidden] in float32."""
        return F.linear(project_out(o_lat.to(self.w_uv.dtype), self.w_uv).flatten(-2), *self.o)


class DsaLayer(MlaLayer):
    """An MLA layer with DeepSeek Sparse Attention: the library's indexer picks the cache rows it attends to.

    Per step, after the latent write (MlaLayer.write)::

        q_I = wq_b(RMSNorm(q_a_proj(h)))  [T, H_I, 128]    k_I = wk(h)  [T, 128]
        write_index_keys(k_I, k_norm, ..., q=q_I)           LayerNorm + RoPE + Hadamard + e4m3 -> index cache;
                                                            q_I rotated (RoPE + Hadamard) in place
        w     = weights_proj(h) / sqrt(H_I * 128)           the heads' weights, both scales folded in
        logits = index_scores(q_I, w, index cache, ...)     [T, kv_len] float32
        slots  = index_topk(logits, ..., block_table)       [T, top-k] physical cache slots, -1 padded
        o_lat  = sparse_attention(q, cache, slots, scale)

    A layer without an indexer (GLM-5.2's shared layers, ``has_indexer`` False) attends to the slots of the
    previous indexed layer in the same step (planner.index_source_layers).
    """

    def __init__(self, attn: torch.nn.Module, dtype: torch.dtype):
        super().__init__(attn, dtype)
        indexer = attn.indexer
        self.has_indexer = indexer is not None
        if not self.has_indexer:
            return
        self.index_heads, self.index_dim = indexer.n_heads, indexer.head_dim
        self.wq_b, self.wk = indexer.wq_b.weight.detach(), indexer.wk.weight.detach()
        self.weights_proj = indexer.weights_proj.weight.detach()
        self.k_norm = (indexer.k_norm.weight.detach(), indexer.k_norm.bias.detach(), indexer.k_norm.eps)

    def index_queries(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] -> the index queries [T, H_I, 128] in ``dtype``, not yet rotated."""
        q_resid = rms_norm(F.linear(h, *self.q_a), self.q_a_norm, self.q_a_eps)
        return F.linear(q_resid, self.wq_b).view(h.shape[0], self.index_heads, self.index_dim).to(self.dtype)

    def index_weights(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] -> float32 [T, H_I]: the heads' weights times H_I^-1/2 and the q.k scale 128^-1/2."""
        return (F.linear(h, self.weights_proj) / math.sqrt(self.index_heads * self.index_dim)).float()

    def index_keys(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] -> the index keys [T, 128] in ``dtype``, before their LayerNorm."""
        return F.linear(h, self.wk).to(self.dtype)

    def write_index(self, k_index: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, style: str,
                    index_cache: torch.Tensor, slots: torch.Tensor, q_index: torch.Tensor) -> None:
        """Writes the tokens' index keys at ``slots``; rotates q_index in place."""
        weight, bias, eps = self.k_norm
        ops.write_index_keys(k_index, weight, bias, eps, positions, table, index_cache, slots, rope_style=style,
                             q=q_index)


# ------------------------------------------------------------------------------------ stack
@dataclass
class Stack:
    """The layers of one demo run: HF reference modules and the library layers with the same weights."""

    spec: ModelSpec
    hf_config: object
    hf_layers: List[torch.nn.Module]
    rotary: torch.nn.Module
    layers: List[MlaLayer]
    dtype: torch.dtype
    device: torch.device
    weights: str                     # where the weights came from, for the report

    @property
    def num_heads(self) -> int:
        return self.hf_config.num_attention_heads

    @property
    def softmax_scale(self) -> float:
        c = self.hf_config
        return rope.mla_softmax_scale(c.qk_nope_head_dim, c.qk_rope_head_dim, c.rope_parameters)


def build_stack(spec: ModelSpec, num_layers: int, dtype: torch.dtype, device, *, seed: int = 0,
                num_heads: Optional[int] = None, index_topk: Optional[int] = None) -> Stack:
    """The first ``num_layers`` attention layers of ``spec``: random weights, or the checkpoint's.

    Weights are rounded to ``dtype`` (the precision a deployment stores them in) and held in HF_DTYPE by
    the HF modules on ``device``; the library layers use those same tensors (MlaLayer, DsaLayer for a DSA
    model, whose top-k is ``index_topk``, default the model's).
    """
    if spec.checkpoint is not None and num_heads is not None:
        raise ValueError("num_heads: a checkpoint's weights fix the heads; the override is for random weights")
    if index_topk is not None and not spec.model.sparse:
        raise ValueError(f"index_topk: {spec.name} has no indexer (DeepSeek Sparse Attention)")
    hf_config = hf_attention_config(spec.config, num_heads, index_topk)
    _, attention_cls, rotary_cls = hf_classes(spec.config.get("model_type"))
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    hf_layers, layers = [], []
    for index in range(num_layers):
        with torch.device("meta"):  # shapes only: the values come from the generator or the checkpoint
            attn = attention_cls(hf_config, layer_idx=index)
        shapes = {name: p.shape for name, p in attn.state_dict().items()}
        if spec.checkpoint is None:
            state = random_attention_state(shapes, generator)
        else:
            state = load_attention_weights(spec.checkpoint, index)
            if set(state) != set(shapes):
                raise ValueError(f"model: layer {index}'s self_attn tensors {sorted(state)} are not those of "
                                 f"{attention_cls.__name__} {sorted(shapes)}")
            bad = [k for k in shapes if state[k].shape != shapes[k]]
            if bad:
                raise ValueError(f"model: layer {index}: {bad[0]} has shape {tuple(state[bad[0]].shape)}, "
                                 f"the config gives {tuple(shapes[bad[0]])}")
        attn = attn.to_empty(device=device).to(HF_DTYPE).eval()
        attn.load_state_dict({k: v.to(dtype).to(HF_DTYPE) for k, v in state.items()})
        hf_layers.append(attn)
        layers.append((DsaLayer if spec.model.sparse else MlaLayer)(attn, dtype))
    rotary = rotary_cls(hf_config).to(device)
    weights = (f"from {spec.checkpoint}" if spec.checkpoint is not None
               else f"random (seed {seed}, std 1/sqrt(fan_in))")
    return Stack(spec, hf_config, hf_layers, rotary, layers, dtype, device, weights)


def hf_attention(attn: torch.nn.Module, rotary: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """HF's attention output [T, hidden] for hidden [T, hidden] at positions 0..T-1, causal."""
    tokens = hidden.shape[0]
    positions = torch.arange(tokens, device=hidden.device)[None]
    mask = torch.full((tokens, tokens), float("-inf"), dtype=hidden.dtype, device=hidden.device).triu(1)
    out, _ = attn(hidden[None], position_embeddings=rotary(hidden, positions), attention_mask=mask[None, None])
    return out[0]


# -------------------------------------------------------------------------------------- run
@dataclass
class Phase:
    """One step of the run: the prompt's prefill or one decode step, with each layer's error."""

    name: str
    q_tokens: int
    kv_len: int
    errors: List[float] = field(default_factory=list)  # ||out - ref|| / ||ref|| per layer
    selections: List["Selection"] = field(default_factory=list)  # DSA: per indexed layer and token
    index_errors: List[float] = field(default_factory=list)  # DSA: ||logits - exact|| / ||exact|| per indexed layer

    @property
    def max_error(self) -> float:
        """The largest layer error; NaN if any layer's is NaN (max() would depend on the order)."""
        return math.nan if any(math.isnan(e) for e in self.errors) else max(self.errors)

    @property
    def max_index_error(self) -> float:
        errors = self.index_errors
        return math.nan if any(math.isnan(e) for e in errors) else max(errors)

    def fails(self, tolerance: float, index_tolerance: Optional[float]) -> bool:
        """Whether the output error is above tolerance (NaN too) or, with selections, an index error is above
        index_tolerance or a selection is inconsistent (check_selection)."""
        if not self.max_error <= tolerance:
            return True
        return bool(self.selections) and not (self.max_index_error <= index_tolerance and
                                              all(s.consistent for s in self.selections))


@dataclass
class DemoResult:
    phases: List[Phase]
    tolerance: float
    timings_us: Optional[Dict[str, Tuple[str, float]]] = None  # kernel -> (shape, median microseconds)
    index_tolerance: Optional[float] = None  # DSA runs: the bound of a phase's max_index_error

    @property
    def failed(self) -> List[Phase]:
        return [p for p in self.phases if p.fails(self.tolerance, self.index_tolerance)]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| computed in float64."""
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm())


def _stale_cache(num_blocks: int, block_size: int, dtype, kv_format, device, generator) -> torch.Tensor:
    """A paged cache of stale contents: random rows of dtype, or random bytes of kv_format's layout."""
    if kv_format is None:
        return torch.randn(num_blocks, block_size, ROW_DIM, generator=generator).to(dtype).to(device)
    shape = layout.paged_cache_shape(kv_format, num_blocks, block_size, dtype)
    return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8).to(device)


def run(stack: Stack, prompt_len: int, decode_steps: int, block_size: int, *, seed: int = 0,
        time_kernels: bool = False, kv_format: Optional[str] = None) -> DemoResult:
    """Prefill of a ``prompt_len``-token prompt, then ``decode_steps`` single-token steps, each layer
    checked against HF. The hidden states are random (seeded); each layer has a paged latent cache with
    a shuffled block table and one spare block, its rows filled beforehand with stale values that the
    ops must not read. kv_format: a quantized cache, written by the quantizing fused write and read by
    the attention ops (the kernels dequantize its tiles), so the error shown is the format's."""
    total = prompt_len + decode_steps
    device, dtype = stack.device, stack.dtype
    generator = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(total, stack.hf_config.hidden_size, generator=generator).to(device)  # float32, as HF

    hf_out = []  # reference attention output of each layer at every position
    with torch.no_grad():
        h = x
        for attn in stack.hf_layers:
            out = hf_attention(attn, stack.rotary, h)
            hf_out.append(out)
            h = h + out

    num_blocks = -(-total // block_size)
    block_table = torch.randperm(num_blocks + 1, generator=generator)[:num_blocks].to(torch.int32)[None].to(device)
    caches = [_stale_cache(num_blocks + 1, block_size, dtype, kv_format, device, generator) for _ in stack.layers]
    quantized = {} if kv_format is None else dict(kv_format=kv_format,
                                                  kv_scale=FP8_KV_SCALE if kv_format == "fp8" else None)
    c = stack.hf_config
    cos_sin = rope.cos_sin_cache(c.qk_rope_head_dim, total, scaling=c.rope_parameters, dtype=torch.float32,
                                 device=device)
    style, scale = rope_style(c), stack.softmax_scale

    def slots_of(positions):
        return block_table[0, positions // block_size].long() * block_size + positions % block_size

    def step(name, first, last, attend):
        """Tokens first..last-1 through every layer; attend(layer index, q) -> o_lat."""
        positions = torch.arange(first, last, device=device)
        phase = Phase(name, last - first, last)
        h = x[first:last]
        for index, layer in enumerate(stack.layers):
            q = layer.queries(h)
            layer.write(layer.latent(h), positions, cos_sin, style, caches[index], slots_of(positions), q, kv_format)
            out = layer.output(attend(index, q))
            phase.errors.append(relative_error(out, hf_out[index][first:last]))
            h = h + out
        return phase

    def prefill(index, q):
        cu_q_lens = torch.tensor([0, prompt_len], dtype=torch.int32, device=device)
        kv_lens = torch.tensor([prompt_len], dtype=torch.int32, device=device)
        return ops.prefill(q, caches[index], block_table, cu_q_lens, kv_lens, scale, **quantized)[0]

    def decode_at(kv_len):
        seq_lens = torch.tensor([kv_len], dtype=torch.int32, device=device)
        return lambda index, q: ops.decode(q[None], caches[index], block_table, seq_lens, scale,
                                           **quantized)[0][0]

    with torch.no_grad():
        phases = [step("prefill", 0, prompt_len, prefill)]
        for k in range(decode_steps):
            position = prompt_len + k
            phases.append(step(f"decode {k + 1}", position, position + 1, decode_at(position + 1)))
        timings = None
        if time_kernels and kv_format is None:
            timings = _time_kernels(stack.layers[0], x, prompt_len, total, cos_sin, style, scale, caches[0],
                                    block_table, slots_of)
    return DemoResult(phases, TOLERANCES[dtype] if kv_format is None else FORMAT_TOLERANCES[kv_format], timings)


# ------------------------------------------------------------------------- sparse (DSA) runs
def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """x [..., 128] with its first 64 dims rotated (cos, sin [..., 32], one angle per pair): neox pairs dim i
    with i + 32, interleaved 2i with 2i + 1. The rotated pairs come back in x's own order."""
    rope = x[..., :ROPE_DIM]
    if style == "neox":
        a, b = rope[..., :ROPE_DIM // 2], rope[..., ROPE_DIM // 2:]
        rotated = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    else:
        a, b = rope[..., 0::2], rope[..., 1::2]
        rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return torch.cat([rotated, x[..., ROPE_DIM:]], dim=-1)


def exact_index_logits(indexer: torch.nn.Module, hidden: torch.Tensor, q_resid: torch.Tensor,
                       position_embeddings, style: str) -> torch.Tensor:
    """The indexer's logits in float64 from its own weights, without fp8 or Hadamard: [T, T], -inf past
    each token's position (hidden, q_resid: one sequence's [T, ...] at positions 0..T-1; position_embeddings:
    HF's (cos, sin), one angle per pair in their first half). The reference the library's logits and HF's
    selection are both checked against."""
    tokens, heads, dim = hidden.shape[0], indexer.n_heads, indexer.head_dim
    cos, sin = (t.reshape(tokens, -1)[:, :ROPE_DIM // 2].double() for t in position_embeddings)
    q = F.linear(q_resid.double(), indexer.wq_b.weight.double()).view(tokens, heads, dim)
    norm = indexer.k_norm
    k = F.layer_norm(F.linear(hidden.double(), indexer.wk.weight.double()), (dim,), norm.weight.double(),
                     norm.bias.double(), norm.eps)
    q, k = _rotate_pairs(q, cos[:, None], sin[:, None], style), _rotate_pairs(k, cos, sin, style)
    weights = F.linear(hidden.double(), indexer.weights_proj.weight.double()) / math.sqrt(heads * dim)
    logits = torch.einsum("th,ths->ts", weights, torch.einsum("thd,sd->ths", q, k).clamp_min(0))
    return logits.masked_fill(torch.ones(tokens, tokens, dtype=torch.bool, device=hidden.device).triu(1),
                              float("-inf"))


@dataclass
class Selection:
    """How one layer's top-k of one token compares (the robust check, docs/demo.md).

    With e = max |ours - exact| over the visible positions and t_k the k-th largest exact logit, a
    position whose exact logit lies outside [t_k - 2e, t_k + 2e] is in the top-k of any logits within e
    of the exact ones exactly when it is above the band. So the library's set passes when it is the top-k
    of its own logits and agrees with HF's set, and with the exact top-k, on every position outside the
    band (HF computes in float32: its own margin is added); the logits' error itself is bounded per phase
    (Phase.index_errors, INDEX_TOLERANCE)."""

    overlap: float            # |ours & HF's| / |HF's|
    ambiguous: int            # positions in the band, where the two sets may differ
    consistent: bool          # ours is the top-k of our logits and agrees with HF's outside the band


def check_selection(ours: torch.Tensor, our_logits: torch.Tensor, hf_set: torch.Tensor, exact: torch.Tensor,
                    topk: int) -> Selection:
    """ours, hf_set: the selected positions (any order, -1 or positions past the token's ignored); our_logits,
    exact: the token's logits over its visible positions 0..p (float64)."""
    visible = exact.shape[0]
    mine = torch.zeros(visible, dtype=torch.bool)
    mine[ours[(ours >= 0) & (ours < visible)].long()] = True
    theirs = torch.zeros(visible, dtype=torch.bool)
    theirs[hf_set[(hf_set >= 0) & (hf_set < visible)].long()] = True
    scale = float(exact.abs().max()) or 1.0
    error = float((our_logits - exact).abs().max())
    if visible <= topk:  # every visible position is selected
        return Selection(float(theirs.sum()) / visible, 0, bool(mine.all() and theirs.all()))
    own_top = int(mine.sum()) == topk and (not (~mine).any() or
                                           float(our_logits[mine].min()) >= float(our_logits[~mine].max()))
    threshold = float(exact.topk(topk).values[-1])
    band = 2 * error + 1e-5 * scale  # HF's float32 logits lie within ~1e-6 of the exact ones
    clear = (exact - threshold).abs() > band
    agree = bool((mine[clear] == theirs[clear]).all()) and bool((mine[clear] == (exact[clear] > threshold)).all())
    return Selection(float((mine & theirs).sum()) / topk, int((~clear).sum()), own_top and agree)


def hf_sparse_attention(attn: torch.nn.Module, rotary: torch.nn.Module, hidden: torch.Tensor, forced: torch.Tensor,
                        style: str) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """HF's DSA attention over hidden [T, hidden] (positions 0..T-1) attending to the positions ``forced``
    [T, k] (the library's selection, -1 padded) instead of its own indexer's, so that the outputs compare
    at float rounding. -> (output [T, hidden], HF's own top-k [T, k'] (its indexer's output on these
    inputs), the exact logits [T, T]); the last two None for a layer without an indexer."""
    tokens = hidden.shape[0]
    positions = torch.arange(tokens, device=hidden.device)
    mask = torch.full((tokens, tokens), float("-inf"), dtype=hidden.dtype, device=hidden.device).triu(1)
    # -1 pads a row with fewer visible positions than k; HF scatters every index, so repeat the token's own
    forced = torch.where(forced >= 0, forced, positions[:, None]).to(torch.int32)[None]
    captured = {}
    if attn.indexer is not None:
        select = attn.indexer.forward

        def forced_selection(hidden_states, q_resid, position_embeddings, *args, **kwargs):
            captured["hf"] = select(hidden_states, q_resid, position_embeddings, *args, **kwargs)[0]
            captured["exact"] = exact_index_logits(attn.indexer, hidden_states[0], q_resid[0], position_embeddings,
                                                   style)
            return forced
        attn.indexer.forward = forced_selection
    try:
        extra = {} if attn.indexer is not None else dict(prev_topk_indices=forced)
        outputs = attn(hidden[None], position_embeddings=rotary(hidden, positions[None]),
                       attention_mask=mask[None, None], **extra)
    finally:
        if attn.indexer is not None:
            del attn.indexer.forward
    return outputs[0][0], captured.get("hf"), captured.get("exact")


def run_sparse(stack: Stack, prompt_len: int, decode_steps: int, block_size: int, topk: int, *, seed: int = 0,
               time_kernels: bool = False, kv_format: Optional[str] = None) -> DemoResult:
    """run() for a DSA model: each layer writes its latent rows and (with an indexer) its index keys, scores
    and selects its top-k slots, and attends to them alone; a layer without an indexer reuses the previous
    indexed layer's slots. Prefill, then single-token decode steps. Each layer's output is checked against
    HF's attention module attending to the same selection (at the tolerance of run()), and each selection
    against HF's own indexer and the exact logits (check_selection). kv_format: a quantized latent cache, as in
    run() (the index cache is e4m3 whatever it is)."""
    total = prompt_len + decode_steps
    device, dtype = stack.device, stack.dtype
    generator = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(total, stack.hf_config.hidden_size, generator=generator).to(device)  # float32, as HF

    num_blocks = -(-total // block_size)
    block_table = torch.randperm(num_blocks + 1, generator=generator)[:num_blocks].to(torch.int32)[None].to(device)
    caches = [_stale_cache(num_blocks + 1, block_size, dtype, kv_format, device, generator) for _ in stack.layers]
    quantized = {} if kv_format is None else dict(kv_format=kv_format,
                                                  kv_scale=FP8_KV_SCALE if kv_format == "fp8" else None)
    index_caches = [torch.randint(0, 256, layout.index_cache_shape(num_blocks + 1, block_size), generator=generator,
                                  dtype=torch.uint8).to(device) for _ in stack.layers]
    c = stack.hf_config
    cos_sin = rope.cos_sin_cache(c.qk_rope_head_dim, total, scaling=c.rope_parameters, dtype=torch.float32,
                                 device=device)
    style, scale = rope_style(c), stack.softmax_scale
    index_style = index_rope_style(stack.spec.config.get("model_type"))
    sources = [i if layer.has_indexer else None for i, layer in enumerate(stack.layers)]
    for i, source in enumerate(sources):
        sources[i] = i if source is not None else sources[i - 1]
    block_position = torch.full((num_blocks + 1,), -1, dtype=torch.long)  # physical block -> its first position
    block_position[block_table[0].long().cpu()] = torch.arange(num_blocks) * block_size

    def slots_of(positions):
        return block_table[0, positions // block_size].long() * block_size + positions % block_size

    def positions_of(slots):
        slots = slots.long().cpu()
        return torch.where(slots >= 0, block_position[slots.clamp_min(0) // block_size] + slots % block_size, -1)

    selected = [torch.full((total, topk), -1, dtype=torch.long) for _ in stack.layers]   # positions, per layer
    logits = [torch.full((total, total), float("-inf"), dtype=torch.float64) for _ in stack.layers]
    outputs = [torch.zeros(total, c.hidden_size, device=device) for _ in stack.layers]

    def step(first, last):
        n = last - first
        positions = torch.arange(first, last, device=device)
        kv_lens = torch.tensor([last], dtype=torch.int32, device=device)
        packed = dict(cu_q_lens=torch.tensor([0, n], dtype=torch.int32, device=device)) if n > 1 else {}
        h, slots_by_layer = x[first:last], {}
        for index, layer in enumerate(stack.layers):
            q = layer.queries(h)
            layer.write(layer.latent(h), positions, cos_sin, style, caches[index], slots_of(positions), q, kv_format)
            if layer.has_indexer:
                q_index = layer.index_queries(h)
                layer.write_index(layer.index_keys(h), positions, cos_sin, index_style, index_caches[index],
                                  slots_of(positions), q_index)
                scores = ops.index_scores(q_index, layer.index_weights(h), index_caches[index], block_table, kv_lens,
                                          last, max_q_len=n if packed else None, **packed)
                slots_by_layer[index] = ops.index_topk(scores, kv_lens, topk, block_table=block_table,
                                                       page_size=block_size, **packed)
                logits[index][first:last, :last] = scores.double().cpu()
            slots = slots_by_layer[sources[index]]
            selected[index][first:last] = positions_of(slots)
            o_lat, _ = ops.sparse_attention(q, caches[index], slots, scale, **quantized)
            outputs[index][first:last] = layer.output(o_lat)
            h = h + outputs[index][first:last]

    with torch.no_grad():
        step(0, prompt_len)
        for k in range(decode_steps):
            step(prompt_len + k, prompt_len + k + 1)
        hf_out, hf_topk, exact = [], [], []
        h = x
        for index, attn in enumerate(stack.hf_layers):
            out, hf_set, exact_logits = hf_sparse_attention(attn, stack.rotary, h, selected[index].to(device),
                                                            index_style)
            hf_out.append(out)
            hf_topk.append(None if hf_set is None else hf_set.cpu())
            exact.append(None if exact_logits is None else exact_logits.cpu())
            h = h + out

    phases = []
    bounds = [("prefill", 0, prompt_len)] + [(f"decode {k + 1}", prompt_len + k, prompt_len + k + 1)
                                            for k in range(decode_steps)]
    for name, first, last in bounds:
        phase = Phase(name, last - first, last)
        for index in range(len(stack.layers)):
            phase.errors.append(relative_error(outputs[index][first:last], hf_out[index][first:last]))
            if exact[index] is None:
                continue
            visible = torch.ones(last - first, last, dtype=torch.bool).tril(first)
            phase.index_errors.append(relative_error(logits[index][first:last, :last][visible],
                                                     exact[index][first:last, :last][visible]))
            for t in range(first, last):
                phase.selections.append(check_selection(selected[index][t], logits[index][t, :t + 1],
                                                        hf_topk[index][t], exact[index][t, :t + 1], topk))
        phases.append(phase)
    timings = _time_sparse_kernels(stack.layers[0], x, total, cos_sin, style, index_style, scale, caches[0],
                                   index_caches[0], block_table, slots_of, topk) if time_kernels and not kv_format else None
    tolerance = TOLERANCES[dtype] if kv_format is None else FORMAT_TOLERANCES[kv_format]
    return DemoResult(phases, tolerance, timings, index_tolerance=INDEX_TOLERANCE)


def _time_sparse_kernels(layer: DsaLayer, x, total, cos_sin, style, index_style, scale, cache, index_cache,
                         block_table, slots_of, topk) -> Dict[str, Tuple[str, float]]:
    """CUDA timings of the ops of layer 0's last decode step (its rows already written): the index-key write,
    the index scores, the top-k and the sparse attention."""
    device = x.device
    last = torch.arange(total - 1, total, device=device)
    h = x[total - 1:]
    q, q_index, k_index = layer.queries(h), layer.index_queries(h), layer.index_keys(h)
    layer.write(layer.latent(h), last, cos_sin, style, cache, slots_of(last), q)
    layer.write_index(k_index, last, cos_sin, index_style, index_cache, slots_of(last), q_index)
    scratch, weights = layer.index_queries(h), layer.index_weights(h)
    kv_lens = torch.tensor([total], dtype=torch.int32, device=device)
    scores = ops.index_scores(q_index, weights, index_cache, block_table, kv_lens, total)
    workspace = torch.zeros(ops.index_topk_workspace_size(1, total, topk), dtype=torch.uint8, device=device)
    slots = ops.index_topk(scores, kv_lens, topk, block_table=block_table, page_size=cache.shape[1],
                           workspace=workspace)
    heads, index_heads = layer.num_heads, layer.index_heads

    def timed(fn):
        return 1e6 * time_graph(lambda _: fn(), calls=10, samples=11)
    return {
        "write_index_keys": (f"1 token, q {index_heads} heads", timed(
            lambda: layer.write_index(k_index, last, cos_sin, index_style, index_cache, slots_of(last), scratch))),
        "index_scores": (f"1 query x {index_heads} heads, kv {total}", timed(
            lambda: ops.index_scores(q_index, weights, index_cache, block_table, kv_lens, total, out=scores))),
        "index_topk": (f"top {topk} of {total}", timed(
            lambda: ops.index_topk(scores, kv_lens, topk, block_table=block_table, page_size=cache.shape[1],
                                   out=slots, workspace=workspace))),
        "sparse_attention": (f"1 query x {heads} heads, {topk} rows", timed(
            lambda: ops.sparse_attention(q, cache, slots, scale))),
    }


def _time_kernels(layer: MlaLayer, x, prompt_len, total, cos_sin, style, scale, cache, block_table,
                  slots_of) -> Dict[str, Tuple[str, float]]:
    """CUDA timings of the three ops on layer 0's inputs: the prompt's write and prefill, the last decode.

    Re-running them rewrites the rows already in the cache with the same values; the write rotates a
    scratch copy of q, so the timed prefill and decode read correctly rotated queries.
    """
    device = x.device
    prompt = torch.arange(prompt_len, device=device)
    kv_a, q_prompt, prompt_slots = layer.latent(x[:prompt_len]), layer.queries(x[:prompt_len]), slots_of(prompt)
    layer.write(kv_a, prompt, cos_sin, style, cache, prompt_slots, q_prompt)
    last = torch.arange(total - 1, total, device=device)
    q_last = layer.queries(x[total - 1:])
    layer.write(layer.latent(x[total - 1:]), last, cos_sin, style, cache, slots_of(last), q_last)
    scratch = q_prompt.clone()
    cu_q_lens = torch.tensor([0, prompt_len], dtype=torch.int32, device=device)
    kv_lens = torch.tensor([prompt_len], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([total], dtype=torch.int32, device=device)
    heads = layer.num_heads
    return {
        "fused_write_kv": (f"{prompt_len} tokens, q {heads} heads", 1e6 * time_graph(
            lambda _: layer.write(kv_a, prompt, cos_sin, style, cache, prompt_slots, scratch), calls=10, samples=11)),
        "prefill": (f"{prompt_len} queries x {heads} heads, kv {prompt_len}", 1e6 * time_graph(
            lambda _: ops.prefill(q_prompt, cache, block_table, cu_q_lens, kv_lens, scale), calls=10, samples=11)),
        "decode": (f"1 query x {heads} heads, kv {total}", 1e6 * time_graph(
            lambda _: ops.decode(q_last[None], cache, block_table, seq_lens, scale), calls=10, samples=11)),
    }


# ---------------------------------------------------------------------------------- report
def describe(stack: Stack, block_size: int) -> List[str]:
    """The header lines: model shapes, weights, reference."""
    import transformers

    c = stack.hf_config
    q_path = f"q_lora {c.q_lora_rank}" if c.q_lora_rank else "no q_lora (q_proj)"
    heads = f"{stack.num_heads} heads"
    if stack.num_heads != stack.spec.model.num_heads:
        heads += f" (--heads; the model has {stack.spec.model.num_heads})"
    scaling = c.rope_parameters
    rope_desc = f"{scaling.get('rope_type', 'default')} theta {scaling.get('rope_theta'):,.0f}"
    if scaling.get("factor"):
        rope_desc += f" factor {scaling['factor']:g}"
    indexer = []
    if stack.spec.model.sparse:
        m = stack.spec.model
        shared = [i for i, layer in enumerate(stack.layers) if not layer.has_indexer]
        topk = f"top-k {c.index_topk:,}" + ("" if c.index_topk == m.index_topk else f" (the model's {m.index_topk:,})")
        indexer = [f"indexer      DSA: {c.index_n_heads} index heads x {c.index_head_dim}, {topk}, RoPE "
                   f"{index_rope_style(stack.spec.config.get('model_type'))} on dims 0..63, Hadamard, e4m3 index "
                   f"cache (132 B/token)" + (f"; layers {', '.join(map(str, shared))} reuse the previous indexed "
                                             "layer's top-k" if shared else "")]
    cache = "paged latent cache" + (" and index cache" if indexer else "")
    return [
        f"model        {stack.spec.name} ({stack.spec.config.get('model_type')}): hidden {c.hidden_size}, {heads}, "
        f"{q_path}, kv_lora {c.kv_lora_rank}, nope/rope/v {c.qk_nope_head_dim}/{c.qk_rope_head_dim}/{c.v_head_dim}",
        f"attention    RoPE {rope_desc} ({rope_style(c)}), softmax scale {stack.softmax_scale:.6g}",
        *indexer,
        f"stack        layers 0..{len(stack.layers) - 1}, h <- h + attn(h); weights {stack.weights}; "
        f"{cache}, block size {block_size}, shuffled block table",
        f"reference    HF transformers {transformers.__version__} {type(stack.hf_layers[0]).__name__} "
        f"(eager, {str(HF_DTYPE).replace('torch.', '')}) on the same weights",
    ]


def format_phases(result: DemoResult) -> str:
    """The per-phase error table, each phase marked ok or FAIL, and what the error means. A DSA run adds
    the index logits' error, the top-k's overlap with HF's and the positions in the threshold's band."""
    sparse = result.index_tolerance is not None
    header = ("phase", "q tokens", "kv len", "max rel err") + (("index err", "top-k = HF", "in band") if sparse else ())
    rows = [header + ("",)]
    for p in result.phases:
        cells = (p.name, str(p.q_tokens), str(p.kv_len), f"{p.max_error:.2e}")
        if sparse:
            overlap = min(s.overlap for s in p.selections)
            cells += (f"{p.max_index_error:.2e}", f"{100 * overlap:.1f}%", str(max(s.ambiguous for s in p.selections)))
        rows.append(cells + ("FAIL" if p.fails(result.tolerance, result.index_tolerance) else "ok",))
    columns = len(header)
    widths = [max(len(r[i]) for r in rows) for i in range(columns)]
    lines = ["  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:columns], widths[1:columns])]
                       + [r[columns]]).rstrip() for r in rows]
    lines.append(f"rel err = ||out - ref|| / ||ref|| of a layer's attention output, max over the layers; "
                 f"tolerance {result.tolerance:g}")
    if sparse:
        lines.append("sparse layers: HF's attention attends to the library's top-k (its own indexer's top-k is "
                     "compared separately);")
        lines.append(f"index err = ||logits - exact|| / ||exact|| of the phase's index logits, max over the layers "
                     f"(exact: float64, unquantized keys), tolerance {result.index_tolerance:g};")
        lines.append("top-k = HF: the smallest share of HF's top-k the library selected; in band: the most positions "
                     "of a token within 2 x its largest logit error of the k-th exact logit, where the sets may "
                     "differ (elsewhere they must agree)")
    return "\n".join(lines)


def format_timings(timings: Dict[str, Tuple[str, float]]) -> str:
    width = max(len(k) for k in timings)
    shape_width = max(len(s) for s, _ in timings.values())
    lines = ["kernel timings (CUDA events over CUDA-graph replays, median)"]
    lines += [f"{name.ljust(width)}  {shape.ljust(shape_width)}  {us:9.1f} us"
              for name, (shape, us) in timings.items()]
    return "\n".join(lines)


# ---- the mla-kv demo command -----------------------------------------------------------------

def _device(args) -> tuple:
    """(torch.device, a one-line note or None): --device, else cuda when a GPU and the kernels are there."""
    if args.device == "cuda":
        if not torch.cuda.is_available():
            args.parser.error("--device cuda: no CUDA GPU found (--device cpu runs the reference ops)")
        if not ops.kernels_available():
            args.parser.error("--device cuda: this mla_kv install has no CUDA kernels (--device cpu runs the "
                              "reference ops)")
        return torch.device("cuda", torch.cuda.current_device()), None
    if args.device == "cpu":
        return torch.device("cpu"), None
    if torch.cuda.is_available() and ops.kernels_available():
        return torch.device("cuda", torch.cuda.current_device()), None
    reason = "no CUDA GPU found" if not torch.cuda.is_available() else "this mla_kv install has no CUDA kernels"
    return torch.device("cpu"), f"{reason}: running the PyTorch reference ops (mla_kv.reference) on the CPU"


def _dtype(args, device) -> str:
    """The --dtype name, or the device's default; rejects what the CUDA kernels do not run. A quantized
    cache is written from 16-bit rows (default bf16 on the CPU)."""
    if getattr(args, "kv_format", None) is not None and args.dtype == "fp32":
        args.parser.error(f"--dtype fp32: a {args.kv_format} cache is written from fp16 or bf16 rows")
    if device.type == "cpu":
        return args.dtype or ("bf16" if getattr(args, "kv_format", None) else "fp32")
    cc = torch.cuda.get_device_capability(device)
    if args.dtype is None:
        return "bf16" if cc >= (8, 0) else "fp16"
    if args.dtype == "fp32":
        args.parser.error("--dtype fp32: the attention kernels run fp16 or bf16 (fp32 runs on --device cpu)")
    if args.dtype == "bf16" and cc < (8, 0):
        args.parser.error(f"--dtype bf16: the bf16 kernels need sm80 or newer, this GPU is sm_{cc[0]}{cc[1]}")
    return args.dtype


def _plan_text(args, spec: ModelSpec, dtype_name: str, gpu: Optional[Tuple[str, int]]) -> str:
    """The planner's view of the model: bytes per token of both layouts, and what fits on ``gpu``
    ((label, bytes), default the current CUDA GPU)."""
    cache_dtype = dtype_name if dtype_name in ("fp16", "bf16") else "fp16"
    lines = []
    if cache_dtype != dtype_name:
        lines.append(f"(planned for an {cache_dtype} cache, as deployed; this run's cache is {dtype_name})")
    gpu = gpu or planner.current_gpu()
    if gpu is None:
        per_layer = spec.model.bytes_per_token_per_layer(planner.CACHE_DTYPES[cache_dtype].itemsize, 1)
        layers = spec.model.num_layers
        latent, expanded = per_layer["latent"], per_layer["expanded"]
        lines += [f"KV cache     {cache_dtype}, {layers} layers: latent {latent:,} B/token/layer "
                  f"({latent * layers:,} B/token), expanded per-head {expanded:,} B/token/layer "
                  f"({expanded * layers:,} B/token): {expanded // latent}x",
                  "context      no GPU found: pass --gpu PRESET or --gpu-mem-gib N (and --weights-gb) to see "
                  "the context that fits"]
        return "\n".join(lines)
    weights_gb = args.weights_gb
    if weights_gb is None and spec.checkpoint is not None:
        weights_gb = sum(os.path.getsize(os.path.join(spec.checkpoint, f)) for f in os.listdir(spec.checkpoint)
                         if f.endswith(".safetensors")) / planner.GB
    if weights_gb is None:
        lines.append("(weights not counted: pass --weights-gb for the model's size)")
        weights_gb = 0.0
    result = planner.plan(spec.model, gpu[1], weights_gb * planner.GB, block_size=args.block_size,
                          cache_dtype=cache_dtype, kv_format=getattr(args, "kv_format", None))
    lines.append(planner.format_plan(result, gpu[0]))
    return "\n".join(lines)


def main(args, gpu: Optional[Tuple[str, int]] = None) -> int:
    """``mla-kv demo``: checks the parsed arguments against the model (an error exits 2 through
    ``args.parser``), runs the demo and prints it -> 0, or 1 when a step is above its tolerance.
    gpu: (label, bytes) of the GPU to plan for (--gpu / --gpu-mem-gib), default the current one."""
    try:
        spec = resolve_model(args.model)
    except (ValueError, TypeError) as e:
        args.parser.error(str(e))
    device, note = _device(args)
    index_topk = getattr(args, "index_topk", None)
    if index_topk is not None and not spec.model.sparse:
        args.parser.error(f"--index-topk: {spec.name} has no indexer (DeepSeek Sparse Attention)")
    if spec.model.sparse:
        defaults = DSA_DEFAULTS[device.type]
        index_topk = index_topk or defaults["topk"]
        args.prompt_len = args.prompt_len or defaults["prompt_len"]
    args.prompt_len = args.prompt_len or DENSE_PROMPT_LEN
    if args.layers > spec.model.num_layers:
        args.parser.error(f"--layers {args.layers}: {spec.name} has {spec.model.num_layers} layers")
    if args.prompt_len + args.decode_steps > spec.model.max_context:
        args.parser.error(f"--prompt-len + --decode-steps = {args.prompt_len + args.decode_steps} exceeds "
                          f"{spec.name}'s max context {spec.model.max_context:,}")
    if args.heads is not None and spec.checkpoint is not None:
        args.parser.error(f"--heads: {spec.name}'s weights fix the heads; the override is for random weights")
    if args.block_size > spec.model.max_context:  # its blocks are allocated whole
        args.parser.error(f"--block-size {args.block_size}: exceeds {spec.name}'s max context "
                          f"{spec.model.max_context:,}")
    if args.heads is not None and args.heads > spec.model.num_heads:  # it makes runs faster, never larger
        args.parser.error(f"--heads {args.heads}: {spec.name} has {spec.model.num_heads} attention heads")
    dtype_name = _dtype(args, device)
    try:
        stack = build_stack(spec, args.layers, DTYPES[dtype_name], device, seed=args.seed, num_heads=args.heads,
                            index_topk=index_topk)
    except ImportError as e:  # transformers or safetensors missing: not an argument error
        print(f"mla-kv demo: {e}", file=sys.stderr)
        return 1
    except (ValueError, TypeError) as e:
        args.parser.error(str(e))

    if device.type == "cuda":
        cc = torch.cuda.get_device_capability(device)
        where = f"{device}, {torch.cuda.get_device_name(device)} (sm_{cc[0]}{cc[1]}): the CUDA kernels"
    else:
        where = "cpu: the PyTorch reference ops (mla_kv.reference)"
    if note:
        print(note)
    kv_format = getattr(args, "kv_format", None)
    cache = "" if kv_format is None else f", {kv_format} cache (quantizing fused write, dequantizing attention)"
    print(f"mla-kv demo  {spec.name}: prompt {args.prompt_len}, decode steps {args.decode_steps}, {dtype_name} "
          f"on {where}{cache}")
    print("\n".join(describe(stack, args.block_size)), end="\n\n", flush=True)
    try:
        if spec.model.sparse:
            result = run_sparse(stack, args.prompt_len, args.decode_steps, args.block_size, index_topk,
                                seed=args.seed, time_kernels=device.type == "cuda", kv_format=kv_format)
        else:
            result = run(stack, args.prompt_len, args.decode_steps, args.block_size, seed=args.seed,
                         time_kernels=device.type == "cuda", kv_format=kv_format)
    except (ValueError, TypeError) as e:  # an op rejecting this configuration (e.g. the block size)
        args.parser.error(str(e))
    print(format_phases(result), end="\n\n")
    print(_plan_text(args, spec, dtype_name, gpu))
    if result.timings_us:
        print()
        print(format_timings(result.timings_us))
    if result.failed:
        worst = max(p.max_error for p in result.failed)
        print(f"mla-kv demo: error above tolerance {result.tolerance:g} in "
              f"{', '.join(p.name for p in result.failed)} (max {worst:.2e})", file=sys.stderr)
        return 1
    return 0
