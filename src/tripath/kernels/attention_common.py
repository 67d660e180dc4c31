"""Inner-loop helpers shared by the attention kernels (varlen, paged decode, unified).

Scores live in the log2 domain inside kernels: ``s2 = log2(e) · s``, so the softmax uses ``exp2``.
``qk_scale = sm_scale · k_scale · log2(e)`` folds the fp8 key scale in; the value scale multiplies the
output at the end. Positions: a row's query sits at ``q_pos``, a key at ``k_pos``; the mask keeps
``k_pos < k_limit``, ``k_pos <= q_pos`` (causal) and ``q_pos - k_pos <= window_left`` (window).
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # instantiated: compiled kernels may only read constexpr globals


@triton.jit
def _tanh(x):
    """``tanh(x)`` to a few fp32 ulps relative at every magnitude: ``2·sigmoid(2x) − 1`` cancels for small
    ``|x|`` (an absolute error of ~1e-7, so ``c·tanh(s/c)`` lost ``c·1e-7`` for a large cap ``c``), so below
    ``|x| < 1/4`` the odd Taylor series to ``x^9`` (truncation < 1e-8 relative) takes over."""
    x2 = x * x
    series = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (-0.05396825396825397
                                                                                   + x2 * 0.021869488536155203))))
    return tl.where(tl.abs(x) < 0.25, series, 2.0 * tl.sigmoid(2.0 * x) - 1.0)


@triton.jit
def score_mods(qk, q_pos, k_pos, k_limit, slope2, qk_scale, softcap, window_left,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Raw dot products ``qk [M, N]`` → log2-domain scores with softcap, ALiBi and the mask applied.

    ``q_pos [M]``, ``k_pos [N]`` int positions; ``slope2 [M]`` ALiBi slopes times log2(e);
    ``softcap`` in natural units (with ``qk_scale`` already including log2(e), the cap is applied to
    ``qk · qk_scale / log2(e)``).
    """
    if HAS_SOFTCAP:
        x = qk * (qk_scale / (softcap * LOG2E))
        s = (softcap * LOG2E) * _tanh(x)
    else:
        s = qk * qk_scale
    if HAS_ALIBI:
        s += slope2[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
    if MASK:
        visible = k_pos[None, :] < k_limit
        if CAUSAL:
            visible = visible & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & ((q_pos[:, None] - k_pos[None, :]) <= window_left)
        s = tl.where(visible, s, float("-inf"))
    return s


@triton.jit
def load_query_tile(q_ptr, q_rows, heads, row_ok, dims_k, head_size, stride_q_t, stride_q_h, sm_scale,
                    alibi_ptr, k_scale_ptr, v_scale_ptr, BLOCK_M: tl.constexpr, KV_FP8: tl.constexpr,
                    HAS_ALIBI: tl.constexpr):
    """A tile's queries and what scales its scores: ``q [BLOCK_M, BLOCK_DK]`` (row ``r`` is token row
    ``q_rows[r]``, head ``heads[r]``; 0 where ``row_ok`` is false or past ``head_size``), ``qk_scale`` (the
    softmax scale times log2(e), times the fp8 key scale), ``v_scale`` (the fp8 value scale, else 1) and the
    rows' ALiBi slopes times log2(e) (``[BLOCK_M]``, 0 without ALiBi)."""
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_t + heads[:, None] * stride_q_h + dims_k[None, :],
                mask=row_ok[:, None] & (dims_k[None, :] < head_size), other=0.0)
    qk_scale = sm_scale * LOG2E
    v_scale = 1.0
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    if HAS_ALIBI:
        slope2 = tl.load(alibi_ptr + heads, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
    else:
        slope2 = tl.zeros([BLOCK_M], tl.float32)
    return q, qk_scale, v_scale, slope2


@triton.jit
def softmax_update(s, v, m_i, l_i, acc, MASK: tl.constexpr):
    """One online-softmax step: scores ``s [M, N]`` (log2 domain), values ``v [N, Dv]``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASK:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])  # accumulate in place (wgmma/MFMA accumulator)
    return m_new, l_i, acc


@triton.jit
def softmax_update_raw(qk, qk_scale, v, m_i, l_i, acc):
    """:func:`softmax_update` for an unmasked tile with no score modifications, on the raw products
    ``qk [M, N]``: the scale is folded into the exponent, ``p = exp2(qk · qk_scale − m)`` (one FMA an
    element), and the running max is taken on the raw maxima times the (positive) scale."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def add_sinks(m_i, l_i, acc, sink2):
    """Count each row's sink (log2 domain, ``[M]``) once in the denominator. A row that saw no key and has
    a −inf sink stays empty (``l_i`` 0, so :func:`finalize` gives 0 and LSE −inf, not NaN)."""
    m_new = tl.maximum(m_i, sink2)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.math.exp2(sink2 - m_use)
    return m_new, l_i, acc * alpha[:, None]


@triton.jit
def finalize(m_i, l_i, acc, v_scale):
    """Normalised output (0 where a row saw nothing) and natural-log LSE (−inf there)."""
    empty = l_i == 0.0
    out = acc * (v_scale / tl.where(empty, 1.0, l_i))[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) / LOG2E)
    return out, lse


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines holding ``ptrs`` (a tensor of pointers, any shape): one
    ``prefetch.global.L2`` per element, NVIDIA only, a hint that returns nothing. Loads issued later then
    wait on L2 rather than on HBM, which keeps more bytes in flight than registers or shared memory hold."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def load_paged_kv(k_cache_ptr, v_cache_ptr, block_row_ptr, k_pos, k_limit, kv_head, dims_k, dims_v,
                  head_size, head_size_v, block_size,
                  stride_k0, stride_k1, stride_k2, stride_k3,
                  stride_v0, stride_v1, stride_v2, stride_v3,
                  SHUFFLED: tl.constexpr, X: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, MASK: tl.constexpr):
    """Load keys transposed ``[Dk, N]`` and values ``[N, Dv]`` of positions ``k_pos [N]`` from the paged
    cache, converted to the compute dtype (fp8 is dequantised by the caller's scales). Without ``MASK`` every
    position is below ``k_limit`` (the caller knows): no position is masked.

    The shuffled layout is read with the same 2-D tiles as NHD, each element's address computed from the
    layout: runs of ``x`` elements (16 bytes) are contiguous along the head dims for K and along the tokens
    for V, so every thread still issues 16-byte loads, and the tiles go to the tensor cores without a
    permutation. Needs ``k_pos`` to start at a multiple of ``x`` (tiles start at multiples of ``BLOCK_N``).
    """
    if SHUFFLED:
        k_pos = tl.multiple_of(k_pos, X)  # runs of x tokens start at multiples of x (see above)
    valid = k_pos < k_limit
    # every token of a block that holds a valid one reads that block (uniform addresses within a block)
    if MASK:
        blocks = tl.load(block_row_ptr + k_pos // block_size, mask=(k_pos // block_size) * block_size < k_limit,
                         other=0).to(tl.int64)
    else:
        blocks = tl.load(block_row_ptr + k_pos // block_size).to(tl.int64)
    offsets = k_pos % block_size
    if SHUFFLED:
        # K[b, h, d // x, s, d % x] and V[b, h, s // x, d, s % x]: the innermost strides are x itself
        # (constexpr, so the compiler sees 16-byte aligned runs; stride_k3 == stride_v3 == x). The block
        # ids come from memory, so the compiler cannot see that runs of x tokens share one (x divides the
        # block size): say so. Without these facts every element is read 2 bytes at a time.
        blocks = tl.max_constancy(blocks, X)
        k_off = (blocks[None, :] * stride_k0 + kv_head * stride_k1 + (dims_k[:, None] // X) * stride_k2
                 + offsets[None, :] * X + dims_k[:, None] % X)
        lane = tl.arange(0, k_pos.shape[0]) % X  # == offsets % X: tiles start at multiples of x
        run = tl.max_constancy(offsets // X, X)
        v_off = (blocks[:, None] * stride_v0 + kv_head * stride_v1 + run[:, None] * stride_v2
                 + dims_v[None, :] * X + lane[:, None])
    else:
        k_off = (blocks[None, :] * stride_k0 + offsets[None, :] * stride_k1 + kv_head * stride_k2
                 + dims_k[:, None] * stride_k3)
        v_off = (blocks[:, None] * stride_v0 + offsets[:, None] * stride_v1 + kv_head * stride_v2
                 + dims_v[None, :] * stride_v3)
    if not MASK:
        k = tl.load(k_cache_ptr + k_off, mask=dims_k[:, None] < head_size, other=0.0)
        v = tl.load(v_cache_ptr + v_off, mask=dims_v[None, :] < head_size_v, other=0.0)
        return k.to(COMPUTE_DTYPE), v.to(COMPUTE_DTYPE)
    k = tl.load(k_cache_ptr + k_off, mask=valid[None, :] & (dims_k[:, None] < head_size), other=0.0)
    if SHUFFLED:
        # V's 16-byte runs lie along the tokens: mask whole runs (a run whose first token is valid lies in a
        # valid block) so the loads stay vectorised, then zero the tokens past the limit.
        run_ok = (k_pos // X) * X < k_limit
        v = tl.load(v_cache_ptr + v_off, mask=run_ok[:, None] & (dims_v[None, :] < head_size_v), other=0.0)
        v = tl.where(valid[:, None], v, 0.0)
    else:
        v = tl.load(v_cache_ptr + v_off, mask=valid[:, None] & (dims_v[None, :] < head_size_v), other=0.0)
    return k.to(COMPUTE_DTYPE), v.to(COMPUTE_DTYPE)


@triton.jit
def paged_tile_loop(m_i, l_i, acc, q, q_pos, slope2, qk_scale, softcap, window_left, lo, hi, seq_len,
                    k_cache_ptr, v_cache_ptr, block_row_ptr, kv_head, dims_k, dims_v, head_size, head_size_v,
                    block_size, stride_k0, stride_k1, stride_k2, stride_k3, stride_v0, stride_v1, stride_v2,
                    stride_v3, BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
                    SHUFFLED: tl.constexpr, X: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                    HAS_ALIBI: tl.constexpr, tree_bits, tree_start, TREE: tl.constexpr):
    """Key tiles ``[lo, hi)`` folded into the running ``(m_i, l_i, acc)`` (see :func:`attend_paged_tiles`).
    Without ``MASK`` the caller knows every key of the range is visible to every row (below ``seq_len``,
    causal and in the window): nothing is masked, and without softcap or ALiBi the scale is folded into the
    exponent (:func:`softmax_update_raw`)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + offs_n
        k, v = load_paged_kv(k_cache_ptr, v_cache_ptr, block_row_ptr, k_pos, seq_len, kv_head, dims_k, dims_v,
                             head_size, head_size_v, block_size,
                             stride_k0, stride_k1, stride_k2, stride_k3,
                             stride_v0, stride_v1, stride_v2, stride_v3,
                             SHUFFLED, X, q.dtype, MASK)
        qk = tl.dot(q, k)
        if MASK or HAS_SOFTCAP or HAS_ALIBI:
            s = score_mods(qk, q_pos, k_pos, seq_len, slope2, qk_scale, softcap, window_left,
                           MASK, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)
            if TREE:
                offset = k_pos - tree_start
                bit = (tree_bits[:, None] >> tl.maximum(offset, 0)[None, :]) & 1
                s = tl.where((offset[None, :] >= 0) & (bit == 0), float("-inf"), s)
            m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, MASK)
        else:
            m_i, l_i, acc = softmax_update_raw(qk, qk_scale, v, m_i, l_i, acc)
    return m_i, l_i, acc


@triton.jit
def attend_paged_tiles(q, q_pos, slope2, qk_scale, softcap, window_left, lo, hi, seq_len,
                       k_cache_ptr, v_cache_ptr, block_table_ptr, seq, stride_bt, kv_head, dims_k, dims_v,
                       head_size, head_size_v, block_size,
                       stride_k0, stride_k1, stride_k2, stride_k3,
                       stride_v0, stride_v1, stride_v2, stride_v3,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
                       CAUSAL: tl.constexpr, SHUFFLED: tl.constexpr, X: tl.constexpr,
                       HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                       tree_bits, tree_start, TREE: tl.constexpr):
    """Online softmax of the query rows ``q [BLOCK_M, Dk]`` (at positions ``q_pos [BLOCK_M]``) over request
    ``seq``'s paged keys ``[lo, hi)`` of ``kv_head``, in tiles of ``BLOCK_N`` read through its block-table
    row: :func:`load_paged_kv`, :func:`score_mods` (keys past ``seq_len`` masked, causal if ``CAUSAL``),
    :func:`softmax_update`; every tile masked. With ``TREE`` (a draft tree's verify) a key at
    ``tree_start + j`` or later is visible to a row only where bit ``j`` of its ``tree_bits [BLOCK_M]`` is set
    (the row's token and its ancestors); keys before ``tree_start`` are visible to every row. Returns the
    running max and sum ``[BLOCK_M]`` (log2 domain) and the unnormalised output ``acc [BLOCK_M, BLOCK_DV]``
    fp32, for :func:`add_sinks` / :func:`finalize`."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    block_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt
    return paged_tile_loop(m_i, l_i, acc, q, q_pos, slope2, qk_scale, softcap, window_left, lo, hi, seq_len,
                           k_cache_ptr, v_cache_ptr, block_row_ptr, kv_head, dims_k, dims_v, head_size,
                           head_size_v, block_size, stride_k0, stride_k1, stride_k2, stride_k3, stride_v0,
                           stride_v1, stride_v2, stride_v3, BLOCK_N, True, CAUSAL, SHUFFLED, X, HAS_WINDOW,
                           HAS_SOFTCAP, HAS_ALIBI, tree_bits, tree_start, TREE)


@triton.jit
def attend_paged_causal(q, q_pos, q_first, q_last, slope2, qk_scale, softcap, window_left, lo, hi, seq_len,
                        k_cache_ptr, v_cache_ptr, block_table_ptr, seq, stride_bt, kv_head, dims_k, dims_v,
                        head_size, head_size_v, block_size,
                        stride_k0, stride_k1, stride_k2, stride_k3,
                        stride_v0, stride_v1, stride_v2, stride_v3,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
                        SHUFFLED: tl.constexpr, X: tl.constexpr,
                        HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """:func:`attend_paged_tiles` for rows that see the keys causally (bottom-right), the tile's queries at
    positions ``q_first ≤ q_pos ≤ q_last`` (its valid rows; ``q_first < seq_len``), ``lo`` a multiple of
    ``BLOCK_N``. The key range is cut into edge tiles and inner tiles: a key ``k`` with ``k ≤ q_first`` and
    (with a window) ``q_last − k ≤ window_left`` is visible to every row, so the tiles wholly made of such keys
    run unmasked (:func:`paged_tile_loop` without ``MASK``), the others masked. :mod:`unified_attention`'s
    tiles take it; paged decode and the one-launch mixed kernel keep :func:`attend_paged_tiles`, where the
    three loops measured slower (docs/BENCHMARKS.md, "The mixed step")."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    block_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt
    hi = tl.maximum(hi, lo)  # an empty range stays empty in all three loops
    inner_lo = lo
    if HAS_WINDOW:
        inner_lo = lo + tl.cdiv(tl.maximum(q_last - window_left - lo, 0), BLOCK_N) * BLOCK_N
    inner_lo = tl.minimum(inner_lo, hi)
    inner_hi = lo + (tl.maximum(tl.minimum(hi, q_first + 1) - lo, 0) // BLOCK_N) * BLOCK_N
    inner_hi = tl.maximum(inner_hi, inner_lo)
    m_i, l_i, acc = paged_tile_loop(m_i, l_i, acc, q, q_pos, slope2, qk_scale, softcap, window_left, lo, inner_lo,
                                    seq_len, k_cache_ptr, v_cache_ptr, block_row_ptr, kv_head, dims_k, dims_v,
                                    head_size, head_size_v, block_size, stride_k0, stride_k1, stride_k2, stride_k3,
                                    stride_v0, stride_v1, stride_v2, stride_v3, BLOCK_N, True, True, SHUFFLED, X,
                                    HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, q_pos, 0, False)
    m_i, l_i, acc = paged_tile_loop(m_i, l_i, acc, q, q_pos, slope2, qk_scale, softcap, window_left, inner_lo,
                                    inner_hi, seq_len, k_cache_ptr, v_cache_ptr, block_row_ptr, kv_head, dims_k,
                                    dims_v, head_size, head_size_v, block_size, stride_k0, stride_k1, stride_k2,
                                    stride_k3, stride_v0, stride_v1, stride_v2, stride_v3, BLOCK_N, False, True,
                                    SHUFFLED, X, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, q_pos, 0, False)
    return paged_tile_loop(m_i, l_i, acc, q, q_pos, slope2, qk_scale, softcap, window_left, inner_hi, hi, seq_len,
                           k_cache_ptr, v_cache_ptr, block_row_ptr, kv_head, dims_k, dims_v, head_size,
                           head_size_v, block_size, stride_k0, stride_k1, stride_k2, stride_k3, stride_v0,
                           stride_v1, stride_v2, stride_v3, BLOCK_N, True, True, SHUFFLED, X, HAS_WINDOW,
                           HAS_SOFTCAP, HAS_ALIBI, q_pos, 0, False)
