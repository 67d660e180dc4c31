"""The LM head fused with the token draw: logits tile by tile over the vocabulary, reduced in the epilogue.

For ``M`` rows (hidden ``h [M, K]``, the LM head's rows ``W [V, K]``; each row ``m`` with temperature ``t_m``
(0: greedy), seed ``s_m`` and position ``p_m``) and every token ``v``::

    z[m, v]   = dtype(Σ_k h[m, k] · W[v, k])        fp32 accumulation, rounded to the LM head's dtype
    key[m, v] = z[m, v] + t_m · G(s_m, p_m, v)        Gumbel noise; t_m = 0: key = z
    token_m   = argmax_v key[m, v]                    the lowest id among equal keys (as torch.argmax)
    lse_m     = log Σ_v exp(z[m, v])                  so the token's log-probability is z[m, token_m] − lse_m

``argmax_v (z / t + G)`` with ``G`` i.i.d. standard Gumbel is a draw from ``softmax(z / t)`` (the Gumbel-max
trick); ``z + t · G`` has the same argmax and never overflows (``t <= 1e30``, ``|G| < 23``). The noise is
counter-based: ``x = Philox-4x32-10(key = s_m, counter = (v, p_m, 0, 0))`` (its first word), ``w = x · 2⁻³² +
2⁻³³`` clamped below 1, ``E = −log(1 − w)`` (a series for small ``w``, so the smallest ``E`` keep their
precision) and ``G = −log E``: a token's noise depends only on (seed, position, token id), not on the batch,
the tile or the rank holding it.

Kernels (partials are ``[4, M, T]`` float32 planes ``(best key, z at it, tile max of z, Σ exp(z − tile max))``
and ``[M, T]`` int32 global token ids of the best key, ``T`` tiles of ``BLOCK_V`` tokens):

- :func:`lm_head_sample_kernel`: program ``(m-block, tile)`` computes ``z`` for ``BLOCK_M`` rows × ``BLOCK_V``
  tokens as ``W_tile · h_blockᵀ`` (the vocabulary on the matrix unit's long side: M may be 1) and writes the
  tile's partials. The m-blocks of a tile are neighbours in the grid, so a weight tile is read from memory
  once and from L2 by the others.
- :func:`logits_sample_kernel`: the same partials from logits already written (``[M, V]``, any float
  dtype): program ``(row, tile)``; the sampler's draw for rows that need their full logits anyway.
- :func:`sample_partials_reduce_kernel`: program ``m`` reduces row ``m``'s ``T`` partials to the token (the
  lowest id among the best keys), its key and logit, and the row's LSE.
"""

import triton
import triton.language as tl
from tripath.triton_internals.specialize import STEP_INVARIANT


@triton.jit
def gumbel_noise(seed, position, token):
    """Standard Gumbel noise of ``token`` (int32 ``[BV, 1]``) for rows of ``seed`` (int64 ``[1, BM]``) at
    ``position`` (int64 ``[1, BM]``): ``[BV, BM]`` float32, finite (in about [−2.8, 22.9])."""
    zero = (token * 0).to(tl.uint32) + (position * 0).to(tl.uint32)
    c0 = token.to(tl.uint32) + zero
    c1 = position.to(tl.uint32) + zero
    x, _, _, _ = tl.philox(seed, c0, c1, zero, zero)
    w = x.to(tl.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10
    w = tl.minimum(w, 0.99999994)
    e = tl.where(w < 0.015625, w * (1.0 + w * (0.5 + w * 0.3333333432674408)), -tl.log(1.0 - w))
    return -tl.log(e)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """``x`` (float32) rounded to ``dtype`` (to nearest, ties to even), as float32. For float16 the rounding
    is done on the bits (10 mantissa bits kept; a fixed 2⁻²⁴ step below 2⁻¹⁴; ±inf from 65520 on): a
    conversion of the accumulator to float16 makes ptxas serialise the loop's wgmma on sm_90."""
    if dtype == tl.float16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0xFFF + ((bits >> 13) & 1)) & 0xFFFFE000
        y = bits.to(tl.float32, bitcast=True)
        y = tl.where(tl.abs(x) < 6.103515625e-05, (x + 0.75) - 0.75, y)
        return tl.where(tl.abs(y) > 65504.0, tl.where(x > 0, float("inf"), float("-inf")), y)
    elif dtype == tl.float32:
        return x
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _store_tile_partials(z, valid, vocab, rows, row_mask, tile, num_rows, num_tiles, temperature_ptr, seeds_ptr,
                         positions_ptr, partials_ptr, part_ids_ptr, BLOCK_V: tl.constexpr, SAMPLE: tl.constexpr):
    """Reduce ``z [BV, BM]`` (float32; ``valid [BV]`` tokens ``vocab [BV]``, global ids) over the tokens and
    store each row's partials of ``tile``."""
    z = tl.where(valid[:, None], z, float("-inf"))
    tile_max = tl.max(z, axis=0)
    safe_max = tl.where(tile_max == float("-inf"), 0.0, tile_max)
    tile_sum = tl.sum(tl.exp(z - safe_max[None, :]), axis=0)
    if SAMPLE:
        t = tl.load(temperature_ptr + rows, mask=row_mask, other=0.0)
        seed = tl.load(seeds_ptr + rows, mask=row_mask, other=0)
        position = tl.load(positions_ptr + rows, mask=row_mask, other=0)
        noise = gumbel_noise(seed[None, :], position[None, :], vocab[:, None])
        key = tl.where(valid[:, None], z + t[None, :] * noise, float("-inf"))
    else:
        key = z
    best = tl.argmax(key, axis=0, tie_break_left=True)
    best_key = tl.max(key, axis=0)
    hit = tl.arange(0, BLOCK_V)[:, None] == best[None, :]
    best_id = tl.max(tl.where(hit, vocab[:, None], -1), axis=0)
    best_z = tl.sum(tl.where(hit, z, 0.0), axis=0)
    at = rows.to(tl.int64) * num_tiles + tile
    plane = num_rows * num_tiles   # int32: M · T is far below 2³¹
    tl.store(partials_ptr + at, best_key, mask=row_mask)
    tl.store(partials_ptr + plane + at, best_z, mask=row_mask)
    tl.store(partials_ptr + 2 * plane + at, tile_max, mask=row_mask)
    tl.store(partials_ptr + 3 * plane + at, tile_sum, mask=row_mask)
    tl.store(part_ids_ptr + at, best_id, mask=row_mask)


@triton.jit(**STEP_INVARIANT)
def lm_head_sample_kernel(
    hidden_ptr, weight_ptr, temperature_ptr, seeds_ptr, positions_ptr, partials_ptr, part_ids_ptr,
    num_rows, vocab_valid, vocab_offset, hidden_size, num_tiles, stride_h, stride_w,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    SAMPLE: tl.constexpr, IEEE_DOT: tl.constexpr,
):
    """Program ``(b, j)``: rows ``[b · BLOCK_M, (b + 1) · BLOCK_M)`` × tokens ``[j · BLOCK_V, (j + 1) · BLOCK_V)``
    of the ``vocab_valid`` rows of ``W`` (global ids from ``vocab_offset``)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    tile = tl.program_id(1)
    row_mask = rows < num_rows
    local = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = local < vocab_valid
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = weight_ptr + local.to(tl.int64)[:, None] * stride_w + ks[None, :]
    h_ptrs = hidden_ptr + rows.to(tl.int64)[:, None] * stride_h + ks[None, :]
    acc = tl.zeros([BLOCK_V, BLOCK_M], dtype=tl.float32)
    for k in range(0, hidden_size, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=valid[:, None], other=0.0)
            h = tl.load(h_ptrs, mask=row_mask[:, None], other=0.0)
        else:
            in_k = (k + ks) < hidden_size
            w = tl.load(w_ptrs, mask=valid[:, None] & in_k[None, :], other=0.0)
            h = tl.load(h_ptrs, mask=row_mask[:, None] & in_k[None, :], other=0.0)
        if IEEE_DOT:
            acc = tl.dot(w, tl.trans(h), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(h), acc)
        w_ptrs += BLOCK_K
        h_ptrs += BLOCK_K
    z = round_to(acc, weight_ptr.dtype.element_ty)
    _store_tile_partials(z, valid, vocab_offset + local, rows, row_mask, tile, num_rows, num_tiles, temperature_ptr,
                         seeds_ptr, positions_ptr, partials_ptr, part_ids_ptr, BLOCK_V, SAMPLE)


@triton.jit(**STEP_INVARIANT)
def logits_sample_kernel(
    logits_ptr, temperature_ptr, seeds_ptr, positions_ptr, partials_ptr, part_ids_ptr,
    num_rows, vocab_valid, vocab_offset, num_tiles, stride_l,
    BLOCK_V: tl.constexpr, SAMPLE: tl.constexpr,
):
    """Program ``(m, j)``: row ``m``'s logits ``[j · BLOCK_V, (j + 1) · BLOCK_V)``."""
    rows = tl.program_id(0) + tl.arange(0, 1)
    tile = tl.program_id(1)
    row_mask = rows < num_rows
    local = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = local < vocab_valid
    z = tl.load(logits_ptr + rows.to(tl.int64)[None, :] * stride_l + local[:, None], mask=valid[:, None],
                other=0.0).to(tl.float32)
    _store_tile_partials(z, valid, vocab_offset + local, rows, row_mask, tile, num_rows, num_tiles, temperature_ptr,
                         seeds_ptr, positions_ptr, partials_ptr, part_ids_ptr, BLOCK_V, SAMPLE)


@triton.jit(**STEP_INVARIANT)
def sample_partials_reduce_kernel(
    partials_ptr, part_ids_ptr, tokens_ptr, stats_ptr, num_rows, num_tiles,
    BLOCK_T: tl.constexpr,
):
    """Program ``m``: row ``m``'s ``num_tiles`` partials → ``tokens[m]`` (int64) and ``stats[:, m]`` = (its key,
    its logit, the row's LSE)."""
    row = tl.program_id(0).to(tl.int64)
    plane = num_rows * num_tiles   # int32: M · T is far below 2³¹
    lanes = tl.arange(0, BLOCK_T)
    best_key = tl.full([BLOCK_T], float("-inf"), tl.float32)
    best_id = tl.full([BLOCK_T], 2147483647, tl.int32)
    best_z = tl.zeros([BLOCK_T], tl.float32)
    run_max = tl.full([BLOCK_T], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_T], tl.float32)
    for start in range(0, num_tiles, BLOCK_T):
        at = start + lanes
        ok = at < num_tiles
        base = partials_ptr + row * num_tiles + at
        key = tl.load(base, mask=ok, other=float("-inf"))
        z = tl.load(base + plane, mask=ok, other=0.0)
        tile_max = tl.load(base + 2 * plane, mask=ok, other=float("-inf"))
        tile_sum = tl.load(base + 3 * plane, mask=ok, other=0.0)
        ids = tl.load(part_ids_ptr + row * num_tiles + at, mask=ok, other=2147483647)
        better = key > best_key   # a lane's earlier tiles hold lower ids: ties keep them
        best_key = tl.where(better, key, best_key)
        best_id = tl.where(better, ids, best_id)
        best_z = tl.where(better, z, best_z)
        new_max = tl.maximum(run_max, tile_max)
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - safe) + tile_sum * tl.exp(tile_max - safe)
        run_max = new_max
    top = tl.max(best_key, axis=0)
    token = tl.min(tl.where(best_key == top, best_id, 2147483647), axis=0)
    chosen = tl.sum(tl.where((best_key == top) & (best_id == token), best_z, 0.0), axis=0)
    row_max = tl.max(run_max, axis=0)
    safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    total = tl.sum(run_sum * tl.exp(run_max - safe_max), axis=0)
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(stats_ptr + row, top)
    tl.store(stats_ptr + num_rows + row, chosen)
    tl.store(stats_ptr + 2 * num_rows + row, safe_max + tl.log(total))
