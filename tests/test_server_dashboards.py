"""vLLM's Grafana dashboard on ``tripath serve``: every query of its panels (vLLM's
examples/online_serving/prometheus_grafana/grafana.json, as current vLLM ships it), and a few common ones
beyond it, evaluated as Prometheus would over two scrapes of a real server process around a few requests,
returns data: the series exist with the labels the queries select, and every rate, increase and quantile of
something that happened is a finite number above zero. One server, several API servers (merged scrapes) and
the in-process engine."""

import math
import time

import httpx
import pytest

from prometheus_queries import Evaluator
from server_process import ServerProcess

pytest.importorskip("fastapi")
pytestmark = pytest.mark.usefixtures("pure_torch_one_thread")

NAME = "dash-model"
SERVE = ["--model", "tiny-llama", "--served-model-name", NAME, "--backend", "torch", "--num-kv-blocks", "64",
         "--max-model-len", "512"]
SEL = '{model_name="$model_name"}[$__rate_interval]'


def _quantiles(name: str) -> list[str]:
    return [f"histogram_quantile({q}, sum by(le) (rate({name}_bucket{SEL})))" for q in (0.99, 0.95, 0.9, 0.5)] + \
        [f"rate({name}_sum{SEL})\n/\nrate({name}_count{SEL})"]


# (panel, query, what it must give): "positive" (a value > 0: a rate, a quantile, a heatmap's busiest bucket),
# "exists" (finite values: a gauge that is 0 again, a count of something that did not happen)
DASHBOARD = [
    *[("E2E Request Latency", q, "positive") for q in _quantiles("vllm:e2e_request_latency_seconds")],
    ("Token Throughput", f"rate(vllm:prompt_tokens_total{SEL})", "positive"),
    ("Token Throughput", f"rate(vllm:generation_tokens_total{SEL})", "positive"),
    *[("Inter Token Latency", q, "positive") for q in _quantiles("vllm:inter_token_latency_seconds")],
    *[("Time Per Output Token (TPOT)", q, "positive")
      for q in _quantiles("vllm:request_time_per_output_token_seconds")],
    ("Scheduler State", 'vllm:num_requests_running{model_name="$model_name"}', "exists"),
    ("Scheduler State", 'vllm:num_requests_waiting{model_name="$model_name"}', "exists"),
    *[("Time To First Token Latency", q, "positive") for q in _quantiles("vllm:time_to_first_token_seconds")],
    ("Cache Utilization", 'vllm:kv_cache_usage_perc{model_name="$model_name"}', "exists"),
    ("Request Prompt Length", f"sum by(le) (increase(vllm:request_prompt_tokens_bucket{SEL}))", "positive"),
    ("Request Generation Length", f"sum by(le) (increase(vllm:request_generation_tokens_bucket{SEL}))", "positive"),
    ("Finish Reason", f"sum by(finished_reason) (increase(vllm:request_success_total{SEL}))", "exists"),
    ("Queue Time", f"rate(vllm:request_queue_time_seconds_sum{SEL})", "positive"),
    ("Requests Prefill and Decode Time", f"rate(vllm:request_prefill_time_seconds_sum{SEL})", "positive"),
    ("Requests Prefill and Decode Time", f"rate(vllm:request_decode_time_seconds_sum{SEL})", "positive"),
    ("Max Generation Token in Sequence Group", f"rate(vllm:request_max_num_generation_tokens_sum{SEL})", "positive"),
    # beyond the dashboard: the other histograms vLLM serves, its prefix cache and its cache configuration
    *[("(inference time)", q, "positive") for q in _quantiles("vllm:request_inference_time_seconds")],
    *[("(tokens per step)", q, "positive") for q in _quantiles("vllm:iteration_tokens_total")],
    ("(n)", f"sum by(le) (increase(vllm:request_params_n_bucket{SEL}))", "exists"),
    ("(max_tokens)", f"rate(vllm:request_params_max_tokens_sum{SEL})", "positive"),
    ("(prefix cache)", f"rate(vllm:prefix_cache_queries_total{SEL})", "positive"),
    ("(preemptions)", f"rate(vllm:num_preemptions_total{SEL})", "exists"),
    ("(cache config)", 'vllm:cache_config_info{engine="0"}', "positive"),
]


def _workload(url: str) -> None:
    """Five engine requests: plain, n=2, streamed, and one of 40 prompt tokens."""
    with httpx.Client(base_url=url, timeout=120) as h:
        for body in ({"prompt": [5, 6, 7], "max_tokens": 6}, {"prompt": [9, 8], "max_tokens": 5, "n": 2, "seed": 1},
                     {"prompt": [1] * 40, "max_tokens": 4}):
            r = h.post("/v1/completions", json={"model": NAME, "ignore_eos": True, **body})
            assert r.status_code == 200, r.text
        with h.stream("POST", "/v1/completions", json={"model": NAME, "prompt": [3, 4], "max_tokens": 7,
                                                       "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200 and list(r.iter_lines())[-2:] == ["data: [DONE]", ""]


@pytest.mark.parametrize("mode", [[], ["--engine-in-process"], ["--api-server-count", "2"]],
                         ids=["core", "in-process", "2-api-servers"])
def test_vllms_dashboard_queries_return_data(tmp_path, mode):
    server = ServerProcess([*SERVE, *mode], tmp_path / "server.log")
    try:
        before, start = httpx.get(server.url + "/metrics", timeout=10).text, time.monotonic()
        _workload(server.url)
        time.sleep(0.1)   # the stats update after the last step
        after, seconds = httpx.get(server.url + "/metrics", timeout=10).text, time.monotonic() - start
    finally:
        server.close()
    query = Evaluator(before, after, seconds, {"model_name": NAME, "__rate_interval": "1m"})
    for panel, expr, want in DASHBOARD:
        result = query(expr)
        assert result, f"{panel}: {expr} selects nothing"
        assert all(math.isfinite(v) for v in result.values()), f"{panel}: {expr} = {result}"
        if want == "positive":
            assert max(result.values()) > 0, f"{panel}: {expr} = {result}"
        if "model_name" in expr:   # the labels the panels select by and show
            assert all(dict(labels).get("model_name", NAME) == NAME for labels in result), expr
    reasons = {dict(labels)["finished_reason"]: v for labels, v in
               query(f"sum by(finished_reason) (increase(vllm:request_success_total{SEL}))").items()}
    assert reasons == {"length": 5, "stop": 0, "abort": 0, "error": 0}
    assert query(f"increase(vllm:request_params_n_count{SEL})") == {
        frozenset({("model_name", NAME), ("engine", "0")}): 4.0}   # four prompts, one with n=2
    assert query(f"increase(vllm:request_generation_tokens_sum{SEL})") == {
        frozenset({("model_name", NAME), ("engine", "0")}): 6 + 2 * 5 + 4 + 7}


def test_the_evaluator_computes_what_prometheus_does():
    """Rates over the scrapes' distance, sums by label, Prometheus' histogram_quantile interpolation, division."""
    head = "# TYPE x histogram\n"
    before = head + 'x_bucket{le="1.0",m="a"} 0\nx_bucket{le="2.0",m="a"} 0\nx_bucket{le="+Inf",m="a"} 0\n' \
        'x_count{m="a"} 0\nx_sum{m="a"} 0\n'
    after = head + 'x_bucket{le="1.0",m="a"} 2\nx_bucket{le="2.0",m="a"} 4\nx_bucket{le="+Inf",m="a"} 5\n' \
        'x_count{m="a"} 5\nx_sum{m="a"} 9\n'
    query = Evaluator(before, after, 10.0, {"w": "1m"})
    labels = frozenset({("m", "a")})
    assert query('rate(x_count{m="a"}[$w])') == {labels: 0.5}
    assert query('rate(x_sum{m="a"}[$w]) / rate(x_count{m="a"}[$w])') == {labels: 1.8}
    assert query("histogram_quantile(0.5, sum by(le) (rate(x_bucket[5m])))") == {frozenset(): 1.25}
    assert query("histogram_quantile(0.2, sum by(le) (rate(x_bucket[5m])))") == {frozenset(): 0.5}
    assert query("histogram_quantile(0.99, sum by(le) (rate(x_bucket[5m])))") == {frozenset(): 2.0}   # in +Inf
    assert query('sum by(m) (increase(x_bucket{le="2.0"}[1m]))') == {labels: 4.0}
    with pytest.raises(ValueError, match="unknown function 'avg_over_time'"):
        query("avg_over_time(x_sum[1m])")
