"""The split-K skinny GEMM (``tripath.ops.linear``) against float64 math: random shapes, splits that do and do
not divide K, bias, poisoned outputs, the merge counters left at zero; the routes chosen per row class; bad
input."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import DEVICE
from tripath.ops import linear as linear_ops
from tripath.platform import H200
from tripath.ops.linear import MAX_SKINNY_ROWS, SkinnyConfig, row_class, skinny_candidates, skinny_config, skinny_linear


def reference(x, w, bias):
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


def counters_zero() -> bool:
    return all(int(c.abs().sum()) == 0 for c in linear_ops._counters.values())


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 40), n=st.integers(2, 90), k=st.integers(1, 200), splits=st.integers(1, 5),
       block_n=st.sampled_from([16, 32]), block_k=st.sampled_from([16, 32]), bias=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_skinny_linear_matches_float64(rows, n, k, splits, block_n, block_k, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen, dtype=torch.float16).to(DEVICE)
    w = torch.randn(n, k, generator=gen, dtype=torch.float16).to(DEVICE)
    b = torch.randn(n, generator=gen, dtype=torch.float16).to(DEVICE) if bias else None
    block_m = 16 if rows <= 16 else 64
    got = skinny_linear(x, w, b, SkinnyConfig(block_m, block_n, block_k, splits, num_stages=2))
    torch.testing.assert_close(got.double(), reference(x, w, b), atol=2e-2 + 2e-3 * k ** 0.5, rtol=2e-3)
    assert counters_zero()


def test_split_partials_are_summed_in_split_order():
    """The last program of a tile sums the splits in order, so two launches give the same bits."""
    x = torch.randn(9, 256, dtype=torch.float16, device=DEVICE)
    w = torch.randn(48, 256, dtype=torch.float16, device=DEVICE)
    config = SkinnyConfig(16, 16, 32, 8, num_stages=2)
    first = skinny_linear(x, w, config=config)
    assert torch.equal(first, skinny_linear(x, w, config=config))
    torch.testing.assert_close(first.double(), reference(x, w, None), atol=0.1, rtol=2e-3)


def test_every_output_is_written():
    """Outputs come from a fresh allocation: poison the allocator's memory first, then check every value."""
    torch.full((4096,), float("nan"), dtype=torch.float16, device=DEVICE)
    x = torch.randn(33, 64, dtype=torch.float16, device=DEVICE)
    w = torch.randn(100, 64, dtype=torch.float16, device=DEVICE)
    got = skinny_linear(x, w, config=SkinnyConfig(64, 32, 32, 2, num_stages=2))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), reference(x, w, None), atol=5e-2, rtol=2e-3)


def test_row_classes_and_default_configs():
    assert [row_class(m) for m in (1, 16, 17, 64, 65, 256)] == [16, 16, 32, 64, 128, 256]
    for rows in (1, 8, 64, 256):
        for n, k in ((1280, 4096), (4096, 1024), (28672, 4096)):
            c = skinny_config(rows, n, k, H200)
            assert c.block_m <= row_class(rows) and 1 <= c.splits <= linear_ops.MAX_SPLITS
            assert c.splits * c.block_k <= -(-k // c.block_k) * c.block_k
            candidates = skinny_candidates(rows, n, k, H200)
            assert candidates[0] == c and len({x.splits for x in candidates}) == len(candidates)
            assert all(dataclasses.replace(x, splits=c.splits) == c for x in candidates)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU's path without the interpreter")
def test_cpu_without_the_interpreter_runs_f_linear(torch_paths_and_validation):
    x = torch.randn(3, 40, dtype=torch.float16)
    w = torch.randn(24, 40, dtype=torch.float16)
    assert torch.equal(skinny_linear(x, w), torch.nn.functional.linear(x, w))


def test_bad_input():
    w = torch.randn(8, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="weight's K = 16"):
        skinny_linear(torch.randn(2, 8, dtype=torch.float16, device=DEVICE), w)
    with pytest.raises(TypeError, match="x has dtype torch.float32"):
        skinny_linear(torch.randn(2, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match=f"1 to {MAX_SKINNY_ROWS}"):
        skinny_linear(torch.randn(MAX_SKINNY_ROWS + 1, 16, dtype=torch.float16, device=DEVICE), w)
    with pytest.raises(ValueError, match="bias has shape"):
        skinny_linear(torch.randn(2, 16, dtype=torch.float16, device=DEVICE), w,
                      torch.randn(7, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous in their last dimension"):
        skinny_linear(torch.randn(16, 2, dtype=torch.float16, device=DEVICE).t(), w)


@pytest.mark.gpu
def test_routes_choose_per_shape_and_class_and_serve_graph_replays():
    """``choose_routes`` times both GEMMs per shape and row class and routes ``linear`` accordingly; a routed
    call matches ``F.linear`` in bf16, inside a CUDA graph too (the counters outlive the replays)."""
    from tripath.ops.linear import forget_routes, linear
    from tripath.ops.linear_routes import choose_routes

    w = torch.randn(1280, 4096, dtype=torch.bfloat16, device="cuda") / 64
    b = torch.randn(1280, dtype=torch.bfloat16, device="cuda")
    try:
        timings = choose_routes([(w, b)], max_rows=64)
        assert [t.rows for t in timings] == [16, 32, 64] and all(t.cublas_us > 0 and t.triton_us > 0 for t in timings)
        for t in timings:
            assert ((torch.device("cuda", torch.cuda.current_device()), 1280, 4096, torch.bfloat16, t.rows)
                    in linear_ops._routes) == t.triton
        linear_ops.set_route(w.device, 1280, 4096, torch.bfloat16, 64, skinny_config(64, 1280, 4096, H200))
        x = torch.randn(50, 4096, dtype=torch.bfloat16, device="cuda")
        want = torch.nn.functional.linear(x.float(), w.float(), b.float())
        torch.testing.assert_close(linear(x, w, b).float(), want, atol=3e-2, rtol=2e-2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = linear(x, w, b)
        x.copy_(torch.randn_like(x))
        for _ in range(3):
            graph.replay()
        want = torch.nn.functional.linear(x.float(), w.float(), b.float())
        torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=2e-2)
        assert counters_zero()
    finally:
        forget_routes()


@pytest.mark.gpu
def test_engine_times_every_projection_shape_and_compiles_nothing_after_start():
    from tripath.engine import LLM, SamplingParams

    llm = LLM("tiny-qwen2", max_num_seqs=8, skinny_gemms="auto")
    try:
        shapes = {(w.shape[0], w.shape[1]) for w, _ in llm.model.projections()}
        routes = llm.core.info().gemm_routes
        assert {(n, k) for n, k, *_ in routes} == shapes
        assert {rows for _, _, rows, *_ in routes} == {16, 32, 64, 128, 256}
        prompts = [[5 + i, 9, 11, 13] * (1 + i) for i in range(12)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
        assert llm.num_compiled_since_start == 0
    finally:
        llm.close()
