"""The engine seen from the HTTP process when it runs in its own process (the default of ``tripath serve``):
:class:`EngineClient` starts the engine core process (:mod:`~tripath.server.transport.core_process`, spawned; its
:class:`~tripath.server.transport.core_loop.CoreLoop`) and serves the handlers'
:class:`~tripath.server.transport.submissions.Engine` interface as the in-process
:class:`~tripath.server.transport.in_process.InProcessClient` does (both are an
:class:`~tripath.server.transport.engine_front.EngineFront`), so the routes do not know which one they talk to.

The event loop that serves the requests talks to the core over two pipes (the messages of
:mod:`~tripath.server.transport.core_messages`, framed by :mod:`~tripath.server.transport.core_wire`),
both non-blocking and watched by the loop itself (``add_reader`` / ``add_writer``), so no thread hands a
message over: the handlers' adds and aborts of one pass of the loop go out as one message (what the pipe
cannot take yet waits in a buffer the loop writes out as it drains, never blocking it); the core's
messages — the engine's facts once it is built (the HTTP process then loads its own tokenizer, never the
weights, in a worker thread), then one update per step — are read as they arrive, each update's items
handed to the handlers (:class:`~tripath.server.transport.submissions.SubmissionBook`) and its metrics observed.
Under load a reader thread would wait for the interpreter lock at every read (the loop holds it much of
the time), and so would every add on a writer thread.

Failures keep the in-process semantics: a refused add or a failed step fails exactly its requests; ``stop``
ends what is left with 503, tells the core to release the engine and waits for it (SIGKILL past the
timeout). A core that dies (killed, crashed) closes its pipe: the loop reads the end of it, fails every
request in flight with 500, ``fatal_error`` names the exit, ``/health`` answers 503 and the server exits
(``on_fatal``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

from tripath.engine.core.engine_core import EngineCore
from tripath.engine.core.engine_info import EngineInfo
from tripath.server.transport.core_messages import Abort, Add, Ready, StartFailed, Stop, Stopped, Update
from tripath.server.transport.core_process import LOG_FORMAT, CoreSpec, core_main
from tripath.server.transport.core_wire import READ_BYTES, FrameReader, Outbox, frame, load_tokenizer_handle, widen
from tripath.server.transport.engine_front import EngineFront
from tripath.server.transport.submissions import SHUTTING_DOWN, Failure

log = logging.getLogger("tripath.server")

KILL_GRACE_S = 5.0   # after stop's timeout, or at exit: how long a core may take to go before SIGKILL


class EngineStartError(RuntimeError):
    """The engine core could not build the engine (the message is the core's error)."""


@contextlib.contextmanager
def stop_signals_ignored():
    """SIGINT and SIGTERM ignored while the core is spawned (it inherits that, so a terminal's Ctrl-C cannot
    kill it before it installs its own handlers); only the main thread may change them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def exit_text(code: int | None) -> str:
    if code is None:
        return "is not responding"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def start_core(spec: CoreSpec, count: int):
    """Spawn the engine core for ``count`` HTTP processes: the core's ``multiprocessing.Process`` and, for each
    HTTP process, its ``(commands, updates)`` pipe ends (the core's ends are closed here: the core holds them,
    so its exit closes them and a reader sees EOF; an HTTP end handed to another process is closed by its
    sender once that process has started, so the core sees that one go)."""
    context = multiprocessing.get_context("spawn")   # CUDA forbids fork after it is initialised
    core_ends, channels = [], []
    for _ in range(count):
        commands_in, commands = context.Pipe(duplex=False)
        updates, updates_out = context.Pipe(duplex=False)
        widen(commands)
        widen(updates)
        core_ends.append((commands_in, updates_out))
        channels.append((commands, updates))
    process = context.Process(target=core_main, args=(spec, core_ends),
                              name="tripath-engine-core")   # not daemonic: it spawns the TP ranks
    with stop_signals_ignored():
        process.start()
    for commands_in, updates_out in core_ends:
        commands_in.close()
        updates_out.close()
    return process, channels


@dataclass(frozen=True)
class CoreChannel:
    """The pipe ends of one HTTP process to an engine core another process started (``--api-server-count``,
    :mod:`~tripath.server.processes.api_servers`): ``commands`` to write, ``updates`` to read (``multiprocessing``
    connections), the core's process id, and the HTTP process's index among those the core serves (its
    engine request ids start ``srv<index>-``, unique across them)."""

    commands: object
    updates: object
    pid: int
    index: int = 0


class EngineClient(EngineFront):
    """The engine core process that ``make_engine()`` builds the :class:`~tripath.engine.core.engine_core.EngineCore` in,
    and the handlers' side of it. ``make_engine`` and ``describe`` are pickled to the core: top-level
    functions, or ``functools.partial`` of them. With ``core``
    the client starts no core: it talks to the one at the other end of that channel, which its starter owns
    (stops, kills, reports the exit of)."""

    def __init__(self, make_engine: Callable[[], EngineCore] | None, metrics,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 describe: Callable[[EngineInfo], str] | None = None, core: CoreChannel | None = None):
        super().__init__(metrics, on_fatal)
        self._spec = CoreSpec(make_engine, describe, logging.getLogger().getEffectiveLevel(), LOG_FORMAT)
        self._core = core
        self.request_id_prefix = "srv" if core is None else f"srv{core.index}"   # engine request ids: prefix-n-choice
        if core is None:
            try:
                pickle.dumps(self._spec)
            except Exception as error:  # noqa: BLE001 - pickling raises many types
                raise TypeError(f"the engine core process needs a picklable make_engine and describe (top-level "
                                f"functions or functools.partial of them), got {make_engine!r}: {error}; run a closure "
                                "in process (engine_in_process=True)") from None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._frames = FrameReader()
        self._commands_out: list = []          # commands of this pass of the loop, sent at its end
        self._outbox: Outbox | None = None     # what the command pipe has not taken yet
        self._reading = False
        self._finished = threading.Event()     # nothing more will be read from the core
        self._closed = False                # nothing more comes from the core
        self._stopped = False
        self._stop_lock = threading.Lock()
        self.process = None
        self._fatal: BaseException | None = None
        self._gone = Failure(500, "the engine core process has stopped", "server_error",   # set as it ends
                             "engine_gone")

    # ---- the Engine interface ---------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self._stopping and not self._closed

    @property
    def starting(self) -> bool:
        return not self._settled.is_set() and not self._stopping

    @property
    def alive(self) -> bool:
        if self._closed:
            return False
        return self._core is not None if self.process is None else self.process.is_alive()

    @property
    def fatal_error(self) -> BaseException | None:
        return self._fatal

    @property
    def core_pid(self) -> int | None:
        if self._core is not None:
            return self._core.pid
        return None if self.process is None else self.process.pid

    def start(self) -> None:
        """Spawn the core (it builds the engine while the server answers ``/health`` with 503). Called on the
        event loop that serves the requests (the app's lifespan does): that loop reads and writes the pipes."""
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("EngineClient.start() must run on the event loop that serves the requests (the "
                               "app's lifespan calls it); an engine without one runs in process "
                               "(engine_in_process=True)") from None
        self._loop_thread = threading.get_ident()
        if self._core is not None:
            self._watch(self._core.commands, self._core.updates)
            log.info("attached to the engine core process %d", self._core.pid)
            return
        self.process, [(commands, updates)] = start_core(self._spec, 1)
        self._watch(commands, updates)
        atexit.register(self._kill)
        log.info("engine core process %d started", self.process.pid)

    def _watch(self, commands, updates) -> None:
        self._commands, self._updates = commands, updates
        self._outbox = Outbox(commands.fileno())
        os.set_blocking(commands.fileno(), False)
        os.set_blocking(updates.fileno(), False)
        self._loop.add_reader(updates.fileno(), self._on_readable)
        self._reading = True

    def _refusal(self) -> Failure | None:
        if self._stopping or self._closed:
            return SHUTTING_DOWN if self._stopping else self._gone
        return None

    def _send_command(self, command) -> None:
        self._command(command)

    def abort(self, request_id: str, outcome: str | None = "abort") -> None:
        """Abort a request (``outcome``: its finish reason in the metrics, ``abort`` or ``stop``; None:
        withdrawn, see :meth:`SubmissionBook.end`)."""
        if self._book.end(request_id, outcome) is not None and not self._closed:
            self._command(Abort(request_id))

    def stop(self, timeout: float = 30.0) -> None:
        """End what is in flight (503), have the core release the engine, and wait for it up to ``timeout``
        (then SIGKILL); idempotent. Called off the event loop (the app's lifespan runs it in a worker thread):
        the loop reads the core's last messages meanwhile."""
        if self._loop is not None and threading.get_ident() == self._loop_thread and self._loop_running():
            raise RuntimeError("EngineClient.stop() waits for the event loop: call it from another thread "
                               "(loop.run_in_executor)")
        self._stopping = True
        self._book.fail_all(SHUTTING_DOWN)
        self._book.flush()
        with self._stop_lock:   # a second call returns once the first is done
            if (self.process is None and self._core is None) or self._stopped:
                return
            self._stopped = True
            deadline = time.monotonic() + timeout
            self._command(Stop())
            self._finished.wait(timeout)
            if self.process is not None:
                self.process.join(max(0.0, deadline - time.monotonic()))
                if self.process.is_alive():
                    log.warning("the engine core did not stop within %.0f s: killing it", timeout)
                    self._kill(grace_s=0.0)
            if self._loop_running():   # the pipes leave the loop before they close
                asyncio.run_coroutine_threadsafe(self._unwatch(), self._loop).result(timeout)
            for conn in (self._commands, self._updates):
                conn.close()
            log.info("engine stopped")

    # ---- the pipes, on the event loop ---------------------------------------------------------------------
    def _loop_running(self) -> bool:
        return self._loop is not None and self._loop.is_running() and not self._loop.is_closed()

    def _command(self, command: Add | Abort | Stop) -> None:
        """Send a command: with the others of this pass of the loop, in one message at its end."""
        if threading.get_ident() != self._loop_thread:
            if self._loop_running():
                self._loop.call_soon_threadsafe(self._command, command)
            else:   # no loop to send it (it has stopped): straight to the pipe, if it takes it now
                with contextlib.suppress(OSError):
                    os.write(self._commands.fileno(), frame([command]))
            return
        self._commands_out.append(command)
        if len(self._commands_out) == 1:
            self._loop.call_soon(self._send_commands)

    def _send_commands(self) -> None:
        batch, self._commands_out = self._commands_out, []
        if batch and not self._closed:
            self._write(frame(batch))

    def _write(self, data: bytes) -> None:
        """Queue a frame and write what the pipe takes now; the rest as it drains (the loop watches it)."""
        waited = len(self._outbox) > 0
        self._outbox.put_frame(data)
        if not waited:
            self._on_writable(watched=False)

    def _on_writable(self, watched: bool = True) -> None:
        try:
            waiting = self._outbox.write()
        except OSError:   # the core is gone: reading its pipe's end reports it
            self._outbox.clear()
            waiting = False
        if waiting and not watched:
            self._loop.add_writer(self._commands.fileno(), self._on_writable)
        elif watched and not waiting:
            self._loop.remove_writer(self._commands.fileno())

    async def _unwatch(self) -> None:
        self._stop_reading()
        self._loop.remove_writer(self._commands.fileno())

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._updates.fileno())

    def _on_readable(self) -> None:
        try:
            data = os.read(self._updates.fileno(), READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        try:
            if not data:
                self._finish(None)
                return
            for message in self._frames.feed(data):
                if isinstance(message, Update):
                    self._take_update(message)
                elif isinstance(message, Ready):
                    self._loop.run_in_executor(None, self._on_ready, message)
                elif isinstance(message, StartFailed):
                    self.startup_error = EngineStartError(message.message)
                    self._finish(None)
                    return
                elif isinstance(message, Stopped):
                    self._finish(None)
                    return
        except Exception as failed:  # noqa: BLE001 - a reader that dies must not leave requests hanging
            log.error("reading the engine core's messages failed:\n%s", traceback.format_exc())
            self._finish(failed)

    def _finish(self, error: BaseException | None) -> None:
        """Nothing more is read from the core: stop watching its pipe, and close (in a worker thread: it
        waits for the core's exit status)."""
        self._stop_reading()
        self._loop.run_in_executor(None, self._close, error)

    def _on_ready(self, ready: Ready) -> None:
        """(A worker thread:) load this process's own tokenizer, then take the engine's facts."""
        try:
            tokenizer = load_tokenizer_handle(ready.tokenizer)
        except Exception as error:  # noqa: BLE001 - the server cannot serve without it: a start failure
            self.startup_error = EngineStartError(f"loading the tokenizer failed: {type(error).__name__}: {error}")
            self._command(Stop())
            return
        speaks = self._core is None or self._core.index == 0   # of several API servers, the first says it
        self._take_facts(ready, tokenizer, speaks)

    def _close(self, error: BaseException | None) -> None:
        """Nothing more comes from the core. Unless asked to stop, that is fatal."""
        try:
            self._close_down(error)
        finally:
            self._finished.set()

    def _close_down(self, error: BaseException | None) -> None:
        if self._stopping:
            self._closed = True
            self._settled.set()
            return
        if self.process is not None:
            self.process.join(KILL_GRACE_S)   # it is gone, or going: how it ended
            ending = exit_text(self.process.exitcode)
        else:   # its starter reports how it ended
            ending = f"{self._core.pid} has stopped"
        failure = self._gone = Failure(500, f"the engine core process {ending}", "server_error", "engine_gone")
        self._closed = True   # after _gone: submit() reads it once it sees _closed
        if self.startup_error is None and not self._ready.is_set():
            self.startup_error = EngineStartError(failure.message + " before the engine was built")
        cause = self.startup_error or error or RuntimeError(failure.message)
        if self.startup_error is None:
            self._fatal = cause
            log.error("%s: failing the %d requests in flight", failure.message, len(self._book))
        if self._on_fatal is not None:   # before any request sees the failure: the exit is decided first
            self._on_fatal(cause)
        self._book.fail_all(failure)
        self._book.flush()
        self._settled.set()

    def _kill(self, grace_s: float = KILL_GRACE_S) -> None:
        """At exit, or past stop's timeout: the core gets ``grace_s`` to see its command pipe close and stop,
        then SIGKILL (it ignores SIGTERM)."""
        process = self.process
        if process is None or not process.is_alive():
            return
        with contextlib.suppress(OSError):
            self._commands.close()
        process.join(grace_s)
        if process.is_alive():
            process.kill()
            process.join()
