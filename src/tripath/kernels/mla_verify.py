"""Absorbed MLA attention for a few new tokens per request (speculative decoding's verify steps): every query
token and every query head of a request packed into one tile, so each latent cache row is read once for all of
them.

Request ``b`` brings ``n_b`` new tokens (``cu_seqlens_q``), already in the cache, at positions
``seq_len - n_b .. seq_len - 1``. Query ``q [T, H, L + R]`` = ``[q_lat | q_pe]``, cache rows
``c = [c_lat | c_pe]`` (see :mod:`tripath.kernels.mla_decode`): token ``t`` of the request attends causally to
the rows up to its own position, or, for a draft tree (``TREE``), to the context and the new tokens whose bits
its ``tree_mask`` entry sets (itself and its ancestors):

    s[t, h, j] = sm_scale · (q_lat[t, h]·c_lat[j] + q_pe[t, h]·c_pe[j]),   o[t, h] = Σ_j softmax_j(s) · c_lat[j]

Program ``(b, row block, split)`` takes rows ``r = t · H + h`` (``BLOCK_M`` of them) as one tile and walks its
split of the request's rows (:func:`~tripath.kernels.mla_decode.split_range`) in ``BLOCK_N``-row tiles through
two ``tl.dot`` (latent and rotary parts). A row whose split holds nothing it may see gets an empty partial
(LSE −inf). With several splits the fp32 partials ``[T, H, S, BLOCK_L]`` go to
:func:`tripath.kernels.paged_decode.reduce_splits_kernel`, per token and head (``splits_used`` per token: rows
of no request keep the caller's 1 and are left alone). fp8: as the decode kernel.
"""

import triton
import triton.language as tl

from tripath.kernels.attention_common import finalize
from tripath.kernels.mla_decode import load_latent_tile, latent_score_scale, split_range
from tripath.kernels.quant import round_to_fp8_grid
from tripath.triton_internals.specialize import STEP_INVARIANT


@triton.jit(**STEP_INVARIANT)
def mla_verify_kernel(
    q_ptr, kv_cache_ptr, block_table_ptr, seq_lens_ptr, cu_seqlens_q_ptr, tree_mask_ptr,
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, q_scale_ptr, kv_scale_ptr,
    sm_scale,
    stride_q_t, stride_q_h, stride_bt, stride_c_block, stride_c_slot,
    stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
    num_heads, kv_lora_rank, rope_dim, block_size,
    num_splits, splits_used_ptr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, TREE: tl.constexpr,
    KV_FP8: tl.constexpr, Q_FP8: tl.constexpr, FP8_MAX: tl.constexpr, EMULATE_RNE: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    """Program ``(b, row block, split)``: rows ``r = t · H + h`` of request ``b`` against the split's cache rows,
    written to ``out [T, H, L]`` (one split) or to the fp32 partials and, from split 0, ``splits_used[t] =
    num_splits`` for each of its tokens; see the module doc."""
    seq = tl.program_id(0)
    row_block = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if row_block * BLOCK_M >= q_len * num_heads:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len   # the position of the request's first new token
    lo, hi = split_range(seq_len, split, num_splits, BLOCK_N)

    r = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    t = r // num_heads
    heads = r % num_heads
    row_ok = t < q_len
    token = (q_start + t).to(tl.int64)
    last_pos = first_pos + t   # the last row each token may see
    tree_bits = t
    if TREE:   # a draft tree: the context, itself and its ancestors (bits of tree_mask)
        tree_bits = tl.load(tree_mask_ptr + token, mask=row_ok, other=0)

    dims_l = tl.arange(0, BLOCK_L)
    dims_r = tl.arange(0, BLOCK_R)
    lat_ok = dims_l < kv_lora_rank
    pe_ok = dims_r < rope_dim
    q_rows = q_ptr + token[:, None] * stride_q_t + heads[:, None] * stride_q_h
    q_lat = tl.load(q_rows + dims_l[None, :], mask=row_ok[:, None] & lat_ok[None, :], other=0.0)
    q_pe = tl.load(q_rows + kv_lora_rank + dims_r[None, :], mask=row_ok[:, None] & pe_ok[None, :], other=0.0)
    qk_scale, v_scale = latent_score_scale(sm_scale, q_scale_ptr, kv_scale_ptr, KV_FP8, Q_FP8)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)
    block_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        valid = pos < hi
        c_lat, _, c_pe = load_latent_tile(kv_cache_ptr, kv_cache_ptr, kv_cache_ptr, block_row_ptr, start, pos, valid,
                                    dims_l, dims_l, dims_r, lat_ok, lat_ok, pe_ok, 0, stride_c_block,
                                    stride_c_slot, kv_lora_rank, block_size, BLOCK_L, 1, False)
        c_lat = c_lat.to(q_lat.dtype)
        c_pe = c_pe.to(q_lat.dtype)
        qk = tl.dot(q_pe, tl.trans(c_pe), tl.dot(q_lat, tl.trans(c_lat)))
        visible = valid[None, :] & (pos[None, :] <= last_pos[:, None])
        if TREE:
            new = tl.maximum(pos - first_pos, 0)
            visible = visible & ((pos[None, :] < first_pos) | (((tree_bits[:, None] >> new[None, :]) & 1) == 1))
        s = tl.where(visible, qk * qk_scale, float("-inf"))
        # a row may see nothing in a tile (its causal end before it, or a masked padding row): no NaN then
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if Q_FP8 and EMULATE_RNE:   # p is in [0, 1]: no saturation needed
            p = round_to_fp8_grid(p, FP8_MAX)
        acc = tl.dot(p.to(c_lat.dtype), c_lat, acc * alpha[:, None])
        m_i = m_new

    out, lse = finalize(m_i, l_i, acc, v_scale)
    if not SPLIT:
        tl.store(out_ptr + token[:, None] * stride_o_t + heads[:, None] * stride_o_h + dims_l[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & lat_ok[None, :])
        if RETURN_LSE:
            tl.store(lse_ptr + token * stride_lse_t + heads * stride_lse_h, lse, mask=row_ok)
    else:
        if split == 0:
            tl.store(splits_used_ptr + token, tl.full([BLOCK_M], 0, tl.int32) + num_splits,
                     mask=row_ok & (heads == 0))
        part = (token * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * BLOCK_L + dims_l[None, :], out, mask=row_ok[:, None])
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
