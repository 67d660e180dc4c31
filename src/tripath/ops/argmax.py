"""``argmax_rows(logits [N, V]) → [N]`` int64: each row's largest value's first column (a NaN counts as
+inf), the greedy token of each row of the LM head's output. On a GPU two launches that split each row over
the SMs (:mod:`tripath.kernels.argmax`); elsewhere ``torch.argmax``.
"""

from __future__ import annotations

import torch

from tripath.kernels.argmax import argmax_chunks_kernel, argmax_merge_kernel
from tripath.ops._checks import FLOAT_DTYPES, check_tensor, next_pow2
from tripath.platform import current_platform
from tripath.triton_internals import launch, use_triton

BLOCK = 1024          # columns a program reads per iteration (8 values a thread at 4 warps)
MIN_CHUNK = 4 * BLOCK  # a chunk's least width: shorter chunks cost more in their merge than they save
PROGRAMS_PER_SM = 4


def argmax_rows_ref(logits: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of :func:`argmax_rows` (same results, NaN counted as +inf)."""
    return torch.where(torch.isnan(logits), float("inf"), logits.float()).argmax(dim=-1)


def argmax_splits(num_rows: int, vocab: int, num_sms: int) -> tuple[int, int]:
    """``(chunk, splits)``: columns a first-pass program scans (a multiple of :data:`BLOCK`) and chunks a row
    has, so the launch has about :data:`PROGRAMS_PER_SM` programs an SM and no chunk narrower than
    :data:`MIN_CHUNK` (or the row)."""
    splits = max(1, min(-(-PROGRAMS_PER_SM * num_sms // max(num_rows, 1)), -(-vocab // MIN_CHUNK)))
    chunk = -(-(-(-vocab // splits)) // BLOCK) * BLOCK
    return chunk, -(-vocab // chunk)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The first column of each row's largest value, ``[N]`` int64, of ``logits [N, V]`` (fp16/bf16/fp32,
    rows contiguous); a NaN counts as +inf, so a row holding one returns its first NaN or +inf. Equal to
    ``torch.argmax(logits, -1)`` on rows without NaN."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    num_rows, vocab = logits.shape
    if vocab < 1:
        raise ValueError("logits must have at least one column")
    if logits.stride(1) != 1:
        raise ValueError("logits must be contiguous in its last dimension")
    device = logits.device
    if not use_triton(device) or num_rows == 0:
        return argmax_rows_ref(logits)
    chunk, splits = argmax_splits(num_rows, vocab, current_platform(device).num_sms)
    part_val = torch.empty(num_rows, splits, dtype=torch.float32, device=device)
    part_idx = torch.empty(num_rows, splits, dtype=torch.int32, device=device)
    out = torch.empty(num_rows, dtype=torch.int64, device=device)
    launch(argmax_chunks_kernel, (num_rows, splits), logits, part_val, part_idx, vocab, logits.stride(0), chunk,
           splits, BLOCK=BLOCK, num_warps=4)
    # BLOCK_S covers the most chunks a row of this width can have, so the variant follows the vocabulary alone
    launch(argmax_merge_kernel, (num_rows,), part_val, part_idx, out, splits,
           BLOCK_S=next_pow2(-(-vocab // MIN_CHUNK)), num_warps=1)
    return out
