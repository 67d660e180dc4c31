"""Figures of ``docs/BENCHMARKS.md``, drawn from its own markdown tables (matplotlib, optional).

    python -m tripath.bench.plots docs/BENCHMARKS.md --out docs

Each figure of :data:`FIGURES` takes the first table under the heading that starts with its prefix. Kernel
tables (a ``floor`` column) become bars of each implementation as a percentage of the floor measured in the
same run (100% = the hardware limit); the end-to-end table becomes bars of each backend's percentage of
its run's roofline floor, per workload. The numbers are read from the cells (the first number in a cell).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Sequence

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass
class Table:
    heading: str
    header: list[str]
    rows: list[list[str]]


@dataclass(frozen=True)
class Figure:
    heading: str  # the table's heading starts with this
    title: str
    kind: str  # "floor": kernel rows as % of the floor column; "end_to_end": backends per workload


FIGURES = {
    "bench_decode.png": Figure("### Paged decode", "Paged decode, 32/8/128 bf16, H200", "floor"),
    "bench_prefill.png": Figure("### Causal prefill", "Causal prefill, 32/8/128 bf16, H200", "floor"),
    "bench_mla_decode.png": Figure("### MLA decode (", "MLA decode, DeepSeek latent, bf16, H200", "floor"),
    "bench_end_to_end.png": Figure("## End to end", "End to end, H200", "end_to_end"),
}


def markdown_tables(text: str) -> list[Table]:
    """Every pipe table of ``text`` with the nearest heading above it."""
    tables, heading, lines = [], "", text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("#"):
            heading = line
        if line.startswith("|") and i + 1 < len(lines) and re.match(r"^\|[\s:|-]+\|$", lines[i + 1].strip()):
            header = [c.strip() for c in line.strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            tables.append(Table(heading, header, rows))
            continue
        i += 1
    return tables


def number(cell: str) -> float | None:
    """The first number in a table cell (``"4203"``, ``"504 TF/s"``, ``"11.2 s"``), or None."""
    match = _NUMBER.search(cell.replace(",", ""))
    return float(match.group()) if match else None


def find_table(tables: Sequence[Table], heading_prefix: str) -> Table:
    for table in tables:
        if table.heading.startswith(heading_prefix):
            return table
    raise ValueError(f"no table under a heading starting with {heading_prefix!r}")


def percent_of_floor(table: Table) -> dict[str, dict[str, float]]:
    """``{row label: {implementation: % of the row's floor}}`` of a table whose last column is a floor."""
    floor_col = next((i for i, name in enumerate(table.header) if "floor" in name.lower()), None)
    if floor_col is None:
        raise ValueError(f"the table under {table.heading!r} has no floor column")
    groups: dict[str, dict[str, float]] = {}
    for row in table.rows:
        floor = number(row[floor_col])
        bars = {}
        for col, name in enumerate(table.header[1:], start=1):
            value = number(row[col])
            if col != floor_col and value is not None and floor:
                bars[name] = 100.0 * value / floor
        groups[row[0]] = bars
    return groups


def end_to_end(table: Table) -> dict[str, dict[str, float]]:
    """``{workload: {backend: % of floor}}`` of the end-to-end table (its ``workload`` or ``workload (run)``
    column; the label prefixed with the model shape when the table has a ``model shape (attention layers)``
    column)."""
    col = {name: i for i, name in enumerate(table.header)}
    col.setdefault("workload", col.get("workload (run)"))
    shape = col.get("model shape (attention layers)")
    groups: dict[str, dict[str, float]] = {}
    for row in table.rows:
        label = row[col["workload"]] if shape is None else f"{row[shape]}: {row[col['workload']]}"
        groups.setdefault(label, {})[row[col["backend"]]] = number(row[col["% of floor"]])
    return groups


def grouped_bars(groups: dict[str, dict[str, float]], title: str, ylabel: str, path: str,
                 reference: float | None = 100.0) -> None:
    """One group of bars per key of ``groups`` (one bar per series), a dashed line at ``reference``."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError("the figures need matplotlib: pip install 'tripath[plots]'") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import textwrap

    series = list(dict.fromkeys(name for bars in groups.values() for name in bars))
    colors = {name: f"C{j}" for j, name in enumerate(series)}
    width = 0.8 / max(1, max(len(bars) for bars in groups.values()))
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(groups)), 3.8), dpi=100)
    labelled = set()
    for i, bars in enumerate(groups.values()):  # each group's own bars, centred on its tick
        for j, (name, value) in enumerate(bars.items()):
            ax.bar(i + (j - (len(bars) - 1) / 2) * width, value, width, color=colors[name],
                   label=None if name in labelled else name)
            labelled.add(name)
    if reference is not None:
        ax.axhline(reference, color="black", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(groups)), ["\n".join(textwrap.wrap(label, 26)) for label in groups], fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="lower right" if reference is not None else "upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def draw(markdown: str, out_dir: str) -> list[str]:
    """Draw every figure of :data:`FIGURES` from the tables of ``markdown`` into ``out_dir``."""
    import os

    tables = markdown_tables(markdown)
    written = []
    for name, figure in FIGURES.items():
        table = find_table(tables, figure.heading)
        path = os.path.join(out_dir, name)
        if figure.kind == "floor":
            grouped_bars(percent_of_floor(table), figure.title, "% of the measured floor", path)
        else:
            grouped_bars(end_to_end(table), figure.title, "% of the roofline floor", path, reference=None)
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tripath.bench.plots", description=__doc__.splitlines()[0])
    parser.add_argument("benchmarks", help="the markdown file with the tables (docs/BENCHMARKS.md)")
    parser.add_argument("--out", default=".", help="folder for the PNG files")
    args = parser.parse_args(argv)
    with open(args.benchmarks) as f:
        for path in draw(f.read(), args.out):
            print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
