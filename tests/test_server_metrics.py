"""``/metrics`` of a real ``tripath serve`` process after a scripted mix of requests — a stop string, ``n=2``,
a client that leaves mid-stream, preemptions on a tiny KV cache — counts every engine request (choice) once
everywhere, with vLLM's names, types, labels and buckets (``vllm:``), each also served as ``tripath:`` with the
same samples; ``--metric-names`` picks one of the two."""

import asyncio
import re
import time

import httpx
import pytest

from server_process import ServerProcess

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from server_models import save_tiny_hf_llama  # noqa: E402  (needs transformers)

NAME = "metrics-model"
_SAMPLE = re.compile(r'^([^{\s]+)(?:\{(.*)\})? (\S+)$')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    save_tiny_hf_llama(path)
    log = tmp_path_factory.mktemp("log") / "server.log"
    proc = ServerProcess(["--model", str(path), "--served-model-name", NAME, "--backend", "torch", "--num-kv-blocks",
                          "16", "--max-num-seqs", "4", "--max-model-len", "256"], log)
    yield proc
    proc.close()


def scrape(server) -> dict[tuple[str, frozenset], float]:
    """Samples by (name, labels), and the ``# TYPE`` of each metric under the key ``(name, "type")``."""
    out = {}
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            out[(name, "type")] = kind
        elif line and not line.startswith("#"):
            name, labels, value = _SAMPLE.match(line).groups()
            pairs = frozenset(tuple(p.split("=", 1)) for p in re.findall(r'\w+="[^"]*"', labels or ""))
            out[(name, frozenset((k, v.strip('"')) for k, v in pairs))] = float(value)
    return out


def value(samples, name, **labels):
    return samples[(name, frozenset({"model_name": NAME, "engine": "0", **labels}.items()))]


def test_metrics_count_every_choice_once(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    ids = lambda text: httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]  # noqa: E731
    greedy = dict(model=NAME, temperature=0, extra_body={"ignore_eos": True})
    # 1. 200 tokens; 2. the same prompt, cut by a stop string early in that output
    base = c.completions.create(prompt="Hello world", max_tokens=200, **greedy).choices[0]
    text = base.text
    start = next(i for i in range(len(text) // 8, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    stopped = c.completions.create(prompt="Hello world", max_tokens=200, stop=[text[start:start + 2]],
                                   **greedy).choices[0]
    assert stopped.finish_reason == "stop" and len(stopped.model_extra["token_ids"]) < 200
    # 3. two choices
    two = c.completions.create(model=NAME, prompt="The quick brown fox", max_tokens=6, n=2, temperature=1.0, seed=5,
                               extra_body={"ignore_eos": True})
    assert [len(ch.model_extra["token_ids"]) for ch in two.choices] == [6, 6]
    # 4. a stream the client leaves after its first event
    before = scrape(server)
    with httpx.Client(base_url=server.url, timeout=60) as h:
        body = {"model": NAME, "prompt": [7] * 20, "max_tokens": 200, "stream": True, "ignore_eos": True}
        with h.stream("POST", "/v1/completions", json=body) as r:
            assert next(line for line in r.iter_lines() if line.startswith("data:"))
    deadline = time.monotonic() + 30
    while value(scrape(server), "vllm:request_success_total", finished_reason="abort") == 0:
        assert time.monotonic() < deadline, "the abort was not counted"
        time.sleep(0.05)
    assert value(before, "vllm:request_success_total", finished_reason="abort") == 0
    # 5. four requests of 80 tokens each on a cache of 15 blocks of 16: preemptions

    async def crowd():
        a = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(a.completions.create(prompt=[11 + i] * 20, max_tokens=60, **greedy)
                                          for i in range(4)))
        finally:
            await a.close()

    assert all(len(out.choices[0].model_extra["token_ids"]) == 60 for out in asyncio.run(crowd()))

    m = scrape(server)
    success = {reason: value(m, "vllm:request_success_total", finished_reason=reason)
               for reason in ("stop", "length", "abort", "error")}
    assert success == {"stop": 1, "length": 1 + 2 + 4, "abort": 1, "error": 0}
    choices = 9
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_decode_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens"):
        assert value(m, f"vllm:{name}_count") == choices, name
        assert m[(f"vllm:{name}", "type")] == "histogram"
    assert value(m, "vllm:time_to_first_token_seconds_bucket", le="2560.0") == choices   # vLLM's buckets
    assert value(m, "vllm:inter_token_latency_seconds_bucket", le="80.0") == \
        value(m, "vllm:inter_token_latency_seconds_count")
    prompt_tokens = 2 * len(ids("Hello world")) + 2 * len(ids("The quick brown fox")) + 20 + 4 * 20
    assert value(m, "vllm:prompt_tokens_total") == prompt_tokens
    assert value(m, "vllm:request_prompt_tokens_sum") == prompt_tokens
    assert value(m, "vllm:request_params_max_tokens_sum") == 200 + 200 + 2 * 6 + 200 + 4 * 60
    generated = value(m, "vllm:generation_tokens_total")
    assert value(m, "vllm:request_generation_tokens_sum") == generated
    assert generated >= 200 + len(stopped.model_extra["token_ids"]) + 12 + 1 + 240
    assert value(m, "vllm:inter_token_latency_seconds_count") == generated - choices   # every later token
    assert value(m, "vllm:request_time_per_output_token_seconds_count") in (choices - 1, choices)
    assert value(m, "vllm:num_preemptions_total") > 0
    assert m[("vllm:num_preemptions_total", "type")] == "counter"
    queried, hit = value(m, "vllm:prefix_cache_queries_total"), value(m, "vllm:prefix_cache_hits_total")
    assert queried >= prompt_tokens and 0 <= hit <= queried   # every admission looks its tokens up
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                  "tripath:kv_cache_blocks_used", "tripath:num_requests_in_server"):
        assert value(m, gauge) == 0, gauge
        assert m[(gauge, "type")] == "gauge"
    assert value(m, "tripath:kv_cache_blocks_total") == 15
    steps = value(m, "tripath:engine_steps_total")
    assert steps > 0 and value(m, "tripath:engine_step_failures_total") == 0
    # the families vLLM added since: queue, prefill and inference times of every choice that had a token ...
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_inference_time_seconds"):
        assert value(m, f"vllm:{name}_count") == choices, name
        assert value(m, f"vllm:{name}_bucket", le="7680.0") == choices, name   # vLLM's request latency buckets
    assert value(m, "vllm:request_inference_time_seconds_sum") == pytest.approx(
        value(m, "vllm:request_prefill_time_seconds_sum") + value(m, "vllm:request_decode_time_seconds_sum"))
    assert 0 < value(m, "vllm:request_queue_time_seconds_sum") + value(m, "vllm:request_prefill_time_seconds_sum") \
        <= value(m, "vllm:time_to_first_token_seconds_sum")   # the engine's part of the time to first token
    # ... n and the longest choice per prompt (8 prompts: one of them with n=2) ...
    assert value(m, "vllm:request_params_n_count") == 8 and value(m, "vllm:request_params_n_sum") == 9
    assert value(m, "vllm:request_params_n_bucket", le="1.0") == 7 and value(m, "vllm:request_params_n_bucket",
                                                                             le="2.0") == 8
    assert value(m, "vllm:request_max_num_generation_tokens_count") == 8
    # ... tokens per model step, counted by the engine (a launch of k decode steps is k of them) ...
    assert value(m, "vllm:iteration_tokens_total_count") >= steps
    assert value(m, "vllm:iteration_tokens_total_sum") >= generated - choices   # every decode's input token
    assert value(m, "vllm:iteration_tokens_total_bucket", le="1.0") > 0   # lone decodes
    # ... and the KV cache's configuration
    info = [labels for name, labels in m if name == "vllm:cache_config_info" and labels != "type"]
    assert len(info) == 1 and m[("vllm:cache_config_info", info[0])] == 1
    assert {"block_size": "16", "num_gpu_blocks": "16", "num_gpu_blocks_override": "16", "cache_dtype": "auto",
            "enable_prefix_caching": "True", "engine": "0"}.items() <= dict(info[0]).items()
    # every vllm: sample is served as tripath: too, with the same value; nothing else but the process's own
    ours = {(name.replace("vllm:", "tripath:", 1), labels): v for (name, labels), v in m.items()
            if labels != "type" and name.startswith("vllm:")}
    assert ours and all(m[key] == v for key, v in ours.items())
    assert not [key for key in m if key[1] != "type" and not key[0].startswith(("vllm:", "tripath:", "python_",
                                                                                   "process_"))]


def test_a_counted_histogram_renders_as_the_same_observations_one_by_one():
    """``CountedHistogram.observe(v, n)`` (one call for a step's tokens of a request) against
    ``prometheus_client.Histogram`` given each observation: the same buckets, count and (to rounding) sum."""
    import random

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from tripath.server.metrics.metrics import LABELS, TOKEN_LATENCY_BUCKETS, CountedHistogram

    name, doc = "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram(name, doc, LABELS, buckets=TOKEN_LATENCY_BUCKETS, registry=theirs).labels(NAME, "0")
    counted = CountedHistogram(name, doc, (NAME, "0"), TOKEN_LATENCY_BUCKETS, ours)
    rng = random.Random(7)
    for _ in range(400):
        v = rng.choice([rng.random() * 3, rng.random() * 200, *TOKEN_LATENCY_BUCKETS, 0.0])  # bounds are "le"
        n = rng.randint(1, 9)
        for _ in range(n):
            reference.observe(v)
        counted.observe(v, n)

    def samples(registry):
        lines = generate_latest(registry).decode().splitlines()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines
                if line and not line.startswith("#") and "_created" not in line}

    expected, got = samples(theirs), samples(ours)
    assert expected.keys() == got.keys() and len(got) == len(TOKEN_LATENCY_BUCKETS) + 3   # +Inf, _count, _sum
    for key, number in expected.items():
        assert got[key] == pytest.approx(number, rel=1e-12), key


def test_the_tokens_per_second_gauge_counts_the_tokens_of_its_window_only(monkeypatch):
    """``generation_tokens_per_second`` against the sum recomputed from every observation still inside the
    window, over observations whose spacing leaves a few to several dozen inside it."""
    import random

    from tripath.engine.scheduling.stats import EngineStats
    from tripath.server.metrics import metrics as M

    clock = [1000.0]
    monkeypatch.setattr(M.time, "monotonic", lambda: clock[0])
    metrics = M.ServerMetrics(NAME, rate_window_s=2.0)
    stats = EngineStats(1, 0, 1, 10, 0, 0, 0, 0)
    rng = random.Random(3)
    seen = []
    for _ in range(500):
        clock[0] += rng.choice([0.001, 0.05, 0.3, 2.5])
        n = rng.choice([0, 1, 8, 64])
        metrics.observe_engine(stats, n)
        seen.append((clock[0], n))
        expected = sum(k for t, k in seen if t >= clock[0] - 2.0) / 2.0
        assert metrics.tokens_per_s._value.get() == pytest.approx(expected, abs=1e-9)


def test_speculative_decoding_counters_follow_the_engine_stats():
    """vLLM's spec-decode families grow by what the engine's cumulative counts grew, per draft position too."""
    from tripath.engine.scheduling.stats import EngineStats
    from tripath.server.metrics.metrics import ServerMetrics

    metrics = ServerMetrics(NAME, names="vllm")
    metrics.observe_engine(EngineStats(1, 0, 1, 10, 0, 0, 0, 1, (), 0, 2, 6, 4, (2, 1, 1)))
    metrics.observe_engine(EngineStats(1, 0, 1, 10, 0, 0, 0, 2, (), 0, 5, 15, 7, (4, 2, 1)))
    text = metrics.render().decode()
    for line in ('vllm:spec_decode_num_drafts_total{engine="0",model_name="%s"} 5.0',
                 'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="%s"} 15.0',
                 'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="%s"} 7.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="%s",position="0"} 4.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="%s",position="2"} 1.0'):
        assert line % NAME in text, line


@pytest.mark.parametrize("names, prefixes", [("both", {"vllm:", "tripath:"}), ("vllm", {"vllm:", "tripath:"}),
                                             ("tripath", {"tripath:"})])
def test_metric_names_choose_how_vllms_families_are_named(names, prefixes):
    """``--metric-names``: vLLM's families as ``vllm:``, ``tripath:`` or both; tripath's own stay ``tripath:``."""
    from tripath.server.metrics.metrics import ServerMetrics

    metrics = ServerMetrics(NAME, names=names)
    metrics.engine_ready(256, {"block_size": "16"})
    families = {line.split(" ")[2] for line in metrics.render().decode().splitlines() if line.startswith("# TYPE ")}
    assert {f.split(":")[0] + ":" for f in families if ":" in f} == prefixes
    assert ("vllm:time_to_first_token_seconds" in families) == (names != "tripath")
    assert ("tripath:time_to_first_token_seconds" in families) == (names != "vllm")
    assert "tripath:num_requests_in_server" in families and "vllm:num_requests_in_server" not in families
    with pytest.raises(ValueError, match="metric names must be one of both, vllm, tripath, got 'tgi'"):
        ServerMetrics(NAME, names="tgi")


def test_the_engine_reports_tokens_per_model_step_and_queue_times(pure_torch_one_thread):
    """``EngineStats.step_token_counts``: every model step's new tokens (a launch of k decode steps is k steps),
    so their sum is the prompts' tokens and one per later token; ``RequestOutput.queue_time`` / ``prefill_time``
    split the engine's time to first token at the first step that scheduled the request."""
    from tripath.engine import LLM, SamplingParams
    from tripath.engine.scheduling.stats import STEP_TOKEN_BUCKETS, StepTokenCounts

    llm = LLM("tiny-llama", backend="torch", num_kv_blocks=64, decode_steps=4, enable_prefix_caching=False)
    prompts = {"a": [5] * 9, "b": [7] * 30, "c": [3] * 2}
    for request_id, prompt in prompts.items():
        llm.add_request(prompt, SamplingParams(max_tokens=11, ignore_eos=True), request_id=request_id)
    first = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            assert out.queue_time is not None and out.queue_time >= 0
            if out.new_token_ids and len(out.output_token_ids) == len(out.new_token_ids):
                first[out.request_id] = out
    stats = llm.stats()
    assert len(stats.step_token_counts) == len(STEP_TOKEN_BUCKETS) + 1
    assert stats.step_tokens_sum == sum(len(p) for p in prompts.values()) + 3 * (11 - 1)
    assert sum(stats.step_token_counts) >= stats.num_steps   # (more: a launch of k decode steps on a GPU)
    assert stats.step_token_counts[1] > 0 and stats.step_token_counts[-1] == 0   # 3 decodes (<= 8); none > 16384
    assert sorted(first) == sorted(prompts)
    for out in first.values():
        assert out.prefill_time > 0 and out.queue_time + out.prefill_time == pytest.approx(out.ttft)
    counts = StepTokenCounts()   # the CPU runs no multi-step launches: their counting alone
    counts.observe(3, 4)   # a launch of 4 decode steps of 3 requests
    counts.observe(16)     # a bucket holds its upper bound
    counts.observe(17)
    assert counts.counts[1] == 4 and counts.counts[2] == 1 and counts.counts[3] == 1 and counts.total == 45
