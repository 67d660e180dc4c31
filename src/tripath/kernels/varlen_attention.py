"""Varlen flash attention over contiguous keys (the prefill path, and the extend path's pieces).

Program ``(m, h, b)`` computes ``BLOCK_M`` queries of head ``h`` of request ``b`` against the request's
keys, online softmax in the log2 domain. The key range is cut into masked edge tiles and unmasked inner
tiles so the inner loop carries no mask. Query ``i`` of a request sits at position ``q_start + i`` in key
coordinates, ``q_start = seqlen_k - seqlen_q`` (bottom-right) unless given per request.

With ``USE_TMA`` (Hopper) key and value tiles come through tensor descriptors over the keys' and values'
rows as ``[Tk, ·]`` matrices, head ``h`` starting at column ``h · stride_h`` (power-of-two head sizes);
otherwise through pointer loads.

With ``HAS_ROPE`` the scores have a second part: ``s = q · k + q_rope · k_rope`` with ``q_rope [Tq, Hq, R]``
and ``k_rope [Tk, Hr, R]``, ``Hr`` either the KV heads or one head shared by all (MLA's decoupled rotary
key). The two products accumulate into one score tile, so MLA's 128 + 64 query/key dims need neither a
concatenated copy nor padding to 256.
"""

import triton
import triton.language as tl

from tripath.kernels.attention_common import (LOG2E, add_sinks, finalize, score_mods, softmax_update,
                                              softmax_update_raw)
from tripath.triton_internals.specialize import STEP_INVARIANT


@triton.jit
def _load_k(k_base, k_desc, desc_row, desc_col, start, stride_k_t, k_pos, seqlen_k, dims_k, head_size,
            MASK: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr):
    """Keys of positions ``k_pos = start + [0, BLOCK_N)``, transposed: ``[Dk, BLOCK_N]`` (zeros past the
    request with pointer loads; descriptor tiles, from column ``desc_col``, may hold the next request's
    keys there)."""
    if USE_TMA:
        return tl.trans(k_desc.load([desc_row + start, desc_col]))
    k_ptrs = k_base + k_pos[None, :].to(tl.int64) * stride_k_t + dims_k[:, None]
    if MASK:
        return tl.load(k_ptrs, mask=(k_pos[None, :] < seqlen_k) & (dims_k[:, None] < head_size), other=0.0)
    if EVEN_D:
        return tl.load(k_ptrs)
    return tl.load(k_ptrs, mask=dims_k[:, None] < head_size, other=0.0)


@triton.jit
def _load_v(v_base, v_desc, desc_row, desc_col, start, stride_v_t, k_pos, seqlen_k, dims_v, head_size_v,
            MASK: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr):
    """Values of positions ``k_pos``: ``[BLOCK_N, Dv]``, rows past the request zeroed when ``MASK``."""
    if USE_TMA:
        v = v_desc.load([desc_row + start, desc_col])
        if MASK:
            v = tl.where(k_pos[:, None] < seqlen_k, v, 0.0)
        return v
    v_ptrs = v_base + k_pos[:, None].to(tl.int64) * stride_v_t + dims_v[None, :]
    if MASK:
        return tl.load(v_ptrs, mask=(k_pos[:, None] < seqlen_k) & (dims_v[None, :] < head_size_v), other=0.0)
    if EVEN_D:
        return tl.load(v_ptrs)
    return tl.load(v_ptrs, mask=dims_v[None, :] < head_size_v, other=0.0)


@triton.jit
def _key_loop(acc, m_i, l_i, q, q_r, k_base, v_base, kr_base, k_desc, v_desc, kr_desc, desc_row, stride_k_t,
              stride_v_t, stride_kr_t, q_pos, slope2, lo, hi, seqlen_k, qk_scale, softcap, window_left, dims_k,
              dims_v, dims_r, k_col, v_col, kr_col, head_size, head_size_v, rope_size, BLOCK_N: tl.constexpr,
              MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
              HAS_ALIBI: tl.constexpr, HAS_ROPE: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr):
    """Key tiles ``[lo, hi)`` (``MASK``: edge tiles, masked scores and zeroed value rows). ``k_col``,
    ``v_col``, ``kr_col``: the KV head's first column in the descriptors' ``[Tk, ·]`` matrices."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + offs_n
        k = _load_k(k_base, k_desc, desc_row, k_col, start, stride_k_t, k_pos, seqlen_k, dims_k, head_size,
                    MASK, EVEN_D, USE_TMA)
        v = _load_v(v_base, v_desc, desc_row, v_col, start, stride_v_t, k_pos, seqlen_k, dims_v, head_size_v,
                    MASK, EVEN_D, USE_TMA)
        qk = tl.dot(q, k)
        if HAS_ROPE:
            k_r = _load_k(kr_base, kr_desc, desc_row, kr_col, start, stride_kr_t, k_pos, seqlen_k, dims_r,
                          rope_size, MASK, EVEN_D, USE_TMA)
            qk = tl.dot(q_r, k_r, qk)
        if MASK or HAS_SOFTCAP or HAS_ALIBI:
            s = score_mods(qk, q_pos, k_pos, seqlen_k, slope2, qk_scale, softcap, window_left,
                           MASK, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)
            m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, MASK)
        else:
            m_i, l_i, acc = softmax_update_raw(qk, qk_scale, v, m_i, l_i, acc)
    return acc, m_i, l_i


@triton.jit(**STEP_INVARIANT)
def varlen_attention_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, qr_ptr, kr_ptr, kr_desc, out_ptr, lse_ptr,
    cu_seqlens_q_ptr, cu_seqlens_k_ptr, q_start_ptr, alibi_ptr, sinks_ptr,
    qk_scale, softcap, window_left,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_qr_t, stride_qr_h, stride_kr_t, stride_kr_h,
    stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
    num_queries_per_kv, head_size, head_size_v, rope_size,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr, HAS_ROPE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_Q_START: tl.constexpr, RETURN_LSE: tl.constexpr, EVEN_D: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """Program ``(m, h, b)``: ``BLOCK_M`` queries of head ``h`` of request ``b`` against its contiguous keys
    (optionally with a rotary part scored separately); writes ``out`` and, with ``RETURN_LSE``, the LSE."""
    block_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest (causal) blocks first
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_begin = tl.load(cu_seqlens_q_ptr + seq)
    seqlen_q = tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin
    if block_m * BLOCK_M >= seqlen_q:
        return
    k_begin = tl.load(cu_seqlens_k_ptr + seq)
    seqlen_k = tl.load(cu_seqlens_k_ptr + seq + 1) - k_begin
    if HAS_Q_START:
        q_start = tl.load(q_start_ptr + seq)
    else:
        q_start = seqlen_k - seqlen_q
    kv_head = head // num_queries_per_kv

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims_k = tl.arange(0, BLOCK_DK)
    dims_v = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < seqlen_q
    q_rows = (q_begin + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_t + head * stride_q_h + dims_k[None, :],
                mask=row_ok[:, None] & (dims_k[None, :] < head_size), other=0.0)
    dims_r = tl.arange(0, BLOCK_DR)
    k_col = kv_head * stride_k_h  # the head's first column in the [Tk, ·] key, value and rotary key rows
    v_col = kv_head * stride_v_h
    kr_col = kv_head * stride_kr_h  # 0 when one rotary key is shared
    if HAS_ROPE:
        q_r = tl.load(qr_ptr + q_rows[:, None] * stride_qr_t + head * stride_qr_h + dims_r[None, :],
                      mask=row_ok[:, None] & (dims_r[None, :] < rope_size), other=0.0)
    else:
        q_r = q
    q_pos = q_start + offs_m
    if HAS_ALIBI:
        slope2 = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(alibi_ptr + head).to(tl.float32) * LOG2E
    else:
        slope2 = tl.full([BLOCK_M], 0.0, tl.float32)

    # Key ranges: [lo, full_lo) masked | [full_lo, full_hi) unmasked | [full_hi, hi) masked.
    p_min = q_start + block_m * BLOCK_M
    p_max = q_start + tl.minimum((block_m + 1) * BLOCK_M, seqlen_q) - 1
    lo = 0
    hi = seqlen_k
    full_hi = seqlen_k
    if CAUSAL:
        hi = tl.maximum(tl.minimum(hi, p_max + 1), 0)
        full_hi = tl.maximum(tl.minimum(full_hi, p_min + 1), 0)
    full_lo = 0
    if HAS_WINDOW:
        lo = tl.minimum(tl.maximum(p_min - window_left, 0), hi)
        full_lo = tl.maximum(p_max - window_left, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, hi)
    full_lo = tl.maximum(full_lo, lo)
    full_hi = tl.maximum((full_hi // BLOCK_N) * BLOCK_N, full_lo)
    full_hi = tl.minimum(full_hi, hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    k_base = k_ptr + k_begin.to(tl.int64) * stride_k_t + k_col
    v_base = v_ptr + k_begin.to(tl.int64) * stride_v_t + v_col
    kr_base = kr_ptr + k_begin.to(tl.int64) * stride_kr_t + kr_col
    acc, m_i, l_i = _key_loop(acc, m_i, l_i, q, q_r, k_base, v_base, kr_base, k_desc, v_desc, kr_desc,
                              k_begin, stride_k_t, stride_v_t, stride_kr_t, q_pos, slope2,
                              full_lo, full_hi, seqlen_k, qk_scale, softcap, window_left, dims_k, dims_v,
                              dims_r, k_col, v_col, kr_col, head_size, head_size_v, rope_size, BLOCK_N, False, CAUSAL,
                              HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_ROPE, EVEN_D, USE_TMA)
    acc, m_i, l_i = _key_loop(acc, m_i, l_i, q, q_r, k_base, v_base, kr_base, k_desc, v_desc, kr_desc,
                              k_begin, stride_k_t, stride_v_t, stride_kr_t, q_pos, slope2,
                              lo, full_lo, seqlen_k, qk_scale, softcap, window_left, dims_k, dims_v,
                              dims_r, k_col, v_col, kr_col, head_size, head_size_v, rope_size, BLOCK_N, True, CAUSAL,
                              HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_ROPE, EVEN_D, USE_TMA)
    acc, m_i, l_i = _key_loop(acc, m_i, l_i, q, q_r, k_base, v_base, kr_base, k_desc, v_desc, kr_desc,
                              k_begin, stride_k_t, stride_v_t, stride_kr_t, q_pos, slope2,
                              full_hi, hi, seqlen_k, qk_scale, softcap, window_left, dims_k, dims_v,
                              dims_r, k_col, v_col, kr_col, head_size, head_size_v, rope_size, BLOCK_N, True, CAUSAL,
                              HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_ROPE, EVEN_D, USE_TMA)
    if HAS_SINKS:
        sink2 = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        m_i, l_i, acc = add_sinks(m_i, l_i, acc, sink2)
    out, lse = finalize(m_i, l_i, acc, 1.0)
    tl.store(out_ptr + q_rows[:, None] * stride_o_t + head * stride_o_h + dims_v[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dims_v[None, :] < head_size_v))
    if RETURN_LSE:
        tl.store(lse_ptr + q_rows * stride_lse_t + head * stride_lse_h, lse, mask=row_ok)
