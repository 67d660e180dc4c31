"""Rotary position embedding: the op, its launcher, and cos/sin table builders.

``rotary_embedding(positions [T], q [T, Hq, D], k [T, Hk, D] | None, cos_sin_cache [max_position, R])``
rotates the first ``R`` dims of every head in place: pair ``i`` of a token at position ``p`` is turned by
the angle whose ``cos``/``sin`` are ``cos_sin_cache[p, i]`` / ``cos_sin_cache[p, R/2 + i]``. NeoX style pairs
dims ``(i, i + R/2)``, GPT-J style ``(2i, 2i + 1)``. Positions are clamped into the table, so the identity
table of :func:`identity_rope_tables` (one row, cos 1, sin 0) leaves every value exactly as it was.
"""

from __future__ import annotations

import torch

from tripath.kernels.rotary import rotary_embedding_kernel
from tripath.ops import _mla_configs
from tripath.ops._checks import FLOAT_DTYPES, check_tensor, next_pow2
from tripath.triton_internals import launch, use_triton
from tripath.platform import current_platform


def rope_cos_sin(max_position: int, rotary_dim: int, *, base: float = 10000.0,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Plain RoPE tables ``cos, sin [max_position, rotary_dim // 2]`` fp32 with inverse frequencies
    ``base^(-2i / rotary_dim)`` (models with scaled RoPE build their own tables)."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float().to(device), angles.sin().float().to(device)


def identity_rope_tables(rotary_dim: int, *, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """One-row tables (cos 1, sin 0): the rotation of NoPE models, exact for every (clamped) position."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    half = rotary_dim // 2
    return (torch.ones(1, half, dtype=torch.float32, device=device),
            torch.zeros(1, half, dtype=torch.float32, device=device))


def _as_heads(name: str, t: torch.Tensor, num_tokens: int | None, device) -> torch.Tensor:
    check_tensor(name, t, dtypes=FLOAT_DTYPES, device=device)
    if t.dim() == 2:
        t = t.unsqueeze(1)
    if t.dim() != 3:
        raise ValueError(f"{name} must be [T, H, D] or [T, D], got shape {tuple(t.shape)}")
    if num_tokens is not None and t.shape[0] != num_tokens:
        raise ValueError(f"{name} has {t.shape[0]} tokens but positions has {num_tokens}")
    if t.stride(2) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (it is rotated in place)")
    return t


def check_rotary_table(name: str, table: torch.Tensor, device, width: int | None = None) -> None:
    check_tensor(name, table, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    if table.shape[0] < 1:
        raise ValueError(f"{name} must have at least one row (position), got shape {tuple(table.shape)}")
    if width is not None and table.shape[1] != width:
        raise ValueError(f"{name} must have {width} columns, got shape {tuple(table.shape)}")
    if table.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None,
                     cos_sin_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], *,
                     is_neox: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate the first ``R`` dims of each head of ``q`` (and ``k``) in place.

    Parameters
    ----------
    positions : ``[T]`` int32/int64 token positions (clamped into ``[0, max_position)``).
    q : ``[T, Hq, D]`` or ``[T, D]``; k : ``[T, Hk, D]``, ``[T, D]`` or None; fp16/bf16/fp32, last dim contiguous.
    cos_sin_cache : ``[max_position, R]``, cos in columns ``[0, R/2)``, sin in ``[R/2, R)``; ``R <= D``, even.
        Or a pair ``(cos, sin)`` of ``[max_position, R/2]`` tables (no concatenated copy needed).
    is_neox : NeoX pairs ``(i, i + R/2)`` if True, GPT-J interleaved pairs ``(2i, 2i + 1)`` if False.

    Returns ``(q, k)``, the same tensors, rotated.
    """
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int32, torch.int64))
    device = positions.device
    num_tokens = positions.shape[0]
    q3 = _as_heads("q", q, num_tokens, device)
    k3 = _as_heads("k", k, num_tokens, device) if k is not None else None
    if isinstance(cos_sin_cache, (tuple, list)):
        if len(cos_sin_cache) != 2:
            raise ValueError(f"cos_sin_cache as a sequence must be (cos, sin), got {len(cos_sin_cache)} tables")
        cos, sin = cos_sin_cache
        check_rotary_table("cos", cos, device)
        check_rotary_table("sin", sin, device, cos.shape[1])
        if sin.shape[0] != cos.shape[0]:
            raise ValueError(f"sin has {sin.shape[0]} positions but cos has {cos.shape[0]}")
        rotary_dim = 2 * cos.shape[1]
    else:
        check_rotary_table("cos_sin_cache", cos_sin_cache, device)
        rotary_dim = cos_sin_cache.shape[1]
        if rotary_dim % 2:
            raise ValueError(f"cos_sin_cache must have an even number of columns (cos | sin), got {rotary_dim}")
        cos, sin = cos_sin_cache[:, : rotary_dim // 2], cos_sin_cache[:, rotary_dim // 2:]
    for name, t in (("q", q3), ("k", k3)):
        if t is not None and t.shape[2] < rotary_dim:
            raise ValueError(f"{name}'s head size {t.shape[2]} is smaller than the rotary dim {rotary_dim}")
    if not isinstance(is_neox, bool):
        raise TypeError(f"is_neox must be a bool, got {type(is_neox).__name__}")
    if not use_triton(device):
        from tripath.ops.reference_mla import rotary_embedding_ref
        rotary_embedding_ref(positions, q3, k3, cos, sin, is_neox=is_neox)
        return q, k
    half = rotary_dim // 2
    k_arg = k3 if k3 is not None else q3
    max_heads = max(q3.shape[1], k3.shape[1] if k3 is not None else 0)
    cfg = dict(_mla_configs.rotary_config(current_platform(device), max_heads))
    launch(
        rotary_embedding_kernel, (num_tokens, -(-max_heads // cfg["BLOCK_H"])),
        positions, q3, k_arg, cos, sin,
        q3.stride(0), q3.stride(1), k_arg.stride(0), k_arg.stride(1), cos.stride(0), sin.stride(0),
        q3.shape[1], k3.shape[1] if k3 is not None else 0, half, cos.shape[0],
        BLOCK_HALF=next_pow2(half), IS_NEOX=is_neox, HAS_K=k3 is not None, **cfg,
    )
    return q, k
