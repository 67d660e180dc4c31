"""One HTTP generation request on the handler side: its engine submissions (one per prompt and choice), and
the events they bring back turned into text deltas, finish reasons and usage.

:class:`Generation` submits, waits for the engine to accept every submission (a refusal is the request's
error), then yields :class:`Delta` values until every choice has finished: one per choice for whatever has
arrived since the last one (one step's tokens, or several steps' when the consumer lags: a slow client gets
fewer, larger events, never a backlog of them); a timeout, a disconnect (the consumer closing the iterator)
or a stop string aborts the submissions still running in the engine. Choices with stop strings are matched
in a worker thread (the strings are the client's: their work stays off the event loop).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from tripath.engine.requests.request import FinishReason, PositionLogprobs, RequestOutput
from tripath.engine.requests.sampling_params import SamplingParams
from tripath.server.http.detokenize import IncrementalDetokenizer, StopMatcher
from tripath.server.metrics.metrics import PromptGroup
from tripath.server.transport.submissions import ACCEPTED, Engine, Failure, Submission

_ids = itertools.count()


class APIError(Exception):
    """An error answered with the OpenAI error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def __reduce__(self):   # pickled whole: the tokenizer helper process raises it for the API server to answer
        return type(self), (self.status, self.message, self.type, self.param, self.code)


@dataclass
class Delta:
    """New output of one choice: text, token ids (with their log-probabilities when asked for), and the
    finish reason on its last delta."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[PositionLogprobs] | None = None

    def extend(self, later: "Delta") -> None:
        """Append the choice's next delta to this one."""
        self.text += later.text
        self.token_ids += later.token_ids
        self.finish_reason = later.finish_reason or self.finish_reason
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs


@dataclass
class ChoiceState:
    """One choice as it streams. ``hidden``: its tokens are not returned (``max_tokens`` 0: the engine runs
    one token for the prompt's sake). Stop strings are matched once ``min_tokens`` tokens are out."""

    sub: Submission
    detokenizer: IncrementalDetokenizer
    stops: StopMatcher
    prompt_tokens: int
    hidden: bool = False
    min_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None   # the stop string or stop token id that ended it (None: EOS, length)

    @property
    def cumulative_logprob(self) -> float:
        return sum(entry[t].logprob for t, entry in zip(self.token_ids, self.logprobs or ()))

    def consume(self, out: RequestOutput) -> Delta:
        """The delta of one step's output (a ``RequestOutput``, or a ``StepOutput`` from the engine core; tokens
        after a stop string are dropped). The stop token that ended the choice (EOS, ``stop_token_ids``) stays in
        ``token_ids`` but adds no text unless ``include_stop_str_in_output`` (as vLLM: it shows when special
        tokens are kept, ``skip_special_tokens: false``)."""
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if self.hidden:
            if out.finished and self.finish_reason is None:
                self.finish_reason = "length"
            return Delta(self.sub.index, "", [], self.finish_reason)
        text, ids = [], []
        wants_logprobs = out.new_logprobs is not None
        logprobs = [] if wants_logprobs else None
        if wants_logprobs and self.logprobs is None:
            self.logprobs = []
        stop_token = len(out.new_token_ids) - 1 if out.finished and out.finish_reason is FinishReason.STOP \
            and not self.stops.include_stop else -1
        for j, token in enumerate(out.new_token_ids):
            if self.finish_reason is not None:
                break
            ids.append(token)
            self.token_ids.append(token)
            if wants_logprobs:
                logprobs.append(out.new_logprobs[j])
                self.logprobs.append(out.new_logprobs[j])
            if j == stop_token:
                break
            piece = self.detokenizer.push(token)
            if len(self.token_ids) <= self.min_tokens:
                text.append(piece)   # no stop string before min_tokens
                continue
            text.append(self.stops.feed(piece))
            if self.stops.stopped:
                self.finish_reason, self.stop_reason = "stop", self.stops.matched
        if out.finished and self.finish_reason is None:
            text.append(self.stops.feed(self.detokenizer.flush(), final=True))
            self.finish_reason = "stop" if self.stops.stopped or out.finish_reason is FinishReason.STOP else "length"
            if self.stops.stopped:
                self.stop_reason = self.stops.matched
            elif out.finish_reason is FinishReason.STOP and self.token_ids and \
                    self.token_ids[-1] in self.sub.params.stop_token_ids:
                self.stop_reason = self.token_ids[-1]
        piece = "".join(text)
        self.text += piece
        return Delta(self.sub.index, piece, ids, self.finish_reason, logprobs)


class Generation:
    """The engine side of one completions / chat request (``prompts`` x ``n`` choices: ``prompts`` and
    ``params`` hold one entry per choice, each prompt's ``choices_per_prompt`` choices one after the other, of
    which the client asked for ``n``). ``request_log``: says when each choice is submitted and ends
    (:class:`~tripath.server.metrics.request_log.RequestLog`)."""

    def __init__(self, engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
                 stops: list[str], timeout_s: float | None, prompt_tokens: int | None = None, *,
                 include_stop: bool = False, skip_special_tokens: bool = True, hidden: bool = False,
                 choices_per_prompt: int = 1, n: int | None = None, request_log=None):
        self.engine = engine
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.arrival = time.perf_counter()
        # usage counts each prompt once, however many choices share it (OpenAI's count)
        self.prompt_tokens = sum(len(p) for p in prompts) if prompt_tokens is None else prompt_tokens
        number, prefix = next(_ids), engine.request_id_prefix
        self.choices: list[ChoiceState] = []
        self.request_log = request_log
        group = None
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            if i % choices_per_prompt == 0:
                group = PromptGroup(choices_per_prompt if n is None else n, choices_per_prompt)
            sub = Submission(f"{prefix}-{number}-{i}", i, prompt, sp, self.loop, self.events, arrival=self.arrival,
                             group=group, request_log=request_log)
            self.choices.append(ChoiceState(sub, IncrementalDetokenizer(engine.tokenizer, skip_special_tokens),
                                            StopMatcher(stops, include_stop), len(prompt), hidden, sp.min_tokens))
        self._submitted = False

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    async def _next(self):
        remaining = None if self.deadline is None else self.deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise asyncio.TimeoutError
        return await asyncio.wait_for(self.events.get(), remaining)

    async def start(self) -> None:
        """Submit every choice and wait until the engine has accepted all of them (else raise APIError)."""
        self._submitted = True
        if self.request_log is not None:
            for c in self.choices:
                self.request_log.received(c.sub, self.engine.tokenizer)
        self.engine.submit([c.sub for c in self.choices])   # taken together, or refused together
        pending = len(self.choices)
        error = None
        early: list = []
        try:
            while pending:
                index, item = await self._next()
                if item is ACCEPTED:
                    pending -= 1
                elif isinstance(item, Failure):
                    pending -= 1
                    self.choices[index].finish_reason = "error"
                    error = error or item
                else:
                    early.append((index, item))
        except asyncio.TimeoutError:
            self.abort()
            raise APIError(504, "the request timed out before the engine accepted it", "timeout") from None
        if error is not None:   # one HTTP request refused: one rejection
            self.engine.metrics.rejected.labels(error.reason).inc()
            self.abort(None)
            raise APIError(error.status, error.message, error.type)
        for event in early:
            self.events.put_nowait(event)

    async def deltas(self) -> AsyncIterator[Delta]:
        """The choices' output until all have finished: per choice, one delta for what arrived since its last
        one. Raises APIError on a timeout or a failed step; aborts what is still running when it stops early
        (closed by a disconnecting client)."""
        try:
            while not self.finished:
                try:
                    batch = [await self._next()]
                except asyncio.TimeoutError:
                    raise APIError(504, "the request timed out", "timeout") from None
                while not self.events.empty():
                    batch.append(self.events.get_nowait())
                if any(self.choices[index].stops.stops for index, _ in batch):
                    deltas, failure, stopped = await self.loop.run_in_executor(None, self._consume, batch)
                else:
                    deltas, failure, stopped = self._consume(batch)
                for choice in stopped:
                    self.engine.abort(choice.sub.request_id, "stop")  # a stop string ended it
                for delta in deltas:
                    yield delta
                if failure is not None:
                    raise APIError(failure.status, failure.message, failure.type)
        finally:
            self.abort()

    def _consume(self, batch: list) -> tuple[list[Delta], Failure | None, list[ChoiceState]]:
        """A batch of events as one delta per choice (in the order they first appear, empty ones dropped), the
        failure that ends the request (the events after it are moot) and the choices a stop string ended."""
        merged: dict[int, Delta] = {}
        stopped, failure = [], None
        for index, item in batch:
            choice = self.choices[index]
            if choice.finish_reason is not None or item is ACCEPTED:
                continue  # output queued before this choice's stop string was seen
            if isinstance(item, Failure):
                failure = item
                break
            delta = choice.consume(item)
            if choice.finish_reason is not None and not item.finished:
                stopped.append(choice)
            if index in merged:
                merged[index].extend(delta)
            else:
                merged[index] = delta
        deltas = [d for d in merged.values() if d.text or d.token_ids or d.finish_reason]
        return deltas, failure, stopped

    def abort(self, outcome: str | None = "abort") -> None:
        """Abort every choice that has not finished (a no-op for the engine once it has); ``outcome``: their
        finish reason in the metrics (None: none, the request was refused)."""
        if not self._submitted:
            return
        for c in self.choices:
            if c.finish_reason is None:
                c.finish_reason = "abort"
                self.engine.abort(c.sub.request_id, outcome)
