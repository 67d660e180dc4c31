"""Argument validation shared by the launchers: every error names the argument and what is supported."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

from tripath import _env
from tripath.constants import MAX_HEAD_SIZE, MIN_HEAD_SIZE
from tripath.platform import FP8_DTYPES

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    shape: Sequence[int | None] | None = None,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming ``name`` when ``t`` is not what the op supports."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {_dtype_names(dtypes)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the inputs are on {device}")
    if shape is not None:
        for i, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}; dimension {i} must be {want}"
                )


def check_head_size(name: str, head_size: int) -> None:
    if not MIN_HEAD_SIZE <= head_size <= MAX_HEAD_SIZE:
        raise ValueError(
            f"{name}={head_size} is not supported: head sizes from {MIN_HEAD_SIZE} to {MAX_HEAD_SIZE}"
        )


def check_gqa(num_heads: int, num_kv_heads: int) -> int:
    """Return the query heads per KV head; raise when ``num_heads`` is not a multiple of ``num_kv_heads``."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num query heads ({num_heads}) must be a positive multiple of num kv heads ({num_kv_heads})"
        )
    return num_heads // num_kv_heads


MAX_SOFTCAP = 1e30   # kernels take the cap in fp32 times log2(e); above it c·tanh(s/c) is s to fp32 precision


def check_options(window_left: int, softcap: float, sm_scale: float | None = None) -> None:
    if window_left < -1:
        raise ValueError(f"window_left must be -1 (off) or >= 0, got {window_left}")
    if not math.isfinite(softcap) or not 0 <= softcap <= MAX_SOFTCAP:
        raise ValueError(f"softcap must be a finite number in [0, {MAX_SOFTCAP:g}] (0 = off), got {softcap}")
    check_sm_scale(sm_scale)


def check_sm_scale(sm_scale: float | None) -> None:
    """``sm_scale`` (None: the op's default) must be a finite number."""
    if sm_scale is not None and not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be a finite number, got {sm_scale}")


def check_per_head(name: str, t: torch.Tensor | None, num_heads: int, device: torch.device) -> None:
    """``alibi_slopes`` and ``sinks``: float32-convertible ``[num_heads]`` on the inputs' device."""
    if t is None:
        return
    check_tensor(name, t, ndim=1, dtypes=(torch.float32, torch.float16, torch.bfloat16), device=device)
    if t.shape[0] != num_heads:
        raise ValueError(f"{name} must have shape [{num_heads}] (one per query head), got {tuple(t.shape)}")


def check_index(name: str, t: torch.Tensor, device: torch.device, ndim: int = 1) -> None:
    check_tensor(name, t, ndim=ndim, dtypes=(torch.int32, torch.int64), device=device)


def check_scale(name: str, scale: torch.Tensor | None, cache_dtype: torch.dtype, device: torch.device) -> None:
    """fp8 caches need a one-element float32 scale tensor on the device; other caches ignore it."""
    if cache_dtype in FP8_DTYPES:
        if scale is None:
            raise ValueError(f"{name} is required for an fp8 KV cache (a one-element float32 tensor)")
    if scale is not None:
        check_tensor(name, scale, dtypes=(torch.float32,), device=device)
        if scale.numel() != 1:
            raise ValueError(f"{name} must hold one per-tensor scale, got {scale.numel()} elements")
        if cache_dtype in FP8_DTYPES and values_checked(None, scale):
            value = float(scale.reshape(()))
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite positive scale, got {value}")


def check_out(name: str, out: torch.Tensor | None, shape: Sequence[int], dtype: torch.dtype, device) -> None:
    if out is None:
        return
    check_tensor(name, out, dtypes=(dtype,), device=device)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(out.shape)}")


def check_block_table(block_table: torch.Tensor, device: torch.device) -> None:
    """``[num_requests, max_blocks]`` int32/int64 on the device, each row's entries contiguous (stride 1)."""
    check_index("block_table", block_table, device, ndim=2)
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError(f"block_table must be contiguous along its rows (stride 1 between a row's blocks), got "
                         f"strides {tuple(block_table.stride())}; pass block_table.contiguous()")


# -- values of index tensors ---------------------------------------------------------------------------------
# Host tensors are checked on every call (free); device tensors only when TRIPATH_VALIDATE=1 or validate=True,
# since reading their values syncs with the host (and breaks CUDA-graph capture).

def values_checked(validate: bool | None, *tensors: torch.Tensor | None) -> bool:
    """Whether to check the values of ``tensors``: never when ``validate`` is False; otherwise always when
    they are all on the host, on a device when ``validate`` (None: the ``TRIPATH_VALIDATE`` setting)."""
    if validate is False:
        return False
    present = [t for t in tensors if t is not None]
    if all(t.device.type == "cpu" for t in present):
        return True
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False  # a CUDA graph is being captured: no host syncs
    return bool(validate) if validate is not None else _env.validate()


def _fail(name: str, bad: torch.Tensor, values: torch.Tensor, what: str) -> None:
    """Raise naming ``name`` when any element of the boolean ``bad`` is set (one host sync)."""
    if bool(bad.any()):
        if bad.dim() == 0:
            raise ValueError(f"{name}: {what} (it is {values.item()})")
        position = tuple(bad.nonzero()[0].tolist())
        shown = values[position].item()
        where = position[0] if len(position) == 1 else list(position)
        raise ValueError(f"{name}: {what} (entry {where} is {shown})")


def check_cu_seqlens_values(name: str, cu: torch.Tensor, num_rows: int, max_seqlen: int | None = None,
                            max_name: str = "") -> None:
    """``cu`` starts at 0, never decreases, ends within ``num_rows`` rows; each length <= ``max_seqlen``."""
    if cu.shape[0] == 0:
        return
    cu = cu.long()
    if int(cu[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(cu[0])}")
    lens = cu[1:] - cu[:-1]
    _fail(name, lens < 0, cu[1:], "offsets must be non-decreasing")
    if int(cu[-1]) > num_rows:
        raise ValueError(f"{name} ends at {int(cu[-1])}, past the {num_rows} rows of the tensor it indexes")
    if max_seqlen is not None and lens.numel() and int(lens.max()) > int(max_seqlen):
        raise ValueError(f"{max_name}={int(max_seqlen)} is below the longest request in {name} ({int(lens.max())})")


def check_seq_lens_values(seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int,
                          num_blocks: int, min_lens: torch.Tensor | None = None) -> None:
    """``0 <= seq_lens[i]`` (``>= min_lens[i]`` when given), at most what row ``i`` of the block table
    holds, and every block id a request reads in ``[0, num_blocks)``."""
    rows = seq_lens.shape[0]
    lens = seq_lens.long()
    _fail("seq_lens", lens < 0, lens, "lengths must be >= 0")
    if min_lens is not None:
        _fail("seq_lens", lens < min_lens.long(), lens, "each length must cover its request's new tokens")
    capacity = block_table.shape[1] * block_size
    _fail("seq_lens", lens > capacity, lens,
          f"lengths must fit in the block table ({block_table.shape[1]} blocks of {block_size} = {capacity})")
    check_block_ids(block_table[:rows], torch.zeros_like(lens), lens, block_size, num_blocks)


def check_block_ids(block_table: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, block_size: int,
                    num_blocks: int) -> None:
    """The block ids row ``i`` reads for positions ``starts[i] .. ends[i] - 1`` lie in ``[0, num_blocks)``."""
    if block_table.numel() == 0:
        return
    cols = torch.arange(block_table.shape[1], device=block_table.device)[None, :]
    first = (starts.long() // block_size)[:, None]
    last = ((ends.long() + block_size - 1) // block_size)[:, None]
    used = (cols >= first) & (cols < last) & (ends > starts)[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_blocks))
    _fail("block_table", bad, block_table, f"block ids must be in [0, num_blocks={num_blocks})")


def check_gather_values(block_table: torch.Tensor, cu_seqlens: torch.Tensor, seq_starts: torch.Tensor,
                        block_size: int, num_blocks: int, num_rows: int, cu_name: str) -> None:
    """A gather's requests: ``cu_seqlens`` within the ``num_rows`` output rows, cached positions
    ``seq_starts[i] ..`` inside row ``i`` of the block table, and in-range block ids."""
    check_cu_seqlens_values(cu_name, cu_seqlens, num_rows)
    num_seqs = cu_seqlens.shape[0] - 1
    if num_seqs <= 0:
        return
    starts = seq_starts.long()
    ends = starts + (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    _fail("seq_starts", starts < 0, starts, "positions must be >= 0")
    capacity = block_table.shape[1] * block_size
    _fail("seq_starts", ends > capacity, ends,
          f"seq_starts + lengths must fit in the block table ({block_table.shape[1]} blocks of {block_size})")
    check_block_ids(block_table[:num_seqs], starts, ends, block_size, num_blocks)


def check_slot_values(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Each slot is negative (skipped) or below the cache's ``num_blocks * block_size`` slots."""
    _fail("slot_mapping", slot_mapping >= num_slots, slot_mapping,
          f"slots must be negative (skip) or below num_blocks * block_size = {num_slots}")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_width(n: int, fp8: bool = False) -> int:
    """Padded tile width of a dim a ``tl.dot`` reduces over: a power of two, at least 16 (``tl.dot``'s least),
    32 where the operands are fp8 (the least K of an fp8 dot on NVIDIA)."""
    return max(32 if fp8 else 16, next_pow2(n))


def contiguous_last(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy where its last dimension is strided."""
    return t if t.stride(-1) == 1 else t.contiguous()


def check_written(name: str, t: torch.Tensor) -> None:
    """An output written in place must be contiguous in its last dimension."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (it is written in place)")
