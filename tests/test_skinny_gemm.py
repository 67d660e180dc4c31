"""skinny_gemm against float64 math: split and unsplit, ragged shapes, bias, the counters left at zero; its
launch settings; bad input."""

import pytest
import torch

from conftest import DEVICE
from tripath.ops import skinny_gemm as sg
from tripath.ops.skinny_gemm import MAX_ROWS, skinny_gemm, skinny_gemm_config


def _want(x, w, b):
    return x.double() @ w.double().T + (b.double() if b is not None else 0.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("rows,n,k,split_k,bias", [
    (1, 70, 256, None, True),     # default split: two 64-wide K steps a split
    (5, 130, 300, 3, False),      # ragged K (the last split short), N past a tile
    (17, 64, 512, 4, True),       # 32-row blocks
    (3, 40, 96, 1, True),         # one split: written straight to out
    (70, 33, 200, 2, False),      # two row blocks of 64 share each weight tile
])
def test_matches_float64(dtype, rows, n, k, split_k, bias):
    x = torch.randn(rows, k, dtype=dtype, device=DEVICE)
    w = torch.randn(n, k, dtype=dtype, device=DEVICE) / k ** 0.5
    b = torch.randn(n, dtype=dtype, device=DEVICE) if bias else None
    got = skinny_gemm(x, w, b, split_k=split_k)
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, _want(x, w, b).to(dtype), **tol)
    if DEVICE in sg._counters:
        assert not sg._counters[DEVICE].any(), "every tile's counter is set back to zero"


def test_split_results_do_not_depend_on_the_order_programs_finish():
    """The last program sums the partials in split order: two calls give the same bits."""
    x = torch.randn(4, 512, device=DEVICE)
    w = torch.randn(96, 512, device=DEVICE)
    a, b = skinny_gemm(x, w, split_k=4), skinny_gemm(x, w, split_k=4)
    assert torch.equal(a, b)


def test_given_counters_are_used_and_left_zero():
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    x, w = torch.randn(2, 256, device=DEVICE), torch.randn(100, 256, device=DEVICE)
    torch.testing.assert_close(skinny_gemm(x, w, split_k=2, counters=counters), (x.double() @ w.double().T).float(),
                               atol=1e-4, rtol=1e-4)
    assert not counters.any()
    with pytest.raises(ValueError, match="counters must be int32 with at least 2 entries"):
        skinny_gemm(x, w, split_k=2, counters=torch.zeros(1, dtype=torch.int32, device=DEVICE))


def test_config_covers_the_gpu_and_keeps_whole_k_steps():
    cfg = skinny_gemm_config(64, 1280, 4096, torch.bfloat16, 132)   # Qwen3's TP-8 QKV at 64 rows
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]) == (64, 64, 128)
    assert cfg["SPLIT_K"] * 20 >= 132 and cfg["k_per_split"] % 128 == 0
    assert cfg["SPLIT_K"] * cfg["k_per_split"] >= 4096 > (cfg["SPLIT_K"] - 1) * cfg["k_per_split"]
    assert skinny_gemm_config(1, 16384, 256, torch.float16, 132)["SPLIT_K"] == 1   # enough tiles already
    assert skinny_gemm_config(8, 64, 4096, torch.float32, 132, split_k=1000)["SPLIT_K"] == 64   # a K step each


def test_bad_input():
    x, w = torch.randn(2, 64, device=DEVICE), torch.randn(32, 64, device=DEVICE)
    with pytest.raises(ValueError, match=f"x must have 1 to {MAX_ROWS} rows"):
        skinny_gemm(torch.randn(MAX_ROWS + 1, 64, device=DEVICE), w)
    with pytest.raises(ValueError, match="weight"):
        skinny_gemm(x, torch.randn(32, 65, device=DEVICE))
    with pytest.raises(TypeError, match="weight has dtype"):
        skinny_gemm(x, w.half())
    with pytest.raises(ValueError, match="bias"):
        skinny_gemm(x, w, torch.randn(31, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous in their last dimension"):
        skinny_gemm(x, torch.randn(64, 32, device=DEVICE).t())
