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
import math
import sys
from typing import Sequence

from tripath.bench.serve_clients import ClientPool, default_client_processes, measured_run
from tripath.bench.serve_compare import main_workload
from tripath.bench.serve_online import make_workload, served_model
from tripath.bench.serve_report import RequestRecord, format_table, summarize, write_csv, write_json

TABLE = [("request_rate", "rate (req/s)"), ("max_concurrency", "max conc."), ("num_requests", "requests"),
         ("num_failed", "failed"), ("request_throughput", "req/s"), ("output_throughput", "out tok/s"),
         ("ttft_s.mean", "TTFT mean (s)"), ("ttft_s.p99", "TTFT p99 (s)"),
         ("server_ttft_mean_s", "server TTFT mean (s)"), ("tpot_s.mean", "TPOT mean (s)"),
         ("itl_s.p50", "ITL p50 (s)"), ("itl_s.p99", "ITL p99 (s)"), ("e2e_s.p50", "e2e p50 (s)"),
         ("e2e_s.p99", "e2e p99 (s)")]


PLAIN_DEFAULTS = {"num_requests": 200, "input_len": 256, "input_len_spread": 0.0, "output_len": 64}


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
