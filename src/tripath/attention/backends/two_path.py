"""``two_path`` (the arrangement of the legacy ROCM_ATTN backend among vLLM's ROCm attention backends): one context-attention launch for every request with more
than one new token (its queries against its cached context plus its new tokens, read from the paged cache
after the write), and :func:`paged_decode` for the single-token decodes."""

from __future__ import annotations

from tripath.attention.backends.base import MHAAttentionBackend, Capabilities
from tripath.ops import paged_decode, unified_attention


class TwoPathBackend(MHAAttentionBackend):
    name = "two_path"
    capabilities = Capabilities(max_decode_threshold=1)

    def forward(self, q, k, v, cache, meta, *, alibi_slopes=None, sinks=None, out=None, window_left=None):
        opts = self._options(alibi_slopes, sinks, window_left)
        self._write(k, v, cache, meta)
        out = self._out(q, out)
        k_scale, v_scale = self._scales(cache)
        nd = meta.decode.num_reqs if meta.decode is not None else 0
        if nd:
            d = meta.decode
            paged_decode(q[:nd], cache.k_cache, cache.v_cache, d.block_table, d.seq_lens, layout=cache.layout,
                         k_scale=k_scale, v_scale=v_scale, num_splits=d.num_splits, out=out[:nd], **opts)
        if nd < meta.plan.num_requests:
            rest = meta.cu_seqlens_q[nd:]
            local_cu = meta.extra.get("two_path_cu")
            if local_cu is None:  # offsets of the multi-token requests, from 0 (one subtraction per step)
                local_cu = meta.extra["two_path_cu"] = rest - meta.cu_seqlens_q[nd]
            unified_attention(q[nd:], cache.k_cache, cache.v_cache, meta.block_table[nd:], meta.seq_lens[nd:],
                              local_cu, meta.max_query_len, layout=cache.layout, k_scale=k_scale,
                              v_scale=v_scale, out=out[nd:], **opts)
        return out
