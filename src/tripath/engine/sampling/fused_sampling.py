"""Which steps draw their tokens straight from the LM head, without writing logits (the *fused* path).

The fused path (:meth:`tripath.models.base.CausalLM.sample_tokens`, :mod:`tripath.ops.lm_head_sample`) computes a
row's logits tile by tile and keeps only the winner of each tile: the greedy token, or the temperature draw by
Gumbel-max with counter-based noise, and the row's log-sum-exp. A step takes it when

- every row it samples can be drawn so (:func:`full_logits_reason` is None for each request: greedy or a
  plain temperature, no top-k / top-p / min-p, no penalties, ``logit_bias`` or ``min_tokens``, no
  structured output, no log-probabilities but a greedy token's own);
- it verifies no drafts (speculative decoding scores every draft against the logits);
- the model offers ``sample_tokens`` (under tensor parallelism each rank draws from its vocabulary rows and
  the ranks gather ``[N, 4]`` values instead of ``[N, V / W]`` logits; rank 0 decides for every rank);
- and :class:`FusedSampling` says so for the step's row count and kind (greedy only, or with sampled rows):
  ``fused_sampling="auto"`` (the default) measures both paths at start on a GPU for each bucket of row
  counts (powers of two up to ``max_num_seqs``) and keeps the faster; on the CPU the unfused path stays;
  ``"on"`` takes the fused path wherever the requests allow (tests), ``"off"`` never.

The tokens are the unfused path's: a greedy row's argmax of the logits in the LM head's dtype (the lowest id
among ties; both paths accumulate in fp32, in different orders, so a near tie may resolve differently on a
GPU); a plain-temperature row's draw uses the same noise on both paths (the sampler draws such rows by
:func:`tripath.ops.lm_head_sample.logits_sample`), keyed by the request's seed and the row's position.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from tripath.engine.requests.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

FUSED_SAMPLING_MODES = ("auto", "on", "off")
TIMED_REPS = 10   # launches timed per path and bucket at start (after two untimed)


def full_logits_reason(params: SamplingParams) -> str | None:
    """Why a request's sampled row needs its whole row of logits (None: the fused path can draw it):
    :attr:`SamplingParams.full_logits_reason`, computed once per parameters object."""
    return params.full_logits_reason


def row_buckets(max_rows: int) -> list[int]:
    """The row counts a choice is made for: powers of two below ``max_rows``, and ``max_rows``."""
    return sorted({1 << i for i in range(max(1, max_rows).bit_length()) if 1 << i < max_rows} | {max(1, max_rows)})


@dataclass
class FusedSampling:
    """The choice for each bucket of row counts (a step of ``n`` rows takes the smallest bucket ``>= n``):
    ``greedy[b]`` for steps whose rows are all greedy, ``sampled[b]`` for steps with temperature rows;
    ``timings[(b, kind)] = (fused µs, unfused µs)`` where they were measured. ``how``: the setting and why."""

    how: str
    buckets: list[int]
    greedy: dict[int, bool]
    sampled: dict[int, bool]
    timings: dict[tuple[int, str], tuple[float, float]] = field(default_factory=dict)

    @classmethod
    def fixed(cls, how: str, max_rows: int, on: bool) -> FusedSampling:
        buckets = row_buckets(max_rows)
        return cls(how, buckets, dict.fromkeys(buckets, on), dict.fromkeys(buckets, on))

    def bucket(self, num_rows: int) -> int | None:
        return next((b for b in self.buckets if b >= num_rows), None)

    def may_use(self, num_rows: int) -> bool:
        """Whether a step of ``num_rows`` rows takes the fused path for either kind (a cheap first test)."""
        b = self.bucket(num_rows)
        return b is not None and (self.greedy[b] or self.sampled[b])

    def use(self, num_rows: int, sampled: bool) -> bool:
        """Whether a step of ``num_rows`` rows (``sampled``: some with a temperature) takes the fused path."""
        b = self.bucket(num_rows)
        return b is not None and (self.sampled if sampled else self.greedy)[b]

    @property
    def any(self) -> bool:
        return any(self.greedy.values()) or any(self.sampled.values())

    def facts(self) -> tuple[tuple[int, bool, bool], ...]:
        """``(rows up to, greedy fused, sampled fused)`` per bucket."""
        return tuple((b, self.greedy[b], self.sampled[b]) for b in self.buckets)

    def summary(self) -> str:
        """One line for the start log: the setting and, per bucket, which path each kind takes (with the
        measured times)."""
        parts = []
        for b in self.buckets:
            cells = []
            for kind, chosen in (("greedy", self.greedy[b]), ("sampled", self.sampled[b])):
                timing = self.timings.get((b, kind))
                measured = f" {timing[0]:.0f}/{timing[1]:.0f} µs" if timing else ""
                cells.append(f"{kind} {'fused' if chosen else 'unfused'}{measured}")
            parts.append(f"≤{b} rows: {', '.join(cells)}")
        return f"fused LM head + sampling ({self.how}): " + "; ".join(parts)


def choose(runner) -> FusedSampling | None:
    """The choice without measuring (None: the fused path is never taken): none for ``"off"`` or a model
    without ``sample_tokens``; ``"on"`` everywhere; ``"auto"`` off until :func:`measure` on a GPU. Under tensor
    parallelism every rank measures (their collectives in step) and rank 0's choice decides each step."""
    mode = runner.config.fused_sampling
    if mode == "off" or not callable(getattr(runner.model, "sample_tokens", None)):
        return None
    max_rows = runner.config.max_num_seqs
    if mode == "on":
        return FusedSampling.fixed("on", max_rows, True)
    return FusedSampling.fixed("auto: no GPU to measure" if runner.device.type != "cuda" else "auto", max_rows, False)


@torch.inference_mode()
def measure(runner, hidden: torch.Tensor, timer=None) -> None:
    """At start on a GPU (:mod:`tripath.engine.runner.startup`): with ``"auto"``, time the fused and the unfused path
    (the LM head's GEMM and the sampler's draw) at each bucket's row count on ``hidden``'s rows, greedy and
    with a temperature, and keep the faster per bucket and kind in ``runner.fused_sampling`` (logged); with
    ``"on"``, run the fused path once per bucket and kind. Either way every kernel variant a step can take is
    compiled before requests. ``timer(fn) -> µs``: default, the mean GPU time of back-to-back calls."""
    choice = runner.fused_sampling
    if choice is None:
        return
    timer = timer or _gpu_us
    timed = runner.config.fused_sampling == "auto"
    for b in choice.buckets:
        h = hidden[:b] if hidden.shape[0] >= b else hidden[:1].expand(b, -1).contiguous()
        for kind, (fused, unfused) in _paths(runner, h).items():
            if not timed:
                fused()
                continue
            timing = (timer(fused), timer(unfused))
            choice.timings[(b, kind)] = timing
            (choice.greedy if kind == "greedy" else choice.sampled)[b] = timing[0] < timing[1]
    if timed:
        choice.how = "auto: measured at start"
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    logger.info("%s", choice.summary())


def _paths(runner, h: torch.Tensor) -> dict:
    """``{kind: (fused, unfused)}`` calls drawing ``h``'s rows, greedy and with temperature 1."""
    from tripath.engine.sampling.sampler import sample

    b = h.shape[0]
    temperature = torch.ones(b, device=h.device)
    seeds = torch.arange(b, device=h.device)
    positions = torch.zeros(b, dtype=torch.int64, device=h.device)
    greedy, sampled = [SamplingParams(temperature=0.0)] * b, [SamplingParams(temperature=1.0)] * b
    return {
        "greedy": (lambda: runner.model.sample_tokens(h),
                   lambda: sample(runner.compute_logits(h), greedy, [None] * b)),
        "sampled": (lambda: runner.model.sample_tokens(h, temperature, seeds, positions),
                    lambda: sample(runner.compute_logits(h), sampled, [None] * b, noise=(seeds, positions))),
    }


def _gpu_us(fn) -> float:
    """Mean GPU µs of ``fn`` over :data:`TIMED_REPS` back-to-back calls (after two untimed ones)."""
    for _ in range(2):
        fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(TIMED_REPS):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1e3 / TIMED_REPS
