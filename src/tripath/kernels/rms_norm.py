"""RMSNorm of each row, optionally after adding a residual, in one pass over the row.

For a row ``x [N]`` (and ``r [N]`` when a residual is added):

- ``s = round(x + r)`` in the activation dtype (the residual stream, as the unfused model stores it);
- ``y = round(w · round(s · rsqrt(mean(s²) + eps)))``: statistics and the scaling in fp32, the normalised
  row rounded to the activation dtype before the weight multiplies it (Hugging Face's order).

``x`` is read once and ``s`` / ``y`` written once per row; the unfused PyTorch graph of the same math makes
seven passes over fp32 copies of the row. :func:`rms_norm_pair_kernel` normalises two tensors' rows (each its
own width, weight and eps) in one launch, with the same math for each.
"""

import triton
import triton.language as tl
from tripath.triton_internals.specialize import STEP_INVARIANT


@triton.jit
def normalize_rows(x, rows64, row_ok, cols, n_cols, weight_ptr, out_ptr, stride_o, eps):
    """``y = round(w · round(x · rsqrt(mean(x²) + eps)))`` of the rows ``x [BLOCK_M, BLOCK_N]`` (activation dtype,
    zero past ``n_cols``) stored to rows ``rows64`` of ``out`` (``stride_o`` apart)."""
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=1) / n_cols
    normed = (xf * (1.0 / tl.sqrt(mean_sq + eps))[:, None]).to(x.dtype)
    w = tl.load(weight_ptr + cols, mask=cols < n_cols, other=0.0)[None, :]
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + rows64[:, None] * stride_o + cols[None, :], y, mask=row_ok[:, None] & (cols[None, :] < n_cols))


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
    normalize_rows(x, rows64, row_ok, cols, n_cols, weight_ptr, out_ptr, stride_o, eps)


@triton.jit(**STEP_INVARIANT)
def rms_norm_pair_kernel(
    a_ptr, weight_a_ptr, out_a_ptr, b_ptr, weight_b_ptr, out_b_ptr,
    num_tokens, cols_a, cols_b, stride_a, stride_oa, stride_b, stride_ob, eps_a, eps_b,
    BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Program ``p`` normalises rows ``[p · BLOCK_M, (p + 1) · BLOCK_M)`` of ``a`` (``cols_a`` wide) into
    ``out_a`` and the same rows of ``b`` (``cols_b`` wide) into ``out_b``, each with its own weight and eps:
    two norms of one row block in one launch (MLA's ``q_a`` and ``kv_a`` norms)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_tokens
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_A)
    a = tl.load(a_ptr + rows64[:, None] * stride_a + cols[None, :], mask=row_ok[:, None] & (cols[None, :] < cols_a),
                other=0.0)
    normalize_rows(a, rows64, row_ok, cols, cols_a, weight_a_ptr, out_a_ptr, stride_oa, eps_a)
    cols = tl.arange(0, BLOCK_B)
    b = tl.load(b_ptr + rows64[:, None] * stride_b + cols[None, :], mask=row_ok[:, None] & (cols[None, :] < cols_b),
                other=0.0)
    normalize_rows(b, rows64, row_ok, cols, cols_b, weight_b_ptr, out_b_ptr, stride_ob, eps_b)
