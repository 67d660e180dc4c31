"""``silu_and_mul(x [T, 2I]) → silu(x[:, :I]) · x[:, I:]`` ``[T, I]``: the gated MLP's activation in one
launch (:mod:`tripath.kernels.activation`), with its PyTorch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tripath.kernels.activation import silu_and_mul_kernel
from tripath.ops._checks import FLOAT_DTYPES, check_tensor
from tripath.triton_internals import launch, use_triton

BLOCK = 1024  # values of a row per program


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of :func:`silu_and_mul`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [T, 2I]`` (fp16/bf16/fp32, last dim contiguous; gate columns first) → new ``[T, I]`` tensor."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.shape[1] % 2:
        raise ValueError(f"x must be [T, 2 * intermediate] (gate then up), got an odd width {x.shape[1]}")
    if x.stride(1) != 1:
        raise ValueError("x must be contiguous in its last dimension")
    if not use_triton(x.device):
        return silu_and_mul_ref(x)
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    launch(silu_and_mul_kernel, (num_tokens, -(-inter // BLOCK)), x, out, num_tokens, inter, x.stride(0),
           out.stride(0), BLOCK=BLOCK, num_warps=4)
    return out
