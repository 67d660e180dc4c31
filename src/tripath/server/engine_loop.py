"""The engine loop: one thread owns the :class:`~tripath.engine.LLM` (and so the GPU), builds it, and runs every
``add_request`` / ``step`` / ``abort_request`` on itself, fed by a command queue.

HTTP handlers never touch the engine: they :meth:`EngineLoop.submit` a :class:`Submission` and read its
asyncio queue, which the thread fills (through ``call_soon_threadsafe``) with :data:`ACCEPTED` or a
:class:`Failure` for the add, then each step's :class:`~tripath.engine.RequestOutput` until the finished one.
The loop blocks on the command queue while the engine is idle and steps while anything is in flight. A
step that raises fails exactly the requests it scheduled (``LLM.step`` aborts them, freeing their blocks,
and names them in :class:`~tripath.engine.StepFailed`): 503 when the device ran out of memory (the
scheduler then takes smaller steps), 500 otherwise; the loop goes on. :meth:`EngineLoop.stop` aborts what is left, frees the model and
the KV cache and ends the thread.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

from tripath.engine.errors import StepFailed
from tripath.engine.request import SamplingParams
from tripath.server.metrics import ChoiceTimes

log = logging.getLogger("tripath.server")

ACCEPTED = "accepted"
# the engine's finish reasons as the metrics name them (vLLM's)
FINISH_REASONS = {"stop": "stop", "length": "length", "aborted": "abort"}


@dataclass
class Failure:
    """A request the engine refused (400) or lost to a failed step (500) or to shutdown (503)."""

    status: int
    message: str
    type: str = "invalid_request_error"


@dataclass(eq=False)
class Submission:
    """One engine request of an HTTP request (``index``: its choice), and where its events go; ``arrival``:
    when the HTTP request arrived (``perf_counter``), the start of its latency metrics."""

    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrival: float = field(default_factory=time.perf_counter)
    times: ChoiceTimes | None = None   # set by the engine thread once the engine has accepted it

    def deliver(self, item) -> None:
        """From the engine thread: queue ``(index, item)`` for the handler."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, item))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class EngineLoop:
    """Builds the engine with ``make_llm()`` on its own thread and serves submissions until stopped."""

    def __init__(self, make_llm: Callable[[], object], metrics, on_fatal: Callable[[BaseException], None] | None = None,
                 describe: Callable[[object], str] | None = None):
        self._make_llm = make_llm
        self.metrics = metrics
        self._on_fatal = on_fatal
        self._describe = describe   # the start-up log line of the built engine
        self._inbox: queue.Queue = queue.Queue()
        self._subs: dict[str, Submission] = {}
        self._ready = threading.Event()
        self._done = threading.Event()
        self._stopping = False
        self.llm = None
        self.tokenizer = None          # read-only to the handlers once ready
        self.vocab_size = 0
        self.max_model_len = 0
        self.max_num_seqs = 0
        self.generation_defaults: dict = {}   # the model's sampling defaults (LLM.generation_defaults)
        self.startup_error: BaseException | None = None
        self.num_running = 0
        self.num_waiting = 0
        self._thread = threading.Thread(target=self._run, name="tripath-engine", daemon=True)

    # ---- from the server ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def ready(self) -> bool:
        """True once ``make_llm()`` has returned (the engine is built and warmed up) and until shutdown."""
        return self._ready.is_set() and not self._stopping

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready.wait(timeout)
        return self._ready.is_set()

    def submit(self, sub: Submission) -> None:
        self._inbox.put(("add", sub))

    def abort(self, request_id: str, outcome: str = "abort") -> None:
        """Abort a request (``outcome`` is its finish reason in the metrics: ``abort``, or ``stop`` for a stop
        string)."""
        self._inbox.put(("abort", (request_id, outcome)))

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything in flight, release the engine and end the thread (waits up to ``timeout``)."""
        self._stopping = True
        self._inbox.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.llm = self._make_llm()
            self.tokenizer = self.llm.tokenizer
            self.vocab_size = int(self.llm.model.config.vocab_size)
            self.max_model_len = int(self.llm.runner.max_model_len)
            self.max_num_seqs = int(self.llm.config.max_num_seqs)
            self.generation_defaults = dict(getattr(self.llm, "generation_defaults", {}))
            self.metrics.engine_ready(self.max_model_len)
            self.metrics.observe_engine(self.llm.stats())
        except BaseException as error:  # noqa: BLE001 - reported to the server, which exits
            self.startup_error = error
            log.error("building the engine failed:\n%s", traceback.format_exc())
            if self._on_fatal is not None:
                self._on_fatal(error)
            self._done.set()
            return
        # Every object alive now lives as long as the server: moved out of the collector's generations, the
        # full collections of a long run no longer walk them (a pause of 0.2 s each on mha-tp8's heap).
        gc.freeze()
        self._ready.set()
        log.info("engine ready: %s", self._describe(self.llm) if self._describe is not None else "")
        try:
            while not self._stopping:
                try:
                    self._drain(block=not self.llm.has_unfinished_requests())
                    if not self._stopping and self.llm.has_unfinished_requests():
                        self._step()
                except Exception as error:  # noqa: BLE001 - never leave requests hanging on a dead loop
                    log.error("the engine loop failed:\n%s", traceback.format_exc())
                    self._fail_all(Failure(500, f"the engine failed: {type(error).__name__}: {error}",
                                           "server_error"))
        finally:
            self._shutdown()

    def _fail_all(self, failure: Failure) -> None:
        reason = "abort" if failure.status == 503 else "error"
        for request_id in list(self._subs):
            try:
                self.llm.abort_request(request_id)
            finally:
                self._end(request_id, reason).deliver(failure)

    def _end(self, request_id: str, reason: str) -> Submission | None:
        """Forget a request that ended (``reason``: its finish reason in the metrics); its submission."""
        sub = self._subs.pop(request_id, None)
        if sub is not None and sub.times is not None:
            self.metrics.observe_end(sub.times, reason, time.perf_counter())
        return sub

    def _drain(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*command)
            if self._stopping:
                return
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, arg) -> None:
        llm = self.llm
        if kind == "add":
            sub: Submission = arg
            try:
                llm.add_request(sub.prompt_token_ids, sub.params, request_id=sub.request_id)
            except (ValueError, TypeError) as error:
                sub.deliver(Failure(400, str(error)))
                return
            except Exception as error:  # noqa: BLE001 - the request fails, the engine goes on
                log.error("adding a request failed:\n%s", traceback.format_exc())
                sub.deliver(Failure(500, f"adding the request failed: {type(error).__name__}: {error}",
                                    "server_error"))
                return
            sub.times = ChoiceTimes(sub.arrival, len(sub.prompt_token_ids), sub.params.max_tokens)
            self._subs[sub.request_id] = sub
            sub.deliver(ACCEPTED)
        elif kind == "abort":
            request_id, outcome = arg
            if request_id in self._subs:
                llm.abort_request(request_id)
                self._end(request_id, outcome)
                self._publish()
        elif kind == "stop":
            self._stopping = True

    def _step(self) -> None:
        llm = self.llm
        try:
            outputs = llm.step()
        except StepFailed as error:  # the step's requests were aborted: fail exactly those, serve the rest
            self.metrics.step_failures.inc()
            num_new = self._deliver(error.outputs)
            failure = Failure(503 if error.out_of_memory else 500, str(error), "server_error")
            for request_id in error.request_ids:
                sub = self._end(request_id, "error")
                if sub is not None:
                    sub.deliver(failure)
            self._publish(num_new)
            return
        except Exception as error:  # noqa: BLE001 - one failed step must not stop the server
            log.error("engine step failed:\n%s", traceback.format_exc())
            self.metrics.step_failures.inc()
            # A failure outside a step's run (in the scheduler) fails what was running, or else the queue.
            victims = [r.request_id for r in llm.scheduler.running] or [r.request_id for r in llm.scheduler.waiting]
            for request_id in victims:
                llm.abort_request(request_id)
                sub = self._end(request_id, "error")
                if sub is not None:
                    sub.deliver(Failure(500, f"the engine step failed: {type(error).__name__}: {error}",
                                        "server_error"))
            self._publish()
            return
        self._publish(self._deliver(outputs))

    def _deliver(self, outputs) -> int:
        """Hand each output to its request's subscriber (and its tokens and end to the metrics); the number
        of new tokens."""
        num_new, now = 0, time.perf_counter()
        for out in outputs:
            num_new += len(out.new_token_ids)
            sub = self._subs.get(out.request_id)
            if sub is None:
                continue
            self.metrics.observe_tokens(sub.times, len(out.new_token_ids), now)
            if out.finished:
                self._end(out.request_id, FINISH_REASONS.get(out.finish_reason.value, "error"))
            sub.deliver(out)
        return num_new

    def _publish(self, num_new_tokens: int = 0) -> None:
        stats = self.llm.stats()
        self.num_running, self.num_waiting = stats.num_running, stats.num_waiting
        self.metrics.observe_engine(stats, num_new_tokens)

    def _shutdown(self) -> None:
        self._fail_all(Failure(503, "the server is shutting down", "server_error"))
        self._publish()
        device = getattr(getattr(self.llm, "config", None), "device", None)
        self.llm = None
        gc.unfreeze()  # the engine's objects may be in reference cycles: collectable again
        gc.collect()
        if device is not None and getattr(device, "type", None) == "cuda":
            import torch

            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        self._done.set()
        log.info("engine stopped")
