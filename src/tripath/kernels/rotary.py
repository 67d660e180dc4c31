"""Rotary position embedding (RoPE) on the first ``R`` dims of each head, in place.

For a token at position ``p`` and pair ``i`` (``0 <= i < R/2``) with ``c = cos[p, i]``, ``s = sin[p, i]``:
``x1' = x1·c − x2·s``, ``x2' = x2·c + x1·s``, computed in fp32 and rounded to the tensor's dtype.
The pair is ``(i, i + R/2)`` for NeoX style and ``(2i, 2i + 1)`` for GPT-J (interleaved) style — DeepSeek
uses GPT-J on its 64 rotary dims. Positions are clamped into ``[0, max_position)``, so a one-row identity
table (cos 1, sin 0) serves NoPE models for every position.
"""

import triton
import triton.language as tl
from tripath.triton_internals.specialize import STEP_INVARIANT


@triton.jit
def rope_pair_dims(BLOCK_HALF: tl.constexpr, half, IS_NEOX: tl.constexpr):
    """Pair index ``i [BLOCK_HALF]``, the dims ``(d1, d2)`` of each pair, and the mask ``i < half``."""
    pair = tl.arange(0, BLOCK_HALF)
    if IS_NEOX:
        d1 = pair
        d2 = pair + half
    else:
        d1 = 2 * pair
        d2 = 2 * pair + 1
    return pair, d1, d2, pair < half


@triton.jit
def load_cos_sin(positions_ptr, token, max_position, cos_ptr, sin_ptr, stride_cos, stride_sin, pair, pair_ok):
    """fp32 ``cos, sin [BLOCK_HALF]`` of ``token``'s position (clamped into the table)."""
    pos = tl.load(positions_ptr + token).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), max_position - 1)
    cos = tl.load(cos_ptr + pos * stride_cos + pair, mask=pair_ok, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + pair, mask=pair_ok, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def rotate_pairs(x1, x2, cos, sin):
    """The rotation of fp32 pairs ``(x1, x2)``; ``cos``/``sin`` broadcast against them. Written as explicit
    FMAs (``x1·cos − x2·sin`` = ``fma(x1, cos, −x2·sin)``) so every kernel that rotates rounds the same way:
    left to the compiler, the contraction into FMAs varies with the launch configuration, and the fused
    decode preparation must give the unfused path's bits."""
    return tl.fma(x1, cos, -(x2 * sin)), tl.fma(x2, cos, x1 * sin)


@triton.jit
def rotate_interleaved(x, cos, sin):
    """GPT-J pairs ``(2i, 2i + 1)`` of rows ``x [M, 2 · HALF]`` (each row one contiguous run, loaded with
    16-byte vectors) rotated by ``cos``/``sin [HALF]`` in fp32 and rounded back to ``x``'s dtype; the pairs
    are split and rejoined in registers."""
    M: tl.constexpr = x.shape[0]
    HALF: tl.constexpr = x.shape[1] // 2
    x1, x2 = tl.split(tl.reshape(x, (M, HALF, 2)))
    y1, y2 = rotate_pairs(x1.to(tl.float32), x2.to(tl.float32), cos[None, :], sin[None, :])
    return tl.reshape(tl.join(y1.to(x.dtype), y2.to(x.dtype)), (M, 2 * HALF))


@triton.jit
def _rotate_heads_in_place(x_ptr, token, stride_t, stride_h, first_head, num_heads, cos, sin, d1, d2, half,
                           pair_ok, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    heads = first_head + tl.arange(0, BLOCK_H)
    head_ok = heads[:, None] < num_heads
    base = x_ptr + token.to(tl.int64) * stride_t + heads[:, None] * stride_h
    if IS_NEOX:  # the pair's halves are two contiguous runs
        mask = head_ok & pair_ok[None, :]
        x1 = tl.load(base + d1[None, :], mask=mask, other=0.0)
        x2 = tl.load(base + d2[None, :], mask=mask, other=0.0)
        y1, y2 = rotate_pairs(x1.to(tl.float32), x2.to(tl.float32), cos[None, :], sin[None, :])
        tl.store(base + d1[None, :], y1.to(x1.dtype), mask=mask)
        tl.store(base + d2[None, :], y2.to(x2.dtype), mask=mask)
    else:  # interleaved pairs: one contiguous run of R values per head, split into pairs in registers
        dims = tl.arange(0, 2 * BLOCK_HALF)
        mask = head_ok & (dims[None, :] < 2 * half)
        x = tl.load(base + dims[None, :], mask=mask, other=0.0)
        tl.store(base + dims[None, :], rotate_interleaved(x, cos, sin), mask=mask)


@triton.jit(**STEP_INVARIANT)
def rotary_embedding_kernel(
    positions_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_cos, stride_sin,
    num_q_heads, num_k_heads, half, max_position,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, IS_NEOX: tl.constexpr, HAS_K: tl.constexpr,
):
    """Program ``(t, b)`` rotates heads ``[b · BLOCK_H, (b + 1) · BLOCK_H)`` of token ``t`` of
    ``q [T, Hq, D]`` (and of ``k [T, Hk, D]``) with the ``[max_position, R/2]`` cos and sin tables (possibly
    the two halves of one ``[max_position, R]``)."""
    token = tl.program_id(0)
    first_head = tl.program_id(1) * BLOCK_H
    pair, d1, d2, pair_ok = rope_pair_dims(BLOCK_HALF, half, IS_NEOX)
    cos, sin = load_cos_sin(positions_ptr, token, max_position, cos_ptr, sin_ptr, stride_cos, stride_sin,
                            pair, pair_ok)
    if first_head < num_q_heads:
        _rotate_heads_in_place(q_ptr, token, stride_q_t, stride_q_h, first_head, num_q_heads, cos, sin, d1, d2,
                               half, pair_ok, BLOCK_H, BLOCK_HALF, IS_NEOX)
    if HAS_K:
        if first_head < num_k_heads:
            _rotate_heads_in_place(k_ptr, token, stride_k_t, stride_k_h, first_head, num_k_heads, cos, sin, d1,
                                   d2, half, pair_ok, BLOCK_H, BLOCK_HALF, IS_NEOX)
