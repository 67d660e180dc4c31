"""The serving benchmarks' report: percentiles against numpy, the summary's schema and values, JSON and CSV."""

import csv
import json
import math
import random

import numpy as np
import pytest

from tripath.bench.serve_report import (RequestRecord, flatten, format_table, percentile, summarize, write_csv,
                                        write_json)


@pytest.mark.parametrize("n", [1, 2, 7, 100])
def test_percentile_matches_numpy(n):
    rng = random.Random(n)
    values = [rng.expovariate(3.0) for _ in range(n)]
    for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-15)


def test_percentile_of_nothing_is_nan_and_q_is_checked():
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="q must be in"):
        percentile([1.0], 101)


def _records():
    rng = random.Random(0)
    records = []
    for i in range(20):
        out = rng.randint(1, 9)
        ttft = rng.uniform(0.01, 0.1)
        itl = [rng.uniform(0.001, 0.02) for _ in range(out - 1)]
        records.append(RequestRecord(rng.randint(4, 40), out, ttft, ttft + sum(itl), itl))
    records.append(RequestRecord(10, 0, None, 0.5, [], ok=False, error="HTTP 503"))
    return records


def test_summary_values():
    records = _records()
    report = summarize(records, elapsed_s=2.0)
    good = [r for r in records if r.ok]
    assert report["num_requests"] == 21 and report["num_failed"] == 1
    out = sum(r.output_tokens for r in good)
    prompt = sum(r.prompt_tokens for r in good)
    assert report["request_throughput"] == pytest.approx(20 / 2.0)
    assert report["output_throughput"] == pytest.approx(out / 2.0)
    assert report["total_throughput"] == pytest.approx((out + prompt) / 2.0)
    ttfts = [r.ttft_s for r in good]
    assert report["ttft_s"]["mean"] == pytest.approx(np.mean(ttfts))
    assert report["ttft_s"]["p90"] == pytest.approx(np.percentile(ttfts, 90))
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in good if r.output_tokens >= 2]
    assert report["tpot_s"]["p50"] == pytest.approx(np.percentile(tpots, 50))
    gaps = [g for r in good for g in r.itl_s]
    assert report["itl_s"]["p99"] == pytest.approx(np.percentile(gaps, 99))
    assert report["e2e_s"]["mean"] == pytest.approx(np.mean([r.e2e_s for r in good]))


def test_summary_schema_and_json(tmp_path):
    report = summarize([RequestRecord(5, 1, 0.1, 0.1, [])], elapsed_s=1.0)  # one token: no TPOT, no ITL
    for key in ("num_requests", "num_failed", "elapsed_s", "request_throughput", "output_throughput",
                "total_throughput"):
        assert isinstance(report[key], (int, float)), key
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert set(report[key]) == {"mean", "p50", "p90", "p99"}
    assert math.isnan(report["tpot_s"]["p50"]) and math.isnan(report["itl_s"]["mean"])
    path = tmp_path / "r.json"
    write_json(path, [report, report])
    loaded = json.loads(path.read_text())   # strict JSON: NaN became null
    assert loaded[0]["tpot_s"]["p50"] is None and loaded[1]["ttft_s"]["p50"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="elapsed_s"):
        summarize([], elapsed_s=0.0)


def test_csv_flattens_nested_keys(tmp_path):
    a = {"rate": 1.0, **summarize(_records(), 2.0), "warm_passes_s": [1.5, 2.25]}
    b = {"rate": 4.0, **summarize([RequestRecord(5, 1, 0.1, 0.1, [])], 1.0)}
    path = tmp_path / "r.csv"
    write_csv(path, [a, b])
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["rate"] == "1.0" and float(rows[0]["ttft_s.p50"]) == pytest.approx(a["ttft_s"]["p50"])
    assert rows[0]["warm_passes_s"] == "1.5 2.25" and rows[1]["warm_passes_s"] == ""  # a list: spaced values
    assert rows[1]["tpot_s.p99"] == ""                       # NaN -> empty cell
    assert list(rows[0])[:2] == ["rate", "num_requests"]
    assert flatten({"x": {"y": {"z": 1}}, "w": 2}) == {"x.y.z": 1, "w": 2}


def test_table_aligns_columns():
    rows = [{"rate": 1.0, "ttft_s": {"p50": 0.0123}}, {"rate": 16.0, "ttft_s": {"p50": math.nan}}]
    text = format_table(rows, [("rate", "req/s"), ("ttft_s.p50", "TTFT p50 (s)")])
    lines = text.splitlines()
    assert lines[0].split() == ["req/s", "TTFT", "p50", "(s)"]
    assert len({len(line) for line in lines}) == 1            # every line as wide as the header
    assert lines[2].split() == ["1", "0.0123"] and lines[3].split() == ["16", "-"]
