"""Overlapped scheduling (``async_scheduling``: step N + 1 is scheduled and launched before step N's tokens
are read) gives exactly the outputs of one-step-at-a-time scheduling: greedy and seeded sampling, stop tokens
(the extra step's token dropped), ``max_tokens`` of 1, prefix hits, chunked prefill and preemption under a
tight KV cache (also of requests whose token is in flight), aborts between steps; every block is free at the
end. Greedy outputs also equal the stand-in model's float64 reference, which shares no tripath code."""

import random

import pytest
import torch

from engine_models import tiny_model
from tripath.engine import LLM, FinishReason, SamplingParams
from tripath.engine.requests.request import RequestStatus


pytestmark = pytest.mark.usefixtures("torch_paths_and_validation")


@pytest.fixture(scope="module")
def model(tiny_lm):
    return tiny_lm


def engine(model, overlap, **kw):
    options = dict(backend="torch", device="cpu", num_kv_blocks=48, block_size=4, max_num_seqs=6,
                   max_num_batched_tokens=24)
    options.update(kw)
    return LLM(model, async_scheduling=overlap, **options)


def workload(seed):
    """Mixed prompts (shared prefixes, so prefix hits happen), greedy and seeded requests, stop tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 61) for _ in range(9)]
    prompts, params = [], []
    for i in range(14):
        body = [rng.randrange(1, 61) for _ in range(rng.randrange(1, 30))]
        prompts.append((shared + body) if i % 3 == 0 else body)
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0, ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=i, ignore_eos=True))
        elif kind == 2:  # stops on some frequent token, usually before max_tokens
            params.append(SamplingParams(max_tokens=16, temperature=1.0, seed=100 + i,
                                         stop_token_ids=tuple(range(1, 61, 4)), ignore_eos=True))
        else:
            params.append(SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return prompts, params


def assert_idle(llm):
    bm = llm.block_manager
    assert not llm.scheduler.running and not llm.scheduler.waiting
    assert bm.num_free_blocks == bm.num_usable_blocks and all(c == 0 for c in bm.ref_counts)


@pytest.mark.parametrize("tight", [False, True], ids=["ample", "tight-kv"])
def test_overlapped_outputs_equal_sequential_outputs(model, tight):
    prompts, params = workload(0)
    kw = dict(num_kv_blocks=20) if tight else {}
    results = {}
    for overlap in (False, True):
        llm = engine(model, overlap, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[overlap] = [(o.output_token_ids, o.finish_reason) for o in outs]
        assert_idle(llm)
        if tight:
            assert llm.scheduler.num_preemptions > 0
        assert llm.block_manager.num_hit_tokens > 0
    assert results[True] == results[False]
    stopped = [r for r, p in zip(results[True], params) if r[1] is FinishReason.STOP]
    assert stopped and all(r[0][-1] in p.stop_token_ids for r, p in zip(results[True], params)
                           if r[1] is FinishReason.STOP)
    for (tokens, reason), prompt, p in zip(results[True], prompts, params):
        if p.greedy:
            assert tokens == model.reference_greedy(prompt, p.max_tokens) and reason is FinishReason.LENGTH


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "three_path", "two_path", "unified"])
def test_overlapped_outputs_equal_sequential_outputs_on_the_gpu(backend):
    """On a GPU the tokens stay on the device between steps, copied to pinned memory behind an event; CUDA
    graphs replay the decodes."""
    model = tiny_model().to("cuda", torch.float16)
    prompts, params = workload(1)
    results = []
    for overlap in (False, True):
        llm = engine(model, overlap, device="cuda", backend=backend, dtype=torch.float16, num_kv_blocks=24,
                     warmup=False)
        results.append([o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert_idle(llm)
        assert llm.overlap is overlap and llm.scheduler.num_preemptions > 0
    assert results[0] == results[1]


def test_a_step_call_returns_the_step_launched_before_it(model):
    llm = engine(model, True)
    rid = llm.add_request([3, 4, 5], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert llm.step() == []  # the prefill is launched, its token not read yet
    request = llm.scheduler.running[0]
    assert request.num_inflight_tokens == 1 and request.num_output_tokens == 0
    seen = []
    while llm.has_unfinished_requests():
        for out in llm.step():
            seen += out.new_token_ids
    assert seen == model.reference_greedy([3, 4, 5], 3) and llm.num_steps == 3
    assert llm.step() == [] and not llm.has_unfinished_requests()
    assert_idle(llm)
    assert rid not in {r.request_id for r in llm.scheduler.running}


def test_a_request_aborted_while_its_token_is_in_flight_is_gone(model):
    llm = engine(model, True)
    keep = llm.add_request([7, 8, 9], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    drop = llm.add_request([1, 2], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    outputs = llm.step() + llm.step()  # the second call reads the first step's tokens
    assert {o.request_id for o in outputs} == {keep, drop}
    assert llm.abort_request(drop)  # its second token is in flight
    streamed = {keep: [t for o in outputs if o.request_id == keep for t in o.new_token_ids]}
    while llm.has_unfinished_requests():
        for out in llm.step():
            assert out.request_id == keep
            streamed[keep] += out.new_token_ids
    assert streamed[keep] == model.reference_greedy([7, 8, 9], 6)
    assert_idle(llm)


def test_a_request_preempted_with_its_token_in_flight_keeps_the_token(model):
    """Two requests that each fill the cache's blocks: the older one grows and preempts the younger one
    while the younger's token is in flight; the younger keeps that token and ends where it would have."""
    prompt_a, prompt_b = [5] * 7, [6] * 7
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = engine(model, True, num_kv_blocks=6, max_num_seqs=2)  # 5 usable blocks of 4 tokens
    a = llm.add_request(prompt_a, params)
    b = llm.add_request(prompt_b, params)
    outs, preempted_in_flight = {a: [], b: []}, False
    while llm.has_unfinished_requests():
        before = llm.scheduler.num_preemptions
        inflight = {r.request_id for r in llm.scheduler.running if r.num_inflight_tokens}
        for out in llm.step():
            outs[out.request_id] += out.new_token_ids
        if llm.scheduler.num_preemptions > before:
            waiting = [r for r in llm.scheduler.waiting if r.status is RequestStatus.WAITING]
            preempted_in_flight |= any(r.request_id in inflight for r in waiting)
    assert preempted_in_flight
    assert outs[a] == model.reference_greedy(prompt_a, 6) and outs[b] == model.reference_greedy(prompt_b, 6)
    assert_idle(llm)


def test_a_failed_launch_aborts_its_requests_and_completes_the_step_before(model, monkeypatch):
    llm = engine(model, True)
    real = llm.runner.launch
    calls = []

    def failing(scheduled, previous=None, num_steps=1):
        calls.append(previous)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return real(scheduled, previous, num_steps)

    monkeypatch.setattr(llm.runner, "launch", failing)
    rid = llm.add_request([4, 4, 4], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    llm.step(), llm.step()
    with pytest.raises(RuntimeError, match="device lost"):
        llm.step()
    assert calls[2] is not None  # the failed launch had a step in flight: its token was kept
    assert not llm.has_unfinished_requests() and len(calls) == 3
    assert_idle(llm)
    monkeypatch.setattr(llm.runner, "launch", real)
    (out,) = llm.generate([[4, 4, 4]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                          use_tqdm=False)
    assert out.output_token_ids == model.reference_greedy([4, 4, 4], 4)
    assert rid != out.request_id


def test_the_option_is_checked_and_a_tensor_parallel_engine_runs_sequentially(model):
    with pytest.raises(TypeError, match="async_scheduling must be a bool"):
        engine(model, 1)
    assert engine(model, True).overlap and not engine(model, False).overlap
    from tripath.engine.runner.parallel_executor import ParallelExecutor
    assert ParallelExecutor.capabilities.overlap is False


def test_each_decode_is_launched_before_the_token_it_reads_is_known_on_the_host(model, monkeypatch):
    """launch(N + 1) comes before step N's tokens are read, and the outputs are still the reference's: the
    in-flight token reaches the next step on the device."""
    from tripath.engine.runner.launched_step import LaunchedStep

    llm = engine(model, True)
    events, real_launch, real_sampled = [], llm.runner.launch, LaunchedStep.sampled

    def launch(scheduled, previous=None, num_steps=1):
        step = real_launch(scheduled, previous, num_steps)
        events.append(("launch", step))
        return step

    def sampled(self):
        events.append(("read", self))
        return real_sampled(self)

    monkeypatch.setattr(llm.runner, "launch", launch)
    monkeypatch.setattr(LaunchedStep, "sampled", sampled)
    prompt = [9, 8, 7, 6]
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
    assert out.output_token_ids == model.reference_greedy(prompt, 5)
    launched = [step for kind, step in events if kind == "launch"]
    assert len(launched) == 5
    for n in range(4):  # step n + 1 (a decode of step n's token) is launched before step n is read
        assert events.index(("launch", launched[n + 1])) < events.index(("read", launched[n]))
