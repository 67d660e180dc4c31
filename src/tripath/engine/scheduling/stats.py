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
    ``step_tokens_sum`` tokens in all (see :class:`StepTokenCounts`). Speculative decoding
    (:mod:`tripath.engine.speculative`): ``spec_num_drafts`` verify steps of requests scored
    ``spec_num_draft_tokens`` drafts and kept ``spec_num_accepted_tokens`` of them;
    ``spec_accepted_per_position[j]`` times the ``j + 1``-th draft of a verify was kept.
    ``fused_sampling_steps`` model steps drew their tokens straight from the LM head, without logits
    (:mod:`tripath.engine.sampling.fused_sampling`).
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
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    fused_sampling_steps: int = 0

    def draft_summary(self) -> str | None:
        """A line on speculative decoding's drafts (None when no step verified any): acceptance overall, the
        tokens a verify step yields on average, and acceptance by position."""
        if not self.spec_num_drafts:
            return None
        rate = self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0
        per_position = ", ".join(f"{n / self.spec_num_drafts:.0%}" for n in self.spec_accepted_per_position)
        return (f"speculative decoding: {self.spec_num_accepted_tokens} of {self.spec_num_draft_tokens} drafted "
                f"tokens accepted ({rate:.1%}) in {self.spec_num_drafts} verifies, "
                f"{1 + self.spec_num_accepted_tokens / self.spec_num_drafts:.2f} tokens per verify; "
                f"accepted by position: {per_position}")

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


class DraftCounts:
    """Speculative decoding's cumulative counts (the ``spec_*`` fields of :class:`EngineStats`)."""

    def __init__(self, num_positions: int):
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_positions

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """One verify: ``num_drafted`` drafts scored, the first ``num_accepted`` of them kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    def stats_fields(self) -> tuple:
        """The values of :class:`EngineStats`' ``spec_*`` fields, in their order."""
        return (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, tuple(self.accepted_per_position))
