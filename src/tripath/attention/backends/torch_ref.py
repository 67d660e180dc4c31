"""``torch``: the reference backend, plain PyTorch on any device, request by request in fp32.

MHA: each request's queries attend to its cached context (read back from the paged cache, dequantised)
followed by its new keys/values as given. MLA (non-absorbed, for every request): RoPE on ``q_pe``/``k_pe``,
the cache rows ``[kv_c | rope(k_pe)]`` written, then per request
``k = [kv_c·W_UKᵀ | rope(k_pe)]`` (per head), ``v = kv_c·W_UV`` over context + new rows, causal attention
with ``sm_scale`` (default ``1/sqrt(P + R)``).
"""

from __future__ import annotations

import math

import torch

from tripath.attention.backends.base import Capabilities, GraphSupport, MHAAttentionBackend, MLAAttentionBackend
from tripath.attention.spec import KVCache, MLACache, MLALayerWeights, RotaryTables
from tripath.ops.kv_cache import as_nhd, dequantize
from tripath.ops.reference import attend
from tripath.platform import FP8_DTYPES, fp8_max


def rotate(x: torch.Tensor, positions: torch.Tensor, rotary: RotaryTables | None) -> torch.Tensor:
    """RoPE on the last dim of ``x [T, ..., R]`` (fp32 math); ``None`` = identity (NoPE)."""
    if rotary is None:
        return x
    cos = rotary.cos[positions.clamp(0, rotary.cos.shape[0] - 1)].float()
    sin = rotary.sin[positions.clamp(0, rotary.sin.shape[0] - 1)].float()
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    xf = x.float()
    if rotary.is_neox:
        a, b = xf.chunk(2, dim=-1)
    else:
        a, b = xf[..., 0::2], xf[..., 1::2]
    ra, rb = a * cos - b * sin, b * cos + a * sin
    out = torch.cat([ra, rb], dim=-1) if rotary.is_neox else torch.stack([ra, rb], dim=-1).flatten(-2)
    return out.to(x.dtype)


class TorchBackend(MHAAttentionBackend, MLAAttentionBackend):
    """Where the step's new keys/values come from matters only for fp8 caches (rounding): by default
    decode rows read them back from the cache (as paged decode does) and extend/prefill rows use them as
    given (as ``three_path``'s varlen paths do); ``new_kv_from_cache=True`` reads them from the cache for
    every row, like the backends that attend through the cache (``unified``, ``two_path``)."""

    name = "torch"
    capabilities = Capabilities(mla=True, needs_triton=False, graphs=GraphSupport.NONE, draft_trees=True)

    def __init__(self, spec, device="cpu", *, new_kv_from_cache: bool = False):
        super().__init__(spec, device)
        self.new_kv_from_cache = new_kv_from_cache

    @classmethod
    def preferred_block_size(cls, is_mla, device) -> int:
        """For MLA models, the MLA backends' preference: the reference stands in for them (where they cannot
        run, e.g. float32 on a GPU, and in comparisons), so its caches are laid out as theirs."""
        if is_mla:
            from tripath.attention.backends.mla_common import MLABackendBase

            return MLABackendBase.preferred_block_size(is_mla, device)
        return super().preferred_block_size(is_mla, device)

    # -- caches ----------------------------------------------------------------------------------------
    def _interface(self):
        return MLAAttentionBackend if self.spec.is_mla else MHAAttentionBackend

    def cache_bytes_per_block(self) -> int:
        return self._interface().cache_bytes_per_block(self)

    def allocate_cache(self, num_blocks, device=None):
        return self._interface().allocate_cache(self, num_blocks, device)

    # -- MHA -------------------------------------------------------------------------------------------
    def forward(self, q, k, v, cache: KVCache, meta, *, alibi_slopes=None, sinks=None, out=None,
                window_left=None):
        opts = self._options(alibi_slopes, sinks, window_left)
        self._write(k, v, cache, meta)
        out = self._out(q, out)
        k_scale, v_scale = self._scales(cache)
        k_nhd, v_nhd = as_nhd(cache.k_cache, cache.v_cache, cache.layout)
        sm_scale = opts.pop("sm_scale") or 1.0 / math.sqrt(self.spec.head_size)
        plan, start = meta.plan, 0
        block_size = self.spec.block_size
        verify = meta.decode.verify if meta.decode is not None else None
        trees = verify.tree_mask if verify is not None else None   # draft trees: the verifies' masks
        for j, (qlen, ctx) in enumerate(zip(plan.query_lens, plan.context_lens)):
            if trees is not None and verify.first_row <= j < plan.num_decodes:
                out[start:start + qlen] = self._attend_tree(q[start:start + qlen], meta, j, ctx, qlen,
                                                            trees[start - verify.token_start:][:qlen], k_nhd,
                                                            v_nhd, k_scale, v_scale, sm_scale, opts)
                start += qlen
                continue
            from_cache = self.new_kv_from_cache or j < plan.num_decodes
            pos = torch.arange(ctx + qlen if from_cache else ctx, device=q.device)
            blocks = meta.block_table[j, pos // block_size].long()
            keys = dequantize(k_nhd[blocks, pos % block_size], k_scale)
            vals = dequantize(v_nhd[blocks, pos % block_size], v_scale)
            if not from_cache:
                keys = torch.cat([keys, k[start:start + qlen].float()])
                vals = torch.cat([vals, v[start:start + qlen].float()])
            out[start:start + qlen] = self._attend(q[start:start + qlen], keys, vals, q_start=ctx, sm_scale=sm_scale,
                                                   **opts)
            start += qlen
        return out

    # -- MLA -------------------------------------------------------------------------------------------
    def forward_mla(self, q_nope, q_pe, kv_c, k_pe, positions, cache: MLACache, meta,
                    weights: MLALayerWeights, *, out=None):
        mla = self.spec.mla
        if mla is None:
            raise TypeError("forward_mla needs an MLA spec (AttentionSpec(mla=MLASpec(...)))")
        num_tokens, num_heads = q_nope.shape[0], q_nope.shape[1]
        q_pe = rotate(q_pe, positions, weights.rotary)
        k_pe = rotate(k_pe, positions, weights.rotary)
        rows = torch.cat([kv_c, k_pe], dim=-1).float()
        self._write_mla(rows, cache, meta.slot_mapping)
        scale = cache.kv_scale if cache.kv_cache.dtype in FP8_DTYPES else None
        sm_scale = self.spec.sm_scale or 1.0 / math.sqrt(mla.qk_nope_head_dim + mla.qk_rope_head_dim)
        w_uk, w_uv = weights.w_uk.float(), weights.w_uv.float()
        q_full = torch.cat([q_nope.float(), q_pe.float()], dim=-1)
        if out is None:
            out = torch.empty(num_tokens, num_heads, mla.v_head_dim, dtype=q_nope.dtype, device=q_nope.device)
        plan, start, block_size = meta.plan, 0, self.spec.block_size
        lat = mla.kv_lora_rank
        verify = meta.decode.verify if meta.decode is not None else None
        trees = verify.tree_mask if verify is not None else None   # draft trees: the verifies' masks
        for j, (qlen, ctx) in enumerate(zip(plan.query_lens, plan.context_lens)):
            from_cache = self.new_kv_from_cache or j < plan.num_decodes  # as for MHA: decodes read back
            pos = torch.arange(ctx + qlen if from_cache else ctx, device=q_nope.device)
            blocks = meta.block_table[j, pos // block_size].long()
            cached = dequantize(cache.kv_cache[blocks, pos % block_size], scale)
            latent = cached if from_cache else torch.cat([cached, rows[start:start + qlen]])  # [S, L + R]
            k_nope = torch.einsum("sl,hpl->shp", latent[:, :lat], w_uk)
            keys = torch.cat([k_nope, latent[:, None, lat:].expand(-1, num_heads, -1)], dim=-1)
            vals = torch.einsum("sl,hlv->shv", latent[:, :lat], w_uv)
            if trees is not None and verify.first_row <= j < plan.num_decodes:
                visible = _tree_visibility(trees[start - verify.token_start:][:qlen], ctx, qlen)
                out[start:start + qlen] = attend(q_full[start:start + qlen], keys, vals, q_start=ctx, causal=False,
                                                 sm_scale=sm_scale, visible=visible)[0]
            else:
                out[start:start + qlen] = self._attend(q_full[start:start + qlen], keys, vals, q_start=ctx,
                                                       sm_scale=sm_scale)
            start += qlen
        return out

    def _attend_tree(self, q, meta, j: int, ctx: int, qlen: int, bits: torch.Tensor, k_nhd, v_nhd, k_scale, v_scale,
                     sm_scale: float, opts: dict) -> torch.Tensor:
        """Verify row ``j``'s draft tree (``bits [qlen]`` its tokens' masks): the context, then the new tokens
        (read back from the cache) whose bits are set."""
        block_size = self.spec.block_size
        pos = torch.arange(ctx + qlen, device=q.device)
        blocks = meta.block_table[j, pos // block_size].long()
        keys = dequantize(k_nhd[blocks, pos % block_size], k_scale)
        vals = dequantize(v_nhd[blocks, pos % block_size], v_scale)
        return attend(q, keys, vals, q_start=ctx, causal=False, sm_scale=sm_scale,
                      visible=_tree_visibility(bits, ctx, qlen), **opts)[0]

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, q_start: int, sm_scale: float,
                **opts) -> torch.Tensor:
        """One request's causal attention: ``q [Sq, Hq, Dqk]`` at positions ``q_start ..`` over ``keys [Sk, Hkv,
        Dqk]`` / ``values [Sk, Hkv, Dv]`` at positions ``0 ..`` (fp32, :func:`~tripath.ops.reference.attend`);
        ``[Sq, Hq, Dv]``."""
        return attend(q, keys, values, q_start=q_start, causal=True, sm_scale=sm_scale, **opts)[0]

    def _write_mla(self, rows: torch.Tensor, cache: MLACache, slot_mapping: torch.Tensor) -> None:
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        values = rows[keep]
        if cache.kv_cache.dtype in FP8_DTYPES:
            limit = fp8_max(cache.kv_cache.dtype)
            values = (values / cache.kv_scale.float()).clamp(-limit, limit)
        block_size = cache.kv_cache.shape[1]
        cache.kv_cache[slots // block_size, slots % block_size] = values.to(cache.kv_cache.dtype)


def _tree_visibility(bits: torch.Tensor, ctx: int, qlen: int) -> torch.Tensor:
    """``[qlen, ctx + qlen]`` bool: a draft tree's tokens (``bits [qlen]``, bit ``j``: sees new token ``j``) see
    the whole context and the new tokens whose bits are set."""
    visible = torch.ones(qlen, ctx + qlen, dtype=torch.bool, device=bits.device)
    visible[:, ctx:] = (bits.long()[:, None] >> torch.arange(qlen, device=bits.device)[None, :]) & 1 == 1
    return visible
