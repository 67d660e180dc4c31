"""Rounds and reports of ``tripath bench serve``'s offline mode.

:func:`run_rounds` runs every backend's process (:func:`tripath.bench.serve_engine.spawn_backend`) ``--rounds``
times in turn (A B A B …), the first round on an empty Triton cache per backend unless ``--warm-cache``,
each backend's start timed again on its now warm cache after its first round: a host whose speed drifts
between processes (the same code slower in one process's host work than in the next: docs/BENCHMARKS.md,
End to end) then weighs on every backend alike. :func:`merge_rounds` reports the round of median warm pass, with every round's warm
pass; :func:`rows_of` makes one row per backend (the warm pass is the median of the passes after the
first, :func:`median_pass`), and :func:`print_report` prints the table, every pass's times
(:func:`format_passes`), the garbage collections and the step breakdowns.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile

from tripath import _env
from tripath.bench.gc_pauses import format_collections
from tripath.bench.serve_engine import spawn_backend
from tripath.bench.serve_report import format_table
from tripath.bench.serve_workloads import Workload
from tripath.bench.step_breakdown import format_breakdown


def run_rounds(workload: Workload, workload_name: str, args) -> list[dict]:
    """Every backend of ``workload`` run ``args.rounds`` times in turn; one merged result per backend
    (:func:`merge_rounds`), in the workload's order. A backend whose round failed is not run again."""
    rounds: dict[str, list[dict]] = {backend: [] for backend in workload.backends}
    with contextlib.ExitStack() as stack:
        caches = {}
        for backend in workload.backends:
            caches[backend] = _env.triton_cache_dir() if args.warm_cache else \
                stack.enter_context(tempfile.TemporaryDirectory(prefix="tripath-triton-"))
        for index in range(args.rounds):
            for backend in workload.backends:
                if rounds[backend] and "error" in rounds[backend][-1]:
                    continue
                empty = index == 0 and not args.warm_cache
                print(f"== {workload_name}: {backend}, round {index + 1} of {args.rounds} "
                      f"({'empty' if empty else 'warm'} Triton cache)", file=sys.stderr, flush=True)
                result = spawn_backend(workload, backend, args, caches[backend], start_only=False)
                if index == 0 and "error" not in result:
                    again = spawn_backend(workload, backend, args, caches[backend], start_only=True)
                    result["warm_start_s"] = again.get("start_s")
                rounds[backend].append(result)
                print(round_line(result), file=sys.stderr, flush=True)   # a run cut short still says this much
    return [merge_rounds(rounds[backend]) for backend in workload.backends]


def round_line(result: dict) -> str:
    """One backend's round in a line, printed as it ends: its starts, every pass, the warm pass's share of
    the floor and what compiled after start (or its error)."""
    if "error" in result:
        return f"   {result['backend']}: {result['error']}"
    passes = result.get("passes", [])
    line = f"   {result['backend']}: start {result.get('start_s', float('nan')):.1f} s"
    notes = [", ".join(f"{phase} {s:.1f} s" for phase, s in (result.get("start_phases") or {}).items())]
    if result.get("warm_start_s") is not None:
        notes.append(f"{result['warm_start_s']:.1f} s on the warm cache")
    if any(notes):
        line += " (" + "; ".join(note for note in notes if note) + ")"
    if passes:
        warm = median_pass(passes[1:] or passes)
        line += "; passes " + " / ".join(f"{p['elapsed_s']:.3f}" for p in passes) + " s"
        if warm.get("floor_fraction") is not None:
            line += f"; warm pass {100 * warm['floor_fraction']:.1f}% of the floor"
        line += f"; {sum(p['compiled_after_start'] for p in passes)} compiled after start"
    return line


def median_pass(passes: list[dict]) -> dict:
    """The pass of median wall time (the slower middle one of an even count): with ``--passes N > 2`` the
    reported warm pass is the median of the N − 1 passes after the first, not the last one alone."""
    return sorted(passes, key=lambda p: p["elapsed_s"])[len(passes) // 2]


def merge_rounds(results: list[dict]) -> dict:
    """One backend's processes of ``--rounds`` (in round order) as one result: the round whose warm pass is
    the median over the rounds (the slower middle one of an even count) with the start times of the first
    round (the only one that can start from an empty cache), ``round_warm_passes_s`` (every round's warm
    pass, in round order) and ``compiled_in_rounds`` (kernel variants compiled after start, every pass of
    every round). A failed round is the result."""
    failed = next((r for r in results if "error" in r), None)
    if failed is not None or len(results) == 1:
        return failed or results[0]
    warm = [median_pass(r["passes"][1:] or r["passes"])["elapsed_s"] for r in results]
    median = sorted(range(len(results)), key=lambda i: warm[i])[len(results) // 2]
    return {**results[median], "start_s": results[0].get("start_s"), "warm_start_s": results[0].get("warm_start_s"),
            "start_phases": results[0].get("start_phases"),
            "round_warm_passes_s": warm,
            "compiled_in_rounds": sum(p["compiled_after_start"] for r in results for p in r.get("passes", []))}


def rows_of(results: list[dict], workload_name: str) -> list[dict]:
    """One table row per backend: starts, first and warm pass, the warm pass's throughputs and latencies
    (``warm_passes_s``: every pass after the first; with ``--rounds``, ``round_warm_passes_s``: every
    round's warm pass, :func:`merge_rounds`)."""
    rows = []
    for r in results:
        label = r["backend"] if r.get("async_scheduling", True) else f"{r['backend']} (sequential)"
        row = {"workload": workload_name, "backend": label}
        if "error" in r:
            rows.append({**row, "error": r["error"]})
            continue
        passes = r.get("passes", [])
        row.update(start_s=r.get("start_s"), warm_start_s=r.get("warm_start_s"))
        if passes:
            first, warm = passes[0], median_pass(passes[1:] or passes)
            row.update(first_pass_s=first["elapsed_s"], warm_pass_s=warm["elapsed_s"],
                       warm_passes_s=[p["elapsed_s"] for p in passes[1:]],
                       output_throughput=warm["output_throughput"], total_throughput=warm["total_throughput"],
                       ttft_s=warm["ttft_s"], tpot_s=warm["tpot_s"], itl_s=warm["itl_s"], e2e_s=warm["e2e_s"],
                       compiled_after_start=r.get("compiled_in_rounds",
                                                  sum(p["compiled_after_start"] for p in passes)),
                       floor_s=warm.get("floor_s"), floor_fraction=warm.get("floor_fraction"),
                       first_pass_gc=first.get("gc"), warm_pass_gc=warm.get("gc"))
            if r.get("round_warm_passes_s"):
                row["round_warm_passes_s"] = r["round_warm_passes_s"]
        rows.append(row)
    return rows


def format_passes(row: dict) -> str:
    """One line of a row: every pass's wall time and, with several warm passes, how far apart they are
    (the slowest over the fastest): the noise to read the backends' differences against."""
    warm = row.get("warm_passes_s") or []
    line = f"{row['backend']}: passes {row['first_pass_s']:.3f} s"
    if warm:
        line += ", then " + " / ".join(f"{t:.3f}" for t in warm) + " s"
    if len(warm) > 1:
        line += f" (warm passes within {100 * (max(warm) / min(warm) - 1):.1f}% of each other)"
    rounds = row.get("round_warm_passes_s") or []
    if len(rounds) > 1:
        line += ("; warm pass of each round " + " / ".join(f"{t:.3f}" for t in rounds) + " s (within "
                 f"{100 * (max(rounds) / min(rounds) - 1):.1f}%; reported: the median round)")
    return line


TABLE = [("backend", "backend"), ("start_s", "start s"), ("warm_start_s", "warm start s"),
         ("first_pass_s", "1st pass s"), ("warm_pass_s", "warm pass s"), ("output_throughput", "out tok/s"),
         ("total_throughput", "total tok/s"), ("ttft_s.mean", "TTFT mean"), ("ttft_s.p50", "p50"),
         ("ttft_s.p99", "p99"), ("tpot_s.mean", "TPOT mean"), ("tpot_s.p50", "p50"), ("tpot_s.p99", "p99"),
         ("compiled_after_start", "compiled"), ("floor_fraction", "of floor")]


def plot(rows: list[dict], path: str) -> None:
    """A bar chart of the warm pass's output tok/s per backend (and workload)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in rows if "output_throughput" in r]
    labels = [f"{r['workload']}\n{r['backend']}" for r in good]
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(good)), 3.5))
    bars = ax.bar(labels, [r["output_throughput"] for r in good], color="#4c72b0")
    for bar, r in zip(bars, good):
        if r.get("floor_fraction"):
            ax.annotate(f"{r['floor_fraction']:.0%} of floor", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("output tok/s (warm pass)")
    ax.set_title("tripath bench serve")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_report(workload: Workload, workload_name: str, results: list[dict], rows: list[dict]) -> None:
    """The command's output: the table of :data:`TABLE`, failures, every pass's times, the first and the warm
    pass's garbage collections and, where measured, each backend's step breakdown."""
    print(f"\n{workload.description or workload_name} ({workload.model})")
    print(format_table(rows, TABLE))
    for r in rows:
        if "error" in r:
            print(f"{r['backend']}: {r['error']}")
    for row in rows:
        if "first_pass_s" in row:
            print(format_passes(row))
    for row in rows:
        if row.get("first_pass_gc") and row.get("warm_pass_gc"):
            print(format_collections(row["backend"], row["first_pass_gc"], row["warm_pass_gc"]))
    for result, row in zip(results, rows):
        if result.get("step_breakdown"):
            print(format_breakdown(row["backend"], result["step_breakdown"]))
