"""Clients that hold connections, on real sockets: slow headers ("slowloris"), slow bodies, answers left
unread, oversized headers, more connections than the cap. uvicorn's two HTTP protocols (httptools, h11) with
the guard of :mod:`tripath.server.http.connections`, served on a thread of this process with a small app; then
``tripath serve`` itself as a process started with a soft open-file limit below the number of slow
connections, which it serves beside them only because it raises that limit."""

import json
import select
import socket
import threading
import time

import httpx
import pytest

from server_process import ServerProcess

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from tripath.server.http.connections import ConnectionLimits, fitted_max_connections, guarded_protocol  # noqa: E402

QUICK = ConnectionLimits(header_timeout_s=0.5, body_timeout_s=0.5, max_connections=8, max_header_bytes=4096,
                         send_timeout_s=0.5)
BIG_CHUNKS = 256   # /big streams this many MiB
WAIT_S = 60   # how long a test waits for an answer that must come: generous, a busy machine is slow
TIMER_SLACK_S = 0.01   # an event loop timer may fire up to a millisecond or so early


def _app(seen: dict):
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    async def echo(request: Request):
        try:
            return PlainTextResponse(str(len(await request.body())))
        except ClientDisconnect:
            seen["disconnected"] = seen.get("disconnected", 0) + 1
            return PlainTextResponse("gone", status_code=400)

    async def big(request: Request):
        async def chunks():
            try:
                for _ in range(BIG_CHUNKS):
                    yield b"x" * (1 << 20)
            finally:
                seen["big_ended"] = time.monotonic()

        return StreamingResponse(chunks())

    return Starlette(routes=[Route("/echo", echo, methods=["POST"]), Route("/ok", lambda r: PlainTextResponse("ok")),
                             Route("/big", big)])


@pytest.fixture(params=["httptools", "h11"])
def guarded(request):
    """``(port, seen)``: a guarded uvicorn serving :func:`_app` on a thread, with :data:`QUICK` limits
    (httptools on uvloop, h11 on asyncio's loop)."""
    import importlib.util

    if request.param == "httptools":   # as tripath serve runs: httptools on uvloop (where installed)
        pytest.importorskip("httptools")
    loop = "uvloop" if request.param == "httptools" and importlib.util.find_spec("uvloop") else "asyncio"
    seen: dict = {}
    sock = socket.create_server(("127.0.0.1", 0))
    config = uvicorn.Config(_app(seen), loop=loop, http=guarded_protocol(request.param, QUICK), log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    yield sock.getsockname()[1], seen
    server.should_exit = True
    thread.join(WAIT_S)
    sock.close()


def _connect(port: int, send: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    if send:
        s.sendall(send)
    return s


def _read_until_closed(s: socket.socket, timeout_s: float = WAIT_S) -> bytes:
    """What the server sends until it closes the connection (a reset counts as closed)."""
    s.settimeout(timeout_s)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _error_of(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_slow_headers_get_408_and_a_silent_connection_is_closed(guarded):
    port, _ = guarded
    start = time.monotonic()
    slow = _connect(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Le")
    silent = _connect(port)
    status, error = _error_of(_read_until_closed(slow))
    assert time.monotonic() - start >= QUICK.header_timeout_s - TIMER_SLACK_S
    assert status == 408 and error["code"] == "request_timeout" and "--header-timeout" in error["message"]
    assert _read_until_closed(silent) == b""   # it sent nothing: closed without a word
    # a kept-alive connection: one request answered, then the next one's headers trickle in and time out
    kept = _connect(port, b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
    assert kept.recv(4096).startswith(b"HTTP/1.1 200")
    kept.sendall(b"GET /ok HTTP/1.1\r\nHo")
    assert _error_of(_read_until_closed(kept))[0] == 408


def test_a_slow_body_gets_408_and_its_handler_sees_the_client_gone(guarded):
    port, seen = guarded
    start = time.monotonic()
    slow = _connect(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
    status, error = _error_of(_read_until_closed(slow))
    assert time.monotonic() - start >= QUICK.body_timeout_s - TIMER_SLACK_S
    assert status == 408 and "--body-timeout" in error["message"]
    deadline = time.monotonic() + WAIT_S
    while not seen.get("disconnected") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen["disconnected"] == 1
    whole = _connect(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\nConnection: close\r\n\r\n"
                           b"0123456789")
    assert _read_until_closed(whole).endswith(b"\r\n\r\n10")


def test_an_answer_left_unread_ends_its_connection_and_its_stream(guarded):
    port, seen = guarded
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # the server's send buffer fills soon
    s.connect(("127.0.0.1", port))
    start = time.monotonic()
    s.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")   # and never read
    deadline = time.monotonic() + WAIT_S
    while "big_ended" not in seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen["big_ended"] - start >= QUICK.send_timeout_s - TIMER_SLACK_S
    assert 0 < len(_read_until_closed(s)) < BIG_CHUNKS << 20   # what was sent before, then the end


def test_oversized_headers_are_refused(guarded, request):
    port, _ = guarded
    big = _connect(port, b"GET /ok HTTP/1.1\r\nHost: x\r\n" + b"X-Filler: " + b"a" * 20_000 + b"\r\n")
    response = _read_until_closed(big)
    if "httptools" in request.node.name:   # httptools has no limit of its own: the guard's 431
        status, error = _error_of(response)
        assert status == 431 and "4096 bytes" in error["message"]
    else:   # h11 refuses past 16 KiB itself, before the guard's limit counts
        assert response.startswith(b"HTTP/1.1 400")


def test_connections_beyond_the_cap_get_503_at_once(guarded):
    port, _ = guarded
    held = [_connect(port, b"GET /ok HTTP/1.1\r\n") for _ in range(QUICK.max_connections)]
    time.sleep(0.05)   # not needed for the 503 (the server accepts in order); lets the cap see them all
    start = time.monotonic()
    extra = _connect(port, b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
    status, error = _error_of(_read_until_closed(extra))
    assert status == 503 and error["code"] == "too_many_connections" and "--max-connections" in error["message"]
    assert time.monotonic() - start < QUICK.header_timeout_s or any(select.select([h], [], [], 0)[0] for h in held), \
        "the refusal waited for the held connections to time out"
    for h in held:
        h.close()
    deadline = time.monotonic() + WAIT_S
    while True:   # the server sees the closes as its loop gets to them
        response = _read_until_closed(_connect(port, b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
        if response.startswith(b"HTTP/1.1 200") or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert response.startswith(b"HTTP/1.1 200")


def test_the_default_cap_leaves_files_to_the_server():
    assert fitted_max_connections(None, 1 << 20) == 4096
    assert fitted_max_connections(None, 1024) == 1024 - 256
    assert fitted_max_connections(100, 1024) == 100 and fitted_max_connections(5000, 1024) == 5000
    with pytest.raises(ValueError, match="header_timeout_s must be a positive finite number, got 0"):
        ConnectionLimits(header_timeout_s=0)


SLOW, OPEN_FILES, HEADER_TIMEOUT_S = 160, 128, 5.0


def test_slowloris_past_the_open_file_limit_does_not_block_requests(tmp_path):
    """The server starts with a soft limit of 128 open files and takes 160 connections that send their headers
    slowly; a completion and /health are answered while all of them are held (without the raised limit the
    server could not accept them, and the requests would wait for the header timeout), and each slow
    connection gets its 408 after the timeout."""
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 4 * SLOW:
        pytest.skip("the hard open-file limit is too low to show the soft one raised")
    server = ServerProcess(["--model", "tiny-llama", "--backend", "torch", "--num-kv-blocks", "16", "--max-model-len",
                            "128", "--header-timeout", str(HEADER_TIMEOUT_S)], tmp_path / "server.log",
                           open_files=OPEN_FILES)
    try:
        limits = next(line for line in open(f"/proc/{server.proc.pid}/limits") if line.startswith("Max open files"))
        assert limits.split()[3] == limits.split()[4], limits   # soft raised to hard
        start = time.monotonic()
        slow = [_connect(server.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") for _ in range(SLOW)]
        for s in slow[::4]:
            s.sendall(b"Content-Type: app")   # still trickling
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as h:
            r = h.post("/v1/completions", json={"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": 2})
            assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2
            assert h.get("/health").status_code == 200
        answered = time.monotonic() - start
        if answered < HEADER_TIMEOUT_S:   # else inconclusive on a machine this slow: the timeout freed them
            assert not select.select(slow, [], [], 0)[0], "slow connections were answered before their timeout"
        for s in slow:
            assert _error_of(_read_until_closed(s))[0] == 408
        assert time.monotonic() - start >= HEADER_TIMEOUT_S
    finally:
        server.close()
    assert "Exception in ASGI application" not in server.log()
