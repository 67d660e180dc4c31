"""Per-head RMSNorm then rotary embedding in one pass (Qwen3's q and k norms before RoPE).

For head ``h`` of token ``t`` of ``x [T, H, D]`` at position ``p`` (rotary dims ``R <= D``, pairs as in
:mod:`tripath.kernels.rotary`):

- ``n = round(x · rsqrt(mean(x²) + eps))`` (statistics and scaling in fp32, over all ``D`` values),
  ``y = round(w_h · n)`` with ``w_h`` the first weight for heads ``h < second_from``, the second after;
- each rotary pair of ``y`` turned by ``cos[p, i]`` / ``sin[p, i]`` in fp32 and rounded; dims past ``R``
  are ``y`` as it is.

The roundings are those of a per-head :func:`tripath.ops.norm.rms_norm` followed by
:func:`tripath.ops.rotary.rotary_embedding`; only the order of the fp32 sum of squares differs. ``x`` is
read once and the result written once, where the two kernels read and write it twice.
"""

import triton
import triton.language as tl
from tripath.kernels.rotary import load_cos_sin, rope_pair_dims, rotate_interleaved, rotate_pairs
from tripath.triton_internals.specialize import STEP_INVARIANT


@triton.jit
def _weighted(x, rstd, weight_ptr, weight2_ptr, dims, dims_ok, first, dtype: tl.constexpr):
    """``round(w · round(x · rstd))`` of the fp32 tile ``x [BLOCK_H, N]``, rounded to ``dtype`` (the
    activations'), each row with the first weight where ``first`` and the second elsewhere (both loaded and
    selected by value: a select between two pointers does not compile for AMD)."""
    w = tl.load(weight_ptr + dims, mask=dims_ok, other=0.0)
    w2 = tl.load(weight2_ptr + dims, mask=dims_ok, other=0.0)
    w = tl.where(first, w[None, :], w2[None, :])
    normed = (x * rstd).to(dtype)
    return (w.to(tl.float32) * normed.to(tl.float32)).to(dtype)


@triton.jit(**STEP_INVARIANT)
def rms_norm_rope_heads_kernel(
    x_ptr, weight_ptr, weight2_ptr, positions_ptr, cos_ptr, sin_ptr, out_ptr,
    stride_x, stride_xh, stride_o, stride_oh, stride_cos, stride_sin,
    heads, second_from, head_size, half, max_position, eps,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr, IS_NEOX: tl.constexpr,
):
    """Program ``(t, b)`` normalises and rotates heads ``[b · BLOCK_H, (b + 1) · BLOCK_H)`` of token ``t``
    of ``x`` (heads ``stride_xh`` apart, tokens ``stride_x``) into ``out``. ``BLOCK_REST``: a power of two
    covering the ``D − R`` dims past the rotary ones (1 when there are none)."""
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    token = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = (hs < heads)[:, None]
    first = (hs < second_from)[:, None]
    pair, d1, d2, pair_ok = rope_pair_dims(BLOCK_HALF, half, IS_NEOX)
    cos, sin = load_cos_sin(positions_ptr, token, max_position, cos_ptr, sin_ptr, stride_cos, stride_sin,
                            pair, pair_ok)
    src = x_ptr + token * stride_x + hs[:, None].to(tl.int64) * stride_xh
    dst = out_ptr + token * stride_o + hs[:, None].to(tl.int64) * stride_oh
    rest = 2 * half + tl.arange(0, BLOCK_REST)
    rest_ok = rest < head_size
    x3 = tl.load(src + rest[None, :], mask=head_ok & rest_ok[None, :], other=0.0).to(tl.float32)
    if IS_NEOX:  # the pairs' halves are two contiguous runs
        mask = head_ok & pair_ok[None, :]
        x1 = tl.load(src + d1[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + d2[None, :], mask=mask, other=0.0).to(tl.float32)
        sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(x3 * x3, axis=1)
        rstd = (1.0 / tl.sqrt(sq / head_size + eps))[:, None]
        y1 = _weighted(x1, rstd, weight_ptr, weight2_ptr, d1, pair_ok, first, dtype)
        y2 = _weighted(x2, rstd, weight_ptr, weight2_ptr, d2, pair_ok, first, dtype)
        z1, z2 = rotate_pairs(y1.to(tl.float32), y2.to(tl.float32), cos[None, :], sin[None, :])
        tl.store(dst + d1[None, :], z1.to(y1.dtype), mask=mask)
        tl.store(dst + d2[None, :], z2.to(y2.dtype), mask=mask)
    else:  # interleaved pairs: the R rotary values of a head are one contiguous run
        dims = tl.arange(0, 2 * BLOCK_HALF)
        dims_ok = dims < 2 * half
        mask = head_ok & dims_ok[None, :]
        x12 = tl.load(src + dims[None, :], mask=mask, other=0.0).to(tl.float32)
        sq = tl.sum(x12 * x12, axis=1) + tl.sum(x3 * x3, axis=1)
        rstd = (1.0 / tl.sqrt(sq / head_size + eps))[:, None]
        y12 = _weighted(x12, rstd, weight_ptr, weight2_ptr, dims, dims_ok, first, dtype)
        tl.store(dst + dims[None, :], rotate_interleaved(y12, cos, sin), mask=mask)
    y3 = _weighted(x3, rstd, weight_ptr, weight2_ptr, rest, rest_ok, first, dtype)
    tl.store(dst + rest[None, :], y3, mask=head_ok & rest_ok[None, :])
