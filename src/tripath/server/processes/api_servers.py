"""Several API servers in front of one engine core: ``tripath serve --api-server-count N``.

One HTTP process serves every request's HTTP, JSON, validation, detokenising and stream framing on one
interpreter; at high concurrency that serial work falls behind the engine core, so tokens, stream ends and the
clients' next requests all travel later. With ``N`` > 1 the ``tripath serve`` process becomes a supervisor
(:func:`supervise`): it spawns the engine core (:mod:`~tripath.server.transport.core_process`) with a pair of pipes per
API server, then ``N`` API server processes (:func:`api_server_main`), each the whole OpenAI-compatible app on
its own event loop, attached to the core over its pipes (:class:`~tripath.server.transport.engine_client.CoreChannel`).
They listen on the same address, each on its own ``SO_REUSEPORT`` socket (API server 0 on the one the
supervisor bound before anything loaded), so the kernel spreads connections over them; the core routes each
request's outputs to the API server that sent it. ``/metrics`` on any of them answers for all
(:mod:`~tripath.server.processes.metrics_peers`).

Lifetime: SIGINT / SIGTERM to the supervisor reach every API server as SIGTERM (a terminal's Ctrl-C reaches
them anyway, so an API server may get both, in either order: every stop signal asks it for the same drained
stop): each drains as one server does (``--shutdown-timeout``), ends what is left with 503 and stops;
the core releases the engine once the last has stopped, and the supervisor exits 0. An API server that
exits on its own (crashed, killed, could not start) stops the others the same way and the supervisor exits
1. A core that dies makes every API server fail its requests, answer ``/health`` with 503 and exit; the
supervisor exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

from tripath.server.processes.metrics_peers import is_abstract

log = logging.getLogger("tripath.server")

ABSTRACT_SOCKETS = sys.platform.startswith("linux")   # the metrics sockets in Linux's abstract namespace
EXIT_GRACE_S = 10.0   # beyond the drain: how long a stopping API server or core may take before SIGKILL
UNIX_PATH_MAX = 107     # the longest socket path AF_UNIX takes (Linux: 108 bytes with the terminating NUL)


@dataclass(frozen=True)
class ApiServerRole:
    """API server ``index`` of ``count`` (0-based), its ``channel`` to the engine core and the ``folder`` the
    API servers share (their metrics sockets: see :func:`socket_folder`)."""

    index: int
    count: int
    channel: object   # a CoreChannel
    folder: str


def watch_supervisor(on_gone: Callable[[], None]) -> None:
    """Call ``on_gone`` (on the running event loop) when the supervisor that started this API server is
    gone, killed included (its sentinel, inherited at spawn, reads the end): the API servers do not outlive
    it, and once they have stopped neither does the core."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    loop = asyncio.get_running_loop()

    def gone() -> None:
        loop.remove_reader(parent.sentinel)
        log.error("the tripath serve process that started this API server is gone: stopping")
        on_gone()

    loop.add_reader(parent.sentinel, gone)


def api_server_main(serve: Callable[..., int], argv: list[str], role: ApiServerRole, listener,
                    address: tuple[str, int]) -> None:
    """An API server process: ``serve(argv, listener, role)`` (``tripath serve``'s app for ``argv``) on
    ``listener`` (None: bind its own ``SO_REUSEPORT`` socket on ``address``, the supervisor's), attached to
    the core of ``role``; exits with the server's status."""
    from tripath.server.processes.listen import ListenError, bind_listener

    if listener is None:
        host, port = address
        try:
            listener = bind_listener(host, port, reuse_port=True)
        except ListenError as error:
            print(f"tripath serve: error: API server {role.index}: {error}", file=sys.stderr)
            sys.exit(1)
    try:
        code = serve(argv, listener, role)
    finally:
        listener.close()
    sys.exit(code)


def _clean_exit(code: int | None) -> bool:
    """An API server's exit after it was asked to stop: 0, or the signal uvicorn re-raises once it has drained."""
    return code in (0, -signal.SIGTERM, -signal.SIGINT)


def supervise(argv: list[str], count: int, listener, host: str, spec, drain_s: float,
              serve: Callable[..., int]) -> int:
    """Run the engine core (``spec``: its :class:`~tripath.server.transport.core_process.CoreSpec`) and ``count`` API
    servers of ``argv`` until they stop (see the module doc); the exit status. ``listener``: the socket bound
    at start on ``host`` (``SO_REUSEPORT``), handed to API server 0; ``drain_s``: ``--shutdown-timeout``;
    ``serve``: what each API server process runs (:func:`api_server_main`; a top-level function, pickled by
    name)."""
    from tripath.server.transport.engine_client import CoreChannel, start_core

    context = multiprocessing.get_context("spawn")
    folder = socket_folder()
    address = (host, listener.getsockname()[1])   # --port 0: the port the system gave
    core, channels = start_core(spec, count)
    log.info("engine core process %d started", core.pid)
    servers = []
    for index, (commands, updates) in enumerate(channels):
        role = ApiServerRole(index, count, CoreChannel(commands, updates, core.pid, index), folder)
        server = context.Process(target=api_server_main, name=f"tripath-api-server-{index}",
                                 args=(serve, argv, role, listener if index == 0 else None, address))
        server.start()
        commands.close()   # the API server holds them: its exit closes them, and the core sees it go
        updates.close()
        servers.append(server)
    listener.close()   # API server 0 holds it now; kept here, it would queue connections after that one's exit
    log.info("%d API servers started: processes %s", count, ", ".join(str(s.pid) for s in servers))
    log.info("their metrics sockets: %s/<index>.sock", "@" + folder[1:] if is_abstract(folder) else folder)
    try:
        return _watch(servers, core, drain_s)
    finally:
        for process in (*servers, core):
            if process.is_alive():
                process.kill()
                process.join()
        if not is_abstract(folder):
            shutil.rmtree(folder, ignore_errors=True)


def socket_folder(abstract: bool = ABSTRACT_SOCKETS) -> str:
    """Where the API servers' metrics sockets live (:mod:`~tripath.server.processes.metrics_peers`). ``abstract`` (on
    Linux): a fresh random name in the abstract socket namespace, ``"\\0tripath-api-servers-<hex>"``, which
    puts nothing on the filesystem, so nothing is left however the processes end. Else a new folder in the
    temp folder; in ``/tmp`` where the temp folder's path is so long that a socket's path would pass what
    ``AF_UNIX`` takes (107 bytes on Linux)."""
    if abstract:
        return "\0tripath-api-servers-" + secrets.token_hex(8)
    base = tempfile.gettempdir()
    if len(os.path.join(base, "tripath-api-servers-12345678", "1000.sock")) > UNIX_PATH_MAX and os.path.isdir("/tmp"):
        base = "/tmp"
    return tempfile.mkdtemp(prefix="tripath-api-servers-", dir=base)


def _watch(servers: list, core, drain_s: float) -> int:
    """Wait for the API servers and the core to end (the module doc says how); the exit status."""
    from tripath.server.transport.engine_client import exit_text

    stop_at: list[float] = []   # when the API servers were asked to stop
    problems: list[str] = []

    def stop_servers() -> None:
        if not stop_at:
            stop_at.append(time.monotonic())
        for server in servers:
            if server.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(server.pid, signal.SIGTERM)

    def on_signal(signum, frame) -> None:
        if not stop_at:
            log.info("%s: stopping the API servers", signal.Signals(signum).name)
        stop_servers()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        running, core_seen = set(servers), False
        while running:
            waited = None if not stop_at else max(0.0, stop_at[0] + drain_s + EXIT_GRACE_S - time.monotonic())
            multiprocessing.connection.wait([s.sentinel for s in running] + ([] if core_seen else [core.sentinel]),
                                            timeout=min(waited, 1.0) if waited is not None else None)
            if not core_seen and core.exitcode is not None:
                core_seen = True
                if not stop_at:   # the API servers see it too: each fails its requests and exits
                    problems.append(f"the engine core process {exit_text(core.exitcode)}")
                    stop_at.append(time.monotonic())
                elif core.exitcode != 0:
                    problems.append(f"the engine core process {exit_text(core.exitcode)} while stopping")
            for server in [s for s in running if s.exitcode is not None]:
                running.discard(server)
                index = servers.index(server)
                if not stop_at:
                    problems.append(f"API server {index} {exit_text(server.exitcode)}: stopping the others")
                    stop_servers()
                elif not _clean_exit(server.exitcode):
                    problems.append(f"API server {index} {exit_text(server.exitcode)}")
            if running and stop_at and time.monotonic() > stop_at[0] + drain_s + EXIT_GRACE_S:
                problems.append(f"API servers {sorted(servers.index(s) for s in running)} did not stop in time: "
                                "killed")
                for server in running:
                    server.kill()
                    server.join()
                running.clear()
        core.join(drain_s + EXIT_GRACE_S)   # it stops once the last API server has stopped, or gone
        if core.is_alive():
            problems.append("the engine core did not stop in time: killed")
            core.kill()
            core.join()
        elif not core_seen and core.exitcode != 0:
            problems.append(f"the engine core process {exit_text(core.exitcode)}")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for problem in problems:
        log.error("%s", problem)
    return 1 if problems else 0
