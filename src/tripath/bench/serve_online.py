"""The online benchmark's client side: a workload of random-token prompts, their Poisson arrival times, and
one run of them streamed from a server's ``/v1/completions`` (:func:`run_benchmark`), each request's times
as a :class:`~tripath.bench.serve_report.RequestRecord`. The command line (``tripath bench serve --url``) is
:mod:`tripath.bench.serve_url`; several client processes: :mod:`tripath.bench.serve_clients`.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass
from typing import Sequence

from tripath.bench.serve_report import RequestRecord

JSON_HEADERS = {"content-type": "application/json"}
READ_BUFFER_BYTES = 1 << 22   # the longest event line the client reads (a lagging stream's, with log-probabilities)


@dataclass
class Workload:
    prompts: list[list[int]]
    output_len: int


def make_workload(num_requests: int, input_len: int, spread: float, output_len: int, vocab_size: int,
                  seed: int) -> Workload:
    """``num_requests`` prompts of random token ids in ``[0, vocab_size)``, lengths uniform in
    ``input_len * (1 ± spread)`` (at least 1)."""
    if num_requests < 1 or input_len < 1 or output_len < 1:
        raise ValueError(f"num_requests, input_len and output_len must be >= 1, got {num_requests}, {input_len}, "
                         f"{output_len}")
    if not 0 <= spread < 1:
        raise ValueError(f"input_len_spread must be in [0, 1), got {spread}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    rng = random.Random(seed)
    low, high = max(1, round(input_len * (1 - spread))), max(1, round(input_len * (1 + spread)))
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(low, high))] for _ in range(num_requests)]
    return Workload(prompts, output_len)


def arrival_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Start times (s from the start): a Poisson process of ``rate`` per second, all 0 for an infinite rate."""
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (inf: all at once), got {rate}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def _one(client, url: str, body: bytes, prompt_tokens: int) -> RequestRecord:
    start = time.perf_counter()
    ttft, last, gaps, tokens = None, None, [], 0
    try:
        async with client.post(url, data=body, headers=JSON_HEADERS) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                return RequestRecord(prompt_tokens, 0, None, time.perf_counter() - start, [], ok=False,
                                     error=f"HTTP {response.status}: {text[:200]}")
            usage = None
            async for line in response.content:   # read to the body's end: the connection is kept for the next
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    continue
                event = json.loads(data)
                if "error" in event:
                    return RequestRecord(prompt_tokens, tokens, ttft, time.perf_counter() - start, gaps, ok=False,
                                         error=str(event["error"].get("message")))
                if event.get("usage"):
                    usage = event["usage"]
                n = sum(len(c.get("token_ids") or ()) or bool(c.get("text")) for c in event.get("choices", ()))
                if n:
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - start
                    else:
                        gaps.append(now - last)
                    last = now
                    tokens += n
            if usage is not None:
                tokens = int(usage["completion_tokens"])
    except Exception as error:  # noqa: BLE001 - a failed request is a data point, not the benchmark's end
        return RequestRecord(prompt_tokens, tokens, ttft, time.perf_counter() - start, gaps, ok=False,
                             error=f"{type(error).__name__}: {error}")
    return RequestRecord(prompt_tokens, tokens, ttft, time.perf_counter() - start, gaps)


async def run_benchmark(base_url: str, model: str, workload: Workload, rate: float, max_concurrency: int | None,
                        seed: int, temperature: float = 0.0, extras: Sequence[dict] | None = None, *,
                        offsets: Sequence[float] | None = None, start_at: float | None = None
                        ) -> tuple[list[RequestRecord], float]:
    """Send the workload; returns each request's record and the wall time from the start to the last finish.
    ``extras[i]``: more body fields of request ``i``; ``offsets``: the requests' start times (s from the
    start; default: :func:`arrival_offsets` of ``rate``); ``start_at``: when to start (``time.time()``; default
    now), so that several client processes (:mod:`tripath.bench.serve_clients`) start together. The bodies are
    JSON-encoded before the clock starts: encoding a prompt of thousands of token ids is the client's work,
    not the server's, and would otherwise count in every request's TTFT.

    The client is aiohttp (as vLLM's benchmark's), its connections kept alive: httpx's asynchronous client,
    opening a connection per request, added its own delay to the TTFT it measured (the requests of one
    client process reached the server one after the other), and reusing its connections held some requests
    back (docs/BENCHMARKS.md, "Measurements behind the code's choices")."""
    import aiohttp

    url = base_url.rstrip("/") + "/v1/completions"
    offsets = arrival_offsets(len(workload.prompts), rate, seed) if offsets is None else offsets
    bodies = [json.dumps({"model": model, "prompt": prompt, "max_tokens": workload.output_len,
                          "temperature": temperature, "ignore_eos": True, "stream": True,
                          "stream_options": {"include_usage": True},
                          **(extras[index] if extras is not None else {})}).encode()
              for index, prompt in enumerate(workload.prompts)]
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connections = max_concurrency or len(workload.prompts)
    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                     read_bufsize=READ_BUFFER_BYTES) as client:
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        start = time.perf_counter()

        async def launch(index, prompt, offset):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is None:
                return await _one(client, url, bodies[index], len(prompt))
            async with limit:
                return await _one(client, url, bodies[index], len(prompt))

        records = await asyncio.gather(*(launch(i, p, o) for i, (p, o) in enumerate(zip(workload.prompts, offsets))))
        elapsed = time.perf_counter() - start
    return list(records), elapsed


def server_model(base_url: str) -> dict:
    import httpx

    response = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30)
    response.raise_for_status()
    data = response.json()["data"]
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return data[0]


def served_model(args) -> tuple[str, int]:
    """The model name to send and the vocabulary to draw prompts from: ``--model`` / ``--vocab-size``, else the
    server's first model and its ``vocab_size``."""
    card = server_model(args.url)
    vocab = args.vocab_size or card.get("vocab_size")
    if not vocab:
        raise ValueError("the server does not report vocab_size: pass --vocab-size")
    return args.model or card["id"], int(vocab)
