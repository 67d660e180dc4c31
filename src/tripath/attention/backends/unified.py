"""``unified``: the whole mixed batch in one :func:`unified_attention` launch (after the KV write)."""

from __future__ import annotations

from tripath.attention.backends.base import MHAAttentionBackend, Capabilities
from tripath.ops import unified_attention


class UnifiedBackend(MHAAttentionBackend):
    name = "unified"
    capabilities = Capabilities(verify_graphs=True)   # one launch on device tensors; max_query_len the padded one

    def forward(self, q, k, v, cache, meta, *, alibi_slopes=None, sinks=None, out=None, window_left=None):
        opts = self._options(alibi_slopes, sinks, window_left)
        self._write(k, v, cache, meta)
        k_scale, v_scale = self._scales(cache)
        return unified_attention(q, cache.k_cache, cache.v_cache, meta.block_table, meta.seq_lens,
                                 meta.cu_seqlens_q, meta.max_query_len, layout=cache.layout, k_scale=k_scale,
                                 v_scale=v_scale, out=self._out(q, out), **opts)
