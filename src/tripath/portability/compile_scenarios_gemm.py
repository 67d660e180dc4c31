"""The portability check's calls of the split-K GEMM for few rows (:mod:`tripath.ops.skinny_gemm`): the presets'
projections at the row counts of each row tile (16, 32, 64), split and unsplit, with and without a bias.
:func:`tripath.portability.compile_scenarios.all_scenarios` adds :func:`rows`.

The weights are ``torch.empty`` of the real shapes (address space only), ``N × K``.
"""

from __future__ import annotations

import torch

from tripath.ops.skinny_gemm import skinny_gemm
from tripath.platform import Platform

SHAPES = {"qwen3 tp8 qkv_proj": (1280, 4096), "deepseek tp8 kv_a": (576, 7168), "llama-3 8b gate_up": (28672, 4096)}


def build_skinny_gemm(platform: Platform, *, shape: str, num_rows: int, bias: bool = False,
                      dtype: torch.dtype = torch.bfloat16) -> None:
    n, k = SHAPES[shape]
    skinny_gemm(torch.randn(num_rows, k).to(dtype), torch.empty(n, k, dtype=dtype),
                torch.randn(n).to(dtype) if bias else None)


def rows() -> list[tuple[str, object, bool, dict]]:
    """``(name, build, ci, kwargs)`` of each call."""
    out = []
    for shape in SHAPES:
        for num_rows in (2, 32, 64):   # 2, not 1: the JIT leaves num_rows unspecialised, the check would not
            ci = shape == "qwen3 tp8 qkv_proj" and num_rows == 64
            out.append((f"split-K GEMM {shape} {num_rows} rows bf16", build_skinny_gemm, ci,
                        {"shape": shape, "num_rows": num_rows}))
    out.append(("split-K GEMM qwen3 tp8 qkv_proj 8 rows + bias fp16", build_skinny_gemm, False,
                {"shape": "qwen3 tp8 qkv_proj", "num_rows": 8, "bias": True, "dtype": torch.float16}))
    return out
