"""``tripath bench wgmma``: the rate of chained Hopper ``wgmma`` instructions per shape, and the MLA decode's
instruction floor (sm_90, Gluon).

One warpgroup a CTA issues ``ITERS`` rounds of ``K / 16`` chained ``m64nNk16`` products (bf16 in, fp32
accumulate) into one accumulator and waits for them at the end of each round, as the score warpgroup of
:mod:`tripath.kernels.mla_decode_sm90` does per tile. ``A`` comes from registers (``RS``) or shared memory
(``SS``); ``B`` from shared memory. With ``c`` CTAs an SM (``c`` warpgroups sharing its tensor cores) the
time an instruction occupies an SM is ``t = T / (c · ITERS · K / 16)`` for a kernel time ``T``.

The MLA decode (64 heads a program, 32-row cache tiles) issues per tile 20 ``RS`` and 16 ``SS``
``m64n32k16`` score products and 4 ``SS`` ``m64n256k16`` value products (two value warpgroups, 256 columns
and 32 rows each); its instruction floor is ``tiles an SM × (20 t_RS32 + 16 t_SS32 + 4 t_SS256)``, the time
its tensor cores would need if they never waited.
"""

from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from tripath.bench import emit_report

ROWS = gl.constexpr(64)  # wgmma M: one warpgroup's rows


@gluon.jit
def wgmma_chain_kernel(a_ptr, b_ptr, out_ptr, ITERS: gl.constexpr, N: gl.constexpr, K: gl.constexpr,
                       A_FROM_SMEM: gl.constexpr):
    """``ITERS`` rounds of ``acc += A [64, K] · Bᵀ`` (``B [N, K]``, K-major) as ``K / 16`` chained ``wgmma``,
    each round awaited; ``out [grid, 64, N]`` receives the accumulator (so nothing is optimised away)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, N, 16])
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    cols = gl.expand_dims(gl.arange(0, K, layout=gl.SliceLayout(0, load_layout)), 0)
    a_rows = gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(1, load_layout)), 1)
    b_rows = gl.expand_dims(gl.arange(0, N, layout=gl.SliceLayout(1, load_layout)), 1)
    a_tile = gl.load(a_ptr + a_rows * K + cols)
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [N, K], gl.NVMMASharedLayout.get_default_for([N, K], gl.bfloat16),
                                       gl.load(b_ptr + b_rows * K + cols))
    acc = gl.zeros([ROWS, N], gl.float32, acc_layout)
    if A_FROM_SMEM:
        a_op = gl.allocate_shared_memory(gl.bfloat16, [ROWS, K],
                                         gl.NVMMASharedLayout.get_default_for([ROWS, K], gl.bfloat16), a_tile)
    else:
        a_op = gl.convert_layout(a_tile, gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2))
    fence_async_shared()
    for _ in range(ITERS):
        acc = warpgroup_mma_wait(num_outstanding=0,
                                 deps=(warpgroup_mma(a_op, b_smem.permute((1, 0)), acc, is_async=True), ))
    o_rows = gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout)), 1)
    o_cols = gl.expand_dims(gl.arange(0, N, layout=gl.SliceLayout(0, acc_layout)), 0)
    gl.store(out_ptr + gl.program_id(0) * ROWS * N + o_rows * N + o_cols, acc)


# (N, A operand, CTAs an SM) measured: the MLA decode's shapes at its occupancy (three warpgroups an SM), and
# one warpgroup an SM from N = 32 to 256 for the rate per width.
CASES = tuple((n, src, 1) for n in (32, 64, 128, 256) for src in ("RS", "SS")) + tuple(
    (n, src, 3) for n in (32, 64) for src in ("RS", "SS"))
K = 256
ITERS = 4000


def measure(cases=CASES, iters: int = ITERS) -> list[dict]:
    """Kernel time and, per case, ``ns`` an instruction occupies an SM, TF/s over the whole GPU."""
    from tripath.bench.kernels import _bench

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    a = torch.randn(64, K, device=dev, dtype=torch.bfloat16) * 0.01
    rows = []
    for n, src, per_sm in cases:
        b = torch.randn(n, K, device=dev, dtype=torch.bfloat16) * 0.01
        grid = sms * per_sm
        out = torch.empty(grid, 64, n, device=dev)

        def launch():
            wgmma_chain_kernel[(grid, )](a, b, out, iters, n, K, src == "SS", num_warps=4)

        launch()
        torch.cuda.synchronize()
        us = _bench(launch, reps_ms=50)
        instructions_per_sm = per_sm * iters * K // 16
        rows.append(dict(n=n, src=src, per_sm=per_sm, us=us, ns=us * 1e3 / instructions_per_sm,
                         tflops=grid * iters * 2 * 64 * n * K / (us * 1e-6) / 1e12))
    return rows


def mla_decode_floor_us(rows: list[dict], batch: int, ctx: int, num_heads: int, sms: int) -> float:
    """Instruction floor of the 64/128-head Gluon MLA decode: its tiles (``num_heads / 64`` head blocks of
    ``⌈ctx / 32⌉`` tiles a request) spread evenly over the SMs, times the per-tile instruction time at three
    warpgroups an SM (``m64n32k16``) and one (``m64n256k16``, which one warpgroup already saturates)."""
    t = {(r["n"], r["src"], r["per_sm"]): r["ns"] for r in rows}
    tile_ns = 20 * t[(32, "RS", 3)] + 16 * t[(32, "SS", 3)] + 4 * t[(256, "SS", 1)]
    tiles = (num_heads // 64) * batch * math.ceil(ctx / 32)
    return tiles * tile_ns / sms / 1e3


def format_report(rows: list[dict], sms: int, device_name: str) -> str:
    lines = [f"# wgmma rates ({device_name}, {sms} SMs; K = {K} a round, {ITERS} rounds, bf16 -> fp32)", "",
             "| shape | A from | warpgroups an SM | kernel µs | ns an instruction occupies an SM | TF/s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| m64n{r['n']}k16 | {'registers' if r['src'] == 'RS' else 'shared memory'} | {r['per_sm']} | "
                     f"{r['us']:.0f} | {r['ns']:.2f} | {r['tflops']:.0f} |")
    lines += ["", "| MLA decode (Gluon, bf16) | instruction floor µs | at 520 TF/s µs |", "|---|---|---|"]
    for heads, batch, ctx in ((128, 64, 4096), (128, 8, 32768), (64, 64, 4096)):
        flops = 2 * batch * heads * ctx * (576 + 512)
        lines.append(f"| H{heads} {batch} × {ctx} | {mla_decode_floor_us(rows, batch, ctx, heads, sms):.1f} | "
                     f"{flops / 520e12 * 1e6:.1f} |")
    return "\n".join(lines)


def main_wgmma(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="tripath bench wgmma", description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the markdown tables to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("tripath bench wgmma needs an sm_90 GPU (Hopper wgmma)")
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    emit_report(format_report(measure(), sms, torch.cuda.get_device_name()), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main_wgmma())
