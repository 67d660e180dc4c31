"""A snapshot of the engine's state and cumulative counters (:meth:`tripath.engine.LLM.stats`), for monitors
such as the server's Prometheus metrics, so they never read the scheduler or the block manager."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# upper bounds of the step-size histogram (tokens per model step): vLLM's ``iteration_tokens_total`` buckets
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class EngineStats:
    """The engine after its last step.

    ``num_running`` requests hold KV blocks, ``num_waiting`` are queued (new or preempted);
    ``num_kv_blocks_used`` of the ``num_kv_blocks_total`` usable blocks (block 0 is reserved) are held by
    requests. The rest are cumulative since the engine was built: ``prefix_cache_queried_tokens`` prompt tokens
    were looked up in the prefix cache and ``prefix_cache_hit_tokens`` of them found there,
    ``num_preemptions`` requests were preempted (recomputed later), ``num_steps`` steps ran;
    ``step_token_counts[i]`` model steps computed at most ``STEP_TOKEN_BUCKETS[i]`` new tokens (and more than
    the bound before it; the last entry counts the steps above the last bound: one longer than the bounds),
    ``step_tokens_sum`` tokens in all (see :class:`StepTokenCounts`).
    """

    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    num_steps: int
    step_token_counts: tuple[int, ...] = ()
    step_tokens_sum: int = 0

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the usable KV blocks held by requests (0 to 1)."""
        return self.num_kv_blocks_used / self.num_kv_blocks_total if self.num_kv_blocks_total else 0.0


class StepTokenCounts:
    """How many new tokens (prompt tokens of prefills and extends, one per decode) each model step computes,
    counted into :data:`STEP_TOKEN_BUCKETS`: a launch of ``k`` decode steps is ``k`` model steps."""

    def __init__(self):
        self.counts = [0] * (len(STEP_TOKEN_BUCKETS) + 1)
        self.total = 0

    def observe(self, num_tokens: int, num_steps: int = 1) -> None:
        self.counts[bisect.bisect_left(STEP_TOKEN_BUCKETS, num_tokens)] += num_steps
        self.total += num_tokens * num_steps
