"""Split-KV paged attention for a few new tokens per request (speculative decoding's verify steps): every
query token of a request and every query head of one KV head packed into one tile.

Request ``b`` brings ``n_b`` new tokens (``cu_seqlens_q``), already in the cache, at positions
``seq_len - n_b .. seq_len - 1``; token ``t`` attends causally to the keys up to its own position, or, for
a draft tree (``TREE``), to the context and the new tokens whose bits its ``tree_mask`` entry sets (itself
and its ancestors: EAGLE-style tree verification). Program
``(b, q_block, kv_head, split)`` (the first two flattened in grid axis 0) takes the rows
``r = t · G + g`` of tokens ``t`` in its ``q_block`` (``BLOCK_M // G`` tokens) and heads ``g < G = Hq / Hkv``
of ``kv_head`` as one ``[BLOCK_M, D]`` tile and walks its split of the context in tiles of ``BLOCK_N``
tokens gathered through the block table: each cache row is read once for all of the request's tokens and
heads, as in paged decode (:mod:`tripath.kernels.paged_decode`), whose split rule this kernel shares (each
request uses ``min(num_splits, max(fill_splits, T // min_split_tiles))`` of the launch's splits) and whose
:func:`~tripath.kernels.paged_decode.reduce_splits_kernel` merges the partials per token and head
(``splits_used`` per token).
"""

import triton
import triton.language as tl

from tripath.kernels.attention_common import LOG2E, add_sinks, attend_paged_tiles, finalize
from tripath.triton_internals.specialize import STEP_INVARIANT


@triton.jit(**STEP_INVARIANT)
def paged_verify_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, cu_seqlens_q_ptr, tree_mask_ptr,
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    alibi_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr,
    sm_scale, softcap, window_left,
    stride_q_t, stride_q_h, stride_bt,
    stride_k0, stride_k1, stride_k2, stride_k3,
    stride_v0, stride_v1, stride_v2, stride_v3,
    stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
    num_heads, num_queries_per_kv, head_size, head_size_v, block_size,
    num_q_blocks, num_splits, fill_splits, min_split_tiles, splits_used_ptr,
    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    SHUFFLED: tl.constexpr, X: tl.constexpr, KV_FP8: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr, RETURN_LSE: tl.constexpr, TREE: tl.constexpr,
):
    """Program ``(b · num_q_blocks + q_block, kv_head, split)``: see the module doc. Writes ``out`` where the
    request uses one split, else fp32 partials ``[T, Hq, num_splits, BLOCK_DV]`` / ``[T, Hq, num_splits]`` and,
    from split 0, ``splits_used[t]`` for each of its tokens."""
    seq = tl.program_id(0) // num_q_blocks
    q_block = tl.program_id(0) % num_q_blocks
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    tokens_per_block = BLOCK_M // num_queries_per_kv
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    first_token = q_block * tokens_per_block
    if first_token >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len   # the position of the request's first new token

    # This split's share of the context, in whole tiles; a window drops tiles before the first token's start.
    first = 0
    if HAS_WINDOW:
        first = (tl.maximum(first_pos + first_token - window_left, 0) // BLOCK_N) * BLOCK_N
    num_tiles = tl.cdiv(seq_len - first, BLOCK_N)
    used = 1
    if SPLIT:
        used = tl.maximum(tl.minimum(num_splits, tl.maximum(fill_splits, num_tiles // min_split_tiles)), 1)
    r = tl.arange(0, BLOCK_M)
    t = first_token + r // num_queries_per_kv
    g = r % num_queries_per_kv
    heads = kv_head * num_queries_per_kv + g
    row_ok = (r < tokens_per_block * num_queries_per_kv) & (t < q_len)
    token = (q_start + t).to(tl.int64)
    if SPLIT:
        if split == 0:
            tl.store(splits_used_ptr + token, tl.full([BLOCK_M], 0, tl.int32) + used, mask=row_ok & (g == 0))
        if split >= used:
            return
    tiles_per_split = tl.cdiv(num_tiles, used)
    lo = first + split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, seq_len)

    dims_k = tl.arange(0, BLOCK_DK)
    dims_v = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + token[:, None] * stride_q_t + heads[:, None] * stride_q_h + dims_k[None, :],
                mask=row_ok[:, None] & (dims_k[None, :] < head_size), other=0.0)
    qk_scale = sm_scale * LOG2E
    v_scale = 1.0
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    q_pos = first_pos + t
    if HAS_ALIBI:
        slope2 = tl.load(alibi_ptr + heads, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
    else:
        slope2 = tl.zeros([BLOCK_M], tl.float32)

    tree_bits = q_pos
    if TREE:   # a draft tree: each token sees the context, itself and its ancestors (bits of tree_mask)
        tree_bits = tl.load(tree_mask_ptr + token, mask=row_ok, other=0)
    m_i, l_i, acc = attend_paged_tiles(q, q_pos, slope2, qk_scale, softcap, window_left, lo, hi, seq_len,
                                       k_cache_ptr, v_cache_ptr, block_table_ptr, seq, stride_bt, kv_head,
                                       dims_k, dims_v, head_size, head_size_v, block_size,
                                       stride_k0, stride_k1, stride_k2, stride_k3,
                                       stride_v0, stride_v1, stride_v2, stride_v3,
                                       BLOCK_M, BLOCK_N, BLOCK_DV, not TREE, SHUFFLED, X,
                                       HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, tree_bits, first_pos, TREE)

    if used == 1:  # the whole context in this program (always without SPLIT)
        if HAS_SINKS:
            sink2 = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
            m_i, l_i, acc = add_sinks(m_i, l_i, acc, sink2)
        out, lse = finalize(m_i, l_i, acc, v_scale)
        tl.store(out_ptr + token[:, None] * stride_o_t + heads[:, None] * stride_o_h + dims_v[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dims_v[None, :] < head_size_v))
        if RETURN_LSE:
            tl.store(lse_ptr + token * stride_lse_t + heads * stride_lse_h, lse, mask=row_ok)
    else:
        out, lse = finalize(m_i, l_i, acc, v_scale)
        part = (token * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * BLOCK_DV + dims_v[None, :], out, mask=row_ok[:, None])
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
