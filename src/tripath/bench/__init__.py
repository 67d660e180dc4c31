"""Benchmarks, tables and plots (the portability check is :mod:`tripath.portability`)."""

from __future__ import annotations

import argparse


def require_gpu(parser: argparse.ArgumentParser) -> None:
    """Exit with status 2 and a usage message when no CUDA or ROCm GPU is visible (GPU-only commands)."""
    import torch

    if not torch.cuda.is_available():
        parser.error("needs a GPU (CUDA or ROCm) and none is visible; on a CPU, `tripath bench` runs every "
                     "backend in Triton's interpreter")


def device_argument(text: str):
    """``--device`` of the benchmarks: ``cpu``, ``cuda`` or ``cuda:N`` (an existing GPU)."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r} is not supported; supported: cpu, cuda, cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r} needs a GPU (CUDA or ROCm) and none is visible; "
                                             "use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def emit_report(text: str, out: str | None) -> None:
    """Print a benchmark's markdown report and, when ``out`` is given, also write it to that file."""
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
