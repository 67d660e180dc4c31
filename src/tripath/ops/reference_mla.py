"""PyTorch references of the MLA ops and the rotary embedding (fp32 math; also their CPU path).

Dims: ``L`` latent (``kv_lora_rank``, 512 for DeepSeek), ``R`` rotary (64), ``H`` query heads, cache rows
``[L + R]``. fp8 destinations store ``sat(x / scale)`` in e4m3; fp8 sources read ``x * scale``.
"""

from __future__ import annotations

import torch

from tripath.ops.reference import attend
from tripath.platform import FP8_DTYPES, fp8_max


def quantize_to(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` (any float) to ``dtype``: ``sat(x / scale)`` for fp8, a plain cast otherwise."""
    x = x.float()
    if dtype in FP8_DTYPES:
        limit = fp8_max(dtype)
        x = (x / scale.float().reshape(())).clamp(-limit, limit)
    return x.to(dtype)


def _dequant(t: torch.Tensor, scale: torch.Tensor | None, fp8: bool) -> torch.Tensor:
    return t.float() * scale.float().reshape(()) if fp8 else t.float()


def rope_pairs(rotary_dim: int, is_neox: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Dims ``(d1, d2)`` of each rotary pair: ``(i, i + R/2)`` (NeoX) or ``(2i, 2i + 1)`` (GPT-J)."""
    i = torch.arange(rotary_dim // 2, device=device)
    return (i, i + rotary_dim // 2) if is_neox else (2 * i, 2 * i + 1)


def rope_rotate(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                is_neox: bool) -> torch.Tensor:
    """``x [T, ..., >= R]`` with its first ``R = 2 · cos.shape[1]`` dims rotated (fp32 math, result rounded
    to ``x``'s dtype); positions are clamped into the tables."""
    rotary_dim = 2 * cos.shape[1]
    pos = positions.long().clamp(0, cos.shape[0] - 1)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rotary_dim // 2,)
    c, s = cos[pos].float().reshape(shape), sin[pos].float().reshape(shape)
    d1, d2 = rope_pairs(rotary_dim, is_neox, x.device)
    x1, x2 = x[..., d1].float(), x[..., d2].float()
    out = x.clone()
    out[..., d1] = (x1 * c - x2 * s).to(x.dtype)
    out[..., d2] = (x2 * c + x1 * s).to(x.dtype)
    return out


def rotary_embedding_ref(positions, q, k, cos, sin, *, is_neox):
    """Reference of :func:`tripath.ops.rotary_embedding` (``q``/``k`` ``[T, H, D]``, rotated in place;
    ``cos``/``sin`` ``[max_position, R/2]``)."""
    for t in (q, k):
        if t is not None:
            t.copy_(rope_rotate(t, positions, cos, sin, is_neox))
    return q, k


def _slots(slot_mapping: torch.Tensor, block_size: int, num_blocks: int):
    keep = (slot_mapping >= 0) & (slot_mapping < num_blocks * block_size)
    slots = slot_mapping[keep].long()
    return keep, slots // block_size, slots % block_size


def concat_and_cache_mla_ref(kv_c, k_pe, kv_cache, slot_mapping, *, kv_scale=None) -> None:
    """Reference of :func:`tripath.ops.concat_and_cache_mla`: row ``[kv_c | k_pe]`` at each slot >= 0."""
    keep, blocks, offsets = _slots(slot_mapping, kv_cache.shape[1], kv_cache.shape[0])
    rows = torch.cat([kv_c[keep].float(), k_pe.reshape(k_pe.shape[0], -1)[keep].float()], dim=-1)
    kv_cache[blocks, offsets] = quantize_to(rows, kv_cache.dtype, kv_scale)


def gather_mla_cache_ref(kv_cache, block_table, cu_seqlens, seq_starts, *, kv_scale=None, out=None,
                         dtype=None):
    """Reference of :func:`tripath.ops.gather_mla_cache` (syncs with the host)."""
    fp8 = kv_cache.dtype in FP8_DTYPES
    block_size = kv_cache.shape[1]
    cu, starts = cu_seqlens.tolist(), seq_starts.tolist()
    rows = []
    for i in range(len(cu) - 1):
        pos = torch.arange(starts[i], starts[i] + cu[i + 1] - cu[i], device=kv_cache.device)
        blocks = block_table[i, pos // block_size].long()
        rows.append(_dequant(kv_cache[blocks, pos % block_size], kv_scale, fp8))
    gathered = torch.cat(rows) if rows else kv_cache.new_zeros(0, kv_cache.shape[2], dtype=torch.float32)
    if out is None:
        return gathered.to(dtype or (torch.bfloat16 if fp8 else kv_cache.dtype))
    out[: gathered.shape[0]] = gathered.to(out.dtype)
    return out


def mla_decode_ref(q, kv_cache, block_table, seq_lens, *, kv_lora_rank=512, sm_scale, kv_scale=None,
                   q_scale=None, out=None, return_lse=False, out_dtype=None):
    """Reference of :func:`tripath.ops.mla_decode`: ``q [B, H, L + R]`` against each request's
    ``seq_lens[b]`` cache rows (keys: whole rows, values: their first ``L`` dims)."""
    batch, num_heads, _ = q.shape
    block_size = kv_cache.shape[1]
    qf = _dequant(q, q_scale, q.dtype in FP8_DTYPES)
    fp8 = kv_cache.dtype in FP8_DTYPES
    lens = seq_lens.tolist()
    out_f = torch.zeros(batch, num_heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, num_heads), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(batch):
        if lens[b] == 0:
            continue
        pos = torch.arange(lens[b], device=q.device)
        rows = _dequant(kv_cache[block_table[b, pos // block_size].long(), pos % block_size], kv_scale, fp8)
        o, l = attend(qf[b:b + 1], rows[:, None, :], rows[:, None, :kv_lora_rank], q_start=lens[b] - 1,
                      causal=False, sm_scale=sm_scale)
        out_f[b], lse[b] = o[0], l[0]
    if out is None:
        out = out_f.to(out_dtype or (torch.bfloat16 if q.dtype in FP8_DTYPES else q.dtype))
    else:
        out.copy_(out_f)
    return (out, lse) if return_lse else out


def concat_mla_query_ref(ql_nope, q_pe, q_out, *, q_scale=None, is_nope_first=True):
    """Reference of :func:`tripath.ops.concat_mla_query`: ``q_out = quant([ql_nope | q_pe] / q_scale)``."""
    parts = [ql_nope.float(), q_pe.float()] if is_nope_first else [q_pe.float(), ql_nope.float()]
    q_out.copy_(quantize_to(torch.cat(parts, dim=-1), q_out.dtype, q_scale))
    return q_out


def fused_qk_rope_concat_and_cache_mla_ref(ql_nope, q_pe, kv_c, k_pe, kv_cache, q_out, slot_mapping, k_scale,
                                           q_scale, positions=None, cos_cache=None, sin_cache=None, *,
                                           is_neox=True, is_nope_first=True) -> None:
    """Reference of :func:`tripath.ops.fused_qk_rope_concat_and_cache_mla` (no rotation without tables)."""
    k_pe = k_pe.reshape(k_pe.shape[0], -1)
    if cos_cache is not None:
        q_pe = rope_rotate(q_pe, positions, cos_cache, sin_cache, is_neox)
        k_pe = rope_rotate(k_pe, positions, cos_cache, sin_cache, is_neox)
    concat_mla_query_ref(ql_nope, q_pe, q_out, q_scale=q_scale, is_nope_first=is_nope_first)
    keep, blocks, offsets = _slots(slot_mapping, kv_cache.shape[1], kv_cache.shape[0])
    parts = [kv_c[keep].float(), k_pe[keep].float()]
    rows = torch.cat(parts if is_nope_first else parts[::-1], dim=-1)
    kv_cache[blocks, offsets] = quantize_to(rows, kv_cache.dtype, k_scale)


def mla_verify_ref(q, kv_cache, block_table, seq_lens, cu_seqlens_q, *, kv_lora_rank=512, sm_scale, kv_scale=None,
                   q_scale=None, tree_mask=None, out=None, return_lse=False):
    """Reference of :func:`tripath.ops.mla_verify`: request ``b``'s tokens against its ``seq_lens[b]`` cache
    rows, causally from position ``seq_lens[b] - n_b``, or along the draft trees of ``tree_mask``."""
    num_tokens, num_heads, _ = q.shape
    block_size = kv_cache.shape[1]
    qf = _dequant(q, q_scale, q.dtype in FP8_DTYPES)
    fp8 = kv_cache.dtype in FP8_DTYPES
    lens, cu = seq_lens.tolist(), cu_seqlens_q.tolist()
    out_f = torch.zeros(num_tokens, num_heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(len(cu) - 1):
        start, n = cu[b], cu[b + 1] - cu[b]
        if n == 0:
            continue
        ctx = lens[b] - n
        pos = torch.arange(lens[b], device=q.device)
        rows = _dequant(kv_cache[block_table[b, pos // block_size].long(), pos % block_size], kv_scale, fp8)
        visible = None
        if tree_mask is not None:
            bits = tree_mask[start:start + n].long().to(q.device)
            visible = torch.ones(n, lens[b], dtype=torch.bool, device=q.device)
            visible[:, ctx:] = (bits[:, None] >> torch.arange(n, device=q.device)[None, :]) & 1 == 1
        o, l = attend(qf[start:start + n], rows[:, None, :], rows[:, None, :kv_lora_rank], q_start=ctx,
                      causal=visible is None, sm_scale=sm_scale, visible=visible)
        out_f[start:start + n], lse[start:start + n] = o, l
    if out is None:
        out = out_f.to(torch.bfloat16 if q.dtype in FP8_DTYPES else q.dtype)
    else:
        out[:cu[-1]].copy_(out_f[:cu[-1]])
    return (out, lse) if return_lse else out
