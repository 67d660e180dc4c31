"""PyTorch references of the MHA attention ops (fp32 math; also the CPU path of each op).

Semantics (shared by every kernel): scores ``s = sm_scale * q·k``; softcap ``s -> c·tanh(s/c)``; ALiBi
``s += slope_h · (k - p)``; then the mask: a key at position ``k`` is visible to a query at position ``p``
iff ``k <= p`` (causal) and ``p - k <= window_left`` (window on). Sinks add ``exp(sink_h - m)`` once to each
row's denominator. Rows that see nothing give output 0 and LSE −inf. LSE is natural-log, ``[T, H]`` fp32.
"""

from __future__ import annotations

import math

import torch

from tripath.ops.kv_cache import as_nhd, dequantize


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_start: int, causal: bool, sm_scale: float,
           window_left: int = -1, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
           sinks: torch.Tensor | None = None, visible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: ``q [Sq, Hq, Dqk]`` against ``k [Sk, Hkv, Dqk]``, ``v [Sk, Hkv, Dv]``.

    Query ``i`` sits at position ``q_start + i``; key ``j`` at position ``j``. ``visible [Sq, Sk]`` bool: a
    mask of its own, on top of the others (a draft tree's).
    Returns ``(out [Sq, Hq, Dv] fp32, lse [Sq, Hq] fp32)``.
    """
    sq, hq, _ = q.shape
    sk, hkv, dv = v.shape
    group = hq // hkv
    qf = q.float()
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", qf, kf) * sm_scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    qpos = torch.arange(sq, device=q.device)[:, None] + q_start
    kpos = torch.arange(sk, device=q.device)[None, :]
    if alibi_slopes is not None:
        s = s + alibi_slopes.float()[:, None, None] * (kpos - qpos).float()[None]
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device) if visible is None else visible.clone()
    if causal:
        visible &= kpos <= qpos
    if window_left >= 0:
        visible &= (qpos - kpos) <= window_left
    s = s.masked_fill(~visible[None], float("-inf"))
    # [H, Sq, 1]; no keys at all (a request of length 0): -inf, so the output is 0 and the LSE -inf
    m = s.amax(dim=-1, keepdim=True) if sk else torch.full((hq, sq, 1), float("-inf"), device=q.device)
    if sinks is not None:
        m = torch.maximum(m, sinks.float()[:, None, None])
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m_safe)
    denom = p.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sinks.float()[:, None, None] - m_safe)
    out = torch.einsum("hqk,khd->qhd", p / torch.where(denom > 0, denom, torch.ones_like(denom)), vf)
    lse = (torch.log(denom) + m_safe).squeeze(-1).transpose(0, 1)  # [Sq, H]
    lse = torch.where(denom.squeeze(-1).transpose(0, 1) > 0, lse, torch.full_like(lse, float("-inf")))
    return out, lse


def _default_scale(sm_scale: float | None, head_size: int) -> float:
    return sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_size)


def _finish(out_f32: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None,
            return_lse: bool, rows: int | None = None):
    """The output in ``dtype``; into ``out`` only its first ``rows`` rows (the requests' tokens: rows past
    ``cu_seqlens_q[-1]`` are left as they are, as the kernels leave them)."""
    if out is None:
        out = out_f32.to(dtype)
    else:
        rows = out_f32.shape[0] if rows is None else rows
        out[:rows].copy_(out_f32[:rows])
    return (out, lse) if return_lse else out


def varlen_attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                         causal=True, sm_scale=None, window_left=-1, softcap=0.0, alibi_slopes=None,
                         sinks=None, q_positions_start=None, out=None, return_lse=False):
    """Reference of :func:`tripath.ops.varlen_attention`."""
    sm_scale = _default_scale(sm_scale, q.shape[2])
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    starts = q_positions_start.tolist() if q_positions_start is not None else None
    out_f = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[0], q.shape[1]), float("-inf"), dtype=torch.float32, device=q.device)
    for i in range(len(cq) - 1):
        sq, sk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if sq == 0:
            continue
        q_start = starts[i] if starts is not None else sk - sq
        o, l = attend(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]], q_start=q_start,
                      causal=causal, sm_scale=sm_scale, window_left=window_left, softcap=softcap,
                      alibi_slopes=alibi_slopes, sinks=sinks)
        out_f[cq[i]:cq[i + 1]] = o
        lse[cq[i]:cq[i + 1]] = l
    return _finish(out_f, lse, q.dtype, out, return_lse, rows=cq[-1])


def _paged_rows(k_nhd, v_nhd, block_row, length, k_scale, v_scale):
    block_size = k_nhd.shape[1]
    pos = torch.arange(length, device=k_nhd.device)
    blocks = block_row[pos // block_size].long()
    return (dequantize(k_nhd[blocks, pos % block_size], k_scale),
            dequantize(v_nhd[blocks, pos % block_size], v_scale))


def unified_attention_ref(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q=None, *,
                          layout="nhd", sm_scale=None, k_scale=None, v_scale=None, window_left=-1,
                          softcap=0.0, alibi_slopes=None, sinks=None, out=None, return_lse=False, tree_mask=None):
    """Reference of :func:`tripath.ops.unified_attention` (new tokens already in the cache) and, with a draft
    tree's ``tree_mask [T]`` int32, of :func:`tripath.ops.paged_verify`'s trees: new token ``t`` of a request
    then sees the context and the new tokens ``j`` whose bit ``j`` its entry sets."""
    sm_scale = _default_scale(sm_scale, q.shape[2])
    k_nhd, v_nhd = as_nhd(k_cache, v_cache, layout)
    cq, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    out_f = torch.zeros(q.shape[0], q.shape[1], v_nhd.shape[3], dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[0], q.shape[1]), float("-inf"), dtype=torch.float32, device=q.device)
    for i in range(len(cq) - 1):
        sq = cq[i + 1] - cq[i]
        if sq == 0:
            continue
        k, v = _paged_rows(k_nhd, v_nhd, block_table[i], lens[i], k_scale, v_scale)
        visible = None
        if tree_mask is not None:
            visible = torch.ones(sq, lens[i], dtype=torch.bool, device=q.device)
            bits = tree_mask[cq[i]:cq[i + 1]].long()
            visible[:, lens[i] - sq:] = (bits[:, None] >> torch.arange(sq, device=q.device)[None, :]) & 1 == 1
        o, l = attend(q[cq[i]:cq[i + 1]], k, v, q_start=lens[i] - sq, causal=tree_mask is None, sm_scale=sm_scale,
                      window_left=window_left, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                      visible=visible)
        out_f[cq[i]:cq[i + 1]] = o
        lse[cq[i]:cq[i + 1]] = l
    return _finish(out_f, lse, q.dtype, out, return_lse, rows=cq[-1])


def paged_decode_ref(q, k_cache, v_cache, block_table, seq_lens, *, layout="nhd", sm_scale=None,
                     k_scale=None, v_scale=None, window_left=-1, softcap=0.0, alibi_slopes=None, sinks=None,
                     num_splits=None, out=None, return_lse=False):
    """Reference of :func:`tripath.ops.paged_decode`: one query token per request, at position seq_len-1."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return unified_attention_ref(q, k_cache, v_cache, block_table, seq_lens, cu, 1, layout=layout,
                                 sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale, window_left=window_left,
                                 softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, out=out,
                                 return_lse=return_lse)


def merge_states_ref(out_a, lse_a, out_b, lse_b, *, out=None):
    """Reference of :func:`tripath.ops.merge_states`: ``o = (e^{a} o_a + e^{b} o_b) / (e^{a} + e^{b})``."""
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(lse_a - m_safe), torch.exp(lse_b - m_safe)
    denom = wa + wb
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    # An empty side (weight 0) may hold garbage that was never written: it must not leak NaN.
    oa = torch.where((wa > 0)[..., None], out_a.float(), torch.zeros((), device=out_a.device))
    ob = torch.where((wb > 0)[..., None], out_b.float(), torch.zeros((), device=out_b.device))
    merged = oa * (wa / safe)[..., None] + ob * (wb / safe)[..., None]
    lse = torch.where(denom > 0, torch.log(safe) + m_safe, torch.full_like(m, float("-inf")))
    if out is None:
        out = merged.to(out_a.dtype)
    else:
        out.copy_(merged)
    return out, lse
