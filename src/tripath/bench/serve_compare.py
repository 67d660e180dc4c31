"""``tripath bench serve --url URL --workload NAME``: an offline workload through a running server, reported as
the offline mode reports it, so that one command pair measures what the server costs::

    tripath bench serve --workload llama-8b --backends three_path --num-requests 256 --max-concurrency 256 \\
        --warm-cache --json offline.json
    tripath serve llama-3.1-8b --backend three_path --max-num-seqs 256 --max-model-len 1792 &
    tripath bench serve --url http://127.0.0.1:8000 --workload llama-8b --num-requests 256 --max-concurrency 256 \\
        --against offline.json

Each pass sends the prompts the offline mode's pass of the same index runs (``make_prompts(workload, vocab,
seed + pass)``: the same lengths and tokens, given the server's vocabulary), greedy, ``ignore_eos``, streamed,
all at once but at most ``max_concurrency`` in flight (the offline mode's ``max_num_seqs``); the first pass,
then warm ones, of which the median is reported (``--passes``, as offline). ``--against`` prints the offline
mode's row (its ``--json``) beside and the ratios the server is held to: output tok/s, and the server's TTFT
p50 against the offline mean TTFT.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys

from tripath.bench.serve_workloads import workload_from_args
from tripath.bench.serve_clients import ClientPool, default_client_processes, measured_run
from tripath.bench.serve_online import Workload as Requests
from tripath.bench.serve_online import served_model
from tripath.bench.serve_report import format_table, summarize, write_csv, write_json
from tripath.bench.serve_rounds import median_pass
from tripath.bench.serve_workloads import Workload, make_prompts

ONLINE_FIELDS = ("num_requests", "input_len", "input_len_spread", "output_len", "max_concurrency")
TABLE = [("backend", "run"), ("num_failed", "failed"), ("first_pass_s", "1st pass s"), ("warm_pass_s", "warm pass s"),
         ("output_throughput", "out tok/s"), ("total_throughput", "total tok/s"), ("ttft_s.mean", "TTFT mean"),
         ("ttft_s.p50", "p50"), ("ttft_s.p99", "p99"), ("server_ttft_mean_s", "server TTFT mean"),
         ("tpot_s.mean", "TPOT mean"), ("tpot_s.p50", "p50"),
         ("tpot_s.p99", "p99")]
SHAPE = ("num_requests", "input_len", "input_len_spread", "output_len", "max_concurrency", "prefix_share")


def run_passes(args, workload: Workload, model: str, vocab: int) -> list[dict]:
    """``args.passes`` passes of ``workload`` through the server (``args.client_processes`` client processes);
    each pass's report, with the server's own mean TTFT (``server_ttft_mean_s``, from its ``/metrics``)."""
    extras = [{"logprobs": workload.logprobs} if workload.asks_logprobs(i) else {}
              for i in range(workload.num_requests)]
    processes = args.client_processes or default_client_processes(workload.max_concurrency, workload.num_requests)
    passes = []
    with ClientPool(processes) as pool:
        for index in range(args.passes):
            requests = Requests(make_prompts(workload, vocab, args.seed + index), workload.output_len)
            records, elapsed, server_ttft = measured_run(pool, args.url, model, requests, math.inf,
                                                         workload.max_concurrency, args.seed, args.temperature, extras)
            report = summarize(records, elapsed)
            report["server_ttft_mean_s"] = server_ttft
            report["client_processes"] = processes
            report["errors"] = sorted({r.error for r in records if not r.ok})[:10]
            passes.append(report)
            print(f"pass {index + 1} of {args.passes}: {report['num_requests'] - report['num_failed']}/"
                  f"{report['num_requests']} ok in {elapsed:.2f} s ({processes} client processes)", file=sys.stderr)
    return passes


def server_row(workload_name: str, model: str, passes: list[dict]) -> dict:
    """The offline mode's row shape (:func:`tripath.bench.serve_rounds.rows_of`) for the server's passes."""
    first, warm = passes[0], median_pass(passes[1:] or passes)
    return {"workload": workload_name, "backend": f"server ({model})", "mode": "online",
            "num_failed": sum(p["num_failed"] for p in passes), "first_pass_s": first["elapsed_s"],
            "warm_pass_s": warm["elapsed_s"], "warm_passes_s": [p["elapsed_s"] for p in passes[1:]],
            **{key: warm[key] for key in ("output_throughput", "total_throughput", "ttft_s", "tpot_s", "itl_s",
                                          "e2e_s", "server_ttft_mean_s")}}


def offline_row(path: str, backend: str | None, workload: Workload) -> tuple[dict, list[str]]:
    """The row of ``backend`` (default: the first) in the offline mode's JSON, and how its workload differs."""
    with open(path) as f:
        data = json.load(f)
    rows = [r for r in data.get("rows", []) if "error" not in r]
    picked = next((r for r in rows if backend in (None, r.get("backend"))), None)
    if picked is None:
        raise ValueError(f"{path} has no {'row' if backend is None else f'row of backend {backend!r}'} without "
                         "an error")
    theirs = data.get("workload", {})
    differences = [f"{key} {theirs.get(key)} offline, {getattr(workload, key)} here" for key in SHAPE
                   if key in theirs and theirs[key] != getattr(workload, key)]
    return {**picked, "backend": f"offline ({picked['backend']})"}, differences


def ratios(server: dict, offline: dict) -> str:
    """The server's output tok/s over the offline mode's, and its TTFT p50 over the offline mean TTFT."""
    throughput = server["output_throughput"] / offline["output_throughput"]
    ttft = server["ttft_s"]["p50"] / offline["ttft_s"]["mean"]
    return (f"server / offline: output tok/s {throughput:.3f}x; TTFT p50 {server['ttft_s']['p50']:.3f} s against "
            f"the offline mean {offline['ttft_s']['mean']:.3f} s: {ttft:.3f}x")


def main_workload(args, parser) -> int:
    """``--url`` with ``--workload``; the exit status (1 if a request failed)."""
    if args.passes < 1:
        parser.error(f"--passes must be >= 1, got {args.passes}")
    workload = workload_from_args(args, ONLINE_FIELDS)
    try:
        model, vocab = served_model(args)
        against = offline_row(args.against, args.backend, workload) if args.against else None
    except Exception as error:  # noqa: BLE001 - unreachable server, unreadable offline report
        print(f"tripath bench serve: error: {error}", file=sys.stderr)
        return 2
    passes = run_passes(args, workload, model, vocab)
    row = server_row(args.workload, model, passes)
    rows = [row] + ([against[0]] if against else [])
    print(f"\n{workload.description or args.workload} through {args.url}")
    print(format_table(rows, TABLE))
    if against:
        for difference in against[1]:
            print(f"note: the offline run's workload differs: {difference}")
        print(ratios(row, against[0]))
    for report in passes:
        for error in report["errors"]:
            print(f"failure: {error}", file=sys.stderr)
    if args.json:
        write_json(args.json, {"workload": {"name": args.workload, **dataclasses.asdict(workload)}, "passes": passes,
                               "rows": rows})
    if args.csv:
        write_csv(args.csv, rows)
    return 1 if row["num_failed"] else 0
