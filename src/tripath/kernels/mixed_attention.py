"""One-launch attention of a whole mixed step (decodes, extends, prefills) over a work list built on the device.

The step's work list (:mod:`tripath.kernels.mixed_plan`) holds items of two kinds of tiles: a *decode tile*
(one request's single new token × the ``G`` query heads of one KV head, packed into ``DECODE_G`` rows as
:mod:`tripath.kernels.paged_decode` packs them) and a *prompt tile* (``BLOCK_Q`` new tokens × ``G`` heads, the
rows of :mod:`tripath.kernels.unified_attention`), each against one piece ``[kv_lo, kv_hi)`` of its keys.

A persistent grid of ``P`` programs walks the ``num_items · Hkv`` works: program ``p`` takes works ``p, p + P,
...``, work ``w`` being item ``w // Hkv`` for KV head ``w % Hkv``. Each runs the shared inner loop
(:func:`~tripath.kernels.attention_common.attend_paged_tiles`) with its kind's tile shape. An item that covers
its tile's whole key range writes ``out`` (and ``lse``) itself, sinks included. A piece of a split tile writes
its normalised fp32 partial ``(o_s, lse_s)`` to slot ``slot0 + piece`` (``part_out [slots, Hkv, PART_ROWS,
BLOCK_DV]``, ``part_lse [slots, Hkv, PART_ROWS]``), then adds one to ``counters[slot0, kv_head]`` (acquire and
release, after a barrier so the whole program's stores are ordered before it); the program that brings the
count to ``pieces`` merges the partials by log-sum-exp (``o = Σ e^{lse_s - lse} o_s``, sinks counted once,
here) into ``out`` and sets the counter back to 0, so the next launch (or graph replay) needs no memset.
Nothing waits on another program, so any grid size is correct; the grid only sets the balance.
"""

import triton
import triton.language as tl

from tripath.kernels.attention_common import LOG2E, add_sinks, attend_paged_tiles, finalize, load_query_tile
from tripath.kernels.mixed_plan import ITEM_FIELDS
from tripath.triton_internals.specialize import STEP_INVARIANT


@triton.jit
def merge_partial(m_i, l_i, acc, lse2, o):
    """Fold one normalised partial (``lse2 [M]`` in the log2 domain, ``o [M, Dv]`` fp32) into a running
    ``(m_i, l_i, acc)`` of the same form as :func:`attend_paged_tiles` returns; an empty partial (−inf) adds
    nothing."""
    m_new = tl.maximum(m_i, lse2)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    w = tl.math.exp2(lse2 - m_use)
    return m_new, l_i * alpha + w, acc * alpha[:, None] + o * w[:, None]


@triton.jit
def attend_item(q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
                out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, counters_ptr,
                alibi_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr, sm_scale, softcap, window_left,
                stride_q_t, stride_q_h, stride_bt,
                stride_k0, stride_k1, stride_k2, stride_k3,
                stride_v0, stride_v1, stride_v2, stride_v3,
                stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
                num_kv_heads, num_queries_per_kv, head_size, head_size_v, block_size,
                seq, tok0, lo, hi, slot0, piece, pieces, kv_head,
                TILE_Q: tl.constexpr, TILE_G: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                PART_ROWS: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                SHUFFLED: tl.constexpr, X: tl.constexpr, KV_FP8: tl.constexpr,
                HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                HAS_SINKS: tl.constexpr, RETURN_LSE: tl.constexpr):
    """One work: ``TILE_Q`` new tokens (from ``tok0``) of request ``seq`` × the ``TILE_G`` (padded) heads of
    ``kv_head`` against keys ``[lo, hi)``; the output, or a partial and perhaps the group's merge."""
    BLOCK_M: tl.constexpr = TILE_Q * TILE_G
    q_begin = tl.load(cu_seqlens_q_ptr + seq)
    query_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows // TILE_G
    g = rows % TILE_G
    heads = kv_head * num_queries_per_kv + g
    row_ok = (tok < query_len) & (g < num_queries_per_kv)
    dims_k = tl.arange(0, BLOCK_DK)
    dims_v = tl.arange(0, BLOCK_DV)
    q_rows = (q_begin + tok).to(tl.int64)
    q, qk_scale, v_scale, slope2 = load_query_tile(q_ptr, q_rows, heads, row_ok, dims_k, head_size, stride_q_t,
                                                   stride_q_h, sm_scale, alibi_ptr, k_scale_ptr, v_scale_ptr,
                                                   BLOCK_M, KV_FP8, HAS_ALIBI)
    q_pos = seq_len - query_len + tok
    # Pieces start at multiples of the key tile (mixed_plan): say so, so the shuffled V tiles load as 16-byte
    # runs and the pipeliner keeps both K and V asynchronous (a loaded lo alone lets it assume nothing).
    lo = (lo // BLOCK_N) * BLOCK_N
    m_i, l_i, acc = attend_paged_tiles(q, q_pos, slope2, qk_scale, softcap, window_left, lo, hi, seq_len,
                                       k_cache_ptr, v_cache_ptr, block_table_ptr, seq, stride_bt, kv_head,
                                       dims_k, dims_v, head_size, head_size_v, block_size,
                                       stride_k0, stride_k1, stride_k2, stride_k3,
                                       stride_v0, stride_v1, stride_v2, stride_v3,
                                       BLOCK_M, BLOCK_N, BLOCK_DV, CAUSAL, SHUFFLED, X,
                                       HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, q_pos, 0, False)
    done = slot0 < 0
    if slot0 >= 0:
        o_s, lse_s = finalize(m_i, l_i, acc, 1.0)  # the value scale is applied once, after the merge
        part = ((slot0 + piece).to(tl.int64) * num_kv_heads + kv_head) * PART_ROWS + rows
        tl.store(part_out_ptr + part[:, None] * BLOCK_DV + dims_v[None, :], o_s, mask=row_ok[:, None])
        tl.store(part_lse_ptr + part, lse_s, mask=row_ok)
        tl.debug_barrier()  # every thread's partial stores before the release below
        counter = counters_ptr + slot0.to(tl.int64) * num_kv_heads + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        done = arrived == pieces - 1
        if done:  # the last piece of the group to finish: merge them all, reset the counter
            tl.store(counter, 0)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
            for j in range(0, pieces):
                part = ((slot0 + j).to(tl.int64) * num_kv_heads + kv_head) * PART_ROWS + rows
                lse2 = tl.load(part_lse_ptr + part, mask=row_ok, other=float("-inf"), cache_modifier=".cg") * LOG2E
                o = tl.load(part_out_ptr + part[:, None] * BLOCK_DV + dims_v[None, :], mask=row_ok[:, None],
                            other=0.0, cache_modifier=".cg")
                m_i, l_i, acc = merge_partial(m_i, l_i, acc, lse2, o)
    if done:
        if HAS_SINKS:
            sink2 = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
            m_i, l_i, acc = add_sinks(m_i, l_i, acc, sink2)
        out, lse = finalize(m_i, l_i, acc, v_scale)
        tl.store(out_ptr + q_rows[:, None] * stride_o_t + heads[:, None] * stride_o_h + dims_v[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dims_v[None, :] < head_size_v))
        if RETURN_LSE:
            tl.store(lse_ptr + q_rows * stride_lse_t + heads * stride_lse_h, lse, mask=row_ok)


@triton.jit(**STEP_INVARIANT)
def mixed_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
    items_ptr, counts_ptr, part_out_ptr, part_lse_ptr, counters_ptr,
    out_ptr, lse_ptr, alibi_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr,
    sm_scale, softcap, window_left,
    stride_q_t, stride_q_h, stride_bt,
    stride_k0, stride_k1, stride_k2, stride_k3,
    stride_v0, stride_v1, stride_v2, stride_v3,
    stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
    num_kv_heads, num_queries_per_kv, head_size, head_size_v, block_size,
    BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, DECODE_G: tl.constexpr, BLOCK_N: tl.constexpr,
    DECODE_BLOCK_N: tl.constexpr, PART_ROWS: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    SHUFFLED: tl.constexpr, X: tl.constexpr, KV_FP8: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr, RETURN_LSE: tl.constexpr,
):
    """Persistent program ``p``: works ``p, p + P, ...`` of the ``counts[0] · Hkv`` (see the module doc)."""
    num_works = tl.load(counts_ptr) * num_kv_heads
    for w in range(tl.program_id(0), num_works, tl.num_programs(0)):
        item = items_ptr + (w // num_kv_heads).to(tl.int64) * ITEM_FIELDS
        kv_head = w % num_kv_heads
        seq = tl.load(item + 0)
        kind = tl.load(item + 1)
        tok0 = tl.load(item + 2)
        lo = tl.load(item + 3)
        hi = tl.load(item + 4)
        slot0 = tl.load(item + 5)
        piece = tl.load(item + 6)
        pieces = tl.load(item + 7)
        if kind == 1:  # a decode: one token, the GQA group packed (the keys before it are all visible)
            attend_item(q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
                        out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, counters_ptr,
                        alibi_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr, sm_scale, softcap, window_left,
                        stride_q_t, stride_q_h, stride_bt, stride_k0, stride_k1, stride_k2, stride_k3,
                        stride_v0, stride_v1, stride_v2, stride_v3, stride_o_t, stride_o_h, stride_lse_t,
                        stride_lse_h, num_kv_heads, num_queries_per_kv, head_size, head_size_v, block_size,
                        seq, tok0, lo, hi, slot0, piece, pieces, kv_head,
                        1, DECODE_G, DECODE_BLOCK_N, False, PART_ROWS, BLOCK_DK, BLOCK_DV, SHUFFLED, X, KV_FP8,
                        HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_SINKS, RETURN_LSE)
        else:  # BLOCK_Q tokens x the group, causal
            attend_item(q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
                        out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, counters_ptr,
                        alibi_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr, sm_scale, softcap, window_left,
                        stride_q_t, stride_q_h, stride_bt, stride_k0, stride_k1, stride_k2, stride_k3,
                        stride_v0, stride_v1, stride_v2, stride_v3, stride_o_t, stride_o_h, stride_lse_t,
                        stride_lse_h, num_kv_heads, num_queries_per_kv, head_size, head_size_v, block_size,
                        seq, tok0, lo, hi, slot0, piece, pieces, kv_head,
                        BLOCK_Q, BLOCK_G, BLOCK_N, True, PART_ROWS, BLOCK_DK, BLOCK_DV, SHUFFLED, X, KV_FP8,
                        HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_SINKS, RETURN_LSE)
