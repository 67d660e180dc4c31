"""Every environment variable tripath reads, in one place."""

from __future__ import annotations

import os


def attention_backend_override() -> str | None:
    """``TRIPATH_ATTENTION_BACKEND``: force a backend by name (``auto`` or unset = automatic)."""
    value = os.environ.get("TRIPATH_ATTENTION_BACKEND", "").strip()
    return value or None


def triton_interpret() -> bool:
    """``TRITON_INTERPRET=1``: run Triton kernels on the CPU with Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")
