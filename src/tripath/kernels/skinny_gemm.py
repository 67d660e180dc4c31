"""Split-K GEMM for few rows: ``y [M, N] = x [M, K] · wᵀ (+ bias)`` with ``w [N, K]`` (an ``nn.Linear`` weight).

A decode step multiplies a few rows (its batch) by each weight, so the GEMM is a read of the weight. A tile
of ``BLOCK_N`` output columns alone gives too few programs to keep every SM reading when ``N`` is small (a
TP-8 layer's projections), so the ``K`` axis is cut in ``num_splits`` pieces too: program ``(n, s, m)``
multiplies rows ``[m · BLOCK_M, (m + 1) · BLOCK_M)`` by columns ``[n · BLOCK_N, (n + 1) · BLOCK_N)`` of ``w``
over ``K`` values ``[s · k_per_split, (s + 1) · k_per_split)``, in fp32.

With one split the program writes its tile. With several, each stores its fp32 partial in
``partials [num_splits, M, N]`` and counts itself in ``counters[tile]``; the last of a tile's programs to
arrive sums the ``num_splits`` partials in split order (so the result does not depend on which program came
last), adds the bias, writes the tile in ``y``'s dtype and sets the counter back to 0, so the counters are
zero between launches (a CUDA graph replays them as they are).
"""

import triton
import triton.language as tl
from tripath.triton_internals.specialize import STEP_INVARIANT


@triton.jit
def _store_tile(out_ptr, bias_ptr, acc, rows, cols, num_rows, N, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows[:, None] < num_rows) & (cols[None, :] < N)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit(**STEP_INVARIANT)
def skinny_gemm_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, partials_ptr, counters_ptr, num_rows, N, K,
                       k_per_split, num_splits, stride_xm, stride_wn, stride_om,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """Grid ``(cdiv(N, BLOCK_N), num_splits, cdiv(num_rows, BLOCK_M))``; ``k_per_split`` a multiple of
    ``BLOCK_K``; ``partials`` fp32 ``[num_splits, num_rows, N]`` and ``counters`` int32 (one a tile, zero)
    are read only with ``num_splits > 1``."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = split * k_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=(rows[:, None] < num_rows) & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                    mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)
        acc = tl.dot(x, w, acc)
    if num_splits == 1:
        _store_tile(out_ptr, bias_ptr, acc, rows, cols, num_rows, N, stride_om, HAS_BIAS)
    else:
        mask = (rows[:, None] < num_rows) & (cols[None, :] < N)
        at = rows[:, None].to(tl.int64) * N + cols[None, :]
        plane = num_rows.to(tl.int64) * N
        tl.store(partials_ptr + split * plane + at, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial stored before the release below
        counter = counters_ptr + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel") == num_splits - 1:
            tl.store(counter, 0)
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in range(0, num_splits):
                acc += tl.load(partials_ptr + s * plane + at, mask=mask, other=0.0, cache_modifier=".cg")
            _store_tile(out_ptr, bias_ptr, acc, rows, cols, num_rows, N, stride_om, HAS_BIAS)
