"""Each projection's GEMM: the library's (``F.linear``, cuBLAS / hipBLASLt) or :func:`tripath.ops.skinny_gemm.
skinny_gemm`, whichever the engine measured faster at start for the weight's shape and the step's rows.

A decode step multiplies a few rows by every weight of the model; for a tensor-parallel shard's projection
(a weight of 1–3K rows) the library's tiles leave most SMs idle, where the split-K kernel spreads the weight
over all of them. :data:`GEMM_CHOICES` holds, per ``(N, K, dtype, device)`` of a weight, the buckets of row
counts (powers of two) at which the split-K kernel won; :func:`linear` looks the step's rows up there (the
smallest bucket at least as large) and takes the library's GEMM for anything not measured (the CPU, eager
steps of more rows, an engine started with ``skinny_gemm="off"``). The engine fills the table before it
captures graphs (:mod:`tripath.engine.runner.gemm_choice`).
"""

from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F

from tripath.ops.skinny_gemm import MAX_ROWS, skinny_gemm


class GemmChoices:
    """``(N, K, dtype, device)`` of a weight → ``{bucket: True where skinny_gemm runs it}`` over sorted buckets
    of row counts (a call of ``m`` rows takes the smallest bucket ``>= m``)."""

    def __init__(self):
        self._table: dict[tuple, tuple[list[int], dict[int, bool]]] = {}

    @staticmethod
    def key(weight: torch.Tensor) -> tuple:
        return (*weight.shape, weight.dtype, weight.device)

    def set(self, weight: torch.Tensor, choice: dict[int, bool]) -> None:
        """The choice for ``weight``'s shape: ``{bucket: skinny}`` (buckets up to :data:`MAX_ROWS`)."""
        if any(b < 1 or b > MAX_ROWS for b in choice):
            raise ValueError(f"row buckets must be 1..{MAX_ROWS}, got {sorted(choice)}")
        self._table[self.key(weight)] = (sorted(choice), dict(choice))

    def clear(self) -> None:
        self._table.clear()

    def skinny(self, weight: torch.Tensor, num_rows: int) -> bool:
        """Whether a call of ``num_rows`` rows on ``weight`` runs :func:`skinny_gemm`."""
        entry = self._table.get(self.key(weight))
        if entry is None:
            return False
        buckets, chosen = entry
        at = bisect.bisect_left(buckets, num_rows)
        return at < len(buckets) and chosen[buckets[at]]

    def summary(self) -> list[str]:
        """A line per weight shape: the row buckets that run the split-K kernel."""
        return [f"{n}x{k} {str(dtype).removeprefix('torch.')}: split-K at rows <= "
                f"{', '.join(str(b) for b in buckets if chosen[b]) or '(none)'}"
                for (n, k, dtype, _), (buckets, chosen) in self._table.items()]


GEMM_CHOICES = GemmChoices()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, by :func:`skinny_gemm` where :data:`GEMM_CHOICES` says so for ``x``'s rows
    (``x`` 2-D, contiguous rows)."""
    if x.dim() == 2 and x.stride(1) == 1 and GEMM_CHOICES.skinny(weight, x.shape[0]):
        return skinny_gemm(x, weight, bias)
    return F.linear(x, weight, bias)
