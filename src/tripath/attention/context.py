"""The per-step handle a model's attention layers call: backend + metadata + one cache per layer.

:class:`AttentionContext` is the contract a model's layers see (``attend`` for MHA / GQA layers,
``attend_mla`` for MLA layers); :class:`ForwardContext` is the implementation that runs the backend. The
engine's stand-ins implement the same two calls: the warm-up's recording context
(:mod:`tripath.engine.runner.warmup`) and the piecewise graphs' capturing context (:mod:`tripath.engine.runner.mixed_graphs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from tripath import _env
from tripath.attention.calibration import calibrate_kv_scales, calibrate_mla_scale
from tripath.attention.layer_replay import MIN_LAYERS_TO_REPLAY, LayerReplay, WatchedPaths
from tripath.attention.metadata import AttentionMetadata
from tripath.attention.spec import MLALayerWeights
from tripath.attention.validate import MetadataError, cache_geometry, validate_metadata


class AttentionContext(Protocol):
    """What a model's attention layers call, once per layer and step."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
               window_left: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """MHA / GQA: ``q [T, Hq, D]``, ``k [T, Hkv, D]``, ``v [T, Hkv, Dv]`` → ``[T, Hq, Dv]``; k / v are
        written to layer ``layer_idx``'s cache."""

    def attend_mla(self, layer_idx: int, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                   k_pe: torch.Tensor, positions: torch.Tensor, weights: MLALayerWeights) -> torch.Tensor:
        """MLA: ``q_nope [T,H,P]``, unrotated ``q_pe [T,H,R]``, ``kv_c [T,L]``, unrotated ``k_pe [T,R]`` →
        ``[T, H, V]``."""


class BackendCapabilities(Protocol):
    """The part of a backend's ``Capabilities`` that :class:`ForwardContext` reads."""

    @property
    def mha(self) -> bool: ...

    @property
    def mla(self) -> bool: ...

    @property
    def needs_triton(self) -> bool: ...


class StepBackend(Protocol):
    """What :class:`ForwardContext` calls on its backend: ``forward`` on an MHA / GQA backend, ``forward_mla``
    on an MLA one, as its ``capabilities`` say. The backends
    (:class:`tripath.attention.backends.base.AttentionBackend`) are above this package and import it, never
    the reverse: a backend's module (and its kernels) loads only when the backend is selected."""

    @property
    def name(self) -> str: ...

    @property
    def capabilities(self) -> BackendCapabilities: ...

    def begin_pass(self, meta: AttentionMetadata) -> None: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, meta: AttentionMetadata, *,
                alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                out: torch.Tensor | None = None, window_left: int | None = None) -> torch.Tensor: ...

    def forward_mla(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                    positions: torch.Tensor, cache, meta: AttentionMetadata, weights: MLALayerWeights,
                    *, out: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass
class ForwardContext:
    """``attend``/``attend_mla`` route layer ``i``'s tensors to the backend with ``caches[i]``.

    ``calibrate_kv_scales``: before writing, set each fp8 cache's scales from this step's keys and values
    (:mod:`tripath.attention.calibration`); the engine does this on its first step when asked to.

    ``validate`` (None: ``TRIPATH_VALIDATE=1``): on construction, check the metadata against the caches
    (:func:`tripath.attention.validate.validate_metadata`; host syncs) and raise
    :class:`~tripath.attention.validate.MetadataError` before any kernel could read or write out of bounds.

    ``replay_launches``: MHA layers whose tensors are the same memory as an earlier layer's of this step (the
    piecewise CUDA graphs' static buffers) make that layer's Triton launches again with their own cache
    swapped in, instead of running the backend's forward (:mod:`tripath.attention.layer_replay`); models of
    fewer than ``MIN_LAYERS_TO_REPLAY`` layers, side streams and the calibration step always run the forward.
    ``watched``: the :class:`~tripath.attention.layer_replay.WatchedPaths` the caller keeps across steps (the
    engine keeps one), so later steps on a known code path record without watching. :attr:`replay_refusals`
    lists why each refused recording of the context was refused.

    Before the first MHA layer of each forward pass (the first call, and every call whose layer already
    attended: the next pass on this context, as multi-step decoding and graph captures make) the context
    calls the backend's ``begin_pass(metadata)``, where a backend does the step's work its layers share.
    """

    backend: StepBackend
    metadata: AttentionMetadata
    caches: list
    calibrate_kv_scales: bool = False
    validate: bool | None = None
    replay_launches: bool = True
    watched: "WatchedPaths | None" = None
    _replay: "LayerReplay | None" = field(default=None, init=False, repr=False)
    _pass_layers: set = field(default_factory=set, init=False, repr=False)   # the MHA layers of this pass

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
        if not self._pass_layers or layer_idx in self._pass_layers:
            self._pass_layers.clear()
            self.backend.begin_pass(self.metadata)
        self._pass_layers.add(layer_idx)
        if self.calibrate_kv_scales:
            calibrate_kv_scales(cache, k, v)

        def forward():
            return self.backend.forward(q, k, v, cache, self.metadata, alibi_slopes=alibi_slopes, sinks=sinks,
                                        window_left=window_left, out=out)

        if out is None or not self.replay_launches or self.calibrate_kv_scales or \
                not self.backend.capabilities.needs_triton or len(self.caches) < MIN_LAYERS_TO_REPLAY:
            return forward()
        if self._replay is None:
            self._replay = LayerReplay(self.metadata, self.watched)
        return self._replay.attend(layer_idx, forward, q, k, v, out, cache, window_left, alibi_slopes, sinks)

    @property
    def replay_refusals(self) -> list[str]:
        """Why each refused launch recording of this context was refused (:class:`LayerReplay`)."""
        return [] if self._replay is None else self._replay.refusals

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


