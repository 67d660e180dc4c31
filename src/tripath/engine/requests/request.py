"""Requests as the engine tracks them: sampling parameters, token state, timings, and the results it returns.

A request's tokens are ``prompt_token_ids + output_token_ids``, then ``num_inflight_tokens`` (0 or 1) that a
launched step is sampling and the engine has not read back yet (overlapped scheduling). ``num_computed_tokens``
of them have their K/V in the paged cache, or in a step already launched (the blocks listed in
``block_ids``, block ``i`` holding positions ``i * block_size .. (i + 1) * block_size - 1``). A step feeds
``num_new_tokens`` more; when they reach the end of the sequence the step's last logits give the next token.
Preemption by recompute frees the blocks and resets ``num_computed_tokens`` to 0 while keeping the outputs,
so the request later re-prefills ``prompt + outputs`` and continues exactly where it stopped.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from tripath.engine.requests.sampling_params import SamplingParams, token_ids_of
from tripath.engine.requests.structured_output import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # queued, or preempted and waiting to be recomputed
    RUNNING = "running"      # holds KV blocks and is scheduled every step
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"        # max_tokens reached
    STOP = "stop"            # an end-of-sequence or stop token was sampled
    ABORTED = "aborted"      # the caller aborted it
    ERROR = "error"          # it cannot go on (``Request.error`` says why): the token sampled was dropped


_request_counter = itertools.count()


@dataclass(eq=False)
class Request:
    """One generation request and its progress (owned by the scheduler)."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    request_id: str = ""
    prompt: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_inflight_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)   # chained hashes of the leading full blocks
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    scheduled_time: float | None = None   # when a step first scheduled it (``perf_counter``)
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    sampling_seed: int | None = None   # the seed of its generator and its draws' noise key (temperature > 0)
    index: int = field(default_factory=lambda: next(_request_counter))
    logprobs: list[PositionLogprobs] | None = None           # per output token, when sampling_params.logprobs
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # per prompt token, when prompt_logprobs
    cumulative_logprob: float | None = None                  # with logprobs: the sum over the output tokens
    grammar: GrammarState | None = None                      # with structured_output: its matcher
    error: str | None = None                                 # why it finished with FinishReason.ERROR
    _prompt_array: tuple | None = field(default=None, init=False, repr=False)   # (prompt list, its int64 array)

    def __post_init__(self):
        self.prompt_token_ids = token_ids_of(self.prompt_token_ids, "prompt_token_ids")
        # the prompt's int64 array, made once here rather than inside the step that schedules its first chunk
        self._prompt_array = (self.prompt_token_ids, np.asarray(self.prompt_token_ids, dtype=np.int64))
        if not self.request_id:
            self.request_id = str(self.index)
        if self.sampling_params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]   # the first prompt token has no log-probability

    @property
    def num_prompt_logprobs_done(self) -> int:
        """Prompt positions whose next token's log-probability is recorded (the prefix cache may serve
        those, and only those, when the request is admitted again)."""
        return 0 if self.prompt_logprobs is None else len(self.prompt_logprobs) - 1

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"outputs={self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={self.block_ids})")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens, in-flight ones included, whose K/V no step has computed yet (1 for a decode)."""
        return self.num_tokens + self.num_inflight_tokens - self.num_computed_tokens

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens ``start .. stop - 1`` of ``prompt + outputs``."""
        prompt = self.prompt_token_ids
        if stop <= len(prompt):
            return prompt[start:stop]
        if start >= len(prompt):
            return self.output_token_ids[start - len(prompt):stop - len(prompt)]
        return prompt[start:] + self.output_token_ids[:stop - len(prompt)]

    def token_array(self, start: int, stop: int) -> np.ndarray:
        """:meth:`token_ids` as an int64 array; a slice of the prompt is a view of an array made when the
        request is made (a step's prompt chunk is one memory copy, not a conversion of Python ints)."""
        prompt = self.prompt_token_ids
        if stop > len(prompt):
            return np.asarray(self.token_ids(start, stop), dtype=np.int64)
        if self._prompt_array is None or self._prompt_array[0] is not prompt:
            self._prompt_array = (prompt, np.asarray(prompt, dtype=np.int64))
        return self._prompt_array[1][start:stop]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int, now: float | None = None) -> None:
        """Record a sampled token and finish the request when it hits a stop condition. A token its structured
        output's grammar does not allow (the request's other settings left the grammar no token, e.g.
        ``min_tokens`` past where the grammar must end) is not recorded: the request finishes with
        :attr:`FinishReason.ERROR` and :attr:`error` says why."""
        now = time.perf_counter() if now is None else now
        if self.first_token_time is None:
            self.first_token_time = now
        if self.grammar is not None and not self.grammar.accept(token_id):
            self.error = self._grammar_error(int(token_id))
            self.finish(FinishReason.ERROR, now)
            return
        self.output_token_ids.append(int(token_id))
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens and (token_id in params.stop_token_ids or (
                not params.ignore_eos and token_id in self.eos_token_ids)):
            self.finish(FinishReason.STOP, now)
        elif self.num_output_tokens >= params.max_tokens:
            self.finish(FinishReason.LENGTH, now)

    def _grammar_error(self, token_id: int) -> str:
        params = self.sampling_params
        why = ""
        if self.num_output_tokens < params.min_tokens:
            why = (f"; min_tokens ({params.min_tokens}) keeps the end of the sequence out where the grammar "
                   "must end")
        return (f"the structured output's grammar does not allow token {token_id} at output position "
                f"{self.num_output_tokens}: the request's settings left no allowed token to sample{why}")

    def finish(self, reason: FinishReason, now: float | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.perf_counter() if now is None else now

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first output token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (None with fewer than two outputs)."""
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival to the first step that scheduled it (None until then)."""
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time


@dataclass
class Logprob:
    """One token's log-probability at a position, its 1-based rank among the vocabulary (1: the most
    likely) and its text (set when the request finishes, with a tokenizer)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]   # token id -> Logprob: the chosen token and the top-k of one position


@dataclass
class CompletionOutput:
    """One completion of a prompt (as vLLM's): ``token_ids`` so far, ``text`` (decoded once finished; None
    without a tokenizer), ``logprobs`` one :data:`PositionLogprobs` per token when asked for, the sum of the
    chosen tokens' log-probabilities (``cumulative_logprob``, None when not asked for), and ``finish_reason``
    (None while running; ``error`` says why for :attr:`FinishReason.ERROR`)."""

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None   # with finish_reason ERROR: why

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What the engine reports about a request after a step (and, finished, at the end of ``generate``), in
    vLLM's shape: ``outputs[i]`` is completion ``i`` (one per engine request; ``LLM.generate`` with
    ``SamplingParams(n=...)`` groups them). ``prompt_logprobs``: ``[None, {...}, ...]``, one entry per prompt
    token when asked for.

    ``new_token_ids`` are the tokens this step added to ``outputs[0]`` (streaming) and ``new_logprobs`` their
    log-probabilities. ``prompt_token_ids`` is the request's own list (not a copy: streaming steps report
    thousands of requests a second); treat it as read-only. ``text``, ``output_token_ids`` and
    ``finish_reason`` are shortcuts to ``outputs[0]``. ``ttft`` (arrival to first token), ``queue_time``
    (arrival to first scheduled) and ``prefill_time`` (first scheduled to first token): the engine's, in
    seconds (None until known).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    ttft: float | None = None
    tpot: float | None = None
    num_preemptions: int = 0
    queue_time: float | None = None

    @property
    def prefill_time(self) -> float | None:
        return None if self.ttft is None or self.queue_time is None else self.ttft - self.queue_time

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def output_token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason

    @classmethod
    def of(cls, request: Request, new_token_ids: Sequence[int] = (), text: str | None = None,
           new_logprobs: list[PositionLogprobs] | None = None) -> "RequestOutput":
        """The output of ``request`` after a step that added ``new_token_ids`` (and ``new_logprobs``)."""
        completion = CompletionOutput(0, text, list(request.output_token_ids), request.cumulative_logprob,
                                      None if request.logprobs is None else list(request.logprobs),
                                      request.finish_reason, request.error)
        return cls(request.request_id, request.prompt, request.prompt_token_ids, [completion], request.is_finished,
                   list(new_token_ids), new_logprobs, request.prompt_logprobs, request.ttft, request.tpot,
                   request.num_preemptions, request.queue_time)
