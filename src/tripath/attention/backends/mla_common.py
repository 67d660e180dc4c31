"""What the MLA backends (``mla``, ``mla_triton``) share: the cache, the metadata, and the phase routing.

Dims: ``H`` heads, latent ``L``, rotary ``R``, no-position ``P``, value ``V`` (DeepSeek: 512 / 64 / 128 / 128);
``W_UK [H, P, L]`` and ``W_UV [H, L, V]`` are ``kv_b_proj`` split per head. The step's inputs are
``q_nope [T, H, P]``, unrotated ``q_pe [T, H, R]``, ``kv_c [T, L]``, unrotated ``k_pe [T, R]``::

    every token      cache[slot] = quant([kv_c | rope(k_pe)])                     (one row of L + R)
    decode  (absorbed)      q = [q_nope·W_UK | rope(q_pe)]        [Td, H, L + R]
                            o = mla_decode(q, cache) · W_UV       [Td, H, L] → [Td, H, V]
    prefill (non-absorbed)  k = [kv_c·W_UKᵀ | rope(k_pe)],  v = kv_c·W_UV         (per head; qk P + R, v V)
                            o = causal varlen_attention(q = [q_nope | rope(q_pe)], k, v)
    extend                  per chunk of cached context: gather latent rows, dequantise, up-project as
                            above, non-causal attention with LSE, merge_states; the new tokens causal:
                            with a cache of the model's dtype, their rows are gathered with the last
                            chunk and attended in one causal launch, otherwise (fp8 caches) in
                            their own pass (with LSE) merged with the context

Scores are ``sm_scale · (q_nope·k_nope + rope(q_pe)·rope(k_pe))`` in both forms, ``sm_scale`` the spec's
(the model folds yarn's ``mscale²`` in) or ``1/sqrt(P + R)``. The backends differ in the decode only:
``mla`` prepares the decode tokens with the fused kernel (when :meth:`MLABackendBase.fused_prep_reasons`
finds nothing against it) and runs the head-packed decode kernel; ``mla_triton`` runs the unfused
preparation (rotary, cache write, query concat: separate launches) and the plain per-head decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from tripath.attention.backends.base import Capabilities, MLAAttentionBackend, attend_joined_chunks
from tripath.attention.metadata import AttentionMetadata, ExtendMetadata, both_set, copy_step_tensor
from tripath.attention.spec import MLACache, MLALayerWeights
from tripath.attention.validate import expect, host_ints
from tripath.ops import (concat_and_cache_mla, concat_mla_query, fused_qk_rope_concat_and_cache_mla,
                         gather_mla_cache, merge_states, mla_decode, mla_verify, rotary_embedding, varlen_attention)
from tripath.ops.mla_verify import gluon_verify_applies
from tripath.constants import MAX_HEAD_SIZE, MIN_HEAD_SIZE
from tripath.platform import FP8_DTYPES

FLOAT_TABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Chains of this many tokens a verify or more take the Gluon verify under verify_kernel "auto" (with fewer than
# 64 heads: from 64 on, a 64-row tile holds one token's heads either way, and decode rows were faster). Decode
# rows cost about a decode per token, the Gluon verify 1.1-2.4 decodes at 4-8 tokens but ~3 µs more at short
# contexts (16 heads, H100): at 8 tokens it was faster from 8 x 2112 and 32 x 576 on, at 4 tokens only from
# 32 x 2112 (docs/BENCHMARKS.md, Speculative decoding).
PACKED_VERIFY_MIN_TOKENS = 8


@dataclass
class MLADecodeRows:
    """Speculative decodes (several query tokens per request) as one decode row per token: token ``i`` of a
    request with ``c`` cached tokens sees ``c + i + 1`` rows through its request's block-table row.

    ``block_table``: ``[Td, width]`` int32, row ``t`` = the block-table row of token ``t``'s request (the
    step's ``width``); ``seq_lens``: ``[Td]`` int32, the rows token ``t`` attends to."""

    block_table: torch.Tensor
    seq_lens: torch.Tensor


@dataclass
class MLAMetadata(AttentionMetadata):
    """The common metadata plus the MLA decode's rows.

    ``decode_rows``: the decode tokens as one decode row each (:class:`MLADecodeRows`) when some decode has
    several query tokens (speculative decoding); None when every decode has one (the decode kernel then
    reads ``decode.block_table`` / ``decode.seq_lens``) or there are no decodes. Built in
    ``build_metadata``, once per step; copied in place by :meth:`copy_`."""

    decode_rows: MLADecodeRows | None = None

    def copy_(self, other: "MLAMetadata") -> "MLAMetadata":
        super().copy_(other)
        mine, theirs = self.decode_rows, other.decode_rows
        if both_set("decode_rows", mine, theirs):
            copy_step_tensor("decode_rows.block_table", mine.block_table, theirs.block_table, table=True)
            copy_step_tensor("decode_rows.seq_lens", mine.seq_lens, theirs.seq_lens)
        return self

    def validate_own(self, num_blocks: int, block_size: int) -> None:
        d, rows = self.decode, self.decode_rows
        if d is None or d.single_token:
            expect(rows is None, "metadata.decode_rows is set without decodes of several tokens")
            return
        expect(rows is not None, "metadata.decode_rows is missing for decodes of several tokens")
        plan = self.plan
        want_rows, want_lens = _decode_rows(plan.query_lens[:d.num_reqs], plan.context_lens[:d.num_reqs])
        expect(host_ints(rows.seq_lens) == want_lens,
               f"metadata.decode_rows.seq_lens is {host_ints(rows.seq_lens)}, expected {want_lens}")
        table = self.block_table
        expect(rows.block_table.shape == (len(want_rows), table.shape[1]),
               f"metadata.decode_rows.block_table has shape {tuple(rows.block_table.shape)}, expected "
               f"{(len(want_rows), table.shape[1])}")
        by_request = host_ints(table)
        for t, (got, r) in enumerate(zip(host_ints(rows.block_table), want_rows)):
            expect(got == by_request[r], f"metadata.decode_rows.block_table row {t} is not request {r}'s row")


def _decode_rows(query_lens, context_lens) -> tuple[list[int], list[int]]:
    """Per decode token: its request's row and the rows it attends to (``context + i + 1``)."""
    rows, lens = [], []
    for j, (q, c) in enumerate(zip(query_lens, context_lens)):
        rows += [j] * q
        lens += [c + i + 1 for i in range(q)]
    return rows, lens


class MLABackendBase(MLAAttentionBackend):
    """The MLA phase routing; subclasses choose the decode kernel and whether the fused preparation runs."""

    # Blocks of 64 rows on a GPU (FlashMLA's page size), a size every fast decode path takes: the Gluon
    # kernels on sm_90 (8-32 heads: 16, 32 or multiples of 64 rows; 64+ heads: multiples of 32) and the
    # packed kernel's descriptor tiles (pages holding whole tiles). Other sizes run the pointer-load kernel.
    # Verify graphs: a verify's tokens are decode rows (MLAMetadata.decode_rows, copied in place).
    capabilities = Capabilities(mha=False, mla=True, features=frozenset({"fp8_kv"}), layouts=frozenset({"nhd"}),
                                gpu_block_size=64, verify_graphs=True, draft_trees=True)
    decode_variant: ClassVar[str] = "packed"
    fused_prep: ClassVar[bool] = False
    # Verifies of chains (several tokens a request, no tree): "rows", each token a decode row of the decode
    # kernels (MLAMetadata.decode_rows: each reads its request's cache rows), "packed", the verify kernel
    # (tripath.ops.mla_verify: every token and head of a request in one program, each cache row read once for
    # them), or "auto": "packed" where mla_verify runs the Gluon kernel (sm_90, 16-bit), the layer has fewer
    # than 64 heads and verifies bring PACKED_VERIFY_MIN_TOKENS tokens or more, else "rows". Draft trees always
    # take the verify kernel.
    verify_kernel: ClassVar[str] = "auto"

    @classmethod
    def unsupported_reasons(cls, spec, device) -> list[str]:
        reasons = super().unsupported_reasons(spec, device)
        if spec.is_mla:
            mla = spec.mla
            for name, size in (("qk_nope_head_dim + qk_rope_head_dim", mla.qk_nope_head_dim + mla.qk_rope_head_dim),
                               ("v_head_dim", mla.v_head_dim)):
                if not MIN_HEAD_SIZE <= size <= MAX_HEAD_SIZE:
                    reasons.append(f"{name} = {size} outside {MIN_HEAD_SIZE}..{MAX_HEAD_SIZE} (the prefill kernel)")
        return reasons

    # -- metadata --------------------------------------------------------------------------------------
    def add_own_ints(self, plan, ints) -> None:
        """``decode_rows`` (a decode slice of several tokens a row): :func:`_decode_rows`' request rows, then
        their lengths."""
        nd = plan.num_decodes
        if nd and max(plan.query_lens[:nd]) > 1:
            rows, lens = _decode_rows(plan.query_lens[:nd], plan.context_lens[:nd])
            ints.add("decode_rows", rows + lens)

    def build_metadata(self, plan, block_table, slot_mapping, *, decode_num_splits=None, ints=None) -> MLAMetadata:
        ints = self.device_ints(plan, block_table.device, ints)
        common = super().build_metadata(plan, block_table, slot_mapping, decode_num_splits=decode_num_splits,
                                        ints=ints)
        d = common.decode
        decode_rows = None
        if d is not None and not d.single_token:
            packed = ints.view("decode_rows")
            n = packed.shape[0] // 2
            decode_rows = MLADecodeRows(block_table.index_select(0, packed[:n]), packed[n:])
        return MLAMetadata.from_common(common, decode_rows=decode_rows)

    # -- forward ---------------------------------------------------------------------------------------
    @property
    def sm_scale(self) -> float:
        mla = self.spec.mla
        return self.spec.sm_scale or 1.0 / math.sqrt(mla.qk_nope_head_dim + mla.qk_rope_head_dim)

    def fused_prep_reasons(self, meta: AttentionMetadata, weights: MLALayerWeights) -> list[str]:
        """Why the fused preparation cannot run for this step (empty: it runs). As in vLLM's ROCm attention
        backends, the fused path runs only when its preconditions are checked; the unfused path gives the same bits."""
        if not self.fused_prep:
            return [f"backend {self.name!r} prepares unfused"]
        reasons = []
        if meta.decode is None:
            reasons.append("no decode tokens")
        rotary, half = weights.rotary, self.spec.mla.qk_rope_head_dim // 2
        if rotary is not None:
            if self.spec.mla.qk_rope_head_dim % 2:
                reasons.append("odd rotary dim")
            for name, table in (("cos", rotary.cos), ("sin", rotary.sin)):
                if (table.dim() != 2 or table.shape[1] != half or table.dtype not in FLOAT_TABLE_DTYPES
                        or table.stride(-1) != 1 or table.device != meta.slot_mapping.device):
                    reasons.append(f"rotary {name} table is not a [max_position, {half}] float tensor on the device")
        return reasons

    def forward_mla(self, q_nope, q_pe, kv_c, k_pe, positions, cache: MLACache, meta: MLAMetadata,
                    weights: MLALayerWeights, *, out=None):
        mla = self.spec.mla
        num_tokens, num_heads = q_nope.shape[0], q_nope.shape[1]
        shape = (num_tokens, num_heads, mla.v_head_dim)
        if out is None:
            out = torch.empty(shape, dtype=q_nope.dtype, device=q_nope.device)
        elif tuple(out.shape) != shape:
            raise ValueError(f"out must have shape {shape}, got {tuple(out.shape)}")
        k_pe = k_pe.reshape(num_tokens, mla.qk_rope_head_dim)
        decode_tokens = meta.decode.num_tokens if meta.decode is not None else 0
        q_decode, q_pe_rest, k_pe_rest = self._prepare(q_nope, q_pe, kv_c, k_pe, positions, cache, meta, weights,
                                                       decode_tokens)
        if decode_tokens:
            self._decode(q_decode, cache, meta, weights, out[:decode_tokens])
        if meta.extend is None and meta.prefill is None:
            return out
        # Non-absorbed queries ``[q_nope | rope(q_pe)]`` of the other tokens, kept as their two parts (the
        # attention kernel scores them separately: no concatenated copy).
        q_rest = (q_nope[decode_tokens:], q_pe_rest)
        e, p = meta.extend, meta.prefill
        joined = e is not None and self._joins_tail(e, cache, kv_c)
        # The new tokens that attend to keys up-projected from the step's inputs: the prefills', and the
        # extends' unless their rows are read back from the cache with the last chunk.
        own = p if joined else (e if e is not None else p)
        if own is not None:
            keys_new = self._up_project(kv_c[own.token_start:], k_pe_rest[own.token_start - decode_tokens:],
                                        weights)
            own_rows = lambda m: tuple(t[m.token_start - own.token_start:m.token_end - own.token_start]  # noqa: E731
                                       for t in keys_new)
        query_rows = lambda m: tuple(t[m.token_start - decode_tokens:m.token_end - decode_tokens]  # noqa: E731
                                     for t in q_rest)
        if e is not None:
            q_e, out_e = query_rows(e), out[e.token_start:e.token_end]
            if joined:
                self._extend_joined(q_e, cache, e, weights, out_e)
            else:
                self._extend(q_e, own_rows(e), cache, e, weights, out_e)
        if p is not None:
            self._attend(query_rows(p), own_rows(p), p.cu_seqlens_q, p.cu_seqlens_q, p.max_query_len,
                         p.max_query_len, causal=True, out=out[p.token_start:p.token_end])
        return out

    def _joins_tail(self, e: ExtendMetadata, cache: MLACache, kv_c: torch.Tensor) -> bool:
        """Whether the extends' new tokens are read back from the cache with the last chunk: the cache holds
        the model's dtype, so its rows are the step's ``[kv_c | rope(k_pe)]`` bit for bit."""
        return e.tail is not None and cache.kv_cache.dtype == kv_c.dtype

    # -- pieces ----------------------------------------------------------------------------------------
    def _kv_scale(self, cache: MLACache):
        return cache.kv_scale if cache.kv_cache.dtype in FP8_DTYPES else None

    def _query_format(self, cache: MLACache, weights: MLALayerWeights, dtype):
        """The absorbed query's dtype and scale: fp8 with ``weights.q_scale`` when the cache is fp8 and the
        model gives a query scale (the fp8 ``q_out`` of vLLM's ROCm MLA backend), else the model dtype unscaled."""
        if cache.kv_cache.dtype in FP8_DTYPES and weights.q_scale is not None:
            return cache.kv_cache.dtype, weights.q_scale
        return dtype, None

    def _rotated(self, positions, q_pe, k_pe, weights):
        """Rotated copies of ``q_pe [n, H, R]`` and ``k_pe [n, R]`` (the inputs as given for NoPE)."""
        if weights.rotary is None or q_pe.shape[0] == 0:
            return q_pe, k_pe
        q_rot, k_rot = (t.clone(memory_format=torch.contiguous_format) for t in (q_pe, k_pe))
        rotary_embedding(positions, q_rot, k_rot, (weights.rotary.cos, weights.rotary.sin),
                         is_neox=weights.rotary.is_neox)
        return q_rot, k_rot

    def _prepare(self, q_nope, q_pe, kv_c, k_pe, positions, cache, meta, weights, decode_tokens):
        """Write every token's cache row; build the decode tokens' absorbed query. Returns ``(q_decode,
        rotated q_pe, rotated k_pe)`` with the rotated parts of the non-decode tokens only."""
        kv_scale = self._kv_scale(cache)
        q_decode = None
        ql_nope = None
        if decode_tokens:
            # q_nope · W_UK per head: [H, Td, P] x [H, P, L] -> [Td, H, L] (a strided view)
            ql_nope = torch.bmm(q_nope[:decode_tokens].transpose(0, 1), weights.w_uk).transpose(0, 1)
            q_dtype, _ = self._query_format(cache, weights, q_nope.dtype)
            q_decode = torch.empty(decode_tokens, q_nope.shape[1], self.spec.mla.cache_width, dtype=q_dtype,
                                   device=q_nope.device)
        _, q_scale = self._query_format(cache, weights, q_nope.dtype)
        if decode_tokens and not self.fused_prep_reasons(meta, weights):
            d = slice(0, decode_tokens)
            rotary = weights.rotary
            tables = (positions[d], rotary.cos, rotary.sin) if rotary is not None else (None, None, None)
            fused_qk_rope_concat_and_cache_mla(
                ql_nope, q_pe[d], kv_c[d], k_pe[d], cache.kv_cache, q_decode, meta.slot_mapping[d], kv_scale,
                q_scale, *tables, is_neox=rotary.is_neox if rotary is not None else True, is_nope_first=True)
            rest = slice(decode_tokens, q_nope.shape[0])
            q_rot, k_rot = self._rotated(positions[rest], q_pe[rest], k_pe[rest], weights)
            if k_rot.shape[0]:
                concat_and_cache_mla(kv_c[rest], k_rot, cache.kv_cache, meta.slot_mapping[rest], kv_scale=kv_scale)
            return q_decode, q_rot, k_rot
        q_rot, k_rot = self._rotated(positions, q_pe, k_pe, weights)
        concat_and_cache_mla(kv_c, k_rot, cache.kv_cache, meta.slot_mapping, kv_scale=kv_scale)
        if decode_tokens:
            concat_mla_query(ql_nope, q_rot[:decode_tokens], q_decode, q_scale=q_scale)
        return q_decode, q_rot[decode_tokens:], k_rot[decode_tokens:]

    def _decode(self, q_decode, cache, meta, weights, out):
        d = meta.decode
        rows = meta.decode_rows
        _, q_scale = self._query_format(cache, weights, out.dtype)
        lat = self.spec.mla.kv_lora_rank
        o_latent = torch.empty(q_decode.shape[0], q_decode.shape[1], lat, dtype=out.dtype, device=out.device)
        options = dict(kv_lora_rank=lat, sm_scale=self.sm_scale, kv_scale=self._kv_scale(cache), q_scale=q_scale,
                       num_splits=d.num_splits, out=o_latent)
        trees = d.verify.tree_mask if d.verify is not None else None
        packed = self.verify_kernel == "packed" or (
            self.verify_kernel == "auto" and d.max_query_len >= PACKED_VERIFY_MIN_TOKENS
            and q_decode.shape[1] < 64 and gluon_verify_applies(q_decode, cache.kv_cache, lat, o_latent))
        if trees is not None or (rows is not None and packed):
            # every token and head of a request in one tile (each cache row read once for them), along the
            # draft trees' masks (one-token decodes: their own bit)
            bits = None if trees is None else torch.cat(
                [torch.ones(d.verify.token_start, dtype=torch.int32, device=out.device), trees])
            mla_verify(q_decode, cache.kv_cache, d.block_table, d.seq_lens, d.cu_seqlens_q, d.max_query_len,
                       tree_mask=bits, **options)
        elif rows is not None:   # each token a decode row of its own, through the decode kernels
            mla_decode(q_decode, cache.kv_cache, rows.block_table, rows.seq_lens, variant=self.decode_variant,
                       **options)
        else:
            mla_decode(q_decode, cache.kv_cache, d.block_table, d.seq_lens, variant=self.decode_variant, **options)
        # [H, Td, L] x [H, L, V] straight into out's [Td, H, V] rows (a strided batch: no copy after)
        torch.bmm(o_latent.transpose(0, 1), weights.w_uv, out=out.transpose(0, 1))

    def _up_project(self, latent, k_pe_rot, weights):
        """Non-absorbed keys of latent rows ``latent [n, L]`` and rotated rotary keys ``k_pe_rot [n, R]``:
        ``(k_nope [n, H, P], k_rope [n, 1, R], v [n, H, V])``, ``k_nope`` and ``v`` strided views of one
        matmul's ``[n, H, P + V]`` output, ``k_rope`` shared by every head."""
        num_heads, p_dim, _ = weights.w_uk.shape
        kv = (latent @ weights.kv_b.T).view(latent.shape[0], num_heads, -1)
        return kv[..., :p_dim], k_pe_rot[:, None, :].to(kv.dtype), kv[..., p_dim:]

    def _attend(self, q, keys, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal, **kwargs):
        """``varlen_attention`` of queries ``(q_nope, q_rope)`` on keys ``(k_nope, k_rope, v)``."""
        (q_nope, q_rope), (k_nope, k_rope, v) = q, keys
        return varlen_attention(q_nope, k_nope, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                causal=causal, sm_scale=self.sm_scale, q_rope=q_rope, k_rope=k_rope, **kwargs)

    def _extend_joined(self, q, cache, e: ExtendMetadata, weights, out):
        """Chunks before the last as in :meth:`_extend`; the last gathered with the new tokens' rows and
        attended in one causal launch (query ``i`` at ``context_len + i``); one chunk needs no merge."""
        workspace = torch.empty(max(e.workspace_tokens, e.tail_tokens), self.spec.mla.cache_width,
                                dtype=q[0].dtype, device=q[0].device)
        attend_joined_chunks(e, lambda chunk, causal, out=None: self._chunk(q, cache, e, chunk, workspace, weights,
                                                                            causal=causal, out=out), out)

    def _chunk(self, q, cache, e: ExtendMetadata, chunk, workspace, weights, *, causal: bool, out=None):
        """Gather one chunk's latent rows, up-project them and attend the extends' queries to them: with the
        LSE (for a merge) unless ``out`` is given."""
        lat = self.spec.mla.kv_lora_rank
        gather_mla_cache(cache.kv_cache, e.block_table, chunk.cu_seqlens_k, chunk.seq_starts,
                         kv_scale=self._kv_scale(cache), out=workspace)
        rows = workspace[:chunk.num_tokens]  # the gathered rows only: the rest holds stale values
        keys = self._up_project(rows[:, :lat], rows[:, lat:], weights)
        return self._attend(q, keys, e.cu_seqlens_q, chunk.cu_seqlens_k, e.max_query_len, chunk.max_len,
                            causal=causal, q_positions_start=chunk.q_positions_start, return_lse=out is None,
                            out=out)

    def _extend(self, q, keys_new, cache, e: ExtendMetadata, weights, out):
        """The new tokens' causal pass over their own keys (with LSE), merged with each context chunk's."""
        acc, lse = self._attend(q, keys_new, e.cu_seqlens_q, e.cu_seqlens_q, e.max_query_len, e.max_query_len,
                                causal=True, return_lse=True)
        if not e.chunks:
            out.copy_(acc)
            return
        workspace = torch.empty(e.workspace_tokens, self.spec.mla.cache_width, dtype=q[0].dtype,
                                device=q[0].device)
        for i, chunk in enumerate(e.chunks):
            part, part_lse = self._chunk(q, cache, e, chunk, workspace, weights, causal=False)
            acc, lse = merge_states(acc, lse, part, part_lse, out=out if i == len(e.chunks) - 1 else None)
