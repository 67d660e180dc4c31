"""Benchmarks, the portability check (``tripath check-compile``), tables and plots."""
