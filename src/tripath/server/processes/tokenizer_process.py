"""A helper process with its own copy of the tokenizer, running calls on it for an API server.

Tokenising megabytes of text holds the interpreter lock for much of the time it takes: ``transformers`` turns
the Rust encoding into Python lists (a 16 MiB text: several million ids, half a second at a time), and a reply
of millions of ids is built and encoded. In the API server's process that pauses its event loop, and with it
every other request's stream and ``/health``. In a process of its own it pauses nothing there.

A call is ``fn(tokenizer, payload, *args) -> bytes``: ``fn`` a top-level function (pickled by name), ``payload``
bytes (a request's body), ``args`` small. The payload and the result cross the pipe as raw bytes, written
from and read into their buffers with the interpreter lock released: the API server neither pickles nor
copies them (a 16 MiB body and a 27 MB reply would cost tens of milliseconds each otherwise).

- One process, started on the first call (``spawn``), loads the tokenizer from the handle it is given
  (:func:`~tripath.server.transport.core_wire.load_tokenizer_handle`, as the API server loaded its own) and
  runs one call at a time at a lower priority (niceness + :data:`HELPER_NICENESS`): its bulk work yields the
  CPU to the engine and the event loop.
- Calls wait their turn on the helper's own thread, holding none of the server's worker threads.
- A call that raises in the helper raises the same exception here (one that does not pickle: a
  ``RuntimeError`` naming it). A helper that dies (killed, out of memory) fails the call in flight with
  :class:`TokenizerProcessDied`; the next call starts a new one.
- :meth:`TokenizerProcess.close` kills it: a server that stops does not wait for a tokenising in progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import multiprocessing
import os
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import wait
from typing import Callable

from tripath.server.transport.core_wire import load_tokenizer_handle

log = logging.getLogger("tripath.server")

HELPER_NICENESS = 10


class TokenizerProcessDied(RuntimeError):
    """The helper process ended before it answered (the next call starts a new one)."""


class _NotTaken(Exception):
    """The helper process ended before it took the call."""


TAKEN = None   # the helper's first answer to a call: it has the payload (a call it had not taken may be retried)


def _next_message(conn, process):
    """The helper's next message; ``EOFError`` if it ended first."""
    if conn not in wait([conn, process.sentinel]):
        raise EOFError
    return conn.recv()


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd: int, size: int) -> bytearray:
    buffer = bytearray(size)
    view, done = memoryview(buffer), 0
    while done < size:
        n = os.readv(fd, [view[done:]])
        if n == 0:
            raise EOFError
        done += n
    return buffer


def _round_trips(error: Exception) -> bool:
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any failure: it does not pickle, or does not unpickle
        return False
    return True


def _serve(conn, handle) -> None:
    """The helper's main: load the tokenizer, then answer each call (``(fn, args, payload size)``, then the
    payload) with :data:`TAKEN` once it has the payload, then ``(True, result size)`` and the result, or
    ``(False, exception)``, until the pipe closes. A tokenizer that does not load is the first call's error."""
    logging.getLogger("tripath").setLevel(logging.ERROR)   # the API server logs what the calls' parsing does
    try:
        tokenizer, failed = load_tokenizer_handle(handle), None
    except Exception as error:  # noqa: BLE001 - told to the caller, then this process ends
        tokenizer, failed = None, RuntimeError(f"the tokenizer helper could not load the tokenizer: "
                                               f"{type(error).__name__}: {error}")
    fd = conn.fileno()
    with contextlib.suppress(EOFError, OSError):   # the API server is gone, or closed the helper
        while _answer(conn, fd, tokenizer, failed):
            pass


def _answer(conn, fd: int, tokenizer, failed: Exception | None) -> bool:
    """Take one call and answer it; whether to take another."""
    fn, args, size = conn.recv()
    payload = bytes(_read_exactly(fd, size))
    conn.send(TAKEN)
    if failed is not None:
        conn.send((False, failed))
        return False
    try:
        result = bytes(fn(tokenizer, payload, *args))
    except Exception as error:  # noqa: BLE001 - the caller's to raise
        conn.send((False, error if _round_trips(error) else RuntimeError(f"{type(error).__name__}: {error}")))
        return True
    del payload
    conn.send((True, len(result)))
    _write_all(fd, result)
    return True


class TokenizerProcess:
    """The helper process of a tokenizer (see the module doc); ``handle``: the tokenizer as
    :func:`~tripath.server.transport.core_wire.tokenizer_handle` describes it. Use :meth:`run` on an event loop,
    or :meth:`call` from any thread."""

    def __init__(self, handle: tuple):
        self.handle = handle
        self._context = multiprocessing.get_context("spawn")
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer-process")
        self._lock = threading.Lock()   # guards the process and its pipe, and the closed flag
        self._process = None
        self._conn = None
        self._closed = False

    @property
    def pid(self) -> int | None:
        """The helper's process id while one runs, else None."""
        with self._lock:
            return None if self._process is None else self._process.pid

    async def run(self, fn: Callable[..., bytes], payload: bytes, *args) -> bytearray:
        """``fn(tokenizer, payload, *args)`` in the helper, awaited on the event loop (see :meth:`call`)."""
        call = functools.partial(self.call, fn, payload, *args)
        return await asyncio.get_running_loop().run_in_executor(self._thread, call)

    def call(self, fn: Callable[..., bytes], payload: bytes, *args) -> bytearray:
        """``fn(tokenizer, payload, *args)`` in the helper (started now if none runs): its result's bytes, or
        the exception it raised; :class:`TokenizerProcessDied` if the helper ended before it answered (a call
        that a helper ended before taking, one killed while idle, goes to a new one). One call at a time
        runs: call it from the helper's thread (:meth:`run`) unless nothing else calls."""
        try:
            return self._call_once(fn, payload, args)
        except _NotTaken:
            return self._call_once(fn, payload, args, last=True)

    def _call_once(self, fn, payload: bytes, args: tuple, last: bool = False) -> bytearray:
        process, conn = self._started()
        taken = False
        try:
            conn.send((fn, args, len(payload)))
            _write_all(conn.fileno(), payload)
            taken = _next_message(conn, process) is TAKEN
            ok, value = _next_message(conn, process)
            if ok:
                return _read_exactly(conn.fileno(), value)
        except (EOFError, OSError):
            self._forget(process)
            if not taken and not last:
                raise _NotTaken from None
            raise TokenizerProcessDied(f"the tokenizer helper process {process.pid} ended (exit status "
                                       f"{process.exitcode}: out of memory, or killed) before it answered; the "
                                       f"next request starts another") from None
        raise value

    def close(self, timeout_s: float = 5.0) -> None:
        """Kill the helper (a call in flight fails with :class:`TokenizerProcessDied`, calls waiting for their
        turn too) and wait up to ``timeout_s`` for it to be reaped; no call starts another."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            process = self._process
        if process is None:
            self._thread.shutdown(wait=False)
            return
        process.kill()
        forgotten = self._thread.submit(self._forget, process)   # on the helper's thread: after the call in flight
        self._thread.shutdown(wait=False)
        with contextlib.suppress(TimeoutError):
            forgotten.result(timeout_s)

    def _started(self):
        with self._lock:
            if self._closed:
                raise TokenizerProcessDied("the tokenizer helper is closed: the server is stopping")
            if self._process is not None and not self._process.is_alive():   # it ended since the last call
                self._reap()
            if self._process is None:
                ours, theirs = self._context.Pipe()
                process = self._context.Process(target=_serve, args=(theirs, self.handle), daemon=True,
                                                name="tripath-tokenizer")
                process.start()
                theirs.close()
                with contextlib.suppress(OSError):   # set here, not in the helper: its imports run lower already
                    niceness = min(os.getpriority(os.PRIO_PROCESS, 0) + HELPER_NICENESS, 19)
                    os.setpriority(os.PRIO_PROCESS, process.pid, niceness)
                self._process, self._conn = process, ours
                log.info("tokenizer helper process %d started", process.pid)
            return self._process, self._conn

    def _forget(self, process) -> None:
        """Kill ``process`` if it is still the helper, reap it and close its pipe. Only on the thread that calls
        (a pipe closed under a call in flight could be reused by another file)."""
        with self._lock:
            if process is not None and self._process is process:
                process.kill()
                self._reap()

    def _reap(self) -> None:
        """(Holding the lock:) the helper has ended or been killed: reap it, close its pipe, forget it."""
        process = self._process
        process.join(5)
        self._conn.close()
        self._process = self._conn = None
        if process.exitcode != 0 and not self._closed:
            log.warning("the tokenizer helper process %d ended with status %s; the next call starts another",
                        process.pid, process.exitcode)
