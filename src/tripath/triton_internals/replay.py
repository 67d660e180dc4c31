"""Launches recorded once and made again with other tensors: one layer's attention replayed for the others.

Every attention layer of a step runs the same launches with the same metadata: only the layer's cache (and
its scales, sinks or ALiBi slopes) differ. :func:`record_launches` runs a function (the first layer's
forward), lets each Triton launch of :func:`tripath.triton_internals.launches.launch` run as usual and keeps
it: the compiled kernel, its grid, its bound arguments and the positions where the *swappable* tensors sit.
:meth:`LaunchSequence.replay` then makes the same launches with other tensors in those positions and
nothing else: no argument checks, configuration choices, binding or specialisation, a fraction of the
whole launch path's host time (docs/BENCHMARKS.md, "Measurements behind the code's choices").

A recording is refused (``None``, with the reason kept) when replaying it could differ from running the
function again:

- the function ran a PyTorch operation other than an allocation or a view that writes into a tensor (a
  copy, a fill) or reads memory not known to be the same for every layer: replaying only the launches
  would skip it. Known the same (``invariant``): the step's metadata tensors, and what operations on them
  alone return (the checks of the metadata's values on a host);
- a launch ran on another stream than the one current at the start (side streams are forked and joined by
  events the recording does not hold);
- a launch received a tensor that shares memory with a swappable one without being it (a view of the
  cache), or a tensor descriptor over one: a swap could not follow it;
- Triton's launch hooks are set (a profiler is attached), or a CUDA graph is being captured.

Watching the PyTorch operations (a dispatch mode over every operation the function runs) is most of a
recording's host cost: about as much again as the function itself. A caller that knows the function's
PyTorch work is what an earlier, watched recording of the same code path checked can record with
``watch=False``: only the launches are then kept and checked (streams, views, descriptors, hooks), and
:attr:`LaunchSequence.path` lets the caller confirm that the launches are the watched ones
(:class:`tripath.attention.ForwardContext` keys code paths by the metadata's structure).

:meth:`LaunchSequence.replay` refuses (returns False, launching nothing) when a swapped tensor differs
from the recorded one in dtype, shape, strides, device or 16-byte alignment (what the compiled kernel was
specialised on), or when the current stream is not the recorded one. Tensors allocated by the recorded
function (outputs of intermediate launches, workspaces) are kept by the sequence and reused by every
replay: replays of one sequence run in stream order, so reuse is safe.

Under ``TRITON_INTERPRET=1`` the replay launches through the interpreter with the swapped arguments (the
same launches, for tests on the CPU).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tripath.triton_internals import launches
from tripath.triton_internals import versions

_aten = torch.ops.aten
# Operations the recorded code may run on any tensor: allocations and views.
ALLOCATE_OR_VIEW = frozenset({
    _aten.empty, _aten.empty_strided, _aten.empty_like, _aten.new_empty, _aten.new_empty_strided,
    _aten.slice, _aten.select, _aten.view, _aten.alias, _aten.as_strided, _aten.unsqueeze, _aten.squeeze,
    _aten.expand, _aten.t, _aten.transpose, _aten.permute, _aten.detach, _aten._reshape_alias, _aten.split,
    _aten.split_with_sizes, _aten.unbind, _aten.narrow,
})


@dataclass
class _Launch:
    kernel: Any  # the @triton.jit function
    grid: tuple[int, int, int]
    args: list  # positional arguments as called (interpreter replays)
    kwargs: dict
    values: list | None  # every parameter's bound value, in the kernel's order (compiled replays)
    runner: Any  # the compiled kernel's (run, function, packed_metadata) (None under the interpreter)
    swaps: list[tuple[int, str, Any]]  # (swappable index, "value" | "arg" | "kwarg", position or name)


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Recording(TorchDispatchMode):
    """Watches the recorded function's PyTorch operations and collects its launches."""

    def __init__(self, swappable: Sequence[torch.Tensor | None], invariant: Sequence[torch.Tensor],
                 interpreted: bool):
        super().__init__()
        self.swappable = list(swappable)
        self.interpreted = interpreted
        self.launches: list[_Launch] = []
        self.reason: str | None = None
        self._ids = {id(t): i for i, t in enumerate(self.swappable) if t is not None}
        self._storages = {_storage_ptr(t) for t in self.swappable if t is not None and t.numel()}
        self._invariant = {_storage_ptr(t) for t in invariant if t.numel()} - self._storages
        first = next((t for t in self.swappable if t is not None), None)
        self.device = first.device if first is not None else None
        self.adapter = None if interpreted else versions.current()
        self.stream = self._current_stream()

    def _current_stream(self) -> int | None:
        if self.interpreted or self.device is None or self.device.type != "cuda":
            return None
        return self.adapter.stream_getter()(self.device.index)

    def refuse(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func.overloadpacket in ALLOCATE_OR_VIEW:
            return result
        if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
            self.refuse(f"the recorded code ran {func}, which writes into a tensor")
        elif all(self._reaches(t, self._invariant) for t in tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor) and t.numel()):
            self._invariant |= {_storage_ptr(t) for t in tree_leaves(result) if isinstance(t, torch.Tensor)
                                and t.numel()}
        else:
            self.refuse(f"the recorded code ran {func} on memory that may differ between layers")
        return result

    @staticmethod
    def _reaches(value, storages: set) -> bool:
        return isinstance(value, torch.Tensor) and value.numel() > 0 and _storage_ptr(value) in storages

    def _slots(self, values) -> list[tuple[int, Any]]:
        """``(swappable index, position)`` of each of ``values`` (an ``enumerate``) that is a swappable tensor;
        refuses a tensor or descriptor that reaches a swappable tensor's memory any other way."""
        found = []
        for at, value in values:
            if isinstance(value, torch.Tensor):
                index = self._ids.get(id(value))
                if index is not None:
                    found.append((index, at))
                    continue
            else:
                value = getattr(value, "base", None)  # a tensor descriptor's tensor
            if self._reaches(value, self._storages):
                self.refuse("a launch reads a swappable tensor through a view or a descriptor")
        return found

    def add(self, kernel, grid: tuple[int, ...], args: tuple, kwargs: dict, compiled) -> None:
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        if self.interpreted:
            swaps = [(i, "arg", p) for i, p in self._slots(enumerate(args))]
            swaps += [(i, "kwarg", k) for i, k in self._slots(kwargs.items())]
            self.launches.append(_Launch(kernel, grid3, list(args), dict(kwargs), None, None, swaps))
            return
        adapter = self.adapter
        if adapter.launch_hooks_attached():
            self.refuse("Triton launch hooks are set")
        if self._current_stream() != self.stream:
            self.refuse("a launch ran on a side stream")
        runner = adapter.compiled_launcher(compiled)
        if runner is None:
            self.refuse(f"no compiled kernel came back from {getattr(kernel, '__name__', kernel)}")
            return
        binder = adapter.binder(kernel, adapter.current_device())
        values = list(binder(*args, **kwargs)[0].values())
        swaps = [(i, "value", p) for i, p in self._slots(enumerate(values))]
        self.launches.append(_Launch(kernel, grid3, [], {}, values, runner, swaps))


class LaunchSequence:
    """The launches of one recorded call (:func:`record_launches`), to be made again by :meth:`replay`."""

    def __init__(self, recording: _Recording):
        self._launches = recording.launches
        self._swappable = recording.swappable
        self._stream = recording.stream
        self._interpreted = recording.interpreted
        self._aligned = [t is not None and t.data_ptr() % 16 == 0 for t in self._swappable]
        self._device_index = recording.device.index if recording.device is not None else None
        self._runs = [launch.runner for launch in self._launches]
        self._stream_of = recording.adapter.stream_getter() if recording.adapter is not None else None

    def __len__(self) -> int:
        return len(self._launches)

    @property
    def path(self) -> tuple:
        """The kernels launched, in order, with the argument positions of the swappable tensors: what two
        recordings of one code path share whatever the step's sizes (grids, integer arguments and compiled
        specialisations may differ)."""
        return tuple((launch.kernel, tuple(launch.swaps)) for launch in self._launches)

    def compatible(self, swaps: Sequence[torch.Tensor | None]) -> bool:
        """Whether ``swaps`` can stand in for the recorded swappable tensors, position by position."""
        if len(swaps) != len(self._swappable):
            return False
        for new, old, aligned in zip(swaps, self._swappable, self._aligned):
            if old is None or new is None:
                if (old is None) != (new is None):
                    return False
                continue
            if (new.dtype != old.dtype or new.shape != old.shape or new.stride() != old.stride()
                    or new.device != old.device or (new.data_ptr() % 16 == 0) != aligned):
                return False
        return True

    def replay(self, swaps: Sequence[torch.Tensor | None]) -> bool:
        """Make the recorded launches again with ``swaps[i]`` in place of swappable tensor ``i``; False (and
        nothing launched) when the swaps or the current stream do not match the recording."""
        if not self.compatible(swaps):
            return False
        if self._interpreted:
            for launch in self._launches:
                args, kwargs = list(launch.args), dict(launch.kwargs)
                for index, where, at in launch.swaps:
                    (args if where == "arg" else kwargs)[at] = swaps[index]
                launch.kernel[launch.grid](*args, **kwargs)
            return True
        stream = self._stream_of(self._device_index)
        if stream != self._stream:
            return False
        for launch, (run, function, packed) in zip(self._launches, self._runs):
            values = launch.values
            if launch.swaps:
                values = list(values)
                for index, _, at in launch.swaps:
                    values[at] = swaps[index]
            g0, g1, g2 = launch.grid
            run(g0, g1, g2, stream, function, packed, None, None, None, *values)
        return True


def record_launches(fn: Callable[[], Any], swappable: Sequence[torch.Tensor | None],
                    invariant: Sequence[torch.Tensor] = (), *,
                    watch: bool = True) -> tuple[Any, LaunchSequence | None, str | None]:
    """Run ``fn()`` and record its launches: ``(fn's result, the sequence, None)``, or ``(result, None,
    reason)`` when the recording cannot be replayed (module docstring). ``swappable``: the tensors a replay
    may swap (None entries stay None); ``invariant``: tensors the same for every replay, which no launch
    writes (the step's metadata), so the recorded code may read them. ``watch=False``: do not watch
    ``fn``'s PyTorch operations (the caller vouches for them, module docstring); ``invariant`` is unused."""
    first = next((t for t in swappable if t is not None), None)
    interpreted = first is None or first.device.type != "cuda"
    recording = _Recording(swappable, invariant if watch else (), interpreted)
    if not interpreted and torch.cuda.is_current_stream_capturing():
        return fn(), None, "a CUDA graph is being captured"
    launches.thread_recordings.active.append(recording)
    try:
        with recording if watch else contextlib.nullcontext():
            result = fn()
    finally:
        launches.thread_recordings.active.pop()
    if recording.reason is None and not recording.launches:
        recording.refuse("nothing was launched")
    if recording.reason is not None:
        return result, None, recording.reason
    return result, LaunchSequence(recording), None


def warm_up_recording() -> None:
    """Set up what a first recording would otherwise set up on a request's time: PyTorch initialises its
    dispatch-mode machinery on first use (a long pause for the first recording of a process, then a short
    one for each kind of operation's first pass through the mode). Records an allocation and a view, in
    inference mode as the engine runs."""
    with torch.inference_mode():
        x = torch.empty(4)
        record_launches(lambda: torch.empty(1)[:1] if x[1:].numel() else None, [x])
