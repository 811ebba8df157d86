"""Preparing MLA projection weights for attention over the latent cache (torch only, any device).

HF checkpoints store kv_b_proj.weight [H * (nope + v), kv_lora_rank]; per head its rows are
[W_UK (nope) | W_UV (v)], each [*, 512]. Absorbed attention uses them as (mla_kv.reference)::

    q_lat[h] = q_nope[h] @ W_UK[h]          [nope] -> [512]   (absorb_q)
    out[h]   = W_UV[h] @ o_lat[h]           [512]  -> [v]     (project_out)

They can also be folded into the neighbouring projections once, at conversion time: q_b_proj then
emits [q_lat | q_pe] per head and o_proj takes the 512-d per-head o_lat directly (fold_q_b_proj,
fold_o_proj). AWQ checkpoints (AutoAWQ GEMM packing) keep kv_b_proj quantized; dequantize_awq
restores the dense weight so it can be split and absorbed.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Optional, Tuple, Union

import torch

from ._checks import integer, tensor
from .layout import LATENT_DIM

__all__ = [
    "split_kv_b_proj", "absorb_q", "project_out", "fold_q_b_proj", "fold_o_proj",
    "dequantize_awq", "load_kv_b_proj", "load_attention_weights",
]

# AutoAWQ's GEMM format packs 8 output channels per int32; nibble i (bits 4i..4i+3) holds channel
# AWQ_PACK_ORDER[i] of its group of 8.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _check_product(x_name: str, x, w_name: str, w) -> None:
    """x [..., H, k] times the per-head weights w [H, *, *]: floating tensors on one device. (An
    integer x would make the einsum round the weights to integers.)"""
    tensor(w_name, w, dims=3)
    tensor(x_name, x)
    for name, t in ((x_name, x), (w_name, w)):
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a floating dtype, got {t.dtype}")
    if x.device != w.device:
        raise ValueError(f"{w_name}: on {w.device}, expected {x.device} like {x_name}")


def _fold_dtype(t: torch.Tensor) -> torch.dtype:
    """Folding multiplies two weights; half-precision inputs are multiplied in float32 and rounded once."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def split_kv_b_proj(weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int,
                    kv_lora_rank: int = LATENT_DIM) -> Tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj.weight [H * (nope + v), kv_lora_rank] -> (w_uk [H, nope, r], w_uv [H, v, r]).

    Views of ``weight`` (no copy), in its dtype and device.
    """
    tensor("weight", weight, dims=2)
    num_heads, qk_nope_head_dim, v_head_dim, kv_lora_rank = (integer(name, v, 1) for name, v in (
        ("num_heads", num_heads), ("qk_nope_head_dim", qk_nope_head_dim), ("v_head_dim", v_head_dim),
        ("kv_lora_rank", kv_lora_rank)))
    rows = num_heads * (qk_nope_head_dim + v_head_dim)
    if tuple(weight.shape) != (rows, kv_lora_rank):
        raise ValueError(f"weight: expected shape ({rows}, {kv_lora_rank}) for {num_heads} heads of "
                         f"nope {qk_nope_head_dim} + v {v_head_dim}, got {tuple(weight.shape)}")
    per_head = weight.view(num_heads, qk_nope_head_dim + v_head_dim, kv_lora_rank)
    return per_head[:, :qk_nope_head_dim], per_head[:, qk_nope_head_dim:]


def absorb_q(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [..., H, nope] -> q_lat [..., H, r] = q_nope[..., h, :] @ w_uk[h], in q_nope's dtype."""
    _check_product("q_nope", q_nope, "w_uk", w_uk)
    if q_nope.dim() < 2 or tuple(q_nope.shape[-2:]) != tuple(w_uk.shape[:2]):
        raise ValueError(f"q_nope: expected shape [..., {w_uk.shape[0]}, {w_uk.shape[1]}] to match "
                         f"w_uk {tuple(w_uk.shape)}, got {tuple(q_nope.shape)}")
    return torch.einsum("...hn,hnr->...hr", q_nope, w_uk.to(q_nope.dtype))


def project_out(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_lat [..., H, r] -> [..., H, v] = w_uv[h] @ o_lat[..., h, :], in o_lat's dtype."""
    _check_product("o_lat", o_lat, "w_uv", w_uv)
    if o_lat.dim() < 2 or tuple(o_lat.shape[-2:]) != (w_uv.shape[0], w_uv.shape[2]):
        raise ValueError(f"o_lat: expected shape [..., {w_uv.shape[0]}, {w_uv.shape[2]}] to match "
                         f"w_uv {tuple(w_uv.shape)}, got {tuple(o_lat.shape)}")
    return torch.einsum("...hr,hvr->...hv", o_lat, w_uv.to(o_lat.dtype))


def fold_q_b_proj(q_b_weight: torch.Tensor, w_uk: torch.Tensor, num_heads: int,
                  qk_nope_head_dim: int, qk_rope_head_dim: int) -> torch.Tensor:
    """q_b_proj.weight [H * (nope + rope), in] -> [H * (r + rope), in] emitting [q_lat | q_pe] per head.

    Works for q_proj as well (models without q_lora_rank). The folded rows of head h are
    w_uk[h]^T @ W_nope[h]; its rope rows are copied. Computed in float32 (float64 for float64) and
    returned in q_b_weight's dtype.
    """
    tensor("q_b_weight", q_b_weight, dims=2)
    tensor("w_uk", w_uk, dims=3)
    num_heads, qk_nope_head_dim, qk_rope_head_dim = (integer(name, v, 1) for name, v in (
        ("num_heads", num_heads), ("qk_nope_head_dim", qk_nope_head_dim), ("qk_rope_head_dim", qk_rope_head_dim)))
    head_dim = qk_nope_head_dim + qk_rope_head_dim
    if q_b_weight.shape[0] != num_heads * head_dim:
        raise ValueError(f"q_b_weight: expected {num_heads} x {head_dim} rows, got {tuple(q_b_weight.shape)}")
    if tuple(w_uk.shape[:2]) != (num_heads, qk_nope_head_dim):
        raise ValueError(f"w_uk: expected shape ({num_heads}, {qk_nope_head_dim}, r), "
                         f"got {tuple(w_uk.shape)}")
    acc = _fold_dtype(q_b_weight)
    per_head = q_b_weight.to(acc).view(num_heads, head_dim, -1)
    q_lat_rows = torch.einsum("hnr,hni->hri", w_uk.to(acc), per_head[:, :qk_nope_head_dim])
    folded = torch.cat([q_lat_rows, per_head[:, qk_nope_head_dim:]], dim=1)
    return folded.reshape(-1, q_b_weight.shape[1]).to(q_b_weight.dtype)


def fold_o_proj(o_weight: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_proj.weight [hidden, H * v] -> [hidden, H * r] taking the per-head o_lat [r] directly.

    Column block h of the result is o_weight[:, h*v:(h+1)*v] @ w_uv[h]. Computed in float32 (float64 for
    float64) and returned in o_weight's dtype.
    """
    tensor("o_weight", o_weight, dims=2)
    tensor("w_uv", w_uv, dims=3)
    heads, v_dim, rank = w_uv.shape
    if o_weight.shape[1] != heads * v_dim:
        raise ValueError(f"o_weight: expected {heads} x {v_dim} columns to match w_uv, "
                         f"got {tuple(o_weight.shape)}")
    acc = _fold_dtype(o_weight)
    per_head = o_weight.to(acc).view(o_weight.shape[0], heads, v_dim)
    folded = torch.einsum("ohv,hvr->ohr", per_head, w_uv.to(acc))
    return folded.reshape(o_weight.shape[0], heads * rank).to(o_weight.dtype)


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols / 8] in AutoAWQ order -> int32 [rows, cols] of values 0..15 in channel order."""
    shifts = 4 * torch.arange(8, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF                 # [rows, cols / 8, nibble]
    channel_of_nibble = torch.tensor(AWQ_PACK_ORDER, device=packed.device)
    by_channel = torch.empty_like(nibbles)
    by_channel[..., channel_of_nibble] = nibbles
    return by_channel.flatten(-2)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int = 128, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """AutoAWQ GEMM 4-bit weight -> dense nn.Linear weight [out, in].

    qweight int32 [in, out / 8] and qzeros int32 [in / group_size, out / 8] pack 8 unsigned 4-bit values
    per int32 (see AWQ_PACK_ORDER); scales [in / group_size, out]. Input channel i of output channel o is
    (q[i, o] - z[i // group_size, o]) * s[i // group_size, o], returned in ``dtype`` (float16 as in
    AutoAWQ; the product is exact in float32, so float16 results round once).
    """
    for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        tensor(name, t, dims=2)
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dtype != torch.int32:
            raise TypeError(f"{name}: expected dtype torch.int32, got {t.dtype}")
    if not scales.dtype.is_floating_point:
        raise TypeError(f"scales: expected a floating dtype, got {scales.dtype}")
    group_size = integer("group_size", group_size, 1)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
    in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
    if in_features % group_size:
        raise ValueError(f"group_size: must divide the {in_features} input channels, got {group_size}")
    groups = in_features // group_size
    if tuple(qzeros.shape) != (groups, qweight.shape[1]):
        raise ValueError(f"qzeros: expected shape ({groups}, {qweight.shape[1]}), got {tuple(qzeros.shape)}")
    if tuple(scales.shape) != (groups, out_features):
        raise ValueError(f"scales: expected shape ({groups}, {out_features}), got {tuple(scales.shape)}")

    q = _unpack_awq(qweight)                                          # [in, out]
    z = _unpack_awq(qzeros).repeat_interleave(group_size, dim=0)      # [in, out]
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=0)
    return ((q - z).to(torch.float32) * s).to(dtype).t().contiguous()


def _safe_open():
    try:
        from safetensors import safe_open
    except ImportError as e:  # safetensors is an optional dependency (the `test` extra)
        raise ImportError("reading checkpoints needs the safetensors package") from e
    return safe_open


def _tensor_files(path: str) -> dict:
    """Maps each tensor name to its safetensors file for a file or a (sharded) checkpoint directory."""
    if os.path.isfile(path):
        files = [path]
    elif os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            return {name: os.path.join(path, file) for name, file in weight_map.items()}
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"path: no .safetensors files in {path}")
    else:
        raise ValueError(f"path: {path} is neither a file nor a directory")
    names = {}
    for file in files:
        with _safe_open()(file, framework="pt") as f:
            names.update((name, file) for name in f.keys())
    return names


def _reader(path: str, device):
    """(tensor name -> file map, read(name) -> tensor) of a .safetensors file or checkpoint directory."""
    safe_open = _safe_open()
    files = _tensor_files(path)

    def read(name: str) -> torch.Tensor:
        with safe_open(files[name], framework="pt", device=str(device)) as f:
            return f.get_tensor(name)

    return files, read


def _read_linear(files: dict, read, base: str, path: str) -> torch.Tensor:
    """The dense weight of linear layer ``base``: ``base.weight``, or its AWQ triplet dequantized."""
    if f"{base}.weight" in files:
        return read(f"{base}.weight")
    if all(f"{base}.{part}" in files for part in ("qweight", "qzeros", "scales")):
        qweight, qzeros, scales = (read(f"{base}.{part}") for part in ("qweight", "qzeros", "scales"))
        if qzeros.dim() != 2 or qzeros.shape[0] == 0 or qweight.shape[0] % qzeros.shape[0]:
            raise ValueError(f"path: {base}.qzeros has shape {tuple(qzeros.shape)}, which does not "
                             f"group the {qweight.shape[0]} input channels")
        return dequantize_awq(qweight, qzeros, scales, group_size=qweight.shape[0] // qzeros.shape[0])
    raise ValueError(f"layer: neither {base}.weight nor {base}.qweight/.qzeros/.scales is in {path}")


def load_kv_b_proj(path: Union[str, os.PathLike], layer: int, *, prefix: str = "model.layers",
                   dtype: Optional[torch.dtype] = None, device="cpu") -> torch.Tensor:
    """Reads layer ``layer``'s kv_b_proj as a dense weight [H * (nope + v), kv_lora_rank].

    ``path`` is a .safetensors file or a checkpoint directory (shards listed by
    model.safetensors.index.json, else every .safetensors file in it). The tensors are
    ``{prefix}.{layer}.self_attn.kv_b_proj.weight``, or the AWQ triplet ``.qweight/.qzeros/.scales``,
    which is dequantized (group size from the shapes). The result has the stored dtype (float16 for
    AWQ) unless ``dtype`` is given.
    """
    path = os.fspath(path)
    layer = integer("layer", layer, 0)
    files, read = _reader(path, device)
    weight = _read_linear(files, read, f"{prefix}.{layer}.self_attn.kv_b_proj", path)
    return weight if dtype is None else weight.to(dtype)


# Tensor name endings of one module in a checkpoint: a dense linear or norm, a bias, an AWQ linear.
_DENSE_PARTS = ("weight", "bias")
_AWQ_PARTS = ("qweight", "qzeros", "scales")


def load_attention_weights(path: Union[str, os.PathLike], layer: int, *, prefix: str = "model.layers",
                           dtype: Optional[torch.dtype] = None, device="cpu") -> Dict[str, torch.Tensor]:
    """Reads every tensor of layer ``layer``'s ``self_attn`` module as a dense state dict.

    Keys are relative to ``{prefix}.{layer}.self_attn`` ("q_a_proj.weight", "kv_a_layernorm.weight",
    "kv_b_proj.weight", "o_proj.weight", ...), so the result loads into HF's DeepseekV2/V3 and
    Glm4MoeLite attention modules. AWQ linears (``.qweight/.qzeros/.scales``) come back dequantized as
    ``.weight``. Any other tensor kind (e.g. block-FP8 ``weight_scale_inv``) is a ValueError: such
    checkpoints must be dequantized first. ``path`` as in load_kv_b_proj; stored dtypes unless
    ``dtype`` is given.
    """
    path = os.fspath(path)
    layer = integer("layer", layer, 0)
    files, read = _reader(path, device)
    base = f"{prefix}.{layer}.self_attn."
    modules = {}
    for name in files:
        if name.startswith(base):
            module, _, part = name[len(base):].rpartition(".")
            if part not in _DENSE_PARTS + _AWQ_PARTS:
                raise ValueError(f"path: {name} is neither a dense nor an AWQ tensor; only those are read")
            modules.setdefault(module, set()).add(part)
    if not modules:
        raise ValueError(f"layer: no {base}* tensors in {path}")
    state = {}
    for module, parts in sorted(modules.items()):
        state[f"{module}.weight"] = _read_linear(files, read, base + module, path)
        if "bias" in parts:
            state[f"{module}.bias"] = read(f"{base}{module}.bias")
    return state if dtype is None else {k: v.to(dtype) for k, v in state.items()}
