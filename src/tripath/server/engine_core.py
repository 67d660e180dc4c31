"""The engine core: the process that owns the :class:`~tripath.engine.LLM` (and its tensor-parallel ranks,
which it spawns) for ``tripath serve``, and only schedules and steps; the HTTP process
(:mod:`~tripath.server.engine_client`) tokenises, validates, detokenises and frames the streams.

:func:`core_main` (the spawned process's entry) builds the engine with ``spec.make_llm()``, sends the
engine's facts (``ready``, :mod:`~tripath.server.core_wire`), then loops: take every command that has
arrived (adds, aborts, stop) — waiting for one only while nothing runs —, take a step
(:mod:`~tripath.server.engine_steps`), and send ONE update with everything that pass produced: the adds it
took or refused, every output of the step (new tokens, finish, new log-probabilities, prompt
log-probabilities once), the requests a failed step failed, and ``LLM.stats()``. The engine does not
decode finished outputs here (``LLM.detokenize_outputs`` off): the HTTP process detokenises.

While requests arrive the core decodes one step at a time: an add that finds a group of multi-step decode
steps launched waits for it (and, with overlapped scheduling, for the group after it: 13 ms on the TP-8
shape), and on a server whose streams end and restart together the adds of one round trickle in over
50-130 ms. Once no request has arrived for :data:`ARRIVAL_WINDOW_S` the engine's ``decode_steps`` apply
again (offline, ``LLM.generate`` adds its requests at step boundaries and keeps them).

The core ignores SIGINT and SIGTERM (a terminal's Ctrl-C reaches the whole process group; so does a service
manager's SIGTERM): the HTTP process drains, then sends ``stop``. The core stops, releasing the engine, on
``stop`` or when the HTTP process is gone (its end of the command pipe closes); a core that does not stop
in time is killed (SIGKILL).
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

from tripath.server.core_wire import FrameReader, encode_output, encode_stats, readable, send, tokenizer_handle
from tripath.server.engine_steps import add_request, close_engine, release_memory, take_step

log = logging.getLogger("tripath.server")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ARRIVAL_WINDOW_S = 0.01   # decode one step at a time until no request has arrived for this long (module doc)


@dataclass(frozen=True)
class CoreSpec:
    """What the core process is started with (pickled to it): ``make_llm`` builds the engine (a top-level
    function or a ``functools.partial`` of one, e.g. :func:`make_engine`), ``describe(llm)`` its start-up log
    line; the HTTP process's log level and format."""

    make_llm: Callable[[], object]
    describe: Callable[[object], str] | None = None
    log_level: int = logging.WARNING
    log_format: str = LOG_FORMAT


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


def core_main(spec: CoreSpec, commands, updates) -> None:
    """The core process: build, serve until stopped, release (``commands`` / ``updates``: its pipe ends, the
    ``multiprocessing`` connections that carried them here; kept open until it returns)."""
    ignore_stop_signals()
    logging.basicConfig(level=spec.log_level, format=spec.log_format, force=True)
    try:
        llm = spec.make_llm()
        facts = engine_facts(llm, spec.describe)
    except BaseException as error:  # noqa: BLE001 - reported to the HTTP process, which exits
        log.error("building the engine failed:\n%s", traceback.format_exc())
        try:
            send(updates.fileno(), ("start_failed", str(error) or type(error).__name__))
        except OSError:
            pass
        sys.exit(1)
    llm.detokenize_outputs = False   # the HTTP process detokenises
    # Every object alive now lives as long as the server: moved out of the collector's generations, the full
    # collections of a long run no longer walk them (a pause of 0.2 s each on mha-tp8's heap).
    gc.freeze()
    try:
        send(updates.fileno(), ("ready", facts))
    except OSError:   # the HTTP process is gone
        return
    EngineCore(llm, commands.fileno(), updates.fileno()).run()


class EngineCore:
    """The core's loop over one built engine (see the module doc); ``commands`` / ``updates``: the file
    descriptors of its pipe ends (blocking)."""

    def __init__(self, llm, commands: int, updates: int):
        self.llm, self.commands, self.updates = llm, commands, updates
        self._frames = FrameReader()
        self._live: dict[str, bool] = {}   # request id -> its prompt's log-probabilities were sent
        self._accepted: list[str] = []
        self._refused: list[tuple] = []
        self._outputs: list[tuple] = []
        self._failed: list[tuple] = []
        self._step_failures = 0
        self._stopping = False
        self._decode_steps = getattr(llm, "decode_steps", 1)   # the engine's multi-step decoding, between arrivals
        self._last_arrival = float("-inf")

    def run(self) -> None:
        try:
            while not self._stopping:
                try:
                    busy = self._receive(block=not self.llm.has_unfinished_requests())
                    if not self._stopping and self.llm.has_unfinished_requests():
                        self._step()
                        busy = True
                except (EOFError, OSError):
                    raise
                except Exception as error:  # noqa: BLE001 - never leave requests hanging on a dead loop
                    log.error("the engine loop failed:\n%s", traceback.format_exc())
                    self._fail_all(f"the engine failed: {type(error).__name__}: {error}")
                    busy = True
                if busy:
                    self._send_update()
            self._fail_all("the server is shutting down", 503)
            self._send_update()
        except (EOFError, OSError):   # the HTTP process is gone: nobody to answer
            self._stopping = True
        finally:
            self._release()
        try:
            send(self.updates, ("stopped",))
        except OSError:
            pass

    def _receive(self, block: bool) -> bool:
        """Handle every command that has arrived (waiting for one when ``block``); whether there was any."""
        if not block and not readable(self.commands):
            return False
        while True:
            for batch in self._frames.receive(self.commands):   # blocks only when ``block``, for the first
                for command in batch:
                    self._handle(command)
            if self._stopping or not readable(self.commands):
                return True

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt_token_ids, params = command
            failure = add_request(self.llm, request_id, prompt_token_ids, params)
            if failure is None:
                self._live[request_id] = False
                self._accepted.append(request_id)
                self._last_arrival = time.monotonic()
            else:
                self._refused.append((request_id, failure.status, failure.message, failure.type))
        elif kind == "abort":
            if self._live.pop(command[1], None) is not None:
                self.llm.abort_request(command[1])
        elif kind == "stop":
            self._stopping = True

    def _step(self) -> None:
        if self._decode_steps > 1:
            arriving = time.monotonic() - self._last_arrival < ARRIVAL_WINDOW_S
            self.llm.decode_steps = 1 if arriving else self._decode_steps
        result = take_step(self.llm)
        live = self._live
        for out in result.outputs:
            sent = live.get(out.request_id)
            if sent is None:
                continue   # aborted since the step was launched
            self._outputs.append(encode_output(out, not sent and out.prompt_logprobs is not None))
            if out.finished:
                del live[out.request_id]
            elif not sent and out.prompt_logprobs is not None:
                live[out.request_id] = True
        if result.failed:
            self._step_failures += 1
        for request_ids, failure in result.failed:
            for request_id in request_ids:
                live.pop(request_id, None)
            self._failed.append((request_ids, failure.status, failure.message, failure.type))

    def _fail_all(self, message: str, status: int = 500) -> None:
        request_ids = list(self._live)
        for request_id in request_ids:
            self.llm.abort_request(request_id)
        self._live.clear()
        if request_ids:
            self._failed.append((request_ids, status, message, "server_error"))

    def _send_update(self) -> None:
        send(self.updates, ("update", self._accepted, self._refused, self._outputs, self._failed,
                            encode_stats(self.llm.stats()), self._step_failures))
        self._accepted, self._refused, self._outputs, self._failed = [], [], [], []
        self._step_failures = 0

    def _release(self) -> None:
        device = close_engine(self.llm)
        self.llm = None
        release_memory(device)
        log.info("engine core stopped")
