"""The server's Prometheus metrics (``GET /metrics``): engine state after each step, request latencies and
token counts. The engine loop updates them (``prometheus_client`` is thread-safe); the handler only renders."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """One registry per server. ``observe_step`` after every engine step, ``observe_finished`` per request."""

    def __init__(self, rate_window_s: float = 5.0):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("tripath_requests_running", "Requests holding KV blocks", registry=r)
        self.waiting = Gauge("tripath_requests_waiting", "Requests queued in the engine (new or preempted)", registry=r)
        self.in_server = Gauge("tripath_requests_in_server", "Requests accepted by the server and not finished",
                               registry=r)
        self.kv_total = Gauge("tripath_kv_cache_blocks_total", "Usable KV-cache blocks", registry=r)
        self.kv_used = Gauge("tripath_kv_cache_blocks_used", "KV-cache blocks held by requests", registry=r)
        self.kv_usage = Gauge("tripath_kv_cache_usage_ratio", "Fraction of the KV-cache blocks held by requests",
                              registry=r)
        self.prefix_hit = Gauge("tripath_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache, "
                                "over all prompt tokens looked up", registry=r)
        self.preemptions = Gauge("tripath_preemptions", "Preemptions since start", registry=r)
        self.steps = Gauge("tripath_engine_steps", "Engine steps since start", registry=r)
        self.step_failures = Counter("tripath_engine_step_failures", "Engine steps that raised", registry=r)
        self.tokens_per_s = Gauge("tripath_generation_tokens_per_second",
                                  f"Output tokens per second over the last {rate_window_s:g} s", registry=r)
        self.prompt_tokens = Counter("tripath_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("tripath_generation_tokens", "Output tokens generated", registry=r)
        self.requests = Counter("tripath_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.rejected = Counter("tripath_requests_rejected", "Requests refused by reason", ["reason"], registry=r)
        self.ttft = Histogram("tripath_time_to_first_token_seconds", "Arrival to first output token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("tripath_time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("tripath_e2e_request_latency_seconds", "Arrival to finish", buckets=LATENCY_BUCKETS,
                             registry=r)
        self._window = rate_window_s
        self._recent: deque[tuple[float, int]] = deque()

    def observe_engine(self, llm, num_new_tokens: int = 0) -> None:
        scheduler, blocks = llm.scheduler, llm.block_manager
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        total = blocks.num_usable_blocks
        used = total - blocks.num_free_blocks
        self.kv_total.set(total)
        self.kv_used.set(used)
        self.kv_usage.set(used / total if total else 0.0)
        self.prefix_hit.set(blocks.prefix_hit_rate)
        self.preemptions.set(scheduler.num_preemptions)
        self.steps.set(llm.num_steps)
        now = time.monotonic()
        if num_new_tokens:
            self.generation_tokens.inc(num_new_tokens)
            self._recent.append((now, num_new_tokens))
        while self._recent and self._recent[0][0] < now - self._window:
            self._recent.popleft()
        self.tokens_per_s.set(sum(n for _, n in self._recent) / self._window)

    def observe_finished(self, output, outcome: str) -> None:
        self.requests.labels(outcome).inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        if output.ttft is not None:
            self.ttft.observe(output.ttft)
        if output.tpot is not None:
            self.tpot.observe(output.tpot)

    def render(self) -> bytes:
        return generate_latest(self.registry)
