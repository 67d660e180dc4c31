"""Which Triton is installed, and the adapter that speaks to its internals.

tripath uses parts of Triton that are not its public API. Every such use is a method of
:class:`~tripath.triton_internals.versions.base.TritonAdapter`; each Triton minor version tripath knows has
one module here whose class overrides what that version changed. :func:`current` returns the installed
Triton's adapter and refuses any other version by name: a new Triton release lands as one more module and
one more entry of :data:`ADAPTERS` (and the ``triton`` range of ``pyproject.toml``).
"""

from __future__ import annotations

import functools
import re

from tripath.triton_internals.versions.base import TritonAdapter
from tripath.triton_internals.versions.triton_3_6 import Triton36
from tripath.triton_internals.versions.triton_3_7 import Triton37
from tripath.triton_internals.versions.triton_3_8 import Triton38
from tripath.triton_internals.versions.triton_3_9 import Triton39

ADAPTERS: dict[tuple[int, int], type[TritonAdapter]] = {cls.version: cls for cls in (Triton36, Triton37, Triton38,
                                                                                    Triton39)}


class UnsupportedTriton(RuntimeError):
    """The installed Triton is a version tripath has no adapter for."""


def known_versions() -> str:
    return ", ".join(f"{major}.{minor}" for major, minor in sorted(ADAPTERS))


def parse(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a Triton version string (``"3.9.0"``, ``"3.6.0+git1234"``), None if it has none."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else None


@functools.lru_cache(maxsize=None)
def installed() -> tuple[int, int] | None:
    """``(major, minor)`` of the installed Triton, known to tripath or not (launch configurations that differ
    from one Triton to the next compare against it)."""
    import triton

    return parse(triton.__version__)


def adapter_for(version: str) -> TritonAdapter:
    """The adapter of Triton ``version`` (e.g. ``"3.9.0"``, ``"3.6.0+git1234"``); :class:`UnsupportedTriton`
    for a version tripath does not know."""
    cls = ADAPTERS.get(parse(version))
    if cls is None:
        raise UnsupportedTriton(
            f"tripath does not know Triton {version}: it works with Triton {known_versions()} "
            f"(pip install 'triton>={min(ADAPTERS)[0]}.{min(ADAPTERS)[1]},<{max(ADAPTERS)[0]}.{max(ADAPTERS)[1] + 1}'"
            ", or the Triton your torch pins)")
    return cls()


@functools.lru_cache(maxsize=None)
def current() -> TritonAdapter:
    """The installed Triton's adapter (:class:`UnsupportedTriton` if it has none)."""
    import triton

    return adapter_for(triton.__version__)
