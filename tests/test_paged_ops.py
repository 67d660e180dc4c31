"""paged_decode and unified_attention (Triton) against their references; random block tables."""

import pytest
import torch

from conftest import DEVICE
from helpers import FP8_TOL, TOL, cu_seqlens, filled_cache, poison
from tripath.ops import paged_decode, unified_attention
from tripath.ops import reference as R

FP8 = torch.float8_e4m3fn

# (hq, hkv, head_size, block_size, seq_lens, layout, cache dtype, options)
DECODE_CASES = [
    (4, 4, 64, 16, [1, 18, 70], "nhd", None, {}),
    (8, 2, 128, 32, [1328, 5], "nhd", None, {}),
    (8, 1, 80, 16, [33, 129], "shuffled", None, {}),
    (5, 1, 96, 16, [40], "nhd", None, {"window_left": 9}),
    (4, 2, 192, 16, [50, 3], "shuffled", None, {"softcap": 2.0}),
    (8, 8, 256, 16, [20], "nhd", None, {"alibi": True}),
    (4, 1, 112, 32, [64, 31], "nhd", None, {"sinks": True}),
    (4, 2, 64, 16, [90, 7], "nhd", FP8, {}),
    (4, 2, 64, 16, [45, 100], "shuffled", FP8, {"sinks": True, "window_left": 20}),
    (4, 4, 64, 1, [7, 3], "nhd", None, {}),
]


def _opts(opts, hq):
    return dict(window_left=opts.get("window_left", -1), softcap=opts.get("softcap", 0.0),
                alibi_slopes=torch.rand(hq, device=DEVICE) if opts.get("alibi") else None,
                sinks=torch.randn(hq, device=DEVICE) if opts.get("sinks") else None)


def _scales(cache_dtype):
    if cache_dtype is None:
        return None, None
    return torch.tensor([0.05], device=DEVICE), torch.tensor([0.04], device=DEVICE)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"h{c[0]}/{c[1]}-d{c[2]}-b{c[3]}-{c[5]}"
                         f"{'-fp8' if c[6] else ''}-{'-'.join(c[7]) or 'plain'}")
def test_paged_decode(case, num_splits):
    hq, hkv, d, bs, seq_lens, layout, cache_dtype, opts = case
    dtype = torch.float16
    k_scale, v_scale = _scales(cache_dtype)
    k_cache, v_cache, bt, _, _ = filled_cache(seq_lens, hkv, d, block_size=bs, dtype=dtype, cache_dtype=cache_dtype,
                                              layout=layout, device=DEVICE, k_scale=k_scale, v_scale=v_scale)
    q = torch.randn(len(seq_lens), hq, d, dtype=dtype, device=DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    kw = _opts(opts, hq)
    out = poison(q.shape, dtype, DEVICE)
    got, lse = paged_decode(q, k_cache, v_cache, bt, sl, layout=layout, k_scale=k_scale, v_scale=v_scale,
                            num_splits=num_splits, out=out, return_lse=True, **kw)
    want, want_lse = R.paged_decode_ref(q, k_cache, v_cache, bt, sl, layout=layout, k_scale=k_scale,
                                        v_scale=v_scale, return_lse=True, **kw)
    tol = TOL[dtype] if cache_dtype is None else FP8_TOL
    torch.testing.assert_close(got.float(), want.float(), **tol)
    torch.testing.assert_close(lse, want_lse, atol=2e-3, rtol=2e-3)


def test_paged_decode_default_splits_and_empty_split():
    # More splits than tiles: some splits are empty and must not disturb the merge.
    k_cache, v_cache, bt, _, _ = filled_cache([3, 40], 2, 64, device=DEVICE)
    q = torch.randn(2, 4, 64, dtype=torch.float16, device=DEVICE)
    sl = torch.tensor([3, 40], dtype=torch.int32, device=DEVICE)
    want = R.paged_decode_ref(q, k_cache, v_cache, bt, sl)
    for splits in (None, 8):
        got = paged_decode(q, k_cache, v_cache, bt, sl, num_splits=splits)
        torch.testing.assert_close(got.float(), want.float(), **TOL[torch.float16])


def test_paged_decode_grid_puts_a_requests_kv_heads_side_by_side():
    """The grid is ``(kv_heads, requests, splits)``: the programs running together read whole cache rows."""
    from tripath.triton_internals import capture_launches

    k_cache, v_cache, bt, _, _ = filled_cache([300, 20, 5], 4, 64, block_size=16, device=DEVICE)
    q = torch.randn(3, 8, 64, dtype=torch.float16, device=DEVICE)
    sl = torch.tensor([300, 20, 5], dtype=torch.int32, device=DEVICE)
    with capture_launches() as records:
        paged_decode(q, k_cache, v_cache, bt, sl, num_splits=2)
    assert [r.grid for r in records if r.name == "paged_decode_kernel"] == [(4, 3, 2)]


@pytest.mark.parametrize("features", [{}, {"sinks": True}, {"window_left": 600}])
def test_paged_decode_splits_follow_each_request_on_a_wide_table(monkeypatch, features):
    """A block table far wider than the contexts (a CUDA graph's spans the longest context served): the
    launch's split count is an upper bound, each request takes the splits its own length calls for (decided
    in the kernel), one-split requests are written without the merge, and every output is right."""
    import tripath.ops.attention as attention_ops
    from tripath.ops import _configs

    seq_lens = [3, 40, 700, 16, 257]
    k_cache, v_cache, bt, _, _ = filled_cache(seq_lens, 2, 64, device=DEVICE)
    wide = torch.zeros(len(seq_lens), 256, dtype=torch.int32, device=DEVICE)  # 4096 tokens a row
    wide[:, :bt.shape[1]] = bt
    q = torch.randn(len(seq_lens), 4, 64, dtype=torch.float16, device=DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    opts = {}
    if features.get("sinks"):
        opts["sinks"] = torch.randn(4, device=DEVICE)
    if "window_left" in features:
        opts["window_left"] = features["window_left"]
    want = R.paged_decode_ref(q, k_cache, v_cache, bt, sl, **opts)
    launched = []
    real = attention_ops.launch
    monkeypatch.setattr(attention_ops, "launch", lambda kernel, grid, *a, **k: launched.append((kernel, k)) or
                        real(kernel, grid, *a, **k))
    got = paged_decode(q, k_cache, v_cache, wide, sl, out=poison(q.shape, q.dtype, DEVICE), **opts)
    torch.testing.assert_close(got.float(), want.float(), **TOL[torch.float16])
    kwargs = launched[0][1]
    block_n, num_splits = kwargs["BLOCK_N"], kwargs["num_splits"]
    assert num_splits > 1 and (kwargs["fill_splits"], kwargs["min_split_tiles"]) == (1, _configs.MIN_SPLIT_TILES)
    first = [max(n - 1 - features["window_left"], 0) // block_n * block_n if "window_left" in features else 0
             for n in seq_lens]
    tiles = [-(-(n - f) // block_n) for n, f in zip(seq_lens, first)]
    expected = [min(num_splits, max(1, t // _configs.MIN_SPLIT_TILES)) for t in tiles]
    assert kwargs["splits_used_ptr"].tolist() == expected and 1 in expected and max(expected) > 1
    # The caller's own count is every request's.
    launched.clear()
    got = paged_decode(q, k_cache, v_cache, wide, sl, num_splits=3, out=poison(q.shape, q.dtype, DEVICE), **opts)
    torch.testing.assert_close(got.float(), want.float(), **TOL[torch.float16])
    assert launched[0][1]["splits_used_ptr"].tolist() == [3] * len(seq_lens)


@pytest.mark.gpu
def test_paged_decode_captured_in_a_graph_takes_short_tiles_and_fits_splits_on_replay(monkeypatch):
    """Captured with a table as wide as 131072 tokens under ``tables_span_max_len`` (the engine's decode
    graphs), the launch takes the 64-token tiles and each replay is right for the lengths it is given."""
    import tripath.ops.attention as attention_ops

    seq_lens = [1030] * 60 + [20000, 3, 17, 4096]
    k_cache, v_cache, bt, _, _ = filled_cache(seq_lens, 8, 128, dtype=torch.bfloat16, device="cuda")
    wide = torch.zeros(len(seq_lens), 131072 // 16, dtype=torch.int32, device="cuda")
    wide[:, :bt.shape[1]] = bt
    q = torch.randn(len(seq_lens), 32, 128, dtype=torch.bfloat16, device="cuda")
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    launched = []
    real = attention_ops.launch
    monkeypatch.setattr(attention_ops, "launch", lambda kernel, grid, *a, **k: launched.append(k) or
                        real(kernel, grid, *a, **k))
    graph = torch.cuda.CUDAGraph()
    with attention_ops.tables_span_max_len():
        paged_decode(q, k_cache, v_cache, wide, sl, out=out)   # compile outside the capture
        with torch.cuda.graph(graph):
            paged_decode(q, k_cache, v_cache, wide, sl, out=out)
    assert launched[0]["BLOCK_N"] == 64 and launched[0]["num_splits"] == 1  # 64 × 8 programs fill the GPU
    for lens in (seq_lens, [max(1, n // 3) for n in seq_lens]):   # each within what its row's cache holds
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        want = R.paged_decode_ref(q, k_cache, v_cache, bt, sl)
        torch.testing.assert_close(out.float(), want.float(), **TOL[torch.bfloat16])


def test_device_split_bounds_on_the_h200():
    """128-token tiles: the fewest splits that fill 2.5 waves of the H200's 132 SMs, 16 tiles a split; 64-token
    tiles: the request's own length alone."""
    from tripath.ops import _configs
    from tripath.platform import H200

    assert _configs.device_split_bounds(H200, 64, 8, True) == (1, 16)   # 512 programs fill it already
    assert _configs.device_split_bounds(H200, 64, 1, True) == (6, 16)   # 64 programs: 6 splits each
    assert _configs.device_split_bounds(H200, 64, 1, False) == (1, 4)


def test_paged_decode_long_tiles_chosen_and_correct(monkeypatch):
    """The 128-token tiles: chosen for the H200 where the rule says so (launch recorded, a cache of one
    block standing in for 64 × 16384 tokens), and correct on ragged lengths (run with those tiles here)."""
    import tripath.ops.attention as attention_ops
    from tripath.ops import _configs
    from tripath.triton_internals import capture_launches
    from tripath.platform import H200, override_platform
    k_cache, v_cache = torch.zeros(2, 1, 16, 8, 128, dtype=torch.bfloat16, device=DEVICE)
    table = torch.zeros(64, 1024, dtype=torch.int32, device=DEVICE)
    lens = torch.full((64,), 16384, dtype=torch.int32, device=DEVICE)
    q = torch.zeros(64, 32, 128, dtype=torch.bfloat16, device=DEVICE)
    with override_platform(H200), capture_launches() as records:
        paged_decode(q, k_cache, v_cache, table, lens)
        paged_decode(q[:, :, :64], k_cache[..., :64], v_cache[..., :64], table, lens)  # 64-dim heads: no
        paged_decode(q, k_cache, v_cache, table, lens, concurrent=True)  # beside other launches: no
        with attention_ops.tables_span_max_len():  # a graph's table, wider than any step's context: no
            paged_decode(q, k_cache, v_cache, table, lens)
    assert [(r.kwargs["BLOCK_N"], r.kwargs["num_splits"]) for r in records if r.name == "paged_decode_kernel"] \
        == [(_configs.LONG_TILE, 3), (64, 1), (64, 1), (64, 1)]

    seq_lens = [1, 129, 300, 257, 128]
    k_cache, v_cache, bt, _, _ = filled_cache(seq_lens, 2, 64, block_size=32, device=DEVICE)
    q = torch.randn(len(seq_lens), 4, 64, dtype=torch.float16, device=DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    want = R.paged_decode_ref(q, k_cache, v_cache, bt, sl)
    monkeypatch.setattr(_configs, "decode_config", lambda *a, **k: {"BLOCK_N": _configs.LONG_TILE, "num_warps": 4,
                                                                    "num_stages": 1})
    for splits in (1, 2):
        got = paged_decode(q, k_cache, v_cache, bt, sl, num_splits=splits, out=poison(q.shape, q.dtype, DEVICE))
        torch.testing.assert_close(got.float(), want.float(), **TOL[torch.float16])


# (hq, hkv, head_size, block_size, [(context, query)], layout, cache dtype, options)
UNIFIED_CASES = [
    (4, 4, 64, 16, [(0, 5), (17, 1), (30, 12)], "nhd", None, {}),
    (8, 2, 128, 32, [(1327, 1), (13, 5), (120, 29)], "nhd", None, {}),
    (5, 1, 80, 16, [(9, 7), (0, 20)], "shuffled", None, {"window_left": 6}),
    (4, 2, 256, 16, [(20, 3)], "nhd", None, {"softcap": 2.5, "alibi": True}),
    (4, 2, 96, 16, [(12, 4), (0, 3)], "nhd", None, {"sinks": True}),
    (4, 1, 64, 16, [(40, 6), (8, 1)], "shuffled", FP8, {}),
]


@pytest.mark.parametrize("case", UNIFIED_CASES, ids=lambda c: f"h{c[0]}/{c[1]}-d{c[2]}-b{c[3]}-{c[5]}"
                         f"{'-fp8' if c[6] else ''}-{'-'.join(c[7]) or 'plain'}")
def test_unified_attention(case):
    hq, hkv, d, bs, reqs, layout, cache_dtype, opts = case
    dtype = torch.float16
    seq_lens = [c + q for c, q in reqs]
    k_scale, v_scale = _scales(cache_dtype)
    k_cache, v_cache, bt, _, _ = filled_cache(seq_lens, hkv, d, block_size=bs, dtype=dtype, cache_dtype=cache_dtype,
                                              layout=layout, device=DEVICE, k_scale=k_scale, v_scale=v_scale)
    q_lens = [q for _, q in reqs]
    q = torch.randn(sum(q_lens), hq, d, dtype=dtype, device=DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    cq = cu_seqlens(q_lens, DEVICE)
    kw = _opts(opts, hq)
    out = poison(q.shape, dtype, DEVICE)
    got, lse = unified_attention(q, k_cache, v_cache, bt, sl, cq, max(q_lens), layout=layout, k_scale=k_scale,
                                 v_scale=v_scale, out=out, return_lse=True, **kw)
    want, want_lse = R.unified_attention_ref(q, k_cache, v_cache, bt, sl, cq, layout=layout, k_scale=k_scale,
                                             v_scale=v_scale, return_lse=True, **kw)
    tol = TOL[dtype] if cache_dtype is None else FP8_TOL
    torch.testing.assert_close(got.float(), want.float(), **tol)
    torch.testing.assert_close(lse, want_lse, atol=2e-3, rtol=2e-3)
