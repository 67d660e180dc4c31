"""The engine core's typed face (``tripath.engine.core.engine_core.EngineCore``), driven directly as the server drives it:
add, step to the end, abort; a step's failure reported in its ``StepResult`` (never raised) with the requests
it aborted; ``step(decode_steps=...)`` bounding multi-step decoding for one step; ``info()`` as the server
reads it (the start-up line, ``vllm:cache_config_info``); and the ``LLM`` facade over the same core."""

import dataclasses
import pickle

import pytest
import torch

from engine_models import tiny_model
from tripath.engine import LLM, SamplingParams
from tripath.engine.core.engine_core import EngineCore, StepResult
from tripath.engine.core.engine_info import EngineInfo

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(autouse=True)
def _torch_paths(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def run_to_end(core: EngineCore) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        result = core.step()
        assert isinstance(result, StepResult) and result.failure is None
        for out in result.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_a_core_adds_steps_and_aborts_as_the_facade_generates(model):
    core = EngineCore(model, backend="torch", num_kv_blocks=32)
    assert core.add_request([5, 6, 7], GREEDY, request_id="a") == "a"
    assert core.add_request([8, 9], GREEDY) == "req-1"
    assert core.add_request([3, 3, 3], SamplingParams(max_tokens=50, ignore_eos=True), request_id="gone") == "gone"
    assert core.num_waiting == 3
    assert core.abort("gone") and not core.abort("gone")
    tokens = run_to_end(core)
    assert tokens == {"a": model.reference_greedy([5, 6, 7], 5), "req-1": model.reference_greedy([8, 9], 5)}
    stats = core.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0) and stats.num_steps > 0
    with pytest.raises(ValueError, match="n / best_of"):
        core.add_request([1, 2], SamplingParams(n=2, temperature=0.5))
    with pytest.raises(ValueError, match="already queued"):
        core.add_request([1, 2], GREEDY, request_id="x")
        core.add_request([1, 2], GREEDY, request_id="x")
    assert core.abort("x") and not core.has_unfinished_requests()


def test_requests_added_together_are_all_queued_or_none(model):
    """``add_requests`` (one HTTP request's prompts x choices): every request validated before any is queued;
    each sampled request gets its own seed."""
    core = EngineCore(model, backend="torch", num_kv_blocks=32)
    sampled = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    for bad, error in (([[1, 2], [10 ** 9]], "vocabulary"), ([[1, 2], []], "empty"),
                       ([[1, 2], [3]], "already queued")):
        ids = ["a", "b"] if error != "already queued" else ["a", "a"]
        with pytest.raises(ValueError, match=error):
            core.add_requests([(prompt, sampled, i, None) for prompt, i in zip(bad, ids)])
        assert core.num_waiting == 0 and not core.has_unfinished_requests()
    with pytest.raises(ValueError, match="n / best_of"):
        core.add_requests([([1, 2], GREEDY, "a", None), ([1, 2], SamplingParams(n=2, temperature=0.5), "b", None)])
    assert core.num_waiting == 0
    assert core.add_requests([([1, 2], sampled, "a", None), ([1, 2], sampled, "b", None)]) == ["a", "b"]
    assert core.num_waiting == 2
    seeds = {r.request_id: r.sampling_seed for r in core.scheduler.waiting}
    assert seeds["a"] != seeds["b"], seeds
    assert set(run_to_end(core)) == {"a", "b"}


def test_a_failing_step_is_reported_with_the_requests_it_aborted_and_the_core_serves_on(model, monkeypatch):
    core = EngineCore(model, backend="torch", num_kv_blocks=32, async_scheduling=False, step_time_target_s=0)
    real = core.runner.launch
    armed = {"error": RuntimeError("device lost")}

    def launch(scheduled, previous=None, num_steps=1):
        if armed["error"] is not None:
            error, armed["error"] = armed["error"], None
            raise error
        return real(scheduled, previous, num_steps)

    monkeypatch.setattr(core.runner, "launch", launch)
    core.add_request([4, 4, 4], GREEDY, request_id="a")
    core.add_request([5, 5], GREEDY, request_id="b")
    result = core.step()   # returns, never raises
    failure = result.failure
    assert failure is not None and sorted(failure.request_ids) == ["a", "b"] and not result.outputs
    assert failure.cause == "RuntimeError" and not failure.out_of_memory and "device lost" in failure.message
    assert not core.has_unfinished_requests()
    assert core.block_manager.num_free_blocks == core.block_manager.num_usable_blocks
    budget = core.scheduler.token_budget
    armed["error"] = torch.OutOfMemoryError("CUDA out of memory (injected)")
    core.add_request([6, 6], GREEDY, request_id="c")
    failure = core.step().failure
    assert failure.request_ids == ("c",) and failure.out_of_memory and core.scheduler.token_budget < budget
    core.add_request([4, 4, 4], GREEDY, request_id="d")
    assert run_to_end(core) == {"d": model.reference_greedy([4, 4, 4], 5)}


def test_a_failure_outside_a_step_fails_what_runs_else_the_queue(model, monkeypatch):
    core = EngineCore(model, backend="torch", num_kv_blocks=32, max_num_seqs=1)
    core.add_request([4, 4, 4], GREEDY, request_id="a")
    core.add_request([5, 5], GREEDY, request_id="b")
    core.step()
    monkeypatch.setattr(core.scheduler, "schedule", lambda *a: (_ for _ in ()).throw(RuntimeError("broken")))
    failure = core.step().failure
    assert failure.request_ids == ("a",) and "broken" in failure.message   # the waiting one stays queued
    assert core.num_waiting == 1


def test_step_bounds_multi_step_decoding_for_one_step(model, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")   # three_path's kernels, interpreted: multi-step needs them
    core = EngineCore(model, backend="three_path", num_kv_blocks=40, block_size=4, max_num_seqs=4,
                      max_num_batched_tokens=32, decode_steps=4, async_scheduling=False)
    real, seen = core.runner.launch, []

    def launch(scheduled, previous=None, num_steps=1):
        seen.append(num_steps)
        return real(scheduled, previous, num_steps)

    monkeypatch.setattr(core.runner, "launch", launch)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    core.add_request([5, 17, 33], params, request_id="a")
    core.step()                        # the prefill
    core.step(decode_steps=1)
    core.step(decode_steps=2)
    core.step()
    assert seen == [1, 1, 2, 4] and core.decode_steps == 4
    assert run_to_end(core)
    info = core.info()
    assert info.decode_steps == 4 and info.backend == "three_path"


def test_info_is_what_the_server_reads(model):
    from tripath.server.metrics.startup import cache_config, startup_summary

    core = EngineCore(model, backend="torch", num_kv_blocks=32, max_model_len=256)
    info = core.info()
    assert isinstance(info, EngineInfo) and pickle.loads(pickle.dumps(info)) == info
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.max_model_len = 1
    assert (info.vocab_size, info.max_model_len, info.max_num_seqs) == (model.config.vocab_size, 256,
                                                                        core.config.max_num_seqs)
    assert (info.backend, info.backend_choice, info.num_kv_blocks, info.num_usable_kv_blocks) == \
        ("torch", "asked for", 32, 31)
    assert info.device == "cpu" and not info.on_gpu and info.decode_graph_sizes == () and info.warmup_seconds is None
    from tripath.engine.runner.startup import PHASES

    assert tuple(phase for phase, _ in info.start_phases) == PHASES and all(s >= 0 for _, s in info.start_phases)
    assert sum(s for _, s in info.start_phases) <= info.start_seconds + 1e-3
    line = startup_summary(info, "tiny", ["tiny"])
    assert "start " in line and "(plan_memory " in line and "capture_graphs " in line
    assert "backend torch (asked for)" in line and "CUDA graphs off (not on a GPU)" in line
    assert "KV cache 31 blocks x 16 tokens" in line and "max_model_len 256" in line
    assert cache_config(info)["num_gpu_blocks"] == "32" and cache_config(info)["num_gpu_blocks_override"] == "32"
    auto = EngineCore(model, num_kv_blocks=8).info()
    assert auto.backend_choice.startswith("auto")


def test_the_facade_is_a_view_of_its_core(model):
    llm = LLM(model, backend="torch", num_kv_blocks=32)
    core = llm.core
    assert llm.scheduler is core.scheduler and llm.runner is core.runner and llm.block_manager is core.block_manager
    llm.decode_steps = 1
    assert core.decode_steps == 1
    rid = llm.add_request([5, 6, 7], GREEDY)
    assert core.has_unfinished_requests() and rid in {r.request_id for r in core.scheduler.waiting}
    outs = []
    while llm.has_unfinished_requests():
        outs += llm.step()
    assert outs[-1].finished and outs[-1].output_token_ids == model.reference_greedy([5, 6, 7], 5)
    assert llm.stats() == core.stats()


def test_the_server_takes_an_engine_core_only(model):
    from tripath.server.transport.core_process import checked_engine

    llm = LLM(model, backend="torch", num_kv_blocks=8)
    assert checked_engine(llm.core) is llm.core
    with pytest.raises(TypeError, match="must return an EngineCore"):
        checked_engine(llm)
