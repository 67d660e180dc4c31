"""``linear(x [..., K], w [N, K], bias [N] | None) → [..., N]``: a projection, by cuBLAS or by the split-K
Triton GEMM for few rows (:mod:`tripath.kernels.skinny_gemm`), whichever the device measured faster.

Which runs is decided per weight shape and per class of row counts (:data:`ROW_CLASSES`, up to
:data:`MAX_SKINNY_ROWS` rows) by :func:`tripath.ops.linear_routes.choose_routes` at engine start, timing both on
the model's own weights; a shape and row count that was never measured runs ``F.linear``. Measuring at start compiles every
Triton variant the routes can launch, so none is compiled while serving.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tripath.kernels.skinny_gemm import skinny_gemm_kernel
from tripath.ops._checks import check_tensor
from tripath.platform import Platform, current_platform
from tripath.triton_internals import launch, use_triton

ROW_CLASSES = (16, 32, 64, 128, 256)  # a launch for M rows uses the config of the first class ≥ M
MAX_SKINNY_ROWS = ROW_CLASSES[-1]
MAX_SPLITS = 16
COUNTERS = 1 << 16  # merge counters a device keeps (one a tile of a launch; more tiles run unsplit)
SKINNY_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class SkinnyConfig:
    """Tile sizes, K splits and launch options of one skinny GEMM launch."""
    block_m: int
    block_n: int
    block_k: int
    splits: int
    num_stages: int = 4
    num_warps: int = 4


def row_class(num_rows: int) -> int:
    """The smallest of :data:`ROW_CLASSES` ≥ ``num_rows`` (``num_rows`` ≤ :data:`MAX_SKINNY_ROWS`)."""
    return next(c for c in ROW_CLASSES if c >= num_rows)


def skinny_config(num_rows: int, n: int, k: int, platform: Platform) -> SkinnyConfig:
    """The launch for ``num_rows`` rows of an ``[n, k]`` weight on ``platform``: row tiles of the row class
    (at most 64, so the per-program input tile stays small), column tiles that keep the L2 traffic of ``x``
    near the weight's own (``BLOCK_N`` ≥ ``BLOCK_M`` where the columns allow), enough K splits that the grid
    covers the SMs about twice, and as many pipeline stages as the shared memory holds (64 KiB on CDNA3)."""
    num_sms = platform.num_sms
    rows = row_class(num_rows)
    block_m = min(rows, 64)
    block_n = 64 if rows >= 64 else 32
    block_k = 128
    tiles = -(-n // block_n) * -(-rows // block_m)
    k_blocks = -(-k // block_k)
    splits = max(1, min(MAX_SPLITS, k_blocks, round(2 * num_sms / tiles)))
    stages = 2 if platform.is_hip else 4
    return SkinnyConfig(block_m, block_n, block_k, splits, num_stages=stages)


def skinny_candidates(num_rows: int, n: int, k: int, platform: Platform) -> list[SkinnyConfig]:
    """:func:`skinny_config` and the same tiles with half and twice its K splits (the split count is a
    runtime argument: every candidate is one compiled variant), distinct, in that order."""
    base = skinny_config(num_rows, n, k, platform)
    most = min(MAX_SPLITS, -(-k // base.block_k))
    counts = dict.fromkeys((base.splits, max(1, base.splits // 2), min(most, 2 * base.splits)))
    return [dataclasses.replace(base, splits=s) for s in counts]


_counters: dict[torch.device, torch.Tensor] = {}  # a device's merge counters (int32, zero between launches)


def _device_counters(device: torch.device) -> torch.Tensor:
    """The merge counters of ``device``, made by its first split launch, which must not be inside a CUDA graph
    capture (they would live in the graph's memory). Launches on one device share them, so they run one at
    a time (the engine's steps do)."""
    if device not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the skinny GEMM's first launch on a device cannot be inside a CUDA graph capture "
                               "(its merge counters must outlive the graph): launch it once before capturing")
        _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _counters[device]


def check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Raise naming the argument when ``x [..., K]``, ``weight [N, K]``, ``bias [N]`` do not fit together."""
    check_tensor("weight", weight, ndim=2)
    check_tensor("x", x, dtypes=(weight.dtype,), device=weight.device)
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has shape {tuple(x.shape)}; its last dimension must be weight's K = {weight.shape[1]}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(weight.dtype,), device=weight.device, shape=(weight.shape[0],))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None) -> torch.Tensor:
    """``x [M, K] · weightᵀ (+ bias)`` by the split-K Triton GEMM (fp16/bf16, 1 ≤ M ≤ :data:`MAX_SKINNY_ROWS`;
    ``x`` and ``weight`` contiguous in their last dimension; ``F.linear`` where Triton does not run, a CPU
    without the interpreter). ``config`` defaults to :func:`skinny_config`."""
    check_linear(x, weight, bias)
    check_tensor("x", x, ndim=2, dtypes=SKINNY_DTYPES)
    num_rows, k = x.shape
    n = weight.shape[0]
    if not 1 <= num_rows <= MAX_SKINNY_ROWS:
        raise ValueError(f"x has {num_rows} rows; the skinny GEMM takes 1 to {MAX_SKINNY_ROWS}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must be contiguous in their last dimension")
    if not use_triton(x.device):
        return F.linear(x, weight, bias)
    if config is None:
        config = skinny_config(num_rows, n, k, current_platform(x.device))
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    k_per_split = -(-k // (config.splits * config.block_k)) * config.block_k
    splits = -(-k // k_per_split)
    grid = (-(-n // config.block_n), splits, -(-num_rows // config.block_m))
    counters = _device_counters(x.device)
    if grid[0] * grid[2] > counters.numel():
        splits, k_per_split, grid = 1, -(-k // config.block_k) * config.block_k, (grid[0], 1, grid[2])
    partials = out if splits == 1 else torch.empty(splits, num_rows, n, dtype=torch.float32, device=x.device)
    launch(skinny_gemm_kernel, grid, x, weight, out if bias is None else bias, out, partials, counters, num_rows,
           n, k, k_per_split, splits, x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
           BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
           num_stages=config.num_stages, num_warps=config.num_warps)
    return out


_routes: dict[tuple, SkinnyConfig] = {}  # (device, N, K, dtype, row class) → the skinny GEMM's launch


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x [..., K], weight [N, K], bias)``, by the skinny GEMM where
    :func:`~tripath.ops.linear_routes.choose_routes` measured it faster for this weight's shape and ``x``'s row
    class (``x`` contiguous and 16-byte aligned, as at that measurement), else by ``F.linear``."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if _routes and x.is_cuda and 1 <= rows <= MAX_SKINNY_ROWS:
        config = _routes.get((x.device, weight.shape[0], k, x.dtype, row_class(rows)))
        if config is not None and x.is_contiguous() and weight.stride(1) == 1 and x.data_ptr() % 16 == 0:
            return skinny_linear(x.view(rows, k), weight, bias, config).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def set_route(device: torch.device, n: int, k: int, dtype: torch.dtype, rows: int,
              config: SkinnyConfig | None) -> None:
    """Run :func:`linear` on ``[n, k]`` weights of ``dtype`` on ``device`` with ``x`` rows of row class ``rows``
    by the skinny GEMM launched as ``config``; None: by ``F.linear``. The launch's Triton variant must have
    been compiled already (the engine's start does it) or the first call compiles it."""
    if rows not in ROW_CLASSES:
        raise ValueError(f"rows={rows} is not a row class; row classes: {ROW_CLASSES}")
    if config is None:
        _routes.pop((device, n, k, dtype, rows), None)
    else:
        _routes[(device, n, k, dtype, rows)] = config


def forget_routes() -> None:
    """Drop every chosen route (every projection runs ``F.linear`` again)."""
    _routes.clear()
