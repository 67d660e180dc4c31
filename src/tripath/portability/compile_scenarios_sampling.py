"""The portability check's calls of the fused LM head and draw (:mod:`tripath.ops.lm_head_sample`): the
presets' LM-head shapes and the row counts that pick each tile, greedy and with the draw's noise, and the
draw from written logits. :func:`tripath.portability.compile_scenarios.all_scenarios` adds :func:`rows`.

The weights are ``torch.empty`` of the real shapes (address space only: the launchers read their sizes, the
AMD back end their allocations' size): a TP-8 shard of Qwen3's 151936-token vocabulary (149 tiles of 128:
64-token tiles) and Llama-3's whole 128256 (128-token tiles), DeepSeek's 7168-wide hidden state.
"""

from __future__ import annotations

import torch

from tripath.ops.lm_head_sample import lm_head_sample, logits_sample
from tripath.platform import Platform

SHAPES = {"qwen3 tp8": (18992, 4096), "llama-3 8b": (128256, 4096), "deepseek tp8": (16160, 7168)}


def _row_keys(num_rows: int):
    zeros = torch.zeros(num_rows, dtype=torch.int64)
    return torch.rand(num_rows) + 0.5, zeros, zeros.clone()


def build_lm_head_sample(platform: Platform, *, shape: str, num_rows: int, sample: bool,
                         dtype: torch.dtype = torch.bfloat16) -> None:
    vocab, hidden = SHAPES[shape]
    weight = torch.empty(vocab, hidden, dtype=dtype)
    lm_head_sample(torch.randn(num_rows, hidden).to(dtype), weight, *(_row_keys(num_rows) if sample else ()))


def build_logits_sample(platform: Platform, *, num_rows: int = 8, vocab: int = 151936) -> None:
    logits_sample(torch.empty(num_rows, vocab, dtype=torch.bfloat16), *_row_keys(num_rows))


def rows() -> list[tuple[str, object, bool, dict]]:
    """``(name, build, ci, kwargs)`` of each call."""
    out = []
    for shape in SHAPES:
        for num_rows in (2, 32, 256):   # 2, not 1: the JIT leaves num_rows unspecialised, the check would not
            for sample in (False, True):
                ci = shape == "qwen3 tp8" and (num_rows, sample) in ((2, False), (256, True))
                out.append((f"LM head + {'draw' if sample else 'argmax'} {shape} {num_rows} rows bf16",
                            build_lm_head_sample, ci, {"shape": shape, "num_rows": num_rows, "sample": sample}))
    out.append(("LM head + argmax qwen3 tp8 16 rows fp16", build_lm_head_sample, False,
                {"shape": "qwen3 tp8", "num_rows": 16, "sample": False, "dtype": torch.float16}))
    out.append(("draw from written logits 151936 tokens bf16", build_logits_sample, True, {}))
    return out
