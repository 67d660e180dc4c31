"""Varlen flash attention over contiguous keys (the prefill path, and the extend path's pieces).

Program ``(m, h, b)`` computes ``BLOCK_M`` queries of head ``h`` of request ``b`` against the request's
keys, online softmax in the log2 domain. The key range is cut into masked edge tiles and unmasked inner
tiles so the inner loop carries no mask. Query ``i`` of a request sits at position ``q_start + i`` in key
coordinates, ``q_start = seqlen_k - seqlen_q`` (bottom-right) unless given per request.

With ``USE_TMA`` (Hopper) key and value tiles come through tensor descriptors over the ``[Tk, Hkv · D]``
matrices (heads contiguous, power-of-two head sizes); otherwise through pointer loads.
"""

import triton
import triton.language as tl

from tripath.kernels.attention_common import (LOG2E, add_sinks, finalize, score_mods, softmax_update,
                                              softmax_update_raw)


@triton.jit
def _load_k(k_base, k_desc, desc_row, start, stride_k_t, k_pos, seqlen_k, dims_k, kv_head, head_size,
            MASK: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr):
    """Keys of positions ``k_pos = start + [0, BLOCK_N)``, transposed: ``[Dk, BLOCK_N]`` (zeros past the
    request with pointer loads; descriptor tiles may hold the next request's keys there)."""
    if USE_TMA:
        return tl.trans(k_desc.load([desc_row + start, kv_head * head_size]))
    k_ptrs = k_base + k_pos[None, :].to(tl.int64) * stride_k_t + dims_k[:, None]
    if MASK:
        return tl.load(k_ptrs, mask=(k_pos[None, :] < seqlen_k) & (dims_k[:, None] < head_size), other=0.0)
    if EVEN_D:
        return tl.load(k_ptrs)
    return tl.load(k_ptrs, mask=dims_k[:, None] < head_size, other=0.0)


@triton.jit
def _load_v(v_base, v_desc, desc_row, start, stride_v_t, k_pos, seqlen_k, dims_v, kv_head, head_size_v,
            MASK: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr):
    """Values of positions ``k_pos``: ``[BLOCK_N, Dv]``, rows past the request zeroed when ``MASK``."""
    if USE_TMA:
        v = v_desc.load([desc_row + start, kv_head * head_size_v])
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
def _key_loop(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, desc_row, stride_k_t, stride_v_t,
              q_pos, slope2, lo, hi, seqlen_k, qk_scale, softcap, window_left, dims_k, dims_v, kv_head,
              head_size, head_size_v, BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
              HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
              EVEN_D: tl.constexpr, USE_TMA: tl.constexpr):
    """Key tiles ``[lo, hi)`` (``MASK``: edge tiles, masked scores and zeroed value rows)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + offs_n
        k = _load_k(k_base, k_desc, desc_row, start, stride_k_t, k_pos, seqlen_k, dims_k, kv_head, head_size,
                    MASK, EVEN_D, USE_TMA)
        v = _load_v(v_base, v_desc, desc_row, start, stride_v_t, k_pos, seqlen_k, dims_v, kv_head,
                    head_size_v, MASK, EVEN_D, USE_TMA)
        if MASK or HAS_SOFTCAP or HAS_ALIBI:
            s = score_mods(tl.dot(q, k), q_pos, k_pos, seqlen_k, slope2, qk_scale, softcap, window_left,
                           MASK, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)
            m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, MASK)
        else:
            m_i, l_i, acc = softmax_update_raw(tl.dot(q, k), qk_scale, v, m_i, l_i, acc)
    return acc, m_i, l_i


@triton.jit
def varlen_attention_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, out_ptr, lse_ptr,
    cu_seqlens_q_ptr, cu_seqlens_k_ptr, q_start_ptr, alibi_ptr, sinks_ptr,
    qk_scale, softcap, window_left,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
    num_queries_per_kv, head_size, head_size_v,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_Q_START: tl.constexpr, RETURN_LSE: tl.constexpr, EVEN_D: tl.constexpr,
    USE_TMA: tl.constexpr,
):
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
    k_base = k_ptr + k_begin.to(tl.int64) * stride_k_t + kv_head * stride_k_h
    v_base = v_ptr + k_begin.to(tl.int64) * stride_v_t + kv_head * stride_v_h
    acc, m_i, l_i = _key_loop(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, k_begin,
                              stride_k_t, stride_v_t, q_pos, slope2,
                              full_lo, full_hi, seqlen_k, qk_scale, softcap, window_left, dims_k, dims_v,
                              kv_head, head_size, head_size_v, BLOCK_N, False, CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                              HAS_ALIBI, EVEN_D, USE_TMA)
    acc, m_i, l_i = _key_loop(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, k_begin,
                              stride_k_t, stride_v_t, q_pos, slope2,
                              lo, full_lo, seqlen_k, qk_scale, softcap, window_left, dims_k, dims_v,
                              kv_head, head_size, head_size_v, BLOCK_N, True, CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                              HAS_ALIBI, EVEN_D, USE_TMA)
    acc, m_i, l_i = _key_loop(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, k_begin,
                              stride_k_t, stride_v_t, q_pos, slope2,
                              full_hi, hi, seqlen_k, qk_scale, softcap, window_left, dims_k, dims_v,
                              kv_head, head_size, head_size_v, BLOCK_N, True, CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                              HAS_ALIBI, EVEN_D, USE_TMA)
    if HAS_SINKS:
        sink2 = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        m_i, l_i, acc = add_sinks(m_i, l_i, acc, sink2)
    out, lse = finalize(m_i, l_i, acc, 1.0)
    tl.store(out_ptr + q_rows[:, None] * stride_o_t + head * stride_o_h + dims_v[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dims_v[None, :] < head_size_v))
    if RETURN_LSE:
        tl.store(lse_ptr + q_rows * stride_lse_t + head * stride_lse_h, lse, mask=row_ok)
