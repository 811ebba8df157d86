"""mla_kv: the MLA latent KV cache (c_kv 512 + k_pe 64 per token and layer) done right.

Ops take torch tensors; CUDA tensors run the compiled kernels, CPU tensors the pure-PyTorch
reference (mla_kv.reference), which is the specification of every op.
"""
from . import layout, reference, rope
from .layout import BlockPointerCache, BlockPool
from .ops import fused_write_kv, fused_write_kv_blocks, kernels_available, write_kv, write_kv_blocks

__version__ = "0.1.0"

__all__ = [
    "BlockPointerCache", "BlockPool", "fused_write_kv", "fused_write_kv_blocks", "kernels_available",
    "layout", "reference", "rope", "write_kv", "write_kv_blocks",
]
