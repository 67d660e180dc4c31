"""Connections bounded below the app: how long a client may take to send a request, how many connections the
server holds, and how many files it may open.

A client that opens connections and sends its headers a byte at a time ("slowloris") costs the server a file
descriptor each and no CPU; uvicorn puts no time limit on a request's headers or body, so a thousand such
connections used up the process's 1024 files and every new connection waited in the kernel's queue. Here,
each connection of ``tripath serve`` (uvicorn's HTTP protocol, httptools or h11, with :class:`_Guard` mixed
in) is held to:

- ``header_timeout_s``: a request's headers complete within this many seconds of the connection opening or of
  the request's first byte on a kept-alive connection. Past it: ``408`` and the connection closes (closed
  without an answer when it sent nothing at all). Headers larger than ``max_header_bytes`` get ``431``.
- ``body_timeout_s``: the body complete within this many seconds of the headers; past it ``408`` (unless the
  app has begun its answer) and the connection closes; the handler reading it sees the client gone.
- ``send_timeout_s``: an answer the client leaves unread — the connection's send buffer full, the handler
  waiting to write more — for this many seconds in a row ends the connection (dropping what is unsent; the
  handler sees the client gone, so a stream's generation is aborted). Without it a client that never reads
  held its connection, and its stream's handler, for ever.
- ``max_connections``: a connection opened while this many are open is answered ``503`` at once and closed,
  so clients beyond the cap are told, not left waiting. Each API server process (``--api-server-count``)
  holds its own cap.

Between requests on a kept-alive connection uvicorn's own ``timeout_keep_alive`` (5 s) applies. The answers
carry OpenAI's error body. :func:`raise_open_file_limit` lifts the process's soft limit on open files to its
hard limit at start (as vLLM does), and :func:`fitted_max_connections` keeps the default cap below it.
"""

from __future__ import annotations

import http
import json
import logging
from dataclasses import dataclass

log = logging.getLogger("tripath.server")

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_SEND_TIMEOUT_S = 60.0
DEFAULT_MAX_CONNECTIONS = 4096
MAX_HEADER_BYTES = 64 << 10   # a request line and headers (h11 itself stops at 16 KiB; httptools has no limit)
FILES_KEPT = 256              # open files the default cap leaves to the server itself (pipes, logs, model files)
REFUSED_LINGER_S = 1.0        # a refused connection is read and dropped this long, so the 503 is not lost to a reset


@dataclass(frozen=True)
class ConnectionLimits:
    """What each connection is held to (see the module doc)."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_header_bytes: int = MAX_HEADER_BYTES
    send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S

    def __post_init__(self):
        for name in ("header_timeout_s", "body_timeout_s", "max_connections", "max_header_bytes", "send_timeout_s"):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ValueError(f"{name} must be a positive finite number, got {value}")


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files (``RLIMIT_NOFILE``) to its hard limit; the soft limit in
    effect after (the old one, logged, where the system refuses)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as error:
        log.warning("could not raise the open-file limit from %d to %d (%s): the server holds at most about %d "
                    "connections", soft, target, error, soft)
        return soft
    return target


def fitted_max_connections(asked: int | None, open_files: int) -> int:
    """The connection cap: ``asked`` (``--max-connections``) as given, with a warning when it leaves fewer than
    :data:`FILES_KEPT` of the ``open_files`` the process may open; by default :data:`DEFAULT_MAX_CONNECTIONS`,
    lowered to leave them."""
    room = max(16, open_files - FILES_KEPT)
    if asked is None:
        return min(DEFAULT_MAX_CONNECTIONS, room)
    if asked > room:
        log.warning("--max-connections %d with an open-file limit of %d: connections beyond about %d fail to be "
                    "accepted and wait instead of getting a 503; raise the limit (ulimit -n)", asked, open_files, room)
    return asked


def guarded_protocol(http_impl: str, limits: ConnectionLimits) -> type:
    """uvicorn's HTTP protocol class ``http_impl`` (``"httptools"`` or ``"h11"``) held to ``limits``: pass it
    to ``uvicorn.Config(http=...)``."""
    if http_impl == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    elif http_impl == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    else:
        raise ValueError(f"http_impl must be 'httptools' or 'h11', got {http_impl!r}")
    return type(f"Guarded{base.__name__}", (_Guard, base), {"limits": limits})


def _raw_response(status: int, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "server_error", "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class _Guard:
    """Mixed into uvicorn's HTTP protocol (before it in the bases). It reads the protocol's ``cycle`` (the
    request being served: a new one once a request's headers are parsed; ``more_body`` false once its body
    is whole; ``response_started`` / ``response_complete``), ``connections``, ``transport`` and ``loop``, and
    follows the connection through its phases: ``"headers"`` (a request begun, its headers not whole),
    ``"body"``, and None (nothing to time: a request being answered, or an idle kept-alive connection)."""

    limits: ConnectionLimits

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._timer, self._phase, self._cycle, self._header_bytes, self._refused = None, None, None, 0, False
        self._unread_timer = None
        if len(self.connections) > self.limits.max_connections:   # this one is counted already
            self._refuse()
        else:
            self._enter("headers")

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._phase is None and (self.cycle is None or self.cycle.response_complete):
            self._enter("headers")   # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        self._follow(len(data))

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow(0)   # h11 parses a pipelined request here

    def connection_lost(self, exc) -> None:
        self._enter(None)
        self._written()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._unread_timer is None:
            self._unread_timer = self.loop.call_later(self.limits.send_timeout_s, self._unread)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._written()

    def _written(self) -> None:
        if self._unread_timer is not None:
            self._unread_timer.cancel()
            self._unread_timer = None

    def _unread(self) -> None:
        """The client left the answer unread for ``send_timeout_s``: drop the connection and what is unsent."""
        self._unread_timer = None
        self._enter(None)
        self.transport.abort()

    def _follow(self, received: int) -> None:
        """Move to the phase the parser has reached after ``received`` more bytes."""
        cycle = self.cycle
        if cycle is not None and cycle is not self._cycle:   # a request's headers were parsed
            self._cycle = cycle
            self._enter("body" if cycle.more_body else None)
        elif self._phase == "body" and not cycle.more_body:
            self._enter(None)
        elif self._phase == "headers":
            self._header_bytes += received
            if self._header_bytes > self.limits.max_header_bytes:
                self._close_with(431, f"the request's headers are larger than {self.limits.max_header_bytes} bytes",
                                 "headers_too_large")

    def _enter(self, phase: str | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._phase, self._header_bytes = phase, 0
        if phase is not None and not self.transport.is_closing():
            seconds = self.limits.header_timeout_s if phase == "headers" else self.limits.body_timeout_s
            self._timer = self.loop.call_later(seconds, self._timed_out, phase, seconds)

    def _timed_out(self, phase: str, seconds: float) -> None:
        self._timer = None
        if phase == "headers" and self._header_bytes == 0:   # nothing sent: close without a word
            self._enter(None)
            self.transport.close()
            return
        flag = "--header-timeout" if phase == "headers" else "--body-timeout"
        self._close_with(408, f"the request's {phase} did not arrive within {seconds:g} s ({flag})", "request_timeout")

    def _close_with(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` unless the app has begun an answer to this request, and close."""
        self._enter(None)
        cycle = self.cycle
        if not self.transport.is_closing():
            if cycle is None or cycle.response_complete or not cycle.response_started:
                self.transport.write(_raw_response(status, message, code))
            self.transport.close()

    def _refuse(self) -> None:
        """A 503 for a connection beyond the cap; the connection is read and dropped until the client closes,
        or :data:`REFUSED_LINGER_S` (closing with its request unread would reset it and lose the answer)."""
        self._refused = True
        self.transport.write(_raw_response(503, f"the server holds its limit of {self.limits.max_connections} "
                                                "connections (--max-connections); retry later",
                                           "too_many_connections"))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._timer = self.loop.call_later(REFUSED_LINGER_S, self.transport.close)
