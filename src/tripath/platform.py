"""The GPU (or CPU) that kernels are launched for, and the per-platform choices that depend on it.

Launchers ask :func:`current_platform` for the target instead of probing torch themselves, so the
portability check (``tripath check-compile``) can make them choose AMD or NVIDIA launch configurations on
any machine with :func:`override_platform`. The fp8 dtype of each platform is chosen here and nowhere else.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Iterator

import torch



@dataclass(frozen=True)
class Platform:
    """A compile/launch target.

    ``backend`` is ``"cuda"``, ``"hip"`` or ``"cpu"``; ``arch`` is the compute capability as an int for CUDA
    (``90`` for Hopper) or the gfx name for AMD (``"gfx942"`` for MI300X/MI325X, ``"gfx950"`` for MI355X);
    ``warp_size`` is 32 on NVIDIA and 64 on AMD CDNA; ``num_sms`` counts streaming multiprocessors / compute
    units (used to size split-KV grids).
    """

    backend: str
    arch: int | str
    warp_size: int
    num_sms: int

    @property
    def is_hip(self) -> bool:
        return self.backend == "hip"

    @property
    def is_cuda(self) -> bool:
        return self.backend == "cuda"

    @property
    def is_hopper(self) -> bool:
        return self.is_cuda and self.arch == 90


# Representative targets for the portability check and for launch-config selection on the CPU.
H200 = Platform("cuda", 90, 32, 132)
MI300X = Platform("hip", "gfx942", 64, 304)
MI355X = Platform("hip", "gfx950", 64, 256)
CPU = Platform("cpu", "cpu", 32, 1)

_override: list[Platform] = []


@functools.lru_cache(maxsize=None)
def _detect(device_index: int) -> Platform:
    props = torch.cuda.get_device_properties(device_index)
    if torch.version.hip is not None:
        arch = getattr(props, "gcnArchName", "gfx942").split(":")[0]
        return Platform("hip", arch, 64, props.multi_processor_count)
    return Platform("cuda", props.major * 10 + props.minor, 32, props.multi_processor_count)


def current_platform(device: torch.device | None = None) -> Platform:
    """The platform kernels launched on ``device`` target (an override wins; CPU tensors → :data:`CPU`,
    which launchers treat like an H200 for tile choices so the interpreter runs the NVIDIA configuration)."""
    if _override:
        return _override[-1]
    if device is not None and device.type == "cuda":
        return _detect(device.index if device.index is not None else torch.cuda.current_device())
    return CPU


@contextlib.contextmanager
def override_platform(platform: Platform) -> Iterator[Platform]:
    """Make launchers choose configurations for ``platform`` (used by the compile check)."""
    _override.append(platform)
    try:
        yield platform
    finally:
        _override.pop()


def fp8_dtype(platform: Platform | None = None) -> torch.dtype:
    """The e4m3 dtype of a platform: ``float8_e4m3fnuz`` on gfx942 (MI300), ``float8_e4m3fn`` elsewhere."""
    platform = platform or current_platform(torch.device("cuda") if torch.cuda.is_available() else None)
    if platform.is_hip and platform.arch == "gfx942":
        return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 dtype (448 for e4m3fn, 240 for e4m3fnuz)."""
    return float(torch.finfo(dtype).max)
