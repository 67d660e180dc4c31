"""The one place where launchers start Triton kernels.

Every launcher calls :func:`launch` instead of ``kernel[grid](...)``. Inside :func:`capture_launches` the
call is recorded rather than run, which lets the portability check compile exactly the kernels, argument
types, constexprs and launch options that the launchers choose, for any target, without a GPU, and lets
the engine's warm-up find which kernel variants a step needs (:func:`launch_key`).
:func:`compiled_variants` counts the variants this process has compiled so far. Inside
:func:`tripath.triton_internals.replay.record_launches` each launch runs and is kept, so that it can be made again
cheaply with some tensor arguments swapped (one layer's attention replayed for the next layers of a step).
:func:`use_triton` decides whether an op runs its Triton kernel at all.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from tripath import _env
from tripath.triton_internals import interpreter, versions



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


_captures: list[tuple[list, Callable | None]] = []  # (records, keep) of each capture_launches


class _ThreadRecordings(threading.local):
    """The recordings in progress on this thread (:func:`tripath.triton_internals.replay.record_launches`): only this
    thread's launches belong to them, whatever other engines in the process launch meanwhile."""

    def __init__(self):
        self.active: list = []


thread_recordings = _ThreadRecordings()   # record_launches pushes and pops its recording here


def launch(kernel: Callable, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Launch ``kernel`` on ``grid`` (or record it inside :func:`capture_launches`; run and record it inside
    :func:`record_launches`)."""
    grid = tuple(int(g) for g in grid)
    if _captures:
        records, keep = _captures[-1]
        record = LaunchRecord(kernel, grid, args, kwargs)
        records.append(record if keep is None else keep(record))
        return
    if min(grid) <= 0:
        return
    if not thread_recordings.active:
        kernel[grid](*args, **kwargs)
        return
    from torch.utils._python_dispatch import _disable_current_modes

    recording = thread_recordings.active[-1]
    # the interpreter's own tensor work is not the recorded code's
    with _disable_current_modes() if recording.interpreted else contextlib.nullcontext():
        recording.add(kernel, grid, args, kwargs, kernel[grid](*args, **kwargs))


@contextlib.contextmanager
def capture_launches(keep: Callable[[LaunchRecord], Any] | None = None) -> Iterator[list]:
    """Record launches instead of running them (outputs stay unwritten). ``keep``: what to list of each
    launch instead of its :class:`LaunchRecord` (e.g. :func:`launch_key`), so that the record, and with it
    the launch's tensors, is dropped at once: a long captured step then holds no more memory than one
    launch's arguments."""
    records: list = []
    _captures.append((records, keep))
    try:
        yield records
    finally:
        _captures.pop()


def use_triton(device: torch.device) -> bool:
    """Whether ops on ``device`` run their Triton kernel: on a GPU, on the CPU under ``TRITON_INTERPRET=1``
    (the interpreter made ready first: :func:`tripath.triton_internals.interpreter.ready`), and always while
    launches are being captured (the compile check)."""
    if device.type == "cuda":
        return True
    if _env.triton_interpret():
        interpreter.ready()
        return True
    return bool(_captures)


_rebuilt: dict[int, Any] = {}


def _jit_function(kernel):
    """The ``JITFunction`` behind ``kernel`` (under the interpreter, rebuilt from the decorator's arguments)."""
    if hasattr(kernel, "params"):
        return kernel
    if id(kernel) not in _rebuilt:
        _rebuilt[id(kernel)] = (kernel, versions.current().rebuild_jit_function(kernel))
    return _rebuilt[id(kernel)][1]


_specialize: tuple | None = None  # the adapter's (specialize_impl, backend), looked up once


def launch_key(record: LaunchRecord) -> tuple:
    """The variant a launch compiles to: the kernel, every argument's Triton specialisation (constexpr
    values; dtype, 16-divisibility and 1-ness of integers, 16-byte alignment of pointers, unless the kernel
    declares the argument step-varying) and the launch options. Two launches with equal keys share one
    compiled kernel; computed on the host, so it also works for recorded launches without a GPU."""
    global _specialize
    if _specialize is None:
        _specialize = versions.current().specialize_impl()
    native_specialize_impl, backend = _specialize
    fn = _jit_function(record.kernel)
    names = list(fn.signature.parameters)
    bound = fn.signature.bind_partial(*record.args, **{k: v for k, v in record.kwargs.items() if k in names})
    values = {**{p.name: p.default for p in fn.params if p.has_default}, **bound.arguments}
    spec = []
    for param in fn.params:
        value = values.get(param.name)
        if param.is_constexpr:
            spec.append(repr(value))
        else:
            spec.append(native_specialize_impl(backend, value, param.is_const, not param.do_not_specialize,
                                               not param.do_not_specialize_on_alignment))
    options = tuple(sorted((k, repr(v)) for k, v in record.kwargs.items() if k not in names))
    return (record.name, tuple(spec), options)


def compiled_variants() -> int:
    """Kernel variants compiled (or loaded from Triton's disk cache) in this process so far, over every
    tripath kernel; 0 under the interpreter, which compiles nothing."""
    adapter = versions.current()
    jit_function = adapter.jit_function_type()
    kernels = {id(obj): obj for name, module in list(sys.modules.items())
               if name.startswith("tripath.kernels.") and module is not None
               for obj in vars(module).values() if isinstance(obj, jit_function)}
    return sum(adapter.variants_in_memory(fn) for fn in kernels.values())
