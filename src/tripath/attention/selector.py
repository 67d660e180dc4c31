"""Backend selection: validate candidates against the spec and the device, keep why each was rejected.

``auto`` tries ``three_path, unified, two_path, sdpa, torch`` for MHA/GQA specs and ``mla, mla_triton, sdpa,
torch`` for MLA specs, in that order (without a GPU: ``sdpa``, PyTorch's fused attention). ``TRIPATH_ATTENTION_BACKEND`` overrides the ``name`` argument.

The spec carries the KV block size and the backend is chosen from the spec, so a caller that has no block
size asks first: :func:`default_block_size` gives the size that the backend ``name`` (for ``auto``, its
first candidate for the model kind) declares it prefers on the device (``Capabilities.cpu_block_size`` /
``gpu_block_size``); then it builds the spec with that size and selects.
"""

from __future__ import annotations

import importlib

import torch

from tripath import _env
from tripath.attention.spec import AttentionSpec

# name -> "module:Class" (imported on first use, so a backend's kernels load only when asked for)
BACKENDS = {
    "three_path": "tripath.attention.backends.three_path:ThreePathBackend",
    "unified": "tripath.attention.backends.unified:UnifiedBackend",
    "mixed": "tripath.attention.backends.mixed:MixedBackend",
    "two_path": "tripath.attention.backends.two_path:TwoPathBackend",
    "sdpa": "tripath.attention.backends.sdpa:SdpaBackend",
    "torch": "tripath.attention.backends.torch_ref:TorchBackend",
    "mla": "tripath.attention.backends.mla:MLABackend",
    "mla_triton": "tripath.attention.backends.mla_triton:MLATritonBackend",
}
AUTO_MHA = ("three_path", "unified", "two_path", "sdpa", "torch")
AUTO_MLA = ("mla", "mla_triton", "sdpa", "torch")


class BackendUnavailableError(ValueError):
    """No requested backend can serve the spec; ``reasons`` maps each candidate to why."""

    def __init__(self, reasons: dict[str, list[str]]):
        self.reasons = reasons
        lines = [f"  {name}: {'; '.join(why)}" for name, why in reasons.items()]
        super().__init__("no attention backend can serve this spec:\n" + "\n".join(lines))


def backend_class(name: str):
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: auto, {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def candidates(name: str, is_mla: bool) -> tuple[str, ...]:
    """The backends ``select_backend`` tries for ``name`` (after ``TRIPATH_ATTENTION_BACKEND``), in order."""
    name = _env.attention_backend_override() or name
    return (AUTO_MLA if is_mla else AUTO_MHA) if name == "auto" else (name,)


def default_block_size(name: str, is_mla: bool, device: torch.device | str) -> int:
    """The KV block size to build the spec with when none is given: what the backend ``name`` prefers for
    the model kind (``is_mla``) on ``device`` (for ``auto``: its first candidate, ``three_path`` or ``mla``,
    whose preference the later candidates take too). Raises for an unknown ``name``."""
    return backend_class(candidates(name, is_mla)[0]).preferred_block_size(is_mla, torch.device(device))


def explain(spec: AttentionSpec, device: torch.device | str = "cpu") -> dict[str, list[str]]:
    """Every backend's reasons for rejecting ``spec`` on ``device`` (empty list = supported)."""
    device = torch.device(device)
    return {name: backend_class(name).unsupported_reasons(spec, device) for name in BACKENDS}


def select_backend(spec: AttentionSpec, name: str = "auto", device: torch.device | str | None = None):
    """Instantiate the backend ``name`` (or the first that fits, for ``"auto"``) for ``spec`` on ``device``.

    Raises ``BackendUnavailableError`` listing why each candidate was rejected.
    """
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    reasons: dict[str, list[str]] = {}
    for candidate in candidates(name, spec.is_mla):
        cls = backend_class(candidate)
        why = cls.unsupported_reasons(spec, device)
        if not why:
            backend = cls(spec, device)
            backend.rejected = reasons
            return backend
        reasons[candidate] = why
    raise BackendUnavailableError(reasons)
