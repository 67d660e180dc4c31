"""The in-process engine: one thread of the HTTP process owns the :class:`~tripath.engine.core.EngineCore`
(and so the GPU), builds it, and runs every ``add_request`` / ``step`` / ``abort`` on itself, fed by a command
queue (``tripath serve --engine-in-process``, and tests that patch the engine).

It serves the handlers' :class:`~tripath.server.submissions.Engine` interface as
:class:`~tripath.server.engine_client.EngineClient` (the default: the engine in its own process) does. The
loop blocks on the command queue while the engine is idle and steps while anything is in flight; a step's
outputs reach the handlers in one hand-over to the event loop (:class:`~tripath.server.submissions.SubmissionBook`).
A failed step fails exactly its requests (:mod:`~tripath.server.engine_steps`) and the loop goes on.
:meth:`EngineLoop.stop` aborts what is left (503), frees the model and the KV cache and ends the thread.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import traceback
from typing import Callable

from tripath.engine.core import EngineCore
from tripath.engine.engine_info import EngineInfo
from tripath.server.core_process import checked_engine
from tripath.server.engine_steps import add_request, close_engine, prepare_grammars, release_memory, take_step
from tripath.server.grammar_waits import GrammarWaits
from tripath.server.startup import cache_config
from tripath.server.submissions import SHUTTING_DOWN, Failure, Submission, SubmissionBook

log = logging.getLogger("tripath.server")


class EngineLoop:
    """Builds the engine core with ``make_engine()`` on its own thread and serves submissions until stopped;
    ``describe(info)``: the start-up log line of its :class:`~tripath.engine.engine_info.EngineInfo`."""

    def __init__(self, make_engine: Callable[[], EngineCore], metrics,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 describe: Callable[[EngineInfo], str] | None = None):
        self._make_engine = make_engine
        self.metrics = metrics
        self.request_id_prefix = "srv"
        self._on_fatal = on_fatal
        self._describe = describe   # the start-up log line of the built engine
        self._inbox: queue.Queue = queue.Queue()
        self._book = SubmissionBook(metrics)
        self._ready = threading.Event()
        self._stopping = False
        self.core: EngineCore | None = None
        self.tokenizer = None          # read-only to the handlers once ready
        self.vocab_size = 0
        self.max_model_len = 0
        self.max_num_seqs = 0
        self.generation_defaults: dict = {}   # the model's sampling defaults (EngineInfo.generation_defaults)
        self.startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tripath-engine", daemon=True)
        self._grammars = GrammarWaits(lambda: self.core.grammar_compiler(), lambda: self._inbox.put(("grammars", None)))

    # ---- from the server ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def ready(self) -> bool:
        """True once ``make_engine()`` has returned (the engine is built and warmed up) and until shutdown."""
        return self._ready.is_set() and not self._stopping

    @property
    def starting(self) -> bool:
        return not self._ready.is_set() and self.startup_error is None and not self._stopping

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def fatal_error(self) -> BaseException | None:
        if self._ready.is_set() and not self._stopping and not self._thread.is_alive():
            return RuntimeError("the engine thread has stopped")
        return None

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
            self.core = checked_engine(self._make_engine())
            info = self.core.info()
            self.tokenizer = self.core.tokenizer
            self.vocab_size, self.max_model_len, self.max_num_seqs = info.vocab_size, info.max_model_len, \
                info.max_num_seqs
            self.generation_defaults = dict(info.generation_defaults)
            prepare_grammars(self.core)
            self.metrics.engine_ready(self.max_model_len, cache_config(info))
            self.metrics.observe_engine(self.core.stats())
        except BaseException as error:  # noqa: BLE001 - reported to the server, which exits
            self.startup_error = error
            log.error("building the engine failed:\n%s", traceback.format_exc())
            if self._on_fatal is not None:
                self._on_fatal(error)
            return
        # Every object alive now lives as long as the server: moved out of the collector's generations, the
        # full collections of a long run no longer walk them (a pause of 0.2 s each on mha-tp8's heap).
        gc.freeze()
        self._ready.set()
        log.info("engine ready: %s", self._describe(info) if self._describe is not None else "")
        try:
            while not self._stopping:
                try:
                    self._drain(block=not self.core.has_unfinished_requests())
                    if not self._stopping and self.core.has_unfinished_requests():
                        self._step()
                except Exception as error:  # noqa: BLE001 - never leave requests hanging on a dead loop
                    log.error("the engine loop failed:\n%s", traceback.format_exc())
                    self._abort_all(Failure(500, f"the engine failed: {type(error).__name__}: {error}",
                                            "server_error"))
                finally:
                    self._book.flush()
        finally:
            self._shutdown()

    def _abort_all(self, failure: Failure) -> None:
        self._grammars.cancel_all()
        for request_id in self._book.request_ids():
            try:
                self.core.abort(request_id)
            finally:
                self._book.fail([request_id], failure)

    def _drain(self, block: bool) -> None:
        try:
            if block:
                due = self._grammars.seconds_to_deadline()
                command = self._inbox.get(timeout=0.5 if due is None else min(0.5, due + 1e-3))
            else:
                command = self._inbox.get_nowait()
        except queue.Empty:
            self._add_compiled()
            return
        while True:
            self._handle(*command)
            if self._stopping:
                return
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                self._add_compiled()
                return

    def _handle(self, kind: str, arg) -> None:
        if kind == "add":
            sub: Submission = arg
            self._book.register(sub)
            failure = None
            if sub.params.structured_output is not None:
                failure = self._grammars.start(sub.request_id, sub.prompt_token_ids, sub.params, sub)
                if failure is None:
                    return   # added once its grammar has compiled (_add_compiled)
            if failure is None:
                failure = add_request(self.core, sub.request_id, sub.prompt_token_ids, sub.params)
            self._added(sub, failure)
        elif kind == "abort":
            request_id, outcome = arg
            self._grammars.cancel(request_id)   # if it waits for its grammar
            if request_id in self._book:
                self.core.abort(request_id)
                self._book.end(request_id, outcome)
                self._book.publish(self.core.stats())
        elif kind == "stop":
            self._stopping = True

    def _added(self, sub: Submission, failure: Failure | None) -> None:
        if failure is None:
            self._book.accept(sub.request_id)
        else:
            self._book.refuse(sub.request_id, failure)

    def _add_compiled(self) -> None:
        """Add the requests whose grammars have compiled; refuse those whose compile failed or is overdue."""
        for wait, grammar, failure in self._grammars.settled():
            if failure is None:
                failure = add_request(self.core, wait.request_id, wait.prompt_token_ids, wait.params, grammar)
            self._added(wait.owner, failure)

    def _step(self) -> None:
        result = take_step(self.core)
        if any(failure.status >= 500 for _, failure in result.failed):
            self.metrics.step_failures.inc()
        num_new = self._book.outputs(result.outputs)
        for request_ids, failure in result.failed:
            self._book.fail(request_ids, failure)
        self._book.publish(self.core.stats(), num_new)

    def _shutdown(self) -> None:
        self._abort_all(SHUTTING_DOWN)
        self._book.publish(self.core.stats())
        self._book.flush()
        device = close_engine(self.core)
        self.core = None
        release_memory(device)
        log.info("engine stopped")
