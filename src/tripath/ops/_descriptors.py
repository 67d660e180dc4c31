"""Reading ``[T, H, D]`` tensors (heads possibly strided in their rows) through TMA tensor descriptors."""

from __future__ import annotations

import functools

import torch


def row_strides(t: torch.Tensor) -> tuple[int, int]:
    """``(token stride, head stride)`` of a ``[T, H, D]`` tensor, the head stride 0 for one head (shared)."""
    strides = t.stride()
    return strides[0], strides[1] if t.shape[1] > 1 else 0


def gluon_descriptor(t: torch.Tensor, shape: list[int], strides: list[int], block: list[int]):
    """A Gluon (sm_90) TMA descriptor over ``t`` viewed as the matrix ``shape``/``strides``, reading
    ``block`` tiles into shared memory in the default NVMMA (swizzled) layout for the kernels' ``wgmma``.

    Descriptors are cached by what they encode (address, dtype, shape, strides, block), so repeated
    launches on the same buffers skip the construction and its checks (host time that a launch would pay
    for each of its several descriptors). A cached descriptor holds only ``t``'s address (:class:`_Address`), not
    ``t``: it keeps no memory alive, and a later tensor at the same address with the same geometry gets an
    identical descriptor, as the launcher reads nothing else from it."""
    return _cached_descriptor(t.data_ptr(), t.dtype, tuple(shape), tuple(strides), tuple(block))


class _Address:
    """What Triton's launcher reads from a descriptor's base tensor: ``data_ptr()`` and ``dtype``."""

    __slots__ = ("_ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype):
        self._ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self._ptr


@functools.lru_cache(maxsize=512)
def _cached_descriptor(ptr: int, dtype: torch.dtype, shape: tuple[int, ...], strides: tuple[int, ...],
                       block: tuple[int, ...]):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(_Address(ptr, dtype), list(shape), list(strides), list(block),
                            _nvmma_layout(block, dtype))


@functools.lru_cache(maxsize=None)
def _nvmma_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The default NVMMA shared layout of a ``block`` tile (cached: building one costs more host time than
    a launch can spare)."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, str(dtype).split(".")[1]))


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
