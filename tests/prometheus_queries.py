"""A small PromQL evaluator for the queries of Grafana dashboards, over two ``/metrics`` scrapes taken
``seconds`` apart (what Prometheus would hold for a ``rate(...[interval])`` of that window).

Understood: selectors ``name{label="value", ...}`` (``=`` matchers) with an optional range ``[...]`` (its
length is the scrapes' distance, whatever it says), ``rate``, ``increase``, ``sum by(labels) (...)``,
``histogram_quantile(q, ...)`` (Prometheus' linear interpolation inside the bucket) and ``/`` between two
vectors (matched on their labels). Grafana's variables are replaced first (``variables``). Anything else
raises ``ValueError`` naming it.
"""

from __future__ import annotations

import math
import re

from prometheus_client.parser import text_string_to_metric_families

Vector = dict[frozenset, float]   # labels (without __name__) -> value
_TOKEN = re.compile(r'\s*(?:(?P<num>\d+(?:\.\d+)?)|(?P<str>"[^"]*")|(?P<ident>[A-Za-z_:][\w:]*)'
                    r'|(?P<range>\[[^\]]*\])|(?P<op>[(){},=/]))')


def samples(text: str) -> dict[str, Vector]:
    """A scrape's samples: sample name -> {labels: value}."""
    out: dict[str, Vector] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value
    return out


def _tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    expr = expr.strip()
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"cannot read {expr[pos:]!r}")
        out.append((m.lastgroup, m.group(m.lastgroup)))
        pos = m.end()
        while pos < len(expr) and expr[pos].isspace():
            pos += 1
    return out


class Evaluator:
    def __init__(self, before: str, after: str, seconds: float, variables: dict[str, str] | None = None):
        self.before, self.after, self.seconds = samples(before), samples(after), seconds
        self.variables = variables or {}

    def __call__(self, expr: str):
        for name, value in self.variables.items():
            expr = expr.replace(f"${name}", value)
        self._toks, self._i = _tokens(expr), 0
        result = self._expr()
        if self._i != len(self._toks):
            raise ValueError(f"unexpected {self._toks[self._i][1]!r} in {expr!r}")
        return result

    # ---- parsing and evaluating at once ---------------------------------------------------------------------
    def _peek(self):
        return self._toks[self._i] if self._i < len(self._toks) else (None, None)

    def _take(self, value: str | None = None, kind: str | None = None) -> str:
        got_kind, got = self._peek()
        if (value is not None and got != value) or (kind is not None and got_kind != kind):
            raise ValueError(f"expected {value or kind}, got {got!r}")
        self._i += 1
        return got

    def _expr(self):
        left = self._term()
        while self._peek()[1] == "/":
            self._take("/")
            right = self._term()
            left = {labels: left[labels] / right[labels] if right[labels] else math.nan
                    for labels in left if labels in right}
        return left

    def _term(self):
        kind, value = self._peek()
        if kind == "num":
            return float(self._take(kind="num"))
        name = self._take(kind="ident")
        if name == "sum":
            by = []
            if self._peek()[1] == "by":
                self._take("by")
                self._take("(")
                while self._peek()[1] != ")":
                    by.append(self._take(kind="ident"))
                    if self._peek()[1] == ",":
                        self._take(",")
                self._take(")")
            self._take("(")
            inner = self._expr()
            self._take(")")
            out: Vector = {}
            for labels, v in inner.items():
                key = frozenset((k, val) for k, val in labels if k in by)
                out[key] = out.get(key, 0.0) + v
            return out
        if name in ("rate", "increase", "histogram_quantile"):
            self._take("(")
            if name == "histogram_quantile":
                q = self._term()
                self._take(",")
                result = _quantile(q, self._expr())
            else:
                before, after = self._selector(self._take(kind="ident"), ranged=True)
                grown = {labels: v - before.get(labels, 0.0) for labels, v in after.items()}
                result = grown if name == "increase" else {k: v / self.seconds for k, v in grown.items()}
            self._take(")")
            return result
        if self._peek()[1] == "(":
            raise ValueError(f"unknown function {name!r}")
        return self._selector(name, ranged=False)

    def _selector(self, name: str, ranged: bool):
        matchers = {}
        if self._peek()[1] == "{":
            self._take("{")
            while self._peek()[1] != "}":
                label = self._take(kind="ident")
                self._take("=")
                matchers[label] = self._take(kind="str")[1:-1]
                if self._peek()[1] == ",":
                    self._take(",")
            self._take("}")
        if ranged:
            self._take(kind="range")

        def pick(scrape):
            return {labels: v for labels, v in scrape.get(name, {}).items()
                    if all((k, v2) in labels for k, v2 in matchers.items())}

        return (pick(self.before), pick(self.after)) if ranged else pick(self.after)


def _quantile(q: float, buckets: Vector) -> Vector:
    """Prometheus' ``histogram_quantile`` over a vector of cumulative ``le`` buckets."""
    groups: dict[frozenset, list[tuple[float, float]]] = {}
    for labels, count in buckets.items():
        le = dict(labels)["le"]
        groups.setdefault(frozenset((k, v) for k, v in labels if k != "le"), []).append((float(le), count))
    out = {}
    for key, points in groups.items():
        points.sort()
        total = points[-1][1]
        if total <= 0 or points[-1][0] != math.inf:
            out[key] = math.nan
            continue
        rank, lower, below = q * total, 0.0, 0.0
        for upper, count in points:
            if count >= rank:
                if upper == math.inf:   # in the +Inf bucket: the highest finite bound
                    out[key] = points[-2][0] if len(points) > 1 else math.nan
                else:
                    out[key] = lower + (upper - lower) * (rank - below) / (count - below) if count > below else upper
                break
            lower, below = upper, count
    return out
