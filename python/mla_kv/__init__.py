"""mla_kv: the MLA latent KV cache (c_kv 512 + k_pe 64 per token and layer) done right.

Ops take torch tensors; CUDA tensors run the compiled kernels, CPU tensors the pure-PyTorch
reference (mla_kv.reference), which is the specification of every op.
"""
from . import gpus, layout, parallel, reference, rope, routes, weights
from .layout import BlockPointerCache, BlockPool
from .ops import (AttentionPlan, AttentionSchedule, attention_plan, attention_schedule, decode, decode_workspace_size,
                  expanded_attention, fused_write_kv, fused_write_kv_blocks, gather_kv, kernels_available, merge_states, prefill, prefill_expanded,
                  prefill_expanded_workspace_size, sparse_attention, sparse_attention_schedule, write_kv,
                  write_kv_blocks)
from .ops import index_scores, index_topk, index_topk_workspace_size
from .ops import write_index_keys, write_index_keys_blocks
from .routes import choose_prefill_route
from .weights import absorb_q, project_out, split_kv_b_proj

__version__ = "0.1.0"

__all__ = [
    "AttentionPlan", "AttentionSchedule", "BlockPointerCache", "BlockPool", "absorb_q", "attention_plan",
    "attention_schedule", "choose_prefill_route", "decode",
    "decode_workspace_size", "expanded_attention", "fused_write_kv", "fused_write_kv_blocks", "gather_kv", "gpus", "index_scores", "index_topk", "index_topk_workspace_size", "kernels_available",
    "layout", "parallel",
    "merge_states", "prefill", "prefill_expanded", "prefill_expanded_workspace_size", "project_out", "reference",
    "rope", "routes", "sparse_attention", "sparse_attention_schedule", "split_kv_b_proj", "weights", "write_kv",
    "write_kv_blocks", "write_index_keys", "write_index_keys_blocks",
]
