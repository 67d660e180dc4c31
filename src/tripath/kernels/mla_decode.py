"""Absorbed MLA decode: every query head against one shared latent KV head, split-KV.

Query ``q [B, H, L + R]`` = ``[q_lat (L) | q_pe (R)]``; cache rows ``c = [c_lat (L) | c_pe (R)]``. For request
``b`` with ``n = seq_lens[b]`` cached rows (its own token included):

    s[h, j] = sm_scale · (q_lat[h]·c_lat[j] + q_pe[h]·c_pe[j]),   o[h] = Σ_j softmax_j(s[h]) · c_lat[j]

``mla_decode_kernel`` (program ``(b, head block, split)``) packs ``BLOCK_H`` heads into the rows of one tile:
each ``[BLOCK_N, L + R]`` tile of cache rows is loaded once and used by all of them through two ``tl.dot``
(latent and rotary parts, since ``L + R`` is not a power of two), so with 64-128 heads the tensor cores
carry the work. With ``V_PARTS = 2`` (many heads: compute-bound) program ``(b, 2·head block + part, split)``
produces half of the ``L`` output columns: it still computes the full scores, but its accumulator is
``[BLOCK_H, L/2]``, which lets 128-head tiles fit in registers without spreading one row's softmax
across warpgroups (the price: the score products run twice, 1.5x the FLOPs).
With ``USE_TMA`` (Hopper, block sizes a multiple of ``BLOCK_N``) whole cache tiles come through tensor
descriptors instead of per-row pointer loads, and a request's ragged end through 16-row pointer tiles.
``SWAP_AB`` transposes the products (cache rows as the MMA's M dimension), so that 16 heads still run on
Hopper's 64-row warpgroup MMA reading its operands straight from shared memory.
fp8: ``kv_scale`` (and ``q_scale`` for an fp8 query,
which then multiplies fp8 tiles directly) folds into the score scale; ``kv_scale`` multiplies the output.
With several splits each writes an fp32 partial ``(o_s, lse_s)`` ``[B, H, S, BLOCK_L]`` that
:func:`tripath.kernels.paged_decode.reduce_splits_kernel` merges.
"""

import triton
import triton.language as tl

from tripath.kernels.attention_common import LOG2E, finalize, prefetch_l2
from tripath.kernels.quant import round_to_fp8_grid
from tripath.triton_internals.specialize import STEP_INVARIANT


@triton.jit
def split_range(seq_len, split, num_splits, BLOCK_N: tl.constexpr):
    """This split's share ``[lo, hi)`` of ``seq_len`` rows, in whole tiles."""
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, seq_len)
    return lo, hi


@triton.jit
def _softmax_step(s, c_lat, m_i, l_i, acc, P_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                  EMULATE_RNE: tl.constexpr):
    """Online softmax over one tile: log2-domain scores ``s [M, N]`` (masked entries −inf, each row with at
    least one valid entry), values ``c_lat [N, L]``. With ``P_FP8`` the probabilities enter the product as
    e4m3 (under the interpreter rounded onto its grid first: :mod:`tripath.kernels.quant`)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if P_FP8 and EMULATE_RNE:  # p is in [0, 1]: no saturation needed
        p = round_to_fp8_grid(p, FP8_MAX)
    acc = tl.dot(p.to(c_lat.dtype), c_lat, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def latent_score_scale(sm_scale, q_scale_ptr, kv_scale_ptr, KV_FP8: tl.constexpr, Q_FP8: tl.constexpr):
    qk_scale = sm_scale * LOG2E
    v_scale = 1.0
    if KV_FP8:
        v_scale = tl.load(kv_scale_ptr)
        qk_scale = qk_scale * v_scale
    if Q_FP8:
        qk_scale = qk_scale * tl.load(q_scale_ptr)
    return qk_scale, v_scale


@triton.jit
def _store_result(out, lse, seq, heads, split, row_ok, lse_ok, dims_l, kv_lora_rank,
                  out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
                  stride_o_b, stride_o_h, stride_lse_b, stride_lse_h, num_heads,
                  num_splits, SPLIT: tl.constexpr, BLOCK_L: tl.constexpr, RETURN_LSE: tl.constexpr):
    """The final output (one split) or this split's fp32 partial, for rows ``heads [M]`` and output columns
    ``dims_l``; the LSE only where ``lse_ok``."""
    if not SPLIT:
        tl.store(out_ptr + seq.to(tl.int64) * stride_o_b + heads[:, None] * stride_o_h + dims_l[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dims_l[None, :] < kv_lora_rank))
        if RETURN_LSE:
            tl.store(lse_ptr + seq * stride_lse_b + heads * stride_lse_h, lse, mask=lse_ok)
    else:
        part = (seq.to(tl.int64) * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * BLOCK_L + dims_l[None, :], out, mask=row_ok[:, None])
        tl.store(part_lse_ptr + part, lse, mask=lse_ok)


@triton.jit
def load_latent_tile(kv_cache_ptr, lat_desc, pe_desc, block_row_ptr, start, pos, valid, mine, other, dims_r,
               mine_ok, other_ok, pe_ok, part, stride_c_block, stride_c_slot, kv_lora_rank, block_size,
               BLOCK_V: tl.constexpr, V_PARTS: tl.constexpr, USE_TMA: tl.constexpr):
    """One tile of cache rows at positions ``pos [N]``: ``(c_mine [N, V], c_other [N, V], c_pe [N, R])``
    (``c_other`` is ``c_mine`` when ``V_PARTS == 1``). Pointer loads zero the rows past ``valid``; with
    ``USE_TMA`` (whole tiles only) the tile is one page's rows, read through the descriptors."""
    if USE_TMA:
        block = tl.load(block_row_ptr + start // block_size)
        row = block * block_size + start % block_size
        c_mine = lat_desc.load([row, part * BLOCK_V])
        c_pe = pe_desc.load([row, kv_lora_rank])
        c_other = c_mine
        if V_PARTS == 2:
            c_other = lat_desc.load([row, (1 - part) * BLOCK_V])
    else:
        blocks = tl.load(block_row_ptr + pos // block_size, mask=valid, other=0).to(tl.int64)
        rows = kv_cache_ptr + blocks * stride_c_block + (pos % block_size) * stride_c_slot
        c_mine = tl.load(rows[:, None] + mine[None, :], mask=valid[:, None] & mine_ok[None, :], other=0.0)
        c_pe = tl.load(rows[:, None] + kv_lora_rank + dims_r[None, :], mask=valid[:, None] & pe_ok[None, :],
                       other=0.0)
        c_other = c_mine
        if V_PARTS == 2:
            c_other = tl.load(rows[:, None] + other[None, :], mask=valid[:, None] & other_ok[None, :],
                              other=0.0)
    return c_mine, c_other, c_pe


@triton.jit
def _prefetch_tile_l2(kv_cache_ptr, block_row_ptr, start, hi, block_size, stride_c_slot,
                      BLOCK_N: tl.constexpr, ROW_LINES: tl.constexpr, LINES_P2: tl.constexpr,
                      LINE_ELEMS: tl.constexpr):
    """Ask L2 for the tile of rows ``[start, start + BLOCK_N)`` (one page's rows, ``ROW_LINES`` whole
    128-byte lines each) when ``start < hi``."""
    if start < hi:
        block = tl.load(block_row_ptr + start // block_size).to(tl.int64)
        first = kv_cache_ptr + (block * block_size + start % block_size) * stride_c_slot
        rows = tl.arange(0, BLOCK_N).to(tl.int64)
        lines = tl.minimum(tl.arange(0, LINES_P2), ROW_LINES - 1)
        prefetch_l2(first + rows[:, None] * stride_c_slot + lines[None, :] * LINE_ELEMS)


@triton.jit
def _tile_loop(m_i, l_i, acc, q_mine, q_other, q_pe, kv_cache_ptr, lat_desc, pe_desc, block_row_ptr,
               lo, hi, qk_scale, mine, other, dims_r, mine_ok, other_ok, pe_ok, part,
               stride_c_block, stride_c_slot, kv_lora_rank, block_size,
               BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, V_PARTS: tl.constexpr, MASK: tl.constexpr,
               USE_TMA: tl.constexpr, SWAP_AB: tl.constexpr, Q_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
               EMULATE_RNE: tl.constexpr,
               PREFETCH: tl.constexpr = 0, ROW_LINES: tl.constexpr = 1):
    """Cache rows ``[lo, hi)`` in ``BLOCK_N``-row tiles (``MASK``: the last may run past ``hi``; only
    pointer loads, ``USE_TMA`` False, may be masked).
    ``SWAP_AB``: the products run transposed, cache rows as the tile's M dimension (``s^T = c · q^T``,
    ``acc^T [V, H] += c^T · p^T``), so a few heads still fill Hopper's 64-row warpgroup MMA; the softmax
    then runs down the columns. ``PREFETCH`` (> 0, with ``USE_TMA``): each step first asks L2 for the tile
    that many steps ahead."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        if PREFETCH > 0:
            _prefetch_tile_l2(kv_cache_ptr, block_row_ptr, start + PREFETCH * BLOCK_N, hi, block_size,
                              stride_c_slot, BLOCK_N, ROW_LINES, triton.next_power_of_2(ROW_LINES),
                              128 // (kv_cache_ptr.dtype.element_ty.primitive_bitwidth // 8))
        pos = start + offs_n
        valid = pos < hi
        c_mine, c_other, c_pe = load_latent_tile(kv_cache_ptr, lat_desc, pe_desc, block_row_ptr, start, pos, valid,
                                           mine, other, dims_r, mine_ok, other_ok, pe_ok, part, stride_c_block,
                                           stride_c_slot, kv_lora_rank, block_size, BLOCK_V, V_PARTS, USE_TMA)
        c_mine = c_mine.to(q_mine.dtype)
        c_other = c_other.to(q_mine.dtype)
        c_pe = c_pe.to(q_mine.dtype)
        if SWAP_AB:
            st = tl.dot(c_mine, tl.trans(q_mine))
            if V_PARTS == 2:
                st = st + tl.dot(c_other, tl.trans(q_other))
            st = tl.dot(c_pe, tl.trans(q_pe), st)
            if MASK:
                st = tl.where(valid[:, None], st * qk_scale, float("-inf"))
            else:
                st = st * qk_scale
            m_new = tl.maximum(m_i, tl.max(st, 0))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(st - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, 0)
            if Q_FP8 and EMULATE_RNE:
                p = round_to_fp8_grid(p, FP8_MAX)
            acc = tl.dot(tl.trans(c_mine), p.to(c_mine.dtype), acc * alpha[None, :])
            m_i = m_new
        else:
            qk = tl.dot(q_mine, tl.trans(c_mine))
            if V_PARTS == 2:
                qk = qk + tl.dot(q_other, tl.trans(c_other))
            qk = tl.dot(q_pe, tl.trans(c_pe), qk)
            if MASK:
                s = tl.where(valid[None, :], qk * qk_scale, float("-inf"))
            else:
                s = qk * qk_scale
            m_i, l_i, acc = _softmax_step(s, c_mine, m_i, l_i, acc, Q_FP8, FP8_MAX, EMULATE_RNE)
    return m_i, l_i, acc


@triton.jit(**STEP_INVARIANT)
def mla_decode_kernel(
    q_ptr, kv_cache_ptr, lat_desc, pe_desc, block_table_ptr, seq_lens_ptr,
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, q_scale_ptr, kv_scale_ptr,
    sm_scale,
    stride_q_b, stride_q_h, stride_bt, stride_c_block, stride_c_slot,
    stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
    num_heads, kv_lora_rank, rope_dim, block_size,
    num_splits, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, V_PARTS: tl.constexpr, USE_TMA: tl.constexpr,
    SWAP_AB: tl.constexpr, PREFETCH: tl.constexpr, ROW_LINES: tl.constexpr,
    KV_FP8: tl.constexpr, Q_FP8: tl.constexpr, FP8_MAX: tl.constexpr, EMULATE_RNE: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    """Program ``(b, head block · V_PARTS + part, split)``: ``BLOCK_H`` heads of request ``b`` against the
    split's cache rows, written to ``out [B, H, L]`` (one split) or to the fp32 partials; see the module
    docstring for the math and the ``USE_TMA`` / ``SWAP_AB`` / ``V_PARTS`` tile layouts."""
    seq = tl.program_id(0)
    head_block = tl.program_id(1) // V_PARTS
    part = tl.program_id(1) % V_PARTS
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo, hi = split_range(seq_len, split, num_splits, BLOCK_N)

    # The latent splits into V_PARTS column parts: this program's output columns ("mine") and, with two
    # parts, the other half, which enters only the scores. The two programs of a head block sum the
    # score products in a different order (equal up to fp32 rounding); part 0 alone writes the LSE.
    BLOCK_V: tl.constexpr = BLOCK_L // V_PARTS
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = heads < num_heads
    mine = part * BLOCK_V + tl.arange(0, BLOCK_V)
    other = (1 - part) * BLOCK_V + tl.arange(0, BLOCK_V)
    dims_r = tl.arange(0, BLOCK_R)
    mine_ok = mine < kv_lora_rank
    other_ok = other < kv_lora_rank
    pe_ok = dims_r < rope_dim
    q_rows = q_ptr + seq.to(tl.int64) * stride_q_b + heads[:, None] * stride_q_h
    q_mine = tl.load(q_rows + mine[None, :], mask=row_ok[:, None] & mine_ok[None, :], other=0.0)
    q_other = q_mine
    if V_PARTS == 2:
        q_other = tl.load(q_rows + other[None, :], mask=row_ok[:, None] & other_ok[None, :], other=0.0)
    q_pe = tl.load(q_rows + kv_lora_rank + dims_r[None, :], mask=row_ok[:, None] & pe_ok[None, :], other=0.0)
    qk_scale, v_scale = latent_score_scale(sm_scale, q_scale_ptr, kv_scale_ptr, KV_FP8, Q_FP8)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_V, BLOCK_H], tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    block_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt
    if USE_TMA:
        # Whole tiles through the descriptors, unmasked; then the ragged end (rows past the request in its
        # last page may hold anything, NaN included) in small pointer-loaded tiles that zero those rows (32 rows
        # for an fp8 query: NVIDIA's fp8 products reduce over at least 32 values).
        TAIL_N: tl.constexpr = 32 if Q_FP8 else 16
        full_hi = lo + (hi - lo) // BLOCK_N * BLOCK_N
        m_i, l_i, acc = _tile_loop(m_i, l_i, acc, q_mine, q_other, q_pe, kv_cache_ptr, lat_desc, pe_desc,
                                   block_row_ptr, lo, full_hi, qk_scale, mine, other, dims_r, mine_ok,
                                   other_ok, pe_ok, part, stride_c_block, stride_c_slot, kv_lora_rank,
                                   block_size, BLOCK_N, BLOCK_V, V_PARTS, False, True, SWAP_AB, Q_FP8, FP8_MAX,
                                   EMULATE_RNE, PREFETCH, ROW_LINES)
        if SWAP_AB:
            acc = tl.trans(acc)
        m_i, l_i, acc = _tile_loop(m_i, l_i, acc, q_mine, q_other, q_pe, kv_cache_ptr, lat_desc, pe_desc,
                                   block_row_ptr, full_hi, hi, qk_scale, mine, other, dims_r, mine_ok,
                                   other_ok, pe_ok, part, stride_c_block, stride_c_slot, kv_lora_rank,
                                   block_size, TAIL_N, BLOCK_V, V_PARTS, True, False, False, Q_FP8, FP8_MAX,
                                   EMULATE_RNE)
    else:
        m_i, l_i, acc = _tile_loop(m_i, l_i, acc, q_mine, q_other, q_pe, kv_cache_ptr, lat_desc, pe_desc,
                                   block_row_ptr, lo, hi, qk_scale, mine, other, dims_r, mine_ok,
                                   other_ok, pe_ok, part, stride_c_block, stride_c_slot, kv_lora_rank,
                                   block_size, BLOCK_N, BLOCK_V, V_PARTS, True, False, SWAP_AB, Q_FP8, FP8_MAX,
                                   EMULATE_RNE)
        if SWAP_AB:
            acc = tl.trans(acc)

    out, lse = finalize(m_i, l_i, acc, v_scale)
    _store_result(out, lse, seq, heads, split, row_ok, row_ok & (part == 0), mine, kv_lora_rank,
                  out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, stride_o_b, stride_o_h, stride_lse_b,
                  stride_lse_h, num_heads, num_splits, SPLIT, BLOCK_L, RETURN_LSE)
