"""The engine core on a thread of the HTTP process (``tripath serve --engine-in-process``, and tests that patch
the engine): :class:`InProcessClient` builds the :class:`~tripath.engine.core.engine_core.EngineCore` on its own thread
and runs the same :class:`~tripath.server.transport.core_loop.CoreLoop` over it as the core process does — the
arrival window, grammar waits, failure handling and stop are the loop's — through a
:class:`~tripath.server.transport.core_frontends.LocalChannel` instead of pipes: commands are queued and wake the
loop's poll, messages are handed to the client on the loop's thread, unpickled.

It serves the handlers' :class:`~tripath.server.transport.submissions.Engine` interface as
:class:`~tripath.server.transport.engine_client.EngineClient` (the default: the engine in its own process) does: an
update's items reach the handlers in one hand-over to the event loop
(:class:`~tripath.server.transport.submissions.SubmissionBook`). :meth:`InProcessClient.stop` ends what is in flight
(503), has the loop release the model and the KV cache, and ends the thread.
"""

from __future__ import annotations

import gc
import logging
import threading
import traceback
from typing import Callable

from tripath.engine.core.engine_core import EngineCore
from tripath.engine.core.engine_info import EngineInfo
from tripath.server.transport.core_frontends import LocalChannel
from tripath.server.transport.core_loop import CoreLoop
from tripath.server.transport.core_messages import Abort, Ready, Stop, Update
from tripath.server.transport.core_process import checked_engine
from tripath.server.transport.core_wire import load_tokenizer_handle
from tripath.server.transport.engine_front import EngineFront
from tripath.server.transport.engine_steps import prepare_grammars
from tripath.server.transport.submissions import SHUTTING_DOWN, Failure

log = logging.getLogger("tripath.server")


class InProcessClient(EngineFront):
    """Builds the engine core with ``make_engine()`` on its own thread and serves it with a
    :class:`CoreLoop` until stopped (see the module doc); ``describe(info)``: the start-up log line."""

    def __init__(self, make_engine: Callable[[], EngineCore], metrics,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 describe: Callable[[EngineInfo], str] | None = None):
        super().__init__(metrics, on_fatal)
        self._make_engine = make_engine
        self._describe = describe
        self._channel = LocalChannel(self._on_message)
        self._loop: CoreLoop | None = None
        self._thread = threading.Thread(target=self._run, name="tripath-engine", daemon=True)

    # ---- the Engine interface ---------------------------------------------------------------------------
    @property
    def core(self) -> EngineCore | None:
        """The engine core while the loop holds it (None before it is built and once it is released)."""
        loop = self._loop
        return None if loop is None else loop.core

    @property
    def starting(self) -> bool:
        return not self._settled.is_set() and not self._stopping

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def fatal_error(self) -> BaseException | None:
        if self._ready.is_set() and not self._stopping and not self._thread.is_alive():
            return RuntimeError("the engine thread has stopped")
        return None

    def start(self) -> None:
        self._thread.start()

    def _refusal(self) -> Failure | None:
        if self._stopping:
            return SHUTTING_DOWN
        if self.fatal_error is not None:
            return Failure(500, "the engine thread has stopped", "server_error", "engine_gone")
        return None

    def _send_command(self, command) -> None:
        self._channel.put(command)

    def abort(self, request_id: str, outcome: str | None = "abort") -> None:
        """Abort a request (``outcome``: its finish reason in the metrics, ``abort`` or ``stop``; None:
        withdrawn, see :meth:`SubmissionBook.end`)."""
        if self._book.end(request_id, outcome) is not None:
            self._channel.put(Abort(request_id))

    def stop(self, timeout: float = 30.0) -> None:
        """End what is in flight (503), have the loop release the engine, and wait up to ``timeout`` for the
        thread to end; idempotent."""
        self._stopping = True
        self._book.fail_all(SHUTTING_DOWN)
        self._book.flush()
        self._channel.put(Stop())
        if self._thread.is_alive():
            self._thread.join(timeout)
            log.info("engine stopped")
        elif self._thread.ident is None:   # never started: nobody else closes the channel
            self._channel.close()

    # ---- the thread -------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            try:
                core = checked_engine(self._make_engine())
            except BaseException as error:  # noqa: BLE001 - reported to the server, which exits
                self.startup_error = error
                log.error("building the engine failed:\n%s", traceback.format_exc())
                self._settled.set()
                if self._on_fatal is not None:
                    self._on_fatal(error)
                return
            prepare_grammars(core)
            # Every object alive now lives as long as the server: moved out of the collector's generations, the
            # full collections of a long run no longer walk them (each a pause that grows with the heap).
            gc.freeze()
            self._loop = CoreLoop(core, [self._channel], describe=self._describe)
            del core   # the loop holds the engine alone: released, it is collected
            self._loop.run()
        finally:
            self._channel.close()

    def _outputs_of(self, update: Update) -> list:
        return update.outputs   # handed over unencoded: the engine's RequestOutputs

    def _on_message(self, message) -> None:
        """(The loop's thread:) a message of the core's loop."""
        if isinstance(message, Update):
            self._take_update(message)
        elif isinstance(message, Ready):
            self._take_facts(message, load_tokenizer_handle(message.tokenizer))
