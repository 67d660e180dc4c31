"""The building blocks of the server's Prometheus metrics (:mod:`~tripath.server.metrics.metrics`): vLLM's bucket
bounds, the histograms ``prometheus_client`` has no kind for, and the names a scrape shows.

Names: every family vLLM also serves is registered once, under vLLM's name (``vllm:...``); a scrape renders it
as ``vllm:...``, as ``tripath:...`` (the names tripath served before it served vLLM's), or both, one beside the
other with the same samples (:func:`named`, ``tripath serve --metric-names``). tripath's own families (no vLLM
counterpart) are ``tripath:...`` whatever the choice.
"""

from __future__ import annotations

import bisect
import math

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from tripath.engine.scheduling.stats import STEP_TOKEN_BUCKETS

LABELS = ("model_name", "engine")
VLLM, TRIPATH = "vllm:", "tripath:"
METRIC_NAMES = ("both", "vllm", "tripath")   # what a scrape shows of vLLM's families (module doc)
# vLLM's bucket bounds (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five_buckets(top: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``top`` (the token-count buckets, up to ``max_model_len``)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > top:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


def _cumulative(bounds: list[str], counts) -> list[tuple[str, int]]:
    out, total = [], 0
    for le, n in zip(bounds, counts):
        total += n
        out.append((le, total))
    return out


class CountedHistogram:
    """A Prometheus histogram that takes ``count`` equal observations in one call (``observe(value, count)``:
    a bisection and two additions, where ``prometheus_client.Histogram.observe`` takes a lock per call): the
    inter-token latency of a step's 8 tokens x 256 requests is one call per request. One thread observes (the
    one that delivers the engine's outputs); ``/metrics`` reads it from another, a bucket at a time."""

    def __init__(self, name: str, doc: str, label_values: tuple[str, ...], buckets, registry: CollectorRegistry):
        self._name, self._doc, self._label_values = name, doc, list(label_values)
        self._upper = [float(b) for b in buckets] + [math.inf]
        self._le = [floatToGoString(b) for b in self._upper]
        self._counts = [0] * len(self._upper)
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        self._counts[bisect.bisect_left(self._upper, value)] += count   # "le": a bucket holds its upper bound
        self._sum += value * count

    def collect(self):
        family = HistogramMetricFamily(self._name, self._doc, labels=LABELS)
        family.add_metric(self._label_values, _cumulative(self._le, self._counts), self._sum)
        yield family

    def describe(self):
        return [HistogramMetricFamily(self._name, self._doc, labels=LABELS)]


class StepTokensHistogram:
    """``vllm:iteration_tokens_total``: the engine's own histogram of new tokens per model step
    (:class:`~tripath.engine.scheduling.stats.StepTokenCounts`), rendered from the latest
    :class:`~tripath.engine.scheduling.stats.EngineStats` (:meth:`update`); the engine counts, the server only
    shows it."""

    NAME = "vllm:iteration_tokens_total"
    DOC = "Histogram of number of tokens per engine_step."

    def __init__(self, label_values: tuple[str, ...], registry: CollectorRegistry):
        self._label_values = list(label_values)
        self._le = [floatToGoString(b) for b in STEP_TOKEN_BUCKETS] + ["+Inf"]
        self._counts: tuple[int, ...] = (0,) * len(self._le)
        self._sum = 0
        registry.register(self)

    def update(self, counts: tuple[int, ...], total: int) -> None:
        if len(counts) == len(self._le):   # an engine that does not count steps sends none
            self._counts, self._sum = counts, total

    def collect(self):
        family = HistogramMetricFamily(self.NAME, self.DOC, labels=LABELS)
        family.add_metric(self._label_values, _cumulative(self._le, self._counts), float(self._sum))
        yield family

    def describe(self):
        return [HistogramMetricFamily(self.NAME, self.DOC, labels=LABELS)]


def renamed(family: Metric, prefix: str) -> Metric:
    """A copy of a ``vllm:`` family under another prefix (its samples renamed alike)."""
    cut = len(VLLM)
    copy = Metric(prefix + family.name[cut:], family.documentation, family.type, family.unit)
    for sample in family.samples:
        copy.add_sample(prefix + sample.name[cut:], sample.labels, sample.value, timestamp=sample.timestamp,
                        exemplar=sample.exemplar)
    return copy


def named(families: list[Metric], names: str) -> list[Metric]:
    """``families`` as a scrape shows them: vLLM's families under ``names`` (:data:`METRIC_NAMES`: ``both``
    lists every ``vllm:`` family, then the ``tripath:`` ones: their copies and tripath's own)."""
    if names not in METRIC_NAMES:
        raise ValueError(f"metric names must be one of {', '.join(METRIC_NAMES)}, got {names!r}")
    if names == "vllm":
        return list(families)
    theirs = [f for f in families if f.name.startswith(VLLM)]
    ours = [renamed(f, TRIPATH) if f.name.startswith(VLLM) else f for f in families]
    return theirs + ours if names == "both" else ours


class Families:
    """What ``generate_latest`` renders: a fixed list of families."""

    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self):
        return self._families


def render(families: list[Metric], names: str) -> bytes:
    """The Prometheus text of ``families`` (:func:`named` ``names``)."""
    return generate_latest(Families(named(families, names)))
