"""The portability check's calls of the split-K skinny GEMM (:mod:`tripath.ops.linear`): a TP-8 projection
(Qwen3's stacked q/k/v, 1280 × 4096) and Llama-3-8B's gate/up (28672 × 4096) at the row counts that pick each
row class's tiles, with and without a bias. :func:`tripath.portability.compile_scenarios.all_scenarios` adds
:func:`rows`. Weights are ``torch.empty`` of the real shapes (the launchers read only their sizes)."""

from __future__ import annotations

import torch

from tripath.ops.linear import ROW_CLASSES, skinny_linear
from tripath.platform import Platform

SHAPES = {"qwen3 tp8 qkv_proj": (1280, 4096), "llama-3 8b gate_up": (28672, 4096)}


def build_skinny_gemm(platform: Platform, *, shape: str, num_rows: int, bias: bool,
                      dtype: torch.dtype = torch.bfloat16) -> None:
    n, k = SHAPES[shape]
    skinny_linear(torch.randn(num_rows, k).to(dtype), torch.empty(n, k, dtype=dtype),
                  torch.zeros(n, dtype=dtype) if bias else None)


def rows() -> list[tuple[str, object, bool, dict]]:
    """``(name, build, ci, kwargs)`` of each call: every row class (2 rows, not 1, for the smallest: the JIT
    leaves the row count unspecialised, the check would not)."""
    out = []
    for shape in SHAPES:
        for num_rows in (2, *ROW_CLASSES[1:]):
            ci = shape == "qwen3 tp8 qkv_proj" and num_rows in (2, 64)
            out.append((f"skinny GEMM {shape} {num_rows} rows bf16", build_skinny_gemm, ci,
                        {"shape": shape, "num_rows": num_rows, "bias": False}))
    out.append(("skinny GEMM qwen3 tp8 qkv_proj 64 rows + bias bf16", build_skinny_gemm, False,
                {"shape": "qwen3 tp8 qkv_proj", "num_rows": 64, "bias": True}))
    return out
