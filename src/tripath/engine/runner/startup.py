"""How an executor starts, before it serves: :func:`start` runs its phases (:data:`PHASES`) once each, in order.

1. ``plan_memory``: first (GPU, ``skinny_gemms="auto"``) the projections' GEMM per weight shape and row class,
   timed on the model's weights (:func:`choose_gemm_routes`), so the memory plan's steps run as the engine
   will; then the KV cache's size in blocks: ``num_kv_blocks`` if given (on the CPU,
   ``CPU_DEFAULT_KV_BLOCKS``), else on a GPU the memory plan (:func:`tripath.engine.runner.memory_plan.plan_gpu_memory`:
   the worst step of each kind measured on a scratch cache, graph pools and headroom reserved, the cache gets
   what is left of ``gpu_memory_utilization``);
2. ``allocate_kv_cache``: the caches, one per attention layer;
3. ``warm_up`` (GPU, Triton backends): every kernel variant the limits allow is compiled
   (:mod:`tripath.engine.runner.warmup`), by worker processes when the Triton cache is empty
   (:func:`compile_pool`, opened by phase 1 and closed by this one);
4. ``capture_graphs``: the verify graphs (:mod:`tripath.engine.runner.verify_graphs`: speculative decoding, where the
   backend allows them), then the decode graphs (:mod:`tripath.engine.runner.decode_graphs`) in their memory pool;
   then (GPU) the largest eager step, run once writing nothing and timed, the LM head and the sampler for
   every row count (:func:`warm_sampling`), and the fused LM head and draw, timed against them per bucket of
   row counts (:func:`tripath.engine.sampling.fused_sampling.measure`); where the step's host time is at least
   ``MIXED_GRAPHS_MIN_HOST_SHARE`` of its GPU span, steps with prompt tokens get piecewise graphs
   (:mod:`tripath.engine.runner.mixed_graphs`); last, the caching allocator gives back what these left and
   holds one largest step's memory again (:func:`hold_step_memory`), so when requests arrive it holds what
   the memory plan reserves for a step.

A :class:`~tripath.engine.runner.model_runner.ModelRunner` implements the phases on one rank (:class:`RunnerStart`); a
:class:`~tripath.engine.runner.parallel_executor.ParallelExecutor` runs each on rank 0 and broadcasts it to the worker
ranks, which run it on their own runners (:mod:`tripath.engine.runner.worker`), so every rank starts the same way. The
functions below read a runner through :class:`StartingRunner` (the warm-up and the memory plan through their
own protocols) and assign nothing to it: the runner keeps what they return.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Iterator, Protocol

import torch

from tripath.attention import ForwardContext
from tripath.attention.backends.base import GraphSupport
from tripath.engine.config import CPU_DEFAULT_KV_BLOCKS
from tripath.engine.requests.sampling_params import SamplingParams
from tripath.engine.runner import warmup
from tripath.engine.runner.executor import Executor, ExecutorCapabilities
from tripath.engine.runner.memory_plan import MemoryPlan, plan_gpu_memory
from tripath.engine.runner.mixed_graphs import MixedStepGraphs
from tripath.engine.runner.whole_step_graphs import WholeStepGraphs
from tripath.engine.runner.warmup import RunnerBasics, WarmupRunner, saved_plan_path
from tripath.engine.sampling import fused_sampling
from tripath.engine.sampling.sampler import make_generator, sample
from tripath.engine.scheduling.block_manager import blocks_needed
from tripath.ops.linear import forget_routes
from tripath.ops.linear_routes import RouteTiming, choose_routes
from tripath.triton_internals import CompilePool, default_workers, warm_up_recording

if TYPE_CHECKING:
    from tripath.engine.runner.decode_graphs import DecodeGraphs
    from tripath.engine.sampling.fused_sampling import FusedSampling

logger = logging.getLogger(__name__)

# Piecewise graphs are captured when the largest eager step's host time is at least this share of its GPU
# span (measured at start): a host-bound shape (a small tensor-parallel shard) is well above it, a GPU-bound
# one (a whole 8B model) well below (docs/BENCHMARKS.md, "Measurements behind the code's choices").
MIXED_GRAPHS_MIN_HOST_SHARE = 0.5

PHASES = ("plan_memory", "allocate_kv_cache", "warm_up", "capture_graphs")   # the start, in order


def start(executor: Executor) -> None:
    """Start ``executor`` (built: its model, spec, backend and input builder): the phases of the module doc,
    once each, in order; their wall-clock seconds are left on it as ``start_phase_seconds`` (phase -> seconds,
    in order) and logged. When one fails the executor is closed (its compile pool, its worker ranks)."""
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def done(phase: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[phase], clock = now - clock, now

    try:
        num_blocks = executor.plan_memory()
        done("plan_memory")
        executor.allocate_kv_cache(num_blocks)
        done("allocate_kv_cache")
        executor.warm_up()
        done("warm_up")
        executor.capture_graphs()
        done("capture_graphs")
    except BaseException:
        executor.close()
        raise
    executor.start_phase_seconds = seconds
    logger.info("start: %s", ", ".join(f"{phase} {s:.1f} s" for phase, s in seconds.items()))


class PhaseOrder:
    """An executor's place in :data:`PHASES`: :meth:`enter` each phase once, in order, or RuntimeError."""

    def __init__(self, owner: str):
        self.owner, self.done = owner, 0

    def enter(self, phase: str) -> None:
        if self.done >= len(PHASES) or PHASES[self.done] != phase:
            raise RuntimeError(f"{self.owner}.{phase}() out of order: the start runs {', '.join(PHASES)}, once "
                               f"each ({self.done} done)")
        self.done += 1


def warms_up(runner: WarmupRunner) -> bool:
    """Whether the start compiles every kernel variant (:mod:`tripath.engine.runner.warmup`): the ``warmup`` setting,
    on a GPU, with a backend of Triton kernels."""
    return runner.config.warmup and runner.device.type == "cuda" and runner.backend.capabilities.needs_triton


class RunnerStart:
    """The phases of a :class:`~tripath.engine.runner.model_runner.ModelRunner`'s start, mixed into it: :func:`start`
    calls them once each, in order (``self._phases``, a :class:`PhaseOrder`); they keep on the runner what the
    functions below, the warm-up and the memory plan compute."""

    def plan_memory(self) -> int:
        """The KV cache's blocks: ``num_kv_blocks``, the CPU default, or on a GPU the memory plan's. Opens the
        start's compile pool (:func:`compile_pool`) where the warm-up pays for one."""
        self._phases.enter("plan_memory")
        self._compile_pool = compile_pool(self) if warms_up(self) else None
        self.gemm_routes = choose_gemm_routes(self)
        if self.config.num_kv_blocks is not None or self.device.type != "cuda":
            return self.config.num_kv_blocks or CPU_DEFAULT_KV_BLOCKS
        self.penalties.allocate(self.logits_width())  # held for the engine's life: in use, not a step's
        self.memory_plan = plan_gpu_memory(self, self._compile_pool)
        return self.memory_plan.num_blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._phases.enter("allocate_kv_cache")
        if self.memory_plan is not None:   # tensor parallelism: every rank takes the smallest rank's plan
            self.memory_plan.num_blocks = num_blocks
        self.num_blocks = num_blocks
        self.caches = [self.backend.allocate_cache(num_blocks, self.device) for _ in range(self.num_layers)]

    def warm_up(self) -> None:
        self._phases.enter("warm_up")
        try:
            if warms_up(self):
                with noting_peak(self.memory_plan, self.device, "warm-up peak"):
                    self.warmup_report = warmup.warm_up(self, pool=self._compile_pool)
        finally:
            self.close()   # the compile pool

    def capture_graphs(self) -> None:
        self._phases.enter("capture_graphs")
        with noting_growth(self.memory_plan, self.device, "graph pools"):
            if self.captures_verify_graphs:
                self.capture_verify_graphs()
            if self.captures_decode_graphs:
                self.capture_decode_graphs()
            if self.device.type == "cuda":
                self.largest_step_host_share = time_largest_step(self)
                whole = self.backend.capabilities.graphs is GraphSupport.ALL
                if self.uses_mixed_graphs and (whole or self.largest_step_host_share >= MIXED_GRAPHS_MIN_HOST_SHARE):
                    self.mixed_graphs = capture_mixed_graphs(self)
                hold_step_memory(self)
        if self.memory_plan is not None:   # what the device holds that PyTorch's allocator does not count
            free, total = torch.cuda.mem_get_info(self.device)
            outside = total - free - torch.cuda.memory_reserved(self.device)
            self.memory_plan.measured["outside the allocator"] = outside

    def close(self) -> None:
        """Release the start's compile pool, if open (one rank, in this process: nothing else); idempotent."""
        pool, self._compile_pool = self._compile_pool, None
        if pool is not None:
            pool.close()


class StartingRunner(RunnerBasics, Protocol):
    """What the start's steps that write nothing (and the piecewise graphs' capture) read of a runner."""

    @property
    def caches(self) -> list: ...

    @property
    def capabilities(self) -> ExecutorCapabilities: ...

    @property
    def decode_graphs(self) -> DecodeGraphs | None: ...   # whose memory pool the piecewise graphs share

    @property
    def max_blocks_per_seq(self) -> int: ...   # the block table's width for max_model_len (graph captures)

    @property
    def fused_sampling(self) -> FusedSampling | None: ...   # measured at start (fused_sampling.measure)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def choose_gemm_routes(runner: StartingRunner) -> list[RouteTiming]:
    """With ``skinny_gemms="auto"`` on a GPU, time and route the model's projections
    (:func:`tripath.ops.linear_routes.choose_routes`, every row class up to ``max_num_batched_tokens``);
    ``"off"`` drops the process's routes (cuBLAS everywhere). Returns the timings (none on the CPU)."""
    if runner.config.skinny_gemms == "off":
        forget_routes()
        return []
    projections = getattr(runner.model, "projections", None)
    if runner.device.type != "cuda" or projections is None:
        return []
    started = time.perf_counter()
    timings = choose_routes(projections(), runner.config.max_num_batched_tokens)
    logger.info("skinny GEMM routes: %d of %d shape and row classes to Triton, timed in %.2f s",
                sum(t.triton for t in timings), len(timings), time.perf_counter() - started)
    return timings


def compile_pool(runner: WarmupRunner) -> CompilePool | None:
    """Worker processes for the start's compilations (:mod:`tripath.triton_internals.compile_pool`): with
    ``compile_workers`` > 1 (None: :func:`~tripath.triton_internals.default_workers`) and no saved warm-up
    plan, whose absence means an empty or outdated Triton cache (a warm one would make them idle)."""
    workers = runner.config.compile_workers or default_workers()
    if workers < 2 or saved_plan_path(runner).is_file():
        return None
    return CompilePool(workers)


@contextlib.contextmanager
def noting_peak(plan: MemoryPlan | None, device: torch.device, name: str) -> Iterator[None]:
    """Record in ``plan.measured[name]`` the most allocated above what was allocated when the block began
    (when it ends without an error; nothing without a memory plan)."""
    if plan is None:
        yield
        return
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    yield
    torch.cuda.synchronize(device)
    plan.measured[name] = torch.cuda.max_memory_allocated(device) - base


@contextlib.contextmanager
def noting_growth(plan: MemoryPlan | None, device: torch.device, name: str) -> Iterator[None]:
    """Record in ``plan.measured[name]`` what the block left allocated (nothing without a memory plan)."""
    if plan is None:
        yield
        return
    before = torch.cuda.memory_allocated(device)
    yield
    torch.cuda.synchronize(device)
    plan.measured[name] = torch.cuda.memory_allocated(device) - before


# ---- steps that write nothing ---------------------------------------------------------------------------
def split_prompts(runner: StartingRunner, num_tokens: int) -> list[int]:
    """``num_tokens`` tokens as prompt lengths of at most ``max_model_len``."""
    limit = runner.max_model_len
    return [min(limit, num_tokens - start) for start in range(0, num_tokens, limit)]


def largest_prompt_step(runner: StartingRunner) -> list[int]:
    """Prompt lengths of the largest step the limits allow: ``max_num_batched_tokens`` tokens in sequences
    of at most ``max_model_len``, at most ``max_num_seqs`` of them."""
    return split_prompts(runner, runner.config.max_num_batched_tokens)[:runner.config.max_num_seqs]


def nothing_written_context(runner: StartingRunner, num_tokens: int) -> ForwardContext:
    """A context for prompts of ``num_tokens`` tokens in all (sequences of at most ``max_model_len``) whose
    slots are all −1 and whose rows read block 0: its steps write nothing to the caches."""
    lens = split_prompts(runner, num_tokens)
    plan = runner.backend.plan(lens, [0] * len(lens))
    width = max(blocks_needed(n, runner.block_size) for n in lens)
    block_table = torch.zeros(len(lens), width, dtype=torch.int32, device=runner.device)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=runner.device)
    return ForwardContext(runner.backend, runner.backend.build_metadata(plan, block_table, slots), runner.caches)


def capture_mixed_graphs(runner: StartingRunner) -> MixedStepGraphs | WholeStepGraphs:
    """Graphs of steps with prompt tokens for ``config.mixed_cuda_graph_sizes()``, captured (in the decode
    graphs' memory pool): whole steps for a backend of :attr:`GraphSupport.ALL`, else piecewise graphs whose
    capture's attention calls see prompts that write nothing."""
    pool = None if runner.decode_graphs is None else runner.decode_graphs.pool
    if runner.backend.capabilities.graphs is GraphSupport.ALL:
        whole = WholeStepGraphs(runner.model, runner.backend, runner.caches, runner.config.mixed_cuda_graph_sizes(),
                                runner.config.max_num_seqs, runner.max_model_len, runner.max_blocks_per_seq,
                                runner.device, pool=pool)
        whole.capture()
        return whole
    graphs = MixedStepGraphs(runner.model, runner.config.mixed_cuda_graph_sizes(), runner.device, pool=pool)
    with torch.inference_mode():
        graphs.capture(lambda n: nothing_written_context(runner, n))
    warm_up_recording()  # the graphs' steps record and replay their layers' launches
    return graphs


@torch.inference_mode()
def time_largest_step(runner: StartingRunner) -> float | None:
    """Run the largest eager step once on the real caches, writing nothing (every slot −1, every row reading
    block 0), then :func:`warm_sampling` on up to ``max_num_seqs`` of its rows and the fused sampling's
    timing: every kernel and cuBLAS choice of those is loaded before requests arrive. Returns the forward's
    host time over its GPU span (near 1: the step is host-bound); None off a GPU, where only the forward
    runs."""
    ids, positions, ctx = largest_step_inputs(runner)
    on_gpu = runner.device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize(runner.device)
        events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        events[0].record()
    begin = time.perf_counter()
    hidden = runner.model(ids, positions, ctx)
    host_s = time.perf_counter() - begin
    if not on_gpu:
        return None
    events[1].record()
    torch.cuda.synchronize(runner.device)
    share = host_s / max(events[0].elapsed_time(events[1]) / 1e3, 1e-9)
    warm_sampling(runner, hidden[:min(runner.config.max_num_seqs, hidden.shape[0])])
    fused_sampling.measure(runner, hidden[:runner.config.max_num_seqs])
    return share


def largest_step_inputs(runner: StartingRunner) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
    """``input_ids``, ``positions`` and a context that writes nothing, for the largest step the limits allow."""
    lens = largest_prompt_step(runner)
    ids = torch.zeros(sum(lens), dtype=torch.int64, device=runner.device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(runner.device)
    return ids, positions, nothing_written_context(runner, sum(lens))


@torch.inference_mode()
def hold_step_memory(runner: StartingRunner) -> None:
    """The end of a GPU start: give the device back what the start's warm-ups left cached in PyTorch's
    allocator (segments of every size the row-count sweeps, the timings and the captures' eager runs made,
    which the memory plan does not reserve), then run the largest step once more, writing nothing, and sample
    ``max_num_seqs`` of its rows with top-k and top-p, so the allocator holds one step's memory (the plan's
    ``step peak``) and no more."""
    torch.cuda.synchronize(runner.device)
    torch.cuda.empty_cache()
    ids, positions, ctx = largest_step_inputs(runner)
    hidden = runner.model(ids, positions, ctx)
    rows = min(runner.config.max_num_seqs, hidden.shape[0])
    logits = runner.compute_logits(hidden[:rows])
    del hidden
    sample(logits, [SamplingParams(temperature=1.0, top_k=50, top_p=0.9)] * rows,
           [make_generator(0, runner.device)] * rows)
    torch.cuda.synchronize(runner.device)


@torch.inference_mode()
def warm_sampling(runner: StartingRunner, hidden: torch.Tensor) -> None:
    """Run the eager work after a step's forward once for every row count it can take, before requests
    arrive: the LM head and sampling of ``1 … hidden.shape[0]`` rows (greedy for each count, with a
    temperature, top-k and top-p for powers of two and the largest, whose probabilities are the largest
    temporary a step allocates), and the device-side advance of multi-step decoding. The first LM-head
    product of each row count picks and loads a cuBLAS kernel, which would stall the first steps that meet
    that count, so it belongs to the start."""
    rows = hidden.shape[0]
    greedy = SamplingParams(temperature=0.0)
    sampled = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
    plain = SamplingParams(temperature=1.0)   # drawn by Gumbel-max with noise keys
    generator = make_generator(0, runner.device)  # not the global generator
    for m in range(1, rows + 1):
        logits = runner.compute_logits(hidden[:m])
        sample(logits, [greedy] * m, [None] * m)
        if m & (m - 1) == 0 or m == rows:
            sample(logits, [sampled] * m, [generator] * m)
            keys = torch.zeros(m, dtype=torch.int64, device=runner.device)
            sample(logits, [plain] * m, [None] * m, noise=(keys, keys))
    if runner.capabilities.multi_step:
        device = runner.device
        plan = runner.backend.plan([1], [1])
        meta = runner.backend.build_metadata(plan, torch.zeros(1, 1, dtype=torch.int32, device=device),
                                             torch.full((1,), -1, dtype=torch.int64, device=device))
        meta.advance_decodes_(torch.ones(1, dtype=torch.int64, device=device), runner.block_size)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
