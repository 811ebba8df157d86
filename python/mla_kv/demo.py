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
}

# config.json keys that shape an MLA attention module; everything else (MoE, vocabulary) is ignored.
_ATTENTION_KEYS = ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                   "qk_rope_head_dim", "v_head_dim", "rope_theta", "rope_scaling", "rope_parameters",
                   "rope_interleave", "rms_norm_eps", "max_position_embeddings", "attention_bias")


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
    return dict(PRESET_ATTENTION[name], num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                max_position_embeddings=m.max_context, kv_lora_rank=m.kv_lora_rank,
                qk_rope_head_dim=m.qk_rope_head_dim, num_nextn_predict_layers=m.num_mtp_layers)


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
    else:
        raise ValueError(f"model_type {model_type!r} is not an MLA model the demo knows "
                         f"({', '.join(planner.MLA_MODEL_TYPES)})")
    return config_cls, attention_cls, rotary_cls


def hf_attention_config(config: dict, num_heads: Optional[int] = None):
    """The HF config object (eager attention) of config.json fields; ``num_heads`` overrides the heads."""
    config_cls, _, _ = hf_classes(config.get("model_type"))
    kwargs = {k: config[k] for k in _ATTENTION_KEYS if k in config}
    if num_heads is not None:
        kwargs["num_attention_heads"] = num_heads
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
        elif name.endswith("layernorm.weight"):
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
                num_heads: Optional[int] = None) -> Stack:
    """The first ``num_layers`` attention layers of ``spec``: random weights, or the checkpoint's.

    Weights are rounded to ``dtype`` (the precision a deployment stores them in) and held in HF_DTYPE by
    the HF modules on ``device``; the library layers use those same tensors (MlaLayer).
    """
    if spec.checkpoint is not None and num_heads is not None:
        raise ValueError("num_heads: a checkpoint's weights fix the heads; the override is for random weights")
    hf_config = hf_attention_config(spec.config, num_heads)
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
        layers.append(MlaLayer(attn, dtype))
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

    @property
    def max_error(self) -> float:
        """The largest layer error; NaN if any layer's is NaN (max() would depend on the order)."""
        return math.nan if any(math.isnan(e) for e in self.errors) else max(self.errors)


@dataclass
class DemoResult:
    phases: List[Phase]
    tolerance: float
    timings_us: Optional[Dict[str, Tuple[str, float]]] = None  # kernel -> (shape, median microseconds)

    @property
    def failed(self) -> List[Phase]:
        return [p for p in self.phases if not p.max_error <= self.tolerance]  # NaN fails too


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
    return [
        f"model        {stack.spec.name} ({stack.spec.config.get('model_type')}): hidden {c.hidden_size}, {heads}, "
        f"{q_path}, kv_lora {c.kv_lora_rank}, nope/rope/v {c.qk_nope_head_dim}/{c.qk_rope_head_dim}/{c.v_head_dim}",
        f"attention    RoPE {rope_desc} ({rope_style(c)}), softmax scale {stack.softmax_scale:.6g}",
        f"stack        layers 0..{len(stack.layers) - 1}, h <- h + attn(h); weights {stack.weights}; "
        f"paged latent cache, block size {block_size}, shuffled block table",
        f"reference    HF transformers {transformers.__version__} {type(stack.hf_layers[0]).__name__} "
        f"(eager, {str(HF_DTYPE).replace('torch.', '')}) on the same weights",
    ]


def format_phases(result: DemoResult) -> str:
    """The per-phase error table, each phase marked ok or FAIL, and what the error means."""
    rows = [("phase", "q tokens", "kv len", "max rel err", "")]
    for p in result.phases:
        rows.append((p.name, str(p.q_tokens), str(p.kv_len), f"{p.max_error:.2e}",
                     "ok" if p.max_error <= result.tolerance else "FAIL"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:4], widths[1:4])] + [r[4]])
             .rstrip() for r in rows]
    lines.append(f"rel err = ||out - ref|| / ||ref|| of a layer's attention output, max over the layers; "
                 f"tolerance {result.tolerance:g}")
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
    device, note = _device(args)
    dtype_name = _dtype(args, device)
    try:
        stack = build_stack(spec, args.layers, DTYPES[dtype_name], device, seed=args.seed, num_heads=args.heads)
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
        result = run(stack, args.prompt_len, args.decode_steps, args.block_size, seed=args.seed,
                     time_kernels=device.type == "cuda", kv_format=getattr(args, "kv_format", None))
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
