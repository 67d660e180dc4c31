"""The per-step handle a model's attention layers call: backend + metadata + one cache per layer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tripath import _env
from tripath.attention.calibration import calibrate_kv_scales, calibrate_mla_scale
from tripath.attention.metadata import AttentionMetadata
from tripath.attention.planner import BatchPlan
from tripath.attention.spec import MLALayerWeights
from tripath.attention.validate import MetadataError, cache_geometry, validate_metadata

if TYPE_CHECKING:  # the backends (and their kernels) load only when a backend is selected
    from tripath.attention.backends.base import AttentionBackend


# A recording costs about one more forward's host time and each replay saves most of one, so replaying pays
# from the third layer (H200 host, mha-tp8 mixed step: forward 0.88 ms, recording 1.92 ms, replay 0.08 ms).
MIN_LAYERS_TO_REPLAY = 3


@dataclass
class ForwardContext:
    """``attend``/``attend_mla`` route layer ``i``'s tensors to the backend with ``caches[i]``.

    ``calibrate_kv_scales``: before writing, set each fp8 cache's scales from this step's keys and values
    (:mod:`tripath.attention.calibration`); the engine does this on its first step when asked to.

    ``validate`` (None: ``TRIPATH_VALIDATE=1``): on construction, check the metadata against the caches
    (:func:`tripath.attention.validate.validate_metadata`; host syncs) and raise
    :class:`~tripath.attention.validate.MetadataError` before any kernel could read or write out of bounds.

    ``replay_launches``: an MHA layer called with ``out`` whose ``q``/``k``/``v``/``out`` are the same
    memory, shapes and strides as an earlier layer's of this step (the piecewise CUDA graphs' static buffers)
    makes that layer's Triton launches again with its own cache, scales, sinks and ALiBi slopes swapped in
    (:mod:`tripath.triton_internals.replay`), instead of running the backend's forward: the same kernels on the same
    metadata, without the host work of choosing them. The first such layer of a step records; a layer that
    attends a second time (the next model step on this context) starts over. Where a forward cannot be
    replayed (side streams, PyTorch arithmetic in the forward, the calibration step) every layer runs it;
    models of fewer than ``MIN_LAYERS_TO_REPLAY`` layers never record. :attr:`replay_refusals` lists why
    each refused recording of the context was refused.

    ``watched``: the :class:`WatchedPaths` the caller keeps across steps (the engine keeps one), in which
    the context notes each code path whose recording, watching every PyTorch operation, was found
    replayable, with the kernels it launched. A code path is the metadata's structure
    (:func:`metadata_structure`: which parts are set, a tensor's dtype, a flag's value, a list's length;
    not the sizes, which change every step) with the layouts and dtypes of the layer's tensors and
    options. A later step on a noted path records without watching (about half the recording's host
    time, :mod:`tripath.triton_internals.replay`) and replays only if it launched one of the noted kernel sequences
    (sizes can change the sequence: a split decode adds its reduction); otherwise every layer of that
    step runs its forward and the next step on the path watches, noting its sequence too. None: every
    recording watches.
    """

    backend: "AttentionBackend"
    metadata: AttentionMetadata
    caches: list
    calibrate_kv_scales: bool = False
    validate: bool | None = None
    replay_launches: bool = True
    watched: "WatchedPaths | None" = None
    replay_refusals: list[str] = field(default_factory=list, init=False, repr=False)
    _recorded: dict = field(default_factory=dict, init=False, repr=False)
    _attended: set = field(default_factory=set, init=False, repr=False)
    _structure: tuple | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.validate is False or (self.validate is None and not _env.validate()):
            return
        if not self.caches:
            raise MetadataError("caches is empty: a ForwardContext needs one cache per attention layer")
        geometry = {cache_geometry(c) for c in self.caches}
        if len(geometry) != 1:
            raise MetadataError(f"the layers' caches differ in (num_blocks, block_size): {sorted(geometry)}")
        validate_metadata(self.metadata, *geometry.pop())

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
               window_left: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """``q [T, Hq, D]``, ``k [T, Hkv, D]``, ``v [T, Hkv, Dv]`` → ``[T, Hq, Dv]`` (k/v written to the cache;
        into ``out`` when given). ``window_left``: this layer's window where layers differ (−1: full
        attention; None: the spec's)."""
        if not self.backend.capabilities.mha:
            raise TypeError(f"backend {self.backend.name!r} serves MLA models only: MLA layers call attend_mla")
        cache = self.caches[layer_idx]
        if self.calibrate_kv_scales:
            calibrate_kv_scales(cache, k, v)

        def forward():
            return self.backend.forward(q, k, v, cache, self.metadata, alibi_slopes=alibi_slopes, sinks=sinks,
                                        window_left=window_left, out=out)

        if out is None or not self.replay_launches or self.calibrate_kv_scales or \
                not self.backend.capabilities.needs_triton or len(self.caches) < MIN_LAYERS_TO_REPLAY:
            return forward()
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
                self.replay_refusals.append(reason)
            return result
        if recorded is not False and recorded.replay(swaps):
            return out
        return forward()

    def _record(self, forward, key: tuple, swaps: tuple, cache_layout: str):
        """Run ``forward`` recording its launches (``record_launches``' result), watching its PyTorch
        operations unless ``watched`` notes its code path (the class doc). ``key``: the layer's
        ``_layout`` of q, k, v and out, then its options."""
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

    def attend_mla(self, layer_idx: int, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                   k_pe: torch.Tensor, positions: torch.Tensor, weights: MLALayerWeights) -> torch.Tensor:
        """MLA: ``q_nope [T,H,P]``, unrotated ``q_pe [T,H,R]``, ``kv_c [T,L]``, unrotated ``k_pe [T,R]`` →
        ``[T, H, V]``."""
        if not self.backend.capabilities.mla:
            raise TypeError(f"backend {self.backend.name!r} serves MHA/GQA models only: their layers call attend")
        if self.calibrate_kv_scales:
            calibrate_mla_scale(self.caches[layer_idx], kv_c, k_pe)
        return self.backend.forward_mla(q_nope, q_pe, kv_c, k_pe, positions, self.caches[layer_idx],
                                        self.metadata, weights)


class WatchedPaths:
    """The code paths of an engine's steps whose launch recordings were watched and found replayable, each
    with the kernel sequences (:attr:`~tripath.triton_internals.replay.LaunchSequence.path`) they launched
    (:class:`ForwardContext`'s ``watched``)."""

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
