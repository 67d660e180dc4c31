"""Warp-specialised varlen flash attention for Hopper (sm_90), written in Gluon.

The portable kernel (:mod:`tripath.kernels.varlen_attention`) runs every warp through the same chain:
load, ``QKᵀ``, softmax, ``PV``. Triton 3.6 cannot split that chain across warps on sm_90, so the tensor
cores idle while the softmax runs. This kernel is the FlashAttention-3 arrangement, spelled out in Gluon:

- persistent programs (one per SM) take work items of ``2 · WG_ROWS`` (128) query rows of one head of one
  request, or with ``PAIR_HEADS`` (short requests, an even GQA group) ``WG_ROWS`` rows of two query heads
  that read the same KV head: then both consumers need the same keys, and a causal item's diagonal tile
  wastes less;
- a **loader** partition (one warp) streams ``BLOCK_N``-key tiles of K and V through TMA into two rings of
  ``NUM_STAGES`` shared-memory buffers, each buffer with a *ready* barrier (TMA byte count) and an *empty*
  barrier (both consumers release it);
- two **consumer** partitions (one warpgroup each, ``WG_ROWS`` = 64 query rows each: a half of the item's
  rows, or with ``PAIR_HEADS`` the rows of one of its heads) run asynchronous
  ``wgmma``. Within each, the score product of tile ``j`` and the value product of tile ``j − 1`` are in
  flight together while the softmax of tile ``j`` runs; across the two, the warp schedulers overlap one
  warpgroup's softmax with the other's matrix products. With ``LAG_TILES`` > 0, warpgroup 1 starts each
  item only once warpgroup 0 has the scores of its first ``LAG_TILES`` key tiles (:func:`_lag_signal`), so
  the two stay that far apart and one's work outside the key loop (first scores, last value product,
  epilogue) overlaps the other's loop instead of leaving the tensor cores idle for both at once.

Math (per query row ``i`` of head ``h``, keys ``k`` of the request, log2 domain, ``c = sm_scale · log2 e``)::

    s_ik = c · (q_i · k_k + qr_i · kr_k)   visible: k < seqlen_k and (causal: k <= q_start + i)
    m_i  = max_k s_ik,  l_i = Σ_k 2^(s_ik − m_i),  o_i = Σ_k 2^(s_ik − m_i) v_k / l_i
    lse_i = (m_i + log2 l_i) · ln 2   (−inf, and o_i = 0, for a row that sees no key)

Shapes: queries ``[Tq, Hq, D]``, keys and values ``[Tk, Hkv, D]``, read through TMA descriptors over their
rows as matrices (head ``h`` from column ``h · stride_h``; query head ``h`` reads KV head ``h //
num_queries_per_kv``), output ``[Tq, Hq, D]``, LSE ``[Tq, Hq]``. With ``HAS_ROPE`` the scores have a second
part (MLA's decoupled rotary dims): ``qr [Tq, Hq, R]``, ``kr [Tk, Hr, R]`` with ``Hr`` the KV heads or one
rotary key shared by all (head stride 0), loaded beside Q and K under the same barriers. A tile that reaches
past its request reads the next request's rows (or TMA's zero fill past the tensor); those scores are masked
and those query rows are not stored. The value rows there would still enter the value product with
probability 0, and 0 · NaN is NaN, so warpgroup 0 zeroes them in shared memory first (``_clean_last_values``):
rows outside the requests may hold anything.

Supported: fp16/bf16, ``D`` = 64 or 128, ``R`` = 32 or 64, causal (bottom-right, or from ``q_start``) or
not. Windows, softcap, ALiBi and sinks stay on the portable kernel (see the launcher).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from tripath.kernels.gluon_tma import tma_store
from tripath.kernels.varlen_sm90_work import item_bounds, loader, round_item, work_item
from tripath.triton_internals.specialize import STEP_INVARIANT

LN2 = gl.constexpr(0.6931471805599453)


@gluon.constexpr_function
def _store_layout(head_d, num_warps):
    """A blocked layout whose threads write 16-byte runs of one output row."""
    cols = min(head_d // 8, 32)
    return gl.BlockedLayout([1, 8], [32 // cols, cols], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _query_buffers(pair_heads, has_rope):
    """Query buffers per warpgroup: two (double-buffered) for head-pair items without a rotary part, where
    shared memory has room (4 · 16 KiB of queries beside the 128 KiB key/value ring), else one."""
    return 2 if pair_heads and not has_rope else 1


@gluon.jit
def _scores(qbuf, stage, smem, zero_s, HAS_ROPE: gl.constexpr):
    """Issue the (asynchronous) score product of the query buffer ``qbuf`` and the key tile in ``stage``:
    ``q kᵀ`` (+ ``qr krᵀ``)."""
    q_smem, k_smem, v_smem, qr_smem, kr_smem = smem
    s_tok = warpgroup_mma(q_smem.index(qbuf), k_smem.index(stage).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
    if HAS_ROPE:
        s_tok = warpgroup_mma(qr_smem.index(qbuf), kr_smem.index(stage).permute((1, 0)), s_tok, is_async=True)
    return s_tok


@gluon.jit
def _softmax_tile(qk, m_i, l_i, tile, num_unmasked, q_pos, offs_n, seqlen_k, qk_scale,
                  BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Online-softmax step on raw scores ``qk [WG_ROWS, BLOCK_N]`` of key tile ``tile``: returns
    ``(p, m_new, l_new, alpha)`` with ``p = 2^(c·qk − m_new)`` and ``alpha = 2^(m_i − m_new)``."""
    if tile >= num_unmasked:
        k_pos = tile * BLOCK_N + offs_n
        visible = gl.expand_dims(k_pos < seqlen_k, 0)
        if CAUSAL:
            visible = visible & (gl.expand_dims(k_pos, 0) <= gl.expand_dims(q_pos, 1))
        qk = gl.where(visible, qk, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(qk, axis=1) * qk_scale)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
    p = gl.exp2(qk * qk_scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def _clean_last_values(wg, v_buf, v_clean, items_done, valid_rows, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr):
    """Warpgroup 0 zeroes rows ``valid_rows ..`` of the item's last value tile (when there are any) and
    signals ``v_clean[0]``; warpgroup 1 waits for it and acknowledges on ``v_clean[1]``, which warpgroup 0
    awaits before its next signal, so it never runs a phase ahead (once per item: phase ``items_done & 1``)."""
    if wg == 0:
        mbarrier.wait(v_clean.index(1), (items_done & 1) ^ 1)  # a fresh barrier counts as acknowledged
        if valid_rows < BLOCK_N:
            layout: gl.constexpr = _store_layout(HEAD_D, 4)
            for c in gl.static_range(BLOCK_N // 16):
                rows = c * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
                chunk = v_buf.slice(c * 16, 16)
                values = chunk.load(layout)
                chunk.store(gl.where(gl.expand_dims(rows < valid_rows, 1), values, gl.zeros_like(values)))
            fence_async_shared()  # the zeroed rows are read by wgmma (the async proxy)
        mbarrier.arrive(v_clean.index(0), count=1)
    else:
        mbarrier.wait(v_clean.index(0), items_done & 1)
        mbarrier.arrive(v_clean.index(1), count=1)


@gluon.jit
def _release_query(q_empty_bar, defer, TMA_STORE: gl.constexpr):
    """Give an item's query buffer back to the loader, unless its output tile is staged there (TMA store)."""
    if TMA_STORE:
        if not defer:
            mbarrier.arrive(q_empty_bar, count=1)
    else:
        mbarrier.arrive(q_empty_bar, count=1)


@gluon.jit
def _store_rows(out, out_ptr, q_begin, first, seqlen_q, head, stride_o_t, stride_o_h, WG_ROWS: gl.constexpr,
                HEAD_D: gl.constexpr):
    """Store output rows ``first + [0, WG_ROWS)`` of a request (those below ``seqlen_q``) of head ``head``,
    through a layout whose threads write 16-byte runs."""
    st_layout: gl.constexpr = _store_layout(HEAD_D, 4)
    out = gl.convert_layout(out, st_layout)
    rows = first + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, st_layout))
    dims = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, st_layout))
    o_ptrs = (out_ptr + gl.expand_dims((q_begin + rows).to(gl.int64) * stride_o_t, 1) + head * stride_o_h
              + gl.expand_dims(dims, 0))
    gl.store(o_ptrs, out, mask=gl.expand_dims(rows < seqlen_q, 1))


@gluon.jit
def _lag_signal(lag, items_done):
    """Warpgroup 0: warpgroup 1 may start item ``items_done`` (after it acknowledged the previous signal,
    so the barrier never runs a phase ahead)."""
    mbarrier.wait(lag.index(1), (items_done & 1) ^ 1)  # a fresh barrier counts as acknowledged
    mbarrier.arrive(lag.index(0), count=1)


@gluon.jit
def _lag_wait(lag, items_done):
    """Warpgroup 1: wait for :func:`_lag_signal` of item ``items_done``, acknowledge it."""
    mbarrier.wait(lag.index(0), items_done & 1)
    mbarrier.arrive(lag.index(1), count=1)


@gluon.jit
def _attend(wg, smem, bars, o_desc, out_ptr, lse_ptr, items_done, tiles_done, prev_deferred, head, q_begin, row0,
            seqlen_q, seqlen_k, q_start, num_tiles, qk_scale, out_strides, WG_ROWS: gl.constexpr,
            BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
            HAS_ROPE: gl.constexpr, RETURN_LSE: gl.constexpr, PAIR_HEADS: gl.constexpr, LAG_TILES: gl.constexpr,
            TMA_STORE: gl.constexpr):
    """One warpgroup, one work item: query rows ``row0 + wg · WG_ROWS + [0, WG_ROWS)`` of head ``head``
    (with ``PAIR_HEADS``: rows ``row0 + [0, WG_ROWS)`` of head ``head + wg``) of the request against its key
    tiles ``0 .. num_tiles − 1`` (ring slots counted on from ``tiles_done``). With ``LAG_TILES``, warpgroup 1
    waits at the start for warpgroup 0's signal, which warpgroup 0 gives once it has the scores of tile
    ``min(num_tiles, LAG_TILES) − 1`` (at once for an item without tiles).

    With ``TMA_STORE`` (two query buffers a warpgroup), an item whose rows all lie inside its request writes
    its output tile into its own query buffer and stores it through TMA (``o_desc``), asynchronously; the
    buffer goes back to the loader at the start of the next item, once TMA has read it
    (``prev_deferred``). Returns whether this item deferred its buffer so."""
    q_smem, k_smem, v_smem, qr_smem, kr_smem = smem
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, v_clean, lag = bars
    stride_o_t, stride_o_h, stride_lse_t, stride_lse_h = out_strides
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype

    if PAIR_HEADS:
        first = row0
        head = head + wg
    else:
        first = row0 + wg * WG_ROWS
    q_pos = q_start + first + gl.arange(0, WG_ROWS, layout=row_s)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    key_bound = seqlen_k  # keys below it are visible to every row of this warpgroup
    if CAUSAL:
        key_bound = gl.minimum(q_start + first + 1, seqlen_k)
    num_unmasked = gl.maximum(key_bound, 0) // BLOCK_N

    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([WG_ROWS], gl.float32, row_s)
    acc = gl.zeros([WG_ROWS, HEAD_D], gl.float32, o_layout)
    zero_s = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, s_layout)
    q_bufs: gl.constexpr = q_smem.shape[0] // 2
    qbuf = (items_done % q_bufs) * 2 + wg
    if TMA_STORE:
        if prev_deferred:
            tma.store_wait(0)  # the previous item's output tile has been read out of its query buffer
            mbarrier.arrive(q_empty.index(((items_done + 1) % q_bufs) * 2 + wg), count=1)
    defer = first + WG_ROWS <= seqlen_q  # (read only with TMA_STORE)
    if LAG_TILES > 0:
        if wg == 1:
            _lag_wait(lag, items_done)
    mbarrier.wait(q_ready.index(qbuf), (items_done // q_bufs) & 1)

    if num_tiles > 0:
        # Tile 0's scores, alone.
        stage = tiles_done % NUM_STAGES
        mbarrier.wait(k_ready.index(stage), (tiles_done // NUM_STAGES) & 1)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(_scores(qbuf, stage, smem, zero_s, HAS_ROPE), ))
        mbarrier.arrive(k_empty.index(stage), count=1)
        if LAG_TILES > 0:
            if wg == 0:
                if gl.minimum(num_tiles, LAG_TILES) == 1:
                    _lag_signal(lag, items_done)
        p, m_i, l_i, alpha = _softmax_tile(qk, m_i, l_i, 0, num_unmasked, q_pos, offs_n, seqlen_k, qk_scale,
                                           BLOCK_N, CAUSAL)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, num_tiles):
            prev = stage
            prev_phase = ((tiles_done + j - 1) // NUM_STAGES) & 1
            stage = (tiles_done + j) % NUM_STAGES
            # Scores of tile j and the value product of tile j − 1, both in flight.
            mbarrier.wait(k_ready.index(stage), ((tiles_done + j) // NUM_STAGES) & 1)
            s_tok = _scores(qbuf, stage, smem, zero_s, HAS_ROPE)
            mbarrier.wait(v_ready.index(prev), prev_phase)
            o_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            qk = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
            mbarrier.arrive(k_empty.index(stage), count=1)
            if LAG_TILES > 1:
                if wg == 0:
                    if j == gl.minimum(num_tiles, LAG_TILES) - 1:
                        _lag_signal(lag, items_done)
            # Softmax of tile j while the value product runs.
            p, m_i, l_i, alpha = _softmax_tile(qk, m_i, l_i, j, num_unmasked, q_pos, offs_n, seqlen_k, qk_scale,
                                               BLOCK_N, CAUSAL)
            acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_op))
            mbarrier.arrive(v_empty.index(prev), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        _release_query(q_empty.index(qbuf), defer, TMA_STORE)  # every score product of this item has completed
        mbarrier.wait(v_ready.index(stage), ((tiles_done + num_tiles - 1) // NUM_STAGES) & 1)
        # Value rows past the request (the next request's, or whatever the caller's tensor holds past the
        # last one) enter the product with probability 0; warpgroup 0 zeroes them first, as 0 · NaN is NaN.
        _clean_last_values(wg, v_smem.index(stage), v_clean, items_done, seqlen_k - (num_tiles - 1) * BLOCK_N,
                           BLOCK_N, HEAD_D)
        o_tok = warpgroup_mma(p_op, v_smem.index(stage), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_op))
        mbarrier.arrive(v_empty.index(stage), count=1)
    else:
        _release_query(q_empty.index(qbuf), defer, TMA_STORE)
        _clean_last_values(wg, v_smem.index(0), v_clean, items_done, BLOCK_N, BLOCK_N, HEAD_D)  # phase only
        if LAG_TILES > 0:
            if wg == 0:
                _lag_signal(lag, items_done)

    # Epilogue: normalise, store the rows that belong to the request.
    seen = l_i > 0.0
    inv_l = gl.where(seen, 1.0 / gl.where(seen, l_i, 1.0), 0.0)
    out = (acc * gl.expand_dims(gl.convert_layout(inv_l, row_o), 1)).to(dtype)
    if TMA_STORE:
        if defer:
            o_buf = q_smem.index(qbuf)  # its scores are done; the loader waits for it (q_empty)
            o_buf.store(out)
            fence_async_shared()  # the tile is read by TMA (the async proxy)
            tma_store(o_desc, [q_begin + first, head * stride_o_h], o_buf)
        else:
            _store_rows(out, out_ptr, q_begin, first, seqlen_q, head, stride_o_t, stride_o_h, WG_ROWS, HEAD_D)
    else:
        _store_rows(out, out_ptr, q_begin, first, seqlen_q, head, stride_o_t, stride_o_h, WG_ROWS, HEAD_D)
    if RETURN_LSE:
        lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
        lse_rows = first + gl.arange(0, WG_ROWS, layout=row_s)
        gl.store(lse_ptr + (q_begin + lse_rows).to(gl.int64) * stride_lse_t + head * stride_lse_h, lse,
                 mask=lse_rows < seqlen_q)
    if TMA_STORE:
        return defer
    else:
        return False


@gluon.jit
def _consumer(wg, smem, bars, o_desc, out_ptr, lse_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, q_start_ptr, num_heads,
              num_seqs, num_m_blocks, qk_scale, out_strides, WG_ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_D: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_Q_START: gl.constexpr,
              HAS_ROPE: gl.constexpr, RETURN_LSE: gl.constexpr, PAIR_HEADS: gl.constexpr, LAG_TILES: gl.constexpr,
              TMA_STORE: gl.constexpr):
    """One warpgroup (``wg`` 0 or 1): its half of every work item of this program, in the loader's order.
    Without a rotary part the loads of the next item's bounds (:func:`item_bounds`) are issued before this
    item runs and nothing reads them until it is done, so their latency hides behind its work (the SASS
    reads them at the loop's back edge; when the item was computed from them right after the loads, ptxas
    placed those reads right there and every item waited for its loads). With a rotary part the five
    registers they hold spill at the 168-register cap, so those loads wait."""
    tiles_done = 0
    items_done = 0
    deferred = False
    num_head_items = num_heads // 2 if PAIR_HEADS else num_heads
    block_m: gl.constexpr = WG_ROWS if PAIR_HEADS else 2 * WG_ROWS
    num_items = num_m_blocks * num_head_items * num_seqs
    pid = gl.program_id(0)
    num_programs = gl.num_programs(0)
    nxt = item_bounds(pid, num_head_items, num_seqs, cu_seqlens_q_ptr, cu_seqlens_k_ptr, q_start_ptr,
                       HAS_Q_START)  # round 0's item
    for r in range(gl.cdiv(num_items, num_programs)):
        t = round_item(r, pid, num_programs, not PAIR_HEADS)
        if HAS_ROPE:
            bounds = item_bounds(t, num_head_items, num_seqs, cu_seqlens_q_ptr, cu_seqlens_k_ptr, q_start_ptr,
                                  HAS_Q_START)
        else:
            bounds = nxt
            # (The next round's item may lie past the last one: its loads stay in bounds, it is never run.)
            nxt = item_bounds(round_item(r + 1, pid, num_programs, not PAIR_HEADS), num_head_items, num_seqs,
                               cu_seqlens_q_ptr, cu_seqlens_k_ptr, q_start_ptr, HAS_Q_START)
        head, q_begin, k_begin, row0, seqlen_q, seqlen_k, q_start, num_tiles = work_item(
            t, bounds, num_head_items, num_seqs, num_m_blocks, block_m, BLOCK_N, CAUSAL, HAS_Q_START, PAIR_HEADS)
        if (t < num_items) & (row0 < seqlen_q):
            deferred = _attend(wg, smem, bars, o_desc, out_ptr, lse_ptr, items_done, tiles_done, deferred, head,
                               q_begin, row0, seqlen_q, seqlen_k, q_start, num_tiles, qk_scale, out_strides, WG_ROWS,
                               BLOCK_N, HEAD_D, NUM_STAGES, CAUSAL, HAS_ROPE, RETURN_LSE, PAIR_HEADS, LAG_TILES,
                               TMA_STORE)
            tiles_done += num_tiles
            items_done += 1
    if TMA_STORE:
        tma.store_wait(0)  # the last output tiles have been read out of shared memory


@gluon.jit(**STEP_INVARIANT)
def varlen_attention_sm90_kernel(
    q_desc, k_desc, v_desc, qr_desc, kr_desc, o_desc, out_ptr, lse_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, q_start_ptr,
    qk_scale, stride_o_t, stride_o_h, stride_lse_t, stride_lse_h, num_heads, num_seqs, num_m_blocks,
    num_queries_per_kv, stride_q_h, stride_k_h, stride_v_h, stride_qr_h, stride_kr_h,
    BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    HAS_Q_START: gl.constexpr, HAS_ROPE: gl.constexpr, RETURN_LSE: gl.constexpr, PAIR_HEADS: gl.constexpr,
    LAG_TILES: gl.constexpr = 0, TMA_STORE: gl.constexpr = False,
):
    """Persistent: program ``p`` of ``P`` takes one work item a round (:func:`round_item`: ``p``, then
    ``2P − 1 − p``, ``2P + p``, …) of the
    ``num_m_blocks · num_heads · num_seqs`` (128-row query block, head, request) items (``num_m_blocks`` =
    ``cdiv(max_seqlen_q, 128)``; items past their request's queries are skipped); with ``PAIR_HEADS``,
    ``num_m_blocks · num_heads / 2 · num_seqs`` (64-row query block, head pair, request) items
    (``num_m_blocks`` = ``cdiv(max_seqlen_q, 64)``; ``num_queries_per_kv`` even). ``qr_desc``/``kr_desc``
    are read only with ``HAS_ROPE``. ``LAG_TILES`` (at most ``NUM_STAGES``): how many key tiles of an item
    warpgroup 0 scores before warpgroup 1 starts it (0: none). Launch with ``num_warps=4`` (the first
    consumer; the second consumer and the loader are extra warps)."""
    WG_ROWS: gl.constexpr = q_desc.block_type.shape[0]
    # Warpgroup 0 runs LAG_TILES key tiles ahead of warpgroup 1; a tile frees its ring slot only once both
    # have used it, so more than the ring holds would deadlock.
    gl.static_assert(LAG_TILES <= NUM_STAGES)
    # Query buffers per warpgroup (_query_buffers): one for 128-row items, which leaves room on the SM for a
    # paged-decode program beside it (two buffers, 209 KiB, made the mixed step slower);
    # two for head-pair items, so the next item's queries load while this one finishes.
    Q_BUFS: gl.constexpr = _query_buffers(PAIR_HEADS, HAS_ROPE)
    # Output tiles are staged in their item's query buffer, released an item later: two buffers needed.
    gl.static_assert(not TMA_STORE or Q_BUFS == 2)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2 * Q_BUFS, WG_ROWS, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    if HAS_ROPE:
        qr_smem = gl.allocate_shared_memory(qr_desc.dtype, [2 * Q_BUFS] + qr_desc.block_type.shape, qr_desc.layout)
        kr_smem = gl.allocate_shared_memory(kr_desc.dtype, [NUM_STAGES] + kr_desc.block_type.shape, kr_desc.layout)
    else:
        qr_smem = q_smem
        kr_smem = k_smem
    q_ready = gl.allocate_shared_memory(gl.int64, [2 * Q_BUFS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2 * Q_BUFS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_clean = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # [signal, acknowledgement]
    mbarrier.init(v_clean.index(0), count=1)
    mbarrier.init(v_clean.index(1), count=1)
    lag = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # [signal, acknowledgement]
    mbarrier.init(lag.index(0), count=1)
    mbarrier.init(lag.index(1), count=1)
    for b in gl.static_range(2 * Q_BUFS):
        mbarrier.init(q_ready.index(b), count=1)
        mbarrier.init(q_empty.index(b), count=1)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=2)  # one arrival from each consumer
        mbarrier.init(v_empty.index(s), count=2)

    smem = (q_smem, k_smem, v_smem, qr_smem, kr_smem)
    bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, v_clean, lag)
    out_strides = (stride_o_t, stride_o_h, stride_lse_t, stride_lse_h)
    # (Argument tuples are written out: a tuple built by concatenation turns its constexprs into tensors.)
    gl.warp_specialize([
        (_consumer, (0, smem, bars, o_desc, out_ptr, lse_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, q_start_ptr, num_heads,
                     num_seqs, num_m_blocks, qk_scale, out_strides, WG_ROWS, BLOCK_N, HEAD_D, NUM_STAGES, CAUSAL,
                     HAS_Q_START, HAS_ROPE, RETURN_LSE, PAIR_HEADS, LAG_TILES, TMA_STORE)),
        (_consumer, (1, smem, bars, o_desc, out_ptr, lse_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, q_start_ptr, num_heads,
                     num_seqs, num_m_blocks, qk_scale, out_strides, WG_ROWS, BLOCK_N, HEAD_D, NUM_STAGES, CAUSAL,
                     HAS_Q_START, HAS_ROPE, RETURN_LSE, PAIR_HEADS, LAG_TILES, TMA_STORE)),
        (loader, ((q_desc, k_desc, v_desc, qr_desc, kr_desc), smem, bars, cu_seqlens_q_ptr, cu_seqlens_k_ptr,
                   q_start_ptr, num_heads, num_seqs, num_m_blocks, num_queries_per_kv,
                   (stride_q_h, stride_k_h, stride_v_h, stride_qr_h, stride_kr_h), WG_ROWS, BLOCK_N, NUM_STAGES,
                   CAUSAL, HAS_Q_START, HAS_ROPE, PAIR_HEADS)),
    ], [4, 1], [240, 24])
