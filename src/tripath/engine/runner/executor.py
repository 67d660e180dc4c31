"""The contract between the engine core (:class:`~tripath.engine.core.engine_core.EngineCore`) and what runs its steps: one
:class:`~tripath.engine.runner.model_runner.ModelRunner` in the engine's process, or a
:class:`~tripath.engine.runner.parallel_executor.ParallelExecutor` over tensor-parallel ranks.

An executor owns the model's KV cache and runs scheduled steps: :meth:`Executor.launch` queues a step and
returns a :class:`~tripath.engine.runner.launched_step.LaunchedStep` whose ``sampled()`` gives its tokens. What it
can do is declared (:class:`ExecutorCapabilities`), never probed: ``overlap`` — ``launch`` takes the
previous launched step whose tokens some of this step's decodes read on the device, so the engine may launch
step N + 1 before it reads step N; ``multi_step`` — ``launch(num_steps=k)`` runs ``k`` model steps of
single-token decodes back to back on the device.

Before it serves, the engine starts it (:func:`tripath.engine.runner.startup.start`): ``plan_memory`` (the KV
cache's size in blocks), ``allocate_kv_cache``, ``warm_up``, ``capture_graphs``, once each, in that order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tripath.engine.runner.launched_step import LaunchedStep


@dataclass(frozen=True)
class ExecutorCapabilities:
    overlap: bool
    multi_step: bool


class Executor(Protocol):
    capabilities: ExecutorCapabilities
    num_blocks: int
    block_size: int
    max_model_len: int

    # ---- the start (tripath.engine.runner.startup.start), once each, in this order ----
    def plan_memory(self) -> int:
        """The KV cache's size in blocks (every rank's smallest under tensor parallelism)."""

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate each attention layer's cache of ``num_blocks`` blocks; sets ``num_blocks``."""

    def warm_up(self) -> None:
        """Compile the kernel variants the limits allow (GPU, Triton backends)."""

    def capture_graphs(self) -> None:
        """Capture the CUDA graphs the backend and configuration allow; reserve a step's memory (GPU)."""

    # ---- serving ----
    def launch(self, scheduled: list, previous: LaunchedStep | None = None, num_steps: int = 1) -> LaunchedStep:
        """Queue ``scheduled`` (``num_steps`` model steps; > 1 needs ``capabilities.multi_step``)."""

    def logits_width(self) -> int:
        """Columns of the logits the sampler sees (the vocabulary, padded as the model pads it)."""

    def close(self) -> None:
        """Release worker processes, if any (idempotent)."""
