"""The engine core process of ``tripath serve``: what it is started with (:class:`CoreSpec`, pickled to the
spawned process), its signals, and its entry (:func:`core_main`): build the engine core with
``spec.make_engine()`` (an :class:`~tripath.engine.core.engine_core.EngineCore`), then run
:class:`~tripath.server.transport.core_loop.CoreLoop` over it, through pipes to the HTTP processes, until they stop
it.

The core ignores SIGINT and SIGTERM (a terminal's Ctrl-C reaches the whole process group; so does a service
manager's SIGTERM): the HTTP processes drain and then stop it over its pipes; a core that does not stop in
time is killed (SIGKILL). A core that cannot build the engine says
:class:`~tripath.server.transport.core_messages.StartFailed` to every HTTP process and exits 1.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
import traceback
from dataclasses import dataclass
from typing import Callable

from tripath.engine.core.engine_core import EngineCore
from tripath.engine.core.engine_info import EngineInfo
from tripath.server.transport.core_loop import CoreLoop
from tripath.server.transport.core_messages import StartFailed
from tripath.server.transport.core_wire import send
from tripath.server.transport.engine_steps import prepare_grammars

log = logging.getLogger("tripath.server")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass(frozen=True)
class CoreSpec:
    """What the core process is started with (pickled to it): ``make_engine`` builds the
    :class:`~tripath.engine.core.engine_core.EngineCore` (a top-level function or a ``functools.partial`` of one, e.g.
    :func:`build_engine_core`), ``describe(info)`` the start-up log line of its
    :class:`~tripath.engine.core.engine_info.EngineInfo`; the HTTP process's log level and format."""

    make_engine: Callable[[], EngineCore]
    describe: Callable[[EngineInfo], str] | None = None
    log_level: int = logging.WARNING
    log_format: str = LOG_FORMAT
    max_waiting: int | None = None


def build_engine_core(model, **options) -> EngineCore:
    """``EngineCore(model, detokenize=False, **options)``: the engine of ``tripath serve``, whose HTTP side
    detokenises (a picklable ``make_engine`` with ``functools.partial``)."""
    return EngineCore(model, detokenize=False, **options)


def checked_engine(built) -> EngineCore:
    """What a ``make_engine()`` returned, if it is an :class:`EngineCore` (else ``TypeError``)."""
    if not isinstance(built, EngineCore):
        raise TypeError(f"make_engine() must return an EngineCore (tripath.engine.core.engine_core), got {type(built).__name__}"
                        "; an LLM's is its .core")
    return built


def ignore_stop_signals() -> None:
    """SIGINT and SIGTERM do nothing to this process. SIGINT is ignored outright, so the processes it starts
    (tensor-parallel ranks, warm-up compilers) inherit that and a Ctrl-C lets the server drain with them;
    SIGTERM through a Python handler, so they keep its default (``multiprocessing`` stops them with it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _ignored)


def _ignored(signum, frame) -> None:
    log.debug("engine core: %s ignored (the server stops the engine)", signal.Signals(signum).name)


def core_main(spec: CoreSpec, frontends) -> None:
    """The core process: build, serve until stopped, release. ``frontends``: ``(commands, updates)`` pipe ends
    of each HTTP process (the ``multiprocessing`` connections that carried them here; kept open until it
    returns)."""
    ignore_stop_signals()
    logging.basicConfig(level=spec.log_level, format=spec.log_format, force=True)
    try:
        core = checked_engine(spec.make_engine())
    except BaseException as error:  # noqa: BLE001 - reported to the HTTP processes, which exit
        log.error("building the engine failed:\n%s", traceback.format_exc())
        for pair in frontends:   # a few bytes into an empty pipe: never waits
            try:
                send(pair[1].fileno(), StartFailed(str(error) or type(error).__name__))
            except OSError:   # that HTTP process is gone
                pass
        sys.exit(1)
    prepare_grammars(core)
    # Every object alive now lives as long as the server: moved out of the collector's generations, the full
    # collections of a long run no longer walk them (each a pause that grows with the heap).
    gc.freeze()
    loop = CoreLoop(core, [(commands.fileno(), update.fileno()) for commands, update in frontends],
                    spec.max_waiting, spec.describe)
    del core   # the loop holds the engine alone
    loop.run()
