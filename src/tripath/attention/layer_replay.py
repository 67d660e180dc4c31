"""Launch replay of a step's attention layers: the first MHA layer of a step records its Triton launches,
the others make them again with their own cache, scales, sinks and ALiBi slopes swapped in
(:mod:`tripath.triton_internals.replay`), instead of re-running the backend's host work of choosing them.

A layer replays the recording of an earlier layer of the same step whose ``q`` / ``k`` / ``v`` / ``out``
are the same memory, shapes and strides (the piecewise CUDA graphs' static buffers) with the same options;
a layer that attends a second time (the next model step on the same context) starts the recordings over.
Where a forward cannot be replayed (side streams, PyTorch arithmetic in the forward) the recording is
refused and every layer runs it; the reasons are kept (:attr:`LayerReplay.refusals`).

Watched recordings: recording normally watches every PyTorch operation of the first layer's forward (about
half its host cost) to prove the launches are all it does. :class:`WatchedPaths`, kept by the engine across
steps, notes each *code path* whose watched recording was found replayable, with the kernel sequences it
launched. A code path is the metadata's structure (:func:`metadata_structure`: which parts are set, a
tensor's dtype, a flag's value, a list's length; not the sizes, which change every step) with the layouts
and dtypes of the layer's tensors and options. A later step on a noted path records without watching and
replays only if it launched one of the noted kernel sequences (sizes can change the sequence: a split decode
adds its reduction); otherwise every layer of that step runs its forward and the next step on the path
watches, noting its sequence too.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from tripath.attention.planner import BatchPlan

# A recording costs about one more forward's host time and each replay saves most of one, so replaying pays
# from the third layer (docs/BENCHMARKS.md, "Measurements behind the code's choices").
MIN_LAYERS_TO_REPLAY = 3


class LayerReplay:
    """The recordings of one step's layers (one :class:`~tripath.attention.ForwardContext`)."""

    def __init__(self, metadata, watched: "WatchedPaths | None"):
        self.metadata = metadata
        self.watched = watched
        self.refusals: list[str] = []
        self._recorded: dict = {}
        self._attended: set = set()
        self._structure: tuple | None = None

    def attend(self, layer_idx: int, forward: Callable[[], torch.Tensor], q, k, v, out, cache, window_left,
               alibi_slopes, sinks) -> torch.Tensor:
        """Layer ``layer_idx``'s result into ``out``: replayed when an earlier layer's recording matches,
        else ``forward()`` (recorded when it is the first of its kind this step)."""
        if layer_idx in self._attended:  # a new model step on this context: its first layer records again
            self._attended.clear()
            self._recorded.clear()
        self._attended.add(layer_idx)
        key = (_layout(q), _layout(k), _layout(v), _layout(out), window_left, alibi_slopes is None, sinks is None)
        swaps = (cache.k_cache, cache.v_cache, cache.k_scale, cache.v_scale, alibi_slopes, sinks)
        recorded = self._recorded.get(key)
        if recorded is None:
            result, sequence, reason = self._record(forward, key, swaps, cache.layout)
            self._recorded[key] = sequence or False
            if sequence is None:
                self.refusals.append(reason)
            return result
        if recorded is not False and recorded.replay(swaps):
            return out
        return forward()

    def _record(self, forward, key: tuple, swaps: tuple, cache_layout: str):
        """Run ``forward`` recording its launches (``record_launches``' result), watching its PyTorch
        operations unless ``watched`` notes its code path. ``key``: the layer's ``_layout`` of q, k, v and
        out, then its options."""
        from tripath.triton_internals import record_launches

        path = None
        if self.watched is not None:
            if self._structure is None:
                self._structure = metadata_structure(self.metadata)
            strides_and_dtypes = tuple(layout[2:] for layout in key[:4])  # sizes and memory change every step
            path = (self._structure, strides_and_dtypes, key[4:], _form(swaps), cache_layout)
        if path is None or self.watched.must_watch(path):
            result, sequence, reason = record_launches(forward, swaps, invariant=metadata_tensors(self.metadata))
            if sequence is not None and path is not None:
                self.watched.note(path, sequence.path)
            return result, sequence, reason
        result, sequence, reason = record_launches(forward, swaps, watch=False)
        if sequence is not None and not self.watched.knows(path, sequence.path):
            return result, None, "the launches differ from those of the watched recordings of this code path"
        return result, sequence, reason


class WatchedPaths:
    """The code paths of an engine's steps whose launch recordings were watched and found replayable, each
    with the kernel sequences (:attr:`~tripath.triton_internals.replay.LaunchSequence.path`) they launched
    (:class:`~tripath.attention.ForwardContext`'s ``watched``)."""

    def __init__(self):
        self.launches: dict[tuple, set] = {}
        self._rewatch: set = set()

    def __len__(self) -> int:
        return len(self.launches)

    def must_watch(self, path: tuple) -> bool:
        """Whether the next recording on ``path`` watches: never watched, or a step on it launched an unknown
        kernel sequence."""
        return path not in self.launches or path in self._rewatch

    def note(self, path: tuple, launches: tuple) -> None:
        """A watched recording on ``path`` launched ``launches`` and was found replayable."""
        self.launches.setdefault(path, set()).add(launches)
        self._rewatch.discard(path)

    def knows(self, path: tuple, launches: tuple) -> bool:
        """Whether a watched recording on ``path`` launched ``launches``; if not, the next one watches."""
        if launches in self.launches.get(path, ()):
            return True
        self._rewatch.add(path)
        return False


def metadata_tensors(value) -> list[torch.Tensor]:
    """Every tensor in the metadata ``value``: its fields, its parts' (dataclasses) and lists of them. The
    plan holds no tensors and is skipped."""
    found = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(x for x in item if not isinstance(x, (int, float)))
        elif dataclasses.is_dataclass(item) and not isinstance(item, (type, BatchPlan)):
            stack.extend(vars(item).values())
    return found


def metadata_structure(value) -> tuple:
    """What of the metadata ``value`` decides which code a backend's forward runs, as a hashable tuple: its
    type and, field by field (parts and lists of parts recursively), whether it is set, a tensor's dtype
    and number of dimensions, a flag's value, a list's length. Sizes and counts (ints, floats) are left
    out: they change from step to step without changing the code path. The plan is skipped: the parts'
    presence carries its phases."""
    if value is None:
        return (None,)
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.dim())
    if isinstance(value, bool):
        return (value,)
    if isinstance(value, (int, float)):
        return ("number",)
    if isinstance(value, (list, tuple)):
        return (len(value), *(metadata_structure(item) for item in value))
    if isinstance(value, BatchPlan):
        return ("plan",)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value), *(metadata_structure(getattr(value, f.name)) for f in dataclasses.fields(value)))
    return (type(value), value)


def _form(tensors) -> tuple:
    """The dtypes and strides of ``tensors`` (None kept): a layer's caches, scales and options."""
    return tuple(None if t is None else (t.dtype, t.stride()) for t in tensors)


def _layout(t: torch.Tensor) -> tuple:
    """What a replayed launch assumes of a tensor it reuses: its memory, shape, strides and dtype."""
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype
