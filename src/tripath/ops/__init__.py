"""Attention ops: a Triton kernel each, a launcher that validates, a PyTorch reference beside it.

On CUDA/ROCm tensors (or on CPU under ``TRITON_INTERPRET=1``) the Triton kernel runs; otherwise the
PyTorch reference does.
"""

from tripath.ops.attention import merge_states, paged_decode, unified_attention, varlen_attention
from tripath.ops.kv_cache import allocate_kv_cache, gather_kv_cache, kv_cache_shapes, write_kv_cache
from tripath.ops.mla import (allocate_mla_cache, concat_and_cache_mla, concat_mla_query,
                             fused_qk_rope_concat_and_cache_mla, gather_mla_cache)
from tripath.ops.mixed_attention import (MixedAttentionWorkspace, mixed_attention, mixed_attention_workspace,
                                         plan_mixed_attention)
from tripath.ops.mla_absorbed import mla_decode
from tripath.ops.mla_verify import mla_verify
from tripath.ops.rotary import identity_rope_tables, rope_cos_sin, rotary_embedding
from tripath.ops.verify import paged_verify

__all__ = [
    "varlen_attention", "paged_decode", "paged_verify", "unified_attention", "merge_states",
    "mixed_attention", "mixed_attention_workspace", "plan_mixed_attention", "MixedAttentionWorkspace",
    "write_kv_cache", "gather_kv_cache", "allocate_kv_cache", "kv_cache_shapes",
    "mla_decode", "mla_verify", "concat_and_cache_mla", "gather_mla_cache", "concat_mla_query",
    "fused_qk_rope_concat_and_cache_mla", "allocate_mla_cache",
    "rotary_embedding", "rope_cos_sin", "identity_rope_tables",
]
