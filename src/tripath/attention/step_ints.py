"""A step's metadata integers, gathered on the host so that they reach the device in one copy.

Every per-step integer a backend's metadata holds on the device (sequence lengths, query offsets, the
extends' context chunks, a backend's own extras) is an int32 list computed from the step's
:class:`~tripath.attention.planner.BatchPlan` alone. :meth:`AttentionBackend.step_ints
<tripath.attention.backends.base.AttentionBackend.step_ints>` gathers them, named, into one
:class:`StepInts`: the common lists (:func:`add_common_ints`), then the backend's own. The engine stages
their values beside the step's block table and copies both with one asynchronous copy
(:class:`~tripath.engine.runner.step_inputs.StepInputBuilder`), then places the device copy here; a caller
without a staging buffer uploads them with :meth:`StepInts.upload`. ``build_metadata`` then takes views.

Layout (``B`` requests, ``E`` extends, ``V`` verifies, in plan order):

- ``packed``: ``seq_lens [B]``, ``context_lens [B]``, ``cu_seqlens_q [B + 1]``, the verifies'
  ``cu_seqlens_q [V + 1]`` (none without verifies);
- ``extend_cu_q [E + 1]``; per context chunk ``c``, ``chunk<c>``: its ``cu_seqlens_k [E + 1]``,
  ``seq_starts [E]``, ``q_positions_start [E]``; ``tail``: the same three of the last chunk joined with the
  new tokens (:func:`tail_lengths`);
- ``prefill_cu_q [P + 1]``.
"""

from __future__ import annotations

import itertools

import torch

from tripath.attention.planner import BatchPlan


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a 1-D tensor on ``device``. On a GPU it goes through pinned host memory with an
    asynchronous copy, which never waits for the work already queued on the device (a copy from pageable
    memory may), so a step can be prepared while the previous one runs."""
    pin = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=pin)


def cumsum(values: list[int]) -> list[int]:
    """``[0, v0, v0 + v1, ...]``: the offsets of ``values``."""
    return list(itertools.accumulate(values, initial=0))


class StepInts:
    """Named int32 lists of one step (see the module doc): :meth:`add` them on the host, send
    :attr:`values` to the device (:meth:`upload`, or the caller's own copy and :meth:`place`), then
    :meth:`view` each."""

    __slots__ = ("values", "_spans", "_device")

    def __init__(self):
        self.values: list[int] = []
        self._spans: dict[str, tuple[int, int]] = {}
        self._device: torch.Tensor | None = None

    def add(self, name: str, values: list[int]) -> None:
        start = len(self.values)
        self.values.extend(values)
        self._spans[name] = (start, len(self.values))

    def upload(self, device: torch.device) -> "StepInts":
        """Copy :attr:`values` to ``device`` (one asynchronous copy from pinned memory on a GPU)."""
        self._device = to_device(self.values, torch.int32, device)
        return self

    def place(self, device_values: torch.Tensor) -> "StepInts":
        """Take ``device_values`` (``[len(values)]`` int32, the caller's copy of :attr:`values`) as the device
        copy."""
        if device_values.dtype != torch.int32 or device_values.shape != (len(self.values),):
            raise ValueError(f"the step's metadata integers are [{len(self.values)}] int32, got "
                             f"{device_values.dtype} of shape {tuple(device_values.shape)}")
        self._device = device_values
        return self

    @property
    def placed(self) -> bool:
        return self._device is not None

    def view(self, name: str) -> torch.Tensor:
        """The device slice of the list added as ``name``."""
        if self._device is None:
            raise RuntimeError("StepInts.view before the values reached the device (upload or place them)")
        start, end = self._spans[name]
        return self._device[start:end]


def tail_lengths(plan: BatchPlan) -> tuple[list[int], list[int]]:
    """The extends' tail (the last context chunk joined with the new tokens): each extend's first position
    ``min(last chunk's start, context_len)`` and its length up to ``seq_len`` (a context that ended in an
    earlier chunk contributes only its new tokens); empty lists without chunks."""
    nd, ne = plan.num_decodes, plan.num_extends
    chunks = plan.extend_chunks
    if not ne or not chunks.num_chunks:
        return [], []
    ext_q, ext_ctx = plan.query_lens[nd:nd + ne], plan.context_lens[nd:nd + ne]
    starts = [min(s, ctx) for s, ctx in zip(chunks.starts[-1], ext_ctx)]
    return starts, [ctx - s + q for s, ctx, q in zip(starts, ext_ctx, ext_q)]


def add_common_ints(plan: BatchPlan, ints: StepInts) -> StepInts:
    """Add the lists every backend's metadata holds (see the module doc) to ``ints``."""
    nd, nv, ne = plan.num_decodes, plan.num_verifies, plan.num_extends
    cu_verify = cumsum(plan.query_lens[nd - nv:nd]) if nv else []
    ints.add("packed", plan.seq_lens + plan.context_lens + cumsum(plan.query_lens) + cu_verify)
    if ne:
        ext_ctx = plan.context_lens[nd:nd + ne]
        chunks = plan.extend_chunks
        ints.add("extend_cu_q", cumsum(plan.query_lens[nd:nd + ne]))
        for c in range(chunks.num_chunks):
            ints.add(f"chunk{c}", chunks.cu_lens(c) + list(chunks.starts[c]) +
                     [ctx - s for ctx, s in zip(ext_ctx, chunks.starts[c])])
        starts, lens = tail_lengths(plan)
        if lens:
            ints.add("tail", cumsum(lens) + starts + [ctx - s for s, ctx in zip(starts, ext_ctx)])
    if plan.num_prefills:
        ints.add("prefill_cu_q", cumsum(plan.query_lens[nd + ne:]))
    return ints
