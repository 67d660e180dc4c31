"""``tripath serve`` under hostile clients (a real process on loopback, CPU, torch backend): a mix of bad,
oversized and adversarial requests runs while well-formed streams are in flight; every stream still gets its
exact tokens and ``/health`` answers within a second throughout. Also: OpenAI's usage count and chunk shapes,
vLLM's schema policy, the queue-depth count, and 503s (not cut streams) for requests still running at the
shutdown timeout."""

import asyncio
import json
import re
import signal
import threading
import time

import httpx
import pytest

from server_process import HealthWatch, ServerProcess

pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from tripath.engine import LLM, SamplingParams  # noqa: E402
from tripath.server.http import protocol as P  # noqa: E402

ENGINE_ARGS = ["--backend", "torch"]
MAX_BYTES = 1_000_000


pytestmark = pytest.mark.usefixtures("pure_torch_one_thread")


@pytest.fixture(scope="module")
def server(tiny_hf_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    proc = ServerProcess(["--model", tiny_hf_dir, "--served-model-name", "tiny-hf", *ENGINE_ARGS, "--num-kv-blocks",
                          "64", "--max-model-len", "256", "--max-num-seqs", "8", "--max-queue-depth", "24",
                          "--max-request-bytes", str(MAX_BYTES)], log)
    yield proc
    proc.close()


def _stream_ids(url, body, started: threading.Event | None = None):
    """The token ids and finish reason of a streamed completion; ``started`` is set at its first event."""
    ids, finish = [], None
    with httpx.Client(timeout=120) as h, h.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if started is not None and line.startswith("data: "):
                started.set()
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    ids += choice["token_ids"]
                    finish = choice["finish_reason"] or finish
    return ids, finish


def _hostile(model):
    """(description, request kwargs for httpx, expected status, a word the error message holds)."""
    base = {"model": model, "prompt": "hello", "max_tokens": 4}
    long_stops = ["q" * 500 + str(i) for i in range(P.MAX_STOP_STRINGS)]
    return [
        ("top_k 2**63", dict(json={**base, "top_k": 1 << 63}), 400, "top_k"),
        ("seed 2**64", dict(json={**base, "seed": 1 << 64}), 400, "seed"),
        ("seed + n past int64", dict(json={**base, "seed": (1 << 63) - 1, "n": 2}), 400, "seed"),
        ("a million stop strings", dict(json={**base, "stop": ["zq"] * 1_000_000}), 413, "max-request-bytes"),
        ("too many stop strings", dict(json={**base, "stop": ["zq"] * (P.MAX_STOP_STRINGS + 1)}), 400, "stop"),
        ("the most and longest stop strings", dict(json={**base, "max_tokens": 30, "stop": long_stops}), 200, ""),
        ("a body over the limit", dict(json={**base, "user": "a" * MAX_BYTES}), 413, "max-request-bytes"),
        ("a chunked body over the limit", dict(content=iter([b'{"model": "x", "user": "' + b"a" * 400_000] * 3),
                                               headers={"content-type": "application/json"}), 413, "bytes"),
        ("a long user", dict(json={**base, "user": "u" * (P.MAX_NAME_CHARS + 1)}), 400, "user"),
        ("a lone surrogate", dict(content=b'{"model": "%s", "prompt": "ab\\ud800"}' % model.encode(),
                                  headers={"content-type": "application/json"}), 400, "JSON"),
        ("max_tokens as a string", dict(json={**base, "max_tokens": "3"}), 400, "max_tokens"),
        ("max_tokens as a bool", dict(json={**base, "max_tokens": True}), 400, "max_tokens"),
        ("stream as a string", dict(json={**base, "stream": "yes"}), 400, "stream"),
        ("a prompt of bools", dict(json={**base, "prompt": [True, False]}), 400, "prompt"),
        ("a temperature past the sampler's", dict(json={**base, "temperature": 1e300}), 400, "temperature"),
        ("more choices than the server holds", dict(json={**base, "prompt": [[5, 6]] * 64, "n": 64}), 400,
         "at most 32"),
        ("a text prompt of 900 kB (tokenised off the loop)", dict(json={**base, "prompt": "The quick fox. " * 60_000}),
         400, "max_model_len"),
        ("an unknown field", dict(json={**base, "bogus_field": {"deep": [1, 2]}}), 200, ""),
    ]


def test_hostile_requests_beside_streams_in_flight(server, tiny_hf_dir):
    prompts = [[5 + i, 9, 14, 3 + i] for i in range(3)]
    bodies = [{"model": "tiny-hf", "prompt": p, "max_tokens": 120, "temperature": 0, "stream": True,
               "ignore_eos": True} for p in prompts]
    results = [None] * len(bodies)
    started = [threading.Event() for _ in bodies]

    def stream(i):
        try:
            results[i] = _stream_ids(server.url, bodies[i], started[i])
        finally:
            started[i].set()   # a failed stream does not hold the test up; its result fails it

    watch = HealthWatch(server.url)
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(bodies))]
    try:
        for t in threads:
            t.start()
        assert all(event.wait(120) for event in started)   # the streams are in flight
        with httpx.Client(base_url=server.url, timeout=60) as h:
            for what, kwargs, status, word in _hostile("tiny-hf"):
                r = h.post("/v1/completions", **kwargs)
                assert r.status_code == status, (what, r.status_code, r.text[:500])
                if status != 200:
                    error = r.json()["error"]
                    assert word in error["message"] and error["type"] == "invalid_request_error", (what, error)
        for t in threads:
            t.join(120)
    finally:
        watch.stop()
    # /health never failed, and was never held for the seconds a body parsed or tokenised on the event loop
    # would hold it (the bound is generous: the test shares a machine with others)
    assert watch.slowest < 5.0 and not watch.failures, (watch.slowest, watch.failures)
    llm = LLM(tiny_hf_dir, num_kv_blocks=64, max_model_len=256, backend="torch")
    want = llm.generate(prompts, SamplingParams(max_tokens=120, temperature=0, ignore_eos=True), use_tqdm=False)
    for (ids, finish), w in zip(results, want):
        assert ids == w.output_token_ids and finish == "length"


def _events(url, path, body):
    with httpx.Client(timeout=60) as h, h.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200, r.read()
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_usage_chunk_shapes_and_schema_policy(server):
    with httpx.Client(base_url=server.url, timeout=60) as h:
        r = h.post("/v1/completions", json={"model": "tiny-hf", "prompt": [5, 6], "n": 3, "max_tokens": 2,
                                            "ignore_eos": True})
        assert r.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}
        r = h.post("/v1/completions", json={"model": "tiny-hf", "prompt": [[5, 6], [7, 8, 9]], "n": 2,
                                            "max_tokens": 1, "ignore_eos": True})
        assert r.json()["usage"]["prompt_tokens"] == 5
        chat = {"model": "tiny-hf", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5,
                "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        events = _events(server.url, "/v1/chat/completions", chat)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        first = chunks[0]["choices"][0]
        assert first["delta"] == {"role": "assistant", "content": ""} and "finish_reason" in first
        assert first["finish_reason"] is None
        completions = [c["usage"]["completion_tokens"] for c in chunks]
        assert all(c["usage"]["prompt_tokens"] == chunks[0]["usage"]["prompt_tokens"] > 0 for c in chunks)
        assert completions == sorted(completions) and completions[-1] == 5
        assert chunks[-1]["choices"] == []   # include_usage's final chunk
        # vLLM's fields: chat_template_kwargs reach the template, tools are accepted (tool_choice "auto" needs
        # --enable-auto-tool-choice, a named function one of the tools)
        base = {"model": "tiny-hf", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        tools = [{"type": "function", "function": {"name": "f"}}]
        r = h.post("/v1/chat/completions", json={**base, "chat_template_kwargs": {"enable_thinking": False},
                                                 "tools": tools, "tool_choice": "none", "unknown_extra": 1})
        assert r.status_code == 200, r.text
        for extra in ({"tools": tools, "tool_choice": "auto"}, {"tool_choice": "auto"},
                      {"tool_choice": {"type": "function", "function": {"name": "f"}}}):
            r = h.post("/v1/chat/completions", json={**base, **extra})
            assert r.status_code == 400 and "tool_choice" in r.json()["error"]["message"], r.text
        r = h.post("/v1/chat/completions", json={**base, "chat_template_kwargs": {"tokenize": True}})
        assert r.status_code == 400 and "tokenize" in r.json()["error"]["message"]
    assert server.log().count("'bogus_field'") <= 1


def _wait_for_requests_in_server(url: str, count: int, timeout: float = 60.0, at_most: bool = False) -> None:
    """Until the server's /metrics reports at least (``at_most``: at most) ``count`` requests accepted and not
    finished (bounded)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, timeout=10) as h:
        while time.monotonic() < deadline:
            found = re.search(r"^tripath:num_requests_in_server\{[^}]*\} (\S+)$", h.get("/metrics").text, re.M)
            if found and (float(found.group(1)) <= count if at_most else float(found.group(1)) >= count):
                return
            time.sleep(0.02)
    raise AssertionError(f"the server did not hold {'at most' if at_most else 'at least'} {count} requests "
                         f"within {timeout} s")


def test_queue_depth_counts_beyond_the_running_and_shutdown_answers_503(tmp_path_factory):
    """With the engine on a thread of the server (``--engine-in-process``; the other tests run it in its own
    process)."""
    log = tmp_path_factory.mktemp("log") / "server.log"
    proc = ServerProcess(["--model", "tiny-llama", *ENGINE_ARGS, "--num-kv-blocks", "160", "--max-num-seqs", "2",
                          "--max-queue-depth", "4", "--max-model-len", "2048", "--shutdown-timeout", "1",
                          "--engine-in-process"], log)
    try:
        async def burst():
            async with httpx.AsyncClient(base_url=proc.url, timeout=120) as h:
                body = {"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True}
                return await asyncio.gather(*(h.post("/v1/completions", json=body) for _ in range(14)))

        # max_num_seqs 2 + depth 4: six long streams fill the server (whatever the machine's speed), then a
        # burst is refused whole
        with httpx.Client(base_url=proc.url, timeout=60) as h:
            body = {"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": 1000, "stream": True,
                    "ignore_eos": True}
            held = [h.stream("POST", "/v1/completions", json=body) for _ in range(6)]
            try:
                assert [cm.__enter__().status_code for cm in held] == [200] * 6
                codes = [r.status_code for r in asyncio.run(burst())]
            finally:
                for cm in held:
                    cm.__exit__(None, None, None)   # the client goes: its request is aborted
        assert codes == [503] * 14, codes
        _wait_for_requests_in_server(proc.url, 0, at_most=True)
        with httpx.Client(base_url=proc.url, timeout=60) as h:
            body = {"model": "tiny-llama", "prompt": [5, 6], "max_tokens": 2, "n": 7}
            r = h.post("/v1/completions", json=body)
            assert r.status_code == 400 and "at most 6" in r.json()["error"]["message"]
        # SIGTERM with a long stream and a long plain request running: both end with a 503 at the timeout
        plain = {}

        def post_plain():
            with httpx.Client(base_url=proc.url, timeout=60) as h:
                plain["r"] = h.post("/v1/completions", json={"model": "tiny-llama", "prompt": [4, 4],
                                                             "max_tokens": 2000, "ignore_eos": True})

        worker = threading.Thread(target=post_plain)
        worker.start()
        with httpx.Client(base_url=proc.url, timeout=60) as h:
            body = {"model": "tiny-llama", "prompt": [9, 9], "max_tokens": 2000, "stream": True, "ignore_eos": True}
            with h.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                events = [next(line for line in lines if line.startswith("data:"))]
                _wait_for_requests_in_server(proc.url, 2)  # the plain request too, however late its thread runs
                proc.signal(signal.SIGTERM)
                events += [line for line in lines if line.startswith("data:")]
        worker.join(60)
        assert events[-1] == "data: [DONE]", events[-3:]
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == 503 and "shutting down" in error["message"], error
        assert plain["r"].status_code == 503 and "shutting down" in plain["r"].json()["error"]["message"]
        proc.proc.wait(30)
        assert "Task exception was never retrieved" not in proc.log()
    finally:
        proc.close()


def test_zero_queue_depth_is_refused(capsys):
    from tripath.cli.serve import main_serve

    assert main_serve(["--model", "tiny-llama", "--port", "0", "--max-queue-depth", "0"]) == 2
    assert "--max-queue-depth must be >= 1" in capsys.readouterr().err


def _first_to_complete(text, stops):
    for end in range(1, len(text) + 1):
        for s in stops:
            if s and text[:end].endswith(s):
                return text[:end - len(s)], True
    return text, False


def test_stop_matching_is_linear_and_cuts_at_the_first_stop_to_complete():
    import random

    from tripath.server.http.detokenize import StopMatcher

    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(0, 3))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 24)))
        matcher, out, i = StopMatcher(stops), "", 0
        while i < len(text):
            n = rng.randint(1, 4)
            out += matcher.feed(text[i:i + n])
            i += n
        out += matcher.feed("", final=True)
        assert (out, matcher.stopped) == _first_to_complete(text, stops), (stops, text)
    # the largest stop lists the API takes, against text built to defeat naive matching: the held-back tail
    # never exceeds the longest partial match
    stops = ["a" * (P.MAX_STOP_STRING_CHARS - 1) + chr(0x100 + i) for i in range(P.MAX_STOP_STRINGS)]
    matcher = StopMatcher(stops)
    emitted = "".join(matcher.feed("a" * 7) for _ in range(300))
    assert len(matcher.pending) == P.MAX_STOP_STRING_CHARS - 1 and len(emitted) == 2100 - len(matcher.pending)
    assert matcher.feed("c") == "a" * (P.MAX_STOP_STRING_CHARS - 1) + "c" and not matcher.stopped
    assert matcher.feed("x" + "a" * (P.MAX_STOP_STRING_CHARS - 1) + chr(0x101)) == "x" and matcher.stopped


def test_chat_template_kwargs_reach_the_template():
    from server_models import build_tokenizer

    from tripath.engine.chat import render_chat

    tokenizer = build_tokenizer("{% if shout %}LOUD {% endif %}{% for m in messages %}{{ m['content'] }}"
                                "{% endfor %}{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}")
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(tokenizer, messages) == "hi"
    assert render_chat(tokenizer, messages, template_kwargs={"shout": True,
                                                             "tools": [{"function": {"name": "f"}}]}) == "LOUD hi[f]"
    with pytest.raises(ValueError, match="chat_template_kwargs may not set add_generation_prompt"):
        render_chat(tokenizer, messages, template_kwargs={"add_generation_prompt": False})
