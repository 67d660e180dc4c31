"""How many tokens a request drafts in a step: speculative decoding's adaptive length.

With an ``acceptance_threshold`` ``θ > 0`` each request keeps an estimate ``a`` of the chance that the target
keeps its next draft, and drafts the largest ``j <= k`` with ``a^j >= θ``: draft ``j`` is kept only when
drafts ``1 .. j`` all are (chance ``a^j`` under a constant per-token acceptance), while it costs a row of the
verify either way. ``θ`` is the least chance of being kept that a draft's row is worth: about the cost of a
verify row relative to a decode step's (small where decode steps are bound by memory bandwidth, near 1 where
a large batch makes them compute-bound).

The estimate: a verify that scored ``d`` drafts and kept the first ``n`` saw ``n`` drafts kept and, when
``n < d``, one rejected (a draft tree counts its depth as ``d``). The counts decay by half every
:data:`HALF_LIFE` verifies, so the estimate follows a request whose text turns easier or harder to predict.
A new request starts from the engine's recent verifies (the same counts over every request's verifies,
decaying by half every :data:`POOL_HALF_LIFE`), weighed as :data:`PRIOR_WEIGHT` observations: where the
engine's drafts have mostly been kept it drafts ``k`` at once, and where they have been rejected it drafts
nothing until its first probe, instead of paying a few rejected verifies to learn it. Before any verify the
prior is all kept, so the engine's first requests draft ``k``. A request whose
estimate allows no draft drafts one (a *probe*) after :data:`PROBE_EVERY` steps without, so that its estimate
can recover; each probe the target rejects doubles that gap, up to :data:`MOST_PROBE_GAP`, and a probe kept
brings it back to :data:`PROBE_EVERY`. A new request starts from the gap the engine's latest probe left (its
own request's), so where probes keep being rejected a new request does not probe again at the short gaps the
requests before it found useless. A probe costs more than its row: the engine reads the step before it
and the probe's own verify before it schedules on, so the steps around it do not overlap.

Between its probes such a request drafts nothing, and the engine knows it ahead of time
(:meth:`DraftLengths.steps_without_draft`): while no running request wants a draft, steps overlap and decodes
run several model steps a launch, as without speculation (:mod:`tripath.engine.scheduling.scheduler`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

HALF_LIFE = 4          # verifies after which an observation weighs half
PRIOR_WEIGHT = 2.0     # a new request's prior counts as this many kept-or-rejected observations
POOL_HALF_LIFE = 32    # verifies of any request after which one weighs half in the engine's prior
PROBE_EVERY = 8        # a request that drafts nothing drafts one token (a probe) after this many steps
MOST_PROBE_GAP = 64    # the gap doubles with each probe rejected, up to this
_DECAY = 0.5 ** (1.0 / HALF_LIFE)
_POOL_DECAY = 0.5 ** (1.0 / POOL_HALF_LIFE)


@dataclass
class _Estimate:
    kept: float = PRIOR_WEIGHT
    rejected: float = 0.0
    idle_steps: int = 0   # steps since the request last drafted (its estimate allowing none)
    probe_gap: int = PROBE_EVERY   # idle steps before its next probe
    probing: bool = False          # its last drafts were a probe

    @property
    def acceptance(self) -> float:
        return self.kept / (self.kept + self.rejected)


class DraftLengths:
    """The adaptive draft length of each request (module doc) for ``threshold`` ``θ`` in ``(0, 1)``."""

    def __init__(self, threshold: float):
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"acceptance_threshold must be in (0, 1), got {threshold}")
        self.threshold = threshold
        self._estimates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # request -> _Estimate
        self._pool_kept = self._pool_rejected = 0.0   # over every request's verifies (module doc)
        self._pool_probe_gap = PROBE_EVERY              # the gap the latest probe of any request left

    def _new_estimate(self) -> _Estimate:
        """A new request's estimate: the engine's recent acceptance, weighed as ``PRIOR_WEIGHT`` observations
        (all kept before any verify), and the probe gap the engine's latest probe left."""
        total = self._pool_kept + self._pool_rejected
        a = self._pool_kept / total if total > 0 else 1.0
        return _Estimate(kept=PRIOR_WEIGHT * a, rejected=PRIOR_WEIGHT * (1.0 - a), probe_gap=self._pool_probe_gap)

    def _estimate(self, request) -> _Estimate:
        estimate = self._estimates.get(request)
        if estimate is None:
            estimate = self._estimates[request] = self._new_estimate()
        return estimate

    def acceptance(self, request) -> float:
        """The request's estimated chance that its next draft is kept."""
        estimate = self._estimates.get(request)
        return (self._new_estimate() if estimate is None else estimate).acceptance

    def length(self, request, most: int) -> int:
        """How many of at most ``most`` drafts the request takes this step (one call per step it decodes)."""
        if most <= 0:
            return 0
        estimate = self._estimate(request)
        a, j = estimate.acceptance, 0
        while j < most and a ** (j + 1) >= self.threshold:
            j += 1
        probe = False
        if j == 0:
            estimate.idle_steps += 1
            probe = estimate.idle_steps >= estimate.probe_gap
            j = int(probe)
        if j:
            estimate.idle_steps, estimate.probing = 0, probe
        return j

    def steps_without_draft(self, request, most: int) -> int:
        """How many of the request's next steps, at most ``most``, will draft nothing (what :meth:`length`
        would give them, its estimate being fixed until the next verify): 0 when the next step drafts, else
        the steps before its next probe."""
        estimate = self._estimates.get(request)
        if estimate is None:   # not seen yet: it starts from the engine's prior
            estimate = self._new_estimate()
        if estimate.acceptance >= self.threshold:
            return 0
        return max(0, min(most, estimate.probe_gap - 1 - estimate.idle_steps))

    def skip(self, request, steps: int) -> None:
        """The request decoded ``steps`` steps without drafts (several model steps of one launch, which
        :meth:`length` was not asked for): they count toward its next probe as idle steps of :meth:`length` do."""
        estimate = self._estimate(request)
        estimate.idle_steps += steps

    def observe(self, request, drafted: int, kept: int) -> None:
        """A verify of the request scored ``drafted`` drafts (a tree: its depth) and kept the first ``kept``."""
        estimate = self._estimate(request)
        rejected = 1.0 if kept < drafted else 0.0
        estimate.kept = estimate.kept * _DECAY + kept
        estimate.rejected = estimate.rejected * _DECAY + rejected
        self._pool_kept = self._pool_kept * _POOL_DECAY + kept
        self._pool_rejected = self._pool_rejected * _POOL_DECAY + rejected
        if estimate.probing:
            estimate.probe_gap = PROBE_EVERY if kept else min(2 * estimate.probe_gap, MOST_PROBE_GAP)
            estimate.probing = False
            self._pool_probe_gap = estimate.probe_gap
