"""The ops as torch.library custom ops, ``torch.ops.mla_kv.<name>``, for torch.compile and CUDA graphs.

``import mla_kv`` registers them (written and tested for torch 2.13; torch.library.custom_op came in 2.4).
REGISTERED lists what is registered: nothing on a torch without custom_op; on one whose custom_op refuses
an op, the ops before it, with a warning. Each op calls the Python function of the same name
(mla_kv.write_kv, mla_kv.decode, ...), which validates its arguments and runs the CUDA kernels on
CUDA tensors and the reference on CPU tensors: there is one implementation. torch.compile sees an
opaque op with a fake (meta) implementation that computes only the output shapes and dtypes, and
mutation annotations for what the op writes, so a model calling them compiles without graph breaks
(``fullgraph=True``) and the compiled graph can be captured in a CUDA graph. The functions themselves
trace the same way: while torch.compile traces ``mla_kv.decode(...)`` (or any function named here), the
call goes to its op with the arguments flattened as below (ops._common.traceable), so a model may call
either form; eager calls run the function as written.

The ops take the Python function's leading positional arguments; tensor arguments that the function
takes by keyword (q, readonly_lens, workspace, out, starts) are positional here, after them (a custom op takes
tensors positionally), and the other keywords stay keywords. The optional tensors an op writes (q of
the fused writes, workspace of the attention ops) have no default: pass None for "none". Torch before
2.13 cannot call an op that omits such an argument, nor one that passes None where None is the default
(the dispatcher drops it, then the version-counter bump indexes past the arguments: pytorch issue
176078), so a default would make the same call work on one torch and raise IndexError on another.
Schemas (``(a!)``: written in place)::

    write_kv(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, *, str? kv_format=None,
             float? kv_scale=None, bool validate=False, str? arch=None) -> ()
    fused_write_kv(Tensor kv_a, Tensor rms_weight, float eps, Tensor positions, Tensor cos_sin_cache,
                   Tensor(a!) kv_cache, Tensor slot_mapping, Tensor(b!)? q, *, str rope_style="interleaved",
                   str? kv_format=None, float? kv_scale=None, bool validate=False, str? arch=None) -> ()
    write_kv_blocks(Tensor kv_c, Tensor k_pe, Tensor(a!) block_ptrs, Tensor cu_block_nums,
                    SymInt block_seq_len, SymInt layer_offset_bytes, Tensor cu_q_lens, Tensor history_lens,
                    Tensor? readonly_lens=None, *, <cache keywords>, SymInt cp_size=1, SymInt cp_rank=0,
                    bool validate=False, str? arch=None) -> ()
    fused_write_kv_blocks(Tensor kv_a, Tensor rms_weight, float eps, Tensor positions, Tensor cos_sin_cache,
                          Tensor(a!) block_ptrs, Tensor cu_block_nums, SymInt block_seq_len,
                          SymInt layer_offset_bytes, Tensor cu_q_lens, Tensor history_lens, Tensor(b!)? q,
                          Tensor? readonly_lens=None, *, str rope_style="interleaved", <cache keywords>,
                          SymInt cp_size=1, SymInt cp_rank=0, bool validate=False, str? arch=None) -> ()
    write_index_keys(Tensor k, Tensor ln_weight, Tensor ln_bias, float eps, Tensor positions, Tensor cos_sin_cache,
                     Tensor(a!) index_cache, Tensor slot_mapping, Tensor(b!)? q, *, str rope_style="neox",
                     str? scale_fmt=None, bool validate=False, str? arch=None) -> ()
    write_index_keys_blocks(Tensor k, Tensor ln_weight, Tensor ln_bias, float eps, Tensor positions,
                            Tensor cos_sin_cache, Tensor(a!) block_ptrs, Tensor cu_block_nums, SymInt block_seq_len,
                            SymInt layer_offset_bytes, Tensor cu_q_lens, Tensor history_lens, Tensor(b!)? q,
                            Tensor? readonly_lens=None, *, str rope_style="neox", str? scale_fmt=None,
                            SymInt cp_size=1, SymInt cp_rank=0, bool validate=False, str? arch=None) -> ()
    decode(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, float softmax_scale,
           Tensor(a!)? workspace, *, <schedule keywords>, bool validate=False, str? arch=None,
           str? kv_format=None, float? kv_scale=None) -> (Tensor out, Tensor lse)
    decode_blocks(Tensor q, Tensor block_ptrs, Tensor cu_block_nums, SymInt block_seq_len,
                  SymInt layer_offset_bytes, Tensor seq_lens, float softmax_scale, Tensor(a!)? workspace, *,
                  <cache keywords>, <schedule keywords>, bool validate=False, str? arch=None) -> (Tensor, Tensor)
    prefill(Tensor q, Tensor kv_cache, Tensor block_table, Tensor cu_q_lens, Tensor kv_lens,
            float softmax_scale, Tensor(a!)? workspace, *, bool causal=True, <schedule keywords>,
            bool validate=False, str? arch=None, str? kv_format=None, float? kv_scale=None)
            -> (Tensor out, Tensor lse)
    prefill_blocks(Tensor q, Tensor block_ptrs, Tensor cu_block_nums, SymInt block_seq_len,
                   SymInt layer_offset_bytes, Tensor cu_q_lens, Tensor kv_lens, float softmax_scale,
                   Tensor(a!)? workspace, *, bool causal=True, <cache keywords>, <schedule keywords>,
                   bool validate=False, str? arch=None) -> (Tensor, Tensor)
    prefill_expanded(Tensor q, Tensor kv_cache, Tensor block_table, Tensor cu_q_lens, Tensor kv_lens,
                     Tensor w_uk, Tensor w_uv, float softmax_scale, Tensor(a!)? workspace, *, SymInt max_q_len,
                     SymInt max_kv_len, bool causal=True, SymInt? max_prefix_len=None, SymInt kv_chunk=8192,
                     str? kv_format=None, float? kv_scale=None, bool validate=False,
                     str attention_kernel="auto", str? arch=None) -> (Tensor out, Tensor lse)
    sparse_attention(Tensor q, Tensor kv_cache, Tensor indices, float softmax_scale, Tensor? topk_lens,
                     Tensor(a!)? workspace, *, <schedule keywords>, bool validate=False, str? arch=None,
                     str? kv_format=None, float? kv_scale=None) -> (Tensor out, Tensor lse)
    sparse_attention_blocks(Tensor q, Tensor block_ptrs, Tensor cu_block_nums, SymInt block_seq_len,
                            SymInt layer_offset_bytes, Tensor indices, Tensor cu_q_lens, float softmax_scale,
                            Tensor? topk_lens, Tensor(a!)? workspace, *, <cache keywords>, <schedule keywords>,
                            bool validate=False, str? arch=None) -> (Tensor, Tensor)
    merge_states(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) -> (Tensor out, Tensor lse)
    expanded_attention(Tensor q, Tensor k, Tensor v, Tensor cu_q_lens, Tensor cu_k_lens, float softmax_scale,
                       *, SymInt max_q_len, bool causal=True, str? arch=None, SymInt[]? smem_limits=None,
                       bool validate=False) -> (Tensor out, Tensor lse)
    gather_kv(Tensor kv_cache, Tensor block_table, Tensor cu_kv_lens, Tensor(a!) out, Tensor? starts=None, *,
              str? kv_format=None, float? kv_scale=None, bool validate=False, str? arch=None) -> ()
    gather_kv_blocks(Tensor block_ptrs, Tensor cu_block_nums, SymInt block_seq_len, SymInt layer_offset_bytes,
                     Tensor cu_kv_lens, Tensor(a!) out, Tensor? starts=None, *, <cache keywords>,
                     bool validate=False, str? arch=None) -> ()

    index_scores(Tensor q, Tensor weights, Tensor index_cache, Tensor block_table, Tensor kv_lens,
                 SymInt max_kv_len, Tensor? cu_q_lens, Tensor? q_scale, *, SymInt? max_q_len=None,
                 bool validate=False, str? arch=None) -> Tensor logits
    index_topk(Tensor logits, Tensor kv_lens, SymInt k, Tensor? cu_q_lens, Tensor? block_table,
               Tensor(a!)? workspace, *, SymInt? page_size=None, bool validate=False, str? arch=None)
               -> Tensor indices

    <cache keywords>    ScalarType? dtype=None, bool rope_first=True, SymInt? row_stride_bytes=None,
                        str? kv_format=None, float? kv_scale=None
    <schedule keywords> SymInt? num_splits=None, SymInt? tokens_per_split=None, SymInt[]? smem_limits=None,
                        str tile_loads="auto"

Arguments that are not tensors or scalars are flattened:

* A layout.BlockPointerCache becomes (block_ptrs, cu_block_nums, block_seq_len, layer_offset_bytes) in its
  place and the cache keywords dtype (default: the inputs' dtype: kv_c, kv_a, q or out), rope_first and
  row_stride_bytes; ``block_pointer_args(cache)`` and ``block_pointer_kwargs(cache)`` give both. The
  ``_blocks`` ops run on CUDA tensors only, like the functions.
* An AttentionSchedule becomes num_splits and tokens_per_split (both or neither; neither: the default
  schedule decode / prefill pick from the sizes, on the host, with no sync), smem_limits as
  [per_block, per_sm, reserved_per_block] bytes and tile_loads; ``schedule_kwargs(schedule)`` gives them.
  The workspace bytes follow from the sizes. Pass ``workspace`` (sized by attention_schedule()) to keep
  the op from allocating one.

What differs from the functions, and why:

* decode / prefill / prefill_expanded / merge_states / expanded_attention return new out and lse tensors and
  take no ``out`` / ``lse`` (index_scores a new logits tensor, no ``out``): a custom op may not return one of its inputs. Under a CUDA graph the results
  live in the graph's memory pool. prefill_expanded has no block-pointer op (call the function with a
  BlockPointerCache). expanded_attention takes ``smem_limits`` as [per_block, per_sm(, reserved_per_block)]
  bytes, not a class name.
* gather_kv / gather_kv_blocks require ``out`` [N >= total_kv, 576] and return nothing (read ``out``):
  without it the row count would be cu_kv_lens[-1], device data that a fake implementation cannot
  read (and that the function reads with a host sync).
* The block-pointer writes declare ``block_ptrs`` as written, although they leave its values alone: what
  they write is the memory the pointers address, which torch does not see. The annotation keeps a compiled
  graph from dropping a write (it returns nothing) and orders it before later ops that read the same
  block_ptrs tensor (decode_blocks, prefill_blocks, gather_kv_blocks), as kv_cache orders the paged ops.
  A compiled graph may pass the kernel a copy of block_ptrs: the same addresses.

``validate=True`` reads device data on the host (a sync): keep it out of CUDA graphs. Every op is tagged
needs_exact_strides where torch has the tag, so inductor passes the inputs with their eager strides.
"""
import inspect
import warnings
from typing import List, Optional, Tuple

import torch

from .._compiled import _C
from ..gpus import smem_limits as _smem_limits
from ..layout import LATENT_DIM, BlockPointerCache
from ..layout import IndexBlockPointerCache
from . import attention as _attention, expanded as _expanded, gather as _gather, write as _write
from . import index_keys as _index_keys
from . import indexer as _indexer
from .index_topk import index_topk as _index_topk  # the package binds its name to the function
from ._common import TRACED as _TRACED, _check_q, _lse_dtype, _result_tensor, _tensor

Tensor = torch.Tensor

__all__ = ["REGISTERED", "block_pointer_args", "block_pointer_kwargs", "schedule_kwargs"]


# ------------------------------------------------------------------------------ conversions
def block_pointer_args(cache: BlockPointerCache) -> tuple:
    """The positional arguments that stand for ``cache`` in the _blocks ops:
    (block_ptrs, cu_block_nums, block_seq_len, layer_offset_bytes)."""
    return cache.block_ptrs, cache.cu_block_nums, cache.block_seq_len, cache.layer_offset_bytes


def block_pointer_kwargs(cache: BlockPointerCache) -> dict:
    """The keyword arguments that complete ``cache`` in the _blocks ops: dtype, rope_first, row_stride_bytes,
    kv_format, kv_scale."""
    return dict(dtype=cache.dtype, rope_first=cache.rope_first, row_stride_bytes=cache.row_stride_bytes,
                kv_format=cache.kv_format, kv_scale=cache.kv_scale)


def schedule_kwargs(schedule: _attention.AttentionSchedule) -> dict:
    """The keyword arguments of decode / prefill that stand for ``schedule`` (an attention_schedule())."""
    limits = schedule.smem_limits
    return dict(num_splits=schedule.num_splits, tokens_per_split=schedule.tokens_per_split,
                smem_limits=None if limits is None else [limits.per_block, limits.per_sm, limits.reserved_per_block],
                tile_loads=schedule.tile_loads)


def _cache(like: Tensor, like_name: str, block_ptrs, cu_block_nums, block_seq_len, layer_offset_bytes, dtype,
           rope_first, row_stride_bytes, kv_format, kv_scale) -> BlockPointerCache:
    """The BlockPointerCache of flattened cache arguments; dtype None: ``like``'s."""
    if dtype is None:
        dtype = _tensor(like_name, like).dtype
    return BlockPointerCache(block_ptrs, cu_block_nums, block_seq_len, layer_offset_bytes, dtype, rope_first,
                             row_stride_bytes, kv_format, kv_scale)


def _schedule(q: Tensor, dims: int, num_splits, tokens_per_split, smem_limits,
              tile_loads) -> Optional[_attention.AttentionSchedule]:
    """The AttentionSchedule of the flattened schedule arguments (None: the op's default one)."""
    if num_splits is None and tokens_per_split is None:
        if smem_limits is not None or tile_loads != "auto":
            raise ValueError("smem_limits / tile_loads: belong to a schedule; pass num_splits and tokens_per_split "
                             "too (schedule_kwargs(attention_schedule(...)))")
        return None
    if num_splits is None or tokens_per_split is None:
        raise ValueError("num_splits / tokens_per_split: pass both (a schedule) or neither (the default schedule)")
    _check_q(q, dims)
    limits = _smem_limits(None if smem_limits is None else tuple(smem_limits))
    need = 0  # an invalid split count is reported by the op (on CUDA; the reference takes no schedule)
    if _C is not None and _C.attention_splits_valid(num_splits, tokens_per_split, 0):
        need = _C.attention_workspace_size(q.shape[:-2].numel(), q.shape[-2], num_splits)
    return _attention.AttentionSchedule(num_splits, tokens_per_split, need, None, limits, tile_loads)


# ---------------------------------------------------------------------------------- writes
def write_kv(kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor, *, kv_format: Optional[str] = None,
             kv_scale: Optional[float] = None, validate: bool = False, arch: Optional[str] = None) -> None:
    """mla_kv.write_kv."""
    _write.write_kv(kv_c, k_pe, kv_cache, slot_mapping, kv_format=kv_format, kv_scale=kv_scale, validate=validate,
                    arch=arch)


def fused_write_kv(kv_a: Tensor, rms_weight: Tensor, eps: float, positions: Tensor, cos_sin_cache: Tensor,
                   kv_cache: Tensor, slot_mapping: Tensor, q: Optional[Tensor], *,
                   rope_style: str = "interleaved", kv_format: Optional[str] = None, kv_scale: Optional[float] = None,
                   validate: bool = False, arch: Optional[str] = None) -> None:
    """mla_kv.fused_write_kv (q positional)."""
    _write.fused_write_kv(kv_a, rms_weight, eps, positions, cos_sin_cache, kv_cache, slot_mapping,
                          rope_style=rope_style, q=q, kv_format=kv_format, kv_scale=kv_scale, validate=validate,
                          arch=arch)


def write_kv_blocks(kv_c: Tensor, k_pe: Tensor, block_ptrs: Tensor, cu_block_nums: Tensor, block_seq_len: int,
                    layer_offset_bytes: int, cu_q_lens: Tensor, history_lens: Tensor,
                    readonly_lens: Optional[Tensor] = None, *, dtype: Optional[torch.dtype] = None,
                    rope_first: bool = True, row_stride_bytes: Optional[int] = None, kv_format: Optional[str] = None,
                    kv_scale: Optional[float] = None, cp_size: int = 1,
                    cp_rank: int = 0, validate: bool = False, arch: Optional[str] = None) -> None:
    """mla_kv.write_kv_blocks with the cache flattened (readonly_lens positional)."""
    cache = _cache(kv_c, "kv_c", block_ptrs, cu_block_nums, block_seq_len, layer_offset_bytes, dtype, rope_first,
                   row_stride_bytes, kv_format, kv_scale)
    _write.write_kv_blocks(kv_c, k_pe, cache, cu_q_lens, history_lens, readonly_lens=readonly_lens,
                           cp_size=cp_size, cp_rank=cp_rank, validate=validate, arch=arch)


def fused_write_kv_blocks(kv_a: Tensor, rms_weight: Tensor, eps: float, positions: Tensor, cos_sin_cache: Tensor,
                          block_ptrs: Tensor, cu_block_nums: Tensor, block_seq_len: int, layer_offset_bytes: int,
                          cu_q_lens: Tensor, history_lens: Tensor, q: Optional[Tensor],
                          readonly_lens: Optional[Tensor] = None, *, rope_style: str = "interleaved",
                          dtype: Optional[torch.dtype] = None, rope_first: bool = True,
                          row_stride_bytes: Optional[int] = None, kv_format: Optional[str] = None,
                          kv_scale: Optional[float] = None, cp_size: int = 1, cp_rank: int = 0,
                          validate: bool = False, arch: Optional[str] = None) -> None:
    """mla_kv.fused_write_kv_blocks with the cache flattened (q and readonly_lens positional)."""
    cache = _cache(kv_a, "kv_a", block_ptrs, cu_block_nums, block_seq_len, layer_offset_bytes, dtype, rope_first,
                   row_stride_bytes, kv_format, kv_scale)
    _write.fused_write_kv_blocks(kv_a, rms_weight, eps, positions, cos_sin_cache, cache, cu_q_lens, history_lens,
                                 rope_style=rope_style, q=q, readonly_lens=readonly_lens, cp_size=cp_size,
                                 cp_rank=cp_rank, validate=validate, arch=arch)


def write_index_keys(k: Tensor, ln_weight: Tensor, ln_bias: Tensor, eps: float, positions: Tensor,
                     cos_sin_cache: Tensor, index_cache: Tensor, slot_mapping: Tensor, q: Optional[Tensor], *,
                     rope_style: str = "neox", scale_fmt: Optional[str] = None, validate: bool = False,
                     arch: Optional[str] = None) -> None:
    """mla_kv.write_index_keys (q positional)."""
    _index_keys.write_index_keys(k, ln_weight, ln_bias, eps, positions, cos_sin_cache, index_cache, slot_mapping,
                                 rope_style=rope_style, scale_fmt=scale_fmt, q=q, validate=validate, arch=arch)


def write_index_keys_blocks(k: Tensor, ln_weight: Tensor, ln_bias: Tensor, eps: float, positions: Tensor,
                            cos_sin_cache: Tensor, block_ptrs: Tensor, cu_block_nums: Tensor, block_seq_len: int,
                            layer_offset_bytes: int, cu_q_lens: Tensor, history_lens: Tensor, q: Optional[Tensor],
                            readonly_lens: Optional[Tensor] = None, *, rope_style: str = "neox",
                            scale_fmt: Optional[str] = None, cp_size: int = 1, cp_rank: int = 0,
                            validate: bool = False, arch: Optional[str] = None) -> None:
    """mla_kv.write_index_keys_blocks with the IndexBlockPointerCache flattened (q and readonly_lens positional)."""
    cache = IndexBlockPointerCache(block_ptrs, cu_block_nums, block_seq_len, layer_offset_bytes)
    _index_keys.write_index_keys_blocks(k, ln_weight, ln_bias, eps, positions, cos_sin_cache, cache, cu_q_lens,
                                        history_lens, readonly_lens=readonly_lens, cp_size=cp_size, cp_rank=cp_rank,
                                        rope_style=rope_style, scale_fmt=scale_fmt, q=q, validate=validate, arch=arch)


# ------------------------------------------------------------------------------- attention
def decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, softmax_scale: float,
           workspace: Optional[Tensor], *, num_splits: Optional[int] = None,
           tokens_per_split: Optional[int] = None, smem_limits: Optional[List[int]] = None,
           tile_loads: str = "auto", validate: bool = False, arch: Optional[str] = None,
           kv_format: Optional[str] = None, kv_scale: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """mla_kv.decode -> (out, lse), with the schedule flattened."""
    schedule = _schedule(q, 4, num_splits, tokens_per_split, smem_limits, tile_loads)
    return _attention.decode(q, kv_cache, block_table, seq_lens, softmax_scale, workspace=workspace,
                             schedule=schedule, validate=validate, arch=arch, kv_format=kv_format,
                             kv_scale=kv_scale)


def decode_blocks(q: Tensor, block_ptrs: Tensor, cu_block_nums: Tensor, block_seq_len: int,
                  layer_offset_bytes: int, seq_lens: Tensor, softmax_scale: float,
                  workspace: Optional[Tensor], *, dtype: Optional[torch.dtype] = None,
                  rope_first: bool = True, row_stride_bytes: Optional[int] = None, kv_format: Optional[str] = None,
                    kv_scale: Optional[float] = None, num_splits: Optional[int] = None,
                  tokens_per_split: Optional[int] = None, smem_limits: Optional[List[int]] = None,
                  tile_loads: str = "auto", validate: bool = False,
                  arch: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """mla_kv.decode over a BlockPointerCache -> (out, lse), with the cache and the schedule flattened."""
    cache = _cache(q, "q", block_ptrs, cu_block_nums, block_seq_len, layer_offset_bytes, dtype, rope_first,
                   row_stride_bytes, kv_format, kv_scale)
    return decode(q, cache, None, seq_lens, softmax_scale, workspace, num_splits=num_splits,
                  tokens_per_split=tokens_per_split, smem_limits=smem_limits, tile_loads=tile_loads,
                  validate=validate, arch=arch)


def prefill(q: Tensor, kv_cache: Tensor, block_table: Tensor, cu_q_lens: Tensor, kv_lens: Tensor,
            softmax_scale: float, workspace: Optional[Tensor], *, causal: bool = True,
            num_splits: Optional[int] = None, tokens_per_split: Optional[int] = None,
            smem_limits: Optional[List[int]] = None, tile_loads: str = "auto", validate: bool = False,
            arch: Optional[str] = None, kv_format: Optional[str] = None,
            kv_scale: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """mla_kv.prefill -> (out, lse), with the schedule flattened. Rows of out / lse past cu_q_lens[B]
    are unspecified (the function leaves them untouched in its own fresh tensors)."""
    schedule = _schedule(q, 3, num_splits, tokens_per_split, smem_limits, tile_loads)
    return _attention.prefill(q, kv_cache, block_table, cu_q_lens, kv_lens, softmax_scale, causal=causal,
                              workspace=workspace, schedule=schedule, validate=validate, arch=arch,
                              kv_format=kv_format, kv_scale=kv_scale)


def prefill_blocks(q: Tensor, block_ptrs: Tensor, cu_block_nums: Tensor, block_seq_len: int,
                   layer_offset_bytes: int, cu_q_lens: Tensor, kv_lens: Tensor, softmax_scale: float,
                   workspace: Optional[Tensor], *, causal: bool = True, dtype: Optional[torch.dtype] = None,
                   rope_first: bool = True, row_stride_bytes: Optional[int] = None, kv_format: Optional[str] = None,
                    kv_scale: Optional[float] = None,
                   num_splits: Optional[int] = None, tokens_per_split: Optional[int] = None,
                   smem_limits: Optional[List[int]] = None, tile_loads: str = "auto", validate: bool = False,
                   arch: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """mla_kv.prefill over a BlockPointerCache -> (out, lse), with the cache and the schedule flattened."""
    cache = _cache(q, "q", block_ptrs, cu_block_nums, block_seq_len, layer_offset_bytes, dtype, rope_first,
                   row_stride_bytes, kv_format, kv_scale)
    return prefill(q, cache, None, cu_q_lens, kv_lens, softmax_scale, workspace, causal=causal,
                   num_splits=num_splits, tokens_per_split=tokens_per_split, smem_limits=smem_limits,
                   tile_loads=tile_loads, validate=validate, arch=arch)


def prefill_expanded(q: Tensor, kv_cache: Tensor, block_table: Tensor, cu_q_lens: Tensor, kv_lens: Tensor,
                     w_uk: Tensor, w_uv: Tensor, softmax_scale: float, workspace: Optional[Tensor], *,
                     max_q_len: int, max_kv_len: int, causal: bool = True, max_prefix_len: Optional[int] = None,
                     kv_chunk: int = 8192, kv_format: Optional[str] = None, kv_scale: Optional[float] = None,
                     validate: bool = False, attention_kernel: str = "auto",
                     arch: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """mla_kv.prefill_expanded over a paged cache -> (out, lse)."""
    return _expanded.prefill_expanded(q, kv_cache, block_table, cu_q_lens, kv_lens, w_uk, w_uv, softmax_scale,
                                      causal=causal, max_q_len=max_q_len, max_kv_len=max_kv_len,
                                      max_prefix_len=max_prefix_len, kv_chunk=kv_chunk, kv_format=kv_format,
                                      kv_scale=kv_scale, workspace=workspace, validate=validate,
                                      attention_kernel=attention_kernel, arch=arch)


def sparse_attention(q: Tensor, kv_cache: Tensor, indices: Tensor, softmax_scale: float, topk_lens: Optional[Tensor],
                     workspace: Optional[Tensor], *, num_splits: Optional[int] = None,
                     tokens_per_split: Optional[int] = None, smem_limits: Optional[List[int]] = None,
                     tile_loads: str = "auto", validate: bool = False, arch: Optional[str] = None,
                     kv_format: Optional[str] = None, kv_scale: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """mla_kv.sparse_attention -> (out, lse), with the schedule flattened."""
    schedule = _schedule(q, 3, num_splits, tokens_per_split, smem_limits, tile_loads)
    return _attention.sparse_attention(q, kv_cache, indices, softmax_scale, topk_lens=topk_lens, workspace=workspace,
                                       schedule=schedule, validate=validate, arch=arch, kv_format=kv_format,
                                       kv_scale=kv_scale)


def sparse_attention_blocks(q: Tensor, block_ptrs: Tensor, cu_block_nums: Tensor, block_seq_len: int,
                            layer_offset_bytes: int, indices: Tensor, cu_q_lens: Tensor, softmax_scale: float,
                            topk_lens: Optional[Tensor], workspace: Optional[Tensor], *,
                            dtype: Optional[torch.dtype] = None, rope_first: bool = True,
                            row_stride_bytes: Optional[int] = None, kv_format: Optional[str] = None,
                            kv_scale: Optional[float] = None, num_splits: Optional[int] = None,
                            tokens_per_split: Optional[int] = None, smem_limits: Optional[List[int]] = None,
                            tile_loads: str = "auto", validate: bool = False,
                            arch: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """mla_kv.sparse_attention over a BlockPointerCache -> (out, lse), cache and schedule flattened."""
    cache = _cache(q, "q", block_ptrs, cu_block_nums, block_seq_len, layer_offset_bytes, dtype, rope_first,
                   row_stride_bytes, kv_format, kv_scale)
    schedule = _schedule(q, 3, num_splits, tokens_per_split, smem_limits, tile_loads)
    return _attention.sparse_attention(q, cache, indices, softmax_scale, topk_lens=topk_lens, cu_q_lens=cu_q_lens,
                                       workspace=workspace, schedule=schedule, validate=validate, arch=arch)


def merge_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tuple[Tensor, Tensor]:
    """mla_kv.merge_states -> (out, lse)."""
    return _attention.merge_states(out_a, lse_a, out_b, lse_b)


def expanded_attention(q: Tensor, k: Tensor, v: Tensor, cu_q_lens: Tensor, cu_k_lens: Tensor, softmax_scale: float,
                       *, max_q_len: int, causal: bool = True, arch: Optional[str] = None,
                       smem_limits: Optional[List[int]] = None, validate: bool = False) -> Tuple[Tensor, Tensor]:
    """mla_kv.expanded_attention -> (out, lse), smem_limits as byte limits."""
    return _expanded.expanded_attention(q, k, v, cu_q_lens, cu_k_lens, softmax_scale, causal=causal,
                                        max_q_len=max_q_len, arch=arch, validate=validate,
                                        smem_limits=None if smem_limits is None else tuple(smem_limits))


# ---------------------------------------------------------------------------------- gather
def gather_kv(kv_cache: Tensor, block_table: Tensor, cu_kv_lens: Tensor, out: Tensor,
              starts: Optional[Tensor] = None, *, kv_format: Optional[str] = None, kv_scale: Optional[float] = None,
              validate: bool = False, arch: Optional[str] = None) -> None:
    """mla_kv.gather_kv into ``out`` (required: a fake cannot read cu_kv_lens[-1], the row count; a
    quantized cache's rows take out's dtype)."""
    _gather.gather_kv(kv_cache, block_table, cu_kv_lens, starts=starts, out=out, kv_format=kv_format,
                      kv_scale=kv_scale, validate=validate, arch=arch)


def gather_kv_blocks(block_ptrs: Tensor, cu_block_nums: Tensor, block_seq_len: int, layer_offset_bytes: int,
                     cu_kv_lens: Tensor, out: Tensor, starts: Optional[Tensor] = None, *,
                     dtype: Optional[torch.dtype] = None, rope_first: bool = True,
                     row_stride_bytes: Optional[int] = None, kv_format: Optional[str] = None,
                     kv_scale: Optional[float] = None, validate: bool = False, arch: Optional[str] = None) -> None:
    """mla_kv.gather_kv over a BlockPointerCache into ``out`` (required), with the cache flattened."""
    cache = _cache(out, "out", block_ptrs, cu_block_nums, block_seq_len, layer_offset_bytes, dtype, rope_first,
                   row_stride_bytes, kv_format, kv_scale)
    _gather.gather_kv(cache, None, cu_kv_lens, starts=starts, out=out, validate=validate, arch=arch)


# --------------------------------------------------------------------------------- indexer
def index_scores(q: Tensor, weights: Tensor, index_cache: Tensor, block_table: Tensor, kv_lens: Tensor,
                 max_kv_len: int, cu_q_lens: Optional[Tensor], q_scale: Optional[Tensor], *,
                 max_q_len: Optional[int] = None, validate: bool = False, arch: Optional[str] = None) -> Tensor:
    """mla_kv.index_scores -> logits [T, max_kv_len] (a new tensor)."""
    return _indexer.index_scores(q, weights, index_cache, block_table, kv_lens, max_kv_len, cu_q_lens=cu_q_lens,
                                      max_q_len=max_q_len, q_scale=q_scale, validate=validate, arch=arch)


def index_topk(logits: Tensor, kv_lens: Tensor, k: int, cu_q_lens: Optional[Tensor], block_table: Optional[Tensor],
               workspace: Optional[Tensor], *, page_size: Optional[int] = None, validate: bool = False,
               arch: Optional[str] = None) -> Tensor:
    """mla_kv.index_topk -> indices int32 [T, k] (a new tensor; the workspace's counters are left zeroed)."""
    return _index_topk(logits, kv_lens, k, cu_q_lens=cu_q_lens, block_table=block_table, page_size=page_size,
                       workspace=workspace, validate=validate, arch=arch)


# ------------------------------------------------------------------------ fake implementations
def _writes_only(*args, **kwargs) -> None:
    """The ops that only write their inputs have no outputs to describe."""
    return None


def _attention_fake(dims: int):
    """out [..., H, 512] in q's dtype and lse [..., H] (float32; float64 for float64 q) for q of ``dims`` dims."""
    def fake(q, *args, **kwargs):
        _check_q(q, dims)
        rows = q.shape[:-1]
        return q.new_empty((*rows, LATENT_DIM)), q.new_empty(rows, dtype=_lse_dtype(q))
    return fake


def _prefill_expanded_fake(q, kv_cache, block_table, cu_q_lens, kv_lens, w_uk, w_uv, *args, **kwargs):
    """out [T, H, d_v] in q's dtype (d_v: w_uv's dim 1) and lse [T, H]."""
    rows = q.shape[:-1]
    return q.new_empty((*rows, w_uv.shape[1])), q.new_empty(rows, dtype=_lse_dtype(q))


def _merge_states_fake(out_a, lse_a, out_b, lse_b):
    return out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape, dtype=_lse_dtype(out_a))


def _expanded_attention_fake(q, k, v, *args, **kwargs):
    """out [T, H, d_v] in q's dtype (d_v: v's dim 2) and lse [T, H]."""
    rows = q.shape[:-1]
    return q.new_empty((*rows, v.shape[2])), q.new_empty(rows, dtype=_lse_dtype(q))


def _index_scores_fake(q, weights, index_cache, block_table, kv_lens, max_kv_len, *args, **kwargs):
    """logits [T, max_kv_len], float32 (float64 for float64 q)."""
    return q.new_empty((q.shape[0], max_kv_len), dtype=_lse_dtype(q))


def _index_topk_fake(logits, kv_lens, k, *args, **kwargs):
    """indices [T, k], int32."""
    return logits.new_empty((logits.shape[0], k), dtype=torch.int32)


# (function, the arguments it writes, its fake)
_OPS = (
    (write_kv, ("kv_cache",), _writes_only),
    (fused_write_kv, ("kv_cache", "q"), _writes_only),
    (write_kv_blocks, ("block_ptrs",), _writes_only),
    (fused_write_kv_blocks, ("block_ptrs", "q"), _writes_only),
    (write_index_keys, ("index_cache", "q"), _writes_only),
    (write_index_keys_blocks, ("block_ptrs", "q"), _writes_only),
    (decode, ("workspace",), _attention_fake(4)),
    (decode_blocks, ("workspace",), _attention_fake(4)),
    (prefill, ("workspace",), _attention_fake(3)),
    (prefill_blocks, ("workspace",), _attention_fake(3)),
    (prefill_expanded, ("workspace",), _prefill_expanded_fake),
    (sparse_attention, ("workspace",), _attention_fake(3)),
    (sparse_attention_blocks, ("workspace",), _attention_fake(3)),
    (merge_states, (), _merge_states_fake),
    (expanded_attention, (), _expanded_attention_fake),
    (gather_kv, ("out",), _writes_only),
    (gather_kv_blocks, ("out",), _writes_only),
    (index_scores, (), _index_scores_fake),
    (index_topk, ("workspace",), _index_topk_fake),
)


def _register() -> dict:
    """Defines torch.ops.mla_kv.<name> for every op; {} where torch has no torch.library.custom_op. An op
    this torch's custom_op refuses (an older torch.library) ends the registration with a warning."""
    custom_op = getattr(torch.library, "custom_op", None)
    if custom_op is None:
        return {}
    options = {}
    exact = getattr(torch.Tag, "needs_exact_strides", None)
    if exact is not None and "tags" in inspect.signature(custom_op).parameters:
        options["tags"] = (exact,)
    defs = {}
    try:
        for fn, mutates, fake in _OPS:
            op = custom_op(f"mla_kv::{fn.__name__}", fn, mutates_args=mutates, **options)
            op.register_fake(fake)
            defs[fn.__name__] = op
    except (TypeError, ValueError, RuntimeError, NotImplementedError) as e:  # an older torch.library
        warnings.warn(f"mla_kv: torch.ops.mla_kv.* left unregistered, torch {torch.__version__} refused "
                      f"{fn.__name__}: {e}", RuntimeWarning, stacklevel=2)
    return defs


# name -> torch.library.CustomOpDef of each registered op (held here: an op lives while its definition does)
REGISTERED = _register()


# ---------------------------------------------------------------- the functions under torch.compile
# What mla_kv.<name> calls while Dynamo traces it (ops._common.traceable): the function's own arguments,
# flattened into its torch.ops.mla_kv form as described above. The op's real implementation is the
# function, so every check still runs before a launch; what is checked here is only what the flattening
# needs (a BlockPointerCache or not, the out / lse the function would fill). A given out / lse receives the
# op's whole result, rows past cu_q_lens[B] included (unspecified there, as in the ops).
def _fill(name: str, given: Optional[Tensor], result: Tensor) -> Tensor:
    if given is None:
        return result
    _result_tensor(name, given, result.shape, result.dtype, result.device)
    return given.copy_(result)


def _filled(out: Optional[Tensor], lse: Optional[Tensor], result) -> Tuple[Tensor, Tensor]:
    return _fill("out", out, result[0]), _fill("lse", lse, result[1])


def _blocks_read(kv_format, kv_scale) -> None:
    if kv_format is not None or kv_scale is not None:
        raise ValueError("kv_format / kv_scale: a BlockPointerCache carries its own (cache.kv_format, "
                         "cache.kv_scale)")


def _block_pointer_cache(cache) -> None:
    if not isinstance(cache, BlockPointerCache):
        raise TypeError(f"cache: expected mla_kv.layout.BlockPointerCache, got {type(cache).__name__}")


def _traced_write_kv(kv_c, k_pe, kv_cache, slot_mapping, *, kv_format=None, kv_scale=None, validate=False,
                     arch=None):
    torch.ops.mla_kv.write_kv(kv_c, k_pe, kv_cache, slot_mapping, kv_format=kv_format, kv_scale=kv_scale,
                              validate=validate, arch=arch)


def _traced_fused_write_kv(kv_a, rms_weight, eps, positions, cos_sin_cache, kv_cache, slot_mapping, *,
                           rope_style="interleaved", q=None, kv_format=None, kv_scale=None, validate=False,
                           arch=None):
    torch.ops.mla_kv.fused_write_kv(kv_a, rms_weight, eps, positions, cos_sin_cache, kv_cache, slot_mapping, q,
                                    rope_style=rope_style, kv_format=kv_format, kv_scale=kv_scale,
                                    validate=validate, arch=arch)


def _traced_write_kv_blocks(kv_c, k_pe, cache, cu_q_lens, history_lens, *, readonly_lens=None, cp_size=1,
                            cp_rank=0, validate=False, arch=None):
    _block_pointer_cache(cache)
    torch.ops.mla_kv.write_kv_blocks(kv_c, k_pe, *block_pointer_args(cache), cu_q_lens, history_lens,
                                     readonly_lens, **block_pointer_kwargs(cache), cp_size=cp_size,
                                     cp_rank=cp_rank, validate=validate, arch=arch)


def _traced_fused_write_kv_blocks(kv_a, rms_weight, eps, positions, cos_sin_cache, cache, cu_q_lens, history_lens,
                                  *, rope_style="interleaved", q=None, readonly_lens=None, cp_size=1, cp_rank=0,
                                  validate=False, arch=None):
    _block_pointer_cache(cache)
    torch.ops.mla_kv.fused_write_kv_blocks(kv_a, rms_weight, eps, positions, cos_sin_cache,
                                           *block_pointer_args(cache), cu_q_lens, history_lens, q, readonly_lens,
                                           rope_style=rope_style, **block_pointer_kwargs(cache), cp_size=cp_size,
                                           cp_rank=cp_rank, validate=validate, arch=arch)


def _traced_write_index_keys(k, ln_weight, ln_bias, eps, positions, cos_sin_cache, index_cache, slot_mapping, *,
                             rope_style="neox", scale_fmt=None, q=None, validate=False, arch=None):
    torch.ops.mla_kv.write_index_keys(k, ln_weight, ln_bias, eps, positions, cos_sin_cache, index_cache, slot_mapping,
                                      q, rope_style=rope_style, scale_fmt=scale_fmt, validate=validate, arch=arch)


def _traced_write_index_keys_blocks(k, ln_weight, ln_bias, eps, positions, cos_sin_cache, cache, cu_q_lens,
                                    history_lens, *, readonly_lens=None, cp_size=1, cp_rank=0, rope_style="neox",
                                    scale_fmt=None, q=None, validate=False, arch=None):
    if not isinstance(cache, IndexBlockPointerCache):
        raise TypeError(f"cache: expected mla_kv.layout.IndexBlockPointerCache, got {type(cache).__name__}")
    torch.ops.mla_kv.write_index_keys_blocks(k, ln_weight, ln_bias, eps, positions, cos_sin_cache, cache.block_ptrs,
                                             cache.cu_block_nums, cache.block_seq_len, cache.layer_offset_bytes,
                                             cu_q_lens, history_lens, q, readonly_lens, rope_style=rope_style,
                                             scale_fmt=scale_fmt, cp_size=cp_size, cp_rank=cp_rank,
                                             validate=validate, arch=arch)


def _traced_decode(q, kv_cache, block_table, seq_lens, softmax_scale, *, out=None, lse=None, workspace=None,
                   schedule=None, validate=False, arch=None, kv_format=None, kv_scale=None):
    split = {} if schedule is None else schedule_kwargs(schedule)
    if isinstance(kv_cache, BlockPointerCache):
        _blocks_read(kv_format, kv_scale)
        result = torch.ops.mla_kv.decode_blocks(q, *block_pointer_args(kv_cache), seq_lens, softmax_scale,
                                                workspace, **block_pointer_kwargs(kv_cache), **split,
                                                validate=validate, arch=arch)
    else:
        result = torch.ops.mla_kv.decode(q, kv_cache, block_table, seq_lens, softmax_scale, workspace, **split,
                                         validate=validate, arch=arch, kv_format=kv_format, kv_scale=kv_scale)
    return _filled(out, lse, result)


def _traced_prefill(q, kv_cache, block_table, cu_q_lens, kv_lens, softmax_scale, *, causal=True, out=None,
                    lse=None, workspace=None, schedule=None, validate=False, arch=None, kv_format=None,
                    kv_scale=None):
    split = {} if schedule is None else schedule_kwargs(schedule)
    if isinstance(kv_cache, BlockPointerCache):
        _blocks_read(kv_format, kv_scale)
        result = torch.ops.mla_kv.prefill_blocks(q, *block_pointer_args(kv_cache), cu_q_lens, kv_lens,
                                                 softmax_scale, workspace, causal=causal,
                                                 **block_pointer_kwargs(kv_cache), **split, validate=validate,
                                                 arch=arch)
    else:
        result = torch.ops.mla_kv.prefill(q, kv_cache, block_table, cu_q_lens, kv_lens, softmax_scale, workspace,
                                          causal=causal, **split, validate=validate, arch=arch,
                                          kv_format=kv_format, kv_scale=kv_scale)
    return _filled(out, lse, result)


def _traced_prefill_expanded(q, kv_cache, block_table, cu_q_lens, kv_lens, w_uk, w_uv, softmax_scale, *,
                             causal=True, max_q_len, max_kv_len, max_prefix_len=None, kv_chunk=8192,
                             kv_format=None, kv_scale=None, out=None, lse=None, workspace=None, validate=False,
                             attention_kernel="auto", arch=None):
    if isinstance(kv_cache, BlockPointerCache):
        raise ValueError("kv_cache: under torch.compile prefill_expanded takes a paged cache (it has no "
                         "block-pointer op); call it with a BlockPointerCache outside the compiled region "
                         "(torch.compiler.disable)")
    result = torch.ops.mla_kv.prefill_expanded(q, kv_cache, block_table, cu_q_lens, kv_lens, w_uk, w_uv,
                                               softmax_scale, workspace, max_q_len=max_q_len,
                                               max_kv_len=max_kv_len, causal=causal, max_prefix_len=max_prefix_len,
                                               kv_chunk=kv_chunk, kv_format=kv_format, kv_scale=kv_scale,
                                               validate=validate, attention_kernel=attention_kernel, arch=arch)
    return _filled(out, lse, result)


def _traced_sparse_attention(q, kv_cache, indices, softmax_scale, *, topk_lens=None, cu_q_lens=None, out=None,
                             lse=None, workspace=None, schedule=None, validate=False, arch=None, kv_format=None,
                             kv_scale=None):
    split = {} if schedule is None else schedule_kwargs(schedule)
    if isinstance(kv_cache, BlockPointerCache):
        _blocks_read(kv_format, kv_scale)
        result = torch.ops.mla_kv.sparse_attention_blocks(q, *block_pointer_args(kv_cache), indices, cu_q_lens,
                                                          softmax_scale, topk_lens, workspace,
                                                          **block_pointer_kwargs(kv_cache), **split,
                                                          validate=validate, arch=arch)
    else:
        if cu_q_lens is not None:
            raise ValueError("cu_q_lens: a paged cache's indices are physical slots; cu_q_lens belongs to a "
                             "BlockPointerCache")
        result = torch.ops.mla_kv.sparse_attention(q, kv_cache, indices, softmax_scale, topk_lens, workspace, **split,
                                                   validate=validate, arch=arch, kv_format=kv_format,
                                                   kv_scale=kv_scale)
    return _filled(out, lse, result)


def _traced_merge_states(out_a, lse_a, out_b, lse_b, *, out=None, lse=None):
    return _filled(out, lse, torch.ops.mla_kv.merge_states(out_a, lse_a, out_b, lse_b))


def _traced_expanded_attention(q, k, v, cu_q_lens, cu_k_lens, softmax_scale, *, causal=True, max_q_len,
                               out=None, lse=None, arch=None, smem_limits=None, validate=False):
    limits = _smem_limits(smem_limits)
    flat = None if limits is None else [limits.per_block, limits.per_sm, limits.reserved_per_block]
    result = torch.ops.mla_kv.expanded_attention(q, k, v, cu_q_lens, cu_k_lens, softmax_scale, max_q_len=max_q_len,
                                                 causal=causal, arch=arch, smem_limits=flat, validate=validate)
    return _filled(out, lse, result)


def _traced_gather_kv(kv_cache, block_table, cu_kv_lens, *, starts=None, out=None, kv_format=None, kv_scale=None,
                      dtype=None, validate=False, arch=None):
    if out is None:
        raise ValueError("out: required under torch.compile (without it the row count is cu_kv_lens[-1], "
                         "device data that a compiled graph cannot read on the host); pass out "
                         "[N >= total_kv, 576]")
    if dtype is not None and dtype != out.dtype:
        raise TypeError(f"out: expected dtype {dtype} (the dtype argument), got {out.dtype}")
    if isinstance(kv_cache, BlockPointerCache):
        _blocks_read(kv_format, kv_scale)
        torch.ops.mla_kv.gather_kv_blocks(*block_pointer_args(kv_cache), cu_kv_lens, out, starts,
                                          **block_pointer_kwargs(kv_cache), validate=validate, arch=arch)
    else:
        torch.ops.mla_kv.gather_kv(kv_cache, block_table, cu_kv_lens, out, starts, kv_format=kv_format,
                                   kv_scale=kv_scale, validate=validate, arch=arch)
    return out


def _traced_index_scores(q, weights, index_cache, block_table, kv_lens, max_kv_len, *, cu_q_lens=None, max_q_len=None,
                         q_scale=None, out=None, validate=False, arch=None):
    result = torch.ops.mla_kv.index_scores(q, weights, index_cache, block_table, kv_lens, max_kv_len, cu_q_lens,
                                           q_scale, max_q_len=max_q_len, validate=validate, arch=arch)
    return _fill("out", out, result)


def _traced_index_topk(logits, kv_lens, k, *, cu_q_lens=None, block_table=None, page_size=None, out=None,
                       workspace=None, validate=False, arch=None):
    result = torch.ops.mla_kv.index_topk(logits, kv_lens, k, cu_q_lens, block_table, workspace, page_size=page_size,
                                         validate=validate, arch=arch)
    return _fill("out", out, result)


_TRACED_FORMS = {
    "write_kv": _traced_write_kv, "fused_write_kv": _traced_fused_write_kv,
    "write_kv_blocks": _traced_write_kv_blocks, "fused_write_kv_blocks": _traced_fused_write_kv_blocks,
    "write_index_keys": _traced_write_index_keys, "write_index_keys_blocks": _traced_write_index_keys_blocks,
    "decode": _traced_decode, "prefill": _traced_prefill, "prefill_expanded": _traced_prefill_expanded,
    "merge_states": _traced_merge_states, "expanded_attention": _traced_expanded_attention,
    "sparse_attention": _traced_sparse_attention,
    "gather_kv": _traced_gather_kv, "index_scores": _traced_index_scores, "index_topk": _traced_index_topk,
}
_OP_NAMES = {fn.__name__ for fn, _, _ in _OPS}
for _name, _route in _TRACED_FORMS.items():
    # a function traces into its op only where torch registered every op its form calls (the _blocks one too)
    if {_name, f"{_name}_blocks"} & _OP_NAMES <= set(REGISTERED):
        _TRACED[_name] = _route
