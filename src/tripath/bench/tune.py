"""``tripath bench tune``: sweep the launch configurations of the decode, prefill and LM-head kernels on this GPU.

Prints, per shape, every configuration's time and bandwidth or FLOP rate, best first, so the tables in
:mod:`tripath.ops._configs` can be set from measurements. Candidates are installed by replacing the config
functions for the duration of one measurement.
"""

from __future__ import annotations

import functools
import itertools
from contextlib import contextmanager

import torch

from tripath.bench import require_gpu
from tripath.bench.kernel_timing import bench_eager, bench_graph, random_table
from tripath.bench.kernels_lm_head import ROWS as LM_HEAD_ROWS
from tripath.bench.kernels_lm_head import SHAPES as LM_HEAD_SHAPES
from tripath.bench.kernels_lm_head import lm_head_inputs
from tripath.ops import _configs, _mla_configs, mla_decode, paged_decode, varlen_attention
from tripath.ops.lm_head_sample import lm_head_sample
from tripath.ops.kv_cache import allocate_kv_cache


@contextmanager
def _patched(name: str, value, module=_configs):
    old = getattr(module, name)
    setattr(module, name, lambda *a, **k: dict(value))
    try:
        yield
    finally:
        setattr(module, name, old)


def _measure(config_fn: str, cfg: dict, fn, label: str, lines: list[str], module=_configs, timer=None):
    """Median µs of ``fn`` (by ``timer``, default eager ``bench_eager``) with ``config_fn`` returning ``cfg``; None
    (and a line saying why) when the configuration does not compile or run (e.g. out of shared memory)."""
    try:
        with _patched(config_fn, cfg, module):
            return bench_eager(fn, reps_ms=60) if timer is None else timer(fn)
    except Exception as exc:
        lines.append(f"{label} {cfg}: {type(exc).__name__}")
        return None


def tune_decode(shapes=((64, 4096), (64, 16384), (8, 32768)), layouts=("nhd",), top: int = 6) -> list[str]:
    lines = []
    dev = torch.device("cuda")
    for (batch, ctx), layout in itertools.product(shapes, layouts):
        table, nb = random_table(batch, ctx, 16, dev)
        kc, vc = allocate_kv_cache(nb, 16, 8, 128, dtype=torch.bfloat16, layout=layout, device=dev)
        kc.normal_()
        vc.normal_()
        q = torch.randn(batch, 32, 128, dtype=torch.bfloat16, device=dev)
        sl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        nbytes = 2 * batch * ctx * 8 * 128 * 2
        splits_options = (1, 2) if batch * 8 >= 264 else (8, 16)
        results = []
        for bn, warps, stages, splits in itertools.product((32, 64), (4,), (2, 3, 4), splits_options):
            cfg = {"BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
            us = _measure("decode_config", cfg,
                          lambda: paged_decode(q, kc, vc, table, sl, layout=layout, num_splits=splits),
                          f"decode {batch}x{ctx} {layout} splits={splits}", lines, timer=bench_graph)
            if us is not None:
                results.append((us, cfg, splits))
        results.sort(key=lambda r: r[0])
        for us, cfg, splits in results[:top]:
            lines.append(f"decode {batch}x{ctx} {layout}: {us:8.1f} us {nbytes / us / 1e3:6.0f} GB/s  {cfg} "
                         f"splits={splits}")
        del kc, vc
        torch.cuda.empty_cache()
    return lines


# Prefill candidates (BLOCK_M, BLOCK_N, num_warps, num_stages), each with and without tensor descriptors.
PREFILL_CANDIDATES = ((128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 2),
                      (128, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2))


def tune_prefill(shapes=((1, 8192), (8, 2048), (16, 512)), top: int = 8) -> list[str]:
    lines = []
    dev = torch.device("cuda")
    for batch, seq in shapes:
        q = torch.randn(batch * seq, 32, 128, dtype=torch.bfloat16, device=dev)
        k = torch.randn(batch * seq, 8, 128, dtype=torch.bfloat16, device=dev)
        v = torch.randn_like(k)
        cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=dev)
        flops = batch * 4 * seq * seq * 32 * 128 / 2
        results = []
        for (bm, bn, warps, stages), tma in itertools.product(PREFILL_CANDIDATES, (True, False)):
            cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, "TMA": tma}
            us = _measure("varlen_config", cfg, lambda: varlen_attention(q, k, v, cu, cu, seq, seq, causal=True),
                          f"prefill {batch}x{seq}", lines)
            if us is not None:
                results.append((us, cfg))
        results.sort(key=lambda r: r[0])
        for us, cfg in results[:top]:
            lines.append(f"prefill {batch}x{seq}: {us:8.1f} us {flops / us / 1e6:6.0f} TF/s  {cfg}")
    return lines


# MLA decode candidates (BLOCK_H, BLOCK_N, num_warps, num_stages, V_PARTS, TMA, SWAP_AB, PREFETCH), and split
# counts per shape.
MLA_FEW_HEADS = ((16, 32, 4, 2, 1, False, False, 0), (16, 32, 4, 3, 1, True, False, 0),
                 (16, 64, 4, 2, 1, True, True, 0), (16, 64, 4, 2, 1, True, True, 2),
                 (16, 64, 4, 2, 1, True, True, 3))
MLA_MANY_HEADS = ((128, 64, 8, 1, 2, False, False, 0), (128, 32, 8, 2, 2, True, False, 0),
                  (64, 64, 8, 2, 1, True, False, 0), (64, 32, 8, 2, 1, True, False, 0))


def tune_mla(top: int = 8) -> list[str]:
    """Absorbed MLA decode (bf16 cache, block 64): 16 heads (memory-bound) and 128 heads (compute-bound),
    GPU time of CUDA-graph replays (eager timing of a ~100 µs launch measures the host as well)."""
    from tripath.bench.kernels_mla import mla_table
    lines = []
    dev = torch.device("cuda")
    shapes = ((16, 64, 4096, (2, 4)), (16, 64, 16384, (2, 4)), (16, 8, 32768, (16, 32)), (128, 64, 4096, (1, 2)))
    for heads, batch, ctx, splits_options in shapes:
        table, cache = mla_table(batch, ctx, 64, dev)
        q = torch.randn(batch, heads, 576, dtype=torch.bfloat16, device=dev)
        sl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        nbytes, flops = batch * ctx * 576 * 2, 2 * batch * heads * ctx * 1088
        results = []
        for (bh, bn, warps, stages, parts, tma, swap, prefetch), splits in itertools.product(
                MLA_FEW_HEADS if heads <= 32 else MLA_MANY_HEADS, splits_options):
            cfg = {"BLOCK_H": bh, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, "V_PARTS": parts,
                   "TMA": tma, "SWAP_AB": swap, "PREFETCH": prefetch}
            us = _measure("mla_decode_config", cfg,
                          lambda: mla_decode(q, cache, table, sl, kv_lora_rank=512, sm_scale=0.07,
                                             num_splits=splits, variant="packed"),
                          f"mla H{heads} {batch}x{ctx} splits={splits}", lines, _mla_configs, timer=bench_graph)
            if us is not None:
                results.append((us, cfg, splits))
        results.sort(key=lambda r: r[0])
        for us, cfg, splits in results[:top]:
            lines.append(f"mla H{heads} {batch}x{ctx}: {us:8.1f} us {nbytes / us / 1e3:6.0f} GB/s "
                         f"{flops / us / 1e6:5.0f} TF/s  {cfg} splits={splits}")
        del cache
        torch.cuda.empty_cache()
    return lines


def tune_lm_head(top: int = 6) -> list[str]:
    """The fused LM head's configurations at each shape and row count (``BLOCK_M`` the rows' tile, or 32 and 64
    from 64 rows; token and hidden tiles, warps, stages), greedy and with a temperature, best first."""
    lines = []
    for (name, (vocab, hidden)), rows, sample in itertools.product(LM_HEAD_SHAPES.items(), LM_HEAD_ROWS, (False, True)):
        weight, h, keys = lm_head_inputs(vocab, hidden, rows)
        args = keys if sample else ()
        results = []
        block_ms = (16,) if rows <= 16 else (32,) if rows <= 32 else (32, 64)
        for bm, bv, bk, warps, stages in itertools.product(block_ms, (64, 128, 256), (64, 128), (4, 8), (3, 4)):
            cfg = {"BLOCK_M": bm, "BLOCK_V": bv, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
            us = _measure("lm_head_sample_config", cfg, functools.partial(lm_head_sample, h, weight, *args),
                          f"lm_head {name} M={rows}", lines, timer=bench_graph)
            if us is not None:
                results.append((us, cfg))
        results.sort(key=lambda r: r[0])
        kind = "temperature" if sample else "greedy"
        for us, cfg in results[:top]:
            lines.append(f"lm_head {name} M={rows} {kind}: {us:8.1f} us {vocab * hidden * 2 / us / 1e3:6.0f} GB/s "
                         f"{cfg}")
        del weight
        torch.cuda.empty_cache()
    return lines


def main_tune(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="tripath bench tune", description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=["decode", "prefill", "mla"],
                        choices=["decode", "prefill", "mla", "lm_head"])
    args = parser.parse_args(argv)
    require_gpu(parser)
    if "decode" in args.only:
        print("\n".join(tune_decode()), flush=True)
    if "prefill" in args.only:
        print("\n".join(tune_prefill()), flush=True)
    if "mla" in args.only:
        print("\n".join(tune_mla()), flush=True)
    if "lm_head" in args.only:
        print("\n".join(tune_lm_head()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main_tune())
