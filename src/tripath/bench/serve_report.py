"""The serving benchmarks' report (online against a server, offline on the engine): per-request records,
their latency statistics and throughputs, and JSON / CSV / table output.

::

    records = [RequestRecord(prompt_tokens=128, output_tokens=64, ttft_s=0.05, e2e_s=0.9, itl_s=[...]), ...]
    report = summarize(records, elapsed_s=12.3)
    report["ttft_s"]["p99"], report["output_throughput"]

Latency statistics (``ttft_s``, ``tpot_s``, ``itl_s``, ``e2e_s``) are ``{"mean", "p50", "p90", "p99"}`` in
seconds over the successful requests; TPOT of one request is ``(e2e - ttft) / (output_tokens - 1)`` (requests
with at least two output tokens), ITL pools every gap between consecutive streamed tokens of every request.
Throughputs are per second of ``elapsed_s`` (the benchmark's wall time) and count successful requests only.
A statistic without samples is NaN (``null`` in JSON, empty in CSV).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from typing import Sequence



@dataclass
class RequestRecord:
    """One request as the client saw it."""

    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None          # first token's latency (None if it failed before one)
    e2e_s: float                  # request latency
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive output tokens; [] if unknown
    ok: bool = True
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens or no TTFT)."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (``q`` in [0, 100]) with linear interpolation between the closest ranks (as
    ``numpy.percentile``'s default); NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(float(v) for v in values)
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def stats(values: Sequence[float]) -> dict[str, float]:
    """``{"mean", "p50", "p90", "p99"}`` of ``values`` (NaN each when empty)."""
    values = [float(v) for v in values]
    mean = math.fsum(values) / len(values) if values else math.nan
    return {"mean": mean, "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99)}


def summarize(records: Sequence[RequestRecord], elapsed_s: float) -> dict:
    """The report of one benchmark run: counts, throughputs and latency statistics (see the module doc)."""
    if not elapsed_s > 0:
        raise ValueError(f"elapsed_s must be > 0, got {elapsed_s}")
    good = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in good)
    output = sum(r.output_tokens for r in good)
    return {
        "num_requests": len(records),
        "num_failed": len(records) - len(good),
        "elapsed_s": float(elapsed_s),
        "total_prompt_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(good) / elapsed_s,
        "output_throughput": output / elapsed_s,
        "total_throughput": (prompt + output) / elapsed_s,
        "ttft_s": stats([r.ttft_s for r in good if r.ttft_s is not None]),
        "tpot_s": stats([r.tpot_s for r in good if r.tpot_s is not None]),
        "itl_s": stats([gap for r in good for gap in r.itl_s]),
        "e2e_s": stats([r.e2e_s for r in good]),
    }


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_json(path, report: dict | list) -> None:
    """Write a report (or a list of them) as indented JSON; NaN and infinities become ``null``."""
    with open(path, "w") as f:
        json.dump(_json_safe(report), f, indent=2, allow_nan=False)
        f.write("\n")


def flatten(row: dict, prefix: str = "") -> dict:
    """Nested dicts to one level with dotted keys: ``{"ttft_s": {"p50": x}}`` -> ``{"ttft_s.p50": x}``."""
    flat = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def write_csv(path, rows: list[dict]) -> None:
    """One CSV row per report, nested keys flattened (``ttft_s.p50``); columns in first-seen order, a
    missing or NaN value is an empty cell, a list its values separated by spaces."""
    flat = [flatten(r) for r in rows]
    columns: list[str] = []
    for r in flat:
        columns.extend(k for k in r if k not in columns)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        for r in flat:
            writer.writerow({k: "" if isinstance(v, float) and math.isnan(v) else
                             " ".join(map(str, v)) if isinstance(v, list) else v for k, v in r.items()})


def _cell(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def format_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A plain-text table: one line per row, ``columns`` as ``(key, header)`` pairs where a key may be dotted
    (``"ttft_s.p50"``); cells right-aligned under their headers, a missing or NaN value shows ``-``."""
    flat = [flatten(r) for r in rows]
    cells = [[header for _, header in columns]] + [[_cell(r.get(key)) for key, _ in columns] for r in flat]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
