"""The server's Prometheus metrics (``GET /metrics``): vLLM's families with vLLM's names, types, units, labels
and buckets (``vllm:...``, so vLLM's Grafana dashboards, alerts and autoscalers read them), each also shown
as ``tripath:...`` unless ``--metric-names`` says otherwise (:mod:`~tripath.server.metrics.metric_kinds`), and
tripath's own extras (``tripath:...`` only).

Every metric carries the labels ``model_name`` (the first served model name) and ``engine`` (``"0"``), except
``vllm:cache_config_info``, whose labels are the KV cache's settings and ``engine``, as vLLM's. Engine state
after each step: requests running / waiting, KV-cache usage, and the cumulative prefix-cache queries / hits
(prompt tokens), preemptions, steps and tokens per step (``iteration_tokens_total``), speculative decoding's
drafts, drafted and accepted tokens, accepted tokens by draft position (``vllm:spec_decode_*``), from
:meth:`tripath.engine.core.engine_core.EngineCore.stats`. Per engine request — one per choice, so a request with ``n=2`` counts twice
everywhere: time to first token when its first token arrives (whatever ends it later: a stop string, a client
that leaves), the prompt tokens counted then too, the inter-token latency of every later token (a step that
brings several tokens of a request spreads the interval evenly over them), and when it ends, by any cause,
its finish reason (``stop``, ``length``, ``abort``, ``error``), end-to-end latency, token counts and
``max_tokens``, and, once it had a first token, its decode time (first to last token), queue time (engine
arrival to first scheduled) and prefill time (first scheduled to first token) as the engine measured them,
and inference time (prefill + decode). Per prompt (its ``n`` choices: a :class:`PromptGroup`), once all
its choices have ended: ``n`` and the most tokens one of them generated. The thread that delivers the
engine's outputs observes them (the engine thread, or the event loop reading the engine core's updates;
``prometheus_client`` is thread-safe); the ``/metrics`` handler only renders.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tripath.server.metrics.metric_kinds import (LABELS, METRIC_NAMES, N_BUCKETS, REQUEST_LATENCY_BUCKETS,
                                                 TOKEN_LATENCY_BUCKETS, TTFT_BUCKETS, CountedHistogram,
                                                 StepTokensHistogram, one_two_five_buckets, render)

__all__ = ["LABELS", "FINISH_REASONS", "TOKEN_LATENCY_BUCKETS", "ChoiceTimes", "CountedHistogram", "PromptGroup",
           "ServerMetrics", "one_two_five_buckets"]

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class ChoiceTimes:
    """The timeline of one engine request (``perf_counter`` seconds): from the HTTP request's ``arrival``;
    ``queue_time`` and ``prefill_time``: the engine's, with its first tokens."""

    arrival: float
    num_prompt_tokens: int
    max_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    num_generated: int = 0
    queue_time: float | None = None
    prefill_time: float | None = None


@dataclass(eq=False)
class PromptGroup:
    """The ``size`` engine requests of one prompt of an HTTP request (``n`` asked for; ``size`` is ``best_of``
    when given): observed once every one has ended or been refused, if any ran."""

    n: int
    size: int
    settled: int = 0
    ran: bool = False
    max_generated: int = 0


class _ByReason:
    """A labelled counter bound to the server's model labels: ``labels(reason)`` is the child to ``inc``."""

    def __init__(self, counter: Counter, labels: tuple[str, str]):
        self._counter, self._labels = counter, labels

    def labels(self, reason: str):
        return self._counter.labels(*self._labels, reason)


class ServerMetrics:
    """One registry per server. The engine's side calls :meth:`engine_ready` once, :meth:`observe_engine` after
    every step, :meth:`observe_tokens` per output with tokens, :meth:`observe_end` when a request ends and
    :meth:`observe_refused` when the engine refused one. ``names``: how a scrape names vLLM's families
    (:data:`~tripath.server.metrics.metric_kinds.METRIC_NAMES`)."""

    def __init__(self, model_name: str = "", rate_window_s: float = 5.0, names: str = "both"):
        self.registry = CollectorRegistry()
        self.model_name, self.names = model_name, names
        if names not in METRIC_NAMES:
            raise ValueError(f"metric names must be one of {', '.join(METRIC_NAMES)}, got {names!r}")
        self._labels = (model_name, "0")
        self.running = self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = self._counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = self._counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = self._counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*LABELS, "finished_reason"], registry=self.registry)
        self.request_success = _ByReason(success, self._labels)
        for reason in FINISH_REASONS:
            self.request_success.labels(reason)
        self.iteration_tokens = StepTokensHistogram(self._labels, self.registry)
        self.request_n = self._histogram("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.ttft = self._histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                    TTFT_BUCKETS)
        self.itl = CountedHistogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                    self._labels, TOKEN_LATENCY_BUCKETS, self.registry)
        self.tpot = self._histogram("vllm:request_time_per_output_token_seconds",
                                    "Histogram of time_per_output_token_seconds per request.", TOKEN_LATENCY_BUCKETS)
        self.e2e = self._latency("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.")
        self.queue_time = self._latency("request_queue_time_seconds",
                                        "Histogram of time spent in WAITING phase for request.")
        self.inference_time = self._latency("request_inference_time_seconds",
                                            "Histogram of time spent in RUNNING phase for request.")
        self.prefill_time = self._latency("request_prefill_time_seconds",
                                          "Histogram of time spent in PREFILL phase for request.")
        self.decode_time = self._latency("request_decode_time_seconds",
                                         "Histogram of time spent in DECODE phase for request.")
        self.spec_drafts = self._counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = self._counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted_tokens = self._counter("vllm:spec_decode_num_accepted_tokens",
                                                  "Number of accepted tokens.")
        self._spec_per_position = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted tokens per draft's position.", [*LABELS, "position"],
                                          registry=self.registry)
        self.request_prompt_tokens = self.request_generation_tokens = self.request_max_tokens = None
        self.max_generation_tokens = None
        self._cache_config_set = False
        # tripath's own
        self.in_server = self._gauge("tripath:num_requests_in_server", "Engine requests accepted by the server and "
                                     "not finished (running, waiting, or about to be added).")
        self.kv_blocks_total = self._gauge("tripath:kv_cache_blocks_total", "Usable KV-cache blocks.")
        self.kv_blocks_used = self._gauge("tripath:kv_cache_blocks_used", "KV-cache blocks held by requests.")
        self.steps = self._counter("tripath:engine_steps", "Engine steps since start.")
        self.step_failures = self._counter("tripath:engine_step_failures", "Engine steps that raised.")
        rejected = Counter("tripath:requests_rejected", "Requests refused by the server or the engine, by reason.",
                           [*LABELS, "reason"], registry=self.registry)
        self.rejected = _ByReason(rejected, self._labels)
        self.tokens_per_s = self._gauge("tripath:generation_tokens_per_second",
                                        f"Generated tokens per second over the last {rate_window_s:g} s.")
        self._window = rate_window_s
        self._recent: deque[tuple[float, int]] = deque()
        self._recent_tokens = 0   # the sum of _recent's counts
        self._last = None   # the EngineStats of the previous observation
        self._groups = threading.Lock()   # PromptGroup counts: a group's requests may end on two threads
        self.num_ended = 0  # engine requests ended, by any cause

    def _gauge(self, name: str, doc: str):
        return Gauge(name, doc, LABELS, registry=self.registry).labels(*self._labels)

    def _counter(self, name: str, doc: str):
        return Counter(name, doc, LABELS, registry=self.registry).labels(*self._labels)

    def _histogram(self, name: str, doc: str, buckets):
        return Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry).labels(*self._labels)

    def _latency(self, name: str, doc: str):
        return self._histogram(f"vllm:{name}", doc, REQUEST_LATENCY_BUCKETS)

    def engine_ready(self, max_model_len: int, cache_config: dict[str, str] | None = None) -> None:
        """Once the engine is built: the token-count histograms, whose buckets go up to ``max_model_len``, and
        ``vllm:cache_config_info`` with ``cache_config``'s labels (:func:`~tripath.server.metrics.startup.cache_config`)."""
        if self.request_prompt_tokens is None:
            buckets = one_two_five_buckets(max_model_len)
            self.request_prompt_tokens = self._histogram("vllm:request_prompt_tokens",
                                                         "Number of prefill tokens processed.", buckets)
            self.request_generation_tokens = self._histogram("vllm:request_generation_tokens",
                                                             "Number of generation tokens processed.", buckets)
            self.request_max_tokens = self._histogram("vllm:request_params_max_tokens",
                                                      "Histogram of the max_tokens request parameter.", buckets)
            self.max_generation_tokens = self._histogram(
                "vllm:request_max_num_generation_tokens",
                "Histogram of maximum number of requested generation tokens.", buckets)
        if cache_config is not None and not self._cache_config_set:
            self._cache_config_set = True
            info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                         [*cache_config, "engine"], registry=self.registry)
            info.labels(**cache_config, engine="0").set(1)

    def observe_engine(self, stats, num_new_tokens: int = 0) -> None:
        """After a step: the engine's :class:`~tripath.engine.scheduling.stats.EngineStats` and the tokens it
        generated."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.kv_blocks_total.set(stats.num_kv_blocks_total)
        self.kv_blocks_used.set(stats.num_kv_blocks_used)
        self.iteration_tokens.update(stats.step_token_counts, stats.step_tokens_sum)
        last = self._last
        for counter, name in ((self.prefix_queries, "prefix_cache_queried_tokens"),
                              (self.prefix_hits, "prefix_cache_hit_tokens"), (self.preemptions, "num_preemptions"),
                              (self.steps, "num_steps"), (self.spec_drafts, "spec_num_drafts"),
                              (self.spec_draft_tokens, "spec_num_draft_tokens"),
                              (self.spec_accepted_tokens, "spec_num_accepted_tokens")):
            grown = getattr(stats, name) - (getattr(last, name) if last is not None else 0)
            if grown > 0:
                counter.inc(grown)
        before = last.spec_accepted_per_position if last is not None else ()
        for position, count in enumerate(stats.spec_accepted_per_position):
            grown = count - (before[position] if position < len(before) else 0)
            if grown > 0:
                self._spec_per_position.labels(*self._labels, str(position)).inc(grown)
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

    def observe_end(self, times: ChoiceTimes | None, reason: str, now: float, group: PromptGroup | None = None) -> None:
        """A request ended at ``now`` (``reason``: one of :data:`FINISH_REASONS`; ``times`` None: the engine never
        accepted it, nothing is observed but its part of ``group``)."""
        if times is not None:
            self._observe_request(times, reason, now)
        self._settle(group, times)

    def observe_refused(self, group: PromptGroup | None) -> None:
        """The engine refused a request (it never ran): its part of ``group``."""
        self._settle(group, None)

    def _observe_request(self, times: ChoiceTimes, reason: str, now: float) -> None:
        self.num_ended += 1
        self.request_success.labels(reason).inc()
        self.e2e.observe(now - times.arrival)
        if self.request_prompt_tokens is not None:
            self.request_prompt_tokens.observe(times.num_prompt_tokens)
            self.request_generation_tokens.observe(times.num_generated)
            self.request_max_tokens.observe(times.max_tokens)
        if times.first_token is None:
            return
        decode = times.last_token - times.first_token
        self.decode_time.observe(decode)
        if times.num_generated > 1:
            self.tpot.observe(decode / (times.num_generated - 1))
        if times.prefill_time is not None:
            self.queue_time.observe(times.queue_time)
            self.prefill_time.observe(times.prefill_time)
            self.inference_time.observe(times.prefill_time + decode)

    def _settle(self, group: PromptGroup | None, times: ChoiceTimes | None) -> None:
        if group is None:
            return
        with self._groups:
            group.settled += 1
            if times is not None:
                group.ran = True
                group.max_generated = max(group.max_generated, times.num_generated)
            done = group.settled == group.size and group.ran
        if done:
            self.request_n.observe(group.n)
            if self.max_generation_tokens is not None:
                self.max_generation_tokens.observe(group.max_generated)

    def families(self) -> list:
        """The registry's families, vLLM's under their ``vllm:`` names (what API servers exchange)."""
        return list(self.registry.collect())

    def render(self) -> bytes:
        return render(self.families(), self.names)
