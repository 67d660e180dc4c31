"""Timing for the kernel benchmarks (``tripath bench kernels``, ``tripath bench tune``): a report's rows, the
floors measured in the same run (copy bandwidth, an 8192³ bf16 matmul), medians of eager launches and of
CUDA-graph replays (GPU time without Python), host time of a call, random block tables, and the driver's
power-capping counter."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tripath import _env


@dataclass
class Row:
    table: str
    shape: str
    impl: str
    us: float
    metric: float  # GB/s or TF/s
    unit: str
    note: str = ""


@dataclass
class Report:
    device: str
    copy_gbps: float = 0.0
    matmul_tflops: float = 0.0
    rows: list[Row] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    power_capped_s: float | None = None  # seconds the driver capped the clocks for power during the run


def parse_power_capping_us(performance_text: str) -> float | None:
    """The "SW Power Capping" counter (µs) of ``nvidia-smi -q -d PERFORMANCE`` output for one GPU, or None
    when the output has no such counter or describes several GPUs."""
    blocks = performance_text.split("Clocks Event Reasons Counters")
    if len(blocks) != 2:
        return None
    for line in blocks[1].splitlines():
        if "SW Power Capping" in line:
            try:
                return float(line.split(":", 1)[1].split()[0])
            except (IndexError, ValueError):
                return None
    return None


def power_capping_us() -> float | None:
    """The driver's counter of time spent capping this machine's GPU clocks for power (µs), where
    ``nvidia-smi`` reports it for exactly one GPU. Sustained prefill load can cap an H200 for tens of
    seconds a minute, which moves compute-bound rows by a few percent, so the report states it."""
    import shutil
    import subprocess
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "-q", "-d", "PERFORMANCE"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_power_capping_us(out.stdout)


def bench_eager(fn, reps_ms: int = 200) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=25, rep=reps_ms, return_mode="median")) * 1e3  # us


def bench_graph(fn) -> float:
    """Median µs of ``fn`` replayed from a CUDA graph: GPU time without Python launch overhead."""
    import triton.testing
    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")) * 1e3


def host_us(fn, calls: int = 100) -> float:
    """Host time of one call of ``fn`` (µs): ``calls`` calls issued while a sleep kernel keeps the GPU busy,
    so no call waits for the GPU and the wall time is Python, checks and launches alone."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e8))  # ~0.2 s of GPU clock cycles: longer than the calls take to issue
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def portable(fn):
    """``fn`` run with the Gluon kernels disabled (on sm_90: the portable Triton kernels they replace)."""
    def run():
        with _env.setting("TRIPATH_DISABLE_GLUON", "1"):
            return fn()
    return run


def measure_floors(report: Report) -> None:
    n = 1 << 29  # 1 GiB of bf16
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = bench_eager(lambda: dst.copy_(src))
    report.copy_gbps = 2 * n * 2 / (us * 1e-6) / 1e9
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    us = bench_eager(lambda: a @ b)
    report.matmul_tflops = 2 * 8192 ** 3 / (us * 1e-6) / 1e12


def random_table(batch: int, ctx: int, block_size: int, device) -> tuple[torch.Tensor, int]:
    per = -(-ctx // block_size)
    num_blocks = batch * per + 1
    perm = torch.randperm(num_blocks - 1, device=device)[: batch * per] + 1
    return perm.view(batch, per).to(torch.int32), num_blocks
