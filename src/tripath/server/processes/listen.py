"""The server's listening socket, bound before the engine is built, so a port that is taken (or an address
that is not this machine's) fails in a fraction of a second instead of after the model has loaded."""

from __future__ import annotations

import errno
import socket


class ListenError(OSError):
    """The server cannot listen on the address it was given; the message says why and what to change."""


def bind_listener(host: str, port: int, backlog: int = 2048, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` and listening (connections queue until the server accepts them).
    ``reuse_port``: with ``SO_REUSEPORT``, so other processes of this user may listen on the same address and
    the kernel spreads the connections over them (the API servers of ``--api-server-count``). Raises
    :class:`ListenError` naming the address and, for a port in use, ``--port``."""
    if reuse_port and not hasattr(socket, "SO_REUSEPORT"):
        raise ListenError("several API servers need SO_REUSEPORT, which this system does not have; use "
                          "--api-server-count 1")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise ListenError(f"cannot listen on {host}:{port}: the host does not resolve ({error.strerror}); "
                          "check --host") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise ListenError(f"cannot listen on {host}:{port}: the port is in use by another process; stop it or "
                              "pick another with --port") from None
        if error.errno == errno.EADDRNOTAVAIL:
            raise ListenError(f"cannot listen on {host}:{port}: the address is not one of this machine's; check "
                              "--host") from None
        if error.errno == errno.EACCES:
            raise ListenError(f"cannot listen on {host}:{port}: permission denied (ports below 1024 need "
                              "privileges); pick another with --port") from None
        raise ListenError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    sock.set_inheritable(True)
    return sock
