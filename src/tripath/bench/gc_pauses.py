"""The interpreter's garbage collections during a measured pass: how many, of which generation, and how long
they held the host (timed through ``gc.callbacks``), so a slow pass can be told apart from one that
collected. A collection of the oldest generation walks every tracked object, and after a start that compiled
many kernels there are many."""

from __future__ import annotations

import gc
import time


class GarbageCollections:
    """Records each collection that starts and ends while the context is active: ``(generation, seconds)``."""

    def __init__(self):
        self.pauses: list[tuple[int, float]] = []
        self._started: float | None = None

    def __enter__(self) -> "GarbageCollections":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.pauses.append((int(info["generation"]), time.perf_counter() - self._started))
            self._started = None

    def summary(self) -> dict:
        """``collections``, ``pause_s`` (their sum), ``max_pause_s``, and the same for the oldest
        generation (2): ``oldest_collections``, ``oldest_pause_s``."""
        oldest = [s for g, s in self.pauses if g == 2]
        return {"collections": len(self.pauses), "pause_s": sum(s for _, s in self.pauses),
                "max_pause_s": max((s for _, s in self.pauses), default=0.0),
                "oldest_collections": len(oldest), "oldest_pause_s": sum(oldest)}


def format_collections(label: str, first: dict, warm: dict) -> str:
    """One line: the first and the warm pass's collections (``summary()`` dicts)."""
    def one(s: dict) -> str:
        return (f"{s['collections']} collections, {1e3 * s['pause_s']:.1f} ms (longest {1e3 * s['max_pause_s']:.1f} "
                f"ms; oldest generation {s['oldest_collections']}, {1e3 * s['oldest_pause_s']:.1f} ms)")
    return f"{label}: garbage collection, first pass {one(first)}; warm pass {one(warm)}"
