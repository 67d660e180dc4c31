"""Split-KV paged decode (flash-decoding) with the query heads of one KV head packed into one tile.

Program ``(kv_head, b, split)`` takes the ``G = Hq / Hkv`` query heads that read ``kv_head`` as the rows
of one ``[BLOCK_G, D]`` tile, and walks its share of request ``b``'s context in tiles of ``BLOCK_N``
tokens gathered through the block table, so each cache row is read once for all its query heads. With one
split the program writes the output; otherwise it writes an fp32 partial ``(o_s, lse_s)`` and
:func:`reduce_splits_kernel` merges ``o = Σ_s e^{lse_s - lse} o_s`` (sinks counted once, there).

The launch's ``num_splits`` is an upper bound chosen on the host from the batch and the block table's
width (which, in a CUDA graph, is the longest context the engine serves). Each request decides on the
device how many of them it uses, from its own number of tiles ``T``:
``used = min(num_splits, max(fill_splits, T // min_split_tiles))`` — enough splits to keep the GPU busy
(``fill_splits``, from the batch), and no split shorter than ``min_split_tiles`` tiles beyond that. The
programs past ``used`` return at once; with ``used == 1`` split 0 writes the output itself and the merge
skips the request (``splits_used[b]`` tells it).

The KV head is the grid's fastest axis, so the programs running together are a request's heads: with the
NHD cache one token's row holds every KV head, and neighbouring programs read whole rows (1.6 % faster
than request-first at 256 requests × 1024 tokens, 32/8/128, block 16, on an H100).
"""

import triton
import triton.language as tl

from tripath.kernels.attention_common import LOG2E, add_sinks, attend_paged_tiles, finalize
from tripath.triton_internals.specialize import STEP_INVARIANT


@triton.jit(**STEP_INVARIANT)
def paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr,
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    alibi_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr,
    sm_scale, softcap, window_left,
    stride_q_b, stride_q_h, stride_bt,
    stride_k0, stride_k1, stride_k2, stride_k3,
    stride_v0, stride_v1, stride_v2, stride_v3,
    stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
    num_heads, num_queries_per_kv, head_size, head_size_v, block_size,
    num_splits, fill_splits, min_split_tiles, splits_used_ptr,
    SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    SHUFFLED: tl.constexpr, X: tl.constexpr, KV_FP8: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr, RETURN_LSE: tl.constexpr,
):
    """Program ``(kv_head, b, split)``: the GQA group of ``kv_head`` (one ``[BLOCK_G, D]`` query tile) against
    the split's share of request ``b``'s paged context (of the ``used`` splits the request takes, see the
    module doc); ``out`` where the request uses one split, else fp32 partials for :func:`reduce_splits_kernel`
    and, from split 0, ``splits_used[b]``."""
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_pos_scalar = seq_len - 1

    # This split's share of the context, in whole tiles; a window drops tiles before its start.
    first = 0
    if HAS_WINDOW:
        first = (tl.maximum(q_pos_scalar - window_left, 0) // BLOCK_N) * BLOCK_N
    num_tiles = tl.cdiv(seq_len - first, BLOCK_N)
    used = 1
    if SPLIT:
        used = tl.maximum(tl.minimum(num_splits, tl.maximum(fill_splits, num_tiles // min_split_tiles)), 1)
        if split == 0:
            tl.store(splits_used_ptr + seq, used)
        if split >= used:
            return
    tiles_per_split = tl.cdiv(num_tiles, used)
    lo = first + split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, seq_len)

    g = tl.arange(0, BLOCK_G)
    heads = kv_head * num_queries_per_kv + g
    row_ok = g < num_queries_per_kv
    dims_k = tl.arange(0, BLOCK_DK)
    dims_v = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_q_b + heads[:, None] * stride_q_h + dims_k[None, :],
                mask=row_ok[:, None] & (dims_k[None, :] < head_size), other=0.0)
    qk_scale = sm_scale * LOG2E
    v_scale = 1.0
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    q_pos = tl.full([BLOCK_G], 0, tl.int32) + q_pos_scalar
    if HAS_ALIBI:
        slope2 = tl.load(alibi_ptr + heads, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
    else:
        slope2 = tl.zeros([BLOCK_G], tl.float32)

    m_i, l_i, acc = attend_paged_tiles(q, q_pos, slope2, qk_scale, softcap, window_left, lo, hi, seq_len,
                                       k_cache_ptr, v_cache_ptr, block_table_ptr, seq, stride_bt, kv_head,
                                       dims_k, dims_v, head_size, head_size_v, block_size,
                                       stride_k0, stride_k1, stride_k2, stride_k3,
                                       stride_v0, stride_v1, stride_v2, stride_v3,
                                       BLOCK_G, BLOCK_N, BLOCK_DV, False, SHUFFLED, X,
                                       HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, q_pos, 0, False)

    if used == 1:  # the whole context in this program (always without SPLIT)
        if HAS_SINKS:
            sink2 = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
            m_i, l_i, acc = add_sinks(m_i, l_i, acc, sink2)
        out, lse = finalize(m_i, l_i, acc, v_scale)
        tl.store(out_ptr + seq.to(tl.int64) * stride_o_b + heads[:, None] * stride_o_h + dims_v[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dims_v[None, :] < head_size_v))
        if RETURN_LSE:
            tl.store(lse_ptr + seq * stride_lse_b + heads * stride_lse_h, lse, mask=row_ok)
    else:
        out, lse = finalize(m_i, l_i, acc, v_scale)
        # Partials: [B, Hq, num_splits, BLOCK_DV] and [B, Hq, num_splits], contiguous.
        part = (seq.to(tl.int64) * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * BLOCK_DV + dims_v[None, :], out, mask=row_ok[:, None])
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit(**STEP_INVARIANT)
def reduce_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, sinks_ptr, splits_used_ptr,
    stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
    num_heads, head_size_v,
    num_splits, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_SINKS: tl.constexpr, RETURN_LSE: tl.constexpr, SPLITS_USED: tl.constexpr,
):
    """Merge the split partials of one (request, head): ``o = Σ e^{lse_s - lse} o_s``. With ``SPLITS_USED``
    the first ``splits_used[b]`` partials of request ``b`` (none where it is 1: its output is written)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    used = num_splits
    if SPLITS_USED:
        used = tl.load(splits_used_ptr + seq)
        if used == 1:
            return
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_DV)
    base = (seq.to(tl.int64) * num_heads + head) * num_splits
    lse_s = tl.load(part_lse_ptr + base + splits, mask=splits < used, other=float("-inf"))
    m = tl.max(lse_s, 0)
    if HAS_SINKS:
        m = tl.maximum(m, tl.load(sinks_ptr + head).to(tl.float32))
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_use)
    denom = tl.sum(w, 0)
    if HAS_SINKS:
        denom += tl.exp(tl.load(sinks_ptr + head).to(tl.float32) - m_use)
    o_s = tl.load(part_out_ptr + (base + splits)[:, None] * BLOCK_DV + dims[None, :],
                  mask=(splits[:, None] < used) & (dims[None, :] < head_size_v), other=0.0)
    safe = tl.where(denom > 0.0, denom, 1.0)
    out = tl.sum(o_s * (w / safe)[:, None], 0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_o_b + head * stride_o_h + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < head_size_v)
    if RETURN_LSE:
        lse = tl.where(denom > 0.0, tl.log(safe) + m_use, float("-inf"))
        tl.store(lse_ptr + seq * stride_lse_b + head * stride_lse_h, lse)
