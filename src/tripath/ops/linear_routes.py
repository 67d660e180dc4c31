"""Choosing, at engine start, which GEMM runs each projection of few rows (:func:`tripath.ops.linear.linear`).

For every distinct weight shape and every row class up to the engine's row limit, :func:`choose_routes` times
``F.linear`` (cuBLAS / hipBLASLt) and the split-K Triton GEMM on the model's own weights of that shape — as
many of them, and of their copies, as make twice the L2 cache, so that each call reads its weight from
memory as a layer does — by replaying a CUDA graph of the calls, and routes the shape's row class to the
Triton GEMM, with the fastest of its candidate launches (:func:`~tripath.ops.linear.skinny_candidates`), where
that took at most :data:`WIN_SHARE` of cuBLAS's time. Timing both compiles the Triton variants the routes use,
before the engine serves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F

from tripath.ops.linear import ROW_CLASSES, SKINNY_DTYPES, SkinnyConfig, set_route, skinny_candidates, skinny_linear
from tripath.platform import current_platform

logger = logging.getLogger(__name__)

WIN_SHARE = 0.95     # the Triton GEMM takes a shape's row class when it needs at most this share of cuBLAS's time
REPLAYS = 20         # graph replays a timing takes the median of


@dataclass(frozen=True)
class RouteTiming:
    """One shape and row class as measured: µs a call of each (the Triton GEMM's best candidate, ``config``),
    and whether the Triton GEMM took it."""
    n: int
    k: int
    rows: int
    cublas_us: float
    triton_us: float
    triton: bool
    config: SkinnyConfig


def _median_call_us(calls) -> float:
    """Median µs of one call of ``calls`` (a list of thunks), timed as graph replays of all of them."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:   # eager once: allocations and Triton's variant before the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return sorted(times)[len(times) // 2]


def _out_of_l2(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """``weights`` and copies of the first, as many as make twice the device's L2 cache together."""
    l2 = torch.cuda.get_device_properties(weights[0].device).L2_cache_size
    total = sum(w.numel() * w.element_size() for w in weights)
    copies = max(0, -(-(2 * l2 - total) // (weights[0].numel() * weights[0].element_size())))
    return weights + [weights[0].clone() for _ in range(min(copies, 32))]


def choose_routes(projections: Iterable[tuple[torch.Tensor, torch.Tensor | None]],
                  max_rows: int) -> list[RouteTiming]:
    """Time and route (module doc) every distinct ``[N, K]`` shape among the ``(weight, bias or None)``
    ``projections`` (2-D CUDA fp16/bf16 weights contiguous in their last dimension; others are left to
    ``F.linear``) for each row class up to ``min(max_rows, MAX_SKINNY_ROWS)``; the routes take effect for
    :func:`tripath.ops.linear.linear`. A shape with a bias is timed with one; a routed shape also runs the
    variant of the other projections of its shape (with or without a bias) once, so that it is compiled."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    biases: dict[tuple, set[bool]] = {}
    for w, b in projections:
        if w.is_cuda and w.dim() == 2 and w.dtype in SKINNY_DTYPES and w.stride(1) == 1:
            key = (w.device, w.shape[0], w.shape[1], w.dtype)
            groups.setdefault(key, []).append(w)
            biases.setdefault(key, set()).add(b is not None)
    timings = []
    for (device, n, k, dtype), same in groups.items():
        with_bias = biases[(device, n, k, dtype)]
        bias = torch.zeros(n, dtype=dtype, device=device) if True in with_bias else None
        ws = _out_of_l2(same)
        platform = current_platform(device)
        for rows in ROW_CLASSES:
            if rows > max(ROW_CLASSES[0], max_rows):
                break
            x = torch.randn(rows, k, dtype=dtype, device=device)
            cublas = _median_call_us([lambda w=w: F.linear(x, w, bias) for w in ws])
            triton, config = min(((_median_call_us([lambda w=w, c=c: skinny_linear(x, w, bias, c) for w in ws]), c)
                                  for c in skinny_candidates(rows, n, k, platform)), key=lambda tc: tc[0])
            wins = triton <= WIN_SHARE * cublas
            set_route(device, n, k, dtype, rows, config if wins else None)
            if wins and len(with_bias) == 2:
                skinny_linear(x, same[0], None, config)
            timings.append(RouteTiming(n, k, rows, cublas, triton, wins, config))
        del ws
    for t in timings:
        logger.info("GEMM [%d, %d] x %d rows: cuBLAS %.1f us, Triton split-K %.1f us (%d splits) -> %s", t.n, t.k,
                    t.rows, t.cublas_us, t.triton_us, t.config.splits, "Triton" if t.triton else "cuBLAS")
    return timings
