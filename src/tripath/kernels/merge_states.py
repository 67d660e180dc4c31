"""Merge two partial attention results by their log-sum-exp: ``o = (e^a o_a + e^b o_b) / (e^a + e^b)``."""

import triton
import triton.language as tl
from tripath.triton_internals.specialize import STEP_INVARIANT


@triton.jit(**STEP_INVARIANT)
def merge_states_kernel(
    out_a_ptr, lse_a_ptr, out_b_ptr, lse_b_ptr, out_ptr, lse_ptr,
    stride_a_t, stride_a_h, stride_b_t, stride_b_h, stride_o_t, stride_o_h,
    stride_la_t, stride_la_h, stride_lb_t, stride_lb_h, stride_lo_t, stride_lo_h,
    num_heads, head_size,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program ``t``: every head of token ``t``, ``o = (e^a o_a + e^b o_b) / (e^a + e^b)`` and
    ``lse = log(e^a + e^b)``; an empty side (LSE −inf) is ignored, whatever its output holds."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    h_ok = heads < num_heads
    mask = h_ok[:, None] & (dims[None, :] < head_size)
    lse_a = tl.load(lse_a_ptr + token * stride_la_t + heads * stride_la_h, mask=h_ok, other=float("-inf"))
    lse_b = tl.load(lse_b_ptr + token * stride_lb_t + heads * stride_lb_h, mask=h_ok, other=float("-inf"))
    m = tl.maximum(lse_a, lse_b)
    m = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m)
    w_b = tl.exp(lse_b - m)
    denom = w_a + w_b
    safe = tl.where(denom > 0.0, denom, 1.0)
    o_a = tl.load(out_a_ptr + token * stride_a_t + heads[:, None] * stride_a_h + dims[None, :], mask=mask,
                  other=0.0).to(tl.float32)
    o_b = tl.load(out_b_ptr + token * stride_b_t + heads[:, None] * stride_b_h + dims[None, :], mask=mask,
                  other=0.0).to(tl.float32)
    # An empty side may hold garbage (never written): weight 0 must not turn NaN into the result.
    o_a = tl.where((w_a > 0.0)[:, None], o_a, 0.0)
    o_b = tl.where((w_b > 0.0)[:, None], o_b, 0.0)
    out = o_a * (w_a / safe)[:, None] + o_b * (w_b / safe)[:, None]
    tl.store(out_ptr + token * stride_o_t + heads[:, None] * stride_o_h + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + token * stride_lo_t + heads * stride_lo_h,
             tl.where(denom > 0.0, tl.log(safe) + m, float("-inf")), mask=h_ok)
