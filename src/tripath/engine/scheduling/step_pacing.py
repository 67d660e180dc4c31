"""Step pacing: the scheduler's token budget kept to what a step can run in about ``step_time_target_s``.

On a GPU a step of thousands of tokens takes milliseconds; on the CPU a step of the default budget (8192
tokens) can take a minute, and everything waits for it: the other requests' next tokens, a new request's
admission, a disconnected client's abort (applied between steps). With a target, the budget starts at
:data:`START_BUDGET` tokens (or ``max_num_batched_tokens``, if smaller) and follows the steps it bounds — a
step that used at least half of it: one that took longer than the target shrinks it in proportion, one that
took less than half the target doubles it. Steps the budget did not bound (a few decodes, a prompt's last
chunk) say nothing about it, so a pause of the machine during one of them changes nothing. The budget is a
multiple of :data:`BUDGET_GRAIN` tokens, so the prompt chunks of a steady run do not change from step to step,
never above ``max_num_batched_tokens`` (or the smaller budget an out-of-memory step left) and never below
what keeps every running decode in the step (:meth:`~tripath.engine.scheduling.scheduler.Scheduler.pace`). Decodes are
never cut: a step of more decodes than the target allows still runs them all.
"""

from __future__ import annotations

START_BUDGET = 256           # tokens a step may take before any step has been timed
BUDGET_GRAIN = 64            # budgets are multiples of this many tokens


class StepPacer:
    """Sets ``scheduler``'s token budget from the times of the steps it bounds (see the module doc)."""

    def __init__(self, scheduler, target_s: float):
        self.scheduler = scheduler
        self.target_s = target_s
        self.budget = scheduler.pace(START_BUDGET)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step of ``num_tokens`` new tokens took ``seconds``."""
        if 2 * num_tokens < self.budget or seconds <= 0:
            return   # the budget did not bound this step
        if seconds > self.target_s:
            tokens = int(self.budget * self.target_s / seconds)
        elif 2 * seconds < self.target_s:
            tokens = 2 * self.budget
        else:
            return
        self.budget = self.scheduler.pace(max(BUDGET_GRAIN, tokens // BUDGET_GRAIN * BUDGET_GRAIN))
