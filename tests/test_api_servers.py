"""``tripath serve --api-server-count N``: several API server processes in front of one engine core.

The core routes each request's outputs to the API server that sent it, ends one API server's requests at its
``stop`` while the others serve on, aborts the requests of one that is gone, and bounds the engine's waiting
queue for all; ``/metrics`` merges the API servers' metrics. End to end on the tiny preset (real processes on
loopback): concurrent streams spread over both API servers and match the in-process engine token for token,
every scrape counts every request, SIGTERM drains and stops everything (exit 0), a killed API server or core
stops the rest (exit 1), a killed supervisor takes everything with it."""

import asyncio
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tripath.engine.core.engine_core import StepResult
from tripath.engine.requests.request import CompletionOutput, FinishReason, RequestOutput
from tripath.engine.requests.sampling_params import SamplingParams
from tripath.engine.scheduling.stats import EngineStats

pytest.importorskip("fastapi")

from server_process import ServerProcess, running  # noqa: E402
from tripath.server.transport.core_messages import Abort, Add, Stop, Stopped, Update  # noqa: E402
from tripath.server.transport.core_wire import FrameReader  # noqa: E402

pytestmark = pytest.mark.usefixtures("pure_torch_one_thread")

PRESET = "tiny-llama"
SERVE = ["--model", PRESET, "--backend", "torch", "--num-kv-blocks", "160", "--max-model-len", "2048",
         "--api-server-count", "2"]


# ---- the merged /metrics ----------------------------------------------------------------------------------
def _samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_merged_metrics_add_up_the_requests_and_keep_the_engines_own():
    from tripath.server.metrics.metric_kinds import render
    from tripath.server.metrics.metrics import ChoiceTimes, ServerMetrics
    from tripath.server.processes.metrics_peers import merge_families

    own, peer = ServerMetrics("m"), ServerMetrics("m")
    for m in (own, peer):
        m.engine_ready(2048, {"block_size": "16"})
    for metrics, ttft, reason, count in ((own, 0.03, "length", 2), (peer, 0.3, "stop", 1)):
        for _ in range(count):
            times = ChoiceTimes(arrival=10.0, num_prompt_tokens=5, max_tokens=8)
            metrics.observe_tokens(times, 1, 10.0 + ttft)
            metrics.observe_tokens(times, 3, 10.0 + ttft + 0.03)
            metrics.observe_end(times, reason, 11.0)
    steps = (0, 20, 10) + (0,) * 11
    own.observe_engine(EngineStats(2, 1, 5, 100, 40, 10, 1, 30, steps, 400), num_new_tokens=8)
    peer.observe_engine(EngineStats(3, 0, 7, 100, 30, 5, 0, 25, steps[:-1] + (1,), 300),
                        num_new_tokens=4)   # an older view of the engine
    families = merge_families(own.families(), [peer.families()])
    merged = _samples(render(families, "tripath").decode())
    theirs = {k: v for k, v in _samples(render(families, "vllm").decode()).items() if k.startswith("vllm:")}
    assert len(theirs) > 100 and all(merged[k.replace("vllm:", "tripath:", 1)] == v for k, v in theirs.items())
    labels = 'engine="0",model_name="m"'
    assert merged[f'tripath:request_success_total{{{labels[:10]},finished_reason="length",{labels[11:]}}}'] == 2
    assert merged[f'tripath:request_success_total{{{labels[:10]},finished_reason="stop",{labels[11:]}}}'] == 1
    assert merged[f"tripath:time_to_first_token_seconds_count{{{labels}}}"] == 3
    assert merged[f'tripath:time_to_first_token_seconds_bucket{{{labels[:10]},le="0.04",{labels[11:]}}}'] == 2
    assert merged[f'tripath:time_to_first_token_seconds_bucket{{{labels[:10]},le="0.5",{labels[11:]}}}'] == 3
    assert merged[f'tripath:inter_token_latency_seconds_count{{{labels}}}'] == 9
    assert merged[f"tripath:generation_tokens_total{{{labels}}}"] == 12
    assert merged[f"tripath:prompt_tokens_total{{{labels}}}"] == 15
    # the engine's own families: the scraped API server's view, not a sum
    assert merged[f"tripath:num_requests_running{{{labels}}}"] == 2
    assert merged[f"tripath:engine_steps_total{{{labels}}}"] == 30
    assert merged[f"tripath:prefix_cache_hits_total{{{labels}}}"] == 10
    assert merged[f"tripath:iteration_tokens_total_count{{{labels}}}"] == 30
    assert merged[f"tripath:iteration_tokens_total_sum{{{labels}}}"] == 400
    assert merged['tripath:cache_config_info{block_size="16",engine="0"}'] == 1
    created = f"tripath:generation_tokens_created{{{labels}}}"
    assert merged[created] == min(_samples(own.render().decode())[created], _samples(peer.render().decode())[created])


def test_a_scrape_asks_its_peers_over_their_sockets_and_leaves_out_one_that_is_gone(tmp_path, caplog):
    from tripath.server.metrics.metrics import ChoiceTimes, ServerMetrics
    from tripath.server.processes.metrics_peers import MetricsPeers

    registries = [ServerMetrics("m") for _ in range(3)]
    for count, metrics in enumerate(registries[:2], start=1):
        for _ in range(count):
            times = ChoiceTimes(arrival=1.0, num_prompt_tokens=2, max_tokens=4)
            metrics.observe_tokens(times, 2, 1.5)
            metrics.observe_end(times, "length", 2.0)
    refreshed = []
    folder = tmp_path / "sockets"

    async def scrape():
        peers = [MetricsPeers(str(folder), i, 3, m.registry, refresh=lambda i=i: refreshed.append(i))
                 for i, m in enumerate(registries)]
        for p in peers[:2]:   # API server 2 is gone: no socket
            await p.start()
        try:
            return await peers[0].render(), await peers[1].render()
        finally:
            await peers[0].close()
            assert [f.name for f in folder.iterdir()] == ["1.sock"]   # API server 1 still serves: kept
            await peers[1].close()

    with caplog.at_level("WARNING", logger="tripath.server"):
        first, second = asyncio.run(scrape())
    success = 'tripath:request_success_total{engine="0",finished_reason="length",model_name="m"}'
    assert _samples(first.decode())[success] == 3 and _samples(second.decode())[success] == 3
    assert sorted(refreshed) == [0, 0, 1, 1]   # each answered once for itself and once for its peer
    assert "API server 2's metrics are left out of this scrape" in caplog.text
    assert not folder.exists()   # the last one closed: its socket and the folder are gone


def _abstract_names() -> set[str]:
    """The names of the abstract Unix sockets that exist now (``@name`` in ``/proc/net/unix``)."""
    with open("/proc/net/unix") as f:
        return {fields[-1] for fields in (line.split() for line in f.readlines()[1:])
                if len(fields) == 8 and fields[-1].startswith("@")}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets are Linux's")
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])   # the server runs on uvloop where it is installed
def test_abstract_metrics_sockets_put_nothing_on_disk_and_read_only_this_users_peers(caplog, monkeypatch, loop):
    from tripath.server.metrics.metrics import ServerMetrics
    from tripath.server.processes.api_servers import socket_folder
    from tripath.server.processes.metrics_peers import MetricsPeers

    folder = socket_folder()
    assert folder.startswith("\0tripath-api-servers-") and socket_folder() != folder   # fresh, random
    registries = [ServerMetrics("m") for _ in range(2)]

    async def scrape(uid_seen: int):
        peers = [MetricsPeers(folder, i, 2, m.registry) for i, m in enumerate(registries)]
        for p in peers:
            await p.start()
        names = _abstract_names()
        try:
            with monkeypatch.context() as mp:
                mp.setattr(os, "getuid", lambda: uid_seen)
                return names, await peers[0].render()
        finally:
            for p in peers:
                await p.close()

    run = pytest.importorskip("uvloop").run if loop == "uvloop" else asyncio.run
    with caplog.at_level("WARNING", logger="tripath.server"):
        names, text = run(scrape(os.getuid()))
    assert {"@" + folder[1:] + "/0.sock", "@" + folder[1:] + "/1.sock"} <= names
    assert not os.path.exists(folder[1:]) and "left out" not in caplog.text
    assert b"tripath:num_requests_in_server" in text
    assert not {n for n in _abstract_names() if n.startswith("@" + folder[1:])}   # gone once closed
    with caplog.at_level("WARNING", logger="tripath.server"):
        run(scrape(os.getuid() + 1))   # as if another user had taken the peer's name
    assert "the socket of API server 1 belongs to user" in caplog.text


# ---- the core's routing -----------------------------------------------------------------------------------
class _StandIn:
    """An engine whose every step gives each live request one token (the request id's number); finished at 3."""

    def __init__(self):
        self.live, self.aborted, self.waiting = {}, [], []

    @property
    def num_waiting(self):
        return len(self.waiting)

    def add_request(self, prompt, params, request_id=None):
        self.live[request_id] = 0

    def add_requests(self, requests):
        if any(not prompt for prompt, *_ in requests):
            raise ValueError("the prompt is empty")
        for prompt, params, request_id, _ in requests:
            self.live[request_id] = 0

    def abort(self, request_id):
        self.aborted.append(request_id)
        self.live.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self, decode_steps=None):
        return StepResult(self.outputs())

    def outputs(self):
        outs = []
        for request_id in list(self.live):
            self.live[request_id] += 1
            done = self.live[request_id] == 3
            reason = FinishReason.LENGTH if done else None
            outs.append(RequestOutput(request_id, None, [1], [CompletionOutput(0, "", [7], finish_reason=reason)], done,
                                      new_token_ids=[7]))
            if done:
                del self.live[request_id]
        return outs

    def stats(self):
        return EngineStats(len(self.live), len(self.waiting), 0, 10, 0, 0, 0, 0)


def _read_all(fd: int, reader: FrameReader) -> list:
    os.set_blocking(fd, False)
    messages = []
    while True:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return messages
        if not data:
            return messages
        messages += reader.feed(data)


def _close_pipes(pipes) -> None:
    for (commands, updates) in pipes:
        for fd in (*commands, *updates):
            try:
                os.close(fd)
            except OSError:
                pass


def test_the_core_routes_outputs_to_the_api_server_that_sent_the_request():
    from tripath.server.transport.core_loop import CoreLoop

    pipes = [(os.pipe(), os.pipe()) for _ in range(2)]   # per API server: (commands r, w), (updates r, w)
    llm = _StandIn()
    core = CoreLoop(llm, [(commands[0], updates[1]) for commands, updates in pipes], max_waiting=1)
    readers = [FrameReader(), FrameReader()]
    try:
        core._handle(0, Add("srv0-1-0", [1, 2], SamplingParams(max_tokens=3)))
        core._handle(1, Add("srv1-1-0", [1, 2], SamplingParams(max_tokens=3)))
        core._handle(1, Add("srv0-1-0", [1], SamplingParams(max_tokens=3)))   # an id in flight: refused
        core._handle(1, Abort("srv0-1-0"))   # not its request: ignored
        core._step()
        core._send_updates()
        got = [_read_all(updates[0], readers[i]) for i, (_, updates) in enumerate(pipes)]
        (update0,), (update1,) = got
        assert isinstance(update0, Update) and isinstance(update1, Update)
        accepted0, refused0, outputs0 = update0.accepted, update0.refused, update0.outputs
        accepted1, refused1, outputs1 = update1.accepted, update1.refused, update1.outputs
        assert accepted0 == ["srv0-1-0"] and [o[0] for o in outputs0] == ["srv0-1-0"] and not refused0
        assert accepted1 == ["srv1-1-0"] and [o[0] for o in outputs1] == ["srv1-1-0"]
        assert refused1 == [("srv0-1-0", 400, "request id 'srv0-1-0' is in flight already", "invalid_request_error",
                             "duplicate_request_id")]
        assert llm.aborted == []
        # the waiting queue is bounded for all API servers
        llm.waiting.append("someone")
        core._handle(0, Add("srv0-2-0", [1], SamplingParams(max_tokens=3)))
        assert core._frontends[0].refused[0][:2] == ("srv0-2-0", 503) and "--max-queue-depth 1" in \
            core._frontends[0].refused[0][2] and core._frontends[0].refused[0][4] == "queue_full"
        llm.waiting.clear()
        core._frontends[0].refused.clear()
        # API server 1 stops: its request ends with 503, it hears 'stopped', API server 0 serves on
        core._handle(1, Stop())
        *_, update, stopped = _read_all(pipes[1][1][0], readers[1])
        assert update.failed == [(["srv1-1-0"], 503, "the server is shutting down", "server_error")]
        assert stopped == Stopped() and not core._stopping and llm.aborted == ["srv1-1-0"]
        core._step()
        core._step()
        core._send_updates()
        (update,) = _read_all(pipes[0][1][0], readers[0])
        assert [o[0] for o in update.outputs] == ["srv0-1-0", "srv0-1-0"] and update.outputs[-1][2]   # finished
        # API server 0 goes away (its command pipe closes): nobody is left, the core stops
        core._handle(0, Add("srv0-3-0", [1], SamplingParams(max_tokens=3)))
        os.close(pipes[0][0][1])
        core._receive(block=False)
        assert core._stopping and llm.aborted[-1] == "srv0-3-0"
    finally:
        _close_pipes(pipes)


class _Talkative(_StandIn):
    """A stand-in whose requests never finish and bring 2,000 tokens a step (big updates)."""

    def outputs(self):
        return [RequestOutput(request_id, None, [1], [CompletionOutput(0, "", [7])], False,
                              new_token_ids=list(range(2000))) for request_id in self.live]


def test_a_core_never_waits_for_an_api_server_that_stops_reading(monkeypatch):
    """API server 1 reads nothing: the core goes on stepping and writing API server 0's updates; once API
    server 1's unread updates pass ``MAX_UNSENT_BYTES`` its requests end (aborted in the engine), and when it
    reads again it gets every update that waited, then the failure."""
    import threading

    from tripath.server.transport import core_loop as C

    monkeypatch.setattr(C, "MAX_UNSENT_BYTES", 1 << 20)
    pipes = [(os.pipe(), os.pipe()) for _ in range(2)]
    llm = _Talkative()
    core = C.CoreLoop(llm, [(commands[0], updates[1]) for commands, updates in pipes])
    reader0, reader1 = FrameReader(), FrameReader()
    got0 = []
    try:
        core._handle(0, Add("a", [1], SamplingParams(max_tokens=10 ** 6)))
        core._handle(1, Add("b", [1], SamplingParams(max_tokens=10 ** 6)))

        def steps():
            for _ in range(400):   # ~2.4 MB for each API server
                core._step()
                core._send_updates()
                got0.extend(_read_all(pipes[0][1][0], reader0))

        worker = threading.Thread(target=steps, daemon=True)
        worker.start()
        worker.join(60)
        assert not worker.is_alive(), "the core blocked on API server 1's full pipe"
        outputs0 = [o for message in got0 if isinstance(message, Update) for o in message.outputs]
        assert len(outputs0) == 400 and not any(message.failed for message in got0)   # API server 0: every step
        assert llm.aborted == ["b"] and "a" in llm.live
        got1 = []
        for _ in range(100):   # API server 1 reads again: what waited, then why its request ended
            got1 += _read_all(pipes[1][1][0], reader1)
            core._receive(block=False)   # writes what waits where the pipe has room
        failed = [f for message in got1 if isinstance(message, Update) for f in message.failed]
        assert failed and failed[0][0] == ["b"] and failed[0][1] == 503 and "fell too far behind" in failed[0][2]
        outputs1 = [o for message in got1 if isinstance(message, Update) for o in message.outputs]
        assert 0 < len(outputs1) < 400 and not core._frontends[1].unsent and not core._frontends[1].overflowed
    finally:
        _close_pipes(pipes)


# ---- end to end -------------------------------------------------------------------------------------------
def _wait_gone(pids: list[int], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while any(running(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if running(p)]}"
        time.sleep(0.1)


def test_streams_spread_over_the_api_servers_match_the_engine_and_every_scrape_counts_them(tmp_path):
    from tripath.engine import LLM

    server = ServerProcess(SERVE, tmp_path / "server.log", log_level="info")
    try:
        children = [server.core_pid(), *server.api_server_pids()]
        prompts = [[5 + i % 7, 3 + i % 5, 11] for i in range(24)]
        lengths = [4 + i % 5 for i in range(24)]

        async def one(client, prompt, n):
            body = {"model": PRESET, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            ids = []
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        ids += json.loads(line[6:])["choices"][0]["token_ids"]
            return ids

        async def run():
            # a fresh connection per request: the kernel spreads connections over the API servers
            async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                         limits=httpx.Limits(max_keepalive_connections=0)) as client:
                return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))

        results = asyncio.run(run())
        llm = LLM(PRESET, backend="torch", num_kv_blocks=160, max_model_len=2048)
        expected = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                                          for n in lengths], use_tqdm=False)
        assert results == [want.output_token_ids for want in expected]
        length = f'tripath:request_success_total{{engine="0",finished_reason="length",model_name="{PRESET}"}}'
        generated = f'tripath:generation_tokens_total{{engine="0",model_name="{PRESET}"}}'
        for _ in range(6):   # whichever API server answers the scrape: all of them
            with httpx.Client(timeout=10) as fresh:
                text = fresh.get(server.url + "/metrics").text
            samples = _samples(text)
            assert samples[length] == 24 and samples[generated] == sum(lengths)
        server.signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0, server.log()
        log = server.log()
        served = dict(re.findall(r"API server (\d) of 2 stopped; it served (\d+) engine requests", log))
        assert set(served) == {"0", "1"} and all(int(n) > 0 for n in served.values()), log
        assert sum(int(n) for n in served.values()) >= 24 and "Traceback" not in log
        _wait_gone(children)
    finally:
        server.close()


def test_sigterm_while_streaming_drains_every_api_server_then_stops_the_core(tmp_path):
    server = ServerProcess(SERVE, tmp_path / "server.log", log_level="info")
    try:
        children = [server.core_pid(), *server.api_server_pids()]
        with httpx.Client(base_url=server.url, timeout=60) as client:
            body = {"model": PRESET, "prompt": [9, 9], "max_tokens": 300, "stream": True, "ignore_eos": True}
            with client.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                first = next(line for line in lines if line.startswith("data:"))
                server.signal(signal.SIGTERM)
                events = [first] + [line for line in lines if line.startswith("data:")]
        tokens = sum(len(json.loads(e[6:])["choices"][0]["token_ids"]) for e in events[:-1])
        assert tokens == 300 and events[-1] == "data: [DONE]"
        assert server.proc.wait(30) == 0, server.log()
        assert "engine core stopped" in server.log()
        _wait_gone(children)
    finally:
        server.close()


def test_one_http_requests_engine_requests_are_taken_or_refused_together():
    """The choices of one HTTP request reach the core as one AddGroup: the shared waiting bound takes all of
    them or none (none of a refused HTTP request ever runs), one larger than the bound enters only an empty
    queue, and one that the engine refuses (an empty prompt, an id in flight) is refused whole."""
    from tripath.server.transport.core_loop import CoreLoop
    from tripath.server.transport.core_messages import AddGroup

    pipes = [(os.pipe(), os.pipe())]
    llm = _StandIn()
    core = CoreLoop(llm, [(commands[0], updates[1]) for commands, updates in pipes], max_waiting=2)
    frontend = core._frontends[0]

    def group(name, *prompts):
        return AddGroup(tuple(Add(f"{name}-{i}", p, SamplingParams(max_tokens=3)) for i, p in enumerate(prompts)))

    def outcome():
        got = ([r[:2] + r[4:] for r in frontend.refused], list(frontend.accepted))
        frontend.clear()
        return got

    try:
        llm.waiting.append("someone")   # 1 of 2 waiting: room for one more engine request, not two
        core._handle(0, group("a", [1], [1]))
        assert outcome() == ([("a-0", 503, "queue_full"), ("a-1", 503, "queue_full")], []) and not llm.live
        core._handle(0, group("b", [1]))
        assert outcome() == ([], ["b-0"]) and set(llm.live) == {"b-0"}
        llm.waiting.clear()
        core._handle(0, group("c", [1], [2], [3]))   # more than the bound, into an empty queue: taken whole
        assert outcome() == ([], ["c-0", "c-1", "c-2"]) and set(llm.live) == {"b-0", "c-0", "c-1", "c-2"}
        core._handle(0, group("d", [1], []))          # the engine refuses the second: neither is queued
        refused, accepted = outcome()
        assert [r[:2] for r in refused] == [("d-0", 400), ("d-1", 400)] and not accepted
        core._handle(0, AddGroup((Add("e-0", [1], SamplingParams()), Add("b-0", [1], SamplingParams()))))
        refused, accepted = outcome()   # an id in flight: the whole group is refused
        assert refused == [("e-0", 400, "duplicate_request_id"), ("b-0", 400, "duplicate_request_id")]
        assert "d-0" not in llm.live and "e-0" not in llm.live and not llm.aborted
    finally:
        _close_pipes(pipes)


def test_the_choices_of_one_request_cross_the_shared_queue_whole(tmp_path):
    """Over real processes (two API servers, one core): a request of more choices than ``--max-queue-depth``
    is taken whole by an idle engine, every choice running to its end."""
    server = ServerProcess(SERVE + ["--max-queue-depth", "2"], tmp_path / "server.log")
    try:
        body = {"model": PRESET, "prompt": [5, 6], "max_tokens": 4, "ignore_eos": True, "n": 3, "seed": 1}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 12 and len(r.json()["choices"]) == 3, r.text
        text = httpx.get(server.url + "/metrics", timeout=30).text
        assert not [line for line in text.splitlines() if line.startswith("tripath:requests_rejected_total{")
                    and not line.endswith(" 0.0")], text
    finally:
        server.close()


@pytest.mark.parametrize("victim", ["api server", "core", "supervisor", "process group"])
def test_a_killed_process_stops_the_rest(tmp_path, victim):
    temp = Path(tempfile.mkdtemp(prefix="tp-", dir="/tmp"))   # short: a socket's path must fit AF_UNIX
    server = ServerProcess(SERVE, tmp_path / "server.log", log_level="info", env={"TMPDIR": str(temp)},
                           new_session=victim == "process group")
    try:
        core, servers = server.core_pid(), server.api_server_pids()
        sockets = re.search(r"their metrics sockets: (\S+)/<index>\.sock", server.log_path.read_text()).group(1)
        if sys.platform.startswith("linux"):   # abstract sockets: nothing on disk, gone with their processes
            assert sockets.startswith("@tripath-api-servers-") and not list(temp.glob("tripath-*"))
            assert {f"{sockets}/0.sock", f"{sockets}/1.sock"} <= _abstract_names()
        if victim == "process group":   # SIGKILL to every process at once: none of them cleans up
            server.signal_group(signal.SIGKILL)
            server.proc.wait()
        elif victim == "supervisor":
            server.proc.kill()
            server.proc.wait()
        else:
            os.kill(servers[1] if victim == "api server" else core, signal.SIGKILL)
            assert server.proc.wait(60) == 1, server.log()
            expected = ("API server 1 was killed by SIGKILL" if victim == "api server"
                        else "the engine core process was killed by SIGKILL")
            assert expected in server.log(), server.log()
        _wait_gone([core, *servers])
        assert not list(temp.glob("tripath-*"))   # the metrics sockets (or their folder) went with them
        if sys.platform.startswith("linux"):   # the kernel frees a dead process's sockets soon after its exit
            deadline = time.monotonic() + 10
            while {n for n in _abstract_names() if n.startswith(sockets)} and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not {n for n in _abstract_names() if n.startswith(sockets)}
    finally:
        server.close()
        shutil.rmtree(temp, ignore_errors=True)


def test_the_sockets_folder_leaves_a_temp_folder_too_long_for_a_socket(tmp_path, monkeypatch):
    from tripath.server.processes.api_servers import UNIX_PATH_MAX, socket_folder

    deep = tmp_path / ("x" * 100)
    deep.mkdir()
    short = Path(tempfile.mkdtemp(prefix="tp-", dir="/tmp"))
    try:
        for base, expected in ((deep, "/tmp"), (short, str(short))):
            monkeypatch.setattr(tempfile, "tempdir", str(base))
            folder = socket_folder(abstract=False)   # the fallback where there are no abstract sockets
            assert os.path.dirname(folder) == expected
            assert len(os.path.join(folder, "1000.sock")) <= UNIX_PATH_MAX
            os.rmdir(folder)
    finally:
        shutil.rmtree(short, ignore_errors=True)


def test_several_api_servers_need_the_engine_in_its_own_process(tmp_path):
    from tripath.cli.serve import main_serve

    assert main_serve([PRESET, "--port", "0", "--api-server-count", "2", "--engine-in-process"]) == 2
    assert main_serve([PRESET, "--port", "0", "--api-server-count", "0"]) == 2
