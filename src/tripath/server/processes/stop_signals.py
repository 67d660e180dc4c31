"""One exit status per stop signal: ``tripath serve`` exits 0 after a SIGTERM or a SIGINT (Ctrl-C) it drained
for, in every mode (one API server, ``--engine-in-process``, ``--api-server-count N``); 1 when something
failed (the engine could not be built or stopped serving, an API server or the core died).

uvicorn catches SIGINT / SIGTERM, shuts down gracefully, then re-raises the signal to the handlers that were in
place before it ran: Python's default SIGINT handler raised ``KeyboardInterrupt`` (the server then returned
0), the default SIGTERM action killed the process (status -15, 143 in a shell) after a clean drain, so the
two signals of one clean stop ended differently. :func:`signals_ask_to_exit` puts handlers in place that only
ask the server to exit: the re-raised signal lands there, and ``run()`` returns.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_ask_to_exit(server) -> Iterator[None]:
    """While in the block, SIGINT and SIGTERM set ``server.should_exit`` (a uvicorn server's graceful stop)
    and nothing else; the previous handlers come back after it. A signal before uvicorn installs its own
    handlers stops the server once it has started. Outside the main thread (no signals there) it does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def ask_to_exit(signum, frame) -> None:
        server.should_exit = True

    previous = {sig: signal.signal(sig, ask_to_exit) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
