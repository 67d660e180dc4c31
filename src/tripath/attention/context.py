"""The per-step handle a model's attention layers call: backend + metadata + one cache per layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tripath import _env
from tripath.attention.calibration import calibrate_kv_scales, calibrate_mla_scale
from tripath.attention.metadata import AttentionMetadata
from tripath.attention.spec import MLALayerWeights
from tripath.attention.validate import MetadataError, cache_geometry, validate_metadata

if TYPE_CHECKING:  # the backends (and their kernels) load only when a backend is selected
    from tripath.attention.backends.base import AttentionBackend


@dataclass
class ForwardContext:
    """``attend``/``attend_mla`` route layer ``i``'s tensors to the backend with ``caches[i]``.

    ``calibrate_kv_scales``: before writing, set each fp8 cache's scales from this step's keys and values
    (:mod:`tripath.attention.calibration`); the engine does this on its first step when asked to.

    ``validate`` (None: ``TRIPATH_VALIDATE=1``): on construction, check the metadata against the caches
    (:func:`tripath.attention.validate.validate_metadata`; host syncs) and raise
    :class:`~tripath.attention.validate.MetadataError` before any kernel could read or write out of bounds.
    """

    backend: "AttentionBackend"
    metadata: AttentionMetadata
    caches: list
    calibrate_kv_scales: bool = False
    validate: bool | None = None

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
               window_left: int | None = None) -> torch.Tensor:
        """``q [T, Hq, D]``, ``k [T, Hkv, D]``, ``v [T, Hkv, Dv]`` → ``[T, Hq, Dv]`` (k/v written to the cache).
        ``window_left``: this layer's window where layers differ (−1: full attention; None: the spec's)."""
        if not self.backend.capabilities.mha:
            raise TypeError(f"backend {self.backend.name!r} serves MLA models only: MLA layers call attend_mla")
        if self.calibrate_kv_scales:
            calibrate_kv_scales(self.caches[layer_idx], k, v)
        return self.backend.forward(q, k, v, self.caches[layer_idx], self.metadata, alibi_slopes=alibi_slopes,
                                    sinks=sinks, window_left=window_left)

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
