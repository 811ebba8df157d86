"""DeepSeek-V4's KV compressors (CSA and HCA), as HF transformers' DeepseekV4CSACompressor / HCACompressor compute
them (transformers 5.25, models/deepseek_v4/modeling_deepseek_v4.py); the indexer's own compressor is CSA's at
width 128.

The compressor's GEMMs (kv_proj, gate_proj) belong to the engine: these functions take their outputs.
Per token t: ``kv[t]`` and ``gate[t]`` hold ``series * width`` values, series 1 (HCA) or 2 (CSA). Windows are
``ratio`` tokens (``bias.shape[0]``; V4: CSA 4, HCA 128) starting at position 0. Entry w is::

    slots    HCA: the tokens of window w, series 0
             CSA: window w-1's tokens in series a = [:width] then window w's in series b = [width:]
                  (2 * ratio slots; entry 0 has window w's series b alone)
    logits   gate[slot] + bias[offset of the slot's token in its window, that series' columns]
    entry    rope(rms_norm(sum_slots softmax(logits over the slots, per column) * kv[slot]))

with RoPE (interleaved pairs, the trailing 64 values) at position ``w * ratio``. ``bias`` is HF's
``position_bias`` [ratio, series * width] and ``rms_weight`` its ``kv_norm.weight`` [width].

``cos_sin_cache`` [max_position, 64] is mla_kv.rope's table: row p = [cos (32) | sin (32)], times the variant's
attention factor. HF's rotary module returns cos and sin [.., 32] one per pair (it repeat_interleaves them):
``cat([cos, sin], -1)`` of ``rotary_emb(x, positions, layer_type="compress")`` is this table. V4's compress
layers use theta 160000 with YaRN factor 16 and attention_factor 1.

Precision: the math runs in float32 (float64 for float64 kv), softmax included, and entries come back in that
dtype. HF rounds the softmax weights to kv's dtype before the weighted sum and the normalized entry back to it;
for float32 kv both agree to float32 rounding.

Decode: a CompressorState per sequence holds the open window's projections (fp32, as they came, the bias not
yet added) and, for CSA, series a of the last closed window; ``compress_step`` takes one token and returns the
entry its window closes, or None. ``compress_prefill(..., state=...)`` continues a state over a chunk (HF's
cached path), so prefill, chunked prefill and token-by-token decode give the same entries.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .._checks import integer, real, tensor
from ._common import _acc_dtype
from .write import ROPE_DIM, apply_rope, rms_norm

CSA_RATIO = 4
HCA_RATIO = 128
# Series per token: CSA's entry w mixes two (a of window w-1, b of window w), HCA's one.
COMPRESSOR_SERIES = {"csa": 2, "hca": 1}


def _check_kind(kind) -> int:
    if kind not in COMPRESSOR_SERIES:
        raise ValueError(f"kind: must be one of {', '.join(COMPRESSOR_SERIES)}, got {kind!r}")
    return COMPRESSOR_SERIES[kind]


@dataclass
class CompressorState:
    """One sequence's compressor state between calls.

    open_kv / open_gate [ratio, series * width]: the projections of the open window's first ``open_tokens``
    tokens (rows past them are unused). prev_kv / prev_gate [ratio, width] (CSA; [0, width] for HCA): series a
    of the last closed window, the first half of the next entry's slots (``has_prev`` False before one closes).
    ``entries``: entries emitted so far; the next token's position is ``entries * ratio + open_tokens``.
    """

    kind: str
    ratio: int
    width: int
    open_kv: torch.Tensor
    open_gate: torch.Tensor
    prev_kv: torch.Tensor
    prev_gate: torch.Tensor
    open_tokens: int = 0
    has_prev: bool = False
    entries: int = 0

    @classmethod
    def empty(cls, kind: str, ratio: int, width: int, *, dtype: torch.dtype = torch.float32,
              device=None) -> "CompressorState":
        """The state of a sequence before its first token (dtype float32, or float64 for a float64 reference)."""
        series = _check_kind(kind)
        ratio = integer("ratio", ratio, 1)
        width = integer("width", width, ROPE_DIM)
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"dtype: the state is kept in float32 (or float64), got {dtype}")
        def zeros(rows: int, cols: int) -> torch.Tensor:
            return torch.zeros(rows, cols, dtype=dtype, device=device)
        previous_rows = ratio if series == 2 else 0     # HCA's windows do not overlap: nothing carries over
        return cls(kind, ratio, width, zeros(ratio, series * width), zeros(ratio, series * width),
                   zeros(previous_rows, width), zeros(previous_rows, width))

    @property
    def next_position(self) -> int:
        return self.entries * self.ratio + self.open_tokens


def _check_inputs(kind, kv, gate, bias, rms_weight, eps, cos_sin_cache, state: Optional[CompressorState]):
    """(series, ratio, width, eps) after checking every argument; errors name the argument."""
    series = _check_kind(kind)
    tensor("bias", bias, dims=2)
    if bias.shape[0] < 1 or bias.shape[1] % series or bias.shape[1] // series < ROPE_DIM:
        raise ValueError(f"bias: expected [ratio, {series} * width] with width >= {ROPE_DIM} for {kind}, "
                         f"got shape {tuple(bias.shape)}")
    ratio, width = bias.shape[0], bias.shape[1] // series
    for name, t in (("kv", kv), ("gate", gate)):
        tensor(name, t, dims=2, last=series * width)
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a floating dtype, got {t.dtype}")
    if gate.shape != kv.shape:
        raise ValueError(f"gate: expected kv's shape {tuple(kv.shape)}, got {tuple(gate.shape)}")
    tensor("rms_weight", rms_weight, dims=1, last=width)
    eps = real("eps", eps, above=0)
    tensor("cos_sin_cache", cos_sin_cache, dims=2, last=ROPE_DIM)
    if state is not None:
        if not isinstance(state, CompressorState):
            raise TypeError(f"state: expected a CompressorState, got {type(state).__name__}")
        if (state.kind, state.ratio, state.width) != (kind, ratio, width):
            raise ValueError(f"state: holds a {state.kind} compressor of ratio {state.ratio}, width {state.width}; "
                             f"the call is {kind} of ratio {ratio}, width {width}")
    return series, ratio, width, eps


def _entries(series: int, width: int, kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor,
             prev_kv: Optional[torch.Tensor], prev_gate: Optional[torch.Tensor], first_entry: int,
             rms_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Entries first_entry, first_entry + 1, ... of the whole windows kv / gate [n, ratio, series * width]
    (accumulation dtype). prev_kv / prev_gate [ratio, width]: CSA's series a of the window before the first
    (None: there is none, the first entry has its own series b alone)."""
    n, ratio = kv.shape[0], kv.shape[1]
    logits = gate + bias.to(gate.dtype)
    if series == 2:
        a_kv, b_kv = kv[..., :width], kv[..., width:]
        a_logits, b_logits = logits[..., :width], logits[..., width:]
        if prev_kv is None:
            # No window before: its slots get weight 0, as HF's zero kv / -inf gate give.
            prev_kv = torch.zeros_like(a_kv[0])
            prev_gate = torch.full_like(a_logits[0], float("-inf"))
        else:
            prev_gate = prev_gate + bias[:, :width].to(gate.dtype)
        shifted_kv = torch.cat([prev_kv[None], a_kv[:-1]], dim=0)
        shifted_logits = torch.cat([prev_gate[None], a_logits[:-1]], dim=0)
        kv = torch.cat([shifted_kv, b_kv], dim=1)                   # [n, 2 * ratio, width]
        logits = torch.cat([shifted_logits, b_logits], dim=1)
    pooled = (torch.softmax(logits, dim=1) * kv).sum(dim=1)          # [n, width]
    normed = rms_norm(pooled, rms_weight, eps)
    positions = (torch.arange(n, device=kv.device) + first_entry) * ratio
    rope = apply_rope(normed[:, -ROPE_DIM:], positions, cos_sin_cache, "interleaved")
    return torch.cat([normed[:, :-ROPE_DIM], rope], dim=-1)


def compress_prefill(kind: str, kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, rms_weight: torch.Tensor,
                     eps: float, cos_sin_cache: torch.Tensor, *,
                     state: Optional[CompressorState] = None) -> torch.Tensor:
    """The entries of the windows that close within kv / gate [T, series * width] -> [n, width].

    state None: one sequence from position 0; entries T // ratio, the tokens of a partial last window dropped
    (HF's cache-less path). With a state: the tokens continue it (positions from state.next_position), the
    entries are those the chunk closes, and the state is updated in place (HF's cached path); the math then runs
    in the state's dtype.
    """
    series, ratio, width, eps = _check_inputs(kind, kv, gate, bias, rms_weight, eps, cos_sin_cache, state)
    acc = _acc_dtype(kv) if state is None else state.open_kv.dtype
    kv, gate = kv.to(acc), gate.to(acc)
    first_entry, prev_kv, prev_gate = 0, None, None
    if state is not None:
        kv = torch.cat([state.open_kv[:state.open_tokens], kv.to(state.open_kv.device)], dim=0)
        gate = torch.cat([state.open_gate[:state.open_tokens], gate.to(state.open_gate.device)], dim=0)
        first_entry = state.entries
        if state.has_prev:
            prev_kv, prev_gate = state.prev_kv, state.prev_gate
    n = kv.shape[0] // ratio
    last_position = (first_entry + n - 1) * ratio
    if n and last_position >= cos_sin_cache.shape[0]:
        raise ValueError(f"cos_sin_cache: {cos_sin_cache.shape[0]} positions; entry {first_entry + n - 1} is "
                         f"rotated at position {last_position}")
    windows_kv = kv[:n * ratio].reshape(n, ratio, kv.shape[1])
    windows_gate = gate[:n * ratio].reshape(n, ratio, gate.shape[1])
    entries = kv.new_zeros(0, width)
    if n:
        entries = _entries(series, width, windows_kv, windows_gate, bias, prev_kv, prev_gate, first_entry,
                           rms_weight, eps, cos_sin_cache.to(kv.device))
    if state is not None:
        rest = kv.shape[0] - n * ratio
        state.open_kv[:rest] = kv[n * ratio:]
        state.open_gate[:rest] = gate[n * ratio:]
        state.open_tokens = rest
        if n and series == 2:
            state.prev_kv.copy_(windows_kv[-1, :, :width])
            state.prev_gate.copy_(windows_gate[-1, :, :width])
            state.has_prev = True
        state.entries += n
    return entries


def compress_step(state: CompressorState, kv_t: torch.Tensor, gate_t: torch.Tensor, position: int,
                  bias: torch.Tensor, rms_weight: torch.Tensor, eps: float,
                  cos_sin_cache: torch.Tensor) -> Optional[torch.Tensor]:
    """One decode token: kv_t / gate_t [series * width] at ``position`` (must be state.next_position: tokens
    come in order) join the open window; returns the entry [width] when that window closes, else None."""
    if not isinstance(state, CompressorState):
        raise TypeError(f"state: expected a CompressorState, got {type(state).__name__}")
    columns = COMPRESSOR_SERIES[state.kind] * state.width
    tensor("kv_t", kv_t, dims=1, last=columns)
    tensor("gate_t", gate_t, dims=1, last=columns)
    position = integer("position", position, 0)
    if position != state.next_position:
        raise ValueError(f"position: the state expects position {state.next_position} next, got {position}")
    entries = compress_prefill(state.kind, kv_t[None], gate_t[None], bias, rms_weight, eps, cos_sin_cache,
                               state=state)
    return entries[0] if entries.shape[0] else None
