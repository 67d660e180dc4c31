"""Every environment variable tripath reads, in one place."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator


def attention_backend_override() -> str | None:
    """``TRIPATH_ATTENTION_BACKEND``: force a backend by name (``auto`` or unset = automatic)."""
    value = os.environ.get("TRIPATH_ATTENTION_BACKEND", "").strip()
    return value or None


TRITON_INTERPRET = "TRITON_INTERPRET"
TRITON_CACHE_DIR = "TRITON_CACHE_DIR"


def torchrun_ranks() -> tuple[int, int] | None:
    """``(RANK, LOCAL_RANK)`` when torchrun started this process (``RANK`` and ``WORLD_SIZE`` both set;
    ``LOCAL_RANK`` defaults to ``RANK``), else None: the tensor-parallel LLM then joins torchrun's process
    group instead of spawning its ranks."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank = int(os.environ["RANK"])
    return rank, int(os.environ.get("LOCAL_RANK", rank))


def triton_interpret() -> bool:
    """``TRITON_INTERPRET=1``: run Triton kernels on the CPU with Triton's interpreter (Triton reads it when it
    is imported; :mod:`tripath.triton_internals.interpreter` sets it where tripath chooses)."""
    return os.environ.get(TRITON_INTERPRET, "0") not in ("", "0", "false", "False")


def triton_interpret_given() -> bool:
    """Whether ``TRITON_INTERPRET`` is set at all (then tripath leaves the choice to it)."""
    return TRITON_INTERPRET in os.environ


def gluon_disabled() -> bool:
    """``TRIPATH_DISABLE_GLUON=1``: never take the Gluon (Hopper-only) kernels; the portable Triton kernels
    run instead (for comparisons, or if an experimental Gluon API misbehaves on some Triton build)."""
    return os.environ.get("TRIPATH_DISABLE_GLUON", "0") not in ("", "0", "false", "False")


def triton_cache_dir() -> str:
    """``TRITON_CACHE_DIR`` (default ``~/.triton/cache``): Triton's compiled kernels; the engine's warm-up
    keeps the list of steps that compile them beside them, so both are cold or warm together."""
    return os.environ.get(TRITON_CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".triton", "cache")


@contextlib.contextmanager
def setting(name: str, value: str) -> Iterator[None]:
    """Set the environment variable ``name`` to ``value`` for the block."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def validate() -> bool:
    """``TRIPATH_VALIDATE=1``: the ops also check the values of their index tensors on the device (slots,
    block ids, ``seq_lens``, ``cu_seqlens``, fp8 scales; each check syncs with the host), and
    :class:`tripath.attention.ForwardContext` checks each step's metadata against its caches. Off by default:
    the engine builds those indices itself; the test suites turn it on."""
    return os.environ.get("TRIPATH_VALIDATE", "0") not in ("", "0", "false", "False")


API_KEY_VARIABLES = ("TRIPATH_API_KEY", "VLLM_API_KEY")


def server_api_key() -> tuple[str | None, str | None]:
    """The key ``tripath serve`` requires (``Authorization: Bearer <key>``) when ``--api-key`` is not given, and
    the variable it came from: ``TRIPATH_API_KEY``, else vLLM's ``VLLM_API_KEY`` (so a deployment written for
    ``vllm serve`` keeps its key); ``(None, None)`` when neither is set (or both are empty)."""
    for name in API_KEY_VARIABLES:
        value = os.environ.get(name)
        if value:
            return value, name
    return None, None
