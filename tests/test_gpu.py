"""GPU suite (bf16, fp8, large shapes, 100K+ contexts): run on a GPU machine with ``-m gpu``."""

import pytest
import torch

from helpers import FP8_TOL, TOL, cu_seqlens, filled_cache, poison
from tripath.attention import AttentionSpec, select_backend
from tripath.attention.backends.torch_ref import TorchBackend
from tripath.bench.batches import make_step
from tripath.ops import paged_decode, unified_attention, varlen_attention
from tripath.ops import reference as R
from tripath.triton_internals import capture_launches

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
BF16 = torch.bfloat16


@pytest.mark.parametrize("hq,hkv,d,dv", [(32, 8, 128, 128), (8, 1, 64, 64), (5, 1, 80, 80), (4, 4, 96, 96),
                                         (4, 2, 112, 112), (16, 16, 192, 128), (4, 2, 256, 256), (4, 4, 160, 160)])
@pytest.mark.parametrize("lens", [([1, 5, 129], [1328, 18, 463]), ([300, 1000], [300, 1000])])
def test_varlen_bf16(hq, hkv, d, dv, lens):
    lq, lk = lens
    q = torch.randn(sum(lq), hq, d, dtype=BF16, device=DEV)
    k = torch.randn(sum(lk), hkv, d, dtype=BF16, device=DEV)
    v = torch.randn(sum(lk), hkv, dv, dtype=BF16, device=DEV)
    cq, ck = cu_seqlens(lq, DEV), cu_seqlens(lk, DEV)
    for kw in (dict(causal=True), dict(causal=False, window_left=100, softcap=20.0),
               dict(causal=True, alibi_slopes=torch.rand(hq, device=DEV), sinks=torch.randn(hq, device=DEV))):
        out = poison((sum(lq), hq, dv), BF16, DEV)
        got, lse = varlen_attention(q, k, v, cq, ck, max(lq), max(lk), out=out, return_lse=True, **kw)
        want, want_lse = R.varlen_attention_ref(q, k, v, cq, ck, return_lse=True, **kw)
        torch.testing.assert_close(got.float(), want.float(), **TOL[BF16])
        torch.testing.assert_close(lse, want_lse, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (8, 1, 64), (4, 4, 128)])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_hopper_gluon_kernel(dtype, hq, hkv, d, causal):
    """The warp-specialised Gluon kernel (sm_90) against the reference: ragged requests (lengths not
    multiples of its 128-row / 128-key tiles, an empty request, queries past their keys that see nothing
    when causal), LSE, per-request query starts, and heads strided inside one packed QKV buffer."""
    from tripath.ops._varlen_sm90 import sm90_unsupported
    from tripath.platform import current_platform
    lq = [1, 5, 129, 0, 300, 64, 1000, 257]
    lk = [1328, 18, 463, 7, 300, 40, 1000, 2100]
    tq, tk = sum(lq), sum(lk)
    q = torch.randn(tq, hq, d, dtype=dtype, device=DEV)
    k = torch.randn(tk, hkv, d, dtype=dtype, device=DEV)
    v = torch.randn(tk, hkv, d, dtype=dtype, device=DEV)
    cq, ck = cu_seqlens(lq, DEV), cu_seqlens(lk, DEV)
    assert sm90_unsupported(current_platform(DEV), q, k, v, max_seqlen_k=max(lk), q_rope=None, k_rope=None,
                            window_left=-1, softcap=0.0, alibi_slopes=None, sinks=None) is None
    starts = torch.tensor([max(b - a, 0) // 2 for a, b in zip(lq, lk)], dtype=torch.int32, device=DEV)
    for kw in (dict(), dict(q_positions_start=starts)):
        got, lse = varlen_attention(q, k, v, cq, ck, max(lq), max(lk), causal=causal, return_lse=True,
                                    out=poison(q.shape, dtype, DEV), **kw)
        want, want_lse = R.varlen_attention_ref(q, k, v, cq, ck, causal=causal, return_lse=True, **kw)
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
        torch.testing.assert_close(lse, want_lse, atol=2e-2, rtol=1e-2)
    n = 1536  # one request of equal lengths, heads inside a packed [q | k | v] buffer
    qkv = torch.randn(n, hq + 2 * hkv, d, dtype=dtype, device=DEV)
    qp, kp, vp = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    cn = cu_seqlens([n], DEV)
    got = varlen_attention(qp, kp, vp, cn, cn, n, n, causal=causal, out=poison(qp.shape, dtype, DEV))
    want = R.varlen_attention_ref(qp, kp, vp, cn, cn, causal=causal)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (8, 4), (32, 32), (24, 8)])
@pytest.mark.parametrize("max_len", [512, 1024])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_hopper_gluon_short_requests(dtype, hq, hkv, max_len, causal):
    """Short requests on the Gluon kernel against the reference: head-pair items for an even GQA group (64
    rows of two query heads of one KV head, double-buffered queries; 64-key tiles up to 512 keys, 128-key
    tiles beyond), 128-row items on 64-key tiles for MHA and odd groups. Many ragged requests (more items
    than programs, so each program runs several and the query buffers alternate), lengths around the tile
    sizes, an empty request, queries that start inside their keys, LSE."""
    from tripath.ops._varlen_sm90 import pair_heads, sm90_unsupported
    from tripath.platform import current_platform
    lk = [max_len, 1, 63, 64, 65, 0, 129, max_len - 1] + torch.randint(1, max_len + 1, (40,)).tolist()
    lq = [n if i % 3 else n // 2 for i, n in enumerate(lk)]  # every third request: queries on a context
    q = torch.randn(sum(lq), hq, 128, dtype=dtype, device=DEV)
    k = torch.randn(sum(lk), hkv, 128, dtype=dtype, device=DEV)
    v = torch.randn(sum(lk), hkv, 128, dtype=dtype, device=DEV)
    cq, ck = cu_seqlens(lq, DEV), cu_seqlens(lk, DEV)
    assert pair_heads(q, k, max(lk)) == ((hq // hkv) % 2 == 0) and sm90_unsupported(
        current_platform(DEV), q, k, v, max_seqlen_k=max(lk), q_rope=None, k_rope=None, window_left=-1,
        softcap=0.0, alibi_slopes=None, sinks=None) is None
    got, lse = varlen_attention(q, k, v, cq, ck, max(lq), max(lk), causal=causal, return_lse=True,
                                out=poison(q.shape, dtype, DEV))
    want, want_lse = R.varlen_attention_ref(q, k, v, cq, ck, causal=causal, return_lse=True)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    torch.testing.assert_close(lse, want_lse, atol=2e-2, rtol=1e-2)


def test_varlen_hopper_gluon_head_pairs_store_only_their_rows():
    """Head-pair items on 64-key tiles store whole output tiles through TMA: into an output that is a view
    of a wider buffer (row stride past its heads), requests of 64-row multiples beside ragged ones; every
    element outside the view keeps its poison and every row inside matches the reference."""
    lk = [128, 64, 65, 512, 1, 191, 256, 320] * 3
    q = torch.randn(sum(lk), 8, 128, dtype=BF16, device=DEV)
    k = torch.randn(sum(lk), 2, 128, dtype=BF16, device=DEV)
    v = torch.randn(sum(lk), 2, 128, dtype=BF16, device=DEV)
    cq = cu_seqlens(lk, DEV)
    wide = torch.full((sum(lk), 11, 128), float("nan"), dtype=BF16, device=DEV)
    out = wide[:, 2:10]  # heads 2..9 of 11
    with capture_launches() as launches:
        varlen_attention(q, k, v, cq, cq, max(lk), max(lk), causal=True, out=out)
    assert launches[0].kwargs["PAIR_HEADS"] and launches[0].kwargs["TMA_STORE"]
    varlen_attention(q, k, v, cq, cq, max(lk), max(lk), causal=True, out=out)
    want = R.varlen_attention_ref(q, k, v, cq, cq, causal=True)
    torch.testing.assert_close(out.float(), want.float(), **TOL[BF16])
    assert wide[:, :2].isnan().all() and wide[:, 10:].isnan().all()


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_hopper_gluon_kernel_ignores_rows_past_the_last_request(causal):
    """Keys and values with NaN in the rows past the last request (a workspace's stale rest): the Gluon
    kernel's last key tile reads them, masks their scores and zeroes their value rows before the product."""
    lq, lk = [300, 1500], [1100, 1537]
    tk = sum(lk)
    q = torch.randn(sum(lq), 8, 128, dtype=BF16, device=DEV)
    k = torch.randn(tk + 200, 2, 128, dtype=BF16, device=DEV)
    v = torch.randn(tk + 200, 2, 128, dtype=BF16, device=DEV)
    k[tk:], v[tk:] = float("nan"), float("nan")
    cq, ck = cu_seqlens(lq, DEV), cu_seqlens(lk, DEV)
    got = varlen_attention(q, k, v, cq, ck, max(lq), max(lk), causal=causal, out=poison(q.shape, BF16, DEV))
    want = R.varlen_attention_ref(q, k[:tk], v[:tk], cq, ck, causal=causal)
    torch.testing.assert_close(got.float(), want.float(), **TOL[BF16])


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("heads,rope,shared", [(16, 64, True), (4, 32, False)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("short", [False, True])
def test_varlen_hopper_gluon_kernel_rotary_part(dtype, heads, rope, shared, causal, short):
    """The Gluon kernel with MLA's rotary part (scores q·k + q_rope·k_rope; one rotary key shared by all
    heads, or one per head) against the reference on the concatenated heads: keys and values strided as
    MLA's up-projection leaves them, ragged requests, a context before the queries, LSE; long requests
    (128-key tiles) and short ones (at most 1024 keys: 64-key tiles)."""
    from tripath.ops._varlen_sm90 import sm90_unsupported
    from tripath.platform import current_platform
    lq, lk = ([1, 700, 0, 300, 129], [1000, 700, 9, 1024, 129]) if short else \
        ([1, 700, 0, 1100, 129], [1500, 700, 9, 4608, 129])
    tq, tk = sum(lq), sum(lk)
    q = torch.randn(tq, heads, 128, dtype=dtype, device=DEV)
    kv = torch.randn(tk, heads, 256, dtype=dtype, device=DEV)  # [k_nope | v] per head
    k, v = kv[..., :128], kv[..., 128:]
    q_rope = torch.randn(tq, heads, rope, dtype=dtype, device=DEV)
    k_rope = torch.randn(tk, 1 if shared else heads, rope, dtype=dtype, device=DEV)
    cq, ck = cu_seqlens(lq, DEV), cu_seqlens(lk, DEV)
    assert sm90_unsupported(current_platform(DEV), q, k, v, max_seqlen_k=max(lk), q_rope=q_rope, k_rope=k_rope,
                            window_left=-1, softcap=0.0, alibi_slopes=None, sinks=None) is None
    got, lse = varlen_attention(q, k, v, cq, ck, max(lq), max(lk), causal=causal, q_rope=q_rope, k_rope=k_rope,
                                return_lse=True, out=poison((tq, heads, 128), dtype, DEV))
    want, want_lse = R.varlen_attention_ref(torch.cat([q, q_rope], -1),
                                            torch.cat([k, k_rope.expand(-1, heads, -1)], -1), v, cq, ck,
                                            causal=causal, return_lse=True)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    torch.testing.assert_close(lse, want_lse, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("layout", ["nhd", "shuffled"])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("hq,hkv,d,bs", [(32, 8, 128, 16), (8, 1, 64, 32), (16, 2, 256, 16), (5, 1, 80, 16),
                                         (4, 4, 192, 64)])
def test_paged_bf16_and_fp8(layout, fp8, hq, hkv, d, bs):
    seq_lens = [1, 1328, 4097, 37]
    cache_dtype = torch.float8_e4m3fn if fp8 else BF16
    ks = torch.tensor([0.05], device=DEV) if fp8 else None
    vs = torch.tensor([0.04], device=DEV) if fp8 else None
    kc, vc, bt, _, _ = filled_cache(seq_lens, hkv, d, block_size=bs, dtype=BF16, cache_dtype=cache_dtype,
                                    layout=layout, device=DEV, k_scale=ks, v_scale=vs)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    tol = FP8_TOL if fp8 else TOL[BF16]
    q = torch.randn(len(seq_lens), hq, d, dtype=BF16, device=DEV)
    for kw in (dict(), dict(window_left=511, sinks=torch.randn(hq, device=DEV)), dict(softcap=10.0)):
        for splits in (None, 1, 7):
            got = paged_decode(q, kc, vc, bt, sl, layout=layout, k_scale=ks, v_scale=vs, num_splits=splits,
                               out=poison(q.shape, BF16, DEV), **kw)
            want = R.paged_decode_ref(q, kc, vc, bt, sl, layout=layout, k_scale=ks, v_scale=vs, **kw)
            torch.testing.assert_close(got.float(), want.float(), **tol)
    q_lens = [1, 300, 5, 37]
    qu = torch.randn(sum(q_lens), hq, d, dtype=BF16, device=DEV)
    cq = cu_seqlens(q_lens, DEV)
    got = unified_attention(qu, kc, vc, bt, sl, cq, 300, layout=layout, k_scale=ks, v_scale=vs)
    want = R.unified_attention_ref(qu, kc, vc, bt, sl, cq, layout=layout, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("batch,ctx", [(48, 4096), (64, 16384)])
def test_paged_decode_long_tiles(batch, ctx):
    """Shapes where the 128-token tiles apply (1 and 3 splits), on ragged lengths."""
    from tripath.ops._configs import long_tile_splits
    from tripath.platform import current_platform
    assert long_tile_splits(current_platform(DEV), batch, 8, ctx) is not None
    seq_lens = [ctx - (97 * i) % (ctx // 2) for i in range(batch)]
    kc, vc, bt, _, _ = filled_cache(seq_lens, 8, 128, block_size=16, dtype=BF16, device=DEV)
    q = torch.randn(batch, 32, 128, dtype=BF16, device=DEV)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    got = paged_decode(q, kc, vc, bt, sl, out=poison(q.shape, BF16, DEV))
    want = R.paged_decode_ref(q, kc, vc, bt, sl)
    torch.testing.assert_close(got.float(), want.float(), **TOL[BF16])


LONG = [(100_000, 1), (4096, 1), (120_000, 16), (3000, 64), (0, 700), (0, 1)]


@pytest.mark.parametrize("name", ["three_path", "unified", "two_path"])
@pytest.mark.parametrize("layout", ["nhd", "shuffled"])
def test_backends_100k_contexts(name, layout):
    spec = AttentionSpec(32, 8, 128, dtype=BF16, kv_layout=layout, extend_chunk_budget=32768)
    backend = select_backend(spec, name, DEV)
    step = make_step(spec, LONG, backend, device=DEV)
    if name == "three_path":
        assert step.plan.extend_chunks.num_chunks >= 4
    meta = backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
    got = backend.forward(step.q, step.k, step.v, step.fresh_cache(), meta)
    ref_meta = backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
    want = TorchBackend(spec, DEV).forward(step.q, step.k, step.v, step.fresh_cache(), ref_meta)
    torch.testing.assert_close(got.float(), want.float(), **TOL[BF16])


@pytest.mark.parametrize("name", ["three_path", "unified", "two_path"])
def test_backends_bf16_features_fp8(name):
    for extra in (dict(kv_cache_dtype="fp8"), dict(window_left=255, use_sinks=True), dict(use_alibi=True, softcap=30.0)):
        spec = AttentionSpec(16, 4, 128, dtype=BF16, extend_chunk_budget=512, **extra)
        backend = select_backend(spec, name, DEV)
        step = make_step(spec, [(2000, 1), (300, 1), (1500, 40), (700, 9), (0, 333)], backend, device=DEV)
        meta = backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
        got = backend.forward(step.q, step.k, step.v, step.fresh_cache(), meta, alibi_slopes=step.alibi_slopes,
                              sinks=step.sinks)
        want = TorchBackend(spec, DEV, new_kv_from_cache=name != "three_path").forward(
            step.q, step.k, step.v, step.fresh_cache(), meta, alibi_slopes=step.alibi_slopes, sinks=step.sinks)
        tol = FP8_TOL if "kv_cache_dtype" in extra else TOL[BF16]
        torch.testing.assert_close(got.float(), want.float(), **tol)


def test_three_path_decode_overlap_is_exact_and_captures(monkeypatch):
    """Decode and prefill on side streams beside the extend: the same bits as the serial order (the
    900-token prefill takes the short-request tiles either way), eager and replayed from a CUDA graph (forks
    and joins captured), and close to the torch reference."""
    spec = AttentionSpec(32, 8, 128, dtype=BF16, extend_chunk_budget=2048)
    from tripath.attention.backends import three_path
    monkeypatch.setattr(three_path, "overlap_decode_by_default", lambda platform: True)  # off on sm_90 by default
    backend = select_backend(spec, "three_path", DEV)
    step = make_step(spec, [(4096, 1)] * 12 + [(3000, 200)] * 2 + [(0, 900)], backend, device=DEV)
    meta = backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
    serial = select_backend(spec, "three_path", DEV)
    serial._fork = lambda name, device, wanted: None  # no side streams: decode, extend, prefill in order
    want = serial.forward(step.q, step.k, step.v, step.fresh_cache(), meta)
    cache = step.fresh_cache()
    out = poison(want.shape, want.dtype, DEV)
    streams, launch = [], three_path.varlen_attention
    three_path.varlen_attention = lambda *a, **kw: (streams.append(torch.cuda.current_stream()), launch(*a, **kw))[1]
    try:
        assert torch.equal(backend.forward(step.q, step.k, step.v, cache, meta, out=out), want)
    finally:
        three_path.varlen_attention = launch
    main = torch.cuda.current_stream()
    assert streams[0] == main and streams[-1] != main  # extend on the main stream, prefill beside it
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capturing stream, as CUDA graphs require
        backend.forward(step.q, step.k, step.v, cache, meta, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.forward(step.q, step.k, step.v, cache, meta, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    ref = TorchBackend(spec, DEV).forward(step.q, step.k, step.v, step.fresh_cache(), meta)
    torch.testing.assert_close(want.float(), ref.float(), **TOL[BF16])
