"""How the engine core takes a step (:class:`StepRunner`, used by :class:`~tripath.engine.core.engine_core.EngineCore`),
and what a step gives back: :class:`StepResult`, its outputs and its failure (:class:`StepFailure`).

One ``step`` call::

 schedule N+1     scheduler.schedule(decode_steps): which requests, how many new tokens each
     │
 launch N+1       executor.launch(scheduled, previous=N): inputs, forward, sampling queued on the device
     │
 read N           LaunchedStep.sampled(): tokens to the scheduler (stop conditions, blocks freed), outputs
     ▼
 StepResult(outputs of N)

Without overlap (``async_scheduling`` off, tensor parallelism, speculative decoding's ``mtp`` method) a step is
read right after its launch. A step whose requests hold structured outputs reads the step before it first
(its grammar masks need that step's tokens). With speculative decoding the step in flight is read before the
next is scheduled while a request may draft (no more running requests than ``disable_by_batch_size``) or when
it verified drafts: steps overlap only while nothing is drafted.

Every failure ends in :class:`StepFailure`, logged once with its traceback (whose frames, and the step's
tensors they hold, are then released): a launch or a read that raises aborts the requests of the steps it
touched (a launched step before it is completed first, its outputs kept in the result); scheduling that
raises aborts the running requests (the waiting ones stay queued); anything else aborts the running
requests, else the waiting ones. A device out-of-memory error shrinks the scheduler's token budget. A
``BaseException`` (``KeyboardInterrupt``) aborts the same requests and propagates.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

from tripath.engine.requests.request import Request, RequestOutput
from tripath.engine.runner.launched_step import LaunchedStep, SampledStep
from tripath.engine.scheduling.scheduler import Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepFailure:
    """A step that failed: the requests it aborted (``request_ids``, their blocks freed), ``message`` (``the
    engine step failed: <type>: <error>``), ``cause`` (the exception's type name) and ``out_of_memory``
    (a device out-of-memory error: the scheduler now takes fewer tokens a step). ``error``: the exception
    itself (its traceback's frames cleared), for callers that raise it on."""

    request_ids: tuple[str, ...]
    message: str
    cause: str
    out_of_memory: bool
    error: BaseException | None = field(default=None, compare=False, repr=False)


@dataclass
class StepResult:
    """One step: ``outputs`` (a :class:`RequestOutput` for each request that gained a token or finished; with
    a failure, those of the step before it that were read), and ``failure`` (None when nothing failed)."""

    outputs: list[RequestOutput] = field(default_factory=list)
    failure: StepFailure | None = None


class _Failed(Exception):
    """A step failed (internal): ``failure`` and the outputs read before it."""

    def __init__(self, failure: StepFailure, outputs: list[RequestOutput]):
        super().__init__(failure.message)
        self.failure, self.outputs = failure, outputs


class StepRunner:
    """The step loop of one engine: ``scheduler`` plans, ``runner`` (an executor) launches; ``overlap``:
    launch step N + 1 before reading step N; ``pacer``: a :class:`~tripath.engine.scheduling.step_pacing.StepPacer`
    timing one-step launches, or None; ``step_tokens``: counts each model step's new tokens;
    ``finished_text(request)``: a finished request's text (None: not decoded)."""

    def __init__(self, scheduler: Scheduler, runner, overlap: bool, pacer, step_tokens,
                 finished_text: Callable[[Request], str | None]):
        self.scheduler, self.runner, self.overlap = scheduler, runner, overlap
        self._pacer, self._step_tokens, self._finished_text = pacer, step_tokens, finished_text
        self._inflight: tuple[SchedulerOutput, LaunchedStep] | None = None   # launched, tokens not read yet
        self.num_steps = 0

    def step(self, decode_steps: int) -> StepResult:
        """One step (see the module doc); never raises an ``Exception``."""
        try:
            return StepResult(self._step(decode_steps))
        except _Failed as failed:
            return StepResult(failed.outputs, failed.failure)
        except Exception as error:  # noqa: BLE001 - outside a step's run: what runs fails, else the queue
            scheduler = self.scheduler
            victims = [r.request_id for r in scheduler.running] or [r.request_id for r in scheduler.waiting]
            for request_id in victims:
                scheduler.abort(request_id)
            return StepResult([], self._failure(error, victims))

    def _step(self, decode_steps: int) -> list[RequestOutput]:
        previous, self._inflight = self._inflight, None
        early: list[RequestOutput] | None = None   # the outputs of ``previous`` when read before the launch
        if previous is not None and self._read_first(previous[0]):
            early, previous = self._read_before(previous, None), None
        try:
            out = self.scheduler.schedule(decode_steps)
        except Exception as error:  # noqa: BLE001 - no step was formed: what ran is failed, nothing is lost unseen
            outputs = self._read(previous) if previous is not None else early or []
            running = [r.request_id for r in list(self.scheduler.running)]
            for request_id in running:
                self.scheduler.abort(request_id)
            raise _Failed(self._failure(error, running), outputs) from None
        if out.is_empty:
            if previous is None:
                if self.scheduler.has_unfinished and early is None:
                    raise RuntimeError("the scheduler could not schedule any unfinished request")
                return early or []
            return self._read(previous)
        if self.overlap and previous is not None and any(s.request.grammar is not None for s in out.scheduled):
            early = self._read_before(previous, out)   # the grammars' masks need the previous step's tokens
            out.scheduled = [s for s in out.scheduled if not s.request.is_finished]  # the read ended them
            if not out.scheduled:
                return early
            previous = None   # read: every input token of ``out`` is on the host now
        try:
            started = time.perf_counter()
            launched = self.runner.launch(out.scheduled, None if previous is None else previous[1],
                                          num_steps=out.num_steps)
            if self.overlap:
                self._inflight = (out, launched)
            else:
                sampled = launched.sampled()
            if self._pacer is not None and out.num_steps == 1:
                self._pacer.observe(sum(item.num_new_tokens for item in out.scheduled), time.perf_counter() - started)
        except Exception as error:  # noqa: BLE001 - fails this step's requests only
            outputs = early or []
            try:
                if previous is not None and early is None:
                    outputs = self._read(previous)
            finally:
                failed = self._abort_scheduled(out)
            raise _Failed(self._failure(error, failed), outputs) from None
        except BaseException:
            try:
                if previous is not None and early is None:
                    self._read(previous)
            finally:
                self._abort_scheduled(out)
            raise
        self.num_steps += 1
        self._step_tokens.observe(out.num_tokens, out.num_steps)
        if not self.overlap:
            return self._complete(out, sampled)
        if early is not None:
            return early
        if previous is None:
            return []
        try:
            return self._read(previous)
        except Exception as error:  # noqa: BLE001
            self._inflight = None
            raise _Failed(self._failure(error, self._abort_scheduled(previous[0], out)), []) from None
        except BaseException:
            self._inflight = None
            self._abort_scheduled(previous[0], out)
            raise

    def _read_first(self, previous: SchedulerOutput) -> bool:
        """Whether to read the step in flight before scheduling the next (speculative decoding): drafting
        needs every token on the host, and a verify's yield (how many of its drafts it kept) moves its
        request's next positions."""
        return self.scheduler.speculation is not None and (
            self.scheduler.may_draft() or any(item.draft_token_ids for item in previous.scheduled))

    def _read_before(self, previous: tuple[SchedulerOutput, LaunchedStep], out: SchedulerOutput | None
                     ) -> list[RequestOutput]:
        """Read ``previous`` before launching ``out`` (a step with structured output; None: before scheduling
        the next step); on failure ``out``'s requests are aborted too."""
        outs = (previous[0],) if out is None else (previous[0], out)
        try:
            return self._read(previous)
        except Exception as error:  # noqa: BLE001
            raise _Failed(self._failure(error, self._abort_scheduled(*outs)), []) from None
        except BaseException:
            self._abort_scheduled(*outs)
            raise

    def _failure(self, error: Exception, request_ids: list[str]) -> StepFailure:
        """The :class:`StepFailure` for ``error``: logged with its traceback, whose frames (and the step's
        tensors they hold) are then released; on a device out-of-memory error the token budget shrinks."""
        logger.error("a step failed; its %d requests are aborted:\n%s", len(request_ids),
                     "".join(traceback.format_exception(error)))
        traceback.clear_frames(error.__traceback__)
        out_of_memory = isinstance(error, torch.OutOfMemoryError)
        if out_of_memory:
            budget = self.scheduler.shrink_token_budget()
            logger.warning("out of device memory in a step: the scheduler now takes at most %d tokens a step",
                           budget)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return StepFailure(tuple(request_ids), f"the engine step failed: {type(error).__name__}: {error}",
                           type(error).__name__, out_of_memory, error)

    def _read(self, launched: tuple[SchedulerOutput, LaunchedStep]) -> list[RequestOutput]:
        """Wait for a launched step's tokens and complete it."""
        out, step = launched
        return self._complete(out, step.sampled())

    def _complete(self, out: SchedulerOutput, sampled: SampledStep) -> list[RequestOutput]:
        """Hand a finished step's tokens to the scheduler and its log-probabilities to their requests; the
        outputs of the requests that gained a token or finished."""
        before = [item.request.num_output_tokens for item in out.scheduled]
        finished = {id(r) for r in self.scheduler.update(out, sampled.tokens)}
        outputs = []
        for i, (item, count) in enumerate(zip(out.scheduled, before)):
            request = item.request
            new = request.output_token_ids[count:]
            new_logprobs = None
            if sampled.logprobs[i] is not None and request.logprobs is not None:
                new_logprobs = sampled.logprobs[i][:len(new)]   # tokens after a stop are dropped
                request.logprobs.extend(new_logprobs)
                request.cumulative_logprob += sum(entry[token].logprob for token, entry in zip(new, new_logprobs))
            if sampled.prompt_logprobs[i] is not None and request.prompt_logprobs is not None:
                request.prompt_logprobs.extend(sampled.prompt_logprobs[i])
            if new or id(request) in finished:
                text = self._finished_text(request) if request.is_finished else None
                outputs.append(RequestOutput.of(request, new, text, new_logprobs))
        return outputs

    def _abort_scheduled(self, *outs: SchedulerOutput) -> list[str]:
        """Abort the unfinished requests of ``outs``; their ids."""
        aborted = []
        for out in outs:
            for item in out.scheduled:
                if not item.request.is_finished and self.scheduler.abort(item.request.request_id) is not None:
                    aborted.append(item.request.request_id)
        return aborted
