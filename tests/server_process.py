"""Start ``tripath serve`` as a real process on a free loopback port, wait for ``/health``, and stop it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

SRC = str(Path(__file__).resolve().parents[1] / "src")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _soft_open_files(limit: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, startup_timeout_s: float = 120.0, log_level: str = "warning",
                 env: dict[str, str] | None = None, new_session: bool = False, open_files: int | None = None):
        """``new_session``: the server leads its own process group (:meth:`signal_group` then signals it and
        every process it started, as a terminal's Ctrl-C does). ``open_files``: the server starts with this soft
        limit on open files (its hard limit unchanged)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="0",
                   PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]), **(env or {}))
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "tripath.cli", "serve", *args, "--port", str(self.port),
                                      "--log-level", log_level], stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=new_session,
                                     preexec_fn=None if open_files is None else lambda: _soft_open_files(open_files))
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                self.close()
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the server did not become healthy in {startup_timeout_s} s:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        """The whole log so far. Never a tail: how much a start writes (its /health polls among it) depends on
        the machine's speed, and an assertion about the log must not."""
        return self.log_path.read_text()

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples by name, labels kept in the name as the server writes them (sorted), e.g.
        ``tripath:request_success_total{engine="0",finished_reason="stop",model_name="m"}``."""
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def signal(self, sig=signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def signal_group(self, sig: int | None = None) -> None:
        """Signal the server's process group (SIGINT by default; needs ``new_session``)."""
        os.killpg(self.proc.pid, sig or signal.SIGINT)

    def core_pid(self) -> int:
        """The engine core's process id, from the log (``--log-level info`` or lower)."""
        match = re.search(r"engine core process (\d+) started", self.log_path.read_text())
        if match is None:
            raise RuntimeError(f"the log names no engine core process:\n{self.log()}")
        return int(match.group(1))

    def tokenizer_helper_pid(self) -> int:
        """The latest tokenizer helper process's id, from the log (``--log-level info``)."""
        started = re.findall(r"tokenizer helper process (\d+) started", self.log_path.read_text())
        if not started:
            raise RuntimeError(f"the log names no tokenizer helper process:\n{self.log()}")
        return int(started[-1])

    def api_server_pids(self) -> list[int]:
        """The API server processes of ``--api-server-count N``, from the log (``--log-level info``)."""
        match = re.search(r"API servers started: processes ([\d, ]+)", self.log_path.read_text())
        if match is None:
            raise RuntimeError(f"the log names no API server processes:\n{self.log()}")
        return [int(p) for p in match.group(1).split(", ")]

    def close(self, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


class HealthWatch:
    """Polls ``/health`` every ``interval_s`` on its own thread and keeps the slowest answer, the polls and the
    statuses that were not 200."""

    def __init__(self, url, interval_s: float = 0.05):
        self.url, self.interval_s = url, interval_s
        self.slowest, self.polls, self.failures = 0.0, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self):
        with httpx.Client(timeout=10) as h:
            while not self._stop.is_set():
                start = time.perf_counter()
                r = h.get(self.url + "/health")
                self.slowest, self.polls = max(self.slowest, time.perf_counter() - start), self.polls + 1
                if r.status_code != 200:
                    self.failures.append(r.status_code)
                self._stop.wait(self.interval_s)

    def stop(self):
        self._stop.set()
        self._thread.join(30)


class Stream:
    """One streamed completion on a connection of its own, read on a thread with plain socket reads (no HTTP
    parsing, so a stream with large events costs the test process little): when each event arrived."""

    def __init__(self, port: int, body: dict, headers: dict[str, str] | None = None):
        data = json.dumps({**body, "stream": True}).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode()
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=300)
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"%sContent-Length: %d\r\n\r\n%s" % (extra, len(data), data))
        self.local_port = self.sock.getsockname()[1]
        self.times: list[float] = []
        self.status: int | None = None
        self.completed = False   # the stream's [DONE] arrived
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        tail = b""
        try:
            while True:
                data = self.sock.recv(1 << 16)
                if not data:
                    return
                now = time.monotonic()
                if self.status is None:
                    self.status = int(data.split(b" ", 2)[1])
                chunk = tail + data
                self.times += [now] * chunk.count(b"data: {")
                if b"data: [DONE]" in chunk:
                    self.completed = True
                    return
                tail = chunk[-16:]
        except OSError:
            pass
        finally:
            self.done.set()

    def wait_events(self, count: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.times) < count and not self.done.is_set():
            assert time.monotonic() < deadline, f"{len(self.times)} events of {count} in {timeout_s} s"
            time.sleep(0.01)

    def longest_gap(self, since: float = float("-inf"), until: float | None = None) -> float:
        """The longest time between two events after ``since``; with ``until``, the time from the last event
        to then counts too (a stream that stopped has a gap up to now)."""
        times = [t for t in self.times if t >= since]
        if until is not None:
            times.append(until)
        return max((b - a for a, b in zip(times, times[1:])), default=0.0)

    def close(self):
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(30)
