"""Tensor-parallel ranks: process groups, each rank's sharded model and ModelRunner, and the workers' step loop.

Every rank (rank 0 in the :class:`~tripath.engine.llm.LLM`'s process, ranks ``1 .. W-1`` in workers) goes
through the same phases, so their collectives line up:

1. join the process groups: the default one (NCCL on GPUs, gloo on the CPU; the model's all-reduces) and a
   gloo group on the CPU for control messages;
2. load its shard of the model (:func:`tripath.models.load_model` with its :class:`ParallelState`), then
   exchange a status (ok, or the error) with every rank;
3. build a :class:`~tripath.engine.runner.model_runner.ModelRunner` around it (spec, backend, input builder), then
   exchange a status;
4. start it: rank 0's engine runs the start's phases (:func:`tripath.engine.runner.startup.start`: ``plan_memory``,
   ``allocate_kv_cache``, ``warm_up``, ``capture_graphs``) and broadcasts each as a :class:`StartPhase`; every
   rank runs it on its runner, then all exchange a status (``plan_memory``'s: the rank's KV blocks, of which
   every rank allocates the smallest), so a failure on one rank stops them all there;
5. workers: run every step rank 0 broadcasts over the control group until it broadcasts ``None`` (and, with
   speculative decoding's ``mtp`` method, every run of the MTP layer: :mod:`tripath.engine.runner.mtp_layer`).

A step message is ``(forget, items, draw_keys)``: ``items`` has one tuple per scheduled request, ``(key,
num_new_tokens, num_computed_tokens, num_tokens, first_block, new_blocks, new_token_ids, draft_token_ids,
draft_parents)`` — what a ModelRunner reads of the request (a verify's drafts apart from its own tokens, and
the parents of a draft tree's nodes), with only the KV block
ids the workers have not seen (its block list is ``known[:first_block] + new_blocks``); ``forget`` lists the
keys of requests that finished or were preempted. Workers compute the logits (the LM head gathers over the
ranks) and sample nothing; rank 0's samples are the engine's. A step that rank 0 draws without logits
(:mod:`tripath.engine.sampling.fused_sampling`) has ``draw_keys``, each request's ``(temperature, sampling seed)``:
every rank draws from its vocabulary rows with them (the draw's collective), rank 0 keeps the tokens;
``draw_keys`` is None for the other steps. A step that verified draft trees is followed by a :class:`TreeMoves`
message: the cache slots rank 0 moved along the accepted paths, which every worker moves in its caches.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from tripath.engine.config import EngineConfig
from tripath.engine.requests.request import RequestStatus
from tripath.engine.requests.sampling_params import SamplingParams
from tripath.engine.runner.draft_trees import move_cache_slots
from tripath.engine.runner.mtp_layer import LaunchHidden, MTPLayerRunner, MTPRun, mtp_cache_bytes
from tripath.engine.runner.startup import PHASES
from tripath.engine.runner.step_request import GREEDY, StepRequest
from tripath.engine.sampling.step_sampling import noise_seed
from tripath.engine.scheduling.scheduler import ScheduledRequest

# Workers wait for rank 0's next step as long as the engine is idle: the control group never times out.
CONTROL_TIMEOUT = timedelta(days=365)


@dataclass
class RankSetup:
    """What every rank needs to start (pickled to the spawned workers)."""

    model: str
    config: EngineConfig
    world_size: int
    init_method: str | None  # tcp://127.0.0.1:port for spawned workers; None: the environment (torchrun)
    rendezvous_timeout_s: float = 600.0


@dataclass(frozen=True)
class StartPhase:
    """A phase of the start (:data:`tripath.engine.runner.startup.PHASES`) rank 0 broadcasts: the runner's method of
    that name, called with ``args``."""

    name: str
    args: tuple = ()

    def __post_init__(self):
        if self.name not in PHASES:
            raise ValueError(f"no start phase {self.name!r}; the phases: {', '.join(PHASES)}")


@dataclass(frozen=True)
class TreeMoves:
    """The cache slots rank 0 moved after a step's draft trees were accepted: slot ``sources[i]`` to
    ``targets[i]`` (:func:`tripath.engine.runner.draft_trees.move_tree_paths`)."""

    sources: list[int]
    targets: list[int]


def share_tree_moves_over(control):
    """Rank 0's ``ModelRunner.share_tree_moves`` under tensor parallelism: the moved slots as a
    :class:`TreeMoves` message over the ``control`` group."""
    def share(sources: torch.Tensor, targets: torch.Tensor) -> None:
        dist.broadcast_object_list([TreeMoves(sources.tolist(), targets.tolist())], src=0, group=control)

    return share


class StepEncoder:
    """Rank 0's side of the step messages. A running request's block list only grows (by appending) and is
    replaced when the request is admitted again, so the workers get each block id once: all of them when the
    list is new to them (or was replaced), else the ones appended since the last step."""

    def __init__(self):
        self.known: dict[int, tuple] = {}  # request index -> (request, its block list object, blocks sent)

    def encode(self, scheduled: list[ScheduledRequest],
               fused: bool = False) -> tuple[list[int], list[tuple], list | None]:
        forget = [key for key, (request, _, _) in self.known.items() if request.status is not RequestStatus.RUNNING]
        for key in forget:
            del self.known[key]
        items = []
        for item in scheduled:
            request, start = item.request, item.num_computed_tokens
            blocks = request.block_ids
            _, sent_list, sent = self.known.get(request.index, (None, None, 0))
            if sent_list is not blocks or sent > len(blocks):
                sent = 0
            self.known[request.index] = (request, blocks, len(blocks))
            drafts = item.draft_token_ids
            items.append((request.index, item.num_new_tokens, start, request.num_tokens, sent, blocks[sent:],
                          request.token_ids(start, start + item.num_new_tokens - len(drafts)), drafts,
                          item.draft_parents))
        keys = [(item.request.sampling_params.temperature, noise_seed(item.request)) for item in scheduled] \
            if fused else None
        return forget, items, keys


class StepDecoder:
    """A worker's side: rebuilds the scheduled requests from the step messages."""

    def __init__(self):
        self.blocks: dict[int, list[int]] = {}
        self.params: dict[float, SamplingParams] = {0.0: GREEDY}   # by temperature

    def decode(self, message: tuple[list[int], list[tuple], list | None]) -> list[ScheduledRequest]:
        forget, items, keys = message
        for key in forget:
            self.blocks.pop(key, None)
        scheduled = []
        for key, num_new, computed, num_tokens, first_block, new_blocks, token_ids, drafts, parents in items:
            blocks = self.blocks.get(key)
            if blocks is None or len(blocks) != first_block:
                blocks = self.blocks[key] = (blocks or [])[:first_block]
            blocks.extend(new_blocks)
            request = StepRequest(num_tokens, blocks, computed, token_ids)
            if keys is not None:
                temperature, request.sampling_seed = keys[len(scheduled)]
                if temperature not in self.params:
                    self.params[temperature] = SamplingParams(temperature=temperature)
                request.sampling_params = self.params[temperature]
            samples = bool(drafts) or computed + num_new == num_tokens
            scheduled.append(ScheduledRequest(request, num_new, computed, samples, drafts, parents))
        return scheduled


def rank_device(device: torch.device, local_rank: int, world_size: int) -> torch.device:
    """Rank ``r`` runs on ``cuda:r`` (its local rank under torchrun) or on the CPU."""
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} GPUs; torch sees {count}")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def join_groups(setup: RankSetup, rank: int):
    """Join (or, under torchrun, reuse) the default process group and create the control group; returns
    ``(ParallelState, control group, whether this call created the default group)``."""
    from tripath.models.parallel import ParallelState

    created = False
    if not dist.is_initialized():
        backend = "nccl" if setup.config.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=setup.init_method or "env://", rank=rank,
                                world_size=setup.world_size, timeout=timedelta(seconds=setup.rendezvous_timeout_s))
        created = True
    if dist.get_world_size() != setup.world_size:
        raise ValueError(f"tensor_parallel_size={setup.world_size}, but the process group has "
                         f"{dist.get_world_size()} ranks (torchrun --nproc-per-node must match)")
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return ParallelState(rank=rank, world_size=setup.world_size), control, created


def exchange(control, status) -> list:
    """Every rank's ``status`` (an int, or an error string), in rank order."""
    statuses = [None] * dist.get_world_size(control)
    dist.all_gather_object(statuses, status, group=control)
    return statuses


def _failure(statuses: list, what: str) -> str | None:
    errors = [f"rank {r}: {s}" for r, s in enumerate(statuses) if isinstance(s, str)]
    return f"tensor-parallel {what} failed on {len(errors)} rank(s):\n" + "\n".join(errors) if errors else None


def start_rank(setup: RankSetup, rank: int, config: EngineConfig, parallel, control):
    """Phases 2 and 3 on this rank; returns ``(model, runner)`` or raises ``RuntimeError`` naming the ranks that
    failed (on every rank)."""
    from tripath.engine.runner.model_runner import ModelRunner
    from tripath.models import load_model
    from tripath.triton_internals import default_workers

    model = runner = None
    mtp = config.speculative_config is not None and config.speculative_config.method == "mtp"
    try:
        model = load_model(setup.model, dtype=config.dtype, device=config.device, parallel=parallel, mtp=mtp)
        status = 0
    except Exception as error:  # reported to every rank, so none waits for a rank that will never come
        status = f"{type(error).__name__}: {error}"
    failure = _failure(exchange(control, status), "model loading")
    if failure:
        raise RuntimeError(failure)
    if config.compile_workers is None:  # the ranks share the cores while they compile the same kernels
        config = replace(config, compile_workers=max(1, default_workers() // setup.world_size))
    try:
        runner = ModelRunner(model, config, extra_cache_bytes=mtp_cache_bytes(model, config) if mtp else None)
        status = 0
    except Exception as error:
        status = f"{type(error).__name__}: {error}"
    failure = _failure(exchange(control, status), "engine start")
    if failure:
        raise RuntimeError(failure)
    return model, runner


def run_start_phase(runner, phase: StartPhase, control) -> int:
    """Phase 4 for one start phase on this rank: run it on ``runner`` and exchange the outcome with every rank;
    returns the smallest rank's result (``plan_memory``'s KV blocks; 0 for the others) or raises
    ``RuntimeError`` naming the ranks that failed (on every rank)."""
    try:
        result = getattr(runner, phase.name)(*phase.args)
        status = result if isinstance(result, int) else 0
    except Exception as error:  # reported to every rank, so none goes on to collectives a failed rank never joins
        status = f"{type(error).__name__}: {error}"
    statuses = exchange(control, status)
    failure = _failure(statuses, f"engine start ({phase.name})")
    if failure:
        raise RuntimeError(failure)
    return min(statuses)


def serve(runner, control) -> None:
    """A worker's loop: run each broadcast start phase, then each broadcast step until the stop message
    (computing the logits, whose LM head gathers over the ranks, without sampling: rank 0's samples are the
    engine's), the cache slots rank 0 moved along accepted draft trees (:class:`TreeMoves`), and each run of the
    MTP layer rank 0's proposer makes (:mod:`tripath.engine.runner.mtp_layer`; its cache allocated at the
    first)."""
    runner.samples = False
    box, decoder, mtp_layer = [None], StepDecoder(), None
    speculation = runner.config.speculative_config
    if speculation is not None and speculation.method == "mtp":   # MTP runs read the launches' hidden states
        launch = runner.hidden_observer = LaunchHidden()
    try:
        while True:
            dist.broadcast_object_list(box, src=0, group=control)
            message = box[0]
            if message is None:
                return
            if isinstance(message, StartPhase):
                run_start_phase(runner, message, control)
            elif isinstance(message, TreeMoves):
                device = runner.device
                move_cache_slots(runner.caches, torch.tensor(message.sources, dtype=torch.int64, device=device),
                                 torch.tensor(message.targets, dtype=torch.int64, device=device))
            elif isinstance(message, MTPRun):
                if mtp_layer is None:
                    mtp_layer = MTPLayerRunner(runner.model, runner, runner.config)
                mtp_layer.run_shared(message, launch)
            else:
                runner.execute(decoder.decode(message), fused=message[2] is not None)
    finally:
        runner.close()


def _exit_when_orphaned(parent: int) -> None:
    """A spawned worker's watchdog: exit as soon as rank 0's process is gone."""
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(0.5)


def leave_groups(control, created: bool) -> None:
    for group in (control, None) if created else (control,):
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - a peer may have gone already; nothing left to release
            pass


def run_worker(rank: int, setup: RankSetup, *, local_rank: int | None = None, parent: int | None = None) -> None:
    """Everything a worker rank does, from joining the groups to the stop message (``local_rank``: its GPU,
    default ``rank``; ``parent``: exit when this process is gone)."""
    if parent is not None:
        threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()
    device = rank_device(setup.config.device, rank if local_rank is None else local_rank, setup.world_size)
    if device.type == "cpu":  # the ranks share the cores
        torch.set_num_threads(max(1, torch.get_num_threads() // setup.world_size))
    config = replace(setup.config, device=device)
    parallel, control, created = join_groups(setup, rank)
    try:
        _, runner = start_rank(setup, rank, config, parallel, control)
        serve(runner, control)
    finally:
        leave_groups(control, created)


def spawned_worker(index: int, setup: RankSetup, parent: int) -> None:
    """Entry point of spawned worker ``index`` (rank ``index + 1``)."""
    try:
        run_worker(index + 1, setup, parent=parent)
    except RuntimeError as error:  # a start failure: rank 0 reports it
        print(f"tripath tensor-parallel rank {index + 1}: {error}", file=sys.stderr)
        sys.exit(1)
    except Exception:  # noqa: BLE001 - the traceback is the report
        traceback.print_exc()
        sys.exit(1)
