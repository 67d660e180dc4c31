"""Triton's interpreter (``TRITON_INTERPRET=1``): how tripath's Triton kernels run on a machine without a GPU.

Triton decides when it is imported whether ``@triton.jit`` functions are interpreted, so the switch must
be made before that: :func:`interpret_without_gpu` (the ``tripath`` commands that run kernels, and the test
suite) sets it when no GPU is visible and the environment has not chosen. Child processes get the choice
explicitly (:func:`child_environment`): benchmark children on a CPU interpret, compile workers never do.
:func:`ready` prepares the installed Triton's interpreter once, before the first interpreted launch (Triton
3.6's needs a fix under numpy 2.3 and newer: :mod:`tripath.triton_internals.versions.triton_3_6`).
"""

from __future__ import annotations

import functools
import os

from tripath import _env
from tripath.triton_internals import versions


def interpreting() -> bool:
    """Whether Triton kernels on the CPU run in the interpreter (``TRITON_INTERPRET`` is on)."""
    return _env.triton_interpret()


def interpret_without_gpu() -> None:
    """Without a visible GPU, turn the interpreter on (``TRITON_INTERPRET=1``) unless the environment already
    sets ``TRITON_INTERPRET``; call it before Triton is imported."""
    if not _env.triton_interpret_given():
        import torch

        if not torch.cuda.is_available():
            os.environ[_env.TRITON_INTERPRET] = "1"


def child_environment(*, interpret: bool | None, cache_dir: str | None = None) -> dict[str, str]:
    """This process's environment for a child process: ``interpret=True`` turns the interpreter on unless the
    environment sets ``TRITON_INTERPRET``, ``interpret=False`` removes it (the child compiles for real),
    ``None`` leaves it as it is; ``cache_dir`` sets the Triton cache directory."""
    env = {k: v for k, v in os.environ.items() if interpret is not False or k != _env.TRITON_INTERPRET}
    if interpret:
        env.setdefault(_env.TRITON_INTERPRET, "1")
    if cache_dir is not None:
        env[_env.TRITON_CACHE_DIR] = cache_dir
    return env


@functools.lru_cache(maxsize=None)
def ready() -> None:
    """Prepare the installed Triton's interpreter for tripath's kernels (once per process)."""
    versions.current().prepare_interpreter()
