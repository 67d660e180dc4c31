"""The benchmark figures: tables read from markdown, percentages of the floor, PNGs drawn."""

import os

import pytest

from tripath.bench import plots

TABLE = """# Title

### Paged decode (today)

| batch × context | tripath | peer | copy floor |
|---|---|---|---|
| 64 × 4096 | 4203 GB/s | 4279 | 4249 |
| 8 × 32768 | 3000 | n/a | 4000 |

## End to end

| model shape (attention layers) | workload | backend | start | first pass | second pass | % of floor |
|---|---|---|---|---|---|---|
| llama | w1 | three_path | 1 s | 2 s | 3 s | 51 |
| llama | w1 | two_path | 1 s | 2 s | 3 s | 43 |
"""


def test_tables_and_percentages_of_the_floor():
    tables = plots.markdown_tables(TABLE)
    assert [t.heading for t in tables] == ["### Paged decode (today)", "## End to end"]
    decode = plots.percent_of_floor(plots.find_table(tables, "### Paged decode"))
    assert decode["64 × 4096"] == pytest.approx({"tripath": 100 * 4203 / 4249, "peer": 100 * 4279 / 4249})
    assert decode["8 × 32768"] == {"tripath": 75.0}  # a cell without a number has no bar
    assert plots.end_to_end(tables[1]) == {"llama: w1": {"three_path": 51.0, "two_path": 43.0}}
    with pytest.raises(ValueError, match="no table under a heading starting with '### MLA'"):
        plots.find_table(tables, "### MLA")
    with pytest.raises(ValueError, match="has no floor column"):
        plots.percent_of_floor(plots.Table("## x", ["a", "b"], [["1", "2"]]))


def test_every_figure_of_the_benchmarks_page_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    docs = os.path.join(os.path.dirname(__file__), "..", "docs", "BENCHMARKS.md")
    with open(docs) as f:
        written = plots.draw(f.read(), str(tmp_path))
    assert sorted(os.path.basename(p) for p in written) == sorted(plots.FIGURES)
    for path in written:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
