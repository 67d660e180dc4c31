"""Reading ``[T, H, D]`` tensors (heads possibly strided in their rows) through TMA tensor descriptors."""

from __future__ import annotations

import torch


def row_strides(t: torch.Tensor) -> tuple[int, int]:
    """``(token stride, head stride)`` of a ``[T, H, D]`` tensor, the head stride 0 for one head (shared)."""
    return t.stride(0), t.stride(1) if t.shape[1] > 1 else 0


def row_matrix(t: torch.Tensor) -> tuple[int, int, int] | None:
    """``(rows, columns, row stride)`` of the ``[T, (H − 1) · stride_h + D]`` matrix a descriptor reads
    (head ``h`` from column ``h · stride_h``: heads may be strided, as in a packed QKV buffer or MLA's
    up-projection ``[k_nope | v]``), or None when the strides rule a descriptor out (a strided last dim,
    overlapping heads, rows or base not 16-byte aligned, no rows)."""
    rows, heads, dim = t.shape
    row_stride, head_stride = row_strides(t)
    cols = (heads - 1) * head_stride + dim
    if (t.stride(2) != 1 or (heads > 1 and head_stride < dim) or row_stride < cols
            or (row_stride * t.element_size()) % 16 or t.data_ptr() % 16 or rows == 0):
        return None
    return rows, cols, row_stride
