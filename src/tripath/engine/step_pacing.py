"""Step pacing: the scheduler's token budget sized so that a step takes about ``step_time_target_s``.

On a GPU a step of thousands of tokens takes milliseconds; on the CPU a step of the default budget (8192
tokens) can take a minute, and everything waits for it: the other requests' next tokens, a new request's
admission, a disconnected client's abort (applied between steps). With a target, the engine measures each
step that ran at least :data:`MIN_TOKENS_TO_LEARN` tokens (seconds per token, a running average) and sets
the budget of the next steps to the tokens that fill the target — a power of two, so the prompt chunks of a
steady run do not change from step to step — never above ``max_num_batched_tokens`` (or the smaller budget an
out-of-memory step left) and never below what keeps every running decode in the step
(:meth:`~tripath.engine.scheduler.Scheduler.pace`). Decodes alone are never cut: a step of more decodes than
the target allows still runs them all.
"""

from __future__ import annotations

DEFAULT_CPU_TARGET_S = 0.25   # the CPU's default step time: long prompts are chunked to about this
MIN_TOKENS_TO_LEARN = 16      # steps with fewer tokens measure the step's fixed costs, not its tokens'
SMOOTHING = 0.3               # the weight of the newest step in the seconds-per-token average


class StepPacer:
    """Sets ``scheduler``'s token budget from the steps' measured time (see the module doc)."""

    def __init__(self, scheduler, target_s: float):
        self.scheduler = scheduler
        self.target_s = target_s
        self.seconds_per_token: float | None = None

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step of ``num_tokens`` new tokens took ``seconds``."""
        if num_tokens < MIN_TOKENS_TO_LEARN or seconds <= 0:
            return
        rate = seconds / num_tokens
        previous = self.seconds_per_token
        self.seconds_per_token = rate if previous is None else (1 - SMOOTHING) * previous + SMOOTHING * rate
        fits = max(1, int(self.target_s / self.seconds_per_token))
        self.scheduler.pace(1 << (fits.bit_length() - 1))   # the largest power of two that fits
