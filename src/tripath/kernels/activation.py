"""The gated MLP's activation: ``silu(gate) · up`` of each row of ``[gate | up]``.

For a row ``[g (I values) | u (I values)]``: ``y = round(round(g · sigmoid(g)) · u)``, the math in fp32 with
the activation rounded to the tensor's dtype before the product, as the unfused PyTorch
``F.silu(g) * u`` computes it. One read of the row, one write of ``y``.
"""

import triton
import triton.language as tl
from tripath.triton_internals.specialize import STEP_INVARIANT


@triton.jit(**STEP_INVARIANT)
def silu_and_mul_kernel(x_ptr, out_ptr, num_tokens, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    """Program ``(t, b)`` computes values ``[b · BLOCK, (b + 1) · BLOCK)`` of row ``t``."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + token * stride_x + inter + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + token * stride_o + cols, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)
