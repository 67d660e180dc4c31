"""Merging split-KV partials inside the launch that wrote them: the last program of a group to finish merges.

The programs of a group (one output tile, its keys cut into ``pieces``) each write a normalised fp32 partial
``(o_s [M, Dv], lse_s [M])`` (natural-log LSE) and then call :func:`last_to_arrive` on the group's counter.
The one that brings the count to ``pieces`` folds every partial into ``(m, l, acc)`` with
:func:`merge_partials` — ``o = Σ_s e^{lse_s - lse} o_s``, the same form :func:`attend_paged_tiles
<tripath.kernels.attention_common.attend_paged_tiles>` returns, so sinks and :func:`finalize
<tripath.kernels.attention_common.finalize>` apply as for a single program — and sets the counter back to 0,
so the next launch (or graph replay) needs no memset. Nothing waits on another program: any grid is correct.

:func:`reduce_splits_kernel` is the same merge as a launch of its own, for kernels that leave their partials
to a second launch (the verify and MLA decode kernels).
"""

import triton
import triton.language as tl

from tripath.kernels.attention_common import LOG2E
from tripath.triton_internals.specialize import STEP_INVARIANT


@triton.jit
def merge_partial(m_i, l_i, acc, lse2, o):
    """Fold one normalised partial (``lse2 [M]`` in the log2 domain, ``o [M, Dv]`` fp32) into a running
    ``(m_i, l_i, acc)``; an empty partial (−inf) adds nothing."""
    m_new = tl.maximum(m_i, lse2)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    w = tl.math.exp2(lse2 - m_use)
    return m_new, l_i * alpha + w, acc * alpha[:, None] + o * w[:, None]


@triton.jit
def last_to_arrive(counter_ptr, pieces):
    """Count this program's partial in (after a barrier, so every thread's stores are ordered before the
    release); True for the program that completes the group of ``pieces``, which also resets the counter."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    done = arrived == pieces - 1
    if done:
        tl.store(counter_ptr, 0)
    return done


@triton.jit
def merge_partials(part_out_ptr, part_lse_ptr, base, step, row_off, pieces, row_ok, dims_v,
                   BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """``(m, l, acc)`` of the group's ``pieces`` partials, piece ``j`` of row ``r`` at row index ``base + j ·
    step + row_off[r]`` (``base`` a scalar, ``row_off [M]`` int32: the index is rebuilt each piece rather than
    held in registers) of ``part_lse [*]`` and ``part_out [*, BLOCK_DV]``; read past L1 (other SMs wrote
    them)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for j in range(0, pieces):
        part = (base + j * step) + row_off
        lse2 = tl.load(part_lse_ptr + part, mask=row_ok, other=float("-inf"), cache_modifier=".cg") * LOG2E
        o = tl.load(part_out_ptr + part[:, None] * BLOCK_DV + dims_v[None, :], mask=row_ok[:, None], other=0.0,
                    cache_modifier=".cg")
        m_i, l_i, acc = merge_partial(m_i, l_i, acc, lse2, o)
    return m_i, l_i, acc


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
