"""The work list of the persistent sm_90 varlen attention kernel (:mod:`tripath.kernels.varlen_attention_sm90`)
and its loader warp: which work item a program takes each round, where the item's rows and keys are, and the
one-warp partition that streams the items' query tiles and K/V tiles through TMA into shared memory."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from tripath.kernels.gluon_tma import tma_load


@gluon.jit
def round_item(r, pid, num_programs, SNAKE: gl.constexpr):
    """The work item of program ``pid`` in round ``r``. With ``SNAKE`` the rounds alternate direction over
    the heaviest-first order, so no program takes the heaviest item of every round: the busiest program's
    tiles come close to the mean (faster on long causal requests; docs/BENCHMARKS.md, "Launch
    configurations"). Head-pair items, whose blocks fill whole rounds evenly either way, keep one direction
    (slower with the snake)."""
    if SNAKE:
        return r * num_programs + pid + (r % 2) * (num_programs - 1 - 2 * pid)
    else:
        return r * num_programs + pid


@gluon.jit
def item_bounds(t, num_head_items, num_seqs, cu_seqlens_q_ptr, cu_seqlens_k_ptr, q_start_ptr,
                 HAS_Q_START: gl.constexpr):
    """The loads work item ``t`` needs (:func:`work_item`): its request's ``(q_begin, q_end, k_begin, k_end,
    q_start)`` (``q_start`` 0 without ``HAS_Q_START``), nothing computed from them, so a caller can issue
    them an item ahead and use them only then (their latency hidden behind the current item)."""
    seq = (t % (num_head_items * num_seqs)) // num_head_items
    q_begin = gl.load(cu_seqlens_q_ptr + seq)
    q_end = gl.load(cu_seqlens_q_ptr + seq + 1)
    k_begin = gl.load(cu_seqlens_k_ptr + seq)
    k_end = gl.load(cu_seqlens_k_ptr + seq + 1)
    q_start = 0
    if HAS_Q_START:
        q_start = gl.load(q_start_ptr + seq)
    return q_begin, q_end, k_begin, k_end, q_start


@gluon.jit
def work_item(t, bounds, num_head_items, num_seqs, num_m_blocks, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               CAUSAL: gl.constexpr, HAS_Q_START: gl.constexpr, PAIR_HEADS: gl.constexpr):
    """Work item ``t`` (query block, head or head pair, request; the last query blocks, which see the most
    keys when causal, first; the heads of one request next to each other, so GQA groups share K/V in L2)
    from its request's ``bounds`` (:func:`item_bounds`).
    Returns ``(head, q_begin, k_begin, row0, seqlen_q, seqlen_k, q_start, num_tiles)`` (``head``: the first
    of the pair with ``PAIR_HEADS``); the item is empty when ``row0 >= seqlen_q``."""
    q_begin, q_end, k_begin, k_end, q_start = bounds
    per_block = num_head_items * num_seqs
    block_m = num_m_blocks - 1 - t // per_block
    head = (t % per_block) % num_head_items
    if PAIR_HEADS:
        head = 2 * head
    seqlen_q = q_end - q_begin
    seqlen_k = k_end - k_begin
    if not HAS_Q_START:
        q_start = seqlen_k - seqlen_q
    row0 = block_m * BLOCK_M
    hi = seqlen_k
    if CAUSAL:
        hi = gl.maximum(gl.minimum(hi, q_start + gl.minimum(row0 + BLOCK_M, seqlen_q)), 0)
    return head, q_begin, k_begin, row0, seqlen_q, seqlen_k, q_start, gl.cdiv(hi, BLOCK_N)


@gluon.jit
def loader(descs, smem, bars, cu_seqlens_q_ptr, cu_seqlens_k_ptr, q_start_ptr, num_heads, num_seqs, num_m_blocks,
            num_queries_per_kv, head_strides, WG_ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
            NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_Q_START: gl.constexpr, HAS_ROPE: gl.constexpr,
            PAIR_HEADS: gl.constexpr):
    """One warp: per work item, the two query tiles (the two row halves, or with ``PAIR_HEADS`` the same
    rows of two heads; once the consumers released the previous ones), then its K and V tiles into the
    rings, running ahead into the next item."""
    q_desc, k_desc, v_desc, qr_desc, kr_desc = descs
    q_smem, k_smem, v_smem, qr_smem, kr_smem = smem
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, v_clean, lag = bars
    stride_q_h, stride_k_h, stride_v_h, stride_qr_h, stride_kr_h = head_strides
    q_bytes: gl.constexpr = q_desc.block_type.nbytes + (qr_desc.block_type.nbytes if HAS_ROPE else 0)
    k_bytes: gl.constexpr = k_desc.block_type.nbytes + (kr_desc.block_type.nbytes if HAS_ROPE else 0)
    q_bufs: gl.constexpr = q_smem.shape[0] // 2
    tiles_done = 0
    items_done = 0
    num_head_items = num_heads // 2 if PAIR_HEADS else num_heads
    block_m: gl.constexpr = WG_ROWS if PAIR_HEADS else 2 * WG_ROWS
    num_items = num_m_blocks * num_head_items * num_seqs
    for r in range(gl.cdiv(num_items, gl.num_programs(0))):
        t = round_item(r, gl.program_id(0), gl.num_programs(0), not PAIR_HEADS)
        bounds = item_bounds(t, num_head_items, num_seqs, cu_seqlens_q_ptr, cu_seqlens_k_ptr, q_start_ptr,
                              HAS_Q_START)
        head, q_begin, k_begin, row0, seqlen_q, seqlen_k, q_start, num_tiles = work_item(
            t, bounds, num_head_items, num_seqs, num_m_blocks, block_m, BLOCK_N, CAUSAL, HAS_Q_START, PAIR_HEADS)
        if (t < num_items) & (row0 < seqlen_q):
            kv_head = head // num_queries_per_kv  # with PAIR_HEADS both heads' (the group size is even)
            q_phase = ((items_done // q_bufs) & 1) ^ 1  # a fresh barrier counts as released
            for wg in gl.static_range(2):
                if PAIR_HEADS:
                    q_row = q_begin + row0
                    q_head = head + wg
                else:
                    q_row = q_begin + row0 + wg * WG_ROWS
                    q_head = head
                qbuf = (items_done % q_bufs) * 2 + wg
                mbarrier.wait(q_empty.index(qbuf), q_phase)
                mbarrier.expect(q_ready.index(qbuf), q_bytes)
                tma_load(q_desc, [q_row, q_head * stride_q_h], q_ready.index(qbuf),
                         q_smem.index(qbuf))
                if HAS_ROPE:
                    tma_load(qr_desc, [q_row, q_head * stride_qr_h], q_ready.index(qbuf),
                             qr_smem.index(qbuf))
            for i in range(num_tiles):
                stage = (tiles_done + i) % NUM_STAGES
                free_phase = (((tiles_done + i) // NUM_STAGES) & 1) ^ 1
                row = k_begin + i * BLOCK_N
                mbarrier.wait(k_empty.index(stage), free_phase)
                mbarrier.expect(k_ready.index(stage), k_bytes)
                tma_load(k_desc, [row, kv_head * stride_k_h], k_ready.index(stage),
                         k_smem.index(stage))
                if HAS_ROPE:
                    tma_load(kr_desc, [row, kv_head * stride_kr_h], k_ready.index(stage),
                             kr_smem.index(stage))
                mbarrier.wait(v_empty.index(stage), free_phase)
                mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
                tma_load(v_desc, [row, kv_head * stride_v_h], v_ready.index(stage),
                         v_smem.index(stage))
            tiles_done += num_tiles
            items_done += 1
