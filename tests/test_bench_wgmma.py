"""``tripath bench wgmma``: its chain kernel compiles for sm_90 into unserialised asynchronous wgmma chains
(on the CPU machine, through ptxas), and the MLA decode's instruction floor follows from the measured rates."""

from __future__ import annotations

import pytest

from tripath.bench import check_compile as cc
from tripath.bench.compile_inspect import CompileJob


def _chain_job(n: int, a_from_smem: bool) -> CompileJob:
    import tripath.bench.wgmma as wg

    constexprs = [("ITERS", 64), ("N", n), ("K", wg.K), ("A_FROM_SMEM", a_from_smem)]
    signature = [("a_ptr", "*bf16"), ("b_ptr", "*bf16"), ("out_ptr", "*fp32")]
    signature += [(name, "constexpr") for name, _ in constexprs]
    return CompileJob("tripath.bench.wgmma:wgmma_chain_kernel", wg.__file__, "sm90", cc.TARGETS["sm90"].gpu,
                      signature, constexprs, [], [("num_warps", 4)], scenarios=[f"wgmma chain N={n}"])


@pytest.mark.parametrize("a_from_smem", [False, True])
def test_wgmma_chain_compiles_to_one_async_chain_a_round(a_from_smem):
    import tripath.bench.wgmma as wg

    (result,) = cc.compile_jobs([_chain_job(32, a_from_smem)])
    assert result.error is None, result.error
    assert result.matrix_kind == "wgmma" and result.matrix_instrs == wg.K // 16
    assert not result.serialised_wgmma and result.injected_wgmma_waits == 0
    assert result.spill_store_bytes == 0


def test_mla_decode_floor_from_rates():
    from tripath.bench.wgmma import mla_decode_floor_us

    rows = [dict(n=32, src="RS", per_sm=3, ns=10.0), dict(n=32, src="SS", per_sm=3, ns=15.0),
            dict(n=256, src="SS", per_sm=1, ns=80.0), dict(n=256, src="RS", per_sm=1, ns=1e9)]
    tile_ns = 20 * 10.0 + 16 * 15.0 + 4 * 80.0  # scores (RS, SS) and the two value warpgroups' products
    # 128 heads: two head blocks; 64 requests of 4096 rows: 128 tiles each; over 132 SMs
    assert mla_decode_floor_us(rows, 64, 4096, 128, 132) == pytest.approx(2 * 64 * 128 * tile_ns / 132 / 1e3)
    assert mla_decode_floor_us(rows, 8, 33, 64, 132) == pytest.approx(8 * 2 * tile_ns / 132 / 1e3)  # ragged tile
