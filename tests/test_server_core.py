"""The engine core in its own process (the default of ``tripath serve``): what crosses the pipes, the stream
framing, coalescing for a lagging client, and the process split's failure semantics end to end on the tiny
preset — a killed core fails the streams in flight, makes ``/health`` 503 and the server exit 1; Ctrl-C to
the whole process group drains the streams, then stops both processes; a killed server takes its core with
it."""

import asyncio
import functools
import json
import os
import pickle
import signal
import time

import httpx
import pytest
import torch

from tripath.engine.core.engine_core import StepResult
from tripath.engine.requests.request import CompletionOutput, FinishReason, Logprob, RequestOutput
from tripath.engine.requests.sampling_params import SamplingParams
from tripath.engine.scheduling.stats import EngineStats
from tripath.server.transport.core_messages import Abort, Add
from tripath.server.transport.core_wire import StepOutput, decode_output, decode_stats, encode_output, encode_stats

pytest.importorskip("fastapi")

from fault_engines import faulty_llm  # noqa: E402
from server_process import ServerProcess, running  # noqa: E402
from tripath.server.http import protocol as P  # noqa: E402
from tripath.server.http import sse  # noqa: E402
from tripath.server.http.generation import Generation  # noqa: E402
from tripath.server.transport.submissions import ACCEPTED  # noqa: E402

SERVE = ["--model", "tiny-llama", "--backend", "torch", "--num-kv-blocks", "160", "--max-model-len", "2048"]


def test_a_step_output_crosses_the_wire_whole():
    logprobs = [{5: Logprob(-0.5, 1), 9: Logprob(-1.25, 2)}, {7: Logprob(-3.0, 4), 5: Logprob(-0.125, 1)}]
    prompt_logprobs = [None, {3: Logprob(-2.0, 3)}]
    out = RequestOutput("srv-1-0", None, [1, 3], [CompletionOutput(0, None, [5, 7], None, None, FinishReason.LENGTH)],
                        True, [5, 7], logprobs, prompt_logprobs)
    got = decode_output(pickle.loads(pickle.dumps(encode_output(out, True))))
    assert (got.request_id, got.new_token_ids, got.finished, got.finish_reason) == ("srv-1-0", [5, 7], True,
                                                                                    FinishReason.LENGTH)
    assert got.new_logprobs == logprobs and got.prompt_logprobs == prompt_logprobs
    assert decode_output(encode_output(out, False)).prompt_logprobs is None   # sent once, with the first output
    unfinished = RequestOutput("r", None, [1], [CompletionOutput(0, None, [4], None)], False, [4])
    assert decode_output(encode_output(unfinished, False)).finish_reason is None
    stats = EngineStats(3, 1, 10, 63, 400, 128, 2, 99)
    assert decode_stats(pickle.loads(pickle.dumps(encode_stats(stats)))) == stats


def test_stream_events_are_the_api_chunks():
    framer = sse.ChunkFramer("cmpl-1", "tiny", chat=False)
    text = framer.chunk([sse.completion_choice(0, "naïve", [1, 2], "length")], {"prompt_tokens": 3,
                                                                            "completion_tokens": 2, "total_tokens": 5})
    assert text.startswith("data: {") and text.endswith("}\n\n")
    got = json.loads(text[6:])
    want = P.CompletionResponse(id="cmpl-1", model="tiny", created=got["created"], usage=P.Usage(
        prompt_tokens=3, completion_tokens=2, total_tokens=5), choices=[P.CompletionChoice(
            index=0, text="naïve", token_ids=[1, 2], finish_reason="length")]).model_dump()
    del want["choices"][0]["prompt_logprobs"]   # a whole response's field (vLLM's), not a chunk's
    assert got == want and list(got) == list(want) and list(got["choices"][0]) == list(want["choices"][0])
    chat = sse.ChunkFramer("chatcmpl-1", "tiny", chat=True)
    for choice, model_choice in ((sse.chat_choice(1, "", [], None, role="assistant"),
                                  P.ChatChunkChoice(index=1, delta=P.DeltaMessage(role="assistant", content=""))),
                                 (sse.chat_choice(0, "hi", [7], "stop"),
                                  P.ChatChunkChoice(index=0, delta=P.DeltaMessage(content="hi"), token_ids=[7],
                                                    finish_reason="stop"))):
        got = json.loads(chat.chunk([choice])[6:])
        want = P.ChatCompletionChunk(id="chatcmpl-1", model="tiny", created=got["created"],
                                     choices=[model_choice]).model_dump()
        assert got == want and list(got) == list(want)


class _EchoEngine:
    """Accepts every submission; the test plays the engine's outputs itself."""

    tokenizer = None
    request_id_prefix = "srv"

    def submit(self, subs):
        for sub in subs:
            sub.events.put_nowait((sub.index, ACCEPTED))

    def abort(self, request_id, outcome="abort"):
        pass


def test_a_lagging_stream_gets_one_event_for_what_it_missed():
    async def run():
        gen = Generation(_EchoEngine(), [[1, 2], [1, 2]], [SamplingParams(max_tokens=3)] * 2, [], None)
        await gen.start()
        for k, token in enumerate([5, 6, 7]):   # three steps arrive before the stream is read
            for choice in gen.choices:
                reason = FinishReason.LENGTH if k == 2 else None
                gen.events.put_nowait((choice.sub.index, StepOutput(choice.sub.request_id, [token + choice.sub.index],
                                                                    k == 2, reason)))
        return [d async for d in gen.deltas()]

    deltas = asyncio.run(run())
    assert [(d.index, d.token_ids, d.finish_reason) for d in deltas] == [(0, [5, 6, 7], "length"),
                                                                        (1, [6, 7, 8], "length")]



def test_a_killed_core_fails_its_streams_and_health_answers_503(monkeypatch):
    """In process through ASGI, the core spawned: SIGKILL it mid-stream."""
    from served_app import ServedApp
    from tripath.server.http.app import build_app

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    fatal = []
    served = ServedApp(build_app(functools.partial(faulty_llm, 0.01, 64), model_name="tiny", on_fatal=fatal.append))
    engine = served.engine
    try:
        pid = engine.core_pid

        async def scenario():   # ASGITransport answers once the response is whole: kill from beside it
            body = {"model": "tiny", "prompt": [4, 5], "max_tokens": 1000, "ignore_eos": True, "stream": True}
            response = asyncio.ensure_future(served.request(body=body))
            while engine.metrics.generation_tokens._value.get() == 0:
                await asyncio.sleep(0.01)
            os.kill(pid, signal.SIGKILL)
            return await response

        events = [line for line in served.run(scenario()).text.splitlines() if line.startswith("data:")]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == 500 and "killed by SIGKILL" in error["message"], error
        health = served.get("/health")
        assert health.status_code == 503 and "killed by SIGKILL" in health.json()["error"], health.text
        late = served.post({"model": "tiny", "prompt": [4, 5], "max_tokens": 2})
        assert late.status_code == 503
        assert len(fatal) == 1 and not engine.alive
    finally:
        served.close(10)
    assert not running(pid)


def _stream_first_event(url: str, max_tokens: int):
    client = httpx.Client(base_url=url, timeout=60)
    body = {"model": "tiny-llama", "prompt": [9, 9], "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    cm = client.stream("POST", "/v1/completions", json=body)
    lines = cm.__enter__().iter_lines()
    first = next(line for line in lines if line.startswith("data:"))
    return client, cm, lines, first


def test_the_server_exits_1_when_its_core_is_killed(tmp_path):
    server = ServerProcess(SERVE, tmp_path / "server.log", log_level="info")
    try:
        # tripath[serve] (and [test]) install uvloop and httptools: the server runs on them and says so
        assert "(uvloop event loop, httptools HTTP parser)" in server.log(), server.log()
        client, cm, lines, _ = _stream_first_event(server.url, 2000)
        os.kill(server.core_pid(), signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data:")]
        cm.__exit__(None, None, None)
        client.close()
        assert rest[-1] == "data: [DONE]" and "killed by SIGKILL" in rest[-2]
        assert server.proc.wait(30) == 1, server.log()
        assert "the engine stopped serving: the engine core process was killed by SIGKILL" in server.log()
    finally:
        server.close()


def test_ctrl_c_to_the_process_group_drains_then_stops_both_processes(tmp_path):
    """SIGINT reaches the server and its core alike (a terminal's Ctrl-C): the core ignores it, the server
    lets the stream finish, then stops the core."""
    server = ServerProcess(SERVE, tmp_path / "server.log", log_level="info", new_session=True)
    try:
        core = server.core_pid()
        client, cm, lines, first = _stream_first_event(server.url, 300)
        server.signal_group(signal.SIGINT)
        events = [first] + [line for line in lines if line.startswith("data:")]
        cm.__exit__(None, None, None)
        client.close()
        tokens = sum(len(json.loads(e[6:])["choices"][0]["token_ids"]) for e in events[:-1])
        assert tokens == 300 and events[-1] == "data: [DONE]", events[-2:]
        assert server.proc.wait(30) == 0, server.log()
        log = server.log()
        assert "engine core stopped" in log and "engine stopped" in log and "Traceback" not in log
        deadline = time.monotonic() + 30   # generous: only a core that never stops waits this long
        while running(core) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(core)
    finally:
        server.close()


MODES = {"one API server": [], "engine in process": ["--engine-in-process"],
         "two API servers": ["--api-server-count", "2"]}


@pytest.mark.parametrize("stop", ["SIGTERM to the server", "SIGINT to the process group"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_drained_stop_exits_0_whichever_the_signal_in_every_mode(tmp_path, mode, stop):
    """docs/SERVING.md: a service manager's SIGTERM and a terminal's Ctrl-C (SIGINT to the whole group) both
    drain and exit 0 (a SIGTERM used to end one API server with -15 after a clean drain)."""
    server = ServerProcess(SERVE + MODES[mode], tmp_path / "server.log", new_session=True)
    try:
        if stop == "SIGTERM to the server":
            server.signal(signal.SIGTERM)
        else:
            server.signal_group(signal.SIGINT)
        assert server.proc.wait(60) == 0, server.log()
        assert "Traceback" not in server.log_path.read_text()
    finally:
        server.close()


def test_an_api_server_stopping_drains_whatever_stop_signal_comes_next(tmp_path):
    """A terminal's Ctrl-C reaches an API server of --api-server-count twice, as the group's SIGINT and as the
    supervisor's SIGTERM, in either order; uvicorn took a SIGINT after a first stop signal as "quit now" (no
    drain, the app's shutdown skipped: its streams cut, a traceback). Here in that order: the supervisor's
    SIGTERM, then, once both API servers are shutting down, a SIGINT to each: the streams still end whole."""
    server = ServerProcess(SERVE + ["--api-server-count", "2"], tmp_path / "server.log", log_level="info")
    streams = []
    try:
        pids = server.api_server_pids()
        streams = [_stream_first_event(server.url, 2000) for _ in range(2)]
        server.signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while server.log().count("Shutting down") < len(pids):   # uvicorn's line: each one is draining
            assert time.monotonic() < deadline and server.proc.poll() is None, server.log()
            time.sleep(0.05)
        for pid in pids:
            os.kill(pid, signal.SIGINT)
        for _, _, lines, first in streams:
            events = [first] + [line for line in lines if line.startswith("data:")]
            tokens = sum(len(json.loads(e[6:])["choices"][0]["token_ids"]) for e in events[:-1])
            assert tokens == 2000 and events[-1] == "data: [DONE]", events[-2:]
        assert server.proc.wait(60) == 0, server.log()
        assert "Traceback" not in server.log()
    finally:
        for client, cm, _, _ in streams:
            cm.__exit__(None, None, None)
            client.close()
        server.close()


@pytest.mark.parametrize("supervised", [True, False], ids=["API server", "one server"])
def test_stop_signals_of_a_supervised_api_server_never_force_its_exit(supervised):
    """The server class alone: after a SIGTERM, a SIGINT leaves an API server draining (uvicorn's force-quit
    stays for a server of its own, where a second Ctrl-C is a person's)."""
    import uvicorn

    from tripath.cli.serve import _server_class

    server = _server_class(uvicorn)(uvicorn.Config(lambda scope, receive, send: None), None, 1.0,
                                    follows_supervisor=supervised)
    server.handle_exit(signal.SIGTERM, None)
    server.handle_exit(signal.SIGINT, None)
    assert server.should_exit and server.force_exit is not supervised


def test_a_killed_server_takes_its_core_with_it(tmp_path):
    server = ServerProcess(SERVE, tmp_path / "server.log", log_level="info")
    try:
        core = server.core_pid()
        server.proc.kill()   # SIGKILL: no shutdown of any kind; the core sees its command pipe close
        server.proc.wait()
        deadline = time.monotonic() + 20
        while running(core):
            assert time.monotonic() < deadline, "the engine core outlived its server"
            time.sleep(0.1)
    finally:
        server.close()


def test_the_transport_benchmark_runs():
    from tripath.bench.core_transport import main

    assert main(["--outputs", "16", "--tokens", "2", "--messages", "50"]) == 0


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_the_core_decodes_one_step_at_a_time_while_requests_arrive(monkeypatch):
    """Multi-step decoding pauses from an accepted add until ``ARRIVAL_WINDOW_S`` passes without one (a
    refused add does not count); an engine without multi-step is left alone."""
    from tripath.server.transport import core_loop as C

    clock = [100.0]
    monkeypatch.setattr(C.time, "monotonic", lambda: clock[0])

    class StandIn:
        def __init__(self, decode_steps):
            self.decode_steps, self.seen = decode_steps, []

        def add_request(self, prompt, params, request_id=None):
            if not prompt:
                raise ValueError("prompt is empty")

        def step(self, decode_steps=None):
            self.seen.append(self.decode_steps if decode_steps is None else min(decode_steps, self.decode_steps))
            return StepResult()

    llm = StandIn(8)
    core = C.CoreLoop(llm, [(-1, -1)])   # the pipes are not used by _handle / _step
    window = C.ARRIVAL_WINDOW_S
    core._step()
    core._handle(0, Add("r1", [1, 2], SamplingParams(max_tokens=4)))
    core._step()
    clock[0] += window / 2
    core._step()
    clock[0] += window / 2 + 1e-4
    core._step()
    core._handle(0, Add("r2", [], SamplingParams(max_tokens=4)))   # refused: not an arrival
    core._step()
    assert llm.seen == [8, 1, 1, 8, 8] and core._frontends[0].refused and core._frontends[0].accepted == ["r1"]
    single = StandIn(1)
    core = C.CoreLoop(single, [(-1, -1)])
    core._handle(0, Add("r3", [1], SamplingParams(max_tokens=4)))
    core._step()
    assert single.seen == [1]


def test_commands_a_full_pipe_cannot_take_wait_and_arrive_whole_and_in_order():
    """The HTTP process never blocks on the command pipe: a message bigger than the pipe's buffer is written
    as the reader drains it, later messages after it; the reader gets every frame whole, in order."""
    import threading

    from tripath.server.metrics.metrics import ServerMetrics
    from tripath.server.transport.core_wire import FrameReader, Outbox
    from tripath.server.transport.engine_client import EngineClient

    read_end, write_end = os.pipe()

    class Conn:   # the commands end as EngineClient holds it
        def fileno(self):
            return write_end

    async def scenario():
        client = EngineClient(functools.partial(faulty_llm, 0.0), ServerMetrics("t"))
        client._loop, client._loop_thread = asyncio.get_running_loop(), threading.get_ident()
        client._commands, client._outbox = Conn(), Outbox(write_end)
        os.set_blocking(write_end, False)
        big = [Add(f"r{i}", list(range(2000)), None) for i in range(40)]   # a few hundred KiB pickled
        for command in big:
            client._command(command)
        await asyncio.sleep(0)   # the loop pass ends: one message, most of it buffered
        assert len(client._outbox), "the pipe took the whole message: make it bigger"
        client._command(Abort("r0"))
        await asyncio.sleep(0)
        frames, messages = FrameReader(), []
        os.set_blocking(read_end, False)
        deadline = time.monotonic() + 10
        while len(messages) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
            try:
                messages += frames.feed(os.read(read_end, 1 << 16))
            except BlockingIOError:
                pass
        return messages, len(client._outbox) > 0

    try:
        messages, left = asyncio.run(scenario())
    finally:
        os.close(read_end)
        os.close(write_end)
    assert messages == [[Add(f"r{i}", list(range(2000)), None) for i in range(40)], [Abort("r0")]]
    assert not left
