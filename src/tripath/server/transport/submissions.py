"""What the HTTP handlers and an engine exchange, whichever way the engine runs (a thread of the HTTP process,
:mod:`~tripath.server.transport.in_process`, or its own process, :mod:`~tripath.server.transport.engine_client`).

A handler submits a :class:`Submission` (one engine request: one prompt and choice of an HTTP request) and
reads its asyncio queue: first :data:`ACCEPTED` or a :class:`Failure` for the add, then each step's output
(an object with ``request_id``, ``new_token_ids``, ``new_logprobs``, ``prompt_logprobs``, ``finished`` and
``finish_reason``: a :class:`~tripath.server.transport.core_wire.StepOutput`)
until the finished one, or a :class:`Failure` that ends it. Every queue item is ``(index, item)``, ``index``
the submission's choice.

:class:`SubmissionBook` is the engine side's record of the submissions in flight and of their metrics; it
queues the items of a step and hands them to the event loop in one go per step (per event loop), not one
per request: at once when it runs on that loop (the core process's updates, read by the loop), else in one
``call_soon_threadsafe`` (the in-process core loop's thread, or a worker thread failing what is left). The
event loop may :meth:`~SubmissionBook.register` and :meth:`~SubmissionBook.end` beside a delivering thread
(single dict operations, atomic in CPython), so a submission is ended exactly once, by whoever pops it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence

from tripath.engine.requests.sampling_params import SamplingParams
from tripath.server.metrics.metrics import ChoiceTimes, PromptGroup, ServerMetrics

ACCEPTED = "accepted"
# the engine's finish reasons as the metrics name them (vLLM's)
FINISH_REASONS = {"stop": "stop", "length": "length", "aborted": "abort"}


# why an add was refused, by status, where the refusal names no reason of its own
REFUSAL_REASONS = {400: "invalid_request", 500: "engine_error", 503: "unavailable"}


@dataclass
class Failure:
    """A request the engine refused (400) or lost to a failed step (500 / 503 out of memory) or to shutdown
    (503). ``reason``: for a refused add, why, as ``tripath:requests_rejected_total{reason}`` counts it
    (``queue_full``, ``duplicate_request_id``, ``grammar_timeout``, ``shutting_down``, ``engine_gone``; by
    default from the status: :data:`REFUSAL_REASONS`)."""

    status: int
    message: str
    type: str = "invalid_request_error"
    reason: str | None = None

    def __post_init__(self):
        if self.reason is None:
            self.reason = REFUSAL_REASONS.get(self.status, "error")


SHUTTING_DOWN = Failure(503, "the server is shutting down", "server_error", "shutting_down")


@dataclass(eq=False)
class Submission:
    """One engine request of an HTTP request (``index``: its choice), and where its events go; ``arrival``:
    when the HTTP request arrived (``perf_counter``), the start of its latency metrics; ``group``: the
    choices of its prompt (per-prompt metrics); ``request_log``: the request log that says when it ends
    (:class:`~tripath.server.metrics.request_log.RequestLog`, with ``--enable-log-requests``)."""

    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrival: float = field(default_factory=time.perf_counter)
    times: ChoiceTimes | None = None   # set once the engine has accepted it
    group: PromptGroup | None = None
    request_log: object | None = None


class Engine(Protocol):
    """What the handlers use of an engine (:class:`~tripath.server.transport.in_process.InProcessClient`,
    :class:`~tripath.server.transport.engine_client.EngineClient`). The facts (``tokenizer`` … ``generation_defaults``)
    are set once ``ready``; ``startup_error``: the engine could not be built; ``fatal_error``: it stopped
    serving without being asked to (the server then exits)."""

    metrics: ServerMetrics
    request_id_prefix: str   # engine request ids are ``<prefix>-<number>-<choice>``
    tokenizer: object
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    generation_defaults: dict
    startup_error: BaseException | None

    @property
    def ready(self) -> bool: ...
    @property
    def starting(self) -> bool: ...
    @property
    def alive(self) -> bool: ...
    @property
    def fatal_error(self) -> BaseException | None: ...
    def start(self) -> None: ...
    def wait_ready(self, timeout: float | None = None) -> bool: ...
    def submit(self, subs: Sequence[Submission]) -> None: ...
    def abort(self, request_id: str, outcome: str | None = "abort") -> None: ...
    def stop(self, timeout: float = 30.0) -> None: ...


def _put_all(items: list[tuple[Submission, object]]) -> None:
    for sub, item in items:
        sub.events.put_nowait((sub.index, item))


class SubmissionBook:
    """The submissions an engine holds, their metrics (:class:`~tripath.server.metrics.metrics.ServerMetrics`), and
    the items queued for their handlers until :meth:`flush`."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self._subs: dict[str, Submission] = {}
        self._pending: list[tuple[Submission, object]] = []
        self._lock = threading.Lock()   # _pending: the delivering thread, and stop() failing what is left

    def __len__(self) -> int:
        return len(self._subs)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._subs

    def request_ids(self) -> list[str]:
        return list(self._subs)

    def register(self, sub: Submission) -> None:
        """Track ``sub`` before the engine has accepted it (its add is on the way)."""
        self._subs[sub.request_id] = sub

    def accept(self, request_id: str) -> None:
        """The engine took the request: its metrics start, its handler gets :data:`ACCEPTED`."""
        sub = self._subs.get(request_id)
        if sub is not None:
            sub.times = ChoiceTimes(sub.arrival, len(sub.prompt_token_ids), sub.params.max_tokens)
            self._queue(sub, ACCEPTED)

    def refuse(self, request_id: str, failure: Failure) -> None:
        """The engine did not take the request: its handler gets ``failure`` (no metrics here: the handler
        counts its HTTP request as rejected, :meth:`~tripath.server.http.generation.Generation.start`)."""
        sub = self._subs.pop(request_id, None)
        if sub is not None:
            self.metrics.observe_refused(sub.group)
            if sub.request_log is not None:
                sub.request_log.refused(sub, failure)
            self._queue(sub, failure)

    def end(self, request_id: str, reason: str | None) -> Submission | None:
        """Forget a request that ended (``reason``: its finish reason in the metrics; None: withdrawn with an
        HTTP request that was refused, which the metrics count as a rejection, not as an ended request); its
        submission, or None when it had ended already."""
        sub = self._subs.pop(request_id, None)
        if sub is not None:
            now = time.perf_counter()
            if reason is None:   # withdrawn with a refused HTTP request: a rejection, not an ended request
                self.metrics.observe_refused(sub.group)
            else:
                self.metrics.observe_end(sub.times, reason, now, sub.group)
            if sub.request_log is not None:
                sub.request_log.finished(sub, reason or "withdrawn", now)
        return sub

    def outputs(self, outputs: Iterable, now: float | None = None) -> int:
        """Queue a step's outputs for their handlers (and their tokens and ends for the metrics); the number
        of new tokens they bring (of requests still in flight: the tokens an engine core made for a request
        between its client's abort and the core's receiving it are nobody's)."""
        now = time.perf_counter() if now is None else now
        num_new = 0
        for out in outputs:
            sub = self._subs.get(out.request_id)
            if sub is None:
                continue
            num_new += len(out.new_token_ids)
            times = sub.times
            if times is not None:
                if times.first_token is None:   # the engine's timeline comes with the first tokens
                    times.queue_time = getattr(out, "queue_time", None)
                    times.prefill_time = getattr(out, "prefill_time", None)
                self.metrics.observe_tokens(times, len(out.new_token_ids), now)
            if out.finished:
                self.end(out.request_id, FINISH_REASONS.get(out.finish_reason.value, "error"))
            self._queue(sub, out)
        return num_new

    def fail(self, request_ids: Sequence[str], failure: Failure) -> None:
        """End these requests with ``failure`` (the metrics count them ``abort`` for a 503, else ``error``)."""
        reason = "abort" if failure.status == 503 else "error"
        for request_id in request_ids:
            sub = self.end(request_id, reason)
            if sub is not None:
                self._queue(sub, failure)

    def fail_all(self, failure: Failure) -> None:
        self.fail(self.request_ids(), failure)

    def publish(self, stats, num_new_tokens: int = 0) -> None:
        """The engine's :class:`~tripath.engine.scheduling.stats.EngineStats` after a step, to the metrics."""
        self.metrics.observe_engine(stats, num_new_tokens)

    def _queue(self, sub: Submission, item) -> None:
        with self._lock:
            self._pending.append((sub, item))

    def flush(self) -> None:
        """Hand the queued items to their event loops: at once to the running one, one
        ``call_soon_threadsafe`` to each other."""
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for sub, item in pending:
            by_loop.setdefault(sub.loop, []).append((sub, item))
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        for loop, items in by_loop.items():
            if loop is here:   # delivered on the loop itself (the engine core's updates): at once
                _put_all(items)
                continue
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass
