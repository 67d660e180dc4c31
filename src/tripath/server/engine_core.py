"""The engine core: the process that owns the :class:`~tripath.engine.LLM` (and its tensor-parallel ranks,
which it spawns) for ``tripath serve``, and only schedules and steps; the HTTP processes — one, or several
with ``--api-server-count`` (:mod:`~tripath.server.api_servers`) — tokenise, validate, detokenise and frame
the streams (:mod:`~tripath.server.engine_client`).

:func:`core_main` (the spawned process's entry) builds the engine with ``spec.make_llm()``, sends the
engine's facts to every HTTP process (``ready``, :mod:`~tripath.server.core_wire`), then loops: take every
command that has arrived from any of them (adds, aborts, stop) — waiting for one only while nothing runs —,
take a step (:mod:`~tripath.server.engine_steps`), and send each HTTP process ONE update with what that pass
produced for its requests: the adds it took or refused, every output of the step (new tokens, finish, new
log-probabilities, prompt log-probabilities once), the requests a failed step failed, and ``LLM.stats()``.
An HTTP process with nothing in a pass gets the stats alone at most every :data:`STATS_REFRESH_S`, and at
once when the engine goes idle. The engine does not decode finished outputs here
(``LLM.detokenize_outputs`` off): the HTTP processes detokenise. With several HTTP processes each bounds
its own requests and the core bounds the engine's waiting queue for all (``CoreSpec.max_waiting``).

While requests arrive the core decodes one step at a time: an add that finds a group of multi-step decode
steps launched waits for it (and, with overlapped scheduling, for the group after it: 13 ms on the TP-8
shape), and on a server whose streams end and restart together the adds of one round reach the core over
100-300 ms (the round's prefills stagger the streams' ends). Once no request has arrived for
:data:`ARRIVAL_WINDOW_S` the engine's ``decode_steps`` apply again (offline, ``LLM.generate`` adds its
requests at step boundaries and keeps them). Measured against no window, the window's gain is within the
noise of a run (docs/BENCHMARKS.md).

The core ignores SIGINT and SIGTERM (a terminal's Ctrl-C reaches the whole process group; so does a service
manager's SIGTERM): each HTTP process drains, then sends ``stop``, which ends what it still has in the
engine (503) and, while others serve on, answers ``stopped`` at once. An HTTP process that is gone (its end
of the command pipe closes) has its requests aborted. The core stops, releasing the engine, at the last
HTTP process's ``stop`` or exit, then says ``stopped`` to whoever is left; a core that does not stop in time
is killed (SIGKILL).
"""

from __future__ import annotations

import gc
import logging
import os
import select
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Sequence

from tripath.server.core_wire import READ_BYTES, FrameReader, encode_output, encode_stats, send, tokenizer_handle
from tripath.server.engine_steps import add_request, close_engine, release_memory, take_step
from tripath.server.submissions import Failure

log = logging.getLogger("tripath.server")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ARRIVAL_WINDOW_S = 0.01   # decode one step at a time until no request has arrived for this long (module doc)
STATS_REFRESH_S = 0.05    # how old the engine's stats may get at an HTTP process that has nothing else to read


@dataclass(frozen=True)
class CoreSpec:
    """What the core process is started with (pickled to it): ``make_llm`` builds the engine (a top-level
    function or a ``functools.partial`` of one, e.g. :func:`make_engine`), ``describe(llm)`` its start-up log
    line; the HTTP process's log level and format."""

    make_llm: Callable[[], object]
    describe: Callable[[object], str] | None = None
    log_level: int = logging.WARNING
    log_format: str = LOG_FORMAT
    max_waiting: int | None = None


def make_engine(model, **options):
    """``LLM(model, **options)``: the engine of ``tripath serve`` (a picklable ``make_llm`` with
    ``functools.partial``)."""
    from tripath.engine import LLM

    return LLM(model, **options)


def ignore_stop_signals() -> None:
    """SIGINT and SIGTERM do nothing to this process. SIGINT is ignored outright, so the processes it starts
    (tensor-parallel ranks, warm-up compilers) inherit that and a Ctrl-C lets the server drain with them;
    SIGTERM through a Python handler, so they keep its default (``multiprocessing`` stops them with it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _ignored)


def _ignored(signum, frame) -> None:
    log.debug("engine core: %s ignored (the server stops the engine)", signal.Signals(signum).name)


def engine_facts(llm, describe) -> dict:
    return {"vocab_size": int(llm.model.config.vocab_size), "max_model_len": int(llm.runner.max_model_len),
            "max_num_seqs": int(llm.config.max_num_seqs),
            "generation_defaults": dict(getattr(llm, "generation_defaults", {})),
            "summary": describe(llm) if describe is not None else "", "tokenizer": tokenizer_handle(llm.tokenizer)}


def core_main(spec: CoreSpec, frontends) -> None:
    """The core process: build, serve until stopped, release. ``frontends``: ``(commands, updates)`` pipe ends
    of each HTTP process (the ``multiprocessing`` connections that carried them here; kept open until it
    returns)."""
    ignore_stop_signals()
    logging.basicConfig(level=spec.log_level, format=spec.log_format, force=True)
    updates = [pair[1].fileno() for pair in frontends]
    try:
        llm = spec.make_llm()
        facts = engine_facts(llm, spec.describe)
    except BaseException as error:  # noqa: BLE001 - reported to the HTTP processes, which exit
        log.error("building the engine failed:\n%s", traceback.format_exc())
        _tell_all(updates, ("start_failed", str(error) or type(error).__name__))
        sys.exit(1)
    llm.detokenize_outputs = False   # the HTTP processes detokenise
    # Every object alive now lives as long as the server: moved out of the collector's generations, the full
    # collections of a long run no longer walk them (a pause of 0.2 s each on mha-tp8's heap).
    gc.freeze()
    _tell_all(updates, ("ready", facts))   # one that is gone already is detached at the first update
    EngineCore(llm, [(commands.fileno(), update.fileno()) for commands, update in frontends],
               spec.max_waiting).run()


def _tell_all(fds: list[int], message) -> None:
    for fd in fds:
        try:
            send(fd, message)
        except OSError:   # that HTTP process is gone
            pass


class _Frontend:
    """One HTTP process the core serves: its pipe ends (descriptors) and what the current pass has for it."""

    __slots__ = ("commands", "updates", "frames", "accepted", "refused", "outputs", "failed", "sent_stats",
                 "sent_at")

    def __init__(self, commands: int, updates: int):
        self.commands, self.updates = commands, updates
        self.frames = FrameReader()
        self.clear()
        self.sent_stats = None
        self.sent_at = float("-inf")

    def has_items(self) -> bool:
        return bool(self.accepted or self.refused or self.outputs or self.failed)

    def clear(self) -> None:
        """Empty this pass's items: the ids added, the adds refused, the outputs, the requests failed."""
        self.accepted, self.refused, self.outputs, self.failed = [], [], [], []


class EngineCore:
    """The core's loop over one built engine (see the module doc). ``frontends``: ``(commands, updates)`` file
    descriptors (blocking) of each HTTP process's pipe ends; ``max_waiting``: with several, the most requests
    the engine may hold waiting (an add beyond it is refused with 503), None for no bound here."""

    def __init__(self, llm, frontends: Sequence[tuple[int, int]], max_waiting: int | None = None):
        self.llm = llm
        self._frontends = [_Frontend(commands, updates) for commands, updates in frontends]
        self._open = set(range(len(self._frontends)))
        self._poller = select.poll()
        self._by_fd: dict[int, int] = {}
        for index, frontend in enumerate(self._frontends):
            if frontend.commands >= 0:
                self._poller.register(frontend.commands, select.POLLIN)
                self._by_fd[frontend.commands] = index
        self._max_waiting = max_waiting
        self._live: dict[str, list] = {}   # request id -> [its frontend, its prompt's log-probabilities were sent]
        self._step_failures = 0            # since start
        self._stopping = False
        self._decode_steps = getattr(llm, "decode_steps", 1)   # the engine's multi-step decoding, between arrivals
        self._last_arrival = float("-inf")

    def run(self) -> None:
        try:
            while not self._stopping:
                try:
                    self._receive(block=not self.llm.has_unfinished_requests())
                    if not self._stopping and self.llm.has_unfinished_requests():
                        self._step()
                except Exception as error:  # noqa: BLE001 - never leave requests hanging on a dead loop
                    log.error("the engine loop failed:\n%s", traceback.format_exc())
                    self._fail_all(f"the engine failed: {type(error).__name__}: {error}")
                self._send_updates()
            self._fail_all("the server is shutting down", 503)
            self._send_updates(final=True)
        finally:
            self._release()
        for index in list(self._open):
            self._send(index, ("stopped",))

    # ---- commands -------------------------------------------------------------------------------------------
    def _receive(self, block: bool) -> None:
        """Handle every command that has arrived (waiting for the first when ``block``)."""
        timeout = None if block else 0
        while self._open and not self._stopping:
            events = self._poller.poll(timeout)
            if not events:
                return
            timeout = 0
            for fd, _ in events:
                index = self._by_fd.get(fd)
                if index is None:
                    continue
                try:
                    data = os.read(fd, READ_BYTES)
                except OSError:
                    data = b""
                if not data:   # that HTTP process is gone: nobody to answer
                    self._detach(index)
                    continue
                for batch in self._frontends[index].frames.feed(data):
                    for command in batch:
                        self._handle(index, command)

    def _handle(self, index: int, command: tuple) -> None:
        kind = command[0]
        frontend = self._frontends[index]
        if kind == "add":
            _, request_id, prompt_token_ids, params = command
            failure = self._overloaded() if request_id not in self._live else \
                Failure(400, f"request id {request_id!r} is in flight already", reason="duplicate_request_id")
            if failure is None:
                failure = add_request(self.llm, request_id, prompt_token_ids, params)
            if failure is None:
                self._live[request_id] = [index, False]
                frontend.accepted.append(request_id)
                self._last_arrival = time.monotonic()
            else:
                frontend.refused.append((request_id, failure.status, failure.message, failure.type, failure.reason))
        elif kind == "abort":
            entry = self._live.get(command[1])
            if entry is not None and entry[0] == index:
                del self._live[command[1]]
                self.llm.abort_request(command[1])
        elif kind == "stop":
            if len(self._open) > 1:   # the others serve on: this one's requests end, it hears no more
                self._end_requests_of(index, "the server is shutting down", 503)
                self._send_update(index, time.monotonic())
                self._send(index, ("stopped",))
                self._forget(index)
            else:
                self._stopping = True

    def _overloaded(self) -> Failure | None:
        if self._max_waiting is None:
            return None
        waiting = len(self.llm.scheduler.waiting)
        if waiting < self._max_waiting:
            return None
        return Failure(503, f"the server is overloaded: {waiting} engine requests wait for a place in the batch "
                            f"(--max-queue-depth {self._max_waiting}); retry later", "server_error", "queue_full")

    # ---- steps ----------------------------------------------------------------------------------------------
    def _step(self) -> None:
        if self._decode_steps > 1:
            arriving = time.monotonic() - self._last_arrival < ARRIVAL_WINDOW_S
            self.llm.decode_steps = 1 if arriving else self._decode_steps
        result = take_step(self.llm)
        live, frontends = self._live, self._frontends
        for out in result.outputs:
            entry = live.get(out.request_id)
            if entry is None:
                continue   # aborted since the step was launched
            first_prompt_logprobs = not entry[1] and out.prompt_logprobs is not None
            frontends[entry[0]].outputs.append(encode_output(out, first_prompt_logprobs))
            if out.finished:
                del live[out.request_id]
            elif first_prompt_logprobs:
                entry[1] = True
        if result.failed:
            self._step_failures += 1
        for request_ids, failure in result.failed:
            by_frontend: dict[int, list[str]] = {}
            for request_id in request_ids:
                entry = live.pop(request_id, None)
                if entry is not None:
                    by_frontend.setdefault(entry[0], []).append(request_id)
            for index, ids in by_frontend.items():
                frontends[index].failed.append((ids, failure.status, failure.message, failure.type))

    def _end_requests_of(self, index: int | None, message: str, status: int) -> None:
        """Abort the requests of one frontend (``index``), or of all (None), failing them with ``message``."""
        by_frontend: dict[int, list[str]] = {}
        for request_id, entry in list(self._live.items()):
            if index is None or entry[0] == index:
                del self._live[request_id]
                self.llm.abort_request(request_id)
                by_frontend.setdefault(entry[0], []).append(request_id)
        for owner, ids in by_frontend.items():
            self._frontends[owner].failed.append((ids, status, message, "server_error"))

    def _fail_all(self, message: str, status: int = 500) -> None:
        self._end_requests_of(None, message, status)

    # ---- updates --------------------------------------------------------------------------------------------
    def _send_updates(self, final: bool = False) -> None:
        """Each frontend's update of this pass: to one with items; with the engine's stats alone to one whose
        stats are :data:`STATS_REFRESH_S` old, or at once when the engine goes idle (or ``final``)."""
        stats = None
        now = time.monotonic()
        idle = final or self.llm is None or not self.llm.has_unfinished_requests()
        for index in list(self._open):
            frontend = self._frontends[index]
            if not frontend.has_items() and not idle and now - frontend.sent_at < STATS_REFRESH_S:
                continue
            stats = encode_stats(self.llm.stats()) if stats is None else stats
            if frontend.has_items() or stats != frontend.sent_stats:
                self._send_update(index, now, stats)

    def _send_update(self, index: int, now: float, stats: tuple | None = None) -> None:
        frontend = self._frontends[index]
        stats = encode_stats(self.llm.stats()) if stats is None else stats
        sent = self._send(index, ("update", frontend.accepted, frontend.refused, frontend.outputs, frontend.failed,
                                  stats, self._step_failures))
        frontend.clear()
        if sent:
            frontend.sent_stats, frontend.sent_at = stats, now

    def _send(self, index: int, message) -> bool:
        """Send to one frontend; a frontend whose process is gone is detached (False)."""
        try:
            send(self._frontends[index].updates, message)
            return True
        except OSError:
            self._detach(index)
            return False

    def _detach(self, index: int) -> None:
        """A frontend's process is gone: its requests are aborted (nobody reads them), the rest serve on; with
        none left the core stops."""
        if index not in self._open:
            return
        self._forget(index)
        for request_id, entry in list(self._live.items()):
            if entry[0] == index:
                del self._live[request_id]
                self.llm.abort_request(request_id)
        if not self._open:
            self._stopping = True

    def _forget(self, index: int) -> None:
        self._open.discard(index)
        frontend = self._frontends[index]
        if self._by_fd.pop(frontend.commands, None) is not None:
            self._poller.unregister(frontend.commands)
        frontend.clear()

    def _release(self) -> None:
        device = close_engine(self.llm)
        self.llm = None
        release_memory(device)
        log.info("engine core stopped")
