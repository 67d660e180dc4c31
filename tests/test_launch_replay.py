"""One layer's attention launches replayed for the other layers of a step (:mod:`tripath.triton_internals.replay`,
``ForwardContext.replay_launches``): every layer's output and cache equal a forward of its own, the
backend's forward runs once for all layers, and what cannot be replayed is refused and run as usual."""

import pytest
import torch

from conftest import DEVICE
from tripath.attention import ForwardContext, WatchedPaths
from tripath.attention.selector import backend_class
from tripath.attention.spec import AttentionSpec
from tripath.bench.batches import make_step
from tripath.ops import write_kv_cache
from tripath.triton_internals import record_launches

# 2 decodes, 1 extend on a cached context, 1 prefill
REQUESTS = [(37, 1), (20, 1), (29, 9), (0, 13)]
NUM_LAYERS = 3


def _layers(step, num_layers):
    """Per-layer caches with different contexts (each a scaled copy; fp8 scales differ too), per-layer new
    q/k/v, and per-layer sinks / ALiBi slopes where the spec has them."""
    caches, inputs, options = [], [], []
    gen = torch.Generator().manual_seed(1)
    for layer in range(num_layers):
        cache = step.fresh_cache()
        if cache.k_cache.dtype.is_floating_point and cache.k_cache.element_size() > 1:
            cache.k_cache.mul_(1.0 + 0.5 * layer)
            cache.v_cache.mul_(1.0 - 0.3 * layer)
        cache.k_scale, cache.v_scale = cache.k_scale * (1 + 0.25 * layer), cache.v_scale * (1 + 0.5 * layer)
        caches.append(cache)
        inputs.append(tuple(torch.randn(t.shape, generator=gen).to(t.dtype).to(t.device)
                            for t in (step.q, step.k, step.v)))
        options.append({name: value * (1.0 + 0.3 * layer) for name, value in
                        (("sinks", step.sinks), ("alibi_slopes", step.alibi_slopes)) if value is not None})
    return caches, inputs, options


def _run(backend, step, layers, replay: bool, windows=None, contexts=None):
    """The layers in order through one context, on shared static q/k/v/out buffers (as the piecewise CUDA
    graphs give them); each layer's output copied out. The context is appended to ``contexts``."""
    caches, inputs, options = layers
    meta = backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
    ctx = ForwardContext(backend, meta, caches, replay_launches=replay)
    if contexts is not None:
        contexts.append(ctx)
    q, k, v = (torch.empty_like(t) for t in (step.q, step.k, step.v))
    out = torch.full((q.shape[0], q.shape[1], backend.spec.v_size), float("nan"), dtype=q.dtype, device=q.device)
    outputs = []
    for layer, (lq, lk, lv) in enumerate(inputs):
        q.copy_(lq), k.copy_(lk), v.copy_(lv)
        window = None if windows is None else windows[layer]
        result = ctx.attend(layer, q, k, v, out=out, window_left=window, **options[layer])
        assert result.data_ptr() == out.data_ptr()
        outputs.append(out.clone())
    return outputs


def _count_forwards(monkeypatch, backend) -> list:
    """A list that grows by one each time ``backend.forward`` runs."""
    calls = []
    real = backend.forward
    monkeypatch.setattr(backend, "forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


CASES = {
    "plain": dict(),
    "sinks": dict(use_sinks=True),
    "alibi-softcap": dict(use_alibi=True, softcap=4.0),
    "fp8": dict(kv_cache_dtype="fp8"),
    "shuffled": dict(kv_layout="shuffled"),
    "several-chunks": dict(extend_chunk_budget=16),  # the extend's context in 2 chunks, merged by LSE
}


@pytest.mark.parametrize("name", ["three_path", "two_path", "unified"])
@pytest.mark.parametrize("case", list(CASES))
def test_replayed_layers_equal_their_own_forward(name, case, monkeypatch):
    spec = AttentionSpec(4, 2, 32, dtype=torch.float16, block_size=16, **CASES[case])
    backend = backend_class(name)(spec, DEVICE)
    step = make_step(spec, REQUESTS, backend, seed=3, device=DEVICE)
    want_layers = _layers(step, NUM_LAYERS)
    want = _run(backend, step, want_layers, replay=False)

    calls = _count_forwards(monkeypatch, backend)
    layers = _layers(step, NUM_LAYERS)
    contexts = []
    got = _run(backend, step, layers, replay=True, contexts=contexts)
    # the first layer ran the forward; the others replayed its launches, except where the recording must be
    # refused: host fp8 scales are checked on the host (a read of per-layer memory), and on a GPU three_path
    # runs the prefill beside the extend on a side stream when it cannot join them (fp8 caches, extends of
    # several context chunks). Every layer then runs its forward.
    refusal = None
    if case == "fp8" and DEVICE.type == "cpu":
        refusal = "memory that may differ between layers"
    elif case in ("fp8", "several-chunks") and name == "three_path" and DEVICE.type == "cuda":
        refusal = "side stream"
    refusals = contexts[0].replay_refusals
    if refusal is None:
        assert len(calls) == 1 and refusals == []
    else:
        assert len(calls) == NUM_LAYERS and len(refusals) == 1 and refusal in refusals[0], refusals
    for layer in range(NUM_LAYERS):
        torch.testing.assert_close(got[layer], want[layer], atol=0, rtol=0)
        for field in ("k_cache", "v_cache"):  # fp8 caches compared as bytes (NaN payloads included)
            got_cache, want_cache = getattr(layers[0][layer], field), getattr(want_layers[0][layer], field)
            assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8))
    assert not torch.equal(got[0], got[1])  # the layers' caches differ, so do their outputs


def test_layers_with_their_own_windows_record_one_sequence_each(monkeypatch):
    """Models mixing sliding-window and full-attention layers: a layer replays only a recording made with
    its own window."""
    spec = AttentionSpec(4, 2, 32, dtype=torch.float16, block_size=16, window_left=12)
    backend = backend_class("three_path")(spec, DEVICE)
    step = make_step(spec, REQUESTS, backend, seed=8, device=DEVICE)
    windows = [12, -1, 12, -1]
    want = _run(backend, step, _layers(step, 4), replay=False, windows=windows)
    calls = _count_forwards(monkeypatch, backend)
    got = _run(backend, step, _layers(step, 4), replay=True, windows=windows)
    assert len(calls) == 2
    for layer in range(4):
        torch.testing.assert_close(got[layer], want[layer], atol=0, rtol=0)


def _three_layers(name: str, seed: int):
    """``backend`` on a step of ``REQUESTS`` with three layers' caches and inputs, the step's metadata and
    a context over the caches."""
    spec = AttentionSpec(4, 2, 32, dtype=torch.float16, block_size=16)
    backend = backend_class(name)(spec, DEVICE)
    step = make_step(spec, REQUESTS, backend, seed=seed, device=DEVICE)
    caches, inputs, _ = _layers(step, 3)
    meta = backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
    return backend, step, caches, inputs, meta, ForwardContext(backend, meta, caches)


def test_a_second_model_step_on_the_context_records_again(monkeypatch):
    backend, step, caches, inputs, meta, ctx = _three_layers("three_path", seed=4)
    calls = _count_forwards(monkeypatch, backend)
    q, k, v = (t.clone() for t in (step.q, step.k, step.v))
    out = torch.empty(q.shape[0], 4, 32, dtype=q.dtype, device=q.device)
    for _ in range(2):
        for layer in range(3):
            ctx.attend(layer, q, k, v, out=out)
    assert len(calls) == 2
    other = torch.empty_like(out)  # other memory: not the recorded launches' output
    ctx.attend(1, q, k, v, out=other)
    assert len(calls) == 3
    two_layers = ForwardContext(backend, meta, caches[:2])  # too few layers for a recording to pay
    for layer in range(2):
        two_layers.attend(layer, q, k, v, out=out)
    assert len(calls) == 5 and two_layers._replay is None


def test_without_out_or_on_other_memory_every_layer_runs_its_forward(monkeypatch):
    backend, step, caches, inputs, meta, ctx = _three_layers("unified", seed=5)
    calls = _count_forwards(monkeypatch, backend)
    for layer, (q, k, v) in enumerate(inputs):
        ctx.attend(layer, q, k, v)  # no out
    assert len(calls) == 3
    for layer, (q, k, v) in enumerate(inputs):  # out given, but q/k/v are new memory every layer
        ctx.attend(layer, q.clone(), k.clone(), v.clone(), out=torch.empty(q.shape[0], 4, 32, dtype=q.dtype, device=q.device))
    assert len(calls) == 6


def test_recording_refuses_what_a_replay_would_get_wrong():
    spec = AttentionSpec(2, 1, 32, dtype=torch.float16, block_size=16)
    backend = backend_class("unified")(spec, DEVICE)
    step = make_step(spec, [(5, 3)], backend, seed=6, device=DEVICE)
    cache = step.cache
    x = torch.zeros(4, device=DEVICE)
    _, sequence, reason = record_launches(lambda: x.add_(1), [cache.k_cache])
    assert sequence is None and "aten.add_" in reason  # arithmetic a replay would skip

    def through_a_view():
        write_kv_cache(step.k, step.v, cache.k_cache[:], cache.v_cache, step.slot_mapping)

    _, sequence, reason = record_launches(through_a_view, [cache.k_cache, cache.v_cache], [step.slot_mapping])
    assert sequence is None and "through a view" in reason

    def read_the_keys():  # the layer's own input, read by PyTorch: not the same for every layer
        write_kv_cache(step.k, step.v, cache.k_cache, cache.v_cache, step.slot_mapping)
        return step.k.float().norm()

    _, sequence, reason = record_launches(read_the_keys, [cache.k_cache, cache.v_cache], [step.slot_mapping])
    assert sequence is None and "may differ between layers" in reason

    _, sequence, reason = record_launches(lambda: torch.empty(3), [cache.k_cache])
    assert sequence is None and "nothing was launched" in reason


def test_replay_refuses_swaps_unlike_the_recorded_tensors():
    spec = AttentionSpec(2, 1, 32, dtype=torch.float16, block_size=16)
    backend = backend_class("unified")(spec, DEVICE)
    step = make_step(spec, [(5, 3)], backend, seed=7, device=DEVICE)
    cache = step.cache

    def write():
        write_kv_cache(step.k, step.v, cache.k_cache, cache.v_cache, step.slot_mapping)

    _, sequence, reason = record_launches(write, [cache.k_cache, cache.v_cache], [step.slot_mapping])
    assert reason is None and len(sequence) == 1
    other = backend.allocate_cache(cache.k_cache.shape[0])
    assert sequence.compatible([other.k_cache, other.v_cache])
    smaller = backend.allocate_cache(cache.k_cache.shape[0] - 1)
    assert not sequence.replay([smaller.k_cache, smaller.v_cache])  # another shape: nothing launched
    assert not smaller.k_cache.any()
    assert not sequence.replay([other.k_cache.float(), other.v_cache])
    assert not sequence.replay([other.k_cache])
    assert sequence.replay([other.k_cache, other.v_cache])
    rows = step.slot_mapping
    torch.testing.assert_close(other.k_cache.flatten(0, 1)[rows], step.k, atol=0, rtol=0)
    torch.testing.assert_close(other.v_cache.flatten(0, 1)[rows], step.v, atol=0, rtol=0)


def test_a_recording_keeps_only_its_own_threads_launches():
    import threading

    spec = AttentionSpec(2, 1, 32, dtype=torch.float16, block_size=16)
    backend = backend_class("unified")(spec, DEVICE)
    step = make_step(spec, [(5, 3)], backend, seed=9, device=DEVICE)
    cache, other = step.cache, backend.allocate_cache(step.cache.k_cache.shape[0], DEVICE)

    def write(into):
        write_kv_cache(step.k, step.v, into.k_cache, into.v_cache, step.slot_mapping)

    def recorded():  # another engine's thread launches while this one records
        thread = threading.Thread(target=write, args=(other,))
        thread.start()
        thread.join()
        write(cache)

    _, sequence, reason = record_launches(recorded, [cache.k_cache, cache.v_cache], [step.slot_mapping])
    assert reason is None and len(sequence) == 1


# the structure of REQUESTS (2 decodes, 1 extend on one context chunk, 1 prefill) at other sizes
SAME_PATH_REQUESTS = [(41, 1), (18, 1), (33, 6), (0, 17)]


def _watch_count(monkeypatch) -> list:
    """A list that grows by one for each PyTorch operation a recording watches."""
    from tripath.triton_internals import replay

    seen = []
    real = replay._Recording.__torch_dispatch__
    monkeypatch.setattr(replay._Recording, "__torch_dispatch__",
                        lambda self, *a, **kw: seen.append(1) or real(self, *a, **kw))
    return seen


def _step_layers(backend, requests, seed, watched, contexts):
    """Per-layer outputs of a step of ``requests`` through a context with ``watched``, replaying, next to
    the same layers each running its own forward."""
    step = make_step(backend.spec, requests, backend, seed=seed, device=DEVICE)
    want = _run(backend, step, _layers(step, NUM_LAYERS), replay=False)
    layers = _layers(step, NUM_LAYERS)
    real_init = ForwardContext.__init__

    def with_watched(ctx, *a, **kw):
        real_init(ctx, *a, **kw)
        ctx.watched = watched

    ForwardContext.__init__ = with_watched
    try:
        got = _run(backend, step, layers, replay=True, contexts=contexts)
    finally:
        ForwardContext.__init__ = real_init
    return got, want


@pytest.mark.parametrize("name", ["three_path", "two_path"])
def test_a_watched_code_path_is_recorded_unwatched_on_later_steps(name, monkeypatch):
    spec = AttentionSpec(4, 2, 32, dtype=torch.float16, block_size=16)
    backend = backend_class(name)(spec, DEVICE)
    watched, contexts = WatchedPaths(), []
    seen = _watch_count(monkeypatch)
    got, want = _step_layers(backend, REQUESTS, 11, watched, contexts)
    assert seen and len(watched) == 1 and contexts[-1].replay_refusals == []
    calls = _count_forwards(monkeypatch, backend)
    seen.clear()
    got, want = _step_layers(backend, SAME_PATH_REQUESTS, 12, watched, contexts)
    # the second step: its forwards (the replaying run's first layer, the reference's three) unwatched
    assert seen == [] and len(calls) == 1 + NUM_LAYERS and contexts[-1].replay_refusals == []
    for layer in range(NUM_LAYERS):
        torch.testing.assert_close(got[layer], want[layer], atol=0, rtol=0)
    seen.clear()
    _step_layers(backend, [(30, 1), (12, 1), (25, 1)], 13, watched, contexts)  # decodes alone: another path
    assert seen and len(watched) == 2


def test_launches_unlike_the_watched_ones_are_refused_and_watched_again(monkeypatch):
    spec = AttentionSpec(4, 2, 32, dtype=torch.float16, block_size=16)
    backend = backend_class("three_path")(spec, DEVICE)
    watched, contexts = WatchedPaths(), []
    _step_layers(backend, REQUESTS, 14, watched, contexts)
    (path, (launches,)), = watched.launches.items()
    watched.launches[path] = {launches[1:]}  # as if the watched recording had launched other kernels
    calls = _count_forwards(monkeypatch, backend)
    got, want = _step_layers(backend, SAME_PATH_REQUESTS, 15, watched, contexts)
    assert len(calls) == 2 * NUM_LAYERS  # no replay: every layer ran its forward
    assert "differ from those of the watched recordings" in contexts[-1].replay_refusals[0]
    assert watched.must_watch(path)
    for layer in range(NUM_LAYERS):
        torch.testing.assert_close(got[layer], want[layer], atol=0, rtol=0)
    seen = _watch_count(monkeypatch)
    _step_layers(backend, SAME_PATH_REQUESTS, 16, watched, contexts)  # watched again: its sequence noted too
    assert seen and watched.launches[path] == {launches[1:], launches} and not watched.must_watch(path)
    seen.clear()
    calls.clear()
    _step_layers(backend, SAME_PATH_REQUESTS, 17, watched, contexts)  # now known: unwatched, replayed
    assert seen == [] and len(calls) == 1 + NUM_LAYERS and contexts[-1].replay_refusals == []


def test_metadata_structure_leaves_out_sizes_but_not_the_code_path():
    from tripath.attention.layer_replay import metadata_structure

    spec = AttentionSpec(4, 2, 32, dtype=torch.float16, block_size=16, extend_chunk_budget=16)
    backend = backend_class("three_path")(spec, DEVICE)

    def structure(requests):
        step = make_step(spec, requests, backend, seed=17, device=DEVICE)
        return metadata_structure(backend.build_metadata(step.plan, step.block_table, step.slot_mapping))

    base = structure([(5, 1), (6, 1), (9, 4), (0, 7)])  # the extend's context: one chunk of 16
    assert structure([(40, 1), (3, 1), (12, 2), (0, 20)]) == base
    assert structure([(5, 1), (9, 4), (0, 7)]) == base  # one decode fewer: same parts
    assert structure([(5, 1), (6, 1), (0, 7)]) != base  # no extend
    assert structure([(5, 1), (6, 1), (9, 4)]) != base  # no prefill
    assert structure([(5, 1), (6, 1), (29, 4), (0, 7)]) != base  # the context in two chunks
