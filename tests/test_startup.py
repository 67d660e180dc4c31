"""The engine's start: the executor's phases run once each, in order (a failed one closes the executor), and
the warm-up, the memory plan and the start's steps read a runner only through their protocols, assigning
nothing to it."""

from __future__ import annotations

import pytest
import torch

from tripath.engine import LLM
from tripath.engine.runner import startup
from tripath.engine.runner.memory_plan import PlanningRunner, run_synthetic_step, worst_steps
from tripath.engine.runner.model_runner import ModelRunner
from tripath.engine.runner.startup import PHASES, StartingRunner
from tripath.engine.runner.warmup import WarmupRunner, runner_limits, saved_plan_path, warm_up


@pytest.fixture
def llm():
    return LLM("tiny-llama", backend="torch", num_kv_blocks=8, max_num_seqs=3, max_num_batched_tokens=32,
               max_model_len=24, compile_workers=1)


class Narrow:
    """``runner`` seen through ``protocol``: any other attribute, and every assignment, raises."""

    def __init__(self, runner, protocol):
        names = {n for base in protocol.__mro__ if base is not object for n in vars(base) if not n.startswith("_")}
        object.__setattr__(self, "_runner", runner)
        object.__setattr__(self, "_names", names)

    def __getattr__(self, name):
        if name not in self._names:
            raise AttributeError(f"{name!r} is read but not in the protocol")
        return getattr(self._runner, name)

    def __setattr__(self, name, value):
        raise AttributeError(f"{name!r} is assigned")


class FakeExecutor:
    def __init__(self, fail: str | None = None):
        self.calls, self.fail = [], fail

    def __getattr__(self, name):
        if name not in (*PHASES, "close"):
            raise AttributeError(name)

        def call(*args):
            self.calls.append((name, *args))
            if name == self.fail:
                raise RuntimeError(f"{name} failed")
            return 7 if name == "plan_memory" else None
        return call


def test_start_runs_the_phases_in_order_and_closes_the_executor_when_one_fails():
    executor = FakeExecutor()
    startup.start(executor)
    assert executor.calls == [("plan_memory",), ("allocate_kv_cache", 7), ("warm_up",), ("capture_graphs",)]
    failing = FakeExecutor(fail="warm_up")
    with pytest.raises(RuntimeError, match="warm_up failed"):
        startup.start(failing)
    assert [c[0] for c in failing.calls] == ["plan_memory", "allocate_kv_cache", "warm_up", "close"]


def test_a_runner_is_built_unstarted_and_its_phases_run_once_each_in_order(llm):
    runner = ModelRunner(llm.model, llm.config)
    assert runner.caches == [] and runner.num_blocks == 0
    with pytest.raises(RuntimeError, match="out of order"):
        runner.warm_up()
    assert runner.plan_memory() == 8   # num_kv_blocks
    runner.allocate_kv_cache(8)
    assert runner.num_blocks == 8 and len(runner.caches) == runner.num_layers
    runner.warm_up()
    runner.capture_graphs()
    with pytest.raises(RuntimeError, match="out of order"):
        runner.plan_memory()
    with pytest.raises(RuntimeError, match="out of order"):
        llm.runner.capture_graphs()   # the engine's runner started already


def test_the_warm_up_reads_the_runner_through_its_protocol(llm):
    runner = Narrow(llm.runner, WarmupRunner)
    report = warm_up(runner, run_kernels=False)
    assert report.steps_probed > 0
    assert saved_plan_path(runner) == saved_plan_path(llm.runner)
    assert startup.compile_pool(runner) is None   # compile_workers=1


def test_the_memory_plan_reads_the_runner_through_its_protocol(llm):
    runner = Narrow(llm.runner, PlanningRunner)
    caches = llm.runner.caches
    before = [(c.k_cache.clone(), c.v_cache.clone()) for c in caches]
    for step in worst_steps(runner_limits(runner), runner.spec.extend_chunk_budget).values():
        run_synthetic_step(runner, step, caches)
    assert all(torch.equal(k, c.k_cache) and torch.equal(v, c.v_cache) for (k, v), c in zip(before, caches))


def test_the_start_steps_read_the_runner_through_their_protocol(llm):
    runner = Narrow(llm.runner, StartingRunner)
    assert startup.time_largest_step(runner) is None   # off a GPU: the forward only, not timed
    ctx = startup.nothing_written_context(runner, 20)
    assert ctx.caches is llm.runner.caches
    startup.warm_sampling(runner, torch.zeros(3, llm.model.config.hidden_size, dtype=llm.config.dtype))
