"""The periodic engine stats line of ``tripath serve``, as vLLM logs it (logger ``tripath.server``)::

    Engine 000: Avg prompt throughput: 512.0 tokens/s, Avg generation throughput: 1870.3 tokens/s,
    Running: 12 reqs, Waiting: 0 reqs, GPU KV cache usage: 23.4%, Prefix cache hit rate: 41.0%

every ``--log-stats-interval`` seconds (default 10; ``--disable-log-stats``: none). The line is read from the
server's metrics (:mod:`~tripath.server.metrics.metrics`; with several API servers, the merged ones of
:mod:`~tripath.server.processes.metrics_peers`, and only API server 0 logs it), so it agrees with ``/metrics``:
throughputs are the growth of ``prompt_tokens_total`` (prompt tokens of requests that had their first token)
and ``generation_tokens_total`` over the interval, divided by its length; ``Preemptions: N`` is added when
the interval had some; the prefix cache hit rate is over the prompt tokens looked up during the interval (over
all since start when none were). The line is INFO while there is activity — tokens in the interval, requests
running or waiting — and for one interval after it, DEBUG otherwise (an idle server does not fill its log).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

log = logging.getLogger("tripath.server")

_COUNTERS = {"prompt": "vllm:prompt_tokens_total", "generation": "vllm:generation_tokens_total",
             "queries": "vllm:prefix_cache_queries_total", "hits": "vllm:prefix_cache_hits_total",
             "preemptions": "vllm:num_preemptions_total"}
_GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
           "kv_usage": "vllm:kv_cache_usage_perc"}
_NAMES = {sample: key for key, sample in (*_COUNTERS.items(), *_GAUGES.items())}


def totals(families) -> dict[str, float]:
    """The values the line needs from metric families (under their ``vllm:`` names), each summed over its
    samples (one per label set)."""
    out = dict.fromkeys(_NAMES.values(), 0.0)
    for family in families:
        for sample in family.samples:
            key = _NAMES.get(sample.name)
            if key is not None:
                out[key] += sample.value
    return out


class StatsLine:
    """Successive snapshots of the metrics in, vLLM's line out (:meth:`update`)."""

    def __init__(self):
        self._last: dict[str, float] | None = None
        self._last_at = 0.0
        self._was_active = False

    def update(self, families, now: float) -> tuple[int, str] | None:
        """The line for the interval since the previous call (``now``: ``time.monotonic()``) and its log level;
        None on the first call, which only sets the start."""
        values, last, elapsed = totals(families), self._last, now - self._last_at
        self._last, self._last_at = values, now
        if last is None or elapsed <= 0:
            return None
        grown = {key: values[key] - last[key] for key in _COUNTERS}
        queries, hits = (grown["queries"], grown["hits"]) if grown["queries"] > 0 else (values["queries"],
                                                                                         values["hits"])
        parts = [f"Avg prompt throughput: {grown['prompt'] / elapsed:.1f} tokens/s",
                 f"Avg generation throughput: {grown['generation'] / elapsed:.1f} tokens/s",
                 f"Running: {values['running']:.0f} reqs", f"Waiting: {values['waiting']:.0f} reqs"]
        if grown["preemptions"] > 0:
            parts.append(f"Preemptions: {grown['preemptions']:.0f}")
        parts += [f"GPU KV cache usage: {values['kv_usage'] * 100:.1f}%",
                  f"Prefix cache hit rate: {hits / queries * 100 if queries > 0 else 0.0:.1f}%"]
        active = grown["prompt"] > 0 or grown["generation"] > 0 or values["running"] > 0 or values["waiting"] > 0
        level = logging.INFO if active or self._was_active else logging.DEBUG
        self._was_active = active
        return level, "Engine 000: " + ", ".join(parts)


async def log_engine_stats(interval_s: float, families: Callable[[], Awaitable[list]]) -> None:
    """Log the line every ``interval_s`` seconds, from ``await families()`` (the server's metric families),
    until cancelled."""
    line = StatsLine()
    line.update(await families(), time.monotonic())
    while True:
        await asyncio.sleep(interval_s)
        try:
            got = line.update(await families(), time.monotonic())
        except Exception:  # noqa: BLE001 - a failed read costs one line, not the server's stats for good
            log.exception("reading the metrics for the stats line failed")
            continue
        if got is not None:
            log.log(*got)
