"""The pure-PyTorch specification of every mla_kv op.

Each function here is what the matching kernel computes, written for clarity rather than speed, and
runs on any device and dtype (float64 included). Kernels are tested against these functions.

Shapes use T tokens, H heads, R = 576 = 512 (latent c_kv) + 64 (rope key k_pe).

By family: ``write`` (rms_norm, apply_rope, write_kv, fused_write_kv), ``attention`` (decode, prefill,
merge_states and the block-pool forms), ``gather`` (gather_kv, gather_kv_blocks) and ``quant``
(the byte layouts of the quantized cache formats: quantize_rows, dequantize_rows, pack_blocks,
unpack_blocks), ``sparse`` (sparse_attention and its block-pool form: DeepSeek Sparse Attention over
the rows an index names) and ``expanded`` (prefill_expanded: the expanded-route prefill; expanded_attention:
its attention over per-head K and V); ``index_keys`` (write_index_keys and its block-pointer form, with
index_key_rows, hadamard_128 and quantize_index_keys: the indexer's key cache). DeepSeek-V4: ``v4_cache``
(its 512-wide K = V rows in bf16, the 584-byte fp8 and the 528-byte MXFP8 page-split formats; write_v4_kv),
``v4_compress`` (the CSA and HCA compressors, prefill and step by step) and ``v4_attention``
(v4_sparse_attention: window and compressed sets under one softmax with the per-head sink).
"""
from .attention import decode, decode_blocks, merge_states, prefill, prefill_blocks
from .expanded import expanded_attention, prefill_expanded
from .gather import gather_kv, gather_kv_blocks
from .indexer import index_scores
from .index_keys import hadamard_128, index_key_rows, quantize_index_keys, write_index_keys, write_index_keys_blocks
from .index_topk import index_topk
from .quant import dequantize_rows, pack_blocks, quantize_rows, unpack_blocks
from .sparse import sparse_attention, sparse_attention_blocks
from .v4_attention import v4_sparse_attention
from .v4_cache import dequantize_v4_rows, quantize_v4_rows, read_v4_rows, v4_kv_rows, v4_q_rows, write_v4_kv
from .v4_compress import CompressorState, compress_prefill, compress_step
from .write import LATENT_DIM, ROPE_DIM, ROW_DIM, apply_rope, fused_write_kv, rms_norm, write_kv

__all__ = [
    "LATENT_DIM", "ROPE_DIM", "ROW_DIM", "apply_rope", "decode", "decode_blocks", "dequantize_rows",
    "expanded_attention", "fused_write_kv", "gather_kv", "gather_kv_blocks", "index_scores", "index_topk", "merge_states", "pack_blocks",
    "prefill", "prefill_blocks", "prefill_expanded", "quantize_rows", "rms_norm", "sparse_attention",
    "sparse_attention_blocks", "unpack_blocks", "write_kv",
    "hadamard_128", "index_key_rows", "quantize_index_keys", "write_index_keys", "write_index_keys_blocks",
    "CompressorState", "compress_prefill", "compress_step", "dequantize_v4_rows", "quantize_v4_rows", "read_v4_rows",
    "v4_kv_rows", "v4_q_rows", "v4_sparse_attention", "write_v4_kv",
]
