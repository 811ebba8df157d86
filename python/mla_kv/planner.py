"""KV cache memory planner: what a model costs per token and how much context fits on a GPU.

For an MLA model it plans two layouts side by side:

- ``latent``: the paged latent cache this library keeps, one row [c_kv | k_pe] per token and layer
  (kv_lora_rank + qk_rope_head_dim = 576 values). Tensor parallelism does not shrink it: every
  rank keeps the whole latent cache, because every rank's heads read all of it.
- ``expanded``: per-head K and V rows of 576 values each, the layout of the engine bug this library
  fixes: heads/tp x 2 x 576 values per token and layer, 2 x heads times the latent.

A GQA model (for comparison) has one layout, ``kv``: kv_heads/tp x 2 x head_dim values per token
and layer (KV heads are replicated when tp exceeds their number).

Quantized caches (``kv_format``, one of mla_kv.layout.KV_FORMATS): None is the unquantized row in
``cache_dtype`` above. ``"fp8"``, ``"fp8_ds_mla"``, ``"int8"`` and ``"int4"`` are latent rows of
512 + 64 values whose bytes per token and layer, and per block, are mla_kv.layout's
(``bytes_per_token`` / ``block_bytes``: int8 and int4 include the per-token scale and zero of the
block's trailer, kept in ``cache_dtype``, which must then be fp16 or bf16). A quantized plan has the
``latent`` layout only: the expanded per-head layout has no quantized form in this library, so it
is planned for kv_format None alone (a 16-bit expanded row next to a quantized latent one would
compare the format and the layout at once). GQA models and MLA models whose rows are not 512 + 64
values have no quantized format here.

DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5.x) adds the indexer's key cache to every layer
that runs an indexer: one key of index_head_dim e4m3 codes and a float32 scale per token
(mla_kv.layout.INDEX_ROW_BYTES = 132 B for the 128-dim keys of every DSA model), in blocks of the same
block size as the latent cache. It is one key per token, like the latent row, so tensor parallelism
does not shrink it, and it is the same in every layout and kv_format. A layer without an indexer
(GLM-5.2's "shared" layers, which reuse the previous indexed layer's top-k) has no index cache.
Counted MTP layers of a DSA model are counted as indexed: an MTP block is a full DSA layer.

Memory accounting (TurboMind's ``cache_max_entry_count`` semantics), per GPU::

    free         = gpu_mem - weight_bytes / tp - reserved_bytes
    cache        = floor(ratio * free)                   ratio: fraction of FREE memory, default 0.8
    bytes_per_block = block_size * bytes_per_token       bytes_per_token: all cached layers, with the
                                                         index cache of the indexed layers (DSA)
    num_blocks   = cache // bytes_per_block              whole blocks only
    max_tokens   = num_blocks * block_size * cp          context parallelism spreads tokens over cp GPUs
    session_len  = min(max_tokens, model max context)    truncated when max_tokens is the smaller

Conventions: GPU memory is in GiB (2^30 B; NVIDIA's "32 GB" V100 is 32 GiB of HBM) and weight
sizes are in decimal GB (10^9 B, as checkpoint files are listed). ``weight_bytes`` is the whole
model, sharded evenly over tp ranks; cp ranks hold the same shards (each GPU holds weights / tp).
``reserved_bytes`` (default 2 GiB) stands for what the runtime takes before the cache is sized:
the CUDA context, library workspaces and activation buffers, plus the few hundred MiB by which the
driver's usable total falls short of the nominal size.
MTP (next-token prediction) layers are not counted by default: TurboMind and HF transformers do
not cache them in normal decoding; ``count_mtp_layers=True`` adds them for engines that do
(speculative decoding with the MTP head).

The bug report this planner reproduces: GLM-4.7-Flash (47 layers, 20 heads) on a V100-32G with
18.4 GB of AWQ weights and ratio 0.8; the engine logged "session_len truncated to 4928". Here:
free = 34,359,738,368 - 18,400,000,000 - 2,147,483,648 = 13,812,254,720 B, cache 11,049,803,776 B;
expanded 46,080 B x 47 layers = 2,165,760 B/token, 138,608,640 B per block of 64 -> 79 blocks =
5,056 tokens; latent 1,152 x 47 = 54,144 B/token, 3,465,216 B per block -> 3,188 blocks =
204,032 tokens >= the model's 202,752. No accounting gives exactly 4,928 together with a latent
context >= 202,752: the layouts differ by exactly 40x per block, and 40 x (4,928 + 64) = 199,680
< 202,752. The engine's 4,928 (77 blocks) is 2 blocks (~0.3 GB) below this plan; its runtime
buffers were that much larger than the 2 GiB reserved here.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from . import layout
from ._checks import integer, real
from .layout import INDEX_DIM, LATENT_DIM, ROPE_DIM

GiB = 1 << 30
GB = 10 ** 9

DEFAULT_RATIO = 0.8
DEFAULT_RESERVED_BYTES = 2 * GiB
DEFAULT_BLOCK_SIZE = 64

CACHE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

# HF config.json model types whose attention is MLA (a latent cache of kv_lora_rank + rope values).
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "kimi_k2", "deepseek_v32", "glm_moe_dsa")
# ... and those of them with DeepSeek Sparse Attention (an indexer and its key cache).
DSA_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")


@dataclass(frozen=True)
class MlaModel:
    """Shapes of an MLA model that decide its cache size (HF config.json names in comments)."""

    name: str
    num_layers: int                      # num_hidden_layers
    num_heads: int                       # num_attention_heads
    max_context: int                     # max_position_embeddings
    kv_lora_rank: int = LATENT_DIM
    qk_rope_head_dim: int = ROPE_DIM
    num_mtp_layers: int = 0              # num_nextn_predict_layers
    # DeepSeek Sparse Attention; index_n_heads 0: none. index_layers: the layers that run an indexer and
    # keep an index cache (ascending, layer 0 first: a layer without one reuses the previous one's top-k).
    index_n_heads: int = 0               # index_n_heads
    index_head_dim: int = 0              # index_head_dim
    index_topk: int = 0                  # index_topk
    index_layers: Tuple[int, ...] = ()   # indexer_types "full" (all layers when the config lists none)

    attention = "mla"

    def __post_init__(self) -> None:
        _check_sizes(self, num_layers=1, num_heads=1, max_context=1, kv_lora_rank=1, qk_rope_head_dim=0,
                     num_mtp_layers=0, index_n_heads=0, index_head_dim=0, index_topk=0)
        layers = self.index_layers
        if not isinstance(layers, tuple) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
            raise TypeError(f"MlaModel.index_layers: expected a tuple of ints, got {layers!r}")
        if not self.index_n_heads:
            if layers or self.index_head_dim or self.index_topk:
                raise ValueError("MlaModel.index_n_heads: index_layers, index_head_dim and index_topk need an "
                                 "indexer (index_n_heads >= 1)")
            return
        _check_sizes(self, index_head_dim=1, index_topk=1)
        if not layers or layers[0] != 0 or list(layers) != sorted(set(layers)) or layers[-1] >= self.num_layers:
            raise ValueError(f"MlaModel.index_layers: ascending layer numbers in [0, {self.num_layers}) starting at "
                             f"layer 0 (a layer without an indexer reuses the previous one's), got {layers}")

    @property
    def sparse(self) -> bool:
        """Whether the model runs DeepSeek Sparse Attention (an indexer, an index cache)."""
        return self.index_n_heads > 0

    @property
    def index_bytes_per_token_per_layer(self) -> int:
        """The index cache's bytes per token in an indexed layer: e4m3 codes and a float32 scale (0: no DSA)."""
        if not self.sparse:
            return 0
        return layout.INDEX_ROW_BYTES if self.index_head_dim == INDEX_DIM else self.index_head_dim + 4

    def bytes_per_token_per_layer(self, element_size: int, tp: int) -> Dict[str, int]:
        if self.num_heads % tp:
            raise ValueError(f"tp: {tp} does not divide {self.name}'s {self.num_heads} attention heads")
        row = (self.kv_lora_rank + self.qk_rope_head_dim) * element_size
        return {"latent": row, "expanded": self.num_heads // tp * 2 * row}


@dataclass(frozen=True)
class GqaModel:
    """Shapes of a grouped-query-attention model, for comparison with MLA."""

    name: str
    num_layers: int
    num_kv_heads: int                    # num_key_value_heads
    head_dim: int                        # head_dim, or hidden_size / num_attention_heads
    max_context: int
    num_mtp_layers: int = 0

    attention = "gqa"

    def __post_init__(self) -> None:
        _check_sizes(self, num_layers=1, num_kv_heads=1, head_dim=1, max_context=1, num_mtp_layers=0)

    def bytes_per_token_per_layer(self, element_size: int, tp: int) -> Dict[str, int]:
        # A rank keeps ceil(kv_heads / tp) heads: KV heads are replicated when tp exceeds them.
        heads_per_rank = -(-self.num_kv_heads // tp)
        return {"kv": heads_per_rank * 2 * self.head_dim * element_size}


# ---- DeepSeek-V4 (Flash, Pro): a window ring plus compressed entries per layer -------------------------------
V4_LAYER_TYPES = ("window", "csa", "hca")   # HF's names: V4_HF_LAYER_TYPES
# The cache formats of a V4 row (mla_kv.layout.V4_FORMATS); kv_format None is the row in cache_dtype.
V4_KV_FORMATS = (None, "v4_fp8", "v4_mxfp8")
V4_STATE_BYTES = 4                          # the compressor state is kept in float32
V4_MODEL_TYPE = "deepseek_v4"               # its HF config.json model_type
# The names of V4_LAYER_TYPES in the layer_types of HF's DeepseekV4Config.
V4_HF_LAYER_TYPES = {"sliding_attention": "window", "compressed_sparse_attention": "csa",
                     "heavily_compressed_attention": "hca"}


@dataclass(frozen=True)
class V4Model:
    """Shapes of a DeepSeek-V4 model (HF DeepseekV4Config names in comments). Its MLA-like K = V row (512 values,
    448 NoPE + 64 RoPE) is not MlaModel's 512 + 64 latent row, and its cache is not one row per token and layer:

    - every layer keeps a ring of the last ``window`` tokens' rows per sequence (a fixed size, whatever the context);
    - CSA layers add one compressed row per ``csa_ratio`` tokens and its index key (INDEX_ROW_BYTES, the indexer's
      128-wide compressed key); HCA layers one compressed row per ``hca_ratio`` tokens; window-only layers nothing;
    - CSA and HCA layers keep a compressor state per sequence: the open window's kv and gate projections in
      float32 (CSA: two series of ``head_dim`` plus the last closed window's first series; its indexer the same at
      ``index_head_dim``), as mla_kv.reference.v4_compress.CompressorState holds them.
    """

    name: str
    num_heads: int                       # num_attention_heads (one K = V head)
    max_context: int                     # max_position_embeddings
    layer_types: Tuple[str, ...]         # layer_types, each of V4_LAYER_TYPES
    window: int = 128                    # sliding_window
    csa_ratio: int = 4                   # compress_rates["compressed_sparse_attention"]
    hca_ratio: int = 128                 # compress_rates["heavily_compressed_attention"]
    head_dim: int = LATENT_DIM           # head_dim
    index_n_heads: int = 64              # index_n_heads
    index_head_dim: int = INDEX_DIM      # index_head_dim
    index_topk: int = 512                # index_topk
    num_mtp_layers: int = 0              # num_nextn_predict_layers: planned as window-only layers

    attention = "v4"
    sparse = True                        # the CSA layers' indexer

    def __post_init__(self) -> None:
        _check_sizes(self, num_heads=1, max_context=1, window=1, csa_ratio=1, hca_ratio=1, head_dim=1,
                     index_n_heads=1, index_head_dim=1, index_topk=1, num_mtp_layers=0)
        types = self.layer_types
        if not isinstance(types, tuple) or not types or not all(t in V4_LAYER_TYPES for t in types):
            raise ValueError(f"V4Model.layer_types: a non-empty tuple of {', '.join(V4_LAYER_TYPES)}, got {types!r}")
        if self.hca_ratio % self.csa_ratio:
            # A planner block spans one HCA page; it must hold whole CSA pages too.
            raise ValueError(f"V4Model.hca_ratio: must be a multiple of csa_ratio {self.csa_ratio}, "
                             f"got {self.hca_ratio}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def count(self, layer_type: str) -> int:
        """Layers of this type (num_mtp_layers not included)."""
        return self.layer_types.count(layer_type)

    def compressor_state_bytes(self, layer_type: str) -> int:
        """One sequence's compressor state in a layer of this type (0: window-only)."""
        def state(ratio: int, series: int, width: int) -> int:
            previous_series = width if series == 2 else 0          # CSA: the last closed window's series a
            return 2 * ratio * (series * width + previous_series) * V4_STATE_BYTES     # kv and gate
        if layer_type == "csa":
            return state(self.csa_ratio, 2, self.head_dim) + state(self.csa_ratio, 2, self.index_head_dim)
        if layer_type == "hca":
            return state(self.hca_ratio, 1, self.head_dim)
        return 0


Model = Union[MlaModel, GqaModel, V4Model]


def _check_sizes(model, **minimums) -> None:
    """A model's size fields are ints of at least these minimums (a 0-layer or 0-head model divides by 0)."""
    for field, minimum in minimums.items():
        integer(f"{type(model).__name__}.{field}", getattr(model, field), minimum)


# Public HF config.json values (max_position_embeddings, num_nextn_predict_layers included).
MODELS: Dict[str, Model] = {m.name: m for m in (
    MlaModel("glm-4.7-flash", num_layers=47, num_heads=20, max_context=202_752, num_mtp_layers=1),
    MlaModel("deepseek-v2-lite", num_layers=27, num_heads=16, max_context=163_840),
    MlaModel("deepseek-v3", num_layers=61, num_heads=128, max_context=163_840, num_mtp_layers=1),
    MlaModel("kimi-k2", num_layers=61, num_heads=64, max_context=131_072),
    MlaModel("deepseek-v3.2", num_layers=61, num_heads=128, max_context=163_840, num_mtp_layers=1,
             index_n_heads=64, index_head_dim=128, index_topk=2048, index_layers=tuple(range(61))),
    MlaModel("glm-5", num_layers=78, num_heads=64, max_context=202_752, num_mtp_layers=1,
             index_n_heads=32, index_head_dim=128, index_topk=2048, index_layers=tuple(range(78))),
    MlaModel("glm-5.1", num_layers=78, num_heads=64, max_context=202_752, num_mtp_layers=1,
             index_n_heads=32, index_head_dim=128, index_topk=2048, index_layers=tuple(range(78))),
    # GLM-5.2 ("IndexShare"): layers 0, 1, 2, then every 4th (6, 10, ..., 74) index; the 57 others reuse
    # the previous indexed layer's top-k (indexer_types; HF's index_topk_freq 4, index_skip_topk_offset 3).
    MlaModel("glm-5.2", num_layers=78, num_heads=64, max_context=202_752, num_mtp_layers=1,
             index_n_heads=32, index_head_dim=128, index_topk=2048, index_layers=(0, 1, 2, *range(6, 78, 4))),
    # DeepSeek-V4 (HF deepseek_v4): Flash 2 window-only + 21 CSA + 20 HCA layers, Pro 30 CSA + 31 HCA. The order
    # of the types is a stand-in (the plan counts them only); max context 1M, HF DeepseekV4Config's default.
    V4Model("deepseek-v4-flash", num_heads=64, max_context=1_048_576, num_mtp_layers=1, index_topk=512,
            layer_types=("window",) * 2 + ("csa", "hca") * 20 + ("csa",)),
    V4Model("deepseek-v4-pro", num_heads=128, max_context=1_048_576, num_mtp_layers=1, index_topk=1024,
            layer_types=("hca",) + ("csa", "hca") * 30),
    GqaModel("llama-3.1-8b", num_layers=32, num_kv_heads=8, head_dim=128, max_context=131_072),
    GqaModel("llama-3.1-70b", num_layers=80, num_kv_heads=8, head_dim=128, max_context=131_072),
)}

# Nominal memory in GiB. The driver reports a few hundred MiB less (reserved_bytes covers it).
GPU_MEM_GIB: Dict[str, float] = {
    "v100-16g": 16, "v100-32g": 32, "t4": 16, "a10": 24, "l4": 24, "a100-40g": 40,
    "a100-80g": 80, "l40s": 48, "h100": 80, "h200": 141,
}


def index_source_layers(model: Model) -> List[Optional[int]]:
    """For each layer of ``model``, the layer whose top-k indices its sparse attention reads: itself when it
    runs an indexer, else the nearest indexed layer before it (GLM-5.2's shared layers); None for every
    layer of a model without DSA."""
    if not isinstance(model, (MlaModel, GqaModel, V4Model)):
        raise TypeError(f"model: expected an MlaModel, GqaModel or V4Model, got {type(model).__name__}")
    if model.attention == "v4":  # each CSA layer runs its own indexer; the others select no top-k
        return [layer if kind == "csa" else None for layer, kind in enumerate(model.layer_types)]
    if model.attention != "mla" or not model.sparse:
        return [None] * model.num_layers
    indexed, source = set(model.index_layers), []
    for layer in range(model.num_layers):
        source.append(layer if layer in indexed else source[-1])  # layer 0 is always indexed
    return source


def _indexed_layers(cfg: dict, num_layers: int, name: str) -> Tuple[int, ...]:
    """The indexed layers of a DSA config: ``indexer_types`` ("full" / "shared" per layer), else
    ``index_topk_pattern`` ("F" / "S" per layer, a string or a list of "full" / "shared"), else the schedule
    ``index_topk_freq`` / ``index_skip_topk_offset`` (layer i indexes when max(i - offset + 1, 0) is a
    multiple of freq; defaults 1 and 2: every layer), the keys HF transformers' GlmMoeDsaConfig reads."""
    kinds = cfg.get("indexer_types")
    key = "indexer_types"
    if kinds is None and cfg.get("index_topk_pattern") is not None:
        key, pattern = "index_topk_pattern", cfg["index_topk_pattern"]
        kinds = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if kinds is None:
        freq = integer(f"{name}: 'index_topk_freq'", cfg.get("index_topk_freq", 1), 1)
        offset = integer(f"{name}: 'index_skip_topk_offset'", cfg.get("index_skip_topk_offset", 2), 0)
        return tuple(i for i in range(num_layers) if max(i - offset + 1, 0) % freq == 0)
    if not isinstance(kinds, list) or len(kinds) != num_layers or not set(kinds) <= {"full", "shared"}:
        raise ValueError(f"{name}: {key!r} must give 'full' or 'shared' for each of the {num_layers} layers")
    return tuple(i for i, kind in enumerate(kinds) if kind == "full")


def _v4_compress_rate(cfg: dict, layer_type: str, legacy_key: str, default: int, name: str) -> int:
    """A DeepSeek-V4 layer type's tokens per compressed entry, read as HF's DeepseekV4Config reads it: the
    top-level ``legacy_key`` (compress_rate_csa / _hca), else ``compress_rates[layer_type]``, else ``default``
    when the config has no compress_rates (the published checkpoints' config.json has none)."""
    if cfg.get(legacy_key) is not None:
        return integer(f"{name}: {legacy_key!r}", cfg[legacy_key], 1)
    rates = cfg.get("compress_rates")
    if rates is None:
        return default
    if not isinstance(rates, dict):
        raise ValueError(f"{name}: 'compress_rates' must be a JSON object, got {type(rates).__name__}")
    if rates.get(layer_type) is None:
        raise ValueError(f"{name}: missing 'compress_rates'[{layer_type!r}] (model_type {V4_MODEL_TYPE!r})")
    return integer(f"{name}: 'compress_rates'[{layer_type!r}]", rates[layer_type], 1)


def _v4_layer_types(cfg: dict, num_layers: int, mtp_layers: int, csa_ratio: int, hca_ratio: int,
                    name: str) -> Tuple[str, ...]:
    """The layer types of a DeepSeek-V4 config: ``layer_types`` (HF's names, V4_HF_LAYER_TYPES), else the
    published checkpoints' ``compress_ratios`` (per layer 0: window-only, csa_ratio: CSA, hca_ratio: HCA). Either
    lists num_hidden_layers entries, or num_nextn_predict_layers more (the published Flash config.json ends with
    its MTP layer's 0): those are left out, as HF leaves them out, and MTP layers are planned as window-only."""
    key = "layer_types" if cfg.get("layer_types") is not None else "compress_ratios"
    kinds = cfg.get(key)
    if kinds is None:
        # HF's fallback schedule (3 HCA layers, then CSA / HCA in turn) is neither released model's.
        raise ValueError(f"{name}: missing 'layer_types' (or 'compress_ratios') (model_type {V4_MODEL_TYPE!r})")
    lengths = sorted({num_layers, num_layers + mtp_layers})
    if not isinstance(kinds, list) or len(kinds) not in lengths:
        got = f"{len(kinds)} entries" if isinstance(kinds, list) else f"a {type(kinds).__name__}"
        raise ValueError(f"{name}: {key!r} must list {' or '.join(map(str, lengths))} layers (num_hidden_layers "
                         f"{num_layers}, num_nextn_predict_layers {mtp_layers}), got {got}")
    if key == "layer_types":
        known, allowed = V4_HF_LAYER_TYPES, ", ".join(V4_HF_LAYER_TYPES)
    else:
        if csa_ratio == hca_ratio:
            raise ValueError(f"{name}: 'compress_ratios' cannot tell CSA from HCA layers: both compress "
                             f"{csa_ratio} tokens an entry")
        known = {0: "window", csa_ratio: "csa", hca_ratio: "hca"}
        allowed = f"0 (window-only), {csa_ratio} (CSA), {hca_ratio} (HCA)"
    types = []
    for layer, kind in enumerate(kinds[:num_layers]):
        if key == "compress_ratios":
            integer(f"{name}: 'compress_ratios'[{layer}]", kind, 0)
        if not isinstance(kind, (str, int)) or kind not in known:
            raise ValueError(f"{name}: {key!r}[{layer}]: {kind!r} is not one of {allowed}")
        types.append(known[kind])
    return tuple(types)


def model_from_hf_config(config: dict, name: str = "config.json") -> Model:
    """A model from an HF config dict: MLA or DeepSeek-V4 by model_type, else GQA when it has
    num_key_value_heads.

    Multimodal configs are read through their ``text_config``. Every size read must be an integer
    (layer and head counts >= 1), else a ValueError/TypeError names ``name`` and the key. A DSA model
    (model_type deepseek_v32, glm_moe_dsa) also needs index_n_heads, index_head_dim and index_topk; its
    indexed layers are all of them unless the config lists them (see _indexed_layers). A DeepSeek-V4 model
    (deepseek_v4) needs those, sliding_window, head_dim and its layer types (see _v4_layer_types); its
    compression ratios default to HF's (see _v4_compress_rate).
    """
    if not isinstance(config, dict):
        raise TypeError(f"{name}: expected a dict (a JSON object), got {type(config).__name__}")
    cfg = config.get("text_config") or config
    if not isinstance(cfg, dict):
        raise ValueError(f"{name}: 'text_config' must be a JSON object, got {type(cfg).__name__}")
    model_type = cfg.get("model_type", config.get("model_type"))

    def need(key, minimum=1):
        if cfg.get(key) is None:
            raise ValueError(f"{name}: missing {key!r} (model_type {model_type!r})")
        return integer(f"{name}: {key!r}", cfg[key], minimum)

    def optional(key, default):
        return default if cfg.get(key) is None else integer(f"{name}: {key!r}", cfg[key], 0)

    mtp_layers = optional("num_nextn_predict_layers", 0)
    if model_type in MLA_MODEL_TYPES:
        indexer = {}
        if model_type in DSA_MODEL_TYPES:
            indexer = dict(index_n_heads=need("index_n_heads"), index_head_dim=need("index_head_dim"),
                           index_topk=need("index_topk"),
                           index_layers=_indexed_layers(cfg, need("num_hidden_layers"), name))
        sizes = dict(num_layers=need("num_hidden_layers"), num_heads=need("num_attention_heads"),
                     max_context=need("max_position_embeddings"), kv_lora_rank=need("kv_lora_rank"),
                     qk_rope_head_dim=need("qk_rope_head_dim", 0), num_mtp_layers=mtp_layers, **indexer)
        try:
            return MlaModel(name, **sizes)
        except ValueError as e:  # indexed layers that do not start at layer 0
            raise ValueError(f"{name}: {e}") from None
    if model_type == V4_MODEL_TYPE:  # before GQA: its config has num_key_value_heads (1, the K = V head)
        csa = _v4_compress_rate(cfg, "compressed_sparse_attention", "compress_rate_csa", V4Model.csa_ratio, name)
        hca = _v4_compress_rate(cfg, "heavily_compressed_attention", "compress_rate_hca", V4Model.hca_ratio, name)
        sizes = dict(num_heads=need("num_attention_heads"), max_context=need("max_position_embeddings"),
                     layer_types=_v4_layer_types(cfg, need("num_hidden_layers"), mtp_layers, csa, hca, name),
                     window=need("sliding_window"), csa_ratio=csa, hca_ratio=hca, head_dim=need("head_dim"),
                     index_n_heads=need("index_n_heads"), index_head_dim=need("index_head_dim"),
                     index_topk=need("index_topk"), num_mtp_layers=mtp_layers)
        try:
            return V4Model(name, **sizes)
        except ValueError as e:  # an HCA ratio that is not a multiple of the CSA one
            raise ValueError(f"{name}: 'compress_rates' (or 'compress_rate_csa' / 'compress_rate_hca'): {e}") from None
    if cfg.get("num_key_value_heads") is not None:
        head_dim = optional("head_dim", 0) or need("hidden_size") // need("num_attention_heads")
        return GqaModel(name, num_layers=need("num_hidden_layers"), num_kv_heads=need("num_key_value_heads"),
                        head_dim=head_dim, max_context=need("max_position_embeddings"), num_mtp_layers=mtp_layers)
    raise ValueError(f"{name}: model_type {model_type!r} is not MLA ({', '.join(MLA_MODEL_TYPES)}) "
                     f"or DeepSeek-V4 ({V4_MODEL_TYPE}) and has no num_key_value_heads")


def load_model(name_or_path: str) -> Model:
    """A preset by name (see MODELS), or a local HF config.json (the file or its directory)."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path: expected a preset name or a path, got {type(name_or_path).__name__}")
    name_or_path = os.fspath(name_or_path)
    if name_or_path in MODELS:
        return MODELS[name_or_path]
    path = name_or_path
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"model config {path}: not found (a model directory holds its config.json)")
    if not os.path.isfile(path):
        if os.sep in name_or_path or name_or_path.endswith(".json"):
            raise ValueError(f"model config {name_or_path}: no such file or directory")
        raise ValueError(f"model {name_or_path!r} is neither a preset ({', '.join(MODELS)}) "
                         "nor a config.json file or a directory holding one")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"model config {path}: not valid JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"model config {path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:  # e.g. no read permission
        raise ValueError(f"model config {path}: cannot be read ({e.strerror})") from None
    if not isinstance(config, dict):
        raise ValueError(f"model config {path}: expected a JSON object")
    return model_from_hf_config(config, name=path)


def gpu_mem_bytes(preset: str) -> int:
    """Nominal memory of a GPU preset (see GPU_MEM_GIB) in bytes."""
    if not isinstance(preset, str) or preset not in GPU_MEM_GIB:
        raise ValueError(f"gpu {preset!r} is not a preset ({', '.join(GPU_MEM_GIB)})")
    return int(GPU_MEM_GIB[preset] * GiB)


def current_gpu() -> Optional[Tuple[str, int]]:
    """(name, total memory in bytes) of the current CUDA device, or None without one."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return props.name, int(props.total_memory)


@dataclass(frozen=True)
class LayoutPlan:
    """How one cache layout fits. Per-GPU sizes; max_tokens and session_len count all cp ranks."""

    layout: str
    bytes_per_token_per_layer: int
    num_cached_layers: int
    bytes_per_token: int
    bytes_per_block: int
    num_blocks: int
    max_tokens: int
    session_len: int
    truncated: bool
    # DSA: the index cache's part of bytes_per_token (INDEX_ROW_BYTES x indexed layers); 0 without DSA
    index_bytes_per_token: int = 0
    # DeepSeek-V4 only (see plan_v4): the fixed bytes of one sequence (window rings and compressor states) and
    # the tokens one block spans
    sequence_bytes: int = 0
    tokens_per_block: int = 0


@dataclass(frozen=True)
class MemoryPlan:
    """The inputs, the per-GPU memory split and one LayoutPlan per layout (latent/expanded or kv;
    latent alone for a quantized kv_format)."""

    model: Model
    gpu_mem_bytes: int
    weight_bytes_per_gpu: int
    reserved_bytes: int
    free_bytes: int
    cache_bytes: int
    ratio: float
    block_size: int
    cache_dtype: str
    tp: int
    cp: int
    layouts: Dict[str, LayoutPlan]
    kv_format: Optional[str] = None

    def to_dict(self) -> dict:
        """JSON-ready: the inputs and memory split, the model, and one key per layout. ``kv_format``
        is there for a quantized plan only (without it: the unquantized cache of cache_dtype, the
        same dict as before kv_format existed)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("model", "layouts")}
        if self.kv_format is None:
            del out["kv_format"]
        out["model"] = dict(asdict(self.model), attention=self.model.attention)
        out.update({name: asdict(lp) for name, lp in self.layouts.items()})
        if self.model.attention == "v4":
            return out
        for name in self.layouts:  # the fields of V4's plans alone
            del out[name]["sequence_bytes"], out[name]["tokens_per_block"]
        if not _is_sparse(self.model):  # a model without DSA: the dict of before DSA existed
            for key in ("index_n_heads", "index_head_dim", "index_topk", "index_layers"):
                out["model"].pop(key, None)
            for name in self.layouts:
                del out[name]["index_bytes_per_token"]
        return out


def _is_sparse(model: Model) -> bool:
    return model.attention == "mla" and model.sparse


@dataclass(frozen=True)
class _PlanArguments:
    """The arguments every plan takes, checked, and the memory they leave for the cache on one GPU."""

    gpu: int
    reserved: int
    ratio: float
    block_size: int
    tp: int
    cp: int
    weights_per_gpu: int
    free: int      # the GPU's bytes less its weights and the reserve
    cache: int     # ratio x free


def _plan_arguments(gpu_mem_bytes, weight_bytes, reserved_bytes, ratio, block_size, tp, cp, cache_dtype,
                    count_mtp_layers) -> _PlanArguments:
    gpu = int(real("gpu_mem_bytes", gpu_mem_bytes, above=0))
    weights = int(real("weight_bytes", weight_bytes, at_least=0))
    reserved = int(real("reserved_bytes", reserved_bytes, at_least=0))
    ratio = real("ratio", ratio, above=0, at_most=1)  # a fraction of free memory
    block_size = integer("block_size", block_size, 1)
    tp = integer("tp", tp, 1)
    cp = integer("cp", cp, 1)
    if not isinstance(cache_dtype, str) or cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"cache_dtype: must be one of {', '.join(CACHE_DTYPES)}, got {cache_dtype!r}")
    if not isinstance(count_mtp_layers, bool):
        raise TypeError(f"count_mtp_layers: expected a bool, got {type(count_mtp_layers).__name__}")
    weights_per_gpu = weights // tp
    free = max(0, gpu - weights_per_gpu - reserved)
    return _PlanArguments(gpu, reserved, ratio, block_size, tp, cp, weights_per_gpu, free, int(free * ratio))


def _memory_plan(model: Model, a: _PlanArguments, cache_dtype: str, layouts: Dict[str, LayoutPlan],
                 kv_format: Optional[str]) -> MemoryPlan:
    return MemoryPlan(model=model, gpu_mem_bytes=a.gpu, weight_bytes_per_gpu=a.weights_per_gpu,
                      reserved_bytes=a.reserved, free_bytes=a.free, cache_bytes=a.cache, ratio=a.ratio,
                      block_size=a.block_size, cache_dtype=cache_dtype, tp=a.tp, cp=a.cp, layouts=layouts,
                      kv_format=kv_format)


def plan(model: Model, gpu_mem_bytes: float, weight_bytes: float, *, ratio: float = DEFAULT_RATIO,
         reserved_bytes: float = DEFAULT_RESERVED_BYTES, block_size: int = DEFAULT_BLOCK_SIZE,
         cache_dtype: str = "fp16", tp: int = 1, cp: int = 1, count_mtp_layers: bool = False,
         kv_format: Optional[str] = None) -> MemoryPlan:
    """Plans the KV cache of ``model`` on GPUs of ``gpu_mem_bytes`` each (see the module docstring).

    kv_format: None (the unquantized cache in cache_dtype) or a quantized latent format of
    mla_kv.layout.KV_FORMATS, planned for the latent layout alone.

    weight_bytes is the whole model's (each GPU holds weight_bytes / tp). When weights and reserved
    bytes exceed the GPU, free memory is 0 and no token fits. Byte counts and ratio are finite real
    numbers (Python or numpy), sizes ints; an error names the parameter.
    """
    if isinstance(model, V4Model):
        return plan_v4(model, gpu_mem_bytes, weight_bytes, ratio=ratio, reserved_bytes=reserved_bytes,
                       block_size=block_size, cache_dtype=cache_dtype, tp=tp, cp=cp,
                       count_mtp_layers=count_mtp_layers, kv_format=kv_format)
    if not isinstance(model, (MlaModel, GqaModel)):
        raise TypeError(f"model: expected an MlaModel, GqaModel or V4Model, got {type(model).__name__}")
    a = _plan_arguments(gpu_mem_bytes, weight_bytes, reserved_bytes, ratio, block_size, tp, cp, cache_dtype,
                        count_mtp_layers)
    block_size, tp, cp, cache = a.block_size, a.tp, a.cp, a.cache
    layout.check_kv_format(kv_format)

    per_layer = model.bytes_per_token_per_layer(CACHE_DTYPES[cache_dtype].itemsize, tp)
    block_per_layer = {name: layer_bytes * block_size for name, layer_bytes in per_layer.items()}
    if kv_format is not None:
        per_layer, block_per_layer = _quantized_latent(model, kv_format, cache_dtype, block_size)
    layers = model.num_layers + (model.num_mtp_layers if count_mtp_layers else 0)
    index_per_token = 0
    if _is_sparse(model):
        indexed = len(model.index_layers) + (model.num_mtp_layers if count_mtp_layers else 0)
        index_per_token = model.index_bytes_per_token_per_layer * indexed
    layouts = {}
    for name, layer_bytes in per_layer.items():
        per_token = layer_bytes * layers + index_per_token
        per_block = block_per_layer[name] * layers + index_per_token * block_size
        blocks = cache // per_block
        max_tokens = blocks * block_size * cp
        layouts[name] = LayoutPlan(
            layout=name, bytes_per_token_per_layer=layer_bytes, num_cached_layers=layers,
            bytes_per_token=per_token, bytes_per_block=per_block, num_blocks=blocks,
            max_tokens=max_tokens, session_len=min(max_tokens, model.max_context),
            truncated=max_tokens < model.max_context, index_bytes_per_token=index_per_token)
    return _memory_plan(model, a, cache_dtype, layouts, kv_format)


def v4_row_format(kv_format: Optional[str], cache_dtype: str) -> str:
    """The mla_kv.layout V4 row format of a plan: kv_format ("v4_fp8", "v4_mxfp8"), else the row in cache_dtype."""
    if kv_format is None:
        if cache_dtype not in ("fp16", "bf16"):
            raise ValueError(f"cache_dtype: a DeepSeek-V4 row is fp16 or bf16 (or kv_format v4_fp8 / v4_mxfp8), "
                             f"got {cache_dtype}")
        return cache_dtype
    if kv_format not in V4_KV_FORMATS:
        raise ValueError(f"kv_format: a DeepSeek-V4 cache is the row in cache_dtype (kv_format None), 'v4_fp8' or "
                         f"'v4_mxfp8', got {kv_format!r}")
    return kv_format


@dataclass(frozen=True)
class V4LayerBytes:
    """One DeepSeek-V4 layer's cache in a row format, with pages of block_size rows (see V4Model)."""

    layer_type: str
    window_bytes: int          # per sequence: the ring of the last `window` rows, in whole pages
    ratio: int                 # tokens per compressed entry (0: window-only)
    page_bytes: int            # a page of block_size compressed entries (0: window-only)
    index_page_bytes: int      # a page of block_size index keys (CSA; else 0)
    state_bytes: int           # per sequence: the compressor state


def v4_layer_bytes(model: V4Model, layer_type: str, kv_format: Optional[str] = None, cache_dtype: str = "bf16",
                   block_size: int = DEFAULT_BLOCK_SIZE) -> V4LayerBytes:
    """The bytes of one V4 layer of ``layer_type`` (V4_LAYER_TYPES): what is fixed per sequence and what a page of
    compressed entries takes. Pages are mla_kv.layout.v4_page_bytes (v4_fp8 / v4_mxfp8 pages padded to 576 / 512)."""
    if not isinstance(model, V4Model):
        raise TypeError(f"model: expected a V4Model, got {type(model).__name__}")
    if layer_type not in V4_LAYER_TYPES:
        raise ValueError(f"layer_type: one of {', '.join(V4_LAYER_TYPES)}, got {layer_type!r}")
    block_size = integer("block_size", block_size, 1)
    row_format = v4_row_format(kv_format, cache_dtype)
    page = layout.v4_page_bytes(block_size, row_format)
    window = -(-model.window // block_size) * page
    state = model.compressor_state_bytes(layer_type)
    if layer_type == "window":
        return V4LayerBytes(layer_type, window, 0, 0, 0, state)
    ratio = model.csa_ratio if layer_type == "csa" else model.hca_ratio
    index_page = block_size * layout.INDEX_ROW_BYTES if layer_type == "csa" else 0
    return V4LayerBytes(layer_type, window, ratio, page, index_page, state)


def plan_v4(model: V4Model, gpu_mem_bytes: float, weight_bytes: float, *, ratio: float = DEFAULT_RATIO,
            reserved_bytes: float = DEFAULT_RESERVED_BYTES, block_size: int = DEFAULT_BLOCK_SIZE,
            cache_dtype: str = "bf16", tp: int = 1, cp: int = 1, count_mtp_layers: bool = False,
            kv_format: Optional[str] = None) -> MemoryPlan:
    """plan() of a DeepSeek-V4 model: one layout, "latent" (its K = V rows), sized for the longest sequence.

    A V4 cache grows by compressed entries, a fraction of a row per token, and holds per sequence a fixed part
    (window rings, compressor states: ``sequence_bytes``). A block here spans ``tokens_per_block`` = block_size x
    hca_ratio tokens: one page of block_size entries in each HCA layer, hca_ratio / csa_ratio pages of entries and
    of index keys in each CSA layer. num_blocks = (cache - sequence_bytes) // bytes_per_block, max_tokens =
    num_blocks x tokens_per_block x cp (each cp rank keeps a sequence's fixed part). bytes_per_token(_per_layer)
    are a block's bytes over its tokens (and cached layers), rounded up: an HCA entry is 584 / 128 B a token.
    Counted MTP layers are planned as window-only layers. The cache has one K = V head: every tp rank keeps all of
    it (tp must divide the heads). kv_format: None (rows in cache_dtype, fp16 or bf16), "v4_fp8" or "v4_mxfp8".
    """
    a = _plan_arguments(gpu_mem_bytes, weight_bytes, reserved_bytes, ratio, block_size, tp, cp, cache_dtype,
                        count_mtp_layers)
    block_size, tp, cp, cache = a.block_size, a.tp, a.cp, a.cache
    if model.num_heads % tp:
        raise ValueError(f"tp: {tp} does not divide {model.name}'s {model.num_heads} attention heads")

    types = list(model.layer_types) + (["window"] * model.num_mtp_layers if count_mtp_layers else [])
    per_layer = [v4_layer_bytes(model, kind, kv_format, cache_dtype, block_size) for kind in types]
    tokens_per_block = block_size * model.hca_ratio
    sequence = sum(lb.window_bytes + lb.state_bytes for lb in per_layer)
    index_per_block = per_block = 0
    for lb in per_layer:
        if lb.ratio:
            pages = model.hca_ratio // lb.ratio
            per_block += pages * (lb.page_bytes + lb.index_page_bytes)
            index_per_block += pages * lb.index_page_bytes

    blocks = max(0, cache - sequence) // per_block
    max_tokens = blocks * tokens_per_block * cp
    per_token = -(-per_block // tokens_per_block)
    latent = LayoutPlan(
        layout="latent", bytes_per_token_per_layer=-(-per_block // (tokens_per_block * len(types))),
        num_cached_layers=len(types), bytes_per_token=per_token, bytes_per_block=per_block, num_blocks=blocks,
        max_tokens=max_tokens, session_len=min(max_tokens, model.max_context), truncated=max_tokens < model.max_context,
        index_bytes_per_token=-(-index_per_block // tokens_per_block), sequence_bytes=sequence,
        tokens_per_block=tokens_per_block)
    return _memory_plan(model, a, cache_dtype, {"latent": latent}, kv_format)


def _quantized_latent(model: Model, kv_format: str, cache_dtype: str, block_size: int) -> Tuple[dict, dict]:
    """({"latent": bytes per token per layer}, {"latent": bytes per block per layer}) of a quantized
    format, from mla_kv.layout (int8 / int4: the per-token scale and zero of the trailer included)."""
    if model.attention != "mla":
        raise ValueError(f"kv_format: {kv_format!r} is a format of the MLA latent row; {model.name} is a "
                         f"{model.attention.upper()} model (unquantized cache only)")
    if (model.kv_lora_rank, model.qk_rope_head_dim) != (LATENT_DIM, ROPE_DIM):
        raise ValueError(f"kv_format: {kv_format!r} is laid out for rows of {LATENT_DIM} + {ROPE_DIM} values; "
                         f"{model.name} has {model.kv_lora_rank} + {model.qk_rope_head_dim} (unquantized cache only)")
    if kv_format in layout.TRAILER_FORMATS and cache_dtype not in ("fp16", "bf16"):
        raise ValueError(f"cache_dtype: {kv_format} keeps its per-token scale and zero in fp16 or bf16, "
                         f"got {cache_dtype}")
    dtype = CACHE_DTYPES[cache_dtype]
    return ({"latent": layout.bytes_per_token(kv_format, dtype)},
            {"latent": layout.block_bytes(kv_format, block_size, dtype)})


def plan_kv_formats(model: Model, gpu_mem_bytes: float, weight_bytes: float, **kwargs) -> Tuple[MemoryPlan, ...]:
    """One plan per format of mla_kv.layout.KV_FORMATS (None first), with plan()'s other arguments."""
    if "kv_format" in kwargs:
        raise TypeError("plan_kv_formats: plans every kv_format; do not pass one")
    formats = V4_KV_FORMATS if isinstance(model, V4Model) else layout.KV_FORMATS
    return tuple(plan(model, gpu_mem_bytes, weight_bytes, kv_format=f, **kwargs) for f in formats)


def format_label(result: MemoryPlan) -> str:
    """The name of a plan's cache format in tables: the kv_format, or the cache dtype when unquantized."""
    return result.kv_format or result.cache_dtype


def _header(result: MemoryPlan, gpu_label: str, cache: str) -> list:
    """The lines above a plan's table: model, GPU, memory per GPU and the ``cache`` line's text."""
    m = result.model
    heads = f"{m.num_heads} heads" if m.attention != "gqa" else f"{m.num_kv_heads} KV heads x {m.head_dim}"
    first = next(iter(result.layouts.values()))
    layers = first.num_cached_layers
    attention = m.attention.upper() + (" + DSA" if _is_sparse(m) else "")
    if m.attention == "v4":
        attention = "DeepSeek-V4 (K = V rows of 512)"
    lines = [f"model        {m.name}: {attention}, {layers} cached layers, {heads}, max context {m.max_context:,}"]
    if m.attention == "v4":
        mtp = layers - m.num_layers
        lines += [
            f"layers       {m.count('window')} window-only, {m.count('csa')} CSA (1 entry per {m.csa_ratio} tokens "
            f"+ its index key), {m.count('hca')} HCA (1 per {m.hca_ratio})" + (f", {mtp} MTP as window-only" if mtp
                                                                                else ""),
            f"indexer      {m.index_n_heads} index heads x {m.index_head_dim}, top-k {m.index_topk:,}: "
            f"{first.index_bytes_per_token:,} B/token of index keys",
            f"per sequence {first.sequence_bytes / (1 << 20):.2f} MiB fixed: a {m.window}-token window ring in "
            "every layer and the compressor states (fp32)",
        ]
    elif _is_sparse(m):
        row = m.index_bytes_per_token_per_layer
        indexed = first.index_bytes_per_token // row
        shared = layers - indexed
        reuse = f" ({shared} reuse the previous one's top-k)" if shared else ""
        lines.append(f"indexer      {m.index_n_heads} index heads x {m.index_head_dim}, top-k {m.index_topk:,}, "
                     f"{indexed} indexed layers{reuse}: index cache {row} B/token/layer, "
                     f"{first.index_bytes_per_token:,} B/token in every layout")
    return lines + [
        f"GPU          {result.gpu_mem_bytes / GiB:.2f} GiB ({gpu_label}), tp {result.tp}, cp {result.cp}",
        f"memory/GPU   weights {result.weight_bytes_per_gpu / GB:.2f} GB, reserved "
        f"{result.reserved_bytes / GiB:.2f} GiB, free {result.free_bytes / GiB:.2f} GiB, "
        f"cache {result.ratio:g} x free = {result.cache_bytes / GiB:.2f} GiB",
        f"cache        {cache}, block size {result.block_size}",
        "",
    ]


def _table(first_column: str, named: Sequence[Tuple[str, LayoutPlan]]) -> list:
    """Aligned rows (name, B/token/layer, ..., session_len) of the layout plans, a header first. With an
    index cache (DSA), an ``index B/token`` column follows B/token/layer, and B/token includes it."""
    index = any(lp.index_bytes_per_token for _, lp in named)
    header = (first_column, "B/token/layer", *(("index B/token",) if index else ()), "B/token", "B/block",
              "blocks", "max tokens", "session_len")
    rows = [header] + [
        (name, f"{lp.bytes_per_token_per_layer:,}", *((f"{lp.index_bytes_per_token:,}",) if index else ()),
         f"{lp.bytes_per_token:,}", f"{lp.bytes_per_block:,}", f"{lp.num_blocks:,}", f"{lp.max_tokens:,}",
         f"{lp.session_len:,}" + (" (truncated)" if lp.truncated else ""))
        for name, lp in named]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return ["  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:-1], widths[1:-1])] + [r[-1]])
            for r in rows]


def format_plan(result: MemoryPlan, gpu_label: str) -> str:
    """The table of a plan that ``mla-kv plan`` and ``mla-kv demo`` print; gpu_label names the GPU."""
    cache = result.cache_dtype
    if result.kv_format in layout.TRAILER_FORMATS:
        cache = f"{result.kv_format}, per-token scale and zero in {result.cache_dtype}"
    elif result.kv_format is not None:
        cache = result.kv_format
    lines = _header(result, gpu_label, cache)
    lines += _table("layout", [(lp.layout, lp) for lp in result.layouts.values()])
    if result.model.attention == "v4":
        lp = result.layouts["latent"]
        lines.append("")
        lines.append(f"one sequence: a block spans {lp.tokens_per_block:,} tokens; B/token is a block's bytes over "
                     f"them; the fixed {lp.sequence_bytes:,} B per sequence come off the cache first")
    elif "expanded" in result.layouts:
        latent, expanded = result.layouts["latent"], result.layouts["expanded"]
        lines.append("")
        lines.append(f"the latent layout stores {expanded.bytes_per_token // latent.bytes_per_token}x "
                     "fewer bytes per token than the expanded per-head layout")
    elif result.kv_format is not None:
        lines.append("")
        lines.append(f"the expanded per-head layout has no {result.kv_format} form here: it is planned "
                     "for the unquantized cache only")
    return "\n".join(lines)


def format_kv_formats(results: Sequence[MemoryPlan], gpu_label: str) -> str:
    """One table of the latent layout in several cache formats (plan_kv_formats' plans), a row each."""
    if not results:
        raise ValueError("results: no plans to format")
    first = results[0]
    unquantized = f"every format; {first.cache_dtype} for the unquantized rows"
    if first.model.attention != "v4":  # V4's formats have no trailer
        unquantized += " and int8/int4's scale and zero"
    lines = _header(first, gpu_label, unquantized)
    lines += _table("format", [(format_label(r), r.layouts["latent"]) for r in results])
    note = "the rows are the latent layout; the expanded per-head layout has no quantized form here"
    if first.model.attention == "v4":
        fixed = ", ".join(f"{format_label(r)} {r.layouts['latent'].sequence_bytes:,}" for r in results)
        note = f"DeepSeek-V4, one sequence; its fixed bytes (window rings, compressor states): {fixed}"
    for r in results:
        if "expanded" in r.layouts:
            lp = r.layouts["expanded"]
            note += (f" (in {format_label(r)}: {lp.bytes_per_token:,} B/token, {lp.max_tokens:,} max tokens"
                     + (", truncated)" if lp.truncated else ")"))
    return "\n".join(lines + ["", note])
