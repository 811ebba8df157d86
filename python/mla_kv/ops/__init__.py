"""The torch-facing ops: argument validation, then dispatch to the CUDA kernels or the reference.

Every op checks its arguments before anything is launched or written and raises a ValueError or
TypeError naming the bad argument. CUDA tensors go to the compiled kernels; CPU tensors run the
pure-PyTorch reference (mla_kv.reference), which is also the specification of each op.

Bounds that need device data (slot values, positions, block-table lengths) are checked only with
``validate=True`` (a host synchronization); without it the kernels never read or write outside the
cache and the outputs: writes skip out-of-range rows, gather leaves the rows it cannot find untouched,
and attention reads a position with no block as a zero row (a finite but unspecified result). Ops do
no host synchronization or allocation otherwise, so they can be captured in CUDA graphs.

The ops live by family: ``write`` (write_kv, fused_write_kv and their block-pointer forms),
``attention`` (attention_schedule, decode, prefill, merge_states, sparse_attention and its schedule),
``expanded`` (prefill_expanded and
its expanded_attention kernel), ``gather`` (gather_kv) and ``indexer`` (DeepSeek Sparse Attention's
indexer: write_index_keys and its block-pointer form in ``index_keys``); ``_common``
holds what they share (the argument checks, the choice of kernel variant, the cache conversions); ``_C``
is the compiled module (mla_kv._compiled, None without the kernels).
``library`` registers every op as a torch.library custom op, ``torch.ops.mla_kv.<name>``, for
torch.compile and CUDA graphs (see its docstring for the schemas).
"""
from .._compiled import _C  # noqa: F401 (the compiled kernels, None without them)
from ._common import kernels_available
from .attention import (AttentionPlan, AttentionSchedule, attention_plan, attention_schedule, decode, decode_workspace_size, merge_states,
                        prefill, sparse_attention, sparse_attention_schedule)
from .expanded import expanded_attention, prefill_expanded, prefill_expanded_workspace_size
from .gather import gather_kv
from .indexer import index_scores
from .index_keys import write_index_keys, write_index_keys_blocks
from .index_topk import index_topk, index_topk_workspace_size
from .write import fused_write_kv, fused_write_kv_blocks, write_kv, write_kv_blocks

from . import library  # noqa: E402,F401 (registers torch.ops.mla_kv.*)

__all__ = [
    "AttentionPlan", "AttentionSchedule", "attention_plan", "attention_schedule", "decode", "decode_workspace_size", "expanded_attention", "fused_write_kv",
    "fused_write_kv_blocks", "gather_kv", "index_scores", "index_topk", "index_topk_workspace_size", "kernels_available", "merge_states", "prefill", "prefill_expanded",
    "prefill_expanded_workspace_size", "sparse_attention", "sparse_attention_schedule", "write_kv",
    "write_kv_blocks", "write_index_keys", "write_index_keys_blocks",
]
