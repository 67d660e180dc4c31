"""Greedy tokens: the index of the largest value of each row of the logits, in two passes split over the row.

For logits ``z [N, V]`` the first pass gives program ``(r, s)`` the columns ``[s · C, (s + 1) · C)`` of row
``r`` (``C`` a multiple of ``BLOCK``) and stores the chunk's largest value and the first column holding it;
the second pass takes, for each row, the largest of its ``S`` chunk maxima and the first chunk holding it.
The result is ``argmax_j z[r, j]`` with ties to the lowest index; a NaN counts as +inf. Splitting the row
keeps every SM reading even when ``N`` is a handful of rows (one program per row would leave most of the GPU
idle at a decode batch of 64 and a 150K vocabulary).
"""

import triton
import triton.language as tl
from tripath.triton_internals.specialize import STEP_INVARIANT


@triton.jit(**STEP_INVARIANT)
def argmax_chunks_kernel(
    logits_ptr, part_val_ptr, part_idx_ptr,
    vocab, stride_row, chunk, num_splits,
    BLOCK: tl.constexpr,
):
    """Program ``(r, s)``: the largest value of chunk ``s`` of row ``r`` and its first column, stored at
    ``part_*[r · num_splits + s]``."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    start = split * chunk
    end = tl.minimum(start + chunk, vocab)
    base = logits_ptr + row.to(tl.int64) * stride_row
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = start + cols  # lanes past the row keep -inf and a column no real one precedes
    for offset in range(start, end, BLOCK):
        idx = offset + cols
        z = tl.load(base + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
        z = tl.where(z != z, float("inf"), z)
        better = z > best  # strict: a lane keeps the first column of its largest value
        best = tl.where(better, z, best)
        best_idx = tl.where(better, idx, best_idx)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, best_idx, 2147483647), axis=0)
    part = row.to(tl.int64) * num_splits + split
    tl.store(part_val_ptr + part, top)
    tl.store(part_idx_ptr + part, first)


@triton.jit(**STEP_INVARIANT)
def argmax_merge_kernel(
    part_val_ptr, part_idx_ptr, out_ptr,
    num_splits,
    BLOCK_S: tl.constexpr,
):
    """Program ``r``: the largest of row ``r``'s ``num_splits`` chunk maxima, its first column into ``out[r]``."""
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    ok = s < num_splits
    base = row.to(tl.int64) * num_splits
    val = tl.load(part_val_ptr + base + s, mask=ok, other=float("-inf"))
    idx = tl.load(part_idx_ptr + base + s, mask=ok, other=2147483647)
    top = tl.max(val, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(val == top, idx, 2147483647), axis=0).to(tl.int64))
