"""The engine core process of ``tripath serve``: what it is started with (:class:`CoreSpec`, pickled to the
spawned process), its signals, and its entry (:func:`core_main`): build the engine with ``spec.make_llm()``,
then run :class:`~tripath.server.engine_core.EngineCore` over it until the HTTP processes stop it.

The core ignores SIGINT and SIGTERM (a terminal's Ctrl-C reaches the whole process group; so does a service
manager's SIGTERM): the HTTP processes drain and then stop it over its pipes; a core that does not stop in
time is killed (SIGKILL). A core that cannot build the engine says ``start_failed`` to every HTTP process
and exits 1.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
import traceback
from dataclasses import dataclass
from typing import Callable

from tripath.server.core_wire import send, tokenizer_handle
from tripath.server.engine_core import EngineCore
from tripath.server.engine_steps import prepare_grammars
from tripath.server.startup import cache_config

log = logging.getLogger("tripath.server")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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
            "summary": describe(llm) if describe is not None else "", "tokenizer": tokenizer_handle(llm.tokenizer),
            "cache_config": cache_config(llm)}


def core_main(spec: CoreSpec, frontends) -> None:
    """The core process: build, serve until stopped, release. ``frontends``: ``(commands, updates)`` pipe ends
    of each HTTP process (the ``multiprocessing`` connections that carried them here; kept open until it
    returns)."""
    ignore_stop_signals()
    logging.basicConfig(level=spec.log_level, format=spec.log_format, force=True)
    try:
        llm = spec.make_llm()
        facts = engine_facts(llm, spec.describe)
    except BaseException as error:  # noqa: BLE001 - reported to the HTTP processes, which exit
        log.error("building the engine failed:\n%s", traceback.format_exc())
        for pair in frontends:   # a few bytes into an empty pipe: never waits
            try:
                send(pair[1].fileno(), ("start_failed", str(error) or type(error).__name__))
            except OSError:   # that HTTP process is gone
                pass
        sys.exit(1)
    llm.detokenize_outputs = False   # the HTTP processes detokenise
    prepare_grammars(llm)
    # Every object alive now lives as long as the server: moved out of the collector's generations, the full
    # collections of a long run no longer walk them (a pause of 0.2 s each on mha-tp8's heap).
    gc.freeze()
    EngineCore(llm, [(commands.fileno(), update.fileno()) for commands, update in frontends],
               spec.max_waiting).run(facts)
