"""A backend = a capability declaration, a metadata builder and a forward.

:class:`AttentionBackend` holds what every backend shares: the capability check, the cache dtype, the
step's plan and metadata. A backend then implements one interface or both:

- :class:`MHAAttentionBackend` (MHA/GQA models): a paged K/V cache (:class:`KVCache`) and
  ``forward(q, k, v, cache, meta)``;
- :class:`MLAAttentionBackend` (MLA models): a latent cache (:class:`MLACache`) and
  ``forward_mla(q_nope, q_pe, kv_c, k_pe, positions, cache, meta, weights)``.

:meth:`AttentionBackend.unsupported_reasons` checks a spec and a device against the declaration and
returns why the backend cannot serve them (empty = it can); selection keeps those reasons so ``auto``
can explain itself.
"""

from __future__ import annotations

import enum

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from tripath import _env
from tripath.attention.metadata import AttentionMetadata, ExtendMetadata, build_metadata
from tripath.attention.step_ints import StepInts, add_common_ints
from tripath.attention.planner import BatchPlan, plan_batch
from tripath.attention.spec import AttentionSpec, KVCache, MLACache, MLALayerWeights
from tripath.constants import BLOCK_SIZES, DEFAULT_BLOCK_SIZE, MAX_HEAD_SIZE, MIN_HEAD_SIZE
from tripath.ops import merge_states
from tripath.ops.kv_cache import allocate_kv_cache, write_kv_cache
from tripath.platform import fp8_dtype, current_platform

ALL_FEATURES = frozenset({"window", "softcap", "alibi", "sinks", "fp8_kv"})


def attend_joined_chunks(e: ExtendMetadata, attend: Callable[..., object], out: torch.Tensor) -> None:
    """The extends' context chunks with the last one joined to their new tokens (``e.tail``).

    ``attend(chunk, causal=..., out=None)`` gathers one chunk and attends the extends' queries to it,
    returning ``(part, lse)``, or writing into ``out`` when given. Chunks before the last run non-causal
    and merge by LSE; the tail runs causal and, when it is the only chunk, writes ``out`` directly."""
    acc = lse = None
    for chunk in e.chunks[:-1]:
        part, part_lse = attend(chunk, causal=False)
        acc, lse = (part, part_lse) if acc is None else merge_states(acc, lse, part, part_lse)
    if acc is None:
        attend(e.tail, causal=True, out=out)
        return
    part, part_lse = attend(e.tail, causal=True)
    merge_states(acc, lse, part, part_lse, out=out)


class GraphSupport(enum.Enum):
    """Which of a backend's steps can be captured in a CUDA graph and replayed on other steps' metadata."""

    NONE = "none"      # the forward reads the step's host values (the plan's lists): never captured
    DECODE = "decode"  # a decode-only forward reads only device tensors: captured once, replayed after
                       # AttentionMetadata.copy_ (and advanced on the device for multi-step decoding)
    ALL = "all"        # DECODE, and every forward reads only the metadata's common tensors, its launches
                       # sized by the step's token and request counts alone: whole steps with prompt tokens
                       # are captured per token bucket and replayed after AttentionMetadata.copy_padded_


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports. ``needs_triton``: its kernels need a GPU or ``TRITON_INTERPRET=1``;
    ``graphs``: which steps it lets the engine capture (:class:`GraphSupport`); ``verify_graphs``: with
    ``graphs`` at ``DECODE``, its forward of a step whose requests all sit in the decode slice as verifies of
    ``decode_threshold`` tokens each (speculative decoding's steps, padded) reads only device tensors too, so
    the engine may capture those steps (:mod:`tripath.engine.runner.verify_graphs`); ``draft_trees``: its verify
    route (MHA, verifies in the decode slice) reads ``metadata.decode.verify.tree_mask`` (speculative
    decoding's draft trees).

    Block sizes (KV cache rows per block): ``block_sizes`` are the ones the backend takes (a spec with
    another is refused); ``cpu_block_size`` / ``gpu_block_size`` the one it prefers on the CPU / on a GPU,
    which the engine builds its spec with when it is given none
    (:meth:`AttentionBackend.preferred_block_size`, :func:`tripath.attention.selector.default_block_size`).
    """

    head_sizes: tuple[int, int] = (MIN_HEAD_SIZE, MAX_HEAD_SIZE)
    dtypes: frozenset = frozenset({torch.float16, torch.bfloat16, torch.float32})
    layouts: frozenset = frozenset({"nhd", "shuffled"})
    features: frozenset = ALL_FEATURES
    mha: bool = True
    mla: bool = False
    needs_triton: bool = True
    graphs: GraphSupport = GraphSupport.DECODE
    verify_graphs: bool = False
    draft_trees: bool = False
    max_decode_threshold: int = 64
    block_sizes: tuple[int, ...] = BLOCK_SIZES
    cpu_block_size: int = DEFAULT_BLOCK_SIZE
    gpu_block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self):
        for name in ("cpu_block_size", "gpu_block_size"):
            if getattr(self, name) not in self.block_sizes:
                raise ValueError(f"Capabilities.{name}={getattr(self, name)} is not one of block_sizes "
                                 f"{self.block_sizes}")


def _shuffled_layout_reasons(spec: AttentionSpec) -> list[str]:
    """The shuffled layout packs ``x = 16 bytes / element`` values (8 at 16 bits, 16 in fp8): the block size
    and both head sizes must be multiples of ``x``."""
    element = 1 if spec.kv_cache_dtype == "fp8" else torch.empty((), dtype=spec.dtype).element_size()
    x = 16 // element
    cache = "fp8" if element == 1 else str(spec.dtype).removeprefix("torch.")
    return [f"kv_layout 'shuffled' with a {cache} cache needs {name} a multiple of {x}, got {value}"
            for name, value in (("block_size", spec.block_size), ("head_size", spec.head_size),
                                ("v_size", spec.v_size)) if value % x]


class AttentionBackend(ABC):
    """What every backend shares: the capability check, the cache dtype, planning and metadata."""

    name: ClassVar[str] = "base"
    capabilities: ClassVar[Capabilities] = Capabilities()

    def __init__(self, spec: AttentionSpec, device: torch.device | str = "cpu"):
        self.spec = spec
        self.device = torch.device(device)
        reasons = self.unsupported_reasons(spec, self.device)
        if reasons:
            raise ValueError(f"backend {self.name!r} cannot serve this spec: " + "; ".join(reasons))

    @classmethod
    def preferred_block_size(cls, is_mla: bool, device: torch.device | str) -> int:
        """The block size to build a spec with for this backend when none is given, for an MLA model
        (``is_mla``) or an MHA/GQA one on ``device``: the declared ``gpu_block_size`` on a GPU, else
        ``cpu_block_size``."""
        caps = cls.capabilities
        return caps.gpu_block_size if torch.device(device).type == "cuda" else caps.cpu_block_size

    @classmethod
    def unsupported_reasons(cls, spec: AttentionSpec, device: torch.device) -> list[str]:
        caps = cls.capabilities
        reasons = []
        if spec.block_size not in caps.block_sizes:
            reasons.append(f"block_size={spec.block_size} is not supported (supported: "
                           f"{', '.join(map(str, caps.block_sizes))})")
        if spec.is_mla and not caps.mla:
            reasons.append("does not serve MLA models")
        if not spec.is_mla and not caps.mha:
            reasons.append("serves only MLA models")
        if not spec.is_mla:
            lo, hi = caps.head_sizes
            for size in {spec.head_size, spec.v_size}:
                if not lo <= size <= hi:
                    reasons.append(f"head size {size} outside {lo}..{hi}")
            if spec.kv_layout not in caps.layouts:
                reasons.append(f"kv_layout {spec.kv_layout!r} not supported (supported: {sorted(caps.layouts)})")
            elif spec.kv_layout == "shuffled":
                reasons += _shuffled_layout_reasons(spec)
        if spec.dtype not in caps.dtypes:
            reasons.append(f"dtype {spec.dtype} not supported")
        missing = spec.features - caps.features
        if missing:
            reasons.append(f"features not supported: {', '.join(sorted(missing))}")
        if spec.decode_threshold > caps.max_decode_threshold:
            reasons.append(f"decode_threshold {spec.decode_threshold} > {caps.max_decode_threshold}")
        if caps.needs_triton and device.type != "cuda" and not _env.triton_interpret():
            reasons.append(f"its Triton kernels need a CUDA/ROCm device or TRITON_INTERPRET=1 (device is "
                           f"{device.type})")
        if spec.dtype == torch.float32 and device.type == "cuda" and caps.needs_triton:
            reasons.append("float32 models run on the GPU only with the torch backend")
        return reasons

    # -- cache -----------------------------------------------------------------------------------------
    @property
    def cache_dtype(self) -> torch.dtype:
        if self.spec.kv_cache_dtype == "fp8":
            return fp8_dtype(current_platform(self.device))
        return self.spec.dtype

    @abstractmethod
    def cache_bytes_per_block(self) -> int:
        """Bytes of one block of one layer's cache."""

    @abstractmethod
    def allocate_cache(self, num_blocks: int, device: torch.device | str | None = None):
        """One layer's cache of ``num_blocks`` blocks (on ``device``, default the backend's)."""

    # -- per step --------------------------------------------------------------------------------------
    def plan(self, query_lens, context_lens) -> BatchPlan:
        """:func:`plan_batch` with this spec's decode threshold, chunk budget and block size."""
        spec = self.spec
        return plan_batch(query_lens, context_lens, decode_threshold=spec.decode_threshold,
                          chunk_budget=spec.extend_chunk_budget, block_size=spec.block_size)

    def step_ints(self, plan: BatchPlan) -> StepInts:
        """The step's metadata integers on the host (:mod:`tripath.attention.step_ints`): the common lists,
        then this backend's own (:meth:`add_own_ints`), for the caller to send to the device in one copy."""
        ints = add_common_ints(plan, StepInts())
        self.add_own_ints(plan, ints)
        return ints

    def add_own_ints(self, plan: BatchPlan, ints: StepInts) -> None:
        """Add the per-step integers this backend's own metadata holds to ``ints`` (named); none here."""

    def device_ints(self, plan: BatchPlan, device: torch.device, ints: StepInts | None) -> StepInts:
        """``ints`` (already on the device), or the step's integers gathered and uploaded now."""
        return self.step_ints(plan).upload(device) if ints is None else ints

    def begin_pass(self, meta: AttentionMetadata) -> None:
        """Called by :class:`~tripath.attention.ForwardContext` before the first MHA layer of each forward pass
        on ``meta``, inside any CUDA graph that captures the pass: the place for work the layers share that
        reads device values of the step (the ``mixed`` backend's work list). Nothing here."""

    def build_metadata(self, plan: BatchPlan, block_table: torch.Tensor, slot_mapping: torch.Tensor, *,
                       decode_num_splits: int | None = None, ints: StepInts | None = None) -> AttentionMetadata:
        """Once per step; every layer's forward reuses the result. ``ints``: :meth:`step_ints` of ``plan``
        placed on the device by the caller (with the step's other inputs, in one copy); None: uploaded here.
        A backend with per-step data of its own adds its integers in :meth:`add_own_ints` and overrides this
        to return a subclass of :class:`AttentionMetadata` holding views of them (built here, never in
        forward)."""
        if plan.decode_threshold != self.spec.decode_threshold:
            raise ValueError(f"the plan's decode_threshold ({plan.decode_threshold}) differs from the spec's "
                             f"({self.spec.decode_threshold})")
        return build_metadata(plan, block_table, slot_mapping, decode_num_splits=decode_num_splits,
                              ints=self.device_ints(plan, block_table.device, ints))


class MHAAttentionBackend(AttentionBackend):
    """MHA/GQA backends: a paged K/V cache per layer, the K/V write, and ``forward``."""

    def cache_bytes_per_block(self) -> int:
        """Bytes of one block of one layer's K and V."""
        elem = torch.empty((), dtype=self.cache_dtype).element_size()
        return self.spec.block_size * self.spec.num_kv_heads * (self.spec.head_size + self.spec.v_size) * elem

    def allocate_cache(self, num_blocks: int, device: torch.device | str | None = None) -> KVCache:
        """One layer's cache (scales 1.0; set ``k_scale``/``v_scale`` after calibration for fp8)."""
        device = torch.device(device) if device is not None else self.device
        spec = self.spec
        if spec.head_size != spec.v_size:
            k, _ = allocate_kv_cache(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size,
                                     dtype=self.cache_dtype, layout=spec.kv_layout, device=device)
            _, v = allocate_kv_cache(num_blocks, spec.block_size, spec.num_kv_heads, spec.v_size,
                                     dtype=self.cache_dtype, layout=spec.kv_layout, device=device)
        else:
            k, v = allocate_kv_cache(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size,
                                     dtype=self.cache_dtype, layout=spec.kv_layout, device=device)
        ones = torch.ones(1, dtype=torch.float32, device=device)
        return KVCache(k, v, spec.kv_layout, ones, ones.clone())

    def _scales(self, cache: KVCache):
        if self.spec.kv_cache_dtype == "fp8":
            return cache.k_scale, cache.v_scale
        return None, None

    def _write(self, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> None:
        k_scale, v_scale = self._scales(cache)
        write_kv_cache(k, v, cache.k_cache, cache.v_cache, meta.slot_mapping, layout=cache.layout,
                       k_scale=k_scale, v_scale=v_scale)

    def _options(self, alibi_slopes, sinks, window_left: int | None = None) -> dict:
        """The ops' keyword options for one layer. ``window_left``: this layer's window when it differs
        from the spec's (models whose layers mix sliding-window and full attention): −1 (full) is always
        allowed, a window only when the spec has one (so selection checked the backend supports it)."""
        spec = self.spec
        if spec.use_alibi and alibi_slopes is None:
            raise ValueError("the spec uses ALiBi: pass alibi_slopes [num_heads]")
        if spec.use_sinks and sinks is None:
            raise ValueError("the spec uses sinks: pass sinks [num_heads]")
        if window_left is None:
            window_left = spec.window_left
        elif window_left >= 0 and spec.window_left < 0:
            raise ValueError(f"window_left={window_left} for a layer of a spec without a sliding window: set "
                             "the spec's window_left so the backend is chosen for windows")
        elif window_left < -1:
            raise ValueError(f"window_left must be >= -1 (-1: no window), got {window_left}")
        return dict(sm_scale=spec.sm_scale, window_left=int(window_left), softcap=spec.softcap,
                    alibi_slopes=alibi_slopes if spec.use_alibi else None,
                    sinks=sinks if spec.use_sinks else None)

    def _out(self, q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        shape = (q.shape[0], q.shape[1], self.spec.v_size)
        if out is None:
            return torch.empty(shape, dtype=q.dtype, device=q.device)
        if tuple(out.shape) != shape:
            raise ValueError(f"out must have shape {shape}, got {tuple(out.shape)}")
        return out

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, *, alibi_slopes: torch.Tensor | None = None,
                sinks: torch.Tensor | None = None, out: torch.Tensor | None = None,
                window_left: int | None = None) -> torch.Tensor:
        """Write the step's ``k [T, Hkv, D]``/``v [T, Hkv, Dv]`` into ``cache`` and return the attention
        output ``[T, Hq, Dv]`` of ``q [T, Hq, D]`` (tokens in plan order). ``window_left``: this layer's
        sliding window if it differs from the spec's (see :meth:`_options`)."""


class MLAAttentionBackend(AttentionBackend):
    """MLA backends: one latent cache ``[num_blocks, block_size, L + R]`` per layer and ``forward_mla``
    (the math: :mod:`tripath.attention.backends.mla_common`)."""

    def cache_bytes_per_block(self) -> int:
        """Bytes of one block of one layer's latent cache."""
        elem = torch.empty((), dtype=self.cache_dtype).element_size()
        return self.spec.block_size * self.spec.mla.cache_width * elem

    def allocate_cache(self, num_blocks: int, device: torch.device | str | None = None) -> MLACache:
        """One layer's latent cache (scale 1.0; set ``kv_scale`` after calibration for fp8)."""
        device = torch.device(device) if device is not None else self.device
        cache = torch.zeros(num_blocks, self.spec.block_size, self.spec.mla.cache_width, dtype=self.cache_dtype,
                            device=device)
        return MLACache(cache, torch.ones(1, dtype=torch.float32, device=device))

    @abstractmethod
    def forward_mla(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                    positions: torch.Tensor, cache: MLACache, meta: AttentionMetadata, weights: MLALayerWeights,
                    *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Write the step's rows ``[kv_c | rope(k_pe)]`` into ``cache`` and return the attention output
        ``[T, H, V]`` of ``q_nope [T, H, P]`` and unrotated ``q_pe [T, H, R]`` (``kv_c [T, L]``, unrotated
        ``k_pe [T, R]``, tokens in plan order)."""
