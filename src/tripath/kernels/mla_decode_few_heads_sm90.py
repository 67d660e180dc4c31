"""Absorbed MLA decode for Hopper (sm_90) with few heads (8, 16 or 32), warp-specialised, in Gluon: the
``variant="auto"``/``"gluon"`` choice of :func:`tripath.ops.mla_decode` for those head counts at block sizes
that are a multiple of 64.

With 16 heads the decode reads 1152 bytes of cache per row and does 16 · 1088 · 2 FLOPs with them: it is
bound by memory, and the kernel's job is to keep loads in flight. ``wgmma`` takes 64 rows, so the products
run transposed, with cache rows as the 64 rows and the heads as the narrow side::

    sᵀ [BLOCK_N, H] = c [BLOCK_N, L + R] · qᵀ            (A: the cache tile, B: the query, both in smem)
    oᵀ [L, H]      += c_latᵀ [L, BLOCK_N] · pᵀ [BLOCK_N, H]   (A: the cache tile read transposed, B: p)

Program ``(b, split)``: all ``H`` heads of request ``b`` against the split's rows. A one-warp **loader**
partition streams ``BLOCK_N``-row cache tiles (two latent halves and the rotary part, page from the block
table) through TMA into a two-stage ring; the **compute** warpgroup (the default partition) runs, per tile,
the score product, the online softmax over the tile's rows (per head: a column of ``sᵀ``), ``pᵀ`` into
shared memory and the value products into two ``[L/2, H]`` accumulators, then frees the slot. The compute
per tile is short against the tile's load, so both slots are in flight most of the time.

Math (log2 domain, ``c = sm_scale · log2 e``)::

    s[j, h] = c · (c_lat[j] · q_lat[h] + c_pe[j] · q_pe[h]),   o[h] = Σ_j 2^(s[j, h] − m_h) c_lat[j] / l_h

Cache rows past the request in its last tile may hold anything (NaN included): their scores are masked and
the compute warpgroup zeroes their latent rows in shared memory before the value products read them.
Output: ``out [B, H, L]`` for one split, else fp32 partials ``[B, H, S, L]`` and ``lse [B, H, S]``
(natural log) for :func:`tripath.kernels.paged_decode.reduce_splits_kernel`.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from tripath.kernels.mla_decode import split_range  # scalar math, shared with the portable kernel
from tripath.kernels.mla_decode_sm90 import zero_tail_rows
from tripath.kernels.gluon_tma import tma_load
from tripath.triton_internals.specialize import STEP_INVARIANT

LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _loader(q_desc, qpe_desc, c_desc, cpe_desc, q_smem, qpe_smem, c_smem, cpe_smem, q_ready, kv_ready, kv_empty,
            block_table_ptr, stride_bt, seq, q_row, lo, hi, num_tiles, block_size, L_HALF: gl.constexpr,
            BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """The query rows once, then every cache tile of the split into the ring as its slot frees."""
    mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes + qpe_desc.block_type.nbytes)
    tma_load(q_desc, [q_row, 0], q_ready, q_smem.index(0))
    tma_load(q_desc, [q_row, L_HALF], q_ready, q_smem.index(1))
    tma_load(qpe_desc, [q_row, 2 * L_HALF], q_ready, qpe_smem)
    PAGE_ROWS: gl.constexpr = c_desc.block_type.shape[0]  # rows per TMA copy: the block size, or BLOCK_N
    PAGES: gl.constexpr = BLOCK_N // PAGE_ROWS
    for i in range(num_tiles):
        stage = i % NUM_STAGES
        tile_start = lo + i * BLOCK_N
        mbarrier.wait(kv_empty.index(stage), ((i // NUM_STAGES) & 1) ^ 1)  # fresh barriers count as released
        mbarrier.expect(kv_ready.index(stage), PAGES * (2 * c_desc.block_type.nbytes + cpe_desc.block_type.nbytes))
        for j in gl.static_range(PAGES):
            # A page past the split (a ragged last tile) is read from block 0: the compute warpgroup masks
            # and zeroes those rows, and the block-table entry past the request is never read.
            start = tile_start + j * PAGE_ROWS
            page = gl.load(block_table_ptr + seq.to(gl.int64) * stride_bt + start // block_size, mask=start < hi,
                           other=0)
            row = page * block_size + start % block_size
            tma_load(c_desc, [row, 0], kv_ready.index(stage),
                     c_smem.index(2 * stage).slice(j * PAGE_ROWS, PAGE_ROWS))
            tma_load(c_desc, [row, L_HALF], kv_ready.index(stage),
                     c_smem.index(2 * stage + 1).slice(j * PAGE_ROWS, PAGE_ROWS))
            tma_load(cpe_desc, [row, 2 * L_HALF], kv_ready.index(stage),
                     cpe_smem.index(stage).slice(j * PAGE_ROWS, PAGE_ROWS))


@gluon.jit
def _compute(q_smem, qpe_smem, c_smem, cpe_smem, p_smem, q_ready, kv_ready, kv_empty, out_ptr, lse_ptr,
             part_out_ptr, part_lse_ptr, seq, split, lo, hi, num_tiles, num_heads, qk_scale, stride_o_b, stride_o_h,
             stride_lse_b, stride_lse_h, HEADS: gl.constexpr, L_HALF: gl.constexpr, BLOCK_N: gl.constexpr,
             NUM_STAGES: gl.constexpr, num_splits, SPLIT: gl.constexpr, RETURN_LSE: gl.constexpr):
    """The compute warpgroup: per tile, ``sᵀ``, the softmax per head over the tile's rows, ``pᵀ`` and the two
    value halves ``oᵀ[half]`` (``[L/2, H]`` each); then the epilogue."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEADS, 16])
    head_s: gl.constexpr = gl.SliceLayout(0, s_layout)  # per-head vectors beside sᵀ
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEADS, 16])
    head_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    rows_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    zero_s = gl.zeros([BLOCK_N, HEADS], gl.float32, s_layout)
    acc0 = gl.zeros([L_HALF, HEADS], gl.float32, o_layout)
    acc1 = gl.zeros([L_HALF, HEADS], gl.float32, o_layout)
    m_i = gl.full([HEADS], float("-inf"), gl.float32, head_s)
    l_i = gl.zeros([HEADS], gl.float32, head_s)
    mbarrier.wait(q_ready, 0)
    for i in range(num_tiles):
        stage = i % NUM_STAGES
        mbarrier.wait(kv_ready.index(stage), (i // NUM_STAGES) & 1)
        s_tok = warpgroup_mma(c_smem.index(2 * stage), q_smem.index(0).permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)
        s_tok = warpgroup_mma(c_smem.index(2 * stage + 1), q_smem.index(1).permute((1, 0)), s_tok, is_async=True)
        s_tok = warpgroup_mma(cpe_smem.index(stage), qpe_smem.permute((1, 0)), s_tok, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
        n_valid = hi - (lo + i * BLOCK_N)
        if n_valid < BLOCK_N:  # the split's ragged last tile: mask the scores, zero the rows past the request
            s = gl.where(gl.expand_dims(rows_n < n_valid, 1), s, float("-inf"))
            zero_tail_rows(c_smem, stage, n_valid, BLOCK_N, 16)
        m_new = gl.maximum(m_i, gl.max(s, axis=0) * qk_scale)
        alpha = gl.exp2(m_i - m_new)  # m_new is finite: every tile holds at least one row of the request
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 0))
        l_i = l_i * alpha + gl.sum(p, axis=0)
        m_i = m_new
        p_smem.store(p.to(p_smem.dtype))
        fence_async_shared()  # pᵀ and the zeroed rows are read by wgmma (the async proxy)
        alpha_o = gl.expand_dims(gl.convert_layout(alpha, head_o), 0)
        o_tok0 = warpgroup_mma(c_smem.index(2 * stage).permute((1, 0)), p_smem, acc0 * alpha_o, is_async=True)
        o_tok1 = warpgroup_mma(c_smem.index(2 * stage + 1).permute((1, 0)), p_smem, acc1 * alpha_o, is_async=True)
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok0, o_tok1))
        mbarrier.arrive(kv_empty.index(stage), count=1)

    seen = l_i > 0.0
    inv_l = gl.convert_layout(gl.where(seen, 1.0 / gl.where(seen, l_i, 1.0), 0.0), head_o)
    lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    _store_half(acc0, 0, inv_l, out_ptr, part_out_ptr, seq, split, num_heads, stride_o_b, stride_o_h, HEADS,
                L_HALF, num_splits, SPLIT)
    _store_half(acc1, 1, inv_l, out_ptr, part_out_ptr, seq, split, num_heads, stride_o_b, stride_o_h, HEADS,
                L_HALF, num_splits, SPLIT)
    heads = gl.arange(0, HEADS, layout=head_s)
    if not SPLIT:
        if RETURN_LSE:
            gl.store(lse_ptr + seq * stride_lse_b + heads * stride_lse_h, lse, mask=heads < num_heads)
    else:
        gl.store(part_lse_ptr + (seq.to(gl.int64) * num_heads + heads) * num_splits + split, lse,
                 mask=heads < num_heads)


@gluon.jit
def _store_half(acc, half, inv_l, out_ptr, part_out_ptr, seq, split, num_heads, stride_o_b, stride_o_h,
                HEADS: gl.constexpr, L_HALF: gl.constexpr, num_splits, SPLIT: gl.constexpr):
    """``oᵀ[half] [L/2, H]`` normalised into ``out [B, H, L]`` (or the split's fp32 partials)."""
    o_layout: gl.constexpr = acc.type.layout
    heads = gl.arange(0, HEADS, layout=gl.SliceLayout(0, o_layout))
    cols = half * L_HALF + gl.expand_dims(gl.arange(0, L_HALF, layout=gl.SliceLayout(1, o_layout)), 1)
    head_ok = gl.expand_dims(heads < num_heads, 0)
    out = acc * gl.expand_dims(inv_l, 0)
    if not SPLIT:
        ptrs = out_ptr + seq.to(gl.int64) * stride_o_b + gl.expand_dims(heads * stride_o_h, 0) + cols
        gl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=head_ok)
    else:
        part = (seq.to(gl.int64) * num_heads + heads) * num_splits + split
        gl.store(part_out_ptr + gl.expand_dims(part * (2 * L_HALF), 0) + cols, out, mask=head_ok)


@gluon.jit(**STEP_INVARIANT)
def mla_decode_few_heads_sm90_kernel(
    q_desc, qpe_desc, c_desc, cpe_desc, block_table_ptr, seq_lens_ptr, out_ptr, lse_ptr, part_out_ptr,
    part_lse_ptr, qk_scale, stride_bt, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h, num_heads, block_size,
    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, num_splits, SPLIT: gl.constexpr, RETURN_LSE: gl.constexpr,
):
    """Grid ``(B, num_splits)``; ``num_warps=4`` (the compute warpgroup; the loader is one extra warp).
    ``q_desc``: ``[B·H, L + R]`` with ``[H, L/2]`` boxes (``H`` = the heads, a power of two 8–32),
    ``qpe_desc`` the same rows with ``[H, R]`` boxes; ``c_desc``/``cpe_desc``: the cache rows
    ``[blocks · block_size, L + R]`` with ``[BLOCK_N, L/2]`` and ``[BLOCK_N, R]`` boxes."""
    HEADS: gl.constexpr = q_desc.block_type.shape[0]
    L_HALF: gl.constexpr = q_desc.block_type.shape[1]
    seq = gl.program_id(0)
    split = gl.program_id(1)
    lo, hi = split_range(gl.load(seq_lens_ptr + seq), split, num_splits, BLOCK_N)
    num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, HEADS, L_HALF], q_desc.layout)
    qpe_smem = gl.allocate_shared_memory(dtype, qpe_desc.block_type.shape, qpe_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, [2 * NUM_STAGES, BLOCK_N, L_HALF], c_desc.layout)
    cpe_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, cpe_desc.block_type.shape[1]],
                                         cpe_desc.layout)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEADS], dtype)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEADS], p_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(kv_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=1)

    gl.warp_specialize([
        (_compute, (q_smem, qpe_smem, c_smem, cpe_smem, p_smem, q_ready, kv_ready, kv_empty, out_ptr, lse_ptr,
                    part_out_ptr, part_lse_ptr, seq, split, lo, hi, num_tiles, num_heads, qk_scale, stride_o_b,
                    stride_o_h, stride_lse_b, stride_lse_h, HEADS, L_HALF, BLOCK_N, NUM_STAGES, num_splits, SPLIT,
                    RETURN_LSE)),
        (_loader, (q_desc, qpe_desc, c_desc, cpe_desc, q_smem, qpe_smem, c_smem, cpe_smem, q_ready, kv_ready,
                   kv_empty, block_table_ptr, stride_bt, seq, seq * num_heads, lo, hi, num_tiles, block_size, L_HALF,
                   BLOCK_N, NUM_STAGES)),
    ], [1], [24])
