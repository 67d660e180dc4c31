"""The server's Prometheus metrics (``GET /metrics``), with vLLM's names, types, units, labels and buckets
under the prefix ``tripath:`` (replace ``vllm:`` by ``tripath:`` in a vLLM dashboard's queries).

Every metric carries the labels ``model_name`` (the first served model name) and ``engine`` (``"0"``).
Engine state after each step: requests running / waiting, KV-cache usage, and the cumulative prefix-cache
queries / hits (prompt tokens), preemptions and steps, from :meth:`tripath.engine.LLM.stats`. Per engine
request — one per choice, so a request with ``n=2`` counts twice everywhere: time to first token when its
first token arrives (whatever ends it later: a stop string, a client that leaves), the prompt tokens counted
then too, the inter-token latency of every later token (a step that brings several tokens of a request spreads
the interval evenly over them), and when it ends, by any cause, its finish reason (``stop``, ``length``,
``abort``, ``error``), end-to-end latency, decode time, mean time per output token, prompt / generation
token counts and ``max_tokens``. The thread that delivers the engine's outputs observes them (the engine
thread, or the event loop reading the engine core's updates; ``prometheus_client`` is thread-safe); the
``/metrics`` handler only renders. tripath's own extras (requests in the server, KV blocks, steps, step
failures, refusals by reason, a generation rate) share the prefix.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)


def one_two_five_buckets(top: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``top`` (the token-count buckets, up to ``max_model_len``)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > top:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass
class ChoiceTimes:
    """The timeline of one engine request (``perf_counter`` seconds): from the HTTP request's ``arrival``."""

    arrival: float
    num_prompt_tokens: int
    max_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    num_generated: int = 0


class CountedHistogram:
    """A Prometheus histogram that takes ``count`` equal observations in one call (``observe(value, count)``:
    a bisection and two additions, where ``prometheus_client.Histogram.observe`` takes a lock per call): the
    inter-token latency of a step's 8 tokens x 256 requests is one call per request. One thread observes (the
    one that delivers the engine's outputs); ``/metrics`` reads it from another, a bucket at a time."""

    def __init__(self, name: str, doc: str, label_values: tuple[str, ...], buckets, registry: CollectorRegistry):
        self._name, self._doc, self._label_values = name, doc, list(label_values)
        self._upper = [float(b) for b in buckets] + [math.inf]
        self._le = [floatToGoString(b) for b in self._upper]
        self._counts = [0] * len(self._upper)
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        self._counts[bisect.bisect_left(self._upper, value)] += count   # "le": a bucket holds its upper bound
        self._sum += value * count

    def collect(self):
        family = HistogramMetricFamily(self._name, self._doc, labels=LABELS)
        cumulative, total = [], 0
        for le, n in zip(self._le, self._counts):
            total += n
            cumulative.append((le, total))
        family.add_metric(self._label_values, cumulative, self._sum)
        yield family

    def describe(self):
        return [HistogramMetricFamily(self._name, self._doc, labels=LABELS)]


class _ByReason:
    """A labelled counter bound to the server's model labels: ``labels(reason)`` is the child to ``inc``."""

    def __init__(self, counter: Counter, labels: tuple[str, str]):
        self._counter, self._labels = counter, labels

    def labels(self, reason: str):
        return self._counter.labels(*self._labels, reason)


class ServerMetrics:
    """One registry per server. The engine's side calls :meth:`engine_ready` once, :meth:`observe_engine` after
    every step, :meth:`observe_tokens` per output with tokens, :meth:`observe_end` when a request ends."""

    def __init__(self, model_name: str = "", rate_window_s: float = 5.0):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._labels = (model_name, "0")
        self.running = self._gauge("num_requests_running", "Number of requests in model execution batches.")
        self.waiting = self._gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = self._gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = self._counter("prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = self._counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                         "tokens.")
        self.preemptions = self._counter("num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = self._counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = self._counter("generation_tokens", "Number of generation tokens processed.")
        success = Counter("tripath:request_success", "Count of successfully processed requests.",
                          [*LABELS, "finished_reason"], registry=self.registry)
        self.request_success = _ByReason(success, self._labels)
        for reason in FINISH_REASONS:
            self.request_success.labels(reason)
        self.ttft = self._histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                    TTFT_BUCKETS)
        self.itl = CountedHistogram("tripath:inter_token_latency_seconds",
                                    "Histogram of inter-token latency in seconds.", self._labels,
                                    TOKEN_LATENCY_BUCKETS, self.registry)
        self.tpot = self._histogram("request_time_per_output_token_seconds",
                                    "Histogram of time_per_output_token_seconds per request.", TOKEN_LATENCY_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                                   REQUEST_LATENCY_BUCKETS)
        self.decode_time = self._histogram("request_decode_time_seconds",
                                           "Histogram of time spent in DECODE phase for request.",
                                           REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = self.request_generation_tokens = self.request_max_tokens = None
        # tripath's own
        self.in_server = self._gauge("num_requests_in_server", "Engine requests accepted by the server and not "
                                     "finished (running, waiting, or about to be added).")
        self.kv_blocks_total = self._gauge("kv_cache_blocks_total", "Usable KV-cache blocks.")
        self.kv_blocks_used = self._gauge("kv_cache_blocks_used", "KV-cache blocks held by requests.")
        self.steps = self._counter("engine_steps", "Engine steps since start.")
        self.step_failures = self._counter("engine_step_failures", "Engine steps that raised.")
        rejected = Counter("tripath:requests_rejected", "Requests refused by the server or the engine, by reason.",
                           [*LABELS, "reason"], registry=self.registry)
        self.rejected = _ByReason(rejected, self._labels)
        self.tokens_per_s = self._gauge("generation_tokens_per_second",
                                        f"Generated tokens per second over the last {rate_window_s:g} s.")
        self._window = rate_window_s
        self._recent: deque[tuple[float, int]] = deque()
        self._recent_tokens = 0   # the sum of _recent's counts
        self._last = None   # the EngineStats of the previous observation
        self.num_ended = 0  # engine requests ended, by any cause

    def _gauge(self, name: str, doc: str):
        return Gauge(f"tripath:{name}", doc, LABELS, registry=self.registry).labels(*self._labels)

    def _counter(self, name: str, doc: str):
        return Counter(f"tripath:{name}", doc, LABELS, registry=self.registry).labels(*self._labels)

    def _histogram(self, name: str, doc: str, buckets):
        return Histogram(f"tripath:{name}", doc, LABELS, buckets=buckets, registry=self.registry).labels(*self._labels)

    def engine_ready(self, max_model_len: int) -> None:
        """Once the engine is built: the token-count histograms, whose buckets go up to ``max_model_len``."""
        buckets = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = self._histogram("request_prompt_tokens", "Number of prefill tokens processed.",
                                                     buckets)
        self.request_generation_tokens = self._histogram("request_generation_tokens",
                                                         "Number of generation tokens processed.", buckets)
        self.request_max_tokens = self._histogram("request_params_max_tokens",
                                                  "Histogram of the max_tokens request parameter.", buckets)

    def observe_engine(self, stats, num_new_tokens: int = 0) -> None:
        """After a step: the engine's :class:`~tripath.engine.stats.EngineStats` and the tokens it generated."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.kv_blocks_total.set(stats.num_kv_blocks_total)
        self.kv_blocks_used.set(stats.num_kv_blocks_used)
        last = self._last
        for counter, name in ((self.prefix_queries, "prefix_cache_queried_tokens"),
                              (self.prefix_hits, "prefix_cache_hit_tokens"), (self.preemptions, "num_preemptions"),
                              (self.steps, "num_steps")):
            grown = getattr(stats, name) - (getattr(last, name) if last is not None else 0)
            if grown > 0:
                counter.inc(grown)
        self._last = stats
        now = time.monotonic()
        if num_new_tokens:
            self.generation_tokens.inc(num_new_tokens)
            self._recent.append((now, num_new_tokens))
            self._recent_tokens += num_new_tokens
        while self._recent and self._recent[0][0] < now - self._window:
            self._recent_tokens -= self._recent.popleft()[1]
        self.tokens_per_s.set(self._recent_tokens / self._window)

    def observe_tokens(self, times: ChoiceTimes, num_new: int, now: float) -> None:
        """``num_new`` tokens of one request arrived at ``now``: its TTFT (and prompt tokens) with the first,
        the inter-token latency of the others."""
        if num_new <= 0:
            return
        if times.first_token is None:
            times.first_token = now
            self.ttft.observe(now - times.arrival)
            self.prompt_tokens.inc(times.num_prompt_tokens)
            gap, later = 0.0, num_new - 1
        else:
            gap, later = (now - times.last_token) / num_new, num_new
        if later:
            self.itl.observe(gap, later)
        times.last_token = now
        times.num_generated += num_new

    def observe_end(self, times: ChoiceTimes, reason: str, now: float) -> None:
        """A request ended at ``now`` (``reason``: one of :data:`FINISH_REASONS`)."""
        self.num_ended += 1
        self.request_success.labels(reason).inc()
        self.e2e.observe(now - times.arrival)
        if self.request_prompt_tokens is not None:
            self.request_prompt_tokens.observe(times.num_prompt_tokens)
            self.request_generation_tokens.observe(times.num_generated)
            self.request_max_tokens.observe(times.max_tokens)
        if times.first_token is not None:
            self.decode_time.observe(times.last_token - times.first_token)
            if times.num_generated > 1:
                self.tpot.observe((times.last_token - times.first_token) / (times.num_generated - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
