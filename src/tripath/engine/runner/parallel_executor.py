"""Rank 0 of a tensor-parallel engine: starts the other ranks and broadcasts every step to them.

``LLM(model, tensor_parallel_size=W)`` builds a :class:`ParallelExecutor` in place of its ModelRunner. The
LLM's process is rank 0: it owns the only scheduler and block manager, broadcasts each step's plan over a
gloo control group (:mod:`tripath.engine.runner.worker` says what a step message holds), runs its own shard of the
model through an ordinary ModelRunner, and samples. Ranks ``1 .. W-1`` run the same steps on their shards,
on the same attention backend (and CUDA graphs), meeting rank 0 in each layer's all-reduce.

Launching: without ``torchrun`` the executor spawns ``W - 1`` worker processes (``torch.multiprocessing``,
spawn start method, rendezvous on a free port of 127.0.0.1), rank ``r`` on ``cuda:r`` or the CPU; a script
that builds the LLM at import time needs the usual ``if __name__ == "__main__":`` guard. Under ``torchrun``
(``RANK``/``WORLD_SIZE`` set, ``WORLD_SIZE == W``) every process builds the LLM: rank 0's returns, and on
the other ranks the constructor serves rank 0's steps and ends the process (``SystemExit(0)``) when rank
0's LLM closes.

Shutdown: :meth:`close` (``LLM.close()``, the ``with`` block's end, garbage collection or interpreter exit)
broadcasts the stop message, joins the workers (terminating any that linger) and leaves the process groups.
Spawned workers also exit on their own when rank 0's process dies.
"""

from __future__ import annotations

import os
import socket
import weakref

import torch
import torch.distributed as dist

from tripath import _env
from tripath.engine.config import EngineConfig
from tripath.engine.runner.executor import ExecutorCapabilities
from tripath.engine.runner.launched_step import LaunchedStep, SampledStep
from tripath.engine.runner.worker import (RankSetup, StartPhase, StepEncoder, join_groups, leave_groups, rank_device,
                                          run_start_phase, run_worker, share_tree_moves_over, spawned_worker,
                                          start_rank)

JOIN_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_shardable(model: str, world: int, mtp: bool = False) -> None:
    """Raise what loading would (unknown model, bad config, no multi-token-prediction layer where ``mtp``) or
    the first shape ``world`` ranks cannot split, before any process starts: the model (and its MTP layer) is
    built for rank 0 on the meta device (no memory)."""
    from tripath.models import load_config, load_model
    from tripath.models.deepseek_mtp import DeepseekMTP
    from tripath.models.loader import MODEL_CLASSES
    from tripath.models.parallel import ParallelState
    from tripath.models.presets import PRESETS

    if os.path.isdir(model):
        config = load_config(model)
    elif model in PRESETS:
        config = PRESETS[model]()
    else:
        load_model(model)  # raises its FileNotFoundError
    with torch.device("meta"):
        MODEL_CLASSES[config.family](config, torch.float32, ParallelState(0, world))
        if mtp:
            DeepseekMTP(config, torch.float32, ParallelState(0, world))


class _Shutdown:
    """The executor's teardown, kept apart from it so that garbage collection can run it."""

    def __init__(self, processes, control, created: bool):
        self.processes, self.control, self.created = processes, control, created
        self.serving = False

    def __call__(self) -> None:
        if self.serving:
            self.serving = False
            try:
                dist.broadcast_object_list([None], src=0, group=self.control)
            except Exception:  # noqa: BLE001 - workers already gone (interpreter exit): nothing to stop
                pass
        for process in self.processes:
            process.join(JOIN_TIMEOUT_S)
            if process.is_alive():
                process.terminate()
                process.join(JOIN_TIMEOUT_S)
        leave_groups(self.control, self.created)


class ParallelExecutor:
    """Rank 0's side of tensor parallelism, an :class:`~tripath.engine.runner.executor.Executor`: ``launch``
    broadcasts each step to the workers and runs rank 0's shard on its
    :class:`~tripath.engine.runner.model_runner.ModelRunner` (``runner``); the other attributes the engine reads
    (``backend``, ``block_size``, ``max_model_len``, the memory plan and graphs) are rank 0's runner's.
    ``model``: a local Hugging Face directory or a preset name (each rank loads its own shard). ``num_blocks``
    is the smallest KV cache of all ranks."""

    def __init__(self, model, config: EngineConfig, tensor_parallel_size: int, *, rendezvous_timeout_s: float = 300.0):
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"tensor_parallel_size={tensor_parallel_size} needs the model as a path or preset name "
                            f"(each rank loads its own shard), not a {type(model).__name__}")
        world = tensor_parallel_size
        speculation = config.speculative_config
        check_shardable(os.fspath(model), world, mtp=speculation is not None and speculation.method == "mtp")
        self.processes = []
        torchrun = _env.torchrun_ranks()
        if torchrun is not None:
            (rank, local_rank), init_method = torchrun, None
        else:
            if dist.is_initialized():
                raise RuntimeError("a torch.distributed process group exists in this process already: close the "
                                   "other tensor-parallel LLM first, or launch every rank with torchrun")
            rank = local_rank = 0
            init_method = f"tcp://127.0.0.1:{free_port()}"
        config.device = rank_device(config.device, local_rank, world)
        setup = RankSetup(os.fspath(model), config, world, init_method, rendezvous_timeout_s)
        if rank != 0:
            run_worker(rank, setup, local_rank=local_rank)
            raise SystemExit(0)
        if init_method is not None:
            context = torch.multiprocessing.get_context("spawn")
            for index in range(world - 1):
                process = context.Process(target=spawned_worker, args=(index, setup, os.getpid()), daemon=True,
                                          name=f"tripath-tp-rank{index + 1}")
                process.start()
                self.processes.append(process)
        try:
            self.parallel, self.control, created = join_groups(setup, 0)
        except BaseException:
            for process in self.processes:
                process.terminate()
            raise
        self._shutdown = _Shutdown(self.processes, self.control, created)
        self._finalizer = weakref.finalize(self, self._shutdown)
        try:
            self.model, self.runner = start_rank(setup, 0, config, self.parallel, self.control)
        except BaseException:
            self.close()
            raise
        self._shutdown.serving = True   # the workers wait for start phases and steps
        self.runner.share_tree_moves = share_tree_moves_over(self.control)
        self.num_blocks = 0   # until allocate_kv_cache
        self.encoder = StepEncoder()

    # workers need each step's input tokens on the host: no overlap, one model step a launch
    capabilities = ExecutorCapabilities(overlap=False, multi_step=False)

    @property
    def tensor_parallel_size(self) -> int:
        return self.parallel.world_size

    # ---- the start (tripath.engine.runner.startup.start): each phase on every rank, rank 0's runner checking the order
    def _start_phase(self, name: str, *args) -> int:
        if not self._finalizer.alive:
            raise RuntimeError("this tensor-parallel engine is closed")
        phase = StartPhase(name, args)
        dist.broadcast_object_list([phase], src=0, group=self.control)
        try:
            return run_start_phase(self.runner, phase, self.control)
        except RuntimeError:
            self._shutdown.serving = False   # every worker left its loop with the same error
            raise

    def reserve_rank0_cache(self, extra_cache_bytes) -> None:
        """Count another cache of as many blocks in rank 0's memory plan (``block_size -> bytes`` per block: a
        draft model's, which runs beside rank 0's shard); every rank then allocates rank 0's smaller count.
        Before :meth:`plan_memory`."""
        if self.num_blocks:
            raise RuntimeError("reserve_rank0_cache comes before the memory plan")
        self.runner.extra_cache_bytes = extra_cache_bytes

    def plan_memory(self) -> int:
        """The KV blocks of the smallest rank's plan."""
        return self._start_phase("plan_memory")

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._start_phase("allocate_kv_cache", num_blocks)
        self.num_blocks = num_blocks

    def warm_up(self) -> None:
        self._start_phase("warm_up")

    def capture_graphs(self) -> None:
        self._start_phase("capture_graphs")

    def launch(self, scheduled, previous=None, num_steps: int = 1) -> LaunchedStep:
        """Broadcast the step to the workers and launch rank 0's shard (one model step, no step in flight:
        ``capabilities`` declare neither)."""
        if num_steps != 1 or previous is not None:
            raise ValueError(f"a tensor-parallel engine runs one model step a launch with no step in flight, got "
                             f"num_steps={num_steps}, previous={'set' if previous is not None else None}")
        if not self._finalizer.alive:
            raise RuntimeError("this tensor-parallel engine is closed")
        dead = [(i + 1, p.exitcode) for i, p in enumerate(self.processes) if not p.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel worker ranks exited: {dead} (rank, exit code)")
        fused = self.runner.step_draws_fused(scheduled)   # the ranks' collectives follow rank 0's choice
        dist.broadcast_object_list([self.encoder.encode(scheduled, fused)], src=0, group=self.control)
        return self.runner.launch(scheduled, fused=fused)

    def execute(self, scheduled, num_steps: int = 1) -> SampledStep:
        """:meth:`launch`, then its tokens."""
        return self.launch(scheduled, num_steps=num_steps).sampled() if scheduled else SampledStep.empty(0)

    def close(self) -> None:
        """Stop the workers and leave the process groups (idempotent)."""
        runner = self.__dict__.get("runner")
        if runner is not None:
            runner.close()
        self._finalizer()

    # rank 0's runner, as the engine and its reports read it
    def logits_width(self) -> int:
        return self.runner.logits_width()

    def compute_logits(self, hidden):
        return self.runner.compute_logits(hidden)

    backend = property(lambda self: self.runner.backend)
    block_size = property(lambda self: self.runner.block_size)
    max_model_len = property(lambda self: self.runner.max_model_len)
    config = property(lambda self: self.runner.config)
    memory_plan = property(lambda self: self.runner.memory_plan)
    warmup_report = property(lambda self: self.runner.warmup_report)
    decode_graphs = property(lambda self: self.runner.decode_graphs)
    mixed_graphs = property(lambda self: self.runner.mixed_graphs)
    largest_step_host_share = property(lambda self: self.runner.largest_step_host_share)
    fused_sampling = property(lambda self: self.runner.fused_sampling)
    gemm_routes = property(lambda self: self.runner.gemm_routes)
    num_fused_sampling_steps = property(lambda self: self.runner.num_fused_sampling_steps)
