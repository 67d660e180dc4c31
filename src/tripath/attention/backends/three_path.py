"""``three_path``: decode, extend and prefill routed to specialised kernels (the seed's ROCM_AITER_FA).

- decode rows → :func:`paged_decode` (split-KV, GQA-packed; the cache may be NHD or shuffled); decodes
  with several query tokens (speculative) → :func:`unified_attention` on the decode slice;
- extend rows → causal :func:`varlen_attention` over the new tokens (with LSE), then for each chunk of
  cached context: gather into the workspace, non-causal :func:`varlen_attention` with LSE, and
  :func:`merge_states` into the running result;
- prefill rows → causal :func:`varlen_attention` over the new tokens.
Sinks go to the new-token pass only, so each row counts them once.

On a GPU, when a step has decode rows beside extend or prefill rows, the decode launch goes last, on a
side stream forked after the cache write (``overlap_decode``; it reads that cache and writes rows of the
output no other launch touches), and the main stream joins it before returning: the memory-bound decode
programs fill the ragged last waves of the compute-bound prefill kernels and the gaps between the
extend's dependent launches. H200, ANCHORS.md mixed step: 1086 → 1068 µs GPU time, bit-identical output.
CUDA graphs capture the fork and the join.
"""

from __future__ import annotations

import torch

from tripath.attention.backends.base import AttentionBackend, Capabilities
from tripath.attention.metadata import AttentionMetadata, ExtendMetadata
from tripath.attention.spec import KVCache
from tripath.ops import gather_kv_cache, merge_states, paged_decode, unified_attention, varlen_attention


class ThreePathBackend(AttentionBackend):
    name = "three_path"
    capabilities = Capabilities()
    overlap_decode = True  # decode on a side stream beside extend/prefill (GPU only)

    def __init__(self, spec, device="cpu"):
        super().__init__(spec, device)
        self._side_stream = None

    def forward(self, q, k, v, cache: KVCache, meta: AttentionMetadata, *, alibi_slopes=None, sinks=None,
                out=None, window_left=None):
        opts = self._options(alibi_slopes, sinks, window_left)
        self._write(k, v, cache, meta)
        out = self._out(q, out)
        side = None
        if (meta.decode is not None and (meta.extend is not None or meta.prefill is not None)
                and self.overlap_decode and q.is_cuda):
            side = self._side(q.device)
            side.wait_stream(torch.cuda.current_stream(q.device))  # fork after the cache write
        if meta.decode is not None and side is None:
            self._decode(q, cache, meta, out, opts)
        if meta.extend is not None:
            self._extend(q, k, v, cache, meta.extend, out, opts)
        if meta.prefill is not None:
            p = meta.prefill
            varlen_attention(q[p.token_start:p.token_end], k[p.token_start:p.token_end],
                             v[p.token_start:p.token_end], p.cu_seqlens_q, p.cu_seqlens_q, p.max_query_len,
                             p.max_query_len, causal=True, out=out[p.token_start:p.token_end], **opts)
        if side is not None:  # launched last: its programs fill the extend/prefill kernels' ragged waves
            with torch.cuda.stream(side):
                self._decode(q, cache, meta, out, opts)
            torch.cuda.current_stream(q.device).wait_stream(side)
        return out

    def _side(self, device: torch.device) -> torch.cuda.Stream:
        if self._side_stream is None or self._side_stream.device != device:
            self._side_stream = torch.cuda.Stream(device=device)
        return self._side_stream

    def _decode(self, q, cache: KVCache, meta: AttentionMetadata, out: torch.Tensor, opts: dict) -> None:
        d = meta.decode
        k_scale, v_scale = self._scales(cache)
        if d.single_token:
            paged_decode(q[:d.num_tokens], cache.k_cache, cache.v_cache, d.block_table, d.seq_lens,
                         layout=cache.layout, k_scale=k_scale, v_scale=v_scale, num_splits=d.num_splits,
                         out=out[:d.num_tokens], **opts)
        else:
            unified_attention(q[:d.num_tokens], cache.k_cache, cache.v_cache, d.block_table, d.seq_lens,
                              d.cu_seqlens_q, d.max_query_len, layout=cache.layout, k_scale=k_scale,
                              v_scale=v_scale, out=out[:d.num_tokens], **opts)

    def _extend(self, q, k, v, cache: KVCache, e: ExtendMetadata, out: torch.Tensor, opts: dict) -> None:
        q_e = q[e.token_start:e.token_end]
        acc, lse = varlen_attention(q_e, k[e.token_start:e.token_end], v[e.token_start:e.token_end],
                                    e.cu_seqlens_q, e.cu_seqlens_q, e.max_query_len, e.max_query_len,
                                    causal=True, return_lse=True, **opts)
        if not e.chunks:
            out[e.token_start:e.token_end] = acc
            return
        k_scale, v_scale = self._scales(cache)
        shape = (e.workspace_tokens, self.spec.num_kv_heads)
        ws_k = torch.empty(*shape, self.spec.head_size, dtype=q.dtype, device=q.device)
        ws_v = torch.empty(*shape, self.spec.v_size, dtype=q.dtype, device=q.device)
        chunk_opts = dict(opts, sinks=None)
        for i, chunk in enumerate(e.chunks):
            gather_kv_cache(cache.k_cache, cache.v_cache, e.block_table, chunk.cu_seqlens_k, chunk.seq_starts,
                            layout=cache.layout, k_scale=k_scale, v_scale=v_scale, out_k=ws_k, out_v=ws_v)
            part, part_lse = varlen_attention(q_e, ws_k, ws_v, e.cu_seqlens_q, chunk.cu_seqlens_k,
                                              e.max_query_len, chunk.max_len, causal=False,
                                              q_positions_start=chunk.q_positions_start, return_lse=True,
                                              **chunk_opts)
            last = i == len(e.chunks) - 1
            acc, lse = merge_states(acc, lse, part, part_lse,
                                    out=out[e.token_start:e.token_end] if last else None)
