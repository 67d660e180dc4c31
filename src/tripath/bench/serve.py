"""``tripath bench serve``: whole requests through the engine, per backend, against the roofline floor.

Offline mode (default): each backend runs in its own process (:mod:`tripath.bench.serve_engine`), with an
empty Triton cache unless ``--warm-cache``; the process builds the engine (timed: *engine start*, warm-up
included), then runs the workload ``--passes`` times (default 2) on fresh prompts of the same shapes (the
*first pass*, then warm passes, of which the median is reported as *the warm pass*), keeping at most
``--max-concurrency`` requests in flight. A second process then times the engine start again on the now
warm cache. With ``--rounds R`` the backends' processes run ``R`` times in turn and the round of median warm
pass is reported, with every round's warm pass (:mod:`tripath.bench.serve_rounds`). Reported per backend:
both starts, the first and the warm pass's wall time (and every warm pass's), output and total tok/s, TTFT /
TPOT / ITL / end-to-end latency (mean, p50, p90, p99, :mod:`tripath.bench.serve_report`), kernel variants
compiled after the engine started, the first and the warm pass's garbage collections, and the warm pass's
fraction of the roofline floor (:mod:`tripath.bench.serve_floor`).

``--url`` switches to the online mode against a running ``tripath serve`` (:mod:`tripath.bench.serve_url`).
Built-in workloads (``--workload``): see :data:`tripath.bench.serve_workloads.WORKLOADS`; explicit options
override their fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from tripath.bench.serve_engine import main_worker
from tripath.bench.serve_report import write_csv, write_json
from tripath.bench.serve_rounds import plot, print_report, rows_of, run_rounds
from tripath.bench.serve_workloads import WORKLOADS, workload_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tripath bench serve", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="mha-tp8", help=f"built-in workload: {', '.join(WORKLOADS)}")
    parser.add_argument("--model", help="preset name or Hugging Face directory (overrides the workload's)")
    parser.add_argument("--backends", help="comma-separated backends (default: the workload's)")
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--input-len", type=int)
    parser.add_argument("--input-len-spread", type=float, help="± fraction of --input-len, uniform")
    parser.add_argument("--output-len", type=int)
    parser.add_argument("--max-concurrency", type=int)
    parser.add_argument("--prefix-share", type=float, help="fraction of each prompt shared by all requests")
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--logprobs", type=int, help="top log-probabilities per token for the requests that ask")
    parser.add_argument("--logprobs-fraction", type=float,
                        help="share of the requests asking for --logprobs (evenly spread; default 1 with --logprobs)")
    parser.add_argument("--passes", type=int, default=2,
                        help="passes per backend: the first, then warm ones (reported: their median)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every backend's process this many times, in turn (A B A B …), and report the "
                             "round of median warm pass: a host whose speed drifts then weighs on every backend "
                             "alike (later rounds reuse the backend's Triton cache)")
    parser.add_argument("--warm-cache", action="store_true",
                        help="use the current Triton cache instead of an empty one per backend")
    parser.add_argument("--device")
    parser.add_argument("--dtype")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="shard the model over N GPUs (compare TP 1 and TP 2 on the same workload)")
    parser.add_argument("--json", help="write the results as JSON")
    parser.add_argument("--csv", help="write one CSV row per backend")
    parser.add_argument("--plot", help="write a PNG of output tok/s per backend")
    parser.add_argument("--no-async-scheduling", action="store_true",
                        help="read each step's tokens before scheduling the next (default: overlap them)")
    parser.add_argument("--decode-steps", type=int, default=8,
                        help="model steps a step of decodes alone runs on the device (multi-step decoding; 1: off)")
    parser.add_argument("--no-mixed-cuda-graphs", action="store_true",
                        help="run steps with prompt tokens eagerly (default: CUDA graphs, piecewise around "
                             "attention, or of whole steps for the mixed backend)")
    parser.add_argument("--skinny-gemms", choices=["auto", "off"],
                        help="the engine's skinny_gemms (default: the engine's): route few-row projections to "
                             "the split-K Triton GEMM where it times faster than cuBLAS at start")
    parser.add_argument("--step-breakdown", action="store_true",
                        help="per kind of step of the warm pass: host time inside the launch and GPU span (one rank)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--profile", help="append each backend's host profile (cProfile) of one extra, unreported "
                                              "pass here")
    return parser


def main_serve(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return main_worker(argv[1:])
    if any(a == "--url" or a.startswith("--url=") for a in argv):
        from tripath.bench.serve_url import main_online
        return main_online(argv)
    args = build_parser().parse_args(argv)
    if args.passes < 1:
        raise SystemExit("tripath bench serve: --passes must be >= 1")
    if args.rounds < 1:
        raise SystemExit("tripath bench serve: --rounds must be >= 1")
    if args.decode_steps < 1:
        raise SystemExit("tripath bench serve: --decode-steps must be >= 1")
    workload = workload_from_args(args)
    import torch

    args.device_is_gpu = args.device != "cpu" and torch.cuda.is_available()
    results = run_rounds(workload, args.workload, args)
    rows = rows_of(results, args.workload)
    print_report(workload, args.workload, results, rows)
    if args.json:
        write_json(args.json, {"workload": {"name": args.workload, **dataclasses.asdict(workload)},
                               "results": results, "rows": rows})
    if args.csv:
        write_csv(args.csv, rows)
    if args.plot:
        plot(rows, args.plot)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main_serve())
