"""Triton 3.7 (torch 2.12 and 2.13): its interpreter works with every numpy 2; ``ptxas`` runs with
``--regAllocOptLevel=2`` (Triton's work-around of a ptxas 13 bug), so the portability check's ``-v`` rerun
passes it too."""

from __future__ import annotations

from tripath.triton_internals.versions.base import TritonAdapter


class Triton37(TritonAdapter):
    version = (3, 7)

    def ptxas(self, arch: int) -> tuple[str, list[str]]:
        path, options = super().ptxas(arch)
        return path, options + ["--regAllocOptLevel=2"]
