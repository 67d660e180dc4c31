"""Argument validation shared by the launchers: every error names the argument and what is supported."""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

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


def check_options(window_left: int, softcap: float) -> None:
    if window_left < -1:
        raise ValueError(f"window_left must be -1 (off) or >= 0, got {window_left}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 = off), got {softcap}")


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


def check_out(name: str, out: torch.Tensor | None, shape: Sequence[int], dtype: torch.dtype, device) -> None:
    if out is None:
        return
    check_tensor(name, out, dtypes=(dtype,), device=device)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(out.shape)}")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
