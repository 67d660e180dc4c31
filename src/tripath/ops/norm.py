"""RMSNorm, with the residual add fused in: the op, its launcher and its PyTorch reference.

``rms_norm(x [..., N], weight [N], eps)`` → ``weight · x / sqrt(mean(x²) + eps)`` (statistics in fp32, the
normalised value rounded to ``x``'s dtype before the weight, as Hugging Face computes it).
``rms_norm(x, weight, eps, residual=r)`` → ``(s, rms_norm(s))`` with ``s = x + r`` rounded to ``x``'s dtype:
the residual stream's new value and its norm, in one pass (:mod:`tripath.kernels.rms_norm`).
``rms_norm_pair(a [T, Na], weight_a, eps_a, b [T, Nb], weight_b, eps_b)`` → ``(rms_norm(a), rms_norm(b))`` in
one launch (the rows may be strided views of one projection's output: MLA's ``q_a`` and ``kv_a`` norms).
``rms_norm_rope_heads(x [T, H, D], weight, eps, positions, (cos, sin), is_neox=…, second_weight=w2,
second_from=S)`` → the norm of each head (heads ``S`` on with ``w2``; the heads may be strided, a view of a
packed QKV projection) with the rotary embedding applied to each head at its token's position, in one
launch (:mod:`tripath.kernels.qk_norm_rope`): Qwen3's q and k norms and RoPE.
"""

from __future__ import annotations

import torch

from tripath.kernels.qk_norm_rope import rms_norm_rope_heads_kernel
from tripath.kernels.rms_norm import rms_norm_kernel, rms_norm_pair_kernel
from tripath.ops._checks import FLOAT_DTYPES, check_tensor, next_pow2
from tripath.triton_internals import launch, use_triton
from tripath.ops._mla_configs import rotary_config
from tripath.ops.reference_mla import rotary_embedding_ref
from tripath.ops.rotary import check_rotary_table
from tripath.platform import current_platform

MAX_NORM_SIZE = 16384  # a row is held in registers: one program per row up to this width


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 residual: torch.Tensor | None = None):
    """PyTorch reference of :func:`rms_norm` (same signature and results)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if residual is None else (x, y)


def norm_config(n_cols: int) -> dict:
    """``BLOCK_N`` covers the row; rows of at most 1024 values share a program (``BLOCK_M`` of them, so a
    program holds about 2048 values instead of launching one tiny program per short row); warps grow with
    the row so each thread keeps 8–16 values."""
    block_n = next_pow2(n_cols)
    block_m = max(1, 2048 // block_n)
    num_warps = 8 if block_n >= 8192 else 4 if block_n >= 2048 else 2 if block_n >= 512 else 1
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: torch.Tensor | None = None):
    """RMSNorm of the last dimension of ``x [..., N]`` (fp16/bf16/fp32, last dim contiguous) with ``weight
    [N]``; with ``residual`` (``x``'s shape and dtype) returns ``(x + residual, its norm)``, else the norm.
    Outputs are new tensors of ``x``'s shape and dtype."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    device = x.device
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have a last dimension to normalise, got shape {tuple(x.shape)}")
    n_cols = x.shape[-1]
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=device, shape=(n_cols,))
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,), device=device, shape=tuple(x.shape))
        if residual.dim() != x.dim():
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    if n_cols > MAX_NORM_SIZE:
        raise ValueError(f"rms_norm normalises rows of at most {MAX_NORM_SIZE} values, got {n_cols}")
    if not use_triton(device):
        return rms_norm_ref(x, weight, eps, residual=residual)
    x2 = _rows("x", x)
    r2 = _rows("residual", residual) if residual is not None else x2
    out = torch.empty(x.shape, dtype=x.dtype, device=device)
    total = torch.empty(x.shape, dtype=x.dtype, device=device) if residual is not None else out
    out2, total2 = out.view(-1, n_cols), total.view(-1, n_cols)
    num_tokens = x2.shape[0]
    cfg = norm_config(n_cols)
    launch(rms_norm_kernel, (-(-num_tokens // cfg["BLOCK_M"]),),
           x2, r2, weight, total2, out2, num_tokens, n_cols, x2.stride(0), r2.stride(0), total2.stride(0),
           out2.stride(0), float(eps), HAS_RESIDUAL=residual is not None, **cfg)
    return out if residual is None else (total, out)


def rms_norm_pair_ref(a: torch.Tensor, weight_a: torch.Tensor, eps_a: float, b: torch.Tensor, weight_b: torch.Tensor,
                      eps_b: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :func:`rms_norm_pair` (same signature and results)."""
    return rms_norm_ref(a, weight_a, eps_a), rms_norm_ref(b, weight_b, eps_b)


def rms_norm_pair(a: torch.Tensor, weight_a: torch.Tensor, eps_a: float, b: torch.Tensor, weight_b: torch.Tensor,
                  eps_b: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(a, weight_a, eps_a), rms_norm(b, weight_b, eps_b))`` in one launch, the same math as the two
    calls (one warp count for both widths, so a row's fp32 sum of squares may be added in another order than
    its own call's, and the last bits differ). ``a [T, Na]`` and ``b [T, Nb]``: the same rows and dtype (fp16/bf16/fp32), each contiguous in its last
    dimension, rows at any stride (two column ranges of one tensor, say); weights ``[Na]`` / ``[Nb]``. Returns
    two new contiguous tensors."""
    check_tensor("a", a, ndim=2, dtypes=FLOAT_DTYPES)
    device, num_tokens = a.device, a.shape[0]
    check_tensor("b", b, ndim=2, dtypes=(a.dtype,), device=device)
    if b.shape[0] != num_tokens:
        raise ValueError(f"a and b must have the same rows, got {num_tokens} and {b.shape[0]}")
    for name, t, w, eps in (("a", a, weight_a, eps_a), ("b", b, weight_b, eps_b)):
        check_tensor(f"weight_{name}", w, ndim=1, dtypes=FLOAT_DTYPES, device=device, shape=(t.shape[1],))
        if t.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
        if not eps > 0:
            raise ValueError(f"eps_{name} must be positive, got {eps}")
        if not 1 <= t.shape[1] <= MAX_NORM_SIZE:
            raise ValueError(f"rms_norm_pair normalises rows of 1 to {MAX_NORM_SIZE} values, got {name} of "
                             f"{t.shape[1]}")
    if not use_triton(device):
        return rms_norm_pair_ref(a, weight_a, eps_a, b, weight_b, eps_b)
    out_a, out_b = torch.empty(a.shape, dtype=a.dtype, device=device), torch.empty(b.shape, dtype=a.dtype,
                                                                                   device=device)
    cfg = norm_config(max(a.shape[1], b.shape[1]))
    launch(rms_norm_pair_kernel, (-(-num_tokens // cfg["BLOCK_M"]),),
           a, weight_a, out_a, b, weight_b, out_b, num_tokens, a.shape[1], b.shape[1],
           a.stride(0), out_a.stride(0), b.stride(0), out_b.stride(0), float(eps_a), float(eps_b),
           BLOCK_M=cfg["BLOCK_M"], BLOCK_A=next_pow2(a.shape[1]), BLOCK_B=next_pow2(b.shape[1]),
           num_warps=cfg["num_warps"])
    return out_a, out_b


def check_head_norm(op: str, x: torch.Tensor, weight: torch.Tensor, eps: float, second_weight: torch.Tensor | None,
                    second_from: int | None) -> None:
    """The arguments of a per-head norm ``op`` (:func:`rms_norm_rope_heads`): ``x [T, H, D]`` with its last
    dimension contiguous, ``weight [D]`` of ``x``'s dtype, an optional ``second_weight`` of the same dtype
    from head ``second_from`` on, ``eps > 0``, ``D`` at most :data:`MAX_NORM_SIZE`."""
    check_tensor("x", x, ndim=3, dtypes=FLOAT_DTYPES)
    device, heads, n_cols = x.device, x.shape[1], x.shape[2]
    check_tensor("weight", weight, ndim=1, dtypes=(x.dtype,), device=device, shape=(n_cols,))
    if second_weight is not None:
        check_tensor("second_weight", second_weight, ndim=1, dtypes=(weight.dtype,), device=device,
                     shape=(n_cols,))
        if not isinstance(second_from, int) or not 0 <= second_from <= heads:
            raise ValueError(f"second_from must be a head index in [0, {heads}], got {second_from!r}")
    elif second_from is not None:
        raise ValueError("second_from is given without second_weight")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    if n_cols > MAX_NORM_SIZE:
        raise ValueError(f"{op} normalises heads of at most {MAX_NORM_SIZE} values, got {n_cols}")
    if x.stride(2) != 1:
        raise ValueError("x must be contiguous in its last dimension")


def head_norms_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                   second_weight: torch.Tensor | None = None, second_from: int | None = None) -> torch.Tensor:
    """RMSNorm of each head ``x[t, h] [D]`` of ``x [T, H, D]`` with ``weight [D]`` (heads ``second_from`` on
    with ``second_weight``, if given), as a new contiguous tensor: the norm part of
    :func:`rms_norm_rope_heads_ref`."""
    if second_weight is None:
        return rms_norm_ref(x, weight, eps).contiguous()
    return torch.cat([rms_norm_ref(x[:, :second_from], weight, eps),
                      rms_norm_ref(x[:, second_from:], second_weight, eps)], dim=1)


def rms_norm_rope_heads_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                            cos_sin: tuple[torch.Tensor, torch.Tensor], *, is_neox: bool,
                            second_weight: torch.Tensor | None = None, second_from: int | None = None) -> torch.Tensor:
    """PyTorch reference of :func:`rms_norm_rope_heads` (same signature and results)."""
    out = head_norms_ref(x, weight, eps, second_weight=second_weight, second_from=second_from)
    rotary_embedding_ref(positions, out, None, *cos_sin, is_neox=is_neox)
    return out


def rms_norm_rope_heads(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                        cos_sin: tuple[torch.Tensor, torch.Tensor], *, is_neox: bool,
                        second_weight: torch.Tensor | None = None, second_from: int | None = None) -> torch.Tensor:
    """RMSNorm of each head ``x[t, h] [D]`` of ``x [T, H, D]`` (fp16/bf16/fp32; the last dimension
    contiguous, tokens and heads at any stride, as in a view of a packed QKV projection) with ``weight [D]``,
    or, given ``second_weight [D]`` and ``0 <= second_from <= H``, heads ``second_from`` on with
    ``second_weight``; followed by the rotary embedding of each head at
    ``positions [T]`` (int32/int64, clamped into the tables) with ``cos_sin = (cos, sin)``, each
    ``[max_position, R/2]`` (``R <= D`` the rotary dims; NeoX pairs ``(i, i + R/2)`` if ``is_neox``, else
    GPT-J pairs ``(2i, 2i + 1)``), in one launch. ``weight`` (and ``second_weight``) must have ``x``'s dtype.
    Returns a new contiguous ``[T, H, D]`` tensor of ``x``'s dtype."""
    check_head_norm("rms_norm_rope_heads", x, weight, eps, second_weight, second_from)
    device = x.device
    num_tokens, heads, head_size = x.shape
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int32, torch.int64), device=device,
                 shape=(num_tokens,))
    if not isinstance(cos_sin, (tuple, list)) or len(cos_sin) != 2:
        raise ValueError("cos_sin must be the pair (cos, sin) of [max_position, R/2] tables")
    cos, sin = cos_sin
    check_rotary_table("cos", cos, device)
    check_rotary_table("sin", sin, device, cos.shape[1])
    if sin.shape[0] != cos.shape[0]:
        raise ValueError(f"sin has {sin.shape[0]} positions but cos has {cos.shape[0]}")
    half = cos.shape[1]
    if 2 * half > head_size:
        raise ValueError(f"the rotary dims ({2 * half}) exceed the head size {head_size}")
    if not isinstance(is_neox, bool):
        raise TypeError(f"is_neox must be a bool, got {type(is_neox).__name__}")
    if not use_triton(device):
        return rms_norm_rope_heads_ref(x, weight, eps, positions, (cos, sin), is_neox=is_neox,
                                       second_weight=second_weight, second_from=second_from)
    out = torch.empty(x.shape, dtype=x.dtype, device=device)
    cfg = rotary_config(current_platform(device), heads)  # the rotary kernel's tiles: heads of one token
    launch(rms_norm_rope_heads_kernel, (num_tokens, -(-heads // cfg["BLOCK_H"])),
           x, weight, second_weight if second_weight is not None else weight, positions, cos, sin, out,
           x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), sin.stride(0),
           heads, second_from if second_weight is not None else heads, head_size, half, cos.shape[0], float(eps),
           BLOCK_HALF=next_pow2(half), BLOCK_REST=next_pow2(max(1, head_size - 2 * half)), IS_NEOX=is_neox,
           **cfg)
    return out


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, N]`` without a copy (its leading dims must flatten to one stride)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(f"{name}'s leading dimensions must flatten into rows without a copy (shape "
                         f"{tuple(t.shape)}, strides {t.stride()})") from None
