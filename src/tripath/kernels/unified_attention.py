"""One-launch attention for a whole mixed batch whose new K/V are already in the paged cache.

Program ``(qb, kv_head)`` handles ``BLOCK_Q`` consecutive new tokens of one request for the ``G`` query
heads of ``kv_head``: the tile's rows are ``(token, head)`` pairs, ``BLOCK_M = BLOCK_Q · BLOCK_G``. Query
blocks are numbered request by request (``cu_seqlens_q[i] // BLOCK_Q + i`` is request ``i``'s first), and
a program finds its request by binary search. Query ``t`` of a request sits at ``seq_len - query_len + t``
and sees the cached keys causally.
"""

import triton
import triton.language as tl

from tripath.kernels.attention_common import LOG2E, add_sinks, attend_paged_causal, finalize, load_query_tile
from tripath.triton_internals.specialize import STEP_INVARIANT


@triton.jit
def _find_request(cu_seqlens_q_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr, BINARY_STEPS: tl.constexpr):
    lo = 0
    hi = num_seqs
    for _ in range(BINARY_STEPS):
        mid = (lo + hi) // 2
        go_right = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= q_block
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit(**STEP_INVARIANT)
def unified_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
    out_ptr, lse_ptr, alibi_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr,
    sm_scale, softcap, window_left,
    stride_q_t, stride_q_h, stride_bt,
    stride_k0, stride_k1, stride_k2, stride_k3,
    stride_v0, stride_v1, stride_v2, stride_v3,
    stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
    num_seqs, num_queries_per_kv, head_size, head_size_v, block_size,
    BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BINARY_STEPS: tl.constexpr,
    SHUFFLED: tl.constexpr, X: tl.constexpr, KV_FP8: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr, RETURN_LSE: tl.constexpr,
):
    """Program ``(q block, kv_head)``: ``BLOCK_Q`` new tokens of one request x the ``G`` heads of ``kv_head``
    against the request's paged keys (context and new tokens, all in the cache), causal bottom-right."""
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_request(cu_seqlens_q_ptr, num_seqs, q_block, BLOCK_Q, BINARY_STEPS)
    q_begin = tl.load(cu_seqlens_q_ptr + seq)
    query_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin
    local_block = q_block - (q_begin // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    tok = local_block * BLOCK_Q + rows // BLOCK_G
    g = rows % BLOCK_G
    heads = kv_head * num_queries_per_kv + g
    row_ok = (tok < query_len) & (g < num_queries_per_kv)
    dims_k = tl.arange(0, BLOCK_DK)
    dims_v = tl.arange(0, BLOCK_DV)
    q_rows = (q_begin + tok).to(tl.int64)
    q, qk_scale, v_scale, slope2 = load_query_tile(q_ptr, q_rows, heads, row_ok, dims_k, head_size, stride_q_t,
                                                   stride_q_h, sm_scale, alibi_ptr, k_scale_ptr, v_scale_ptr,
                                                   BLOCK_M, KV_FP8, HAS_ALIBI)
    q_pos = context_len + tok

    p_min = context_len + local_block * BLOCK_Q
    p_max = tl.minimum(context_len + (local_block + 1) * BLOCK_Q, seq_len) - 1
    lo = 0
    if HAS_WINDOW:
        lo = (tl.maximum(p_min - window_left, 0) // BLOCK_N) * BLOCK_N
    hi = p_max + 1
    m_i, l_i, acc = attend_paged_causal(q, q_pos, p_min, p_max, slope2, qk_scale, softcap, window_left, lo, hi,
                                        seq_len, k_cache_ptr, v_cache_ptr, block_table_ptr, seq, stride_bt, kv_head,
                                        dims_k, dims_v, head_size, head_size_v, block_size,
                                        stride_k0, stride_k1, stride_k2, stride_k3,
                                        stride_v0, stride_v1, stride_v2, stride_v3,
                                        BLOCK_M, BLOCK_N, BLOCK_DV, SHUFFLED, X, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)
    if HAS_SINKS:
        sink2 = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
        m_i, l_i, acc = add_sinks(m_i, l_i, acc, sink2)
    out, lse = finalize(m_i, l_i, acc, v_scale)
    tl.store(out_ptr + q_rows[:, None] * stride_o_t + heads[:, None] * stride_o_h + dims_v[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dims_v[None, :] < head_size_v))
    if RETURN_LSE:
        tl.store(lse_ptr + q_rows * stride_lse_t + heads * stride_lse_h, lse, mask=row_ok)
