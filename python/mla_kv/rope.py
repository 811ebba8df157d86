"""RoPE tables for MLA models: the cos/sin cache the kernels read and the softmax scale that goes with it.

The rope part of an MLA key (k_pe, 64 values) and of each query head is rotated by angles
``position * inv_freq[i]``, i < rope_dim / 2. ``inv_freq`` follows HF transformers' RoPE variants
("default", "linear", "yarn", "llama3") and is computed here in float64, so a table cast to float32 is
correctly rounded rather than carrying float32 frequency error (HF computes in float32).

``scaling`` is the model's HF ``rope_scaling`` (transformers 4.x) or ``rope_parameters`` (5.x) dict.
The variant is ``scaling["rope_type"]``, else ``scaling["type"]``, else "default"; ``scaling=None`` is
"default". The base ``theta`` is the explicit argument when given, else ``scaling["rope_theta"]``
(5.x dicts carry it); an explicit ``theta`` wins over the dict's. Keys a variant does not use are ignored.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Optional, Tuple

import torch

from ._checks import integer, real

ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def rope_type(scaling: Optional[Mapping]) -> str:
    """The RoPE variant named by an HF scaling dict ("default" for None); ValueError if unsupported."""
    if scaling is None:
        return "default"
    if not isinstance(scaling, Mapping):
        raise TypeError(f"scaling must be a dict or None, got {type(scaling).__name__}")
    kind = scaling.get("rope_type", scaling.get("type")) or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"scaling rope_type {kind!r} is not supported; expected one of {ROPE_TYPES}")
    return kind


def _scaling_value(scaling: Mapping, key: str, kind: str) -> float:
    if scaling.get(key) is None:
        raise ValueError(f"scaling[{key!r}] is required for rope_type {kind!r}")
    return real(f"scaling[{key!r}]", scaling[key], above=0)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _scaling_option(scaling: Mapping, key: str, default, **bounds):
    """An optional scaling[key] within ``bounds`` (as for _checks.real); ``default`` when it is absent,
    None or 0, which HF's ``scaling.get(key) or default`` treats as unset."""
    value = scaling.get(key)
    return default if value is None or value == 0 else real(f"scaling[{key!r}]", value, **bounds)


def _resolve_theta(theta: Optional[float], scaling: Optional[Mapping], kind: str) -> float:
    name = "theta"
    if theta is None:
        name = "scaling['rope_theta']"
        theta = scaling.get("rope_theta") if scaling is not None else None
        if theta is None:
            raise ValueError("theta is required (pass theta or a scaling dict holding 'rope_theta')")
    theta = real(name, theta, above=0)
    if kind == "yarn" and theta <= 1:  # its correction dims divide by log(theta), 0 at theta 1
        raise ValueError(f"{name}: rope_type 'yarn' needs theta > 1, got {theta!r}")
    return theta


def _yarn_frequencies(base_inv_freq: torch.Tensor, rope_dim: int, theta: float,
                      scaling: Mapping) -> Tuple[torch.Tensor, float]:
    # Dimensions that turn fewer than beta_slow times over the original context are interpolated
    # (divided by factor), those turning more than beta_fast times kept, with a linear ramp between;
    # the bounds are HF's/DeepSeek's correction dims, rounded outwards unless truncate is False.
    factor = _scaling_value(scaling, "factor", "yarn")
    original_max = _scaling_value(scaling, "original_max_position_embeddings", "yarn")
    beta_fast = _scaling_option(scaling, "beta_fast", 32, above=0)  # rotations: the log needs them > 0
    beta_slow = _scaling_option(scaling, "beta_slow", 1, above=0)

    def correction_dim(num_rotations: float) -> float:
        return rope_dim * math.log(original_max / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    inv_freq = base_inv_freq / factor * ramp + base_inv_freq * (1 - ramp)

    if scaling.get("attention_factor") is not None:
        attention_factor = real("scaling['attention_factor']", scaling["attention_factor"], above=0)
    else:  # mscales > 0 keep yarn_mscale >= 1, a safe divisor
        mscale = _scaling_option(scaling, "mscale", None, above=0)
        mscale_all_dim = _scaling_option(scaling, "mscale_all_dim", None, above=0)
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else yarn_mscale(factor))
    return inv_freq, attention_factor


def _llama3_frequencies(base_inv_freq: torch.Tensor, scaling: Mapping) -> torch.Tensor:
    # Wavelengths shorter than original/high_freq_factor are kept, longer than original/low_freq_factor
    # divided by factor, and blended in between by how many times they fit in the original context.
    factor = _scaling_value(scaling, "factor", "llama3")
    low_freq_factor = _scaling_value(scaling, "low_freq_factor", "llama3")
    high_freq_factor = _scaling_value(scaling, "high_freq_factor", "llama3")
    original_max = _scaling_value(scaling, "original_max_position_embeddings", "llama3")
    if high_freq_factor <= low_freq_factor:
        raise ValueError(f"scaling['high_freq_factor'] ({high_freq_factor}) must exceed "
                         f"scaling['low_freq_factor'] ({low_freq_factor})")
    wavelen = 2 * math.pi / base_inv_freq
    long_wave = wavelen > original_max / low_freq_factor
    short_wave = wavelen < original_max / high_freq_factor
    smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * base_inv_freq / factor + smooth * base_inv_freq
    return torch.where(long_wave, base_inv_freq / factor, torch.where(short_wave, base_inv_freq, blended))


def rope_frequencies(rope_dim: int, theta: Optional[float] = None,
                     scaling: Optional[Mapping] = None) -> Tuple[torch.Tensor, float]:
    """The float64 inverse frequencies [rope_dim / 2] and the factor cos/sin are multiplied by.

    Unscaled, inv_freq[i] = theta ** (-2i / rope_dim). "linear" divides every frequency by
    ``factor`` (the same as dividing positions by it). "yarn" and "llama3" follow HF transformers'
    ``_compute_yarn_parameters`` / ``_compute_llama3_parameters``; yarn's factor is
    ``attention_factor`` if given, else yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    when both are set and non-zero, else yarn_mscale(factor). Other variants have factor 1.
    """
    rope_dim = integer("rope_dim", rope_dim, 1)
    if rope_dim % 2:
        raise ValueError(f"rope_dim must be even, got {rope_dim}")
    kind = rope_type(scaling)
    theta = _resolve_theta(theta, scaling, kind)
    inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    if kind == "linear":
        return inv_freq / _scaling_value(scaling, "factor", kind), 1.0
    if kind == "yarn":
        return _yarn_frequencies(inv_freq, rope_dim, theta, scaling)
    if kind == "llama3":
        return _llama3_frequencies(inv_freq, scaling), 1.0
    return inv_freq, 1.0


def cos_sin_cache(rope_dim: int, max_position: int, theta: Optional[float] = None,
                  scaling: Optional[Mapping] = None, dtype: torch.dtype = torch.float32,
                  device=None) -> torch.Tensor:
    """The table [max_position, rope_dim] that the write and attention ops rotate with.

    Row p is [cos(p * inv_freq) | sin(p * inv_freq)] (rope_dim / 2 values each, see
    ``rope_frequencies``), times the variant's attention factor (YaRN's mscale ratio). Computed in
    float64, then cast to ``dtype`` and moved to ``device``. It serves both rope styles: pair i is
    (2i, 2i+1) for "interleaved" and (i, i + rope_dim/2) for "neox".

    HF's rotary modules return the same values duplicated to the full rope_dim:
    ``cos_hf = cat(cache[p, :half], cache[p, :half])``, ``sin_hf = cat(cache[p, half:], cache[p, half:])``.
    """
    max_position = integer("max_position", max_position, 1)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    inv_freq, attention_factor = rope_frequencies(rope_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    table = torch.cat([angles.cos(), angles.sin()], dim=-1) * attention_factor
    return table.to(dtype=dtype, device=device)


def mla_softmax_scale(qk_nope_head_dim: int, qk_rope_head_dim: int,
                      scaling: Optional[Mapping] = None) -> float:
    """The attention softmax scale of an MLA layer (DeepSeek's convention, as in HF's MLA models).

    1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), times yarn_mscale(factor, mscale_all_dim) ** 2
    when ``scaling`` is not "default" and has a non-zero ``mscale_all_dim`` (DeepSeek-V2/V3,
    Kimi-K2 with YaRN). Not 1/sqrt(576): the latent width does not enter the scale.
    GLM-4.7-Flash: mla_softmax_scale(192, 64) == 1/16.
    """
    head_dim = integer("qk_nope_head_dim", qk_nope_head_dim, 1) + integer("qk_rope_head_dim", qk_rope_head_dim, 1)
    scale = head_dim ** -0.5
    kind = rope_type(scaling)
    mscale_all_dim = None if kind == "default" else _scaling_option(scaling, "mscale_all_dim", None, above=0)
    if mscale_all_dim:
        mscale = yarn_mscale(_scaling_value(scaling, "factor", kind), mscale_all_dim)
        scale *= mscale * mscale
    return scale
