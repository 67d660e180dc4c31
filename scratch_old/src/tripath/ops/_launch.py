"""The one place where launchers start Triton kernels.

Every launcher calls :func:`launch` instead of ``kernel[grid](...)``. Inside :func:`capture_launches` the
call is recorded rather than run, which lets the portability check compile exactly the kernels, argument
types, constexprs and launch options that the launchers choose, for any target, without a GPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from tripath import _env

LAUNCH_OPTIONS = ("num_warps", "num_stages", "waves_per_eu", "matrix_instr_nonkdim", "kpack", "num_ctas")


@dataclass
class LaunchRecord:
    """One recorded launch: the ``@triton.jit`` function, its grid, arguments and options."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__ if hasattr(self.kernel, "fn") else self.kernel.__name__


_captures: list[list[LaunchRecord]] = []


def launch(kernel: Callable, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Launch ``kernel`` on ``grid`` (or record it inside :func:`capture_launches`)."""
    grid = tuple(int(g) for g in grid)
    if _captures:
        _captures[-1].append(LaunchRecord(kernel, grid, args, kwargs))
        return
    if min(grid) <= 0:
        return
    kernel[grid](*args, **kwargs)


@contextlib.contextmanager
def capture_launches() -> Iterator[list[LaunchRecord]]:
    """Record launches instead of running them (outputs stay unwritten)."""
    records: list[LaunchRecord] = []
    _captures.append(records)
    try:
        yield records
    finally:
        _captures.pop()


def use_triton(device: torch.device) -> bool:
    """Whether ops on ``device`` run their Triton kernel: on a GPU, on the CPU under ``TRITON_INTERPRET=1``,
    and always while launches are being captured (the compile check)."""
    return device.type == "cuda" or _env.triton_interpret() or bool(_captures)
