"""What a launched step returns: :class:`LaunchedStep` (work queued on the device, its tokens on their way to
the host) and :class:`SampledStep` (what the host reads from it: each scheduled request's tokens and the
log-probabilities it asked for)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tripath.engine.requests.request import PositionLogprobs
from tripath.engine.sampling.logprobs import LogprobRows, as_dicts
from tripath.engine.scheduling.scheduler import ScheduledRequest


@dataclass
class StepLogprobs:
    """Device log-probabilities of one launch: ``sampled[j]`` the chosen tokens of model step ``j`` for the
    sampled rows ``sampled_rows`` (indices into the launch's sample rows) with ``sampled_ks`` top tokens each;
    ``prompt`` the prompt positions scored in this step, ``prompt_counts[i]`` of them for scheduled request
    ``prompt_requests[i]`` (in order), with ``prompt_ks`` top tokens; ``verify`` the rows of the verifies
    asking for log-probabilities (launch column ``verify_columns[i]``, ``verify_counts[i]`` rows each, each
    scored with the token the verify yields there; rows past its last token are dropped on the host)."""

    sampled_rows: list[int]
    sampled_ks: list[int]
    sampled: list[LogprobRows]
    prompt_requests: list[int]
    prompt_counts: list[int]
    prompt_ks: list[int]
    prompt: LogprobRows | None
    verify_columns: list[int] = field(default_factory=list)
    verify_counts: list[int] = field(default_factory=list)
    verify_ks: list[int] = field(default_factory=list)
    verify: LogprobRows | None = None

    @property
    def on_gpu(self) -> bool:
        rows = self.sampled[0] if self.sampled else self.prompt if self.prompt is not None else self.verify
        return rows is not None and rows.chosen.device.type == "cuda"


@dataclass
class SampledStep:
    """A finished launch as the host reads it: ``tokens[i]`` the tokens sampled for scheduled request ``i``
    (empty where it is mid-prompt; one per model step), ``logprobs[i]`` one dict per such token where the
    request asks for them, ``prompt_logprobs[i]`` one dict per prompt position scored (else None)."""

    tokens: list[list[int]]
    logprobs: list[list[PositionLogprobs] | None]
    prompt_logprobs: list[list[PositionLogprobs] | None]

    @classmethod
    def empty(cls, n: int) -> "SampledStep":
        return cls([[] for _ in range(n)], [None] * n, [None] * n)


class LaunchedStep:
    """A step whose work is queued on the device. ``tokens [K, S]`` int64 (device): row ``j`` holds the
    tokens sampled by model step ``j`` of the ``K`` this launch ran (``K = 1`` but for multi-step decoding),
    column ``k`` those of ``scheduled[sample_rows[k]]``; ``rows``: ``id(request) -> k``. ``ragged``: a launch
    with verifies (speculative decoding), whose columns hold 1 to ``K`` tokens each, then -1. The tokens' (and
    any log-probabilities') copy to the host is under way; :meth:`sampled` waits for it."""

    def __init__(self, scheduled: list[ScheduledRequest], sample_rows: list[int], tokens: torch.Tensor | None,
                 logprobs: StepLogprobs | None = None, ragged: bool = False):
        self.num_scheduled = len(scheduled)
        self.ragged = ragged
        self.sample_rows = sample_rows
        self.tokens = tokens
        self.requests = [scheduled[i].request for i in sample_rows]  # keeps the ids in ``rows`` unique
        self.rows = {id(r): k for k, r in enumerate(self.requests)}
        self._host, self._ready = tokens, None
        self._logprobs = logprobs
        on_gpu = False
        if tokens is not None and tokens.device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            on_gpu = True
        if logprobs is not None:
            on_gpu = on_gpu or logprobs.on_gpu
            logprobs.sampled = [rows.to_host() for rows in logprobs.sampled]
            logprobs.prompt = None if logprobs.prompt is None else logprobs.prompt.to_host()
            logprobs.verify = None if logprobs.verify is None else logprobs.verify.to_host()
        if on_gpu:
            self._ready = torch.cuda.Event()
            self._ready.record()

    @property
    def last_tokens(self) -> torch.Tensor:
        """``[S]``: the tokens of the launch's last model step (the next step's in-flight inputs)."""
        if self.ragged:
            raise RuntimeError("a launch with verify steps has no common last row of tokens: the engine reads it "
                               "before scheduling the next step")
        return self.tokens[-1]

    def sampled(self) -> SampledStep:
        """The tokens (and log-probabilities) of each scheduled request, in step order; waits for the device."""
        out = SampledStep.empty(self.num_scheduled)
        if self._ready is not None:
            self._ready.synchronize()
        if self.tokens is not None:
            for i, tokens in zip(self.sample_rows, self._host.t().tolist()):
                out.tokens[i] = [t for t in tokens if t >= 0] if self.ragged else tokens
        lp = self._logprobs
        if lp is None:
            return out
        per_step = [as_dicts(rows, lp.sampled_ks) for rows in lp.sampled]
        for j, row in enumerate(lp.sampled_rows):
            out.logprobs[self.sample_rows[row]] = [step[j] for step in per_step]
        if lp.prompt is not None:
            start = 0
            for i, count, k in zip(lp.prompt_requests, lp.prompt_counts, lp.prompt_ks):
                out.prompt_logprobs[i] = as_dicts(lp.prompt.rows(start, start + count), [k] * count)
                start += count
        if lp.verify is not None:
            start = 0
            for column, count, k in zip(lp.verify_columns, lp.verify_counts, lp.verify_ks):
                i = self.sample_rows[column]
                kept = len(out.tokens[i])
                out.logprobs[i] = as_dicts(lp.verify.rows(start, start + kept), [k] * kept)
                start += count
        return out
