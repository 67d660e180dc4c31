"""``skinny_gemm(x [M, K], weight [N, K], bias [N]) → x · weightᵀ + bias`` ``[M, N]`` for few rows (a decode
batch), split over K with the partials summed in the same launch (:mod:`tripath.kernels.skinny_gemm`), with
its PyTorch reference (``F.linear``).

The split is chosen so that the grid covers the GPU about once (:func:`skinny_gemm_config`): a projection of
a TP-8 shard (N of 1–2K rows) spreads over every SM where a library GEMM's tiles leave most of them idle.
Whether it beats the library's GEMM depends on the shape: the engine measures both at start and keeps the
faster per shape (:class:`tripath.models.linear.LinearChoice`).

The counters that find each tile's last split are a per-device buffer of zeros that every launch leaves at
zero; launches on concurrent streams must not share it (pass ``counters``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tripath.kernels.skinny_gemm import skinny_gemm_kernel
from tripath.ops._checks import FLOAT_DTYPES, check_tensor, dot_width
from tripath.platform import current_platform
from tripath.triton_internals import launch, use_triton

MAX_ROWS = 256   # more rows than this: a GEMM of its own (the weight is no longer read once for all rows)
COUNTERS = 1 << 16   # entries of the per-device counter buffer (tiles × row blocks of one launch)
_counters: dict[torch.device, torch.Tensor] = {}


def skinny_gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference of :func:`skinny_gemm`."""
    return F.linear(x, weight, bias)


def skinny_gemm_config(num_rows: int, n: int, k: int, dtype: torch.dtype, num_sms: int, *,
                       split_k: int | None = None, block_n: int | None = None,
                       block_k: int | None = None) -> dict:
    """Launch settings: ``BLOCK_M`` (rows of ``x`` a program: 16–64), ``BLOCK_N`` (weight rows, 64 by
    default), ``BLOCK_K`` (128 for 16-bit, 64 for fp32), ``k_per_split`` (a multiple of ``BLOCK_K``) and
    ``SPLIT_K``: by default about one program an SM (``round(num_sms / tiles)`` splits, fewer where a split
    would have under two ``BLOCK_K`` steps; the steps are shared out whole, so the count may fall short).
    On an H100 the best of a sweep of the presets' projections at 1 and 8 rows was within a split of it on
    most shapes (docs/BENCHMARKS.md)."""
    block_m = min(64, dot_width(num_rows))
    block_n = block_n or 64
    block_k = block_k or (64 if dtype == torch.float32 else 128)
    programs = -(-num_rows // block_m) * -(-n // block_n)
    steps = -(-k // block_k)
    if split_k is None:
        split_k = max(1, min(round(num_sms / programs), steps // 2))
    split_k = max(1, min(int(split_k), steps))
    k_per_split = -(-steps // split_k) * block_k
    split_k = -(-k // k_per_split)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, k_per_split=k_per_split)


def _default_counters(device: torch.device) -> torch.Tensor:
    counters = _counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny_gemm's counters are made on the first call outside a CUDA graph capture: "
                               "call it once before capturing, or pass counters")
        counters = _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return counters


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                split_k: int | None = None, block_n: int | None = None, block_k: int | None = None,
                num_warps: int = 4, num_stages: int = 3, counters: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` (M ≤ 256) times ``weight [N, K]`` transposed, plus ``bias [N]``: a new ``[M, N]`` tensor
    of ``x``'s dtype (fp16/bf16/fp32; weight and bias the same; last dims contiguous). ``split_k``,
    ``block_n``, ``block_k``, ``num_warps``, ``num_stages``: launch settings (:func:`skinny_gemm_config`
    when None). ``counters``: int32 zeros of at least (row blocks × weight tiles) entries, left zero."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,), device=x.device, shape=(None, x.shape[1]))
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(x.dtype,), device=x.device, shape=(weight.shape[0],))
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must have 1 to {MAX_ROWS} rows, got {x.shape[0]}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must be contiguous in their last dimension")
    if not use_triton(x.device):
        return skinny_gemm_ref(x, weight, bias)
    num_rows, k = x.shape
    n = weight.shape[0]
    cfg = skinny_gemm_config(num_rows, n, k, x.dtype, current_platform(x.device).num_sms, split_k=split_k,
                             block_n=block_n, block_k=block_k)
    grid = (-(-num_rows // cfg["BLOCK_M"]), -(-n // cfg["BLOCK_N"]), cfg["SPLIT_K"])
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    partials = out
    if cfg["SPLIT_K"] > 1:
        partials = torch.empty(cfg["SPLIT_K"], num_rows, n, dtype=torch.float32, device=x.device)
        counters = _default_counters(x.device) if counters is None else counters
        if counters.dtype != torch.int32 or counters.numel() < grid[0] * grid[1]:
            raise ValueError(f"counters must be int32 with at least {grid[0] * grid[1]} entries")
    launch(skinny_gemm_kernel, grid, x, weight, bias if bias is not None else x, out, partials,
           counters if counters is not None else out, num_rows, n, k, cfg["k_per_split"], cfg["SPLIT_K"],
           x.stride(0), weight.stride(0), out.stride(0), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
           BLOCK_K=cfg["BLOCK_K"], SPLIT=cfg["SPLIT_K"] > 1, EVEN_K=k % cfg["BLOCK_K"] == 0,
           HAS_BIAS=bias is not None, IEEE_DOT=x.dtype == torch.float32, num_warps=num_warps,
           num_stages=num_stages)
    return out
