"""Absorbed MLA decode for Hopper (sm_90) with many heads, warp-specialised, in Gluon.

Program ``(head block, b, split)``: 64 query heads of request ``b`` against the split's cache rows (the two
head blocks of a 128-head request run side by side, so the second read of a row mostly hits L2). The
score product is computed once per tile and shared, so no product runs twice (the portable kernel's
128-head tiles compute the scores once per 256-wide half of the value, 1.5x the FLOPs):

- a **score** warpgroup (the default partition) loads the 64 query rows once (the second latent half by TMA
  into shared memory, the first half and the rotary part into registers as ``wgmma`` A operands) and, per
  ``BLOCK_N``-row cache tile, computes ``s = q_lat · c_latᵀ + q_pe · c_peᵀ`` on ``wgmma``, the online
  softmax, and hands ``p`` (16-bit) and the row rescale ``alpha`` on through a ring of shared buffers. The
  next tile's scores are issued beside this tile's softmax (the register-operand products before it, the
  shared-memory half interleaved with it), so they run beside it and beside the value products. The
  softmax rescales lazily: a row's running maximum moves only when a tile's exceeds it by
  ``RESCALE_SLACK`` (log2 units; ``p`` then stays below ``2^RESCALE_SLACK``), so ``alpha`` is exactly 1 for
  nearly every tile after the first;
- two **value** warpgroups: each owns half of the ``L`` output columns, ``o_half = o_half · alpha + p ·
  c_lat[:, half]``, where the multiply by ``alpha`` (and the wait for the previous product it needs) is
  skipped when every ``alpha`` of the tile is 1, so the products queue back to back on the tensor cores;
  each loads its own half of each tile (warpgroup 0 also the rotary part) into a ring of
  ``NUM_STAGES`` slots: as soon as its product of tile ``i − 1`` completes, it refills that slot with
  tile ``i − 1 + NUM_STAGES`` (page from the block table; ``BLOCK_N`` divides the block size). A separate
  loader warp would leave the three warpgroups fewer registers than they need (the value warpgroups 160
  a thread, the score warpgroup the 184 left).

Shared memory: 5 stages × 36 KiB + the query's second latent half (32 KiB) + p: 221 KiB. The stage count
decides much of the speed (docs/BENCHMARKS.md, "Launch configurations"), which is why half of the query
lives in registers. The score accumulator must not stay in flight across the loop's back edge: ptxas then
serialises every ``wgmma`` (``tripath check-compile`` fails such builds).

Math (log2 domain, ``c = sm_scale · log2 e``)::

    s[h, j] = c · (q_lat[h] · c_lat[j] + q_pe[h] · c_pe[j]),   o[h] = Σ_j 2^(s[h, j] − m_h) c_lat[j] / l_h

with ``m_h`` any value within ``RESCALE_SLACK`` below the running maximum (exactly that maximum when
``RESCALE_SLACK`` is 0), ``l_h = Σ_j 2^(s[h, j] − m_h)``, and the LSE ``(m_h + log2 l_h) · ln 2``.

Cache rows past the request in its last tile may hold anything (NaN included): their scores are masked
and the score warpgroup zeroes their latent rows in shared memory before the value products read them.
Output: ``out [B, H, L]`` for one split, else fp32 partials ``[B, H, S, L]`` and ``lse [B, H, S]``
(natural log) for :func:`tripath.kernels.paged_decode.reduce_splits_kernel`. With ``TMA_OUT`` (one split,
``out`` contiguous and of the query's dtype) each value warpgroup stages its ``[64, L/2]`` output tile in
the ring, free once all three warpgroups have passed ``done``, and stores it with one TMA copy: every
program finishes at about the same time, and pointer stores of that burst cost a measurable share of a
program's time.

The same kernel verifies (``VERIFY``, :func:`tripath.ops.mla_verify` on sm_90): a request's new tokens × heads,
token-major, take the place of the heads, 64 of those rows a program, each row masked to the keys its token
sees (the context and, among the new tokens, its chain prefix or its draft tree's ancestors), so each cache row
is read once for every token of the request (see the kernel's docstring). A decode compiles without any of it.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from tripath.kernels.mla_decode import split_range  # scalar math, shared with the portable kernel
from tripath.kernels.gluon_tma import tma_load, tma_store
from tripath.triton_internals.specialize import STEP_INVARIANT

LN2 = gl.constexpr(0.6931471805599453)
HEADS = gl.constexpr(64)  # query heads per program: one warpgroup's wgmma rows
VALUE_REGS = gl.constexpr(160)  # registers a thread of each value warpgroup; the score warpgroup gets the rest


@gluon.jit
def _tile_row(i, block_table_ptr, stride_bt, seq, lo, block_size, BLOCK_N: gl.constexpr):
    """The cache row where tile ``i`` of the split starts (its page from the block table; ``BLOCK_N``
    divides the block size)."""
    start = lo + i * BLOCK_N
    page = gl.load(block_table_ptr + seq.to(gl.int64) * stride_bt + start // block_size)
    return page * block_size + start % block_size


@gluon.jit
def _load_half(row, stage, half, c_desc, cpe_desc, c_smem, cpe_smem, kv_ready, L_HALF: gl.constexpr):
    """Value warpgroup ``half``'s share of the cache tile at ``row``: TMA of its latent half (warpgroup 0 also
    the rotary part) into ring slot ``stage``; ``kv_ready`` completes once both shares have landed."""
    if half == 0:
        mbarrier.expect(kv_ready.index(stage), c_desc.block_type.nbytes + cpe_desc.block_type.nbytes)
        tma_load(cpe_desc, [row, 2 * L_HALF], kv_ready.index(stage), cpe_smem.index(stage))
    else:
        mbarrier.expect(kv_ready.index(stage), c_desc.block_type.nbytes)
    tma_load(c_desc, [row, half * L_HALF], kv_ready.index(stage),
             c_smem.index(2 * stage + half))


@gluon.jit
def zero_tail_rows(c_smem, stage, n_valid, BLOCK_N: gl.constexpr, CHUNK: gl.constexpr):
    """Zero rows ``n_valid ..`` of both latent halves (``c_smem[2 · stage + half]``, ``[BLOCK_N, L/2]``) of a
    ring slot, ``CHUNK`` rows at a time: the rows past the request in its last tile, which the value
    product reads with probability 0 (and 0 · NaN is NaN)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    for half in gl.static_range(2):
        for c in gl.static_range(BLOCK_N // CHUNK):
            rows = c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
            chunk = c_smem.index(2 * stage + half).slice(c * CHUNK, CHUNK)
            tile = chunk.load(layout)
            chunk.store(gl.where(gl.expand_dims(rows < n_valid, 1), tile, gl.zeros_like(tile)))


@gluon.jit
def _register_scores(i, q_reg, qpe_reg, c_smem, cpe_smem, kv_ready, zero_s, NUM_STAGES: gl.constexpr):
    """Issue (asynchronously) the products of cache tile ``i``'s scores whose query operand lives in registers,
    once the tile has landed: ``q_pe · c_peᵀ + q_lat[:, :L/2] · c_lat[:, :L/2]ᵀ`` (20 ``wgmma``)."""
    stage = i % NUM_STAGES
    mbarrier.wait(kv_ready.index(stage), (i // NUM_STAGES) & 1)
    s_tok = warpgroup_mma(qpe_reg, cpe_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    return warpgroup_mma(q_reg, c_smem.index(2 * stage).permute((1, 0)), s_tok, is_async=True)


@gluon.jit
def _shared_scores(i, s_tok, q_smem, c_smem, NUM_STAGES: gl.constexpr):
    """Add the rest of tile ``i``'s scores to ``s_tok`` (asynchronously):
    ``q_lat[:, L/2:] · c_lat[:, L/2:]ᵀ``, the query operand from shared memory (16 ``wgmma``)."""
    return warpgroup_mma(q_smem, c_smem.index(2 * (i % NUM_STAGES) + 1).permute((1, 0)), s_tok, is_async=True)


@gluon.jit
def _verify_mask(s, start, ctx, row_tok, row_bits, offs_n, TREE: gl.constexpr):
    """A verify's scores ``s [HEADS, BLOCK_N]`` of the tile at key ``start``, masked: the row of token ``t``
    (at position ``ctx + t``) sees key ``p`` when ``p < ctx`` (the context) or, for a new token ``j = p - ctx``,
    when ``j <= t`` (a chain) or bit ``j`` of its tree mask ``row_bits`` is set (a draft tree)."""
    rel = gl.expand_dims(start + offs_n - ctx, 0)
    if TREE:
        bit = (gl.expand_dims(row_bits, 1) >> gl.minimum(gl.maximum(rel, 0), 31)) & 1
        seen = (rel < 0) | (bit != 0)
    else:
        seen = rel <= gl.expand_dims(row_tok, 1)
    return gl.where(seen, s, float("-inf"))


@gluon.jit
def _scorer(q_ptr, q_desc, q_smem, c_smem, cpe_smem, p_smem, alpha_smem, ml_smem, q_ready,
            kv_ready, p_ready, p_empty, done, q_row, lo, hi, num_tiles, qk_scale, L_HALF: gl.constexpr,
            ROPE: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, P_STAGES: gl.constexpr,
            RESCALE_SLACK: gl.constexpr, head0, num_heads, num_q_rows, ctx, q_start, n_new, tree_mask_ptr,
            VERIFY: gl.constexpr, TREE: gl.constexpr):
    """The score warpgroup: the query rows (the second latent half by TMA, the rest into registers), then
    per tile the scores, the online softmax, ``p`` and ``alpha`` handed on; at the end the row maxima and
    sums (``ml_smem [2, HEADS]``). With ``VERIFY`` row ``head0 + r`` of the request is token
    ``(head0 + r) // num_heads`` at position ``ctx`` + that, masked as :func:`_verify_mask` says."""
    mbarrier.expect(q_ready, q_desc.block_type.nbytes)
    tma_load(q_desc, [q_row, L_HALF], q_ready, q_smem)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    # The first latent half and the rotary part of the query live in registers (A operands of their score
    # products), so their 40 KiB of shared memory hold a fifth cache stage instead.
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    q_rows = gl.expand_dims((q_row + gl.arange(0, HEADS, layout=gl.SliceLayout(1, a_layout))).to(gl.int64), 1)
    q_cols = gl.expand_dims(gl.arange(0, L_HALF, layout=gl.SliceLayout(0, a_layout)), 0)
    pe_cols = gl.expand_dims(gl.arange(0, ROPE, layout=gl.SliceLayout(0, a_layout)), 0)
    if VERIFY:  # the last request's tile may reach past the query's rows
        q_reg = gl.load(q_ptr + q_rows * (2 * L_HALF + ROPE) + q_cols,
                        mask=(q_rows < num_q_rows) & (q_cols < L_HALF), other=0.0)
        qpe_reg = gl.load(q_ptr + q_rows * (2 * L_HALF + ROPE) + 2 * L_HALF + pe_cols,
                          mask=(q_rows < num_q_rows) & (pe_cols < ROPE), other=0.0)
    else:
        q_reg = gl.load(q_ptr + q_rows * (2 * L_HALF + ROPE) + q_cols)
        qpe_reg = gl.load(q_ptr + q_rows * (2 * L_HALF + ROPE) + 2 * L_HALF + pe_cols)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_tok = (head0 + gl.arange(0, HEADS, layout=row_s)) // num_heads  # VERIFY: each row's token
    row_bits = row_tok
    if TREE:
        row_bits = gl.load(tree_mask_ptr + q_start + row_tok, mask=row_tok < n_new, other=0)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    zero_s = gl.zeros([HEADS, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([HEADS], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([HEADS], gl.float32, row_s)
    mbarrier.wait(q_ready, 0)
    s = zero_s
    if num_tiles > 0:
        s = _shared_scores(0, _register_scores(0, q_reg, qpe_reg, c_smem, cpe_smem, kv_ready, zero_s, NUM_STAGES),
                           q_smem, c_smem, NUM_STAGES)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    for i in range(num_tiles):
        stage = i % NUM_STAGES
        # The next tile's scores run on the tensor cores beside this softmax and this tile's value products (the
        # last iteration computes its own tile's again and discards them: no branch around an in-flight wgmma).
        # Their register-operand products are issued before the softmax, the shared-memory half after its
        # arithmetic in the source: ptxas then spreads that half's issue through the softmax, which no longer
        # starts only once all 36 products are queued.
        nxt = gl.minimum(i + 1, num_tiles - 1)
        s_next = _register_scores(nxt, q_reg, qpe_reg, c_smem, cpe_smem, kv_ready, zero_s, NUM_STAGES)
        start = lo + i * BLOCK_N
        n_valid = hi - start
        if n_valid < BLOCK_N:  # the split's ragged last tile: mask the scores, zero the rows past the request
            s = gl.where(gl.expand_dims(offs_n < n_valid, 0), s, float("-inf"))
            zero_tail_rows(c_smem, stage, n_valid, BLOCK_N, 8)  # 8 rows at a time: few registers beside q
        if VERIFY:
            if start + BLOCK_N > ctx:  # the tile holds the new tokens' rows
                s = _verify_mask(s, start, ctx, row_tok, row_bits, offs_n, TREE)
        # Lazy rescaling: a row keeps its stale maximum until the tile's exceeds it by RESCALE_SLACK (log2 units),
        # so p ≤ 2^RESCALE_SLACK and alpha is exactly 1 for most tiles, which the value warpgroups then skip.
        m_tile = gl.max(s, axis=1) * qk_scale
        m_new = gl.where(m_tile > m_i + RESCALE_SLACK, m_tile, m_i)
        m_use = m_new  # finite for a decode: every tile holds at least one row of the request
        if VERIFY:  # a verify's row may have seen no row yet (the split's rows so far all past its token)
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        p = p.to(p_smem.dtype)
        s_next = _shared_scores(nxt, s_next, q_smem, c_smem, NUM_STAGES)
        slot = i % P_STAGES
        mbarrier.wait(p_empty.index(slot), ((i // P_STAGES) & 1) ^ 1)
        p_smem.index(slot).store(p)
        alpha_smem.index(slot).store(alpha)
        fence_async_shared()  # p and the zeroed rows are read by wgmma (the async proxy)
        mbarrier.arrive(p_ready.index(slot), count=1)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, ))  # nothing in flight across the back edge
    ml_smem.index(0).store(m_i)
    ml_smem.index(1).store(l_i)
    mbarrier.arrive(done, count=1)


@gluon.jit
def _valuer(half, c_desc, cpe_desc, c_smem, cpe_smem, p_smem, alpha_smem, ml_smem, kv_ready, p_ready, p_empty, done,
            block_table_ptr, stride_bt, block_size, out_ptr, out_desc, lse_ptr, part_out_ptr, part_lse_ptr, seq, head0,
            split, lo, num_heads, num_tiles, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h, L_HALF: gl.constexpr,
            BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, P_STAGES: gl.constexpr, num_splits, SPLIT: gl.constexpr,
            RETURN_LSE: gl.constexpr, TMA_OUT: gl.constexpr, VERIFY: gl.constexpr, out_seq, num_rows):
    """A value warpgroup: output columns ``half · L_HALF + [0, L_HALF)`` of the 64 rows (heads, or a verify's
    token-major heads); ``seq`` the request (its block-table row); with ``VERIFY`` ``out_seq`` the output's row
    block and ``num_rows`` its rows (a decode passes 0 for both: nothing more is captured)."""
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, L_HALF, 16])
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    acc = gl.zeros([HEADS, L_HALF], gl.float32, o_layout)
    # The ring fill: the first two tiles (the score warpgroup's first two score products), then, once the
    # first has landed, the rest. Every program starts at once, so the fill is one burst over the whole GPU;
    # the tiles needed first then do not wait behind the others.
    for i in range(gl.minimum(num_tiles, 2)):
        _load_half(_tile_row(i, block_table_ptr, stride_bt, seq, lo, block_size, BLOCK_N), i, half, c_desc,
                   cpe_desc, c_smem, cpe_smem, kv_ready, L_HALF)
    if num_tiles > 2:
        mbarrier.wait(kv_ready.index(0), 0)
    for i in range(2, gl.minimum(num_tiles, NUM_STAGES)):
        _load_half(_tile_row(i, block_table_ptr, stride_bt, seq, lo, block_size, BLOCK_N), i, half, c_desc,
                   cpe_desc, c_smem, cpe_smem, kv_ready, L_HALF)
    for i in range(num_tiles):
        stage = i % NUM_STAGES
        slot = i % P_STAGES
        # The block-table entry of the tile this iteration refills, read before the waits below so that its
        # latency passes behind them (clamped into the split; unused past its end).
        refill_row = _tile_row(gl.minimum(i - 1 + NUM_STAGES, num_tiles - 1), block_table_ptr, stride_bt, seq, lo,
                               block_size, BLOCK_N)
        mbarrier.wait(p_ready.index(slot), (i // P_STAGES) & 1)  # while the previous product runs
        mbarrier.wait(kv_ready.index(stage), (i // NUM_STAGES) & 1)
        alpha = alpha_smem.index(slot).load(row_o)
        if gl.min(alpha, axis=0) < 1.0:  # some row's maximum moved: rescale once the previous product completes
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            acc = acc * gl.expand_dims(alpha, 1)
        # Otherwise this product queues behind the previous one on the same accumulator, without a wait.
        acc = warpgroup_mma(p_smem.index(slot), c_smem.index(2 * stage + half), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # the previous product has completed
        if i > 0:
            mbarrier.arrive(p_empty.index((i - 1) % P_STAGES), count=1)
        # Tile i − 1's slot is free (its scores were read before its p was handed on, this warpgroup's product
        # has completed, the other warpgroup reads only its own half): refill it with tile i − 1 + NUM_STAGES.
        if i > 0 and i - 1 + NUM_STAGES < num_tiles:
            _load_half(refill_row, (i - 1) % NUM_STAGES, half, c_desc, cpe_desc, c_smem, cpe_smem, kv_ready, L_HALF)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    if num_tiles > 0:
        mbarrier.arrive(p_empty.index((num_tiles - 1) % P_STAGES), count=1)
    # done completes once the score warpgroup has stored the row maxima and sums and both value warpgroups'
    # products have completed (the ring is then free for the output tiles).
    mbarrier.arrive(done, count=1)
    mbarrier.wait(done, 0)
    m_i = ml_smem.index(0).load(row_o)
    l_i = ml_smem.index(1).load(row_o)
    out_smem = None
    if TMA_OUT:  # one TMA store of this warpgroup's [64, L/2] output tile, staged in the (now free) ring
        out_smem = c_smem._reinterpret(out_desc.dtype, [NUM_STAGES, HEADS, L_HALF], out_desc.layout).index(half)
    store_half(acc, m_i, l_i, half, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, out_seq if VERIFY else seq, head0,
               split, num_heads, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h, L_HALF, num_splits, SPLIT,
               RETURN_LSE, num_rows if VERIFY else num_heads, out_desc, out_smem)


@gluon.jit
def store_half(acc, m_i, l_i, half, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, seq, head0, split, num_heads,
               stride_o_b, stride_o_h, stride_lse_b, stride_lse_h, L_HALF: gl.constexpr, num_splits, SPLIT: gl.constexpr,
               RETURN_LSE: gl.constexpr, num_rows, out_desc=None, out_smem=None):
    """The epilogue of a warpgroup that holds output columns ``half · L/2 + [0, L/2)`` of 64 heads:
    ``acc [64, L/2]`` normalised by the row sums ``l_i`` into ``out [B, H, L]`` (one split) or the fp32
    partials, and (warpgroup of half 0) the LSE from the row maxima ``m_i`` (log2 domain). Given
    ``out_desc`` (over ``out`` as ``[B·H, L]``) and a free ``[64, L/2]`` shared buffer ``out_smem``, the
    one-split output goes through ``out_smem`` and a TMA store instead of pointer stores. Rows from
    ``num_rows`` on (``num_heads`` for a decode) are not stored: a verify's ``seq`` is its first token and its rows
    run over its tokens' heads (``out [T, H, L]`` contiguous)."""
    o_layout: gl.constexpr = acc.type.layout
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    seen = l_i > 0.0
    out = acc * gl.expand_dims(gl.where(seen, 1.0 / gl.where(seen, l_i, 1.0), 0.0), 1)
    lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    heads = head0 + gl.arange(0, HEADS, layout=row_o)
    cols = half * L_HALF + gl.arange(0, L_HALF, layout=gl.SliceLayout(0, o_layout))
    head_ok = heads < num_rows
    row_ok = gl.expand_dims(head_ok, 1)
    if not SPLIT and out_smem is not None:  # out [B·H, L] by TMA from out_smem [64, L/2]
        out_smem.store(out.to(out_desc.dtype))
        fence_async_shared()
        tma_store(out_desc, [seq * num_heads + head0, half * L_HALF], out_smem)
        if RETURN_LSE and half == 0:
            gl.store(lse_ptr + seq * stride_lse_b + heads * stride_lse_h, lse, mask=head_ok)
        tma.store_wait(0)
    elif not SPLIT:
        ptrs = (out_ptr + seq.to(gl.int64) * stride_o_b + gl.expand_dims(heads * stride_o_h, 1)
                + gl.expand_dims(cols, 0))
        gl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok)
        if RETURN_LSE and half == 0:
            gl.store(lse_ptr + seq * stride_lse_b + heads * stride_lse_h, lse, mask=head_ok)
    else:
        part = (seq.to(gl.int64) * num_heads + heads) * num_splits + split
        gl.store(part_out_ptr + gl.expand_dims(part * (2 * L_HALF), 1) + gl.expand_dims(cols, 0), out, mask=row_ok)
        if half == 0:
            gl.store(part_lse_ptr + part, lse, mask=head_ok)


@gluon.jit(**STEP_INVARIANT)
def mla_decode_sm90_kernel(
    q_ptr, q_desc, c_desc, cpe_desc, block_table_ptr, seq_lens_ptr, out_ptr, out_desc, lse_ptr, part_out_ptr,
    part_lse_ptr, qk_scale, stride_bt, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h, num_heads, block_size,
    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, P_STAGES: gl.constexpr, num_splits, SPLIT: gl.constexpr,
    RETURN_LSE: gl.constexpr, RESCALE_SLACK: gl.constexpr, TMA_OUT: gl.constexpr,
    cu_seqlens_q_ptr, tree_mask_ptr, splits_used_ptr, num_q_rows, min_split_tiles, VERIFY: gl.constexpr,
    TREE: gl.constexpr,
):
    """Grid ``(H / 64, B, num_splits)``; ``num_warps=4`` (the score warpgroup; the two value
    warpgroups are extra warps). ``q_ptr``/``q_desc``: ``[B·H, L + R]`` contiguous, with ``[64, L/2]``
    boxes; ``c_desc``/``cpe_desc``: the cache rows
    ``[blocks · block_size, L + R]`` with ``[BLOCK_N, L/2]`` and ``[BLOCK_N, R]`` boxes.

    ``VERIFY`` (speculative decoding; :func:`tripath.ops.mla_verify`): request ``b`` brings ``n_b`` new tokens,
    query rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1`` of ``q [T, H, L + R]`` (``num_q_rows = T · H``
    rows of ``q_ptr``), and its ``n_b · H`` (token, head) rows, token-major, are the programs' 64-row tiles:
    grid ``(⌈max n_b · H / 64⌉, B, num_splits)``, each cache row read once for all of them (the tiles of a
    request side by side, as the head blocks of a decode). Token ``t`` at position ``seq_lens[b] - n_b + t``
    sees the context and, among the new tokens, those up to ``t`` (chains) or the bits of its ``tree_mask``
    entry (``TREE``). ``out [T, H, L]`` contiguous (``lse [T, H]`` contiguous). ``num_splits`` is an upper
    bound: request ``b`` takes ``used = min(num_splits, ⌊tiles / min_split_tiles⌋)`` (at least 2) of them for
    its ``tiles = ⌈seq_lens[b] / BLOCK_N⌉``, the programs past ``used`` return at once, and program ``(0, b, 0)``
    stores ``used`` in ``splits_used`` for each of the request's tokens (the merge's count)."""
    L_HALF: gl.constexpr = q_desc.block_type.shape[1]
    head0 = gl.program_id(0) * HEADS  # the head blocks of a request run side by side: the second reads from L2
    seq = gl.program_id(1)
    split = gl.program_id(2)
    seq_len = gl.load(seq_lens_ptr + seq)
    out_seq = seq
    num_rows = num_heads
    ctx = seq_len
    n_new = 1
    used = num_splits
    if VERIFY:
        out_seq = gl.load(cu_seqlens_q_ptr + seq)
        n_new = gl.load(cu_seqlens_q_ptr + seq + 1) - out_seq
        num_rows = n_new * num_heads
        ctx = seq_len - n_new
        if SPLIT:  # the splits this request's own length calls for (a graph's num_splits follows its table width),
            # two at least: every program then writes partials, as a decode's do (one epilogue, fewer registers)
            used = gl.maximum(gl.minimum(num_splits, gl.cdiv(seq_len, BLOCK_N) // min_split_tiles), 2)
            if head0 == 0 and split == 0:
                toks = gl.arange(0, 16, layout=gl.BlockedLayout([1], [32], [4], [0]))  # MAX_VERIFY_TOKENS
                gl.store(splits_used_ptr + out_seq + toks, gl.full([16], 0, gl.int32, toks.type.layout) + used,
                         mask=toks < n_new)
            if split >= used:
                return
        if head0 >= num_rows:  # a row tile past this request's tokens
            return
    lo, hi = split_range(seq_len, split, used, BLOCK_N)
    num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [HEADS, L_HALF], q_desc.layout)  # the second latent half
    c_smem = gl.allocate_shared_memory(dtype, [2 * NUM_STAGES, BLOCK_N, L_HALF], c_desc.layout)
    cpe_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, cpe_desc.block_type.shape[1]],
                                         cpe_desc.layout)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEADS, BLOCK_N], dtype)
    p_smem = gl.allocate_shared_memory(dtype, [P_STAGES, HEADS, BLOCK_N], p_layout)
    vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])  # rows of [slots, HEADS]
    alpha_smem = gl.allocate_shared_memory(gl.float32, [P_STAGES, HEADS], vec_layout)
    ml_smem = gl.allocate_shared_memory(gl.float32, [2, HEADS], vec_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [P_STAGES, 1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [P_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    mbarrier.init(done, count=3)  # the score warpgroup and both value warpgroups
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(kv_ready.index(s), count=2)  # both value warpgroups load a share
    for s in gl.static_range(P_STAGES):
        mbarrier.init(p_ready.index(s), count=1)
        mbarrier.init(p_empty.index(s), count=2)

    gl.warp_specialize([
        (_scorer, (q_ptr, q_desc, q_smem, c_smem, cpe_smem, p_smem, alpha_smem, ml_smem, q_ready, kv_ready,
                   p_ready, p_empty, done, out_seq * num_heads + head0, lo, hi, num_tiles, qk_scale, L_HALF,
                   cpe_desc.block_type.shape[1], BLOCK_N, NUM_STAGES, P_STAGES, RESCALE_SLACK, head0, num_heads,
                   num_q_rows, ctx, out_seq, n_new, tree_mask_ptr, VERIFY, TREE)),
        (_valuer, (0, c_desc, cpe_desc, c_smem, cpe_smem, p_smem, alpha_smem, ml_smem, kv_ready, p_ready, p_empty,
                   done, block_table_ptr, stride_bt, block_size, out_ptr, out_desc, lse_ptr, part_out_ptr, part_lse_ptr,
                   seq, head0, split, lo, num_heads, num_tiles, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
                   L_HALF, BLOCK_N, NUM_STAGES, P_STAGES, num_splits, SPLIT, RETURN_LSE, TMA_OUT, VERIFY,
                   out_seq if VERIFY else 0, num_rows if VERIFY else 0)),
        (_valuer, (1, c_desc, cpe_desc, c_smem, cpe_smem, p_smem, alpha_smem, ml_smem, kv_ready, p_ready, p_empty,
                   done, block_table_ptr, stride_bt, block_size, out_ptr, out_desc, lse_ptr, part_out_ptr, part_lse_ptr,
                   seq, head0, split, lo, num_heads, num_tiles, stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
                   L_HALF, BLOCK_N, NUM_STAGES, P_STAGES, num_splits, SPLIT, RETURN_LSE, TMA_OUT, VERIFY,
                   out_seq if VERIFY else 0, num_rows if VERIFY else 0)),
    # Registers: the value warpgroups keep 160 a thread (a 128-register accumulator and the loop; at 152 ptxas
    # ignored the limit and serialised their products), so setmaxnreg gives the score warpgroup the 184 left,
    # which loosens ptxas's schedule of the softmax (faster than 168 each).
    ], [4, 4], [VALUE_REGS, VALUE_REGS])
