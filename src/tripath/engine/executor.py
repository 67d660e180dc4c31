"""The contract between the engine core (:class:`~tripath.engine.core.EngineCore`) and what runs its steps: one
:class:`~tripath.engine.model_runner.ModelRunner` in the engine's process, or a
:class:`~tripath.engine.parallel_executor.ParallelExecutor` over tensor-parallel ranks.

An executor owns the model's KV cache and runs scheduled steps: :meth:`Executor.launch` queues a step and
returns a :class:`~tripath.engine.launched_step.LaunchedStep` whose ``sampled()`` gives its tokens. What it
can do is declared (:class:`ExecutorCapabilities`), never probed: ``overlap`` — ``launch`` takes the
previous launched step whose tokens some of this step's decodes read on the device, so the engine may launch
step N + 1 before it reads step N; ``multi_step`` — ``launch(num_steps=k)`` runs ``k`` model steps of
single-token decodes back to back on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tripath.engine.launched_step import LaunchedStep


@dataclass(frozen=True)
class ExecutorCapabilities:
    overlap: bool
    multi_step: bool


class Executor(Protocol):
    capabilities: ExecutorCapabilities
    num_blocks: int
    block_size: int
    max_model_len: int

    def launch(self, scheduled: list, previous: LaunchedStep | None = None, num_steps: int = 1) -> LaunchedStep:
        """Queue ``scheduled`` (``num_steps`` model steps; > 1 needs ``capabilities.multi_step``)."""

    def logits_width(self) -> int:
        """Columns of the logits the sampler sees (the vocabulary, padded as the model pads it)."""

    def close(self) -> None:
        """Release worker processes, if any (idempotent)."""
