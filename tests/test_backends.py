"""Every backend against ``torch`` on named batches; ``torch`` against float64 math; selection."""

import subprocess
import sys

import pytest
import torch

from conftest import DEVICE
from helpers import FP8_TOL, TOL, naive_attention, poison
from tripath.attention import AttentionSpec, BackendUnavailableError, explain, select_backend
from tripath.attention.backends.torch_ref import TorchBackend
from tripath.bench.batches import make_step

# (context_len, query_len) per request, in arrival order (the plan reorders them)
BATCHES = {
    "decode_only": [(37, 1), (5, 1), (70, 1)],
    "prefill_only": [(0, 9), (0, 30)],
    "extend_only": [(50, 6), (17, 12)],
    "mixed": [(40, 1), (0, 9), (70, 12), (5, 1), (33, 5), (0, 1)],
}
SPECS = {
    "gqa4": dict(num_heads=8, num_kv_heads=2, head_size=64),
    "mha-d80-shuffled": dict(num_heads=2, num_kv_heads=2, head_size=80, kv_layout="shuffled"),
    "mqa-fp8": dict(num_heads=4, num_kv_heads=1, head_size=64, kv_cache_dtype="fp8"),
    "window-sinks": dict(num_heads=4, num_kv_heads=2, head_size=64, window_left=12, use_sinks=True),
    "alibi-softcap-b32": dict(num_heads=5, num_kv_heads=1, head_size=96, use_alibi=True, softcap=4.0,
                              block_size=32),
}


def _run(backend, step):
    meta = backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
    cache = step.fresh_cache()
    out = backend.forward(step.q, step.k, step.v, cache, meta, alibi_slopes=step.alibi_slopes, sinks=step.sinks)
    return out, cache


@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("name", ["three_path", "unified", "two_path", "mixed", "sdpa"])
def test_backend_matches_torch(name, batch, spec_name):
    # a 24-token chunk budget: the extends' contexts take several chunks
    spec = AttentionSpec(dtype=torch.float16, extend_chunk_budget=24, **SPECS[spec_name])
    backend = select_backend(spec, name, DEVICE)
    step = make_step(spec, BATCHES[batch], backend, device=DEVICE, seed=hash((batch, spec_name)) % 1000)
    if batch in ("extend_only", "mixed"):
        assert step.plan.extend_chunks.num_chunks >= 2
    reference = TorchBackend(spec, DEVICE, new_kv_from_cache=name not in ("three_path", "sdpa"))
    got, got_cache = _run(backend, step)
    want, want_cache = _run(reference, step)
    tol = FP8_TOL if spec.kv_cache_dtype == "fp8" else TOL[spec.dtype]
    torch.testing.assert_close(got.float(), want.float(), **tol)
    # the step's new K/V landed in the cache exactly as the reference wrote them
    assert torch.equal(got_cache.k_cache.view(torch.uint8), want_cache.k_cache.view(torch.uint8))
    assert torch.equal(got_cache.v_cache.view(torch.uint8), want_cache.v_cache.view(torch.uint8))


@pytest.mark.parametrize("name", ["three_path", "unified", "two_path", "mixed", "sdpa", "torch"])
def test_layer_window_overrides_the_spec(name):
    """A layer's ``window_left`` (models mixing sliding-window and full-attention layers): −1 on a windowed
    spec gives full attention, and 5 gives what a spec with window 5 gives; bad values are refused."""
    windowed = AttentionSpec(4, 2, 64, dtype=torch.float16, window_left=12, extend_chunk_budget=24)
    backend = select_backend(windowed, name, DEVICE)
    step = make_step(windowed, BATCHES["mixed"], backend, device=DEVICE, seed=4)
    meta = backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
    for window in (-1, 5):
        spec = AttentionSpec(4, 2, 64, dtype=torch.float16, window_left=window, extend_chunk_budget=24)
        want = select_backend(spec, name, DEVICE).forward(step.q, step.k, step.v, step.fresh_cache(), meta)
        got = backend.forward(step.q, step.k, step.v, step.fresh_cache(), meta, window_left=window)
        torch.testing.assert_close(got.float(), want.float(), **TOL[torch.float16])
    full = select_backend(AttentionSpec(4, 2, 64, dtype=torch.float16), name, DEVICE)
    with pytest.raises(ValueError, match="window_left=5 for a layer of a spec without a sliding window"):
        full.forward(step.q, step.k, step.v, step.fresh_cache(), meta, window_left=5)
    with pytest.raises(ValueError, match="window_left must be >= -1"):
        backend.forward(step.q, step.k, step.v, step.fresh_cache(), meta, window_left=-3)


def test_mixed_plans_once_a_pass_and_again_where_a_layer_changes_the_window(monkeypatch):
    """Through a ForwardContext the ``mixed`` backend plans its work list in ``begin_pass`` (once a forward
    pass) and its layers attend on it; a layer with another window plans again, and so does the next layer
    back on the spec's window; a second pass on the context (multi-step decoding, a graph capture after its
    eager run) plans again. Every layer's output matches ``torch``'s."""
    import tripath.attention.backends.mixed as mixed_module
    from tripath.attention import ForwardContext

    plans = []
    real_plan = mixed_module.plan_mixed_attention
    monkeypatch.setattr(mixed_module, "plan_mixed_attention",
                        lambda ws, cq, sl, window_left: plans.append(window_left) or real_plan(ws, cq, sl,
                                                                                              window_left=window_left))
    spec = AttentionSpec(4, 2, 64, dtype=torch.float16, window_left=12, extend_chunk_budget=24)
    backend = select_backend(spec, "mixed", DEVICE)
    reference = TorchBackend(spec, DEVICE, new_kv_from_cache=True)
    step = make_step(spec, BATCHES["mixed"], backend, device=DEVICE, seed=9)
    meta = backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
    windows = [None, None, -1, None]
    want = [reference.forward(step.q, step.k, step.v, step.fresh_cache(), meta, window_left=w) for w in windows]
    ctx = ForwardContext(backend, meta, [step.fresh_cache() for _ in windows], replay_launches=False)
    for expected_plans in ([12, -1, 12], [12, -1, 12, 12, -1, 12]):
        for layer, window in enumerate(windows):
            got = ctx.attend(layer, step.q, step.k, step.v, window_left=window)
            torch.testing.assert_close(got.float(), want[layer].float(), **TOL[torch.float16])
        assert plans == expected_plans
    plans.clear()   # without a context: a plan for a metadata not planned last, none for the same one again
    other = backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
    for _ in range(2):
        backend.forward(step.q, step.k, step.v, step.fresh_cache(), other)
    assert plans == [12]


@pytest.mark.parametrize("spec_name", ["gqa4", "mqa-fp8", "window-sinks"])
def test_mixed_takes_paged_decode_for_decode_only_steps_and_not_for_a_bucket(spec_name):
    """A step of one-token decodes runs ``paged_decode`` on the ``mixed`` backend (no work list planned) and
    agrees with ``torch``; a whole-step graph's bucket, even of one-token rows, has no decodes in its plan (its
    rows are prompts), so the graph captured on it runs the one-launch kernel for any step it replays."""
    from tripath.attention import ForwardContext
    from tripath.engine.runner.whole_step_graphs import WholeStepGraphs
    from tripath.triton_internals import capture_launches

    spec = AttentionSpec(dtype=torch.float16, **SPECS[spec_name])
    backend = select_backend(spec, "mixed", DEVICE)
    one_launch = {"plan_mixed_work_kernel", "mixed_attention_kernel"}
    step = make_step(spec, BATCHES["decode_only"], backend, device=DEVICE, seed=11)
    want, _ = _run(TorchBackend(spec, DEVICE, new_kv_from_cache=True), step)
    meta = backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
    with capture_launches() as records:
        ForwardContext(backend, meta, [step.fresh_cache()], replay_launches=False).attend(
            0, step.q, step.k, step.v, alibi_slopes=step.alibi_slopes, sinks=step.sinks)
    names = {r.name for r in records}
    assert "paged_decode_kernel" in names and not names & one_launch
    got = ForwardContext(backend, meta, [step.fresh_cache()], replay_launches=False).attend(
        0, step.q, step.k, step.v, alibi_slopes=step.alibi_slopes, sinks=step.sinks)
    torch.testing.assert_close(got.float(), want.float(), **(FP8_TOL if spec.kv_cache_dtype == "fp8" else
                                                             TOL[spec.dtype]))
    graphs = WholeStepGraphs(None, backend, [], sizes=[4], max_num_seqs=8, max_model_len=64, max_blocks_per_seq=4,
                             device=DEVICE)
    bucket = graphs.bucket_metadata(4)
    assert bucket.plan.query_lens == [1] * 4 and bucket.decode is None
    q = torch.randn(4, spec.num_heads, spec.head_size, dtype=spec.dtype, device=DEVICE)
    kv = torch.randn(4, spec.num_kv_heads, spec.head_size, dtype=spec.dtype, device=DEVICE)
    with capture_launches() as records:
        backend.forward(q, kv, kv, step.fresh_cache(), bucket, sinks=step.sinks)
    assert {r.name for r in records} >= one_launch


def test_mixed_on_a_padded_bucket_matches_the_step():
    """A whole-step graph's replay in eager form: the step's metadata copied into a larger bucket's
    (``copy_padded_``: padding requests of no tokens and no keys, padding tokens writing nothing) gives the
    step's output on its rows and the step's cache writes, for two different steps into the same bucket."""
    from tripath.engine.runner.whole_step_graphs import WholeStepGraphs

    spec = AttentionSpec(4, 2, 64, dtype=torch.float16, extend_chunk_budget=24)
    backend = select_backend(spec, "mixed", DEVICE)
    graphs = WholeStepGraphs(None, backend, [], sizes=[96], max_num_seqs=10, max_model_len=192, max_blocks_per_seq=12,
                             device=DEVICE)
    bucket = graphs.bucket_metadata(96)
    assert (bucket.plan.num_requests, bucket.num_tokens, bucket.block_table.shape[1]) == (10, 96, 12)
    assert bucket.plan.query_lens == [10] * 6 + [9] * 4
    assert WholeStepGraphs(None, backend, [], sizes=[96], max_num_seqs=2, max_model_len=40, max_blocks_per_seq=3,
                           device=DEVICE).bucket_metadata(96) is None   # two prompts of 48 pass max_model_len
    for seed, requests in ((5, BATCHES["mixed"]), (6, [(20, 1), (0, 33), (41, 7)])):
        step = make_step(spec, requests, backend, device=DEVICE, seed=seed)
        meta = backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
        want_cache = step.fresh_cache()
        want = TorchBackend(spec, DEVICE, new_kv_from_cache=True).forward(step.q, step.k, step.v, want_cache, meta)
        bucket.copy_padded_(meta)
        t = step.q.shape[0]
        pad = 96 - t
        q, k, v = (torch.cat([x, torch.randn(pad, *x.shape[1:], dtype=x.dtype, device=DEVICE)])
                   for x in (step.q, step.k, step.v))
        cache = step.fresh_cache()
        got = backend.forward(q, k, v, cache, bucket, out=poison((96, 4, 64), torch.float16, DEVICE))
        torch.testing.assert_close(got[:t].float(), want.float(), **TOL[torch.float16])
        assert got[t:].isnan().all()   # padding rows are not written
        assert torch.equal(cache.k_cache.view(torch.uint8), want_cache.k_cache.view(torch.uint8))
        assert torch.equal(cache.v_cache.view(torch.uint8), want_cache.v_cache.view(torch.uint8))
    big = make_step(spec, [(3, 9)] * 11, backend, device=DEVICE)
    with pytest.raises(ValueError, match="does not fit the captured bucket"):
        bucket.copy_padded_(backend.build_metadata(big.plan, big.block_table, big.slot_mapping))


def test_torch_backend_matches_float64():
    spec = AttentionSpec(4, 2, 32, dtype=torch.float32, window_left=6, use_sinks=True, use_alibi=True)
    backend = select_backend(spec, "torch", "cpu")
    reqs = [(10, 1), (0, 5), (7, 4)]
    gen = torch.Generator().manual_seed(1)
    step = make_step(spec, reqs, backend)
    out, cache = _run(backend, step)
    # recover each request's keys/values from the cache (context) and the step (new tokens)
    from tripath.ops.kv_cache import as_nhd
    k_nhd, v_nhd = as_nhd(cache.k_cache, cache.v_cache, "nhd")
    at = 0
    for j, (qlen, ctx) in enumerate(zip(step.plan.query_lens, step.plan.context_lens)):
        pos = torch.arange(ctx + qlen)
        blocks = step.block_table[j, pos // spec.block_size].long()
        keys, vals = k_nhd[blocks, pos % spec.block_size], v_nhd[blocks, pos % spec.block_size]
        want, _ = naive_attention(step.q[at:at + qlen], keys, vals, q_start=ctx, window_left=6,
                                  alibi_slopes=step.alibi_slopes, sinks=step.sinks)
        torch.testing.assert_close(out[at:at + qlen].double(), want, atol=1e-5, rtol=1e-5)
        at += qlen
    del gen


def test_long_extend_many_chunks_three_path():
    spec = AttentionSpec(4, 1, 64, dtype=torch.float16, extend_chunk_budget=32, block_size=16)
    backend = select_backend(spec, "three_path", DEVICE)
    step = make_step(spec, [(300, 7), (45, 3)], backend, device=DEVICE)
    assert step.plan.extend_chunks.num_chunks == 19
    got, _ = _run(backend, step)
    want, _ = _run(TorchBackend(spec, DEVICE), step)
    torch.testing.assert_close(got.float(), want.float(), **TOL[torch.float16])


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"], ids=["joined-tail", "separate-new-token-pass"])
def test_attention_launches_get_exactly_their_rows(monkeypatch, kv_cache_dtype):
    """Every varlen launch of the extend and prefill paths gets keys and values of exactly
    ``cu_seqlens_k[-1]`` rows: a context chunk smaller than the gather workspace passes the rows it
    gathered, never the workspace's stale rest (the Hopper kernel's last key tile reads rows past the last
    request, and stale NaN there would reach the output as 0 · NaN). The portable kernel's launches (sm_90's
    Gluon kernel takes other arguments)."""
    from tripath.triton_internals import capture_launches

    monkeypatch.setenv("TRIPATH_DISABLE_GLUON", "1")

    spec = AttentionSpec(4, 1, 64, dtype=torch.float16, extend_chunk_budget=32, block_size=16,
                         kv_cache_dtype=kv_cache_dtype)
    backend = select_backend(spec, "three_path", DEVICE)
    step = make_step(spec, [(300, 7), (45, 3), (0, 9)], backend, device=DEVICE)
    with capture_launches() as records:
        _run(backend, step)
    varlen = [r.args for r in records if r.name == "varlen_attention_kernel"]
    assert len(varlen) > step.plan.extend_chunks.num_chunks
    for args in varlen:  # (q, k, v, k_desc, v_desc, q_rope, k_rope, kr_desc, out, lse, cu_seqlens_q, cu_seqlens_k)
        assert args[1].shape[0] == args[2].shape[0] == int(args[11][-1])


JOIN_SPECS = {"window-sinks": dict(window_left=40, use_sinks=True),
              "alibi-softcap-b32": dict(use_alibi=True, softcap=4.0, block_size=32)}


@pytest.mark.parametrize("opts", list(JOIN_SPECS))
@pytest.mark.parametrize("budget", [32768, 24], ids=["one-chunk", "several-chunks"])
def test_three_path_joins_the_last_chunk_with_the_new_tokens(budget, opts):
    """The extends' last context chunk and their new tokens (read back from the cache) go through one causal
    launch: with one chunk, a step's extends and the prefill beside them cost one gather and one attention
    launch and no merge; with several (a context that ends before the last chunk included), the earlier
    chunks merge into it and the prefill has its own launch. The result agrees with ``torch``."""
    from tripath.triton_internals import capture_launches

    spec = AttentionSpec(4, 2, 64, dtype=torch.float16, extend_chunk_budget=budget, **JOIN_SPECS[opts])
    backend = select_backend(spec, "three_path", DEVICE)
    step = make_step(spec, [(50, 6), (17, 12), (3, 1), (0, 5)], backend, device=DEVICE, seed=7)
    assert (step.plan.extend_chunks.num_chunks == 1) == (budget == 32768)
    with capture_launches() as records:  # records the launches without running them
        _run(backend, step)
    joined, _ = _run(backend, step)
    names = [r.name for r in records]
    if budget == 32768:
        assert names.count("varlen_attention_kernel") == 1  # the extends and the prefill together
        assert "merge_states_kernel" not in names and names.count("gather_kv_cache_kernel") == 1
    else:
        assert names.count("varlen_attention_kernel") == step.plan.extend_chunks.num_chunks + 1  # + the prefill
    want, _ = _run(TorchBackend(spec, DEVICE), step)
    torch.testing.assert_close(joined.float(), want.float(), **TOL[torch.float16])


def test_three_path_keeps_the_new_token_pass_for_fp8_caches(monkeypatch):
    """An fp8 cache holds the new keys rounded: the extend's new tokens then take their own causal pass over
    the step's keys (as the torch reference does), merged with the context (counted on the portable kernel)."""
    from tripath.triton_internals import capture_launches

    monkeypatch.setenv("TRIPATH_DISABLE_GLUON", "1")

    spec = AttentionSpec(4, 1, 64, dtype=torch.float16, kv_cache_dtype="fp8")
    backend = select_backend(spec, "three_path", DEVICE)
    step = make_step(spec, [(50, 6), (17, 12)], backend, device=DEVICE, seed=3)
    with capture_launches() as records:
        _run(backend, step)
    names = [r.name for r in records]
    assert names.count("varlen_attention_kernel") == 2 and names.count("merge_states_kernel") == 1


def test_three_path_decode_overlap_default_per_gpu(monkeypatch):
    """The decode shares the GPU with the extend/prefill launches by default, except on sm_90 where the
    persistent Gluon prefill kernel leaves nothing to fill (and not when that kernel is disabled)."""
    from tripath.attention.backends.three_path import overlap_decode_by_default
    from tripath.platform import H200, MI300X, MI355X
    assert overlap_decode_by_default(MI300X) and overlap_decode_by_default(MI355X)
    assert not overlap_decode_by_default(H200)
    monkeypatch.setenv("TRIPATH_DISABLE_GLUON", "1")
    assert overlap_decode_by_default(H200)


def test_auto_selection_and_reasons(monkeypatch):
    spec = AttentionSpec(8, 2, 64)
    assert select_backend(spec, "auto", DEVICE).name == "three_path"  # GPU or interpreter
    monkeypatch.setenv("TRIPATH_ATTENTION_BACKEND", "unified")
    assert select_backend(spec, "auto", DEVICE).name == "unified"
    monkeypatch.delenv("TRIPATH_ATTENTION_BACKEND")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cpu = select_backend(spec, "auto", "cpu")
    assert cpu.name == "sdpa"
    assert "need a CUDA/ROCm device or TRITON_INTERPRET=1" in cpu.rejected["three_path"][0]
    with pytest.raises(BackendUnavailableError, match="three_path: its Triton kernels need"):
        select_backend(spec, "three_path", "cpu")


def test_selection_rejects_with_explanations():
    spec = AttentionSpec(8, 2, 64, decode_threshold=3)
    reasons = explain(spec, DEVICE)
    assert reasons["three_path"] == [] and reasons["unified"] == []
    assert reasons["two_path"] == ["decode_threshold 3 > 1"]
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        select_backend(spec, "fast", DEVICE)


def test_speculative_decode_rows_three_path(monkeypatch):
    """One-token decodes on paged_decode and verifies (2-3 tokens) on paged_verify, beside an extend and a
    prefill: the torch backend's output."""
    import tripath.attention.backends.three_path as three_path

    spec = AttentionSpec(4, 2, 64, dtype=torch.float16, decode_threshold=3)
    backend = select_backend(spec, "three_path", DEVICE)
    step = make_step(spec, [(20, 3), (9, 1), (9, 2), (0, 4), (30, 6), (14, 1)], backend, device=DEVICE)
    meta = backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
    assert step.plan.num_decodes == 4 and step.plan.num_verifies == 2 and not meta.decode.single_token
    calls = []
    for name in ("paged_decode", "paged_verify", "unified_attention"):
        real = getattr(three_path, name)
        monkeypatch.setattr(three_path, name, lambda *a, _real=real, _name=name, **k: calls.append(
            (_name, a[0].shape[0])) or _real(*a, **k))
    got, _ = _run(backend, step)
    assert calls == [("paged_decode", 2), ("paged_verify", 5)]
    want, _ = _run(TorchBackend(spec, DEVICE), step)
    torch.testing.assert_close(got.float(), want.float(), **TOL[torch.float16])


def test_forward_requires_declared_per_head_tensors():
    spec = AttentionSpec(4, 2, 64, dtype=torch.float16, use_sinks=True)
    backend = select_backend(spec, "torch", "cpu")
    step = make_step(spec, [(4, 1)], backend)
    meta = backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
    with pytest.raises(ValueError, match="pass sinks"):
        backend.forward(step.q, step.k, step.v, step.fresh_cache(), meta)


def test_importing_the_attention_layer_loads_no_kernels():
    """Specs, planning and the backend registry load without Triton: a backend's module (and its kernels)
    is imported when that backend is selected, not before."""
    code = ("import sys; import tripath.attention, tripath.attention.backends, tripath.attention.spec; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton' or "
            "m.startswith(('tripath.ops', 'tripath.kernels', 'tripath.attention.backends.'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
