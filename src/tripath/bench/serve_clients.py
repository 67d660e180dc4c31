"""The online benchmark's client spread over processes (``tripath bench serve --url --client-processes N``),
so that a run measures the server and not the client.

One Python process streaming from many connections is itself a bottleneck: at 64 streams of about one event
every 7 ms each (9,000 events a second) its event loop delays every event it reads, and both the TTFT and
the throughput it reports include that delay. :class:`ClientPool` splits the requests round-robin over ``N``
spawned processes — request ``i`` goes to process ``i % N`` with its own arrival offset, and each process
holds its share of ``--max-concurrency`` (``C // N``, the first ``C % N`` one more) — starts them at one
wall-clock instant and merges their records in request order. The pass's wall time is the latest process's,
from that common start.

:func:`server_ttft_totals` reads the server's own TTFT histogram (``/metrics``: tripath's or vLLM's name), so a
report can set the server's TTFT, from arrival at the server, beside the client's.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Sequence

from tripath.bench.serve_online import Workload, arrival_offsets, run_benchmark
from tripath.bench.serve_report import RequestRecord

STREAMS_PER_PROCESS = 8
START_MARGIN_S = 0.25   # the processes are told to start this far ahead of the moment they are sent the work
TTFT_METRICS = ("vllm:time_to_first_token_seconds", "tripath:time_to_first_token_seconds")   # the first served


def default_client_processes(max_concurrency: int | None, num_requests: int) -> int:
    """One process per :data:`STREAMS_PER_PROCESS` streams in flight, at most half the CPUs (the server and
    its engine run beside the client)."""
    streams = max_concurrency or num_requests
    return max(1, min((os.cpu_count() or 2) // 2, math.ceil(streams / STREAMS_PER_PROCESS)))


def _run_share(base_url: str, model: str, prompts: list[list[int]], output_len: int, offsets: list[float],
               max_concurrency: int | None, seed: int, temperature: float, extras: list[dict] | None,
               start_at: float) -> tuple[list[RequestRecord], float]:
    return asyncio.run(run_benchmark(base_url, model, Workload(prompts, output_len), math.inf, max_concurrency, seed,
                                     temperature, extras, offsets=offsets, start_at=start_at))


def _ready(_: int) -> None:
    time.sleep(0.1)   # long enough that every process takes one of these


class ClientPool:
    """``processes`` client processes, reused across runs (``with ClientPool(n) as pool: pool.run(...)``);
    with one process, runs in this one."""

    def __init__(self, processes: int):
        if processes < 1:
            raise ValueError(f"client processes must be >= 1, got {processes}")
        self.processes = processes
        self._executor = None

    def __enter__(self) -> "ClientPool":
        if self.processes > 1:
            self._executor = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"))
            list(self._executor.map(_ready, range(self.processes)))   # spawned and imported before any run
        return self

    def __exit__(self, *exc) -> None:
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None

    def run(self, base_url: str, model: str, workload: Workload, rate: float, max_concurrency: int | None, seed: int,
            temperature: float = 0.0, extras: Sequence[dict] | None = None) -> tuple[list[RequestRecord], float]:
        """As :func:`~tripath.bench.serve_online.run_benchmark`, over the pool's processes."""
        n = len(workload.prompts)
        shares = min(self.processes, n, max_concurrency or n)
        if self._executor is None or shares == 1:
            return asyncio.run(run_benchmark(base_url, model, workload, rate, max_concurrency, seed, temperature,
                                             extras))
        offsets = arrival_offsets(n, rate, seed)
        start_at = time.time() + START_MARGIN_S
        futures = []
        for k in range(shares):
            index = range(k, n, shares)
            limit = None if max_concurrency is None else max_concurrency // shares + (k < max_concurrency % shares)
            futures.append(self._executor.submit(
                _run_share, base_url, model, [workload.prompts[i] for i in index], workload.output_len,
                [offsets[i] for i in index], limit, seed + k, temperature,
                None if extras is None else [extras[i] for i in index], start_at))
        records: list[RequestRecord | None] = [None] * n
        elapsed = 0.0
        for k, future in enumerate(futures):
            share, share_elapsed = future.result()
            for i, record in zip(range(k, n, shares), share):
                records[i] = record
            elapsed = max(elapsed, share_elapsed)
        return records, elapsed


def server_ttft_totals(base_url: str) -> tuple[float, int] | None:
    """The server's TTFT histogram so far, ``(sum of seconds, count)`` over its label sets, or None when its
    ``/metrics`` has none (or cannot be read)."""
    import httpx

    try:
        from prometheus_client.parser import text_string_to_metric_families
        response = httpx.get(base_url.rstrip("/") + "/metrics", timeout=10)
        response.raise_for_status()
        families = list(text_string_to_metric_families(response.text))
    except (ImportError, httpx.HTTPError, ValueError):   # no parser, no /metrics, not Prometheus text
        return None
    by_name = {f.name: f for f in families}
    name = next((n for n in TTFT_METRICS if n in by_name), None)   # tripath serves both names by default
    if name is None:
        return None
    samples = by_name[name].samples
    return (sum(s.value for s in samples if s.name.endswith("_sum")),
            int(sum(s.value for s in samples if s.name.endswith("_count"))))


def server_ttft_mean(before: tuple[float, int] | None, after: tuple[float, int] | None) -> float | None:
    """The server's mean TTFT between two :func:`server_ttft_totals` readings (None without both)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def measured_run(pool: ClientPool, base_url: str, model: str, workload: Workload, rate: float,
                 max_concurrency: int | None, seed: int, temperature: float = 0.0,
                 extras: Sequence[dict] | None = None) -> tuple[list[RequestRecord], float, float | None]:
    """:meth:`ClientPool.run`, and the server's own mean TTFT over it (None where its ``/metrics`` has none)."""
    before = server_ttft_totals(base_url)
    records, elapsed = pool.run(base_url, model, workload, rate, max_concurrency, seed, temperature, extras)
    return records, elapsed, server_ttft_mean(before, server_ttft_totals(base_url))
