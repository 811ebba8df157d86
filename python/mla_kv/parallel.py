"""Several GPUs: head (tensor) parallelism and context parallelism over torch.distributed.

Head parallelism (TP) needs no new op: rank r of tp takes the rows of its num_heads / tp heads from
q_b_proj and kv_b_proj (``shard_heads``), keeps the whole latent cache and the same block tables, and
runs the ordinary decode/prefill with its heads; its o_proj columns (``shard_heads(..., dim=1)``)
give a partial hidden state that the engine all-reduces as usual. See docs/parallel.md.

Context parallelism (CP): token t of a sequence lives on rank t % cp at LOCAL position t // cp
(TurboMind's convention), so each rank caches 1/cp of every sequence and the context that fits grows
cp-fold. Every rank computes q and kv_a for all new tokens (activations are replicated), writes only
its own tokens (``cp_fused_write_kv``), attends over its local tokens (``cp_decode`` /
``cp_prefill``, giving a partial (out, lse) per rank) and the partial states are merged by their
log-sum-exp (``cp_merge``: an all-gather, then ``mla_kv.merge_states``). Each rank holds local block
tables (or, in TurboMind's block-pointer form, block lists) that map its local positions to blocks of
its own cache; the lengths passed in are GLOBAL. Both forms serve the write, decode and prefill.

Causal masking across ranks: a query at global position p sees global positions <= p, which on rank
r are the ``(p + cp - r) // cp`` local positions 0, 1, ... (``cp_local_lens(p + 1)``). Along the new
tokens of one sequence this count grows by 1 every cp positions, not every position, so it is not
the ops' per-sequence rule "query i sees kv_len - q_len + i + 1". But the queries whose positions
are congruent mod cp are spaced exactly cp apart, and along them the count does grow by exactly 1
per query: each such residue class is an ordinary causal query block whose kv length is the count of
its last query. cp_decode and cp_prefill run the ordinary kernels on those classes (min(S_q, cp)
strided decode calls; one prefill over the B x cp classes, reordered, each class reading its sequence's
table row or, for block pointers, a copy of its sequence's block list), so no new kernel is needed.
The price: each class makes its own pass over the local cache (min(S_q, cp) passes for decode, up to
cp for prefill) where a kernel with a per-query mask could make one; for S_q = 1 it is one pass.

CUDA graphs: the position/slot helpers, cp_fused_write_kv (validate=False), cp_decode and cp_prefill
use only device tensor ops on shapes known on the host (no host synchronization), and cp_merge only
all-gathers (into fresh buffers) and merges; capturing it needs collectives that can be captured
(PyTorch's NCCL backend allows it; not exercised here, and gloo is CPU only).
``cp_local_positions(num_tokens=None)`` reads cu_q_lens[-1] on the host. The CPU path (the reference
ops) synchronizes everywhere, as the reference does.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from . import _checks, ops
from .layout import LATENT_DIM, BlockPointerCache
from .ops._common import _check_block_pointer_cache, _result_tensor, _same_device, _size, _tensor

__all__ = [
    "CpTokens", "cp_class_block_pointers", "cp_decode", "cp_fused_write_kv", "cp_local_lens", "cp_local_positions",
    "cp_merge", "cp_prefill", "cp_slot_mapping", "merge_partial_states", "shard_heads",
]


def _check_rank(size_name: str, size, rank) -> None:
    _checks.integer(size_name, size, 1)
    _checks.integer("rank", rank, 0)
    if rank >= size:
        raise ValueError(f"rank: must be < {size_name} ({size}), got {rank}")


def _check_cu_q_lens(cu_q_lens) -> int:
    """The batch size of cu_q_lens int32 [B + 1]."""
    _tensor("cu_q_lens", cu_q_lens, dims=1, dtype=torch.int32, contiguous=True)
    if cu_q_lens.shape[0] < 2:
        raise ValueError("cu_q_lens: needs at least 2 entries (batch >= 1)")
    return cu_q_lens.shape[0] - 1


def _sequence_of_tokens(cu_q_lens: torch.Tensor, num_tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sequence, index within it) of packed tokens 0..num_tokens-1, int64, on cu_q_lens's device.

    Tokens at or past cu_q_lens[B] get sequence B (no sequence) and index 0.
    """
    cu = cu_q_lens.long()
    token = torch.arange(num_tokens, device=cu.device)
    seq = torch.searchsorted(cu[1:], token, right=True)  # cu[b] <= t < cu[b + 1]
    batch = cu.shape[0] - 1
    index = torch.where(seq < batch, token - cu[seq.clamp_max(batch - 1)], 0)
    return seq, index


# ------------------------------------------------------------------------------ head parallel
def shard_heads(weight: torch.Tensor, num_heads: int, tp: int, rank: int, dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s slice of a per-head weight under head (tensor) parallelism, as a view.

    ``weight``'s dim ``dim`` holds num_heads equal groups in head order: q_b_proj.weight
    [H * (nope + rope), q_lora] and kv_b_proj.weight [H * (nope + v), 512] along dim 0, o_proj.weight
    [hidden, H * v] along dim 1. Rank r of tp gets heads r * H / tp .. (r + 1) * H / tp - 1, so the
    slices of q_b_proj, kv_b_proj and o_proj of one rank describe the same heads.
    """
    _tensor("weight", weight)
    _checks.integer("num_heads", num_heads, 1)
    _check_rank("tp", tp, rank)
    if isinstance(dim, bool) or not isinstance(dim, int) or not -weight.dim() <= dim < weight.dim():
        raise ValueError(f"dim: must index one of weight's {weight.dim()} dims, got {dim!r}")
    if num_heads % tp:
        raise ValueError(f"tp: must divide num_heads ({num_heads}), got {tp}")
    if weight.shape[dim] % num_heads:
        raise ValueError(f"weight: dim {dim} of shape {tuple(weight.shape)} is not {num_heads} equal head groups")
    per_rank = weight.shape[dim] // tp
    return weight.narrow(dim, rank * per_rank, per_rank)


# ------------------------------------------------------------------------- context parallel
def cp_local_lens(lens: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """How many of the global positions 0 .. lens - 1 live on rank ``rank`` of cp: max(0, ceil((lens - rank) / cp)).

    lens: an integer tensor of any shape; returns int32 of the same shape and device. This is a
    sequence's local length on the rank, and with lens = p + 1 the number of local positions a query
    at global position p sees there.
    """
    _check_rank("cp", cp, rank)
    _tensor("lens", lens)
    if lens.dtype.is_floating_point or lens.dtype.is_complex or lens.dtype == torch.bool:
        raise TypeError(f"lens: expected an integer dtype, got {lens.dtype}")
    return torch.div(lens.long() - rank + cp - 1, cp, rounding_mode="floor").clamp_min(0).to(torch.int32)


class CpTokens(NamedTuple):
    """Where the packed new tokens of a batch go under context parallelism, seen from one rank.

    All [T] on cu_q_lens's device. Rows past cu_q_lens[B] (padding) have seq_id B, position 0 and
    are owned by no rank.
    """

    seq_ids: torch.Tensor          # int64: the token's sequence
    positions: torch.Tensor        # int64: its global position (what RoPE rotates by)
    owned: torch.Tensor            # bool: it lives on this rank (position % cp == rank)
    local_positions: torch.Tensor  # int64: position // cp, its place in this rank's cache where owned


def cp_local_positions(cu_q_lens: torch.Tensor, history_lens: torch.Tensor, cp: int, rank: int,
                       num_tokens: Optional[int] = None) -> CpTokens:
    """Global and local positions of a batch's new tokens on rank ``rank`` of cp.

    The new tokens are packed by sequence (cu_q_lens int32 [B + 1]); token i of sequence b is at global
    position history_lens[b] + i (int32 [B], TurboMind's addressing), lives on rank position % cp, at
    local position position // cp. ``num_tokens`` (T, the packed rows) defaults to cu_q_lens[B],
    read on the host (a synchronization); pass it to stay graph-safe.
    """
    _check_rank("cp", cp, rank)
    batch = _check_cu_q_lens(cu_q_lens)
    _tensor("history_lens", history_lens, dims=1, dtype=torch.int32, contiguous=True)
    _size("history_lens", history_lens, 0, batch)
    _same_device(cu_q_lens=cu_q_lens, history_lens=history_lens)
    num_tokens = int(cu_q_lens[-1]) if num_tokens is None else _checks.integer("num_tokens", num_tokens, 0)
    seq, index = _sequence_of_tokens(cu_q_lens, num_tokens)
    valid = seq < batch
    positions = torch.where(valid, history_lens.long()[seq.clamp_max(batch - 1)] + index, 0)
    owned = valid & (positions % cp == rank)
    return CpTokens(seq, positions, owned, positions // cp)


def cp_slot_mapping(tokens: CpTokens, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """The slot mapping (int64 [T]) of this rank's write: slots of the owned tokens, -1 for the rest.

    block_table int32 [B, max_blocks] is this rank's LOCAL table (local position j of sequence b is in
    block block_table[b, j // block_size]); tokens whose local position lies past the table get -1
    too, so they are skipped like the ops skip padded tokens.
    """
    if not isinstance(tokens, CpTokens):
        raise TypeError(f"tokens: expected mla_kv.parallel.CpTokens, got {type(tokens).__name__}")
    _tensor("block_table", block_table, dims=2, dtype=torch.int32, last_contiguous=True)
    _size("block_table", block_table, 1, 1, at_least=True)
    _checks.integer("block_size", block_size, 1)
    _same_device(block_table=block_table, positions=tokens.local_positions)
    rows, width = block_table.shape
    block_index = tokens.local_positions // block_size
    inside = tokens.owned & (block_index < width) & (tokens.seq_ids < rows)
    blocks = block_table[tokens.seq_ids.clamp_max(rows - 1), block_index.clamp_max(width - 1)].long()
    return torch.where(inside, blocks * block_size + tokens.local_positions % block_size, -1)


def cp_fused_write_kv(kv_a: torch.Tensor, rms_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor,
                      kv_cache, block_table: Optional[torch.Tensor], cu_q_lens: torch.Tensor,
                      history_lens: torch.Tensor, cp: int, rank: int, *, rope_style: str = "interleaved",
                      q: Optional[torch.Tensor] = None, readonly_lens: Optional[torch.Tensor] = None,
                      validate: bool = False, arch: Optional[str] = None) -> None:
    """mla_kv.fused_write_kv under context parallelism: this rank writes only the tokens it owns.

    kv_a [T, 576]: the raw kv_a projection of ALL new tokens, packed by sequence (cu_q_lens int32
    [B + 1], history_lens int32 [B]: the GLOBAL history lengths, as in cp_local_positions; rows past
    cu_q_lens[B] are padding). kv_cache / block_table: this rank's LOCAL cache, either a paged tensor
    [num_blocks, block_size, 576] with its table int32 [B, max_blocks], or a layout.BlockPointerCache
    (block_table None) whose sequence b's blocks hold its local rows 0, 1, ... (local row j: global
    position j * cp + rank). RoPE uses the global positions, and q [T, H, D] (optional) is rotated for
    every token, owned or not, since every rank attends with all queries.

    Paged: one ordinary fused_write_kv launch with a computed slot mapping (other ranks' tokens get slot
    -1). Block pointers: one fused_write_kv_blocks launch with cp_size=cp, cp_rank=rank, the kernel
    skipping the other ranks' tokens itself; ``readonly_lens`` (int32 [B], optional, block form only)
    counts the LOCAL rows of each sequence that are never written (TurboMind's read-only prefix blocks,
    readonly_block_num[b] * block_len). An engine writing many layers per step can compute
    cp_local_positions (and cp_slot_mapping) once and call the ordinary write per layer.
    """
    _tensor("kv_a", kv_a, dims=2)
    blocks = isinstance(kv_cache, BlockPointerCache)
    if blocks and block_table is not None:
        raise ValueError("block_table: must be None with a layout.BlockPointerCache (its block lists address the rows)")
    if not blocks and readonly_lens is not None:
        raise ValueError("readonly_lens: only for a layout.BlockPointerCache kv_cache; a paged write skips rows "
                         "through its slot mapping (slot -1)")
    tokens = cp_local_positions(cu_q_lens, history_lens, cp, rank, num_tokens=kv_a.shape[0])
    if blocks:
        ops.fused_write_kv_blocks(kv_a, rms_weight, eps, tokens.positions, cos_sin_cache, kv_cache, cu_q_lens,
                                  history_lens, rope_style=rope_style, q=q, readonly_lens=readonly_lens,
                                  cp_size=cp, cp_rank=rank, validate=validate, arch=arch)
        return
    _tensor("kv_cache", kv_cache, dims=3)
    _tensor("block_table", block_table, dims=2, dtype=torch.int32, last_contiguous=True)
    _size("block_table", block_table, 0, cu_q_lens.shape[0] - 1)
    slots = cp_slot_mapping(tokens, block_table, kv_cache.shape[1])
    ops.fused_write_kv(kv_a, rms_weight, eps, tokens.positions, cos_sin_cache, kv_cache, slots,
                       rope_style=rope_style, q=q, validate=validate, arch=arch)


def cp_decode(q: torch.Tensor, kv_cache, block_table: Optional[torch.Tensor], seq_lens: torch.Tensor,
              softmax_scale: float, cp: int, rank: int, *, out: Optional[torch.Tensor] = None,
              lse: Optional[torch.Tensor] = None, workspace: Optional[torch.Tensor] = None,
              schedule: Optional[ops.AttentionSchedule] = None, arch: Optional[str] = None):
    """This rank's partial decode attention under context parallelism -> (out, lse), to cp_merge.

    q [B, S_q, H, 576] as in mla_kv.decode; kv_cache / block_table: this rank's LOCAL cache (paged
    tensor + table, or a layout.BlockPointerCache with block_table None); seq_lens int32 [B]: the
    GLOBAL kv lengths including the S_q new tokens. Query i of sequence b (global position
    p = seq_lens[b] - S_q + i) sees the local tokens of global positions <= p. The queries are run in
    min(S_q, cp) residue classes i = g, g + cp, ... (strided views of q/out/lse, no copies), each an
    ordinary decode whose visible counts grow by one per query (see the module docstring); a rank
    with nothing visible to a query gives it out 0 and lse -inf, which the merge ignores.
    ``schedule`` / ``workspace`` (for CUDA graphs): from attention_schedule(B, ceil(S_q / cp), H,
    local max kv length); they serve every class call. No host synchronization.
    """
    _check_rank("cp", cp, rank)
    _tensor("q", q, dims=4)
    _tensor("seq_lens", seq_lens, dims=1, dtype=torch.int32, contiguous=True)
    batch, s_q, heads, _ = q.shape
    out = _result_tensor("out", out, (batch, s_q, heads, LATENT_DIM), q.dtype, q.device)
    lse = _result_tensor("lse", lse, (batch, s_q, heads), torch.float32, q.device)
    for g in range(min(s_q, cp)):
        last = g + (len(range(g, s_q, cp)) - 1) * cp          # the class's last query
        class_lens = cp_local_lens(seq_lens.long() - s_q + last + 1, cp, rank)
        ops.decode(q[:, g::cp], kv_cache, block_table, class_lens, softmax_scale, out=out[:, g::cp],
                   lse=lse[:, g::cp], workspace=workspace, schedule=schedule, arch=arch)
    return out, lse


def cp_class_block_pointers(block_ptrs: torch.Tensor, cu_block_nums: torch.Tensor,
                            cp: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The block lists of causal cp_prefill's query classes: class (b, g) reads sequence b's blocks.

    block_ptrs int64 [N] and cu_block_nums int32 [B + 1] as in layout.BlockPointerCache (sequence b
    owns block_ptrs[cu_block_nums[b]:cu_block_nums[b + 1]]). Returns (class_ptrs int64 [cp * N],
    class_cu_block_nums int32 [B * cp + 1]): class c = b * cp + g (the order of cp_prefill's classes)
    owns class_ptrs[class_cu_block_nums[c]:class_cu_block_nums[c + 1]], a copy of sequence b's list.
    Each sequence's range is repeated cp times where it was (class (b, g) starts at
    cp * cu_block_nums[b] + g * its block count); entries no class owns (past cp * cu_block_nums[B],
    or before cp * cu_block_nums[0]) are 0. The classes share the sequences' blocks, so nothing of the
    cache is copied. Device tensor ops on shapes known on the host (cp * N): no host synchronization.
    """
    _checks.integer("cp", cp, 1)
    _tensor("block_ptrs", block_ptrs, dims=1, dtype=torch.int64, contiguous=True)
    _tensor("cu_block_nums", cu_block_nums, dims=1, dtype=torch.int32, contiguous=True)
    if cu_block_nums.shape[0] < 2:
        raise ValueError("cu_block_nums: needs at least 2 entries (batch >= 1)")
    _same_device(block_ptrs=block_ptrs, cu_block_nums=cu_block_nums)
    cu = cu_block_nums.long()
    counts = cu[1:] - cu[:-1]
    classes = counts.shape[0] * cp
    starts = cp * cu[:-1, None] + torch.arange(cp, device=cu.device) * counts[:, None]      # [B, cp]
    class_cu = torch.cat([starts.flatten(), cp * cu[-1:]])
    entry = torch.arange(cp * block_ptrs.shape[0], device=cu.device)
    # The class c with class_cu[c] <= entry < class_cu[c + 1], and the entry's place in its list.
    cls = torch.searchsorted(class_cu[1:], entry, right=True).clamp_max(classes - 1)
    within = entry - class_cu[cls]
    owned = (within >= 0) & (entry < class_cu[-1])
    # Clamped into block_ptrs: a cu_block_nums running past its end reads nothing out of range here
    # (the kernels then get class lists as far out of range as the caller's lists were).
    source = (cu[cls // cp] + within).clamp(0, max(block_ptrs.shape[0] - 1, 0))
    class_ptrs = torch.where(owned, block_ptrs[source], 0)
    return class_ptrs, class_cu.to(torch.int32)


def cp_prefill(q: torch.Tensor, kv_cache, block_table: Optional[torch.Tensor], cu_q_lens: torch.Tensor,
               kv_lens: torch.Tensor, softmax_scale: float, cp: int, rank: int, *, causal: bool = True,
               out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
               workspace: Optional[torch.Tensor] = None, schedule: Optional[ops.AttentionSchedule] = None,
               arch: Optional[str] = None):
    """This rank's partial prefill attention under context parallelism -> (out, lse), to cp_merge.

    q [T, H, 576] packed (cu_q_lens int32 [B + 1], cu_q_lens[B] == T) as in mla_kv.prefill; kv_lens
    int32 [B]: the GLOBAL kv lengths including the new tokens (a cached prefix of kv_len - q_len);
    kv_cache / block_table: this rank's LOCAL cache, a paged tensor [num_blocks, block_size, 576] with
    its table int32 [B, max_blocks], or a layout.BlockPointerCache (block_table None). Causal: a query
    at global position p sees the local tokens of positions <= p. The queries are regrouped into the
    B x cp residue classes (sequence b, in-sequence index i with i % cp == g), each an ordinary causal
    sequence over its sequence's cache (the table row repeated cp times; block pointers: the block list
    repeated, cp_class_block_pointers), and run by one prefill: a copy of q into class order and of
    out/lse back. Not causal: one prefill over the local lengths.
    ``schedule`` / ``workspace``: for B * cp sequences and T tokens (block pointers: max kv length
    len(block_ptrs) * block_seq_len, which the default plans for). No host synchronization.
    """
    _check_rank("cp", cp, rank)
    _tensor("q", q, dims=3)
    batch = _check_cu_q_lens(cu_q_lens)
    _tensor("kv_lens", kv_lens, dims=1, dtype=torch.int32, contiguous=True)
    _size("kv_lens", kv_lens, 0, batch)
    if not causal or cp == 1:
        return ops.prefill(q, kv_cache, block_table, cu_q_lens, cp_local_lens(kv_lens, cp, rank), softmax_scale,
                           causal=causal, out=out, lse=lse, workspace=workspace, schedule=schedule, arch=arch)
    tokens, heads, _ = q.shape
    if isinstance(kv_cache, BlockPointerCache):
        _check_block_pointer_cache(kv_cache, q.dtype)
        if kv_cache.batch != batch:
            raise ValueError(f"kv_cache.cu_block_nums: describes {kv_cache.batch} sequences, cu_q_lens {batch}")
        class_ptrs, class_cu_blocks = cp_class_block_pointers(kv_cache.block_ptrs, kv_cache.cu_block_nums, cp)
        class_cache = dataclasses.replace(kv_cache, block_ptrs=class_ptrs, cu_block_nums=class_cu_blocks)
        class_table = None
        if schedule is None and q.device.type == "cuda":
            # Each class list is one of the sequences' lists: bound the kv length by the original
            # pointers, not by the cp-fold class array ops.prefill would plan for.
            schedule = ops.attention_schedule(batch * cp, max(1, -(-tokens // (batch * cp))), heads,
                                              kv_cache.block_ptrs.shape[0] * kv_cache.block_seq_len,
                                              total_q_tokens=tokens, device=q.device, arch=arch)
    else:
        _tensor("block_table", block_table, dims=2, dtype=torch.int32, last_contiguous=True)
        class_cache, class_table = kv_cache, block_table.repeat_interleave(cp, dim=0)
    out = _result_tensor("out", out, (tokens, heads, LATENT_DIM), q.dtype, q.device)
    lse = _result_tensor("lse", lse, (tokens, heads), torch.float32, q.device)

    cu = cu_q_lens.long()
    q_lens = cu[1:] - cu[:-1]
    # Class g of a sequence holds its queries i = g, g + cp, ...: as many as positions of rank g in q_len.
    class_q = torch.stack([cp_local_lens(q_lens, cp, g) for g in range(cp)], dim=1).long()     # [B, cp]
    last = torch.arange(cp, device=cu.device) + (class_q - 1) * cp                            # in-sequence
    class_kv = cp_local_lens((kv_lens.long() - q_lens)[:, None] + last + 1, cp, rank)
    class_kv = torch.where(class_q > 0, class_kv, 0).flatten()
    cu_class = torch.nn.functional.pad(class_q.flatten().cumsum(0), (1, 0)).to(torch.int32)

    seq, index = _sequence_of_tokens(cu_q_lens, tokens)
    to_class = cu_class.long()[seq * cp + index % cp] + index // cp     # token -> its row in class order
    q_classes = q.new_empty((tokens, heads, q.shape[2])).index_copy_(0, to_class, q)
    out_classes, lse_classes = ops.prefill(
        q_classes, class_cache, class_table, cu_class, class_kv, softmax_scale,
        causal=True, workspace=workspace, schedule=schedule, arch=arch)
    out.copy_(out_classes[to_class])
    lse.copy_(lse_classes[to_class])
    return out, lse


def merge_partial_states(outs: torch.Tensor, lses: torch.Tensor, *, out: Optional[torch.Tensor] = None,
                         lse: Optional[torch.Tensor] = None):
    """Merges attention states over disjoint key sets stacked on dim 0 -> (out, lse).

    outs [n, ..., D], lses [n, ...] float32 (natural log), as all-gathered from n ranks. Folded in
    order with mla_kv.merge_states (n - 1 launches), so ranks merging the same gathered states get
    bit-identical results; a state with lse -inf counts for nothing.
    """
    _tensor("outs", outs)
    _tensor("lses", lses)
    if outs.dim() < 2 or outs.shape[0] < 1:
        raise ValueError(f"outs: expected [n >= 1, ..., D], got shape {tuple(outs.shape)}")
    if tuple(lses.shape) != tuple(outs.shape[:-1]):
        raise ValueError(f"lses: shape {tuple(lses.shape)} must be outs' without the last dim "
                         f"{tuple(outs.shape[:-1])}")
    if outs.shape[0] == 1:
        return (outs[0] if out is None else out.copy_(outs[0]),
                lses[0] if lse is None else lse.copy_(lses[0]))
    merged = outs[0], lses[0]
    for k in range(1, outs.shape[0]):
        last = k == outs.shape[0] - 1
        merged = ops.merge_states(*merged, outs[k], lses[k], out=out if last else None, lse=lse if last else None)
    return merged


def _all_gather(gathered: torch.Tensor, tensor: torch.Tensor, group) -> None:
    # Flat buffers are the one form every backend takes (gloo rejects a [world, ...] output);
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(gathered.view(-1), tensor.contiguous().view(-1), group=group)


def cp_merge(out: torch.Tensor, lse: torch.Tensor, group=None):
    """Merges the ranks' partial (out, lse) of cp_decode / cp_prefill -> (out, lse), on every rank.

    out [..., 512], lse [...] float32 from this rank; ``group`` is the CP process group (default the
    world), its rank order being the cp rank. Two all-gathers (out, lse) through torch.distributed, then
    merge_partial_states: every rank gets the same full result, as replicated activations need.
    """
    _tensor("out", out)
    _tensor("lse", lse, dtype=torch.float32)
    world = dist.get_world_size(group)
    if world == 1:
        return out, lse
    outs = out.new_empty((world, *out.shape))
    lses = lse.new_empty((world, *lse.shape))
    _all_gather(outs, out, group)
    _all_gather(lses, lse, group)
    return merge_partial_states(outs, lses)
