"""``three_path``: decode, extend and prefill routed to specialised kernels (the arrangement of vLLM's ROCm
attention backends).

- decode rows → :func:`paged_decode` (split-KV, GQA-packed; the cache may be NHD or shuffled); verify
  rows (the decode slice's decodes of several tokens, after the one-token ones: speculative decoding,
  ``decode_threshold > 1``) → :func:`paged_verify` (split-KV, a request's tokens and GQA heads in one tile;
  its tile is sized for ``decode_threshold`` tokens, so one variant serves every step), or the whole decode
  slice → :func:`unified_attention` past :data:`~tripath.ops.verify.MAX_VERIFY_TOKENS`;
- extend rows → for each chunk of cached context: gather into the workspace, non-causal
  :func:`varlen_attention` with LSE, and :func:`merge_states` into the running result; the new tokens
  by causal :func:`varlen_attention`, joined with the last chunk (below) or, for fp8 caches, in their own
  pass over the step's keys, merged with the context;
- prefill rows → causal :func:`varlen_attention` over the new tokens.
Sinks go to the pass that holds the new tokens only, so each row counts them once.

On a GPU, when a step has decode rows beside extend or prefill rows, the decode launch goes last, on a
side stream forked after the cache write (it reads that cache and writes rows of the output no other
launch touches), and the main stream joins it before returning: the memory-bound decode programs fill the
ragged last waves of the compute-bound prefill kernels and the gaps between the extend's dependent
launches. :func:`overlap_decode_by_default` decides per GPU (off on sm_90, where the persistent Gluon
prefill kernel leaves no ragged waves). Likewise, when a step has both extend and prefill rows, the
prefill launch runs on a second side stream, so each of the two compute-bound launches fills the other's
last wave; the prefill then takes the large tiles even when it has few (``concurrent``). CUDA graphs
capture the forks and joins; the output is bit-identical to the serial order.

The extends' last context chunk is gathered together with their new tokens (already in the cache) and
attended in one causal launch, when the cache holds the keys' own dtype (so the gathered new rows are
exactly the step's keys; an fp8 cache keeps the separate new-token pass, which uses the unquantised keys).
With one chunk, the usual case, that is one gather and one launch, with no merge; the prefills of the step
then join that gather and launch too (:class:`ThreePathMetadata`), so a step of decodes, extends and
prefills costs the cache write, the decode, one gather and one causal launch on one stream. Each launch
costs host time, which decides steps of small tensor-parallel shards, where a layer's attention is little
GPU work (docs/BENCHMARKS.md, "Measurements behind the code's choices"); the extra gather of the prefills'
keys costs little GPU time beside that.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from tripath import _env
from tripath.attention.backends.base import MHAAttentionBackend, Capabilities, attend_joined_chunks
from tripath.attention.metadata import AttentionMetadata, ContextChunk, ExtendMetadata, copy_step_tensor
from tripath.attention.step_ints import StepInts, cumsum
from tripath.attention.validate import check_offsets, expect, host_ints
from tripath.attention.spec import KVCache
from tripath.ops import gather_kv_cache, merge_states, paged_decode, paged_verify, unified_attention, varlen_attention
from tripath.ops.verify import MAX_VERIFY_TOKENS
from tripath.platform import Platform, current_platform


@dataclass
class ThreePathMetadata(AttentionMetadata):
    """The common metadata plus, for a step with extends whose cached context is one chunk and prefills
    after them, the single launch that attends both (``E`` extends, ``P`` prefills, rows ``D … D + E + P``
    of the plan):

    - ``prompts``: a :class:`ContextChunk` over each extend's whole sequence (context and new tokens) and
      each prefill's new tokens, gathered from the cache after the write: ``cu_seqlens_k [E + P + 1]``,
      ``seq_starts [E + P]`` all 0, ``q_positions_start [E + P]`` = the extends' context lengths, then 0;
    - ``prompts_cu_seqlens_q [E + P + 1]``: their query offsets, counted from 0.

    Both None otherwise. Built in ``build_metadata``, once per step (one host-to-device copy)."""

    prompts: ContextChunk | None = None
    prompts_cu_seqlens_q: torch.Tensor | None = None

    def copy_(self, other: "ThreePathMetadata") -> "ThreePathMetadata":
        super().copy_(other)
        copy_step_tensor("prompts_cu_seqlens_q", self.prompts_cu_seqlens_q, other.prompts_cu_seqlens_q)
        return self

    def validate_own(self, num_blocks: int, block_size: int) -> None:
        if self.prompts is None:
            expect(self.prompts_cu_seqlens_q is None, "metadata.prompts_cu_seqlens_q is set without prompts")
            return
        plan = self.plan
        expect(plan.num_extends > 0 and plan.num_prefills > 0 and plan.extend_chunks.num_chunks == 1,
               "metadata.prompts is set, but the step has no extends with one context chunk beside prefills")
        nd = plan.num_decodes
        check_offsets("prompts_cu_seqlens_q", host_ints(self.prompts_cu_seqlens_q), list(plan.query_lens[nd:]))
        check_offsets("prompts.cu_seqlens_k", host_ints(self.prompts.cu_seqlens_k), list(plan.seq_lens[nd:]))
        expect(host_ints(self.prompts.seq_starts) == [0] * (plan.num_requests - nd),
               "metadata.prompts.seq_starts must be 0 for every extend and prefill")
        expect(host_ints(self.prompts.q_positions_start) == list(plan.context_lens[nd:]),
               "metadata.prompts.q_positions_start must be each request's context length")


class ThreePathBackend(MHAAttentionBackend):
    name = "three_path"
    # verify graphs: paged_verify reads the captured verify slice's tensors; its host values (first row, token
    # start, max_query_len) are the padded plan's, the same on every step
    capabilities = Capabilities(verify_graphs=True, draft_trees=True)

    def __init__(self, spec, device="cpu"):
        super().__init__(spec, device)
        self._side_streams: dict[str, torch.cuda.Stream] = {}

    @staticmethod
    def _joins_prompts(plan) -> bool:
        """Extends of one context chunk beside prefills: one gather and one causal launch for both."""
        return bool(plan.num_extends and plan.num_prefills and plan.extend_chunks.num_chunks == 1)

    def add_own_ints(self, plan, ints: StepInts) -> None:
        """``prompts`` (steps that join extends and prefills): their ``cu_seqlens_k [R + 1]``, ``seq_starts
        [R]`` (zeros), ``q_positions_start [R]`` (context lengths) and ``cu_seqlens_q [R + 1]``, ``R`` the
        prompt rows."""
        if self._joins_prompts(plan):
            nd, rows = plan.num_decodes, plan.num_requests - plan.num_decodes
            ints.add("prompts", cumsum(plan.seq_lens[nd:]) + [0] * rows + list(plan.context_lens[nd:]) +
                     cumsum(plan.query_lens[nd:]))

    def build_metadata(self, plan, block_table, slot_mapping, *, decode_num_splits=None,
                       ints=None) -> ThreePathMetadata:
        ints = self.device_ints(plan, block_table.device, ints)
        common = super().build_metadata(plan, block_table, slot_mapping, decode_num_splits=decode_num_splits,
                                        ints=ints)
        prompts = prompts_cu_q = None
        if self._joins_prompts(plan):
            nd, rows = plan.num_decodes, plan.num_requests - plan.num_decodes
            seq_lens = plan.seq_lens[nd:]
            packed = ints.view("prompts")
            prompts = ContextChunk(cu_seqlens_k=packed[:rows + 1], seq_starts=packed[rows + 1:2 * rows + 1],
                                   q_positions_start=packed[2 * rows + 1:3 * rows + 1], max_len=max(seq_lens),
                                   num_tokens=sum(seq_lens))
            prompts_cu_q = packed[3 * rows + 1:]
        return ThreePathMetadata.from_common(common, prompts=prompts, prompts_cu_seqlens_q=prompts_cu_q)

    def forward(self, q, k, v, cache: KVCache, meta: ThreePathMetadata, *, alibi_slopes=None, sinks=None,
                out=None, window_left=None):
        opts = self._options(alibi_slopes, sinks, window_left)
        self._write(k, v, cache, meta)
        out = self._out(q, out)
        on_gpu = q.is_cuda
        overlap_decode = on_gpu and overlap_decode_by_default(current_platform(q.device))
        # extends of one context chunk beside prefills: both in one gather and one causal launch
        joined = meta.prompts is not None and cache.k_cache.dtype == k.dtype
        decode_side = self._fork("decode", q.device, overlap_decode and meta.decode is not None
                                 and (meta.extend is not None or meta.prefill is not None))
        prefill_side = self._fork("prefill", q.device, on_gpu and not joined and meta.prefill is not None
                                  and meta.extend is not None)
        if meta.decode is not None and decode_side is None:
            self._decode(q, cache, meta, out, opts, concurrent=False)
        if joined:
            self._prompts_joined(q, cache, meta, out, dict(opts, concurrent=decode_side is not None))
        elif meta.extend is not None:  # beside the decode: launches sized so SMs pass to it as programs finish
            self._extend(q, k, v, cache, meta.extend, out, dict(opts, concurrent=decode_side is not None))
        if meta.prefill is not None and not joined:
            p = meta.prefill
            with torch.cuda.stream(prefill_side) if prefill_side is not None else contextlib.nullcontext():
                varlen_attention(q[p.token_start:p.token_end], k[p.token_start:p.token_end],
                                 v[p.token_start:p.token_end], p.cu_seqlens_q, p.cu_seqlens_q, p.max_query_len,
                                 p.max_query_len, causal=True, out=out[p.token_start:p.token_end],
                                 concurrent=prefill_side is not None, **opts)
        if decode_side is not None:  # launched last: its programs fill the extend/prefill kernels' ragged waves
            with torch.cuda.stream(decode_side):
                self._decode(q, cache, meta, out, opts, concurrent=True)
        for side in (prefill_side, decode_side):
            if side is not None:
                torch.cuda.current_stream(q.device).wait_stream(side)
        return out

    def _fork(self, name: str, device: torch.device, wanted: bool) -> torch.cuda.Stream | None:
        """This backend's side stream ``name`` on ``device``, made to wait for the main stream's work so far
        (the cache write); None when not ``wanted``."""
        if not wanted:
            return None
        side = self._side_streams.get(name)
        if side is None or side.device != device:
            side = self._side_streams[name] = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        return side

    def _decode(self, q, cache: KVCache, meta: AttentionMetadata, out: torch.Tensor, opts: dict, *,
                concurrent: bool) -> None:
        """``concurrent``: the decode runs beside the extend/prefill launches (tile hint to the op)."""
        d = meta.decode
        k_scale, v_scale = self._scales(cache)
        if d.single_token:
            paged_decode(q[:d.num_tokens], cache.k_cache, cache.v_cache, d.block_table, d.seq_lens,
                         layout=cache.layout, k_scale=k_scale, v_scale=v_scale, num_splits=d.num_splits,
                         out=out[:d.num_tokens], concurrent=concurrent, **opts)
        elif self.spec.decode_threshold <= MAX_VERIFY_TOKENS:   # one-token decodes, then the verifies
            v = d.verify
            if v.first_row:
                n = v.first_row
                paged_decode(q[:n], cache.k_cache, cache.v_cache, d.block_table[:n], d.seq_lens[:n],
                             layout=cache.layout, k_scale=k_scale, v_scale=v_scale, out=out[:n],
                             concurrent=concurrent, **opts)
            rows = slice(v.token_start, d.num_tokens)
            paged_verify(q[rows], cache.k_cache, cache.v_cache, v.block_table, v.seq_lens, v.cu_seqlens_q,
                         self.spec.decode_threshold, layout=cache.layout, k_scale=k_scale, v_scale=v_scale,
                         out=out[rows], tree_mask=v.tree_mask, **opts)
        else:
            unified_attention(q[:d.num_tokens], cache.k_cache, cache.v_cache, d.block_table, d.seq_lens,
                              d.cu_seqlens_q, d.max_query_len, layout=cache.layout, k_scale=k_scale,
                              v_scale=v_scale, out=out[:d.num_tokens], **opts)

    def _extend(self, q, k, v, cache: KVCache, e: ExtendMetadata, out: torch.Tensor, opts: dict) -> None:
        if e.tail is not None and cache.k_cache.dtype == k.dtype:
            self._extend_joined(q, cache, e, out, opts)
            return
        q_e = q[e.token_start:e.token_end]
        acc, lse = varlen_attention(q_e, k[e.token_start:e.token_end], v[e.token_start:e.token_end],
                                    e.cu_seqlens_q, e.cu_seqlens_q, e.max_query_len, e.max_query_len,
                                    causal=True, return_lse=True, **opts)
        if not e.chunks:
            out[e.token_start:e.token_end] = acc
            return
        ws_k, ws_v = self._workspace(q, e.workspace_tokens)
        chunk_opts = dict(opts, sinks=None)
        for i, chunk in enumerate(e.chunks):
            part, part_lse = self._chunk(q_e, cache, e, chunk, ws_k, ws_v, causal=False, **chunk_opts)
            last = i == len(e.chunks) - 1
            acc, lse = merge_states(acc, lse, part, part_lse,
                                    out=out[e.token_start:e.token_end] if last else None)

    def _extend_joined(self, q, cache: KVCache, e: ExtendMetadata, out: torch.Tensor, opts: dict) -> None:
        """Chunks before the last as above; the last chunk gathered together with the new tokens (already in
        the cache, bit-identical there when the cache has the keys' dtype) and attended in one causal launch
        (query ``i`` of an extend sits at ``context_len + i``, bottom-right in the joined keys). One chunk (the
        usual case) is a single gather and a single launch written straight into ``out``, with no merge."""
        q_e = q[e.token_start:e.token_end]
        ws_k, ws_v = self._workspace(q, max(e.workspace_tokens, e.tail_tokens))

        def attend(chunk, *, causal: bool, out=None):
            chunk_opts = opts if chunk is e.tail else dict(opts, sinks=None)  # sinks once, with the new tokens
            return self._chunk(q_e, cache, e, chunk, ws_k, ws_v, causal=causal, out=out, **chunk_opts)

        attend_joined_chunks(e, attend, out[e.token_start:e.token_end])

    def _prompts_joined(self, q, cache: KVCache, meta: ThreePathMetadata, out: torch.Tensor, opts: dict) -> None:
        """The extends (one context chunk each) and the prefills in one launch: every extend's whole
        sequence and every prefill's new tokens gathered from the cache (the keys' own dtype, so the new rows
        are exactly the step's keys), then one causal :func:`varlen_attention` whose query ``i`` of a request
        sits at ``context_len + i``. One gather and one launch where the separate paths take two launches
        and a second stream; the gather copies the prefills' keys once more."""
        e, p, chunk = meta.extend, meta.prefill, meta.prompts
        ws_k, ws_v = self._workspace(q, chunk.num_tokens)
        k_scale, v_scale = self._scales(cache)
        rows = slice(e.token_start, p.token_end)
        gather_kv_cache(cache.k_cache, cache.v_cache, meta.block_table[meta.plan.num_decodes:], chunk.cu_seqlens_k,
                        chunk.seq_starts, layout=cache.layout, k_scale=k_scale, v_scale=v_scale, out_k=ws_k,
                        out_v=ws_v)
        varlen_attention(q[rows], ws_k[:chunk.num_tokens], ws_v[:chunk.num_tokens], meta.prompts_cu_seqlens_q,
                         chunk.cu_seqlens_k, max(e.max_query_len, p.max_query_len), chunk.max_len, causal=True,
                         q_positions_start=chunk.q_positions_start, out=out[rows], **opts)

    def _workspace(self, q, tokens: int):
        shape = (tokens, self.spec.num_kv_heads)
        return (torch.empty(*shape, self.spec.head_size, dtype=q.dtype, device=q.device),
                torch.empty(*shape, self.spec.v_size, dtype=q.dtype, device=q.device))

    def _chunk(self, q_e, cache: KVCache, e: ExtendMetadata, chunk, ws_k, ws_v, *, causal: bool, out=None,
               **opts):
        """Gather one chunk's rows into the workspace and attend the extends' queries to them: with the LSE
        (for a merge) unless ``out`` is given."""
        k_scale, v_scale = self._scales(cache)
        gather_kv_cache(cache.k_cache, cache.v_cache, e.block_table, chunk.cu_seqlens_k, chunk.seq_starts,
                        layout=cache.layout, k_scale=k_scale, v_scale=v_scale, out_k=ws_k, out_v=ws_v)
        rows = chunk.num_tokens  # the gathered rows only: the rest of the workspace holds stale values
        return varlen_attention(q_e, ws_k[:rows], ws_v[:rows], e.cu_seqlens_q, chunk.cu_seqlens_k, e.max_query_len,
                                chunk.max_len, causal=causal, q_positions_start=chunk.q_positions_start,
                                return_lse=out is None, out=out, **opts)


def overlap_decode_by_default(platform: Platform) -> bool:
    """Whether the decode goes on a side stream beside the extend and prefill launches: yes, except on sm_90
    with the Gluon prefill kernel enabled, whose persistent programs leave no ragged waves to fill (there
    the overlap measured slower than the serial order; docs/BENCHMARKS.md, mixed step)."""
    return not (platform.is_hopper and not _env.gluon_disabled())
