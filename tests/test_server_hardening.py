"""``tripath serve`` against a hostile review's findings (a real process on loopback, CPU, torch backend): a
multi-megabyte /tokenize is answered while /health answers; every body-reading route is bounded by
--max-request-bytes and takes JSON only (415 for the text/plain "simple request" a web page can make a browser
send); the key from VLLM_API_KEY guards /tokenize and /detokenize; --disable-fastapi-docs removes the docs;
sampling values that break float32, logit_bias keys int() cannot read, schemas nested past the limit or sent
as deep JSON text, and constraints over --max-structured-output-bytes are 400s naming the parameter, never a
bare 500."""

import asyncio
import json
import os
import signal

import httpx
import pytest

from server_process import HealthWatch, ServerProcess

pytest.importorskip("fastapi")
pytest.importorskip("transformers")

KEY = "sk-from-vllm-env"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BYTES = 4 << 20
MAX_CONSTRAINT = 32 << 10   # room for a schema nested past Python's recursion limit as text (22 KB)


@pytest.fixture(scope="module")
def server(tiny_hf_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    proc = ServerProcess(["--model", tiny_hf_dir, "--served-model-name", "tiny-hf", "--backend", "torch",
                          "--num-kv-blocks", "64", "--max-model-len", "256", "--max-request-bytes", str(MAX_BYTES),
                          "--max-structured-output-bytes", str(MAX_CONSTRAINT), "--disable-fastapi-docs"], log,
                         env={"VLLM_API_KEY": KEY, "TRIPATH_API_KEY": ""}, log_level="info")
    yield proc
    proc.close()


def _post(server, path, **kwargs):
    return httpx.post(server.url + path, headers={**AUTH, **kwargs.pop("headers", {})}, timeout=120, **kwargs)


def test_a_large_tokenize_is_answered_whole_with_health_answering_and_the_body_limit_holds(server):
    """A 3 MiB /tokenize (1.4 million tokens, in the tokenizer helper process) is answered whole while
    ``/health`` answers; the helper killed, the next large /tokenize starts another and is answered; a body
    over --max-request-bytes is a 413 on every body-reading route. (Victims' streams during a /tokenize:
    tests/test_server_stalls.py, at 16 MiB.)"""
    text = ("The quick brown fox jumps over the lazy dog. " * 70_000)[:3 << 20]   # 3 MiB: 1.4 million tokens
    watch = HealthWatch(server.url, interval_s=0.02)
    try:
        r = _post(server, "/tokenize", json={"prompt": text})
    finally:
        watch.stop()
    assert r.status_code == 200, r.text[:500]
    reply = r.json()
    assert reply["count"] == len(reply["tokens"]) > 1_000_000 and reply["tokens"][:4] == _post(
        server, "/tokenize", json={"prompt": text[:100]}).json()["tokens"][:4]
    assert watch.polls > 1 and watch.slowest < 1.0 and not watch.failures
    killed = server.tokenizer_helper_pid()
    os.kill(killed, signal.SIGKILL)
    again = _post(server, "/tokenize", json={"prompt": text[:300_000]})
    assert again.status_code == 200
    prefix = again.json()["tokens"][:-1]   # the cut may end inside a word
    assert len(prefix) > 100_000 and prefix == reply["tokens"][:len(prefix)]
    assert server.tokenizer_helper_pid() != killed
    too_long = [{"role": "user", "content": "a" * MAX_BYTES}]
    for path, body in (("/tokenize", {"prompt": "a" * MAX_BYTES}), ("/detokenize", {"tokens": [5] * (MAX_BYTES // 2)}),
                       ("/v1/chat/completions", {"model": "tiny-hf", "messages": too_long})):
        r = _post(server, path, json=body)
        assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"], path


def test_the_vllm_key_guards_tokenize_and_the_docs_are_gone(server):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]}), ("/v1/models", None),
                       ("/docs", None), ("/openapi.json", None)):
        r = httpx.request("GET" if body is None else "POST", server.url + path, json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    assert _post(server, "/tokenize", json={"prompt": "hi"}).status_code == 200
    assert _post(server, "/detokenize", json={"tokens": [5, 6]}).status_code == 200
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        assert httpx.get(server.url + path, headers=AUTH).status_code == 404, path
    assert httpx.get(server.url + "/health").status_code == 200 and httpx.get(server.url + "/metrics").status_code == 200


def test_only_json_bodies_are_taken(server):
    body = json.dumps({"model": "tiny-hf", "prompt": [5, 6], "max_tokens": 1})
    routes = (("/v1/completions", body), ("/v1/chat/completions", json.dumps({"model": "tiny-hf", "messages": [
        {"role": "user", "content": "hi"}]})), ("/tokenize", '{"prompt": "hi"}'), ("/detokenize", '{"tokens": [5]}'))
    for path, content in routes:
        for content_type in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                             "multipart/form-data; boundary=x", None, "application/json; charset=latin-1",
                             "application/jsonx"):
            headers = {"Origin": "https://elsewhere.example"} | ({} if content_type is None else
                                                                {"Content-Type": content_type})
            r = _post(server, path, content=content.encode(), headers=headers)
            assert r.status_code == 415, (path, content_type, r.text)
            error = r.json()["error"]
            assert error["code"] == "unsupported_media_type" and "application/json" in error["message"], error
        for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON;charset=UTF8"):
            r = _post(server, path, content=content.encode(), headers={"Content-Type": content_type})
            assert r.status_code == 200, (path, content_type, r.text)


def _deep_schema(levels: int) -> str:
    """A JSON schema nested ``levels`` objects deep (two JSON levels each), as text."""
    return '{"type":"object","properties":{"a":' * levels + '{"type":"string"}' + "}}" * levels


BASE = {"model": "tiny-hf", "prompt": "hi", "max_tokens": 2}
BAD = [
    # (request fields, expected param, a word of the message)
    ({"logit_bias": {"²": 1}}, "logit_bias", "plain decimal"),
    ({"logit_bias": {"07": 1}}, "logit_bias", "'07'"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "'-1'"),
    ({"logit_bias": {"٣": 1}}, "logit_bias", "plain decimal"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty", "[1e-30, 1e+30]"),
    ({"repetition_penalty": 1e-40}, "repetition_penalty", "repetition_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty"),
    ({"temperature": 1e300}, "temperature", "temperature"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"min_p": 1.5}, "min_p", "min_p"),
    ({"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty"),
    ({"guided_json": _deep_schema(70)}, "guided_json", "nested deeper than 128 levels"),
    ({"guided_json": _deep_schema(600)}, "guided_json", "nested deeper than 128 levels"),   # past Python's recursion
    ({"structured_outputs": {"json": _deep_schema(70)}}, "structured_outputs.json", "nested deeper"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a" * (MAX_CONSTRAINT + 1)}, "guided_regex", "--max-structured-output-bytes"),
    ({"guided_choice": ["x" * (MAX_CONSTRAINT // 2)] * 3}, "guided_choice", f"at most {MAX_CONSTRAINT} bytes"),
    ({"guided_grammar": 'root ::= "' + "a" * MAX_CONSTRAINT + '"'}, "guided_grammar", "--max-structured-output"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_CONSTRAINT // 20)}}}}},
     "response_format.json_schema.schema", "--max-structured-output-bytes"),
]


def test_bad_values_are_400s_naming_the_parameter(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as h:
        for fields, param, word in BAD:
            r = h.post("/v1/completions", json={**BASE, **fields})
            assert r.status_code == 400, (fields, r.status_code, r.text[:300])
            error = r.json()["error"]
            assert error["param"] == param and word in error["message"], (fields, error)
            assert error["type"] == "invalid_request_error"
        for literal in ("NaN", "Infinity", "-Infinity"):   # JSON extensions pydantic reads as floats
            r = h.post("/v1/completions", content=f'{{"model": "tiny-hf", "prompt": "hi", "presence_penalty": '
                                                  f'{literal}}}', headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "presence_penalty", r.text
        deep = b'{"model": "tiny-hf", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        r = h.post("/v1/completions", content=deep, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "recursion limit" in r.json()["error"]["message"], r.text[:300]
        # within the limits a constraint works: a schema near the nesting limit, choices at the size limit
        ok = h.post("/v1/completions", json={**BASE, "max_tokens": 3, "guided_json": _deep_schema(60)})
        assert ok.status_code == 200, ok.text
        choices = ["ab" * (MAX_CONSTRAINT // 4), "cd" * (MAX_CONSTRAINT // 4)]
        ok = h.post("/v1/completions", json={**BASE, "max_tokens": 3, "guided_choice": choices})
        assert ok.status_code == 200 and any(c.startswith(ok.json()["choices"][0]["text"]) for c in choices), ok.text
    assert "Traceback" not in server.log()


def test_a_reply_of_many_tokens_is_whole(server):
    """More than LARGE_REPLY_TOKENS tokens: the reply is built and encoded in a worker thread."""
    from tripath.server.http.responses import LARGE_REPLY_TOKENS

    n, tokens = 17, 250
    assert n * tokens > LARGE_REPLY_TOKENS
    r = _post(server, "/v1/completions", json={"model": "tiny-hf", "prompt": [5, 6], "n": n, "max_tokens": tokens,
                                               "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    reply = r.json()
    assert reply["usage"]["completion_tokens"] == n * tokens and len(reply["choices"]) == n
    assert all(len(c["token_ids"]) == tokens and c["text"] for c in reply["choices"])


def test_large_texts_are_tokenised_one_at_a_time():
    from tripath.server.http.large_texts import LargeTextGate

    async def run():
        gate, inside, most = LargeTextGate(large_chars=100), 0, 0

        async def tokenise(chars):
            nonlocal inside, most
            async with gate.admit(chars):
                inside += 1
                most = max(most, inside)
                await asyncio.sleep(0.01)
                inside -= 1

        await asyncio.gather(*(tokenise(1000) for _ in range(4)))
        large = most
        most = 0
        await asyncio.gather(*(tokenise(10) for _ in range(4)), tokenise(1000))
        return large, most

    large, small = asyncio.run(run())
    assert large == 1 and small == 5


def test_the_bodies_in_flight_are_bounded_together():
    """In process, the middleware alone: bodies held by requests still being served count together."""
    from starlette.exceptions import HTTPException

    from tripath.server.http.request_body import BodyLimit

    async def run():
        release = asyncio.Event()

        async def app(scope, receive, send):
            while (await receive()).get("more_body"):
                pass
            await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        limit = BodyLimit(app, max_bytes=10, max_total_bytes=25)

        async def request(*chunks: bytes, length: bool = True):
            headers = [(b"content-length", str(sum(map(len, chunks))).encode())] if length else []
            messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                        for i, c in enumerate(chunks)]
            sent = []

            async def receive():
                return messages.pop(0)

            async def send(message):
                sent.append(message)

            await limit({"type": "http", "headers": headers}, receive, send)
            return sent[0]["status"], json.loads(sent[1]["body"]) if sent[0]["status"] != 200 else None

        held = [asyncio.ensure_future(request(b"a" * 10)) for _ in range(2)]
        while limit.in_flight < 20:
            await asyncio.sleep(0)
        status, body = await request(b"b" * 10)   # by its Content-Length: at once
        assert status == 503 and body["error"]["code"] == "overloaded" and "--max-request-bytes" in \
            body["error"]["message"]
        with pytest.raises(HTTPException) as error:   # chunked: when the chunk that passes the limit arrives
            await request(b"c" * 5, b"c" * 5, length=False)
        assert error.value.status_code == 503
        assert limit.in_flight == 20
        release.set()
        assert [s for s, _ in await asyncio.gather(*held)] == [200, 200] and limit.in_flight == 0
        assert (await request(b"d" * 10))[0] == 200

    asyncio.run(run())
