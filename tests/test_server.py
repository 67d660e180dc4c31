"""``tripath serve`` as a real process on loopback, driven by the official ``openai`` client (CPU, torch backend):
completions and chat, streamed and not, against ``LLM.generate`` / ``LLM.chat`` on the same model; stop
strings and stop tokens; usage; 400s beside a running request; 200 concurrent streams on a small KV cache
(preemption); disconnects; overload (503); graceful shutdown."""

import asyncio
import json
import random
import threading
import time

import httpx
import pytest
import torch

from server_process import ServerProcess

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from tripath.engine import LLM, SamplingParams  # noqa: E402

PRESET = "tiny-llama"
# On a GPU the same suite runs the servers and their references on a Triton backend (eager, so the steps'
# rounding does not depend on the batch's CUDA graph size); on the CPU on the torch backend.
if torch.cuda.is_available():
    ENGINE_ARGS = ["--backend", "three_path", "--device", "cuda", "--dtype", "float16", "--enforce-eager"]
    ENGINE = dict(backend="three_path", device="cuda", dtype="float16", enforce_eager=True)
else:
    ENGINE_ARGS = ["--backend", "torch"]
    ENGINE = dict(backend="torch")


pytestmark = pytest.mark.usefixtures("pure_torch_one_thread")


def _serve(args, tmp_path_factory, log_level="warning"):
    log = tmp_path_factory.mktemp("log") / "server.log"
    return ServerProcess(args, log, log_level=log_level)


@pytest.fixture(scope="module")
def hf_server(tiny_hf_dir, tmp_path_factory):
    server = _serve(["--model", tiny_hf_dir, "--served-model-name", "tiny-hf", *ENGINE_ARGS,
                     "--num-kv-blocks", "64", "--max-model-len", "256"], tmp_path_factory)
    yield server
    server.close()


@pytest.fixture(scope="module")
def hf_llm(tiny_hf_dir):
    return LLM(tiny_hf_dir, num_kv_blocks=64, max_model_len=256, **ENGINE)


@pytest.fixture(scope="module")
def preset_server(tmp_path_factory):
    server = _serve(["--model", PRESET, *ENGINE_ARGS, "--num-kv-blocks", "10", "--max-num-seqs", "32",
                     "--max-model-len", "128"], tmp_path_factory)
    yield server
    server.close()


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def aclient(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _stream_completion(c, **kw):
    text, ids, finish, usage = "", [], None, None
    for chunk in c.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text
            ids += choice.model_extra["token_ids"]
            finish = choice.finish_reason or finish
    return text, ids, finish, usage


def _stream_chat(c, **kw):
    text, ids, finish, usage = "", [], None, None
    for chunk in c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            ids += choice.model_extra.get("token_ids") or []
            finish = choice.finish_reason or finish
    return text, ids, finish, usage


PROMPTS = ["Hello world", "The quick brown fox", "naïve café 日本語 ✓"]


def test_completions_streamed_equal_non_streamed_and_generate(hf_server, hf_llm):
    c = client(hf_server)
    assert [m.id for m in c.models.list().data] == ["tiny-hf"]
    expected = hf_llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
    for prompt, want in zip(PROMPTS, expected):
        full = c.completions.create(model="tiny-hf", prompt=prompt, max_tokens=20, temperature=0)
        choice = full.choices[0]
        assert choice.model_extra["token_ids"] == want.output_token_ids
        assert choice.text == want.text
        assert choice.finish_reason == want.finish_reason.value
        assert full.usage.prompt_tokens == len(want.prompt_token_ids)
        assert full.usage.completion_tokens == len(want.output_token_ids)
        assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
        text, ids, finish, usage = _stream_completion(c, model="tiny-hf", prompt=prompt, max_tokens=20,
                                                      temperature=0)
        assert (text, ids, finish) == (choice.text, want.output_token_ids, choice.finish_reason)
        assert usage.completion_tokens == len(ids) and usage.prompt_tokens == full.usage.prompt_tokens
    # token-id prompts give the same as the text they encode
    ids = hf_llm.tokenizer.encode(PROMPTS[0])
    by_ids = c.completions.create(model="tiny-hf", prompt=ids, max_tokens=20, temperature=0)
    assert by_ids.choices[0].model_extra["token_ids"] == expected[0].output_token_ids


def test_chat_streamed_equal_non_streamed_and_llm_chat(hf_server, hf_llm):
    c = client(hf_server)
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello server!"}]
    want = hf_llm.chat(conversation, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0]
    full = c.chat.completions.create(model="tiny-hf", messages=conversation, max_tokens=16, temperature=0)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == want.text
    assert full.choices[0].model_extra["token_ids"] == want.output_token_ids
    assert full.usage.prompt_tokens == len(want.prompt_token_ids)
    assert full.usage.completion_tokens == len(want.output_token_ids)
    text, ids, finish, usage = _stream_chat(c, model="tiny-hf", messages=conversation, max_tokens=16,
                                            temperature=0)
    assert (text, ids, finish) == (want.text, want.output_token_ids, full.choices[0].finish_reason)
    assert usage.completion_tokens == len(ids)


def test_stop_strings_and_stop_tokens_cut_the_output(hf_server):
    c = client(hf_server)
    kw = dict(model="tiny-hf", prompt="Hello world", max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    base = c.completions.create(**kw).choices[0]
    text, ids = base.text, base.model_extra["token_ids"]
    assert len(ids) == 30
    # a stop string of two clean characters from the middle of the output: cut before its first occurrence
    start = next(i for i in range(len(text) // 3, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    stop = text[start:start + 2]
    want = text[:text.find(stop)]
    full = c.completions.create(stop=[stop, "never-seen-xyz"], **kw).choices[0]
    assert full.text == want and full.finish_reason == "stop"
    assert len(full.model_extra["token_ids"]) < 30
    assert full.model_extra["token_ids"] == ids[:len(full.model_extra["token_ids"])]
    streamed, _, finish, usage = _stream_completion(c, stop=stop, **kw)
    assert (streamed, finish) == (want, "stop")
    assert usage.completion_tokens == len(full.model_extra["token_ids"])
    # a stop token id: generation ends at (and includes) its first occurrence
    token = ids[5]
    cut = ids.index(token) + 1
    by_token = c.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "stop_token_ids": [token]}})
    assert by_token.choices[0].model_extra["token_ids"] == ids[:cut]
    assert by_token.choices[0].finish_reason == "stop"


def test_n_choices(hf_server):
    c = client(hf_server)
    out = c.completions.create(model="tiny-hf", prompt="Hello", max_tokens=6, temperature=1.0, seed=7, n=3,
                               extra_body={"ignore_eos": True})
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    assert all(len(ch.model_extra["token_ids"]) == 6 for ch in out.choices)
    assert out.usage.completion_tokens == 18
    again = c.completions.create(model="tiny-hf", prompt="Hello", max_tokens=6, temperature=1.0, seed=7, n=3,
                                 extra_body={"ignore_eos": True})
    assert [ch.text for ch in again.choices] == [ch.text for ch in out.choices]   # seeded


BAD_BODIES = [
    ("{not json", "JSON"),
    (json.dumps({"model": "tiny-hf", "prompt": "hi", "max_tokens": "3"}), "max_tokens"),
    (json.dumps({"model": "tiny-hf", "prompt": "hi", "max_tokens": -3}), "max_tokens"),
    (json.dumps({"model": "tiny-hf", "prompt": "hi", "temperature": -1}), "temperature"),
    (json.dumps({"model": "tiny-hf", "prompt": "hi " * 200, "max_tokens": 100}), "max_model_len"),
    (json.dumps({"model": "tiny-hf", "prompt": [3, 5, 100000]}), "vocabulary"),
    (json.dumps({"model": "tiny-hf", "prompt": []}), "prompt"),
    (json.dumps({"model": "tiny-hf", "prompt": "hi", "presence_penalty": 2.5}), "presence_penalty"),
    (json.dumps({"model": "tiny-hf", "prompt": "hi", "logit_bias": {"x": 1}}), "logit_bias"),
    (json.dumps({"model": "tiny-hf", "prompt": "hi", "logit_bias": {"99999": 1}}), "logit_bias"),
    (json.dumps({"model": "tiny-hf", "prompt": "hi", "stop_token_ids": [3, 99999]}), "stop_token_ids"),
    (json.dumps({"model": "tiny-hf", "prompt": "hi", "logprobs": 21}), "logprobs"),
    (json.dumps({"model": "tiny-hf", "prompt": "hi", "best_of": 2, "n": 3}), "best_of"),
    (json.dumps({"model": "tiny-hf", "prompt": "hi", "best_of": 2, "stream": True}), "best_of"),
    (json.dumps({"model": "tiny-hf", "prompt": "hi", "max_tokens": 2, "min_tokens": 3}), "min_tokens"),
    (json.dumps({"model": "tiny-hf", "prompt": "hi", "suffix": "x"}), "suffix"),
]


def test_bad_requests_get_400_while_a_good_request_completes(hf_server):
    result = {}

    def good():
        result["out"] = _stream_completion(client(hf_server), model="tiny-hf", prompt="The quick", max_tokens=40,
                                           temperature=0, extra_body={"ignore_eos": True})

    thread = threading.Thread(target=good)
    thread.start()
    with httpx.Client(base_url=hf_server.url, timeout=30) as h:
        for body, mention in BAD_BODIES:
            r = h.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and mention in error["message"], error
        r = h.post("/v1/chat/completions", json={"model": "tiny-hf", "messages": []})
        assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
        r = h.post("/v1/completions", json={"model": "other-model", "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client(hf_server).completions.create(model="tiny-hf", prompt="hi", max_tokens=1000)
    thread.join(60)
    assert len(result["out"][1]) == 40 and result["out"][2] == "length"


def test_token_ids_without_a_tokenizer_and_chat_refused(preset_server):
    c = client(preset_server)
    out = c.completions.create(model=PRESET, prompt=[5, 6, 7], max_tokens=4, temperature=0,
                               extra_body={"ignore_eos": True})
    assert len(out.choices[0].model_extra["token_ids"]) == 4 and out.choices[0].text == ""
    with pytest.raises(openai.BadRequestError, match="no tokenizer"):
        c.completions.create(model=PRESET, prompt="text", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="tokenizer"):
        c.chat.completions.create(model=PRESET, messages=[{"role": "user", "content": "hi"}])


def _idle(server):
    m = server.metrics()
    return tuple(m[f'tripath:{name}{{engine="0",model_name="{PRESET}"}}'] for name in
                 ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_used", "num_requests_in_server"))


def test_200_concurrent_streams_with_preemption(preset_server):
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 256) for _ in range(rng.randint(4, 24))] for _ in range(200)]
    lengths = [rng.randint(2, 12) for _ in prompts]
    before = preset_server.metrics()

    async def one(c, prompt, n):
        ids, usage, finish = [], None, None
        stream = await c.completions.create(model=PRESET, prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                ids += choice.model_extra["token_ids"]
                finish = choice.finish_reason or finish
        return ids, usage, finish

    async def run():
        c = aclient(preset_server)
        try:
            return await asyncio.gather(*(one(c, p, n) for p, n in zip(prompts, lengths)))
        finally:
            await c.close()

    start = time.perf_counter()
    results = asyncio.run(run())
    print(f"200 streams in {time.perf_counter() - start:.1f} s")
    llm = LLM(PRESET, num_kv_blocks=64, **ENGINE)
    expected = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths],
                            use_tqdm=False)
    for (ids, usage, finish), n, want in zip(results, lengths, expected):
        assert len(ids) == n and usage.completion_tokens == n and finish == "length"
        assert ids == want.output_token_ids
    after = preset_server.metrics()
    preemptions = f'tripath:num_preemptions_total{{engine="0",model_name="{PRESET}"}}'
    assert after[preemptions] > before[preemptions]   # the small cache forced preemption
    length = f'tripath:request_success_total{{engine="0",finished_reason="length",model_name="{PRESET}"}}'
    assert after[length] - before[length] == 200
    assert _idle(preset_server) == (0, 0, 0, 0)   # every block and request slot back


def test_disconnect_mid_stream_frees_blocks(preset_server):
    aborted = f'tripath:request_success_total{{engine="0",finished_reason="abort",model_name="{PRESET}"}}'
    before = preset_server.metrics()[aborted]
    streams = []
    with httpx.Client(base_url=preset_server.url, timeout=30) as h:
        for i in range(3):
            body = {"model": PRESET, "prompt": [3 + i] * 20, "max_tokens": 100, "stream": True, "ignore_eos": True}
            cm = h.stream("POST", "/v1/completions", json=body)
            r = cm.__enter__()
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))   # generating
            streams.append(cm)
        assert preset_server.metrics()[f'tripath:kv_cache_blocks_used{{engine="0",model_name="{PRESET}"}}'] > 0
        for cm in streams:
            cm.__exit__(None, None, None)   # the client goes away mid-stream
    deadline = time.monotonic() + 60   # generous: only a leak waits this long
    while _idle(preset_server) != (0, 0, 0, 0) and time.monotonic() < deadline:
        threading.Event().wait(0.1)
    assert _idle(preset_server) == (0, 0, 0, 0)
    assert preset_server.metrics()[aborted] - before == 3


def test_overload_gets_503_and_graceful_shutdown(tmp_path_factory):
    server = _serve(["--model", PRESET, *ENGINE_ARGS, "--num-kv-blocks", "32", "--max-num-seqs", "1",
                     "--max-queue-depth", "2", "--max-model-len", "256"], tmp_path_factory, log_level="info")
    try:
        body = {"model": PRESET, "prompt": [5, 6, 7], "max_tokens": 60, "ignore_eos": True}

        async def burst():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as h:
                return await asyncio.gather(*(h.post("/v1/completions", json=body) for _ in range(12)))

        # max_num_seqs 1 + depth 2: three long streams fill the server (whatever the machine's speed), then a
        # burst is refused whole
        with httpx.Client(base_url=server.url, timeout=60) as h:
            held = [h.stream("POST", "/v1/completions", json={**body, "max_tokens": 200, "stream": True})
                    for _ in range(3)]
            try:
                assert [cm.__enter__().status_code for cm in held] == [200] * 3
                responses = asyncio.run(burst())
            finally:
                for cm in held:
                    cm.__exit__(None, None, None)   # the client goes: its request is aborted
        assert [r.status_code for r in responses] == [503] * 12
        assert all("overloaded" in r.json()["error"]["message"] for r in responses)
        deadline = time.monotonic() + 60   # generous: only a leak waits this long
        while _idle(server) != (0, 0, 0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _idle(server) == (0, 0, 0, 0)
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)   # served again
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 60
        # SIGTERM with a stream in flight: it still completes, then the process exits cleanly
        with httpx.Client(base_url=server.url, timeout=60) as h:
            body = {"model": PRESET, "prompt": [9, 9], "max_tokens": 150, "stream": True, "ignore_eos": True}
            with h.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                events = [next(line for line in lines if line.startswith("data:"))]
                server.signal()
                events += [line for line in lines if line.startswith("data:")]
        tokens = sum(len(json.loads(e[5:])["choices"][0]["token_ids"]) for e in events if e != "data: [DONE]")
        assert tokens == 150 and events[-1] == "data: [DONE]"
        assert server.proc.wait(30) == 0, server.log()   # a drained stop: 0, whichever the signal
        assert "engine stopped" in server.log()
    finally:
        server.close()


def test_bench_serve_online_against_the_server(preset_server, tmp_path, capsys):
    from tripath.cli import main

    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--url", preset_server.url, "--num-requests", "24", "--input-len", "8",
                 "--input-len-spread", "0.5", "--output-len", "5", "--request-rate", "100,inf",
                 "--max-concurrency", "8", "--json", str(out), "--csv", str(tmp_path / "serve.csv")]) == 0
    reports = json.loads(out.read_text())
    assert [r["request_rate"] for r in reports] == [100.0, "inf"]
    for r in reports:
        assert r["num_requests"] == 24 and r["num_failed"] == 0 and r["total_output_tokens"] == 24 * 5
        assert r["model"] == PRESET and 0 < r["ttft_s"]["p50"] <= r["e2e_s"]["p50"] <= r["e2e_s"]["p99"]
        assert r["itl_s"]["mean"] > 0 and r["tpot_s"]["mean"] > 0 and r["output_throughput"] > 0
        assert r["client_processes"] == 1 and 0 < r["server_ttft_mean_s"] <= r["ttft_s"]["mean"]
    table = capsys.readouterr().out
    assert "TTFT mean (s)" in table and len(table.strip().splitlines()) == 4
    assert (tmp_path / "serve.csv").read_text().splitlines()[0].count("ttft_s.p99") == 1
    assert _idle(preset_server) == (0, 0, 0, 0)


def test_bench_serve_online_runs_an_offline_workload_and_compares(preset_server, tmp_path, capsys):
    from tripath.cli import main

    offline = tmp_path / "offline.json"
    offline.write_text(json.dumps({"workload": {"name": "tiny", "num_requests": 8, "output_len": 8},
                                   "rows": [{"backend": "torch", "output_throughput": 100.0,
                                             "ttft_s": {"mean": 0.5, "p50": 0.5, "p99": 0.9}}]}))
    out = tmp_path / "online.json"
    assert main(["bench", "serve", "--url", preset_server.url, "--workload", "tiny", "--num-requests", "8",
                 "--max-concurrency", "4", "--passes", "2", "--against", str(offline), "--json", str(out),
                 "--csv", str(tmp_path / "online.csv")]) == 0
    report = json.loads(out.read_text())
    assert [p["total_output_tokens"] for p in report["passes"]] == [8 * 8, 8 * 8]
    server, against = report["rows"]
    assert server["num_failed"] == 0 and server["output_throughput"] > 0 and against["backend"] == "offline (torch)"
    assert len((tmp_path / "online.csv").read_text().splitlines()) == 3   # header, server, offline
    printed = capsys.readouterr().out
    assert "server / offline: output tok/s" in printed and "TTFT p50" in printed
    assert all(p["server_ttft_mean_s"] > 0 for p in report["passes"])
    assert _idle(preset_server) == (0, 0, 0, 0)


def test_the_benchmark_client_spread_over_processes_returns_every_record_in_request_order(preset_server):
    from tripath.bench.serve_clients import ClientPool
    from tripath.bench.serve_online import Workload

    prompts = [[5 + i % 7] * (3 + i) for i in range(11)]   # a distinct length per request
    with ClientPool(3) as pool:
        records, elapsed = pool.run(preset_server.url, PRESET, Workload(prompts, 4), 200.0, 5, seed=1)
    assert [r.prompt_tokens for r in records] == [len(p) for p in prompts]
    assert all(r.ok and r.output_tokens == 4 for r in records)
    assert elapsed >= max(r.e2e_s for r in records)
    assert _idle(preset_server) == (0, 0, 0, 0)
