"""Everything of tripath that touches Triton's internals, behind one interface.

- launches (:mod:`.launches`): every launcher starts its kernels through :func:`launch`; :func:`use_triton`
  says whether an op runs its Triton kernel; :func:`capture_launches` records launches instead of running
  them, :func:`launch_key` names the compiled variant a launch needs, :func:`compiled_variants` counts
  those this process compiled;
- launch replay (:mod:`.replay`): :func:`record_launches` keeps one call's launches, and
  :class:`LaunchSequence` makes them again with other tensors (:func:`warm_up_recording` at engine start);
- the compile pool (:mod:`.compile_pool`): :func:`collect_compilations` lists the compilations a block would
  make, :class:`CompilePool` makes them in worker processes (:func:`default_workers`);
- specialisation (:mod:`.specialize`): the arguments the kernels keep Triton from specialising on (the only
  module the kernels import);
- the interpreter switch (:mod:`.interpreter`): when Triton kernels run in Triton's interpreter on a CPU;
- the per-version adapters (:mod:`.versions`): each call into a part of Triton that is not its public API,
  one adapter per Triton version tripath knows (3.6–3.9); an unknown version is refused by name.

Importing this package loads neither PyTorch nor Triton: each name below loads its module on first use (the
compile workers import the kernels, and with them :mod:`.specialize`, without PyTorch).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "launch": "launches", "use_triton": "launches", "capture_launches": "launches", "LaunchRecord": "launches",
    "launch_key": "launches", "compiled_variants": "launches",
    "record_launches": "replay", "LaunchSequence": "replay", "warm_up_recording": "replay",
    "CompilePool": "compile_pool", "Compilation": "compile_pool", "PoolReport": "compile_pool",
    "collect_compilations": "compile_pool", "default_workers": "compile_pool",
    "STEP_INVARIANT": "specialize",
    "interpret_without_gpu": "interpreter", "interpreting": "interpreter", "child_environment": "interpreter",
    "UnsupportedTriton": "versions", "current_adapter": None,
}
__all__ = sorted(_EXPORTS)


def current_adapter():
    """The installed Triton's adapter (:func:`tripath.triton_internals.versions.current`)."""
    from tripath.triton_internals import versions

    return versions.current()


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
