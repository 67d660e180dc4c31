"""A GEMM for few rows: ``out [M, N] = x [M, K] · W [N, K]ᵀ (+ bias [N])`` with M small (a decode batch),
split over K so that a weight of a few thousand rows still spreads over every SM.

The weight's rows are the matrix unit's long side (tiles of ``BLOCK_N`` rows × ``BLOCK_M`` rows of ``x``,
``W_tile · x_blockᵀ``), so M may be 1. Program ``(b, j, s)`` multiplies rows block ``b`` of ``x`` by weight
tile ``j`` over the K range ``[s · k_per_split, (s + 1) · k_per_split)``; the row blocks of a tile are
neighbours in the grid, so the tile is read from memory once and from L2 by the others.

With one split the program writes ``dtype(acc + bias)``. With several splits it writes its fp32 partial to
``partials [splits, M, N]`` and counts itself in the tile's ``counters`` entry (an acquire-release atomic);
the program that counts last sums the tile's partials in split order (0, 1, …: the result does not depend on
which program finishes last), adds the bias, writes ``out`` and sets the counter back to 0 for the next
call. The program's threads meet at a barrier before the count (so the release covers all their stores), and
the last program reads the partials past L1 (``.cg``), after the count's acquire.
"""

import triton
import triton.language as tl
from tripath.kernels.lm_head_sample import round_to
from tripath.triton_internals.specialize import STEP_INVARIANT


@triton.jit
def _store_out(acc, rows, cols, row_ok, col_ok, bias_ptr, out_ptr, stride_o, HAS_BIAS: tl.constexpr):
    """``acc [BLOCK_N, BLOCK_M]`` (fp32, weight rows × x rows) plus the bias, rounded, into ``out[rows, cols]``."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    ptrs = out_ptr + rows.to(tl.int64)[None, :] * stride_o + cols[:, None]
    tl.store(ptrs, round_to(acc, dtype).to(dtype), mask=col_ok[:, None] & row_ok[None, :])


@triton.jit(**STEP_INVARIANT)
def skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, partials_ptr, counters_ptr,
    num_rows, n_cols, k_size, k_per_split, num_splits, stride_x, stride_w, stride_o,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE_DOT: tl.constexpr,
):
    """Program ``(b, j, s)`` as in the module docstring. ``k_per_split``: a multiple of ``BLOCK_K``;
    ``SPLIT``: ``num_splits > 1``; ``EVEN_K``: ``k_size`` is a multiple of ``BLOCK_K`` (no K mask)."""
    block = tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    col_ok = cols < n_cols
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, k_size)
    ks = k_start + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :]
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            in_k = (k + tl.arange(0, BLOCK_K)) < k_end
            w = tl.load(w_ptrs, mask=col_ok[:, None] & in_k[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=row_ok[:, None] & in_k[None, :], other=0.0)
        if IEEE_DOT:
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if not SPLIT:
        _store_out(acc, rows, cols, row_ok, col_ok, bias_ptr, out_ptr, stride_o, HAS_BIAS)
    else:
        plane = num_rows.to(tl.int64) * n_cols
        at = rows.to(tl.int64)[None, :] * n_cols + cols[:, None]
        mask = col_ok[:, None] & row_ok[None, :]
        tl.store(partials_ptr + split * plane + at, acc, mask=mask)
        counter = counters_ptr + block * tl.num_programs(1) + tile
        tl.debug_barrier()   # every thread's partial stored before the count releases them
        done = tl.atomic_add(counter, 1, sem="acq_rel")
        if done == num_splits - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(0, num_splits):
                total += tl.load(partials_ptr + s * plane + at, mask=mask, other=0.0, cache_modifier=".cg")
            _store_out(total, rows, cols, row_ok, col_ok, bias_ptr, out_ptr, stride_o, HAS_BIAS)
            tl.atomic_xchg(counter, 0)
