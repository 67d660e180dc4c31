"""mixed_attention (one persistent launch over a work list planned on the device) against the fp32 reference.

Random mixes of decodes, extends and prefills (random block tables, NaN-poisoned outputs and caches), GQA
ratios including an uneven one, block sizes, and ``kv_split`` values from one piece a tile to many; the score
modifiers, fp8 caches and the shuffled layout; the work list's invariants checked by an independent rule
(every visible key of every new token in exactly one item; each item runs for every KV head, so every head
too); one workspace reused across calls and mixes (the merge counters come back to zero); argument errors.
The GPU tests run the real sizes in bf16 and fp8 and replay a captured CUDA graph with other mixes.
"""

from collections import Counter, defaultdict

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from conftest import DEVICE
from helpers import FP8_TOL, TF32_TOL, cu_seqlens, filled_cache, kernel_tolerance, poison
from tripath.ops import MixedAttentionWorkspace, mixed_attention, mixed_attention_workspace, plan_mixed_attention
from tripath.ops import reference as R

FP8 = torch.float8_e4m3fn
D = 32


@st.composite
def mixes(draw, max_decodes=4, max_extends=2, max_prefills=2, max_context=80, max_query=20):
    """``[(context, query)]`` in plan order: decodes (one new token), extends (a context), prefills (none)."""
    decodes = [(draw(st.integers(0, max_context)), 1) for _ in range(draw(st.integers(0, max_decodes)))]
    extends = [(draw(st.integers(1, max_context)), draw(st.integers(2, max_query)))
               for _ in range(draw(st.integers(0, max_extends)))]
    prefills = [(0, draw(st.integers(2, max_query))) for _ in range(draw(st.integers(0, max_prefills)))]
    requests = decodes + extends + prefills
    assume(requests)
    return requests


def _step(requests, hq, hkv, *, block_size=16, dtype=torch.float16, cache_dtype=None, layout="nhd", scales=None):
    seq_lens = [c + q for c, q in requests]
    k_scale, v_scale = scales or (None, None)
    k_cache, v_cache, bt, _, _ = filled_cache(seq_lens, hkv, D, block_size=block_size, dtype=dtype,
                                              cache_dtype=cache_dtype, layout=layout, device=DEVICE,
                                              k_scale=k_scale, v_scale=v_scale)
    q_lens = [q for _, q in requests]
    q = torch.randn(sum(q_lens), hq, D, dtype=dtype, device=DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, bt, sl, cu_seqlens(q_lens, DEVICE)


def check_work_list(ws: MixedAttentionWorkspace, requests, window_left=-1, kv_split=None) -> dict:
    """The last plan of ``ws`` against an independent rule; returns its counts."""
    counts = ws.plan_counts()
    cfg = ws.config
    key_tile = max(cfg["BLOCK_N"], cfg["DECODE_BLOCK_N"])
    split = counts["kv_split"]
    assert split % key_tile == 0 and split >= (kv_split or 1)
    assert counts["items"] <= ws.max_items and counts["slots"] <= ws.part_lse.shape[0]
    items = ws.items[:counts["items"]].tolist()
    cover = Counter()
    groups = defaultdict(list)
    for seq, kind, tok0, lo, hi, slot0, piece, pieces in items:
        ctx, ql = requests[seq]
        assert kind == (ql == 1)
        tile_tokens = 1 if kind else ws.block_q
        assert tok0 % tile_tokens == 0 and 0 <= lo <= hi and hi - lo <= split
        assert lo % (cfg["DECODE_BLOCK_N"] if kind else cfg["BLOCK_N"]) == 0
        groups[(seq, tok0)].append((piece, pieces, slot0, lo, hi))
        for t in range(tok0, min(tok0 + tile_tokens, ql)):
            for key in range(lo, hi):
                cover[(seq, t, key)] += 1
    assert all(n == 1 for n in cover.values()), "a key read twice for one token"
    for seq, (ctx, ql) in enumerate(requests):
        for t in range(ql):
            p = ctx + t
            first = max(0, p - window_left) if window_left >= 0 else 0
            assert all(cover[(seq, t, key)] == 1 for key in range(first, p + 1)), (seq, t)
    slots = []
    for (seq, tok0), parts in groups.items():
        parts.sort()
        n = len(parts)
        ctx, ql = requests[seq]
        assert parts[-1][4] == ctx + min(tok0 + (1 if ql == 1 else ws.block_q), ql)  # one past its last token
        assert [p[0] for p in parts] == list(range(n)) and all(p[1] == n for p in parts)
        assert all(a[4] == b[3] for a, b in zip(parts, parts[1:]))  # consecutive pieces
        slot0 = parts[0][2]
        assert all(p[2] == slot0 for p in parts) and (slot0 == -1) == (n == 1)
        if n > 1:
            slots += range(slot0, slot0 + n)
    assert len(slots) == len(set(slots)) == counts["slots"] and all(0 <= s < ws.part_lse.shape[0] for s in slots)
    assert counts["tiles"] == len(groups) == sum(1 if q == 1 else -(-q // ws.block_q) for _, q in requests)
    return counts


def _compare(got, want, dtype, fp8=False, lse=None, want_lse=None):
    tol = FP8_TOL if fp8 else kernel_tolerance(dtype, DEVICE)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    if lse is not None:
        torch.testing.assert_close(lse, want_lse, **(TF32_TOL if tol is TF32_TOL else dict(atol=2e-3, rtol=2e-3)))


GQA = [(4, 2), (4, 1), (2, 2), (6, 2)]  # 6/2: a group of three, padded to four rows


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=mixes(), heads=st.sampled_from(GQA), block_size=st.sampled_from([8, 16, 32]),
       kv_split=st.sampled_from([None, 16, 32, 48, 4096]), dtype=st.sampled_from([torch.float16, torch.float32]))
def test_random_mixes_match_the_reference(requests, heads, block_size, kv_split, dtype):
    hq, hkv = heads
    q, k_cache, v_cache, bt, sl, cq = _step(requests, hq, hkv, block_size=block_size, dtype=dtype)
    ws = mixed_attention_workspace(hq, hkv, D, max_num_tokens=q.shape[0] + 5, max_num_seqs=len(requests) + 1,
                                   device=DEVICE, split_budget=64)
    got, lse = mixed_attention(q, k_cache, v_cache, bt, sl, cq, workspace=ws, kv_split=kv_split,
                               out=poison(q.shape, dtype, DEVICE), return_lse=True)
    want, want_lse = R.unified_attention_ref(q, k_cache, v_cache, bt, sl, cq, return_lse=True)
    _compare(got, want, dtype, lse=lse, want_lse=want_lse)
    check_work_list(ws, requests, kv_split=kv_split)
    assert not ws.counters.any()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=mixes(max_decodes=8, max_extends=3, max_prefills=3, max_context=300, max_query=60),
       heads=st.sampled_from(GQA), window_left=st.sampled_from([-1, 0, 5, 40]),
       kv_split=st.one_of(st.none(), st.integers(1, 200)), split_budget=st.sampled_from([1, 4, 64]))
def test_work_list_covers_every_visible_key_once(requests, heads, window_left, kv_split, split_budget):
    """The planner alone, on wider mixes: coverage, piece and slot layout, and the capacity bound whatever
    the budget (a small one lengthens the pieces instead of overflowing)."""
    hq, hkv = heads
    sl = torch.tensor([c + q for c, q in requests], dtype=torch.int32, device=DEVICE)
    cq = cu_seqlens([q for _, q in requests], DEVICE)
    ws = mixed_attention_workspace(hq, hkv, D, max_num_tokens=int(cq[-1]) + 7, max_num_seqs=len(requests),
                                   device=DEVICE, split_budget=split_budget)
    plan_mixed_attention(ws, cq, sl, window_left=window_left, kv_split=kv_split)
    check_work_list(ws, requests, window_left=window_left, kv_split=kv_split)


def test_cost_model_picks_the_split_on_the_device():
    """``S = max(min_split, ⌈W / target_items⌉, ⌈W / split_budget⌉)`` rounded up to the key tiles, ``W`` the keys
    the tiles read (one KV head)."""
    requests = [(300, 1), (17, 1), (200, 30), (0, 45)]
    sl = torch.tensor([c + q for c, q in requests], dtype=torch.int32, device=DEVICE)
    cq = cu_seqlens([q for _, q in requests], DEVICE)
    for budget in (64, 3):
        ws = mixed_attention_workspace(8, 2, D, max_num_tokens=80, max_num_seqs=4, device=DEVICE,
                                       split_budget=budget)
        plan_mixed_attention(ws, cq, sl)
        bq, tile = ws.block_q, max(ws.config["BLOCK_N"], ws.config["DECODE_BLOCK_N"])
        work = sum(c + 1 if q == 1 else sum(c + min(t + bq, q) for t in range(0, q, bq)) for c, q in requests)
        want = max(ws.min_split, -(-work // ws.target_items), -(-work // budget))
        assert check_work_list(ws, requests)["kv_split"] == -(-want // tile) * tile


def _opts(features, hq):
    return dict(window_left=features.get("window_left", -1), softcap=features.get("softcap", 0.0),
                alibi_slopes=torch.rand(hq, device=DEVICE) if features.get("alibi") else None,
                sinks=torch.randn(hq, device=DEVICE) if features.get("sinks") else None)


# (hq, hkv, block size, layout, cache dtype, features)
FEATURE_CASES = [
    (4, 2, 16, "nhd", FP8, {}),
    (4, 1, 16, "shuffled", FP8, {"sinks": True, "window_left": 20}),
    (4, 2, 16, "shuffled", None, {}),
    (6, 2, 16, "nhd", None, {"window_left": 9}),
    (4, 2, 32, "nhd", None, {"softcap": 2.0, "alibi": True}),
    (4, 4, 16, "nhd", None, {"sinks": True}),
]
FEATURE_MIX = [(70, 1), (3, 1), (0, 1), (41, 9), (0, 19)]


@pytest.mark.parametrize("case", FEATURE_CASES, ids=lambda c: f"h{c[0]}/{c[1]}-b{c[2]}-{c[3]}"
                         f"{'-fp8' if c[4] else ''}-{'-'.join(c[5]) or 'plain'}")
@pytest.mark.parametrize("kv_split", [None, 16])
def test_features(case, kv_split):
    hq, hkv, bs, layout, cache_dtype, features = case
    dtype = torch.float16
    scales = (torch.tensor([0.05], device=DEVICE), torch.tensor([0.04], device=DEVICE)) if cache_dtype else None
    q, k_cache, v_cache, bt, sl, cq = _step(FEATURE_MIX, hq, hkv, block_size=bs, cache_dtype=cache_dtype,
                                            layout=layout, scales=scales)
    k_scale, v_scale = scales or (None, None)
    kw = dict(layout=layout, k_scale=k_scale, v_scale=v_scale, **_opts(features, hq))
    ws = mixed_attention_workspace(hq, hkv, D, max_num_tokens=q.shape[0], max_num_seqs=len(FEATURE_MIX),
                                   device=DEVICE)
    got, lse = mixed_attention(q, k_cache, v_cache, bt, sl, cq, workspace=ws, kv_split=kv_split,
                               out=poison(q.shape, dtype, DEVICE), return_lse=True, **kw)
    want, want_lse = R.unified_attention_ref(q, k_cache, v_cache, bt, sl, cq, return_lse=True, **kw)
    _compare(got, want, dtype, fp8=cache_dtype is not None, lse=lse, want_lse=want_lse)
    counts = check_work_list(ws, FEATURE_MIX, window_left=kw["window_left"], kv_split=kv_split)
    assert kv_split is None or counts["slots"] > 0  # 16-key pieces: the merge ran
    assert not ws.counters.any()


def test_one_workspace_serves_many_calls_and_mixes():
    """Plan once, attend twice (planned): the same output, counters back at zero; then another mix and another
    split in the same workspace; a call without ``return_lse`` and rows past the step left alone."""
    hq, hkv = 4, 2
    ws = mixed_attention_workspace(hq, hkv, D, max_num_tokens=48, max_num_seqs=6, device=DEVICE, split_budget=32)
    # contexts past two key tiles (64 keys on a GPU), so that a split of 16 splits them there too
    for requests, kv_split in (([(140, 1), (9, 1), (130, 6), (0, 12)], 16), ([(300, 1), (20, 3)], None),
                               ([(200, 1)] * 6, 16)):
        q, k_cache, v_cache, bt, sl, cq = _step(requests, hq, hkv)
        want = R.unified_attention_ref(q, k_cache, v_cache, bt, sl, cq)
        plan_mixed_attention(ws, cq, sl, kv_split=kv_split)
        slots = check_work_list(ws, requests, kv_split=kv_split)["slots"]
        assert kv_split is None or slots > 0   # (unset: the cost model's split, which depends on the SM count)
        padded = torch.cat([q, torch.randn(3, hq, D, dtype=q.dtype, device=DEVICE)])
        for _ in range(2):
            out = poison(padded.shape, q.dtype, DEVICE)
            got = mixed_attention(padded, k_cache, v_cache, bt, sl, cq, workspace=ws, planned=True, out=out)
            assert got is out and out[q.shape[0]:].isnan().all()
            _compare(out[:q.shape[0]], want, q.dtype)
            assert not ws.counters.any()


def test_a_grown_workspace_shares_partials_and_the_outgrown_one_still_serves():
    """The ``mixed`` backend grows its workspace for a larger step; a CUDA graph captured on the smaller one
    holds that one's buffers, so it must stay alive, share the partials and counters, and still attend right
    after the larger step ran on the new one."""
    from tripath.attention import AttentionSpec
    from tripath.attention.backends.mixed import MixedBackend

    hq, hkv = 4, 2
    backend = MixedBackend(AttentionSpec(num_heads=hq, num_kv_heads=hkv, head_size=D), device=DEVICE)
    small = backend.workspace(8, 4, DEVICE)
    assert backend.workspace(200, 16, DEVICE) is small   # fits: no growth
    large = backend.workspace(300, 40, DEVICE)
    assert large is not small and (large.max_num_tokens, large.max_num_seqs) == (512, 64)
    assert large.part_out is small.part_out and large.counters is small.counters and large.counts is small.counts
    assert large.items.data_ptr() != small.items.data_ptr() and small in backend._outgrown
    steps = ([(300, 1), (0, 250)], [(40, 1), (9, 1), (30, 6)])
    for ws, requests in ((large, steps[0]), (small, steps[1]), (large, steps[0])):
        q, k_cache, v_cache, bt, sl, cq = _step(requests, hq, hkv)
        got = mixed_attention(q, k_cache, v_cache, bt, sl, cq, workspace=ws, kv_split=16)
        _compare(got, R.unified_attention_ref(q, k_cache, v_cache, bt, sl, cq), q.dtype)
        assert not ws.counters.any()
    with pytest.raises(ValueError, match="share"):
        mixed_attention_workspace(8, 2, D, max_num_tokens=6, max_num_seqs=2, device=DEVICE, share=small)


def test_without_a_workspace_and_on_the_torch_path(monkeypatch):
    requests = [(20, 1), (7, 5)]
    q, k_cache, v_cache, bt, sl, cq = _step(requests, 4, 2)
    want = R.unified_attention_ref(q, k_cache, v_cache, bt, sl, cq)
    _compare(mixed_attention(q, k_cache, v_cache, bt, sl, cq), want, q.dtype)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch reference path of a CPU without the interpreter
    _compare(mixed_attention(q, k_cache, v_cache, bt, sl, cq), want, q.dtype)


def test_sm90_tiles_follow_the_cache_dtype(monkeypatch):
    """On sm_90 a workspace for a 16-bit cache takes 64-key prompt tiles (measured faster), one for an fp8 cache
    32-key ones (64 spill there); ``mixed_attention`` without a workspace picks by its cache."""
    import importlib

    from tripath.platform import H200

    op = importlib.import_module("tripath.ops.mixed_attention")   # the module (the package exports the function)
    monkeypatch.setattr(op, "current_platform", lambda device: H200)
    tiles = {fp8: mixed_attention_workspace(32, 8, 128, max_num_tokens=64, max_num_seqs=4, device="cpu",
                                            kv_fp8=fp8).config for fp8 in (False, True)}
    assert (tiles[False]["BLOCK_N"], tiles[True]["BLOCK_N"]) == (64, 32)
    assert tiles[False]["BLOCK_Q"] == tiles[True]["BLOCK_Q"] == 16


def test_argument_errors_name_the_argument():
    requests = [(20, 1), (7, 5)]
    q, k_cache, v_cache, bt, sl, cq = _step(requests, 4, 2)
    ws = mixed_attention_workspace(4, 2, D, max_num_tokens=6, max_num_seqs=2, device=DEVICE)
    with pytest.raises(ValueError, match="workspace"):
        mixed_attention(q, k_cache, v_cache, bt, sl, cq,
                        workspace=mixed_attention_workspace(8, 2, D, max_num_tokens=6, max_num_seqs=2, device=DEVICE))
    with pytest.raises(ValueError, match="max_num_tokens"):
        mixed_attention(torch.cat([q, q]), k_cache, v_cache, bt, sl, cq, workspace=ws)
    with pytest.raises(ValueError, match="planned"):
        mixed_attention(q, k_cache, v_cache, bt, sl, cq, planned=True)
    plan_mixed_attention(ws, cq, sl, window_left=4)
    with pytest.raises(ValueError, match="window_left"):
        mixed_attention(q, k_cache, v_cache, bt, sl, cq, workspace=ws, planned=True)
    with pytest.raises(ValueError, match="kv_split"):
        mixed_attention(q, k_cache, v_cache, bt, sl, cq, workspace=ws, planned=True, window_left=4, kv_split=16)
    with pytest.raises(ValueError, match="kv_split"):
        plan_mixed_attention(ws, cq, sl, kv_split=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        plan_mixed_attention(mixed_attention_workspace(4, 2, D, max_num_tokens=6, max_num_seqs=1, device=DEVICE),
                             cq, sl)
    with pytest.raises(ValueError, match="seq_lens"):
        plan_mixed_attention(ws, cq, sl[:1])
    with pytest.raises(TypeError, match="workspace"):
        plan_mixed_attention(object(), cq, sl)
    with pytest.raises(ValueError, match="split_budget"):
        mixed_attention_workspace(4, 2, D, max_num_tokens=6, max_num_seqs=2, device=DEVICE, split_budget=0)
    with pytest.raises(ValueError, match="seq_lens"):  # shorter than the request's new tokens
        mixed_attention(q, k_cache, v_cache, bt, torch.tensor([20, 3], dtype=torch.int32), cq)


# --- GPU: real sizes, bf16 and fp8, and a captured CUDA graph replayed with other mixes -----------------------

def _gpu_mix(seed: int, decodes=48, extends=8, prefills=2):
    gen = torch.Generator().manual_seed(seed)

    def pick(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    return ([(pick(1, 4096), 1) for _ in range(decodes)] + [(pick(1, 2048), pick(64, 512)) for _ in range(extends)]
            + [(0, pick(256, 2048)) for _ in range(prefills)])


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_real_sizes(fp8):
    from tripath.platform import current_platform, fp8_dtype
    dev = torch.device("cuda")
    requests = _gpu_mix(0)
    cache_dtype = fp8_dtype(current_platform(dev)) if fp8 else None
    scales = (torch.tensor([0.05], device=dev), torch.tensor([0.04], device=dev)) if fp8 else (None, None)
    seq_lens = [c + q for c, q in requests]
    k_cache, v_cache, bt, _, _ = filled_cache(seq_lens, 8, 128, dtype=torch.bfloat16, cache_dtype=cache_dtype,
                                              device=dev, k_scale=scales[0], v_scale=scales[1])
    q = torch.randn(sum(q for _, q in requests), 32, 128, dtype=torch.bfloat16, device=dev)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    cq = cu_seqlens([q for _, q in requests], dev)
    ws = mixed_attention_workspace(32, 8, 128, max_num_tokens=q.shape[0], max_num_seqs=len(requests), device=dev)
    for kv_split in (None, 256, 100000):
        got = mixed_attention(q, k_cache, v_cache, bt, sl, cq, workspace=ws, kv_split=kv_split, k_scale=scales[0],
                              v_scale=scales[1], out=poison(q.shape, q.dtype, dev))
        want = R.unified_attention_ref(q, k_cache, v_cache, bt, sl, cq, k_scale=scales[0], v_scale=scales[1])
        _compare(got, want, torch.bfloat16, fp8=fp8)
        assert not ws.counters.any()


@pytest.mark.gpu
def test_gpu_graph_replays_other_mixes():
    """Plan and attention captured once for a bucket; replays with other mixes of the same bucket (fewer
    requests: padding requests of no tokens) are right."""
    dev = torch.device("cuda")
    steps = [_gpu_mix(1), _gpu_mix(2, decodes=60, extends=2, prefills=1), _gpu_mix(3, decodes=4, extends=0)]
    max_tokens = max(sum(n for _, n in m) for m in steps)
    max_seqs = max(len(m) for m in steps)
    made = [filled_cache([c + n for c, n in m], 8, 128, dtype=torch.bfloat16, device=dev)[:3] for m in steps]
    num_blocks = max(kc.shape[0] for kc, _, _ in made)
    width = max(bt.shape[1] for _, _, bt in made)
    k_cache = torch.empty((num_blocks, *made[0][0].shape[1:]), dtype=torch.bfloat16, device=dev)
    v_cache = torch.empty_like(k_cache)
    ws = mixed_attention_workspace(32, 8, 128, max_num_tokens=max_tokens, max_num_seqs=max_seqs, device=dev)
    q = torch.zeros(max_tokens, 32, 128, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(q)
    table = torch.zeros(max_seqs, width, dtype=torch.int32, device=dev)
    sl = torch.zeros(max_seqs, dtype=torch.int32, device=dev)
    cq = torch.zeros(max_seqs + 1, dtype=torch.int32, device=dev)

    def load(i):
        requests, (kc, vc, bt) = steps[i], made[i]
        pad = max_seqs - len(requests)
        k_cache[:kc.shape[0]].copy_(kc)
        v_cache[:vc.shape[0]].copy_(vc)
        table.zero_()
        table[:bt.shape[0], :bt.shape[1]] = bt
        sl.copy_(torch.tensor([c + n for c, n in requests] + [0] * pad, dtype=torch.int32))
        cq.copy_(cu_seqlens([n for _, n in requests] + [0] * pad, dev))
        q.normal_()
        return sum(n for _, n in requests)

    def step():
        plan_mixed_attention(ws, cq, sl)
        mixed_attention(q, k_cache, v_cache, table, sl, cq, workspace=ws, planned=True, out=out)

    load(0)
    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i in range(len(steps)):
        n = load(i)
        out.fill_(float("nan"))
        graph.replay()
        want = R.unified_attention_ref(q, k_cache, v_cache, table, sl, cq)
        _compare(out[:n], want[:n], torch.bfloat16)
        assert not ws.counters.any()
