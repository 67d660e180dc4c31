"""A snapshot of the engine's state and cumulative counters (:meth:`tripath.engine.LLM.stats`), for monitors
such as the server's Prometheus metrics, so they never read the scheduler or the block manager."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """The engine after its last step.

    ``num_running`` requests hold KV blocks, ``num_waiting`` are queued (new or preempted);
    ``num_kv_blocks_used`` of the ``num_kv_blocks_total`` usable blocks (block 0 is reserved) are held by
    requests. The rest are cumulative since the engine was built: ``prefix_cache_queried_tokens`` prompt tokens
    were looked up in the prefix cache and ``prefix_cache_hit_tokens`` of them found there,
    ``num_preemptions`` requests were preempted (recomputed later), ``num_steps`` steps ran.
    """

    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    num_steps: int

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the usable KV blocks held by requests (0 to 1)."""
        return self.num_kv_blocks_used / self.num_kv_blocks_total if self.num_kv_blocks_total else 0.0
