"""The engine's memory plan and its out-of-memory handling.

CPU: the worst steps stay inside the limits, the plan's arithmetic and its refusal, a synthetic step writes
nothing, captured launches keep no tensors, and an injected out-of-memory step fails its own requests only
(the engine serves on, no block leaks, the step budget shrinks). GPU (``-m gpu``): every GPU preset builds
with its default settings and a worst-case workload stays within the planned peak.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tripath.engine import LLM, SamplingParams, StepFailed
from tripath.engine.core.engine_core import EngineCore
from tripath.engine.runner.memory_plan import MemoryPlan, check_fits, kv_blocks_left, run_synthetic_step, worst_steps
from tripath.engine.runner.warmup import WarmupLimits


@pytest.mark.parametrize("limits", [WarmupLimits(256, 8192, 131072), WarmupLimits(16, 8192, 36172),
                                    WarmupLimits(4, 64, 48), WarmupLimits(1, 16, 2048),
                                    WarmupLimits(64, 8192, 4096, decode_threshold=3),
                                    WarmupLimits(128, 8192, 1792), WarmupLimits(64, 8192, 3584),
                                    WarmupLimits(2, 8192, 512), WarmupLimits(8, 8192, 8)])
def test_worst_steps_stay_inside_the_limits_and_cover_every_kind(limits):
    steps = worst_steps(limits, chunk_budget=32768)
    assert {"prefill", "decode"} <= set(steps)
    if limits.max_num_seqs >= 3 and limits.max_num_batched_tokens > limits.max_num_seqs:
        assert {"extend", "extends", "mixed"} <= set(steps)
    for name, (q, c) in steps.items():
        assert len(q) == len(c) <= limits.max_num_seqs, name
        assert sum(q) <= limits.max_num_batched_tokens, name
        assert all(qi >= 1 and ci >= 0 and qi + ci <= limits.max_model_len for qi, ci in zip(q, c)), name
    q, c = steps["decode"]
    assert max(c) == limits.max_model_len - 1  # the longest contexts: the most split-KV partials
    dq = limits.decode_threshold
    assert ("verify" in steps) == (dq > 1)
    if dq > 1:   # speculative decoding: as many verifies of dq tokens as fit, on the longest contexts
        q, c = steps["verify"]
        assert set(q) == {dq} and len(q) == min(limits.max_num_seqs, limits.max_num_batched_tokens // dq)
    if "extend" in steps:
        (q,), (c,) = steps["extend"]
        assert q + c == limits.max_model_len and q == min(limits.max_num_batched_tokens, limits.max_model_len - 1)


def test_the_plan_leaves_the_kv_cache_what_the_reservations_do_not_take():
    gib = 2**30
    assert kv_blocks_left(90 * gib, 20 * gib, 8 * gib, 2 * gib, gib, 2**21) == (90 - 31) * 512
    plan = MemoryPlan(total=100 * gib, budget=90 * gib, in_use=20 * gib, weights=16 * gib,
                      step_peaks={"prefill": 3 * gib, "decode": 8 * gib}, graph_pools=2 * gib, headroom=gib,
                      bytes_per_block=2**21, num_blocks=(90 - 31) * 512)
    assert plan.step_peak == 8 * gib and plan.kv_cache == 59 * gib and plan.planned_peak == 89 * gib
    text = plan.summary()
    for part in ("KV cache", "step peak", "decode 8.00", "graph pools", "headroom", "weights 16.00"):
        assert part in text


def test_a_plan_without_room_for_one_sequence_is_refused_naming_the_settings():
    check_fits(num_blocks=9, block_size=16, max_model_len=128, plan_text="")  # 8 usable blocks = 128 tokens
    with pytest.raises(RuntimeError) as info:
        check_fits(num_blocks=8, block_size=16, max_model_len=128, plan_text="PLAN")
    message = str(info.value)
    for setting in ("max_model_len", "max_num_seqs", "gpu_memory_utilization", "PLAN"):
        assert setting in message


def test_a_synthetic_step_writes_nothing_to_the_cache(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    llm = LLM("tiny-llama", backend="torch", num_kv_blocks=8, max_num_seqs=4, max_num_batched_tokens=64,
              max_model_len=200)
    runner = llm.runner
    before = [(c.k_cache.clone(), c.v_cache.clone()) for c in runner.caches]
    for step in worst_steps(WarmupLimits(4, 64, 200), runner.spec.extend_chunk_budget).values():
        run_synthetic_step(runner, step, runner.caches)
    for (k, v), cache in zip(before, runner.caches):
        assert torch.equal(k, cache.k_cache) and torch.equal(v, cache.v_cache)


def test_a_synthetic_verify_step_samples_every_token_and_writes_nothing(monkeypatch):
    """Speculative decoding: the plan's verify step (decode_threshold tokens a request) runs the penalties'
    transforms, the acceptance rule and log-probabilities over every verify token, and leaves the cache
    untouched."""
    import tripath.engine.runner.memory_plan as memory_plan
    from tripath.engine.sampling.logits_transforms import StepTransforms
    from tripath.engine.speculative import acceptance

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    llm = LLM("tiny-llama", backend="torch", num_kv_blocks=8, max_num_seqs=4, max_num_batched_tokens=64,
              max_model_len=200, speculative_config={"num_speculative_tokens": 3})
    runner = llm.runner
    assert runner.spec.decode_threshold == 4
    rows = []
    real = acceptance.accept_drafts
    monkeypatch.setattr(acceptance, "accept_drafts", lambda logits, *a: rows.append(logits.shape[0]) or
                        real(logits, *a))
    transformed, apply = [], StepTransforms.apply
    monkeypatch.setattr(StepTransforms, "apply", lambda self, logits, *a: transformed.append(
        (logits.shape[0], self.penalty_rows is not None)) or apply(self, logits, *a))
    before = [(c.k_cache.clone(), c.v_cache.clone()) for c in runner.caches]
    steps = memory_plan.worst_steps(WarmupLimits(4, 64, 200, decode_threshold=4), runner.spec.extend_chunk_budget)
    run_synthetic_step(runner, steps["verify"], runner.caches)
    assert rows == [16]   # 4 verifies of 4 tokens
    assert transformed[0] == (16, True)   # then the sampled rows' own
    for (k, v), cache in zip(before, runner.caches):
        assert torch.equal(k, cache.k_cache) and torch.equal(v, cache.v_cache)


def test_captured_launches_keep_only_what_keep_returns():
    from tripath.triton_internals import capture_launches, launch

    class Kernel:  # stands for a @triton.jit function: the capture never calls it
        __name__ = "toy"

    tensor = torch.empty(1024)
    alive = weakref.ref(tensor)
    with capture_launches(keep=lambda record: record.grid) as kept:
        launch(Kernel(), (3, 1), tensor, 7)
        del tensor
        gc.collect()
        assert alive() is None  # the record, and the tensor with it, was dropped at once
    assert kept == [(3, 1)]
    with capture_launches() as records:
        launch(Kernel(), (2,), 5)
    assert records[0].args == (5,)


def _flaky_forward(llm):
    """Arm ``llm``'s backend to raise an out-of-memory error in the next forward (one step), once."""
    forward = llm.runner.backend.forward
    state = {"armed": False, "raised": 0}

    def flaky(*args, **kwargs):
        if state["armed"]:
            state["armed"] = False
            state["raised"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return forward(*args, **kwargs)

    llm.runner.backend.forward = flaky
    return state


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_an_out_of_memory_step_fails_its_requests_only_and_the_engine_serves_on(monkeypatch, async_scheduling):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    llm = LLM("tiny-llama", backend="torch", num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256,
              async_scheduling=async_scheduling, decode_steps=1)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    expected = [o.output_token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    state = _flaky_forward(llm)

    first = llm.add_request(prompts[0], greedy)
    second = llm.add_request(prompts[1], greedy)
    delivered = {first: [], second: []}
    for _ in range(3):
        for out in llm.step():
            delivered[out.request_id] += out.new_token_ids
    state["armed"] = True
    with pytest.raises(StepFailed) as info:
        llm.step()
    error = info.value
    assert error.out_of_memory and error.cause == "OutOfMemoryError" and "out of memory" in str(error)
    assert sorted(error.request_ids) == sorted([first, second])  # both were in the failed step
    for out in error.outputs:  # the step before it, read before the failure: delivered as usual
        delivered[out.request_id] += out.new_token_ids
    assert delivered[first] == expected[0][:len(delivered[first])] and delivered[first]
    assert not llm.has_unfinished_requests()
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks  # nothing leaked
    assert llm.scheduler.token_budget == 128  # halved: the next steps are smaller

    outputs = llm.generate(prompts, greedy, use_tqdm=False)  # the engine serves on, with the same results
    assert [o.output_token_ids for o in outputs] == expected
    assert state["raised"] == 1


def test_a_failed_schedule_names_the_running_requests_and_keeps_the_waiting_ones(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    llm = LLM("tiny-llama", backend="torch", num_kv_blocks=64, max_num_seqs=1, decode_steps=1)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    running = llm.add_request([5, 6, 7], greedy)
    llm.step()
    waiting = llm.add_request([8, 9], greedy)
    real = llm.scheduler.schedule
    monkeypatch.setattr(llm.scheduler, "schedule", lambda *a: (_ for _ in ()).throw(RuntimeError("broken")))
    with pytest.raises(StepFailed) as info:
        llm.step()
    assert info.value.request_ids == [running] and "broken" in str(info.value)
    monkeypatch.setattr(llm.scheduler, "schedule", real)
    outputs = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            outputs[out.request_id] = out
    assert list(outputs) == [waiting] and len(outputs[waiting].output_token_ids) == 4
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_usable_blocks


def test_generate_with_an_out_of_memory_step_raises_and_leaves_the_engine_idle(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    llm = LLM("tiny-llama", backend="torch", num_kv_blocks=64, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    state = _flaky_forward(llm)
    state["armed"] = True
    with pytest.raises(StepFailed):
        llm.generate([[3, 4, 5]] * 3, params, use_tqdm=False)
    assert not llm.has_unfinished_requests()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_usable_blocks
    assert len(llm.generate([[3, 4, 5]], params, use_tqdm=False)[0].output_token_ids) == 4


def test_the_token_budget_shrinks_to_a_floor_and_not_without_chunked_prefill():
    from tripath.engine.scheduling.block_manager import BlockManager
    from tripath.engine.scheduling.scheduler import MIN_TOKEN_BUDGET, Scheduler

    scheduler = Scheduler(BlockManager(32, 16, True), max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=512)
    assert [scheduler.shrink_token_budget() for _ in range(6)] == [512, 256, 128, 64, 64, 64]
    assert MIN_TOKEN_BUDGET == 64
    whole = Scheduler(BlockManager(32, 16, True), max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=512,
                      enable_chunked_prefill=False)
    assert whole.shrink_token_budget() == 1024


# ---- GPU: every GPU preset with its defaults --------------------------------------------------------------
GPU_PRESETS = [(preset, backend) for preset in ("llama-3.1-8b", "qwen3-235b-attn-tp8")
               for backend in ("three_path", "two_path", "unified")]
GPU_PRESETS += [(preset, backend) for preset in ("deepseek-r1-attn-tp8", "kimi-nope-attn-tp8")
                for backend in ("mla", "mla_triton")]


@pytest.mark.gpu
@pytest.mark.parametrize("preset,backend", GPU_PRESETS)
def test_a_gpu_preset_with_defaults_serves_a_worst_case_workload_within_its_plan(preset, backend):
    """Default settings: two requests at ``max_model_len`` minus their outputs (chunked: extends on the
    longest contexts), the other ``max_num_seqs - 2`` short (decodes at full batch beside them)."""
    import random

    llm = LLM(preset, backend=backend)
    plan = llm.runner.memory_plan
    assert plan is not None and plan.num_blocks == llm.runner.num_blocks
    print(llm.memory_report())
    out_len = 16
    rng = random.Random(0)
    vocab = llm.model.config.vocab_size
    longest = llm.runner.max_model_len - out_len
    num_seqs = llm.config.max_num_seqs
    prompts = [[rng.randrange(2, vocab) for _ in range(longest)] for _ in range(2)]
    prompts += [[rng.randrange(2, vocab) for _ in range(rng.randrange(16, 512))] for _ in range(num_seqs - 2)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=out_len, temperature=0.8, top_p=0.9, ignore_eos=True),
                           use_tqdm=False)
    peak = torch.cuda.max_memory_allocated()
    free, total = torch.cuda.mem_get_info()
    device_used = total - free   # what the driver holds too: the caching allocator's reserve, contexts, local memory
    print(f"{preset} {backend}: peak {peak / 2**30:.2f} GiB allocated, planned {plan.planned_peak / 2**30:.2f} GiB; "
          f"the device {device_used / 2**30:.2f} GiB in use after it ({torch.cuda.memory_reserved() / 2**30:.2f} "
          f"GiB reserved by PyTorch), budget {plan.budget / 2**30:.2f} GiB; "
          f"{llm.num_compiled_since_start} compiled after start")
    assert all(len(o.output_token_ids) == out_len for o in outputs)
    assert peak <= plan.planned_peak
    assert device_used <= plan.budget
    assert llm.num_compiled_since_start == 0


def test_the_server_answers_an_out_of_memory_step_503_and_serves_the_next_request(monkeypatch):
    pytest.importorskip("fastapi")
    import asyncio

    import httpx

    from tripath.server.http.app import build_app

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    threads = torch.get_num_threads()
    holder = {}

    def make():
        torch.set_num_threads(1)
        core = EngineCore("tiny-llama", backend="torch", num_kv_blocks=16)
        holder["state"] = _flaky_forward(core)
        return core

    app = build_app(make, model_name="tiny", engine_in_process=True)   # the test arms the engine it holds
    engine = app.state.server.engine
    engine.start()
    assert engine.wait_ready(120)

    async def post(body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=60) as client:
            return await client.post("/v1/completions", json=body)

    try:
        holder["state"]["armed"] = True
        r = asyncio.run(post({"model": "tiny", "prompt": [4, 5, 6], "max_tokens": 4}))
        assert r.status_code == 503, r.text
        assert "out of memory" in r.json()["error"]["message"]
        good = asyncio.run(post({"model": "tiny", "prompt": [4, 5, 6], "max_tokens": 5, "ignore_eos": True}))
        assert good.status_code == 200 and len(good.json()["choices"][0]["token_ids"]) == 5
        llm = engine.core
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_usable_blocks
        assert engine.metrics.step_failures._value.get() == 1
    finally:
        engine.stop()
        torch.set_num_threads(threads)


@pytest.mark.gpu
def test_the_mla_workload_runs_at_the_default_memory_utilization():
    """The seed's MLA workload (DeepSeek-R1's attention at TP 8: 256 requests of 1-3K tokens, 512 out, 64 at
    once) at the default gpu_memory_utilization: it ran out of memory in an extend's up-projection before
    the memory plan reserved the worst extend."""
    import random

    llm = LLM("deepseek-r1-attn-tp8", backend="mla", max_num_seqs=64, max_num_batched_tokens=8192)
    rng = random.Random(1)
    vocab = llm.model.config.vocab_size
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randrange(1024, 3072))] for _ in range(256)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=512, temperature=0, ignore_eos=True), use_tqdm=False)
    peak = torch.cuda.max_memory_allocated()
    print(f"mla workload: peak {peak / 2**30:.2f} GiB, planned {llm.runner.memory_plan.planned_peak / 2**30:.2f} GiB")
    assert all(len(o.output_token_ids) == 512 for o in outputs)
    assert peak <= llm.runner.memory_plan.planned_peak
    assert llm.num_compiled_since_start == 0


@pytest.mark.gpu
def test_serve_with_default_settings_answers_health_and_a_completion(tmp_path):
    """``tripath serve --model llama-3.1-8b`` with every setting at its default (it ran out of memory in the
    warm-up before the memory plan)."""
    pytest.importorskip("fastapi")
    import httpx

    from server_process import ServerProcess

    server = ServerProcess(["--model", "llama-3.1-8b"], tmp_path / "server.log", startup_timeout_s=900,
                           log_level="info")
    try:
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"model": "llama-3.1-8b", "prompt": [1, 2, 3, 4], "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 8, r.text
        print(server.log())
    finally:
        assert server.close() == 0   # a drained SIGTERM exits 0
