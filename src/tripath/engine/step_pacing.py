"""Step pacing: the scheduler's token budget sized so that a step takes about ``step_time_target_s``.

On a GPU a step of thousands of tokens takes milliseconds; on the CPU a step of the default budget (8192
tokens) can take a minute, and everything waits for it: the other requests' next tokens, a new request's
admission, a disconnected client's abort (applied between steps). With a target, the engine times each step
and models a step's time as ``fixed + per_token * tokens`` — on the CPU the fixed part is mostly reading every
weight once (a 135M-parameter model in float32: about 60 ms on two cores), the per-token part the matrix
work — fitted by least squares over the recent steps (each older step weighs :data:`FORGET` as much as the
next), or, while the steps' token counts have not varied enough to separate the two, as ``seconds / tokens``.
The budget of the next steps is the tokens that fill the target, rounded down to a multiple of
:data:`BUDGET_GRAIN` (so a steady run's prompt chunks do not change from step to step), never above
``max_num_batched_tokens`` (or the smaller budget an out-of-memory step left) and never below what keeps every
running decode in the step (:meth:`~tripath.engine.scheduler.Scheduler.pace`). Decodes alone are never cut: a
step of more decodes than the target allows still runs them all.
"""

from __future__ import annotations

DEFAULT_CPU_TARGET_S = 0.5   # the CPU's default step time: long prompts are chunked to about this
FORGET = 0.9                 # the weight of a step's timing, relative to the step after it
BUDGET_GRAIN = 64            # budgets are multiples of this many tokens


class StepPacer:
    """Sets ``scheduler``'s token budget from the steps' measured times (see the module doc)."""

    def __init__(self, scheduler, target_s: float):
        self.scheduler = scheduler
        self.target_s = target_s
        self._sums = [0.0] * 5   # weighted: 1, tokens, seconds, tokens², tokens * seconds

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step of ``num_tokens`` new tokens took ``seconds``."""
        if num_tokens < 1 or seconds <= 0:
            return
        sums = self._sums
        for i, value in enumerate((1.0, num_tokens, seconds, num_tokens * num_tokens, num_tokens * seconds)):
            sums[i] = FORGET * sums[i] + value
        fixed, per_token = self.model()
        fits = int((self.target_s - fixed) / per_token) if self.target_s > fixed else 0
        self.scheduler.pace(fits // BUDGET_GRAIN * BUDGET_GRAIN)

    def model(self) -> tuple[float, float]:
        """``(fixed seconds, seconds per token)`` of a step, as fitted so far."""
        weight, tokens, seconds, squares, products = self._sums
        spread = weight * squares - tokens * tokens
        if spread > 1e-9 * weight * squares:
            per_token = (weight * products - tokens * seconds) / spread
            fixed = (seconds - per_token * tokens) / weight
            if per_token > 0 and fixed >= 0:
                return fixed, per_token
        return 0.0, seconds / tokens
