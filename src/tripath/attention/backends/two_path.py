"""``two_path`` (the arrangement of the legacy ROCM_ATTN backend among vLLM's ROCm attention backends): one context-attention launch for every request with more
than one new token (its queries against its cached context plus its new tokens, read from the paged cache
after the write), and :func:`paged_decode` for the single-token decodes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tripath.attention.backends.base import MHAAttentionBackend, Capabilities
from tripath.attention.metadata import AttentionMetadata, copy_step_tensor
from tripath.attention.validate import check_offsets, expect, host_ints
from tripath.ops import paged_decode, unified_attention


@dataclass
class TwoPathMetadata(AttentionMetadata):
    """The common metadata plus the context-attention launch's query offsets.

    ``context_cu_seqlens_q``: ``[B − D + 1]`` int32, the query offsets of the requests after the ``D``
    decodes (extends and prefills), counted from 0 (``cu_seqlens_q[D:] − cu_seqlens_q[D]``: that launch
    reads ``q[cu_seqlens_q[D]:]``); None when every request is a decode. Built in ``build_metadata``, once
    per step; copied in place by :meth:`copy_`."""

    context_cu_seqlens_q: torch.Tensor | None = None

    def copy_(self, other: "TwoPathMetadata") -> "TwoPathMetadata":
        super().copy_(other)
        copy_step_tensor("context_cu_seqlens_q", self.context_cu_seqlens_q, other.context_cu_seqlens_q)
        return self

    def validate_own(self, num_blocks: int, block_size: int) -> None:
        plan = self.plan
        nd = plan.num_decodes
        if nd == plan.num_requests:
            expect(self.context_cu_seqlens_q is None, "metadata.context_cu_seqlens_q is set in a step of decodes "
                                                      "only")
            return
        expect(self.context_cu_seqlens_q is not None, "metadata.context_cu_seqlens_q is missing for "
                                                      f"{plan.num_requests - nd} requests after the decodes")
        check_offsets("context_cu_seqlens_q", host_ints(self.context_cu_seqlens_q), list(plan.query_lens[nd:]))


class TwoPathBackend(MHAAttentionBackend):
    name = "two_path"
    # no verify graphs: verifies are extends here, whose context-attention launch is sized on the step's host
    # lengths (they take today's route: piecewise graphs or eager)
    capabilities = Capabilities(max_decode_threshold=1)

    def build_metadata(self, plan, block_table, slot_mapping, *, decode_num_splits=None, ints=None) -> TwoPathMetadata:
        common = super().build_metadata(plan, block_table, slot_mapping, decode_num_splits=decode_num_splits,
                                        ints=ints)
        nd = plan.num_decodes
        context_cu = None
        if nd < plan.num_requests:  # one subtraction on the device per step (no host sync)
            context_cu = common.cu_seqlens_q[nd:] - common.cu_seqlens_q[nd]
        return TwoPathMetadata.from_common(common, context_cu_seqlens_q=context_cu)

    def forward(self, q, k, v, cache, meta: TwoPathMetadata, *, alibi_slopes=None, sinks=None, out=None,
                window_left=None):
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
            unified_attention(q[nd:], cache.k_cache, cache.v_cache, meta.block_table[nd:], meta.seq_lens[nd:],
                              meta.context_cu_seqlens_q, meta.max_query_len, layout=cache.layout, k_scale=k_scale,
                              v_scale=v_scale, out=out[nd:], **opts)
        return out
