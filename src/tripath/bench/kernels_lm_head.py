"""The LM head and the token draw at the presets' LM-head shapes (``tripath bench kernels --only lm_head``) and a
sweep of the fused kernel's configurations (``tripath bench tune --only lm_head``: :mod:`tripath.bench.tune`).

For each shape (a rank's vocabulary rows × the hidden size, bf16) and ``M`` = 1, 8, 64, 256 rows: the
unfused paths (``torch.matmul`` then ``argmax``; the same GEMM then the Gumbel draw from the written logits,
:func:`tripath.ops.lm_head_sample.logits_sample`) against the fused one
(:func:`tripath.ops.lm_head_sample.lm_head_sample`, greedy and with a temperature). Times are GPU time of
CUDA-graph replays; the rate is the weights' bytes (read once) over it, against the copy bandwidth measured
in the same run; the last column is the speed-up over ``torch.matmul`` + ``argmax``. Each shape's fused
greedy tokens are checked against the argmax of the logits first (a near tie may differ: counted, not
failed, as both accumulate in fp32 in different orders).
"""

from __future__ import annotations

import functools
import itertools

import torch

from tripath.bench.kernel_timing import Report, Row, bench_graph
from tripath.ops.lm_head_sample import lm_head_sample, logits_sample

# name -> (vocabulary rows of a rank, hidden size)
SHAPES = {"llama-3.1-8b (128256 × 4096)": (128256, 4096),
          "qwen3-235b TP-8 shard (18992 × 4096)": (18992, 4096),
          "deepseek-r1 TP-8 shard (16160 × 7168)": (16160, 7168)}
ROWS = (1, 8, 64, 256)
BASELINE = "torch.matmul + argmax"


def lm_head_inputs(vocab: int, hidden: int, rows: int):
    dev = torch.device("cuda")
    weight = torch.randn(vocab, hidden, dtype=torch.bfloat16, device=dev) * hidden ** -0.5
    h = torch.randn(rows, hidden, dtype=torch.bfloat16, device=dev)
    keys = (torch.full((rows,), 0.8, device=dev), torch.arange(rows, device=dev),
            torch.full((rows,), 1000, dtype=torch.int64, device=dev))
    return weight, h, keys


def bench_lm_head(report: Report) -> None:
    for (name, (vocab, hidden)), rows in itertools.product(SHAPES.items(), ROWS):
        weight, h, keys = lm_head_inputs(vocab, hidden, rows)
        nbytes = vocab * hidden * 2
        shape = f"{name}, M = {rows}"
        fused = lm_head_sample(h, weight).tokens
        differ = int((fused != torch.nn.functional.linear(h, weight).argmax(dim=-1)).sum())
        if differ:
            report.errors.append(f"lm_head {shape}: {differ} of {rows} greedy tokens differ from argmax (near ties?)")
        runs = {BASELINE: functools.partial(_matmul_argmax, h, weight),
                "torch.matmul + Gumbel draw (logits_sample)": functools.partial(_matmul_draw, h, weight, keys),
                "tripath lm_head_sample, greedy": functools.partial(lm_head_sample, h, weight),
                "tripath lm_head_sample, temperature": functools.partial(lm_head_sample, h, weight, *keys)}
        for impl, fn in runs.items():
            us = bench_graph(fn)
            report.rows.append(Row("lm_head", shape, impl, us, nbytes / (us * 1e-6) / 1e9, "GB/s"))
        del weight, runs
        torch.cuda.empty_cache()


def _matmul_argmax(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(h, weight).argmax(dim=-1)


def _matmul_draw(h: torch.Tensor, weight: torch.Tensor, keys: tuple):
    return logits_sample(torch.nn.functional.linear(h, weight), *keys)


def format_lm_head(rows: list[Row], copy_gbps: float, spread) -> list[str]:
    base = {r.shape: r.us for r in rows if r.impl == BASELINE}
    lines = ["| shape | implementation | time | GB/s | % of copy | speed-up over matmul + argmax |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r.shape} | {r.impl} | {r.us:.1f} µs{spread(r)} | {r.metric:.0f} | "
              f"{100 * r.metric / copy_gbps:.0f}% | {base[r.shape] / r.us:.2f}× |" for r in rows]
    return lines
