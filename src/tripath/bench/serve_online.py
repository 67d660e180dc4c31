"""``tripath bench serve --url``: the online serving benchmark against a running OpenAI-compatible server.

    tripath bench serve --url http://127.0.0.1:8000 --num-requests 200 --input-len 512 --output-len 128 \\
        --request-rate 1,4,inf --json serve.json
    tripath bench serve --url http://127.0.0.1:8000 --workload llama-8b --against offline.json   # the server's cost

Prompts are random token ids (seeded; lengths ``--input-len`` ± ``--input-len-spread`` as a fraction), each
asking for exactly ``--output-len`` tokens (``ignore_eos``), streamed from ``/v1/completions``. Requests start
at a Poisson rate (``--request-rate`` per second; ``inf`` sends them all at once), optionally capped at
``--max-concurrency`` in flight (over ``--client-processes`` client processes:
:mod:`tripath.bench.serve_clients`); a list of rates runs one benchmark per rate. The client measures TTFT (until
the first streamed token), the gaps between streamed tokens (ITL), TPOT and end-to-end latency per request,
and the report (:mod:`tripath.bench.serve_report`) gives their mean / p50 / p90 / p99, request and token
throughput, and failures. ``--workload`` sends an offline workload's requests instead, pass by pass, and
reports them as the offline mode does (:mod:`tripath.bench.serve_compare`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from typing import Sequence

from tripath.bench.serve_report import RequestRecord, format_table, summarize, write_csv, write_json

TABLE = [("request_rate", "rate (req/s)"), ("max_concurrency", "max conc."), ("num_requests", "requests"),
         ("num_failed", "failed"), ("request_throughput", "req/s"), ("output_throughput", "out tok/s"),
         ("ttft_s.mean", "TTFT mean (s)"), ("ttft_s.p99", "TTFT p99 (s)"),
         ("server_ttft_mean_s", "server TTFT mean (s)"), ("tpot_s.mean", "TPOT mean (s)"),
         ("itl_s.p50", "ITL p50 (s)"), ("itl_s.p99", "ITL p99 (s)"), ("e2e_s.p50", "e2e p50 (s)"),
         ("e2e_s.p99", "e2e p99 (s)")]


JSON_HEADERS = {"content-type": "application/json"}
READ_BUFFER_BYTES = 1 << 22   # the longest event line the client reads (a lagging stream's, with log-probabilities)
PLAIN_DEFAULTS = {"num_requests": 200, "input_len": 256, "input_len_spread": 0.0, "output_len": 64}


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

    The client is aiohttp (as vLLM's benchmark's), its connections kept alive: on 64 streams of the TP-8
    shape httpx's asynchronous client, opening a connection per request, added about 40 ms to the TTFT
    it measured (the requests of one client process reached the server one after the other), and reusing
    its connections held some requests back by seconds."""
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


def _rates(text: str) -> list[float]:
    try:
        rates = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected request rates such as 1,4,inf, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"request rates must be > 0 (inf: all at once), got {text!r}")
    return rates


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tripath bench serve", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="prompt tokens are drawn from [0, V) (default: the server's vocab_size)")
    parser.add_argument("--workload", default=None,
                        help="a built-in workload of the offline mode (its prompts, passes and report; "
                             "--against compares with the offline mode's --json): see tripath.bench.serve_compare")
    parser.add_argument("--num-requests", type=int, default=None, help="default: 200, or the workload's")
    parser.add_argument("--input-len", type=int, default=None, help="default: 256, or the workload's")
    parser.add_argument("--input-len-spread", type=float, default=None,
                        help="prompt lengths vary by ± this fraction (default: 0, or the workload's)")
    parser.add_argument("--output-len", type=int, default=None, help="default: 64, or the workload's")
    parser.add_argument("--request-rate", type=_rates, default=[math.inf],
                        help="requests per second, Poisson; a comma list runs each; inf = all at once (default; "
                             "always with --workload, as the offline mode)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="at most this many requests in flight (default: no limit, or the workload's)")
    parser.add_argument("--passes", type=int, default=2,
                        help="with --workload: passes on fresh prompts, the first, then warm ones (reported: "
                             "their median), as the offline mode")
    parser.add_argument("--against", default=None,
                        help="with --workload: the offline mode's --json of the same workload, shown beside")
    parser.add_argument("--backend", default=None,
                        help="with --against: the offline row to compare (default: the first)")
    parser.add_argument("--client-processes", type=int, default=None,
                        help="spread the requests over this many client processes, so that the client is not "
                             "what is measured (default: one per 8 streams in flight, at most half the CPUs)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the reports (a list, one per rate) to this file")
    parser.add_argument("--csv", default=None, help="write the reports as CSV rows to this file")
    return parser


def main_online(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tripath bench serve --url ...``; returns the exit status (1 if any request failed)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.client_processes is not None and args.client_processes < 1:
        parser.error(f"--client-processes must be >= 1, got {args.client_processes}")
    if args.workload is not None:
        from tripath.bench.serve_compare import main_workload
        return main_workload(args, parser)
    for name, default in PLAIN_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    try:
        model, vocab = served_model(args)
        workload = make_workload(args.num_requests, args.input_len, args.input_len_spread, args.output_len, vocab,
                                 args.seed)
    except Exception as error:  # noqa: BLE001 - unreachable server, bad arguments
        print(f"tripath bench serve: error: {error}", file=sys.stderr)
        return 2
    from tripath.bench.serve_clients import ClientPool, default_client_processes, measured_run

    processes = args.client_processes or default_client_processes(args.max_concurrency, args.num_requests)
    reports = []
    with ClientPool(processes) as pool:
        for rate in args.request_rate:
            records, elapsed, server_ttft = measured_run(pool, args.url, model, workload, rate, args.max_concurrency,
                                                         args.seed, args.temperature)
            reports.append(_rate_report(args, model, rate, processes, records, elapsed, server_ttft))
    print(format_table(reports, TABLE))
    for report in reports:
        for error in report["errors"]:
            print(f"failure at rate {report['request_rate']}: {error}", file=sys.stderr)
    if args.json:
        write_json(args.json, reports)
    if args.csv:
        write_csv(args.csv, [{k: v for k, v in r.items() if k != "errors"} for r in reports])
    return 1 if any(r["num_failed"] for r in reports) else 0


def _rate_report(args, model: str, rate: float, processes: int, records: list[RequestRecord], elapsed: float,
                 server_ttft: float | None) -> dict:
    report = {"mode": "online", "url": args.url, "model": model, "request_rate": rate if math.isfinite(rate) else "inf",
              "max_concurrency": args.max_concurrency, "input_len": args.input_len,
              "input_len_spread": args.input_len_spread, "output_len": args.output_len, "seed": args.seed,
              "client_processes": processes, **summarize(records, elapsed), "server_ttft_mean_s": server_ttft}
    report["errors"] = sorted({r.error for r in records if not r.ok})[:10]
    print(f"rate {rate:g} req/s: {report['num_requests'] - report['num_failed']}/{report['num_requests']} ok in "
          f"{elapsed:.2f} s", file=sys.stderr)
    return report
