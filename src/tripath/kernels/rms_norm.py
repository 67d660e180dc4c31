"""RMSNorm of each row, optionally after adding a residual, in one pass over the row.

For a row ``x [N]`` (and ``r [N]`` when a residual is added):

- ``s = round(x + r)`` in the activation dtype (the residual stream, as the unfused model stores it);
- ``y = round(w · round(s · rsqrt(mean(s²) + eps)))``: statistics and the scaling in fp32, the normalised
  row rounded to the activation dtype before the weight multiplies it (Hugging Face's order).

``x`` is read once and ``s`` / ``y`` written once per row; the unfused PyTorch graph of the same math makes
seven passes over fp32 copies of the row.
"""

import triton
import triton.language as tl
from tripath.triton_internals.specialize import STEP_INVARIANT


@triton.jit(**STEP_INVARIANT)
def rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, sum_ptr, out_ptr,
    num_tokens, n_cols, stride_x, stride_r, stride_s, stride_o, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    """Program ``p`` normalises rows ``[p · BLOCK_M, (p + 1) · BLOCK_M)`` of the ``num_tokens`` rows of ``x``
    (``stride_x`` apart) into the same rows of ``out`` (``stride_o`` apart). With ``HAS_RESIDUAL`` it adds
    ``residual`` first and stores the sum to ``sum``."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < num_tokens
    mask = row_ok[:, None] & (cols[None, :] < n_cols)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + rows64[:, None] * stride_s + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=1) / n_cols
    normed = (xf * (1.0 / tl.sqrt(mean_sq + eps))[:, None]).to(x.dtype)
    w = tl.load(weight_ptr + cols, mask=cols < n_cols, other=0.0)[None, :]
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + rows64[:, None] * stride_o + cols[None, :], y, mask=mask)
