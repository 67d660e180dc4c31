"""Attention ops: a Triton kernel each, a launcher that validates, a PyTorch reference beside it.

On CUDA/ROCm tensors (or on CPU under ``TRITON_INTERPRET=1``) the Triton kernel runs; otherwise the
PyTorch reference does.
"""

from tripath.ops.attention import merge_states, paged_decode, unified_attention, varlen_attention
from tripath.ops.kv_cache import allocate_kv_cache, gather_kv_cache, kv_cache_shapes, write_kv_cache

__all__ = [
    "varlen_attention", "paged_decode", "unified_attention", "merge_states",
    "write_kv_cache", "gather_kv_cache", "allocate_kv_cache", "kv_cache_shapes",
]
