"""The split-KV partials shared by paged decode and verify (:mod:`tripath.ops.attention`,
:mod:`tripath.ops.verify`): their buffers, and the launch of
:func:`~tripath.kernels.paged_decode.reduce_splits_kernel` that merges them row by row."""

from __future__ import annotations

import torch

from tripath.kernels.paged_decode import reduce_splits_kernel
from tripath.ops._checks import next_pow2
from tripath.triton_internals import launch


def split_buffers(rows: int, heads: int, num_splits: int, block_dv: int, lse: torch.Tensor, seq_lens: torch.Tensor,
                  device, fill_used: bool = False):
    """``(part_out [rows, heads, S, block_dv], part_lse [rows, heads, S], splits_used [rows])`` for ``S =
    num_splits > 1`` (``fill_used``: ``splits_used`` starts at 1, for rows no program writes); with one split
    the kernel writes ``out`` itself and these are placeholders (``lse``, ``seq_lens``)."""
    if num_splits <= 1:
        return lse, lse, seq_lens
    part_out = torch.empty(rows, heads, num_splits, block_dv, dtype=torch.float32, device=device)
    part_lse = torch.empty(rows, heads, num_splits, dtype=torch.float32, device=device)
    used = (torch.ones if fill_used else torch.empty)(rows, dtype=torch.int32, device=device)
    return part_out, part_lse, used


def merge_splits(part_out, part_lse, splits_used, out: torch.Tensor, lse: torch.Tensor, sinks, num_splits: int,
                 block_dv: int, return_lse: bool) -> None:
    """Merge each row's first ``splits_used[row]`` partials into ``out [rows, heads, Dv]`` (and ``lse``); rows
    with one split are left as the kernel wrote them. Nothing to do for ``num_splits <= 1`` or no rows."""
    rows, heads = out.shape[0], out.shape[1]
    if num_splits <= 1 or rows == 0:
        return
    launch(
        reduce_splits_kernel, (rows, heads),
        part_out, part_lse, out, lse, sinks if sinks is not None else splits_used, splits_used,
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), heads, out.shape[2],
        num_splits=num_splits, BLOCK_S=next_pow2(num_splits), BLOCK_DV=block_dv,
        HAS_SINKS=sinks is not None, RETURN_LSE=return_lse, SPLITS_USED=True, num_warps=4,
    )
