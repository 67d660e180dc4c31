"""Benchmarks, the portability check (``tripath check-compile``), tables and plots."""


def emit_report(text: str, out: str | None) -> None:
    """Print a benchmark's markdown report and, when ``out`` is given, also write it to that file."""
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
