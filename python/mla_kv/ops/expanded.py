"""prefill_expanded: the expanded-route prefill, built from gather_kv, two GEMMs, an attention kernel and
merge_states; and expanded_attention, the own attention kernel it takes where torch has no flash kernel.

The q tokens of sequence b are its last q_len_b of kv_len_b positions. Its keys split into the cached
prefix [0, kv_len - q_len) and the new part [kv_len - q_len, kv_len). The new part is gathered (quantized
formats dequantized by gather_kv), up-projected to K = [c_kv W_UK^T | k_pe] and V = c_kv W_UV^T per head
(one GEMM each over all heads) and attended causally: there q_len == k_len, so the top-left and
bottom-right alignments of the mask coincide. The prefix is gathered and up-projected kv_chunk rows per
sequence at a time, attended without a mask (every prefix key precedes every query) and merged into the
running (out, lse) by merge_states. Sizes, chunk counts and the kernel's max_seqlen come from the host
ints max_q_len / max_kv_len / max_prefix_len, so nothing reads device data on the host.

On CUDA the attention is torch's flash kernel (torch.ops.aten._flash_attention_forward: sm80+, head
dims <= 256, the smaller of q/k's and v's zero-padded to the larger) where it runs; below sm80 it is
mla_kv's own expanded_attention kernel (Sm70 mma.m8n8k4 / Sm75 mma.m16n8k8, fp16, the head dims of
OWN_KERNEL_DIMS); else torch's memory-efficient (cutlass fMHA) kernel,
torch.ops.aten._efficient_attention_forward: sm50+, q/k head dim may differ from v's (multiples of 8).
All take packed sequences through cumulative lengths. bench/RESULTS.md has their speeds. On the CPU a
small float math attention takes their place and gather_kv runs its reference, so the CPU run checks the
same split, chunking and merging against the float64 spec (mla_kv.reference.prefill_expanded).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from .. import reference
from .._checks import integer, real
from .._compiled import _C
from ..gpus import LimitsSpec, c_limits, smem_limits as _smem_limits
from ..layout import LATENT_DIM, ROPE_DIM, ROW_DIM, BlockPointerCache
from ._common import (_DTYPES, _aligned, _capability, _check_arch, _check_attention_inputs, _kernel_arch,
                      _lse_dtype, _packed_batch, _result_tensor, _same_device, _size, _stream, _tensor,
                      _validate_table, traceable)
from .attention import merge_states
from .gather import gather_kv

# The memory-efficient kernel's mask types (custom_mask_type): none, and causal aligned top-left (query i
# sees keys <= i of its sequence). Bottom-right (2) is not needed: only the new part is masked, and there
# q_len == k_len.
_NO_MASK, _CAUSAL_TOP_LEFT = 0, 1
_ALIGN = 256  # bytes: every workspace part starts at a multiple (16-byte vectors, cuBLAS likes 256)


# --------------------------------------------------------------------------------- workspace
def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The running (out, lse) are merged in float32 (float64 for float64 inputs), not in the 16-bit dtype:
    rounding each merge to fp16/bf16 would add an error per chunk."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _prefix_bound(max_kv_len: int, max_prefix_len) -> int:
    """The host bound on a prefix: max_prefix_len, or max_kv_len - 1 (a sequence with a query has at most
    that many cached positions before it)."""
    return max_kv_len - 1 if max_prefix_len is None else integer("max_prefix_len", max_prefix_len, 0)


def _chunk_rows(prefix_bound: int, kv_chunk: int) -> int:
    """Prefix rows a sequence contributes to one chunk."""
    return min(kv_chunk, prefix_bound)


def _num_chunks(prefix_bound: int, kv_chunk: int) -> int:
    return -(-prefix_bound // kv_chunk)


def _workspace_parts(tokens, batch, heads, d_nope, d_v, prefix_bound, kv_chunk, dtype):
    """(name, shape, dtype) of each workspace part. The gathered rows and their up-projections serve the
    new part (at most `tokens` rows) and then each prefix chunk (at most batch x chunk rows) in turn.
    "k_nope_or_v" first receives the nope half of K (copied into k beside k_pe), then V. The float32
    states exist only with prefix chunks (whole prompts store the new part into out / lse)."""
    rows = max(tokens, batch * _chunk_rows(prefix_bound, kv_chunk))
    state, merged = _state_dtype(dtype), tokens if prefix_bound > 0 else 0
    return (("rows", (rows, ROW_DIM), dtype), ("k", (rows, heads, d_nope + ROPE_DIM), dtype),
            ("k_nope_or_v", (rows * heads * max(d_nope, d_v),), dtype),
            ("out_0", (merged, heads, d_v), state), ("out_1", (merged, heads, d_v), state),
            ("part_out", (merged, heads, d_v), state), ("lse_0", (merged, heads), state),
            ("lse_1", (merged, heads), state), ("part_lse", (merged, heads), state))


def _part_bytes(shape, dtype) -> int:
    return -(-math.prod(shape) * torch.empty((), dtype=dtype).element_size() // _ALIGN) * _ALIGN


def prefill_expanded_workspace_size(total_q_tokens: int, batch: int, num_heads: int, d_nope: int, d_v: int, *,
                                    max_kv_len: int, kv_chunk: int = 8192, max_prefix_len: Optional[int] = None,
                                    dtype: torch.dtype = torch.float16) -> int:
    """Bytes of ``workspace`` prefill_expanded needs: q's T, the batch, heads, head dims and dtype, and the
    same max_kv_len / kv_chunk / max_prefix_len as the call. Dominated by the up-projected keys and values
    of max(T, batch x min(kv_chunk, max_prefix_len)) rows: (d_nope + 64 + max(d_nope, d_v)) x heads values
    each, plus 576 for the gathered row; with prefix chunks also the float32 (out, lse) states of T rows."""
    sizes = [integer(name, v, minimum) for name, v, minimum in (
        ("total_q_tokens", total_q_tokens, 0), ("batch", batch, 1), ("num_heads", num_heads, 1),
        ("d_nope", d_nope, 1), ("d_v", d_v, 1))]
    bound = _prefix_bound(integer("max_kv_len", max_kv_len, 1), max_prefix_len)
    if dtype not in (*_DTYPES, torch.float64):
        raise TypeError(f"dtype: must be one of {', '.join(map(str, (*_DTYPES, torch.float64)))}, got {dtype}")
    return sum(_part_bytes(shape, dt) for _, shape, dt in
               _workspace_parts(*sizes, bound, integer("kv_chunk", kv_chunk, 1), dtype))


def _carve(workspace: torch.Tensor, parts) -> dict:
    views, offset = {}, 0
    for name, shape, dtype in parts:
        size = _part_bytes(shape, dtype)
        views[name] = workspace[offset:offset + size].view(dtype)[:math.prod(shape)].view(shape)
        offset += size
    return views


def _workspace(workspace, parts, device) -> dict:
    need = sum(_part_bytes(shape, dtype) for _, shape, dtype in parts)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.uint8, device=device)
    _tensor("workspace", workspace, dims=1, dtype=torch.uint8, contiguous=True)
    if workspace.numel() < need or workspace.device != device:
        raise ValueError(f"workspace: needs {need} bytes on {device} (prefill_expanded_workspace_size), got "
                         f"{workspace.numel()} on {workspace.device}")
    if workspace.data_ptr() % 16:
        raise ValueError("workspace: must be 16-byte aligned")
    return _carve(workspace, parts)


# --------------------------------------------------------------------------------- attention
@dataclass(frozen=True)
class _Tokens:
    """Where each of q's T rows sits, computed on the device: its sequence (clamped to B - 1 for rows past
    cu_q_lens[B]), its index within the sequence (0 for those rows), and whether it is a query (live)."""

    seq: torch.Tensor
    pos: torch.Tensor
    live: torch.Tensor


def _tokens(cu_q_lens: torch.Tensor, tokens: int, max_q_len: int) -> _Tokens:
    batch = cu_q_lens.shape[0] - 1
    index = torch.arange(tokens, dtype=torch.int32, device=cu_q_lens.device)
    seq = torch.searchsorted(cu_q_lens[1:], index, right=True)
    live = seq < batch
    seq = seq.clamp(max=batch - 1)
    # Clamped to the lse rows the kernel has: a q_len above max_q_len (not checked without validate)
    # then gives a wrong row, never an out-of-bounds read.
    pos = torch.where(live, index - cu_q_lens[seq], 0).clamp(max=max_q_len - 1).long()
    return _Tokens(seq, pos, live)


def _efficient_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, tokens: _Tokens):
    """torch's memory-efficient kernel over packed sequences -> (out [T, H, d_v] in q's dtype, lse [T, H]
    float32). Rows of sequences without keys, and rows past cu_q[B], are unspecified (the caller masks them).

    Assumptions about torch.ops.aten._efficient_attention_forward (torch 2.13: its schema and
    torch/_meta_registrations.py meta__efficient_attention_forward; the CUDA kernel is
    aten/src/ATen/native/transformers/cuda/attention.cu with the cutlass kernel_forward.h), to be
    confirmed by the GPU tests:
    - varlen takes batch 1: q [1, T, H, D], k [1, N, H, D], v [1, N, H, Dv]; cu_seqlens_q / cu_seqlens_k
      int32 [B + 1] on the device; max_seqlen_q / max_seqlen_k host ints (bounds, no sync); the output is
      [1, T, H, Dv], row t for q's row t.
    - with compute_log_sumexp=True the lse is float32 [B, H, ceil(max_seqlen_q / 32) * 32] (the meta
      function's shape; B = len(cu_seqlens_q) - 1), and entry [b, h, i] belongs to the i-th query of
      sequence b, i counted from cu_seqlens_q[b] (the kernel offsets its lse pointer by
      (b * H + h) * lse_dim + the query block's start within the sequence). Hence lse[T, H] =
      lse_padded[seq(t), :, t - cu_q[seq(t)]], which _Tokens supplies. Natural log, like mla_kv's lse.
    - custom_mask_type 0 = no mask, 1 = causal from the top left; scale= multiplies q.k.
    If the GPU tests fail on lse (or on out with a cached prefix, whose merge weights come from lse),
    this mapping is the first suspect.
    """
    out, lse_padded = torch.ops.aten._efficient_attention_forward(
        q[None], k[None], v[None], None, cu_q, cu_k, max_q, max_k, 0.0,
        _CAUSAL_TOP_LEFT if causal else _NO_MASK, True, scale=scale)[:2]
    return out[0], lse_padded[tokens.seq, :, tokens.pos]


def _flash_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, tokens: _Tokens):
    """torch's flash kernel over packed sequences, same arguments and results as _efficient_attention.
    Varlen takes [T, H, D] with one head dim for q, k and v (the output has q's), so the narrower side
    is zero-padded: zero columns change no score and give zero output columns, sliced off. Its lse is
    [H, T] (torch/_meta_registrations.py). causal: the new part, q_len == k_len."""
    del tokens
    d_v, width = v.shape[-1], max(q.shape[-1], v.shape[-1])
    pad = lambda t: t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))
    out, lse = torch.ops.aten._flash_attention_forward(pad(q), pad(k), pad(v), cu_q, cu_k, max_q, max_k, 0.0,
                                                       causal, False, scale=scale)[:2]
    return out[..., :d_v], lse.t()


_FLASH_MAX_DIM = 256
_ATTENTION_KERNELS = ("auto", "flash", "mla_kv", "mem_efficient")


def _attention_kernel(name, device, dtype, d_qk, d_v, arch):
    """attention_kernel -> the attention function. "auto": torch's flash kernel on sm80+ for head dims
    <= 256, else the own kernel (mla_kv: Sm70 / Sm75, fp16, OWN_KERNEL_DIMS), else torch's
    memory-efficient one."""
    if name not in _ATTENTION_KERNELS:
        raise ValueError(f"attention_kernel: one of {', '.join(map(repr, _ATTENTION_KERNELS))}, got {name!r}")
    if arch is not None and name not in ("auto", "mla_kv"):
        raise ValueError(f"arch: picks the variant of the mla_kv kernel; attention_kernel={name!r} has none")
    if device.type != "cuda":
        return _math_attention
    cc = "".join(map(str, torch.cuda.get_device_capability(device)))
    flash_ok = torch.cuda.get_device_capability(device) >= (8, 0) and max(d_qk, d_v) <= _FLASH_MAX_DIM
    own_ok = own_kernel_supported(device, dtype, d_qk, d_v)
    if name == "flash" and not flash_ok:
        raise ValueError(f"attention_kernel: flash needs sm80+ and head dims <= {_FLASH_MAX_DIM} "
                         f"(got {max(d_qk, d_v)} on sm{cc})")
    if name == "mla_kv" and not own_ok:
        raise ValueError(f"attention_kernel: the mla_kv kernel takes float16 at (d_qk, d_v) in {OWN_KERNEL_DIMS} "
                         f"on a GPU its sm70 / sm75 variants run on (got {dtype}, ({d_qk}, {d_v}) on sm{cc})")
    if name == "flash" or (name == "auto" and flash_ok and arch is None):
        return _flash_attention
    if name == "mla_kv" or (name == "auto" and own_ok):
        _own_kernel_tag(device, arch)  # a bad arch fails before anything runs

        def own(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, tokens: _Tokens):
            del max_k, tokens
            return expanded_attention(q, k, v, cu_q, cu_k, scale, causal=causal, max_q_len=max_q, arch=arch)
        return own
    return _efficient_attention


def _math_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, tokens: _Tokens):
    """The CPU stand-in for _efficient_attention, same arguments and results: one sequence at a time, in
    float32 (float64 for float64 q), out rounded to q's dtype as the kernel's is."""
    del max_q, max_k, tokens  # the loop reads the lengths themselves
    acc = _lse_dtype(q)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=acc)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=acc)
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cu_q) - 1):
        (q0, q1), (k0, k1) = cu_q[b:b + 2], cu_k[b:b + 2]
        if q1 == q0 or k1 == k0:
            continue
        scores = torch.einsum("nhd,lhd->hnl", q[q0:q1].to(acc), k[k0:k1].to(acc)) * scale
        if causal:
            scores = scores.masked_fill(torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).triu(1), float("-inf"))
        lse_b = torch.logsumexp(scores, -1)
        out[q0:q1] = torch.einsum("hnl,lhv->nhv", torch.exp(scores - lse_b[..., None]), v[k0:k1].to(acc))
        lse[q0:q1] = lse_b.transpose(0, 1)
    return out.to(q.dtype), lse


# ------------------------------------------------------------------ own expanded-form kernel
# The head dims (d_qk, d_v) the own kernel is built for: DeepSeek-V2/V3 and Kimi-K2, GLM-4.7-Flash, and
# a 64-wide nope half. Its tags: Sm70 (mma.m8n8k4) and Sm75 (mma.m16n8k8), fp16.
OWN_KERNEL_DIMS = ((192, 128), (256, 256), (128, 128))
_OWN_TAGS = ("sm70", "sm75")


def _own_tags_here(device: torch.device):
    """The own kernel's variants (_C.Arch) that run on ``device`` in this build, best first."""
    cc = _capability(device.index if device.index is not None else torch.cuda.current_device())
    return [getattr(_C.Arch, t) for t in reversed(_OWN_TAGS) if _C.resolve_arch(getattr(_C.Arch, t), cc) != _C.Arch.auto]


def _own_kernel_tag(device: torch.device, arch: Optional[str]):
    """The _C.Arch the own kernel takes on ``device``: ``arch`` (sm70 / sm75), or the best that runs
    there (Sm75 from Turing up, Sm70 on Volta)."""
    if arch is not None and arch not in _OWN_TAGS:
        raise ValueError(f"arch: the expanded-form kernel has the variants {', '.join(_OWN_TAGS)} (None: the "
                         f"GPU's best), got {arch!r}")
    if arch is not None:
        return _kernel_arch(device, torch.float16, arch)
    tags = _own_tags_here(device)
    return tags[0] if tags else _kernel_arch(device, torch.float16, "sm70")  # (raises: none runs here)


def own_kernel_supported(device: torch.device, dtype: torch.dtype, d_qk: int, d_v: int) -> bool:
    """Whether the own expanded-form kernel serves this call: fp16 at one of OWN_KERNEL_DIMS, on a GPU
    that runs one of its variants in this build."""
    if _C is None or device.type != "cuda" or dtype != torch.float16 or (d_qk, d_v) not in OWN_KERNEL_DIMS:
        return False
    return bool(_own_tags_here(device))


def _check_cu_lens(name: str, cu: torch.Tensor, rows: int, what: str) -> torch.Tensor:
    """Host check of packed lengths (device data: a sync): cu starts at 0, does not decrease and ends at
    most at `rows`. Returns the lengths (int64, on the CPU)."""
    cu = cu.cpu().long()
    if int(cu[0]) != 0 or bool((cu.diff() < 0).any()) or int(cu[-1]) > rows:
        raise ValueError(f"{name}: must start at 0, be non-decreasing and end at most at {what}'s {rows} rows, got "
                         f"{cu.tolist()[:8]}{' ...' if cu.numel() > 8 else ''}")
    return cu.diff()


@traceable
def expanded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q_lens: torch.Tensor,
                       cu_k_lens: torch.Tensor, softmax_scale: float, *, causal: bool = True, max_q_len: int,
                       out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
                       arch: Optional[str] = None, smem_limits: LimitsSpec = None,
                       validate: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Multi-head attention over packed sequences with per-head K and V (the expanded form) -> (out, lse).

    q [T, H, d_qk], k [N, H, d_qk], v [N, H, d_v]; sequence b owns q rows cu_q_lens[b] .. cu_q_lens[b + 1]
    and k / v rows cu_k_lens[b] .. cu_k_lens[b + 1] (int32 [B + 1]). causal: aligned bottom-right, query i
    of a sequence with n queries and m keys sees keys j <= m - n + i; else all of its sequence's keys.
    Returns out [T, H, d_v] in q's dtype and lse [T, H] float32 (natural log; float64 for float64 q); a
    query that sees no key gets 0 / -inf; rows past cu_q_lens[B] are not written. max_q_len: a host bound
    on every q_len (rows past it are not computed). ``validate=True`` checks the lengths on the host (a
    sync; always on the CPU): cu_q_lens / cu_k_lens start at 0, do not decrease, end within q's / k's rows,
    and every q_len is at most max_q_len; without it the lengths are trusted (unlike the cache ops, the
    kernel does not bound its rows by T and N: lengths past them read and write past q / k / v / out).
    On CUDA: fp16, (d_qk, d_v) in OWN_KERNEL_DIMS, head
    dims contiguous, strides multiples of 8 elements; ``arch`` "sm70" / "sm75" picks the variant (both
    run on any newer GPU), ``smem_limits`` plans the tiles of a smaller GPU (a class name of
    mla_kv.gpus.gpu_classes(), or byte limits). CPU tensors run the reference.
    Reference: mla_kv.reference.expanded_attention.
    """
    _check_arch(arch, _OWN_TAGS)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _tensor(name, t)
    on_cuda = q.device.type == "cuda"
    dtypes = (torch.float16,) if on_cuda else (*_DTYPES, torch.float64)
    _tensor("q", q, dims=3, dtypes=dtypes, last_contiguous=True)
    tokens, heads, d_qk = q.shape
    _tensor("k", k, dims=3, dtype=q.dtype, last_contiguous=True)
    _tensor("v", v, dims=3, dtype=q.dtype, last_contiguous=True)
    _size("k", k, 1, heads)
    _size("k", k, 2, d_qk)
    _size("v", v, 0, k.shape[0])
    _size("v", v, 1, heads)
    d_v = v.shape[2]
    softmax_scale = real("softmax_scale", softmax_scale, above=0)
    max_q_len = integer("max_q_len", max_q_len, 1)
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    _tensor("cu_q_lens", cu_q_lens, dims=1, dtype=torch.int32, contiguous=True)
    if cu_q_lens.shape[0] < 2:
        raise ValueError(f"cu_q_lens: expected [batch + 1] with batch >= 1, got shape {tuple(cu_q_lens.shape)}")
    batch = cu_q_lens.shape[0] - 1
    _tensor("cu_k_lens", cu_k_lens, dims=1, dtype=torch.int32, contiguous=True)
    _size("cu_k_lens", cu_k_lens, 0, batch + 1)
    device = _same_device(q=q, k=k, v=v, cu_q_lens=cu_q_lens, cu_k_lens=cu_k_lens)
    out = _result_tensor("out", out, (tokens, heads, d_v), q.dtype, device)
    lse = _result_tensor("lse", lse, (tokens, heads), _lse_dtype(q), device)
    limits = _smem_limits(smem_limits)
    if not isinstance(validate, bool):
        raise TypeError(f"validate: expected a bool, got {type(validate).__name__}")
    if validate or not on_cuda:
        q_lens = _check_cu_lens("cu_q_lens", cu_q_lens, tokens, "q")
        _check_cu_lens("cu_k_lens", cu_k_lens, k.shape[0], "k")
        if int(q_lens.max()) > max_q_len:
            b = int(q_lens.argmax())
            raise ValueError(f"max_q_len: sequence {b} has {int(q_lens[b])} queries, more than max_q_len = {max_q_len}")
    if not on_cuda:
        ref_out, ref_lse = reference.expanded_attention(q, k, v, cu_q_lens, cu_k_lens, softmax_scale, causal=causal)
        rows = int(cu_q_lens[-1])
        out[:rows].copy_(ref_out[:rows])
        lse[:rows].copy_(ref_lse[:rows])
        return out, lse
    if (d_qk, d_v) not in OWN_KERNEL_DIMS:
        name = "q" if d_qk not in {d for d, _ in OWN_KERNEL_DIMS} else "v"
        raise ValueError(f"{name}: the expanded-form kernel is built for (d_qk, d_v) in {OWN_KERNEL_DIMS}, got "
                         f"({d_qk}, {d_v})")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        _aligned(name, t, 8)
    for name, n in (("cu_q_lens", batch), ("q", heads)):
        if n > 65535:
            raise ValueError(f"{name}: at most 65,535 {'sequences' if name == 'cu_q_lens' else 'heads'}, got {n}")
    tag = _own_kernel_tag(device, arch)
    tiles = _C.expanded_attention_tiles(tag, d_qk, d_v, c_limits(limits))
    if tiles.block_m == 0:
        raise ValueError(f"smem_limits: no {tag.name} expanded-form tile at head dims ({d_qk}, {d_v}) fits "
                         f"{limits if limits is not None else 'this GPU'}")
    if tokens == 0:
        return out, lse
    p = _C.ExpandedAttentionParams()
    p.dtype, p.batch, p.num_heads, p.head_dim_qk, p.head_dim_v = _C.DType.float16, batch, heads, d_qk, d_v
    p.max_q_len, p.cu_q_lens, p.cu_k_lens = max_q_len, cu_q_lens.data_ptr(), cu_k_lens.data_ptr()
    p.q, p.q_stride_t, p.q_stride_h = q.data_ptr(), q.stride(0), q.stride(1)
    p.k, p.k_stride_t, p.k_stride_h = k.data_ptr(), k.stride(0), k.stride(1)
    p.v, p.v_stride_t, p.v_stride_h = v.data_ptr(), v.stride(0), v.stride(1)
    p.out, p.out_stride_t, p.out_stride_h = out.data_ptr(), out.stride(0), out.stride(1)
    p.lse, p.lse_stride_t, p.lse_stride_h = lse.data_ptr(), lse.stride(0), lse.stride(1)
    p.softmax_scale, p.causal = softmax_scale, causal
    p.smem_limits = c_limits(limits)
    with torch.cuda.device(device):
        _C.expanded_attention(p, tag, _stream(device))
    return out, lse


# ------------------------------------------------------------------------------------ steps
def _up_project(rows, w_uk_t, w_uv_t, k, k_nope_or_v, d_nope, d_v):
    """Gathered rows [n, 576] -> K [n, H, d_nope + 64] (into k) and V [n, H, d_v] (a view of k_nope_or_v):
    one GEMM over all heads each, c_kv [n, 512] @ W [512, H x d]."""
    n, heads = rows.shape[0], k.shape[1]
    c_kv = rows[:, :LATENT_DIM]
    k_nope = k_nope_or_v[:n * heads * d_nope].view(n, heads * d_nope)
    torch.matmul(c_kv, w_uk_t, out=k_nope)
    k[:, :, :d_nope].copy_(k_nope.view(n, heads, d_nope))
    k[:, :, d_nope:].copy_(rows[:, None, LATENT_DIM:].expand(n, heads, ROPE_DIM))
    v = k_nope_or_v[:n * heads * d_v].view(n, heads * d_v)
    torch.matmul(c_kv, w_uv_t, out=v)  # after the copy above has read k_nope (stream order)
    return v.view(n, heads, d_v)


def _store_part(part_out, part_lse, sees, out, lse) -> None:
    """A part's attention into the state buffers: rows that see none of the part's keys (no keys for their
    sequence, or past cu_q_lens[B]) become out 0, lse -inf, whatever the kernel left there."""
    out.copy_(part_out).masked_fill_(~sees[:, None, None], 0)
    lse.copy_(part_lse).masked_fill_(~sees[:, None], float("-inf"))


def _validate_lengths(cu_q_lens, kv_lens, tokens, bounds, have, block_size, blocks) -> None:
    """Host checks of device data (validate=True, and always on the CPU): cu_q_lens, the host bounds
    (max_q_len, max_kv_len, prefix bound), q_len <= kv_len and table coverage."""
    q_lens, lens = _check_cu_lens("cu_q_lens", cu_q_lens, tokens, "q"), kv_lens.cpu().long()
    prefixes = torch.where(q_lens > 0, lens - q_lens, 0)
    for name, got, bound in zip(("max_q_len", "max_kv_len", "max_prefix_len"), (q_lens, lens, prefixes), bounds):
        over = (got > bound).nonzero()
        if over.numel():
            b = int(over[0])
            raise ValueError(f"{name}: sequence {b} needs {int(got[b])}, more than {name} = {bound}")
    _validate_table("cache.cu_block_nums" if blocks else "block_table", "kv_lens", kv_lens, q_lens, have,
                    block_size)


# --------------------------------------------------------------------------------------- op
@traceable
def prefill_expanded(q: torch.Tensor, kv_cache: Union[torch.Tensor, BlockPointerCache],
                     block_table: Optional[torch.Tensor], cu_q_lens: torch.Tensor, kv_lens: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, softmax_scale: float, *,
                     causal: bool = True, max_q_len: int, max_kv_len: int, max_prefix_len: Optional[int] = None,
                     kv_chunk: int = 8192, kv_format: Optional[str] = None, kv_scale: Optional[float] = None,
                     out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
                     workspace: Optional[torch.Tensor] = None, validate: bool = False,
                     attention_kernel: str = "auto",
                     arch: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Expanded-route prefill / extend attention over the latent cache -> (out [T, H, d_v], lse [T, H]).

    q [T, H, d_nope + 64] = [q_nope | q_pe] per head (fp16 or bf16 on CUDA), packed by cu_q_lens int32
    [B + 1]; kv_lens int32 [B] include the new tokens, already in the cache; cache arguments (a paged
    kv_cache with block_table, quantized with kv_format / kv_scale, or a BlockPointerCache) as in prefill;
    w_uk [H, d_nope, 512], w_uv [H, d_v, 512] in q's dtype (weights.split_kv_b_proj; keep them contiguous,
    else every call copies them; d_nope and d_v multiples of 8 on CUDA). max_q_len / max_kv_len: host
    bounds on every q_len / kv_len (the chunk count and the kernel's max_seqlen come from them; a length
    above its bound gives an unspecified
    result, checked with ``validate=True``). max_prefix_len: a host bound on kv_len - q_len over the
    sequences with queries (default max_kv_len - 1; 0 for whole prompts skips the prefix chunks).
    kv_chunk: prefix rows per sequence up-projected at a time. attention_kernel: "auto" (torch's flash
    kernel on sm80+ for head dims <= 256, else mla_kv's own expanded_attention kernel where it serves the
    call: fp16 at OWN_KERNEL_DIMS, else torch's memory-efficient kernel), "flash", "mla_kv" or
    "mem_efficient"; ``arch`` ("sm70" / "sm75") runs that variant of the own kernel, on any newer GPU.
    Returns out in q's dtype and lse float32 (float64 for float64 q); rows past cu_q_lens[B] and queries
    that see no key get out 0, lse -inf (as the reference). ``workspace``: uint8, at least
    prefill_expanded_workspace_size(...) bytes; without it one is allocated per call. With out, lse and
    workspace given the op reads nothing back to the host; the attention kernel's outputs and small
    index vectors still come from torch's caching allocator (in a CUDA graph capture: its private pool).
    CPU tensors run the same chunked algorithm with a math attention and always validate.
    Reference: mla_kv.reference.prefill_expanded (over the dequantized rows for a quantized cache).
    """
    _check_arch(arch, _OWN_TAGS)
    _tensor("q", q)
    on_cuda = q.device.type == "cuda"
    dtypes = (torch.float16, torch.bfloat16) if on_cuda else (*_DTYPES, torch.float64)
    _tensor("q", q, dims=3, dtypes=dtypes, last_contiguous=True)
    tokens, heads, d_qk = q.shape
    for name, w in (("w_uk", w_uk), ("w_uv", w_uv)):
        _tensor(name, w, dims=3, dtype=q.dtype)
        _size(name, w, 0, heads)
        _size(name, w, 2, LATENT_DIM)
    d_nope, d_v = w_uk.shape[1], w_uv.shape[1]
    if d_qk != d_nope + ROPE_DIM:
        raise ValueError(f"q: the last dim must be d_nope + {ROPE_DIM} = {d_nope + ROPE_DIM} (w_uk's d_nope "
                         f"{d_nope}), got {d_qk}")
    if on_cuda:
        for name, d in (("w_uk", d_nope), ("w_uv", d_v)):
            if d % 8:
                raise ValueError(f"{name}: its head dim (dim 1) must be a multiple of 8 on CUDA (the attention "
                                 f"kernel reads 16-byte vectors), got {d}")
    softmax_scale = real("softmax_scale", softmax_scale, above=0)
    max_q_len, max_kv_len, kv_chunk = (integer(name, v, 1) for name, v in (
        ("max_q_len", max_q_len), ("max_kv_len", max_kv_len), ("kv_chunk", kv_chunk)))
    prefix_bound = _prefix_bound(max_kv_len, max_prefix_len)
    if not isinstance(validate, bool):
        raise TypeError(f"validate: expected a bool, got {type(validate).__name__}")
    batch = _packed_batch(causal, cu_q_lens, kv_lens)
    blocks = isinstance(kv_cache, BlockPointerCache)
    device, source = _check_attention_inputs(q, kv_cache, block_table, batch, dict(
        q=q, cu_q_lens=cu_q_lens, kv_lens=kv_lens, w_uk=w_uk, w_uv=w_uv, kv_cache=None if blocks else kv_cache,
        block_table=None if blocks else block_table), kv_format, kv_scale)
    if blocks and not on_cuda:
        raise ValueError("cache: block-pointer ops run on CUDA tensors only")
    out = _result_tensor("out", out, (tokens, heads, d_v), q.dtype, device)
    lse = _result_tensor("lse", lse, (tokens, heads), _lse_dtype(q), device)
    if validate or not on_cuda:
        have = (kv_cache.cu_block_nums.diff() if blocks else torch.full((batch,), block_table.shape[1]))
        _validate_lengths(cu_q_lens, kv_lens, tokens, (max_q_len, max_kv_len, prefix_bound), have,
                          source.block_size, blocks)
    attend = _attention_kernel(attention_kernel, device, q.dtype, d_qk, d_v, arch)
    ws = _workspace(workspace, _workspace_parts(tokens, batch, heads, d_nope, d_v, prefix_bound, kv_chunk, q.dtype),
                    device)
    if tokens == 0:
        return out, lse

    w_uk_t, w_uv_t = w_uk.reshape(heads * d_nope, LATENT_DIM).t(), w_uv.reshape(heads * d_v, LATENT_DIM).t()
    gather_format = {} if blocks else dict(kv_format=source.kv_format, kv_scale=source.kv_scale,
                                           dtype=None if source.kv_format is None else q.dtype)
    at = _tokens(cu_q_lens, tokens, max_q_len)
    q_lens = cu_q_lens.diff()

    def keys(cu_k_lens, starts, rows):
        """Gathers positions starts[b] .. of each sequence (cu_k_lens row counts) into the first `rows`
        rows and up-projects them -> (K, V)."""
        gathered = gather_kv(kv_cache, block_table, cu_k_lens, starts=starts, out=ws["rows"][:rows], **gather_format)
        k = ws["k"][:rows]
        return k, _up_project(gathered, w_uk_t, w_uv_t, k, ws["k_nope_or_v"], d_nope, d_v)

    # New part: q_len rows from position kv_len - q_len; every query sees at least its own key. Without
    # prefix chunks (whole prompts) it is the answer: stored into out / lse directly, with no float32
    # state to merge into (the same values: the kernel's out is in q's dtype already).
    chunks = _num_chunks(prefix_bound, kv_chunk)
    k, v = keys(cu_q_lens, kv_lens - q_lens, tokens)
    new_part = attend(q, k, v, cu_q_lens, cu_q_lens, max_q_len, max_q_len, causal, softmax_scale, at)
    if chunks == 0:
        _store_part(*new_part, at.live, out, lse)
        return out, lse
    _store_part(*new_part, at.live, ws["out_0"], ws["lse_0"])

    # Cached prefix, in chunks of kv_chunk positions per sequence; a sequence without queries needs none.
    prefix_lens = torch.where(q_lens > 0, kv_lens - q_lens, 0).clamp(min=0)
    chunk_rows, state = _chunk_rows(prefix_bound, kv_chunk), 0
    cu_k_lens = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    for j in range(chunks):
        # Clamped to chunk_rows (= kv_chunk unless the bound is smaller), so that a prefix above its bound
        # (unchecked without validate) never makes the kernel read past the rows gathered.
        chunk_lens = (prefix_lens - j * kv_chunk).clamp(0, chunk_rows)
        torch.cumsum(chunk_lens, 0, dtype=torch.int32, out=cu_k_lens[1:])
        # An empty chunk starts at the prefix end, so its 0 rows stay inside the table's coverage.
        k, v = keys(cu_k_lens, prefix_lens.clamp(max=j * kv_chunk).int(), batch * chunk_rows)
        part = attend(q, k, v, cu_q_lens, cu_k_lens, max_q_len, chunk_rows, False, softmax_scale, at)
        _store_part(*part, at.live & (chunk_lens[at.seq] > 0), ws["part_out"], ws["part_lse"])
        merge_states(ws[f"out_{state}"], ws[f"lse_{state}"], ws["part_out"], ws["part_lse"],
                     out=ws[f"out_{1 - state}"], lse=ws[f"lse_{1 - state}"])
        state = 1 - state
    out.copy_(ws[f"out_{state}"])
    lse.copy_(ws[f"lse_{state}"])
    return out, lse
