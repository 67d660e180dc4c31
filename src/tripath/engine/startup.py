"""How a :class:`~tripath.engine.model_runner.ModelRunner` starts, before it serves (:func:`start`), in order:

1. the KV cache's size: ``num_kv_blocks`` if given (on the CPU, ``CPU_DEFAULT_KV_BLOCKS``), else on a GPU the
   memory plan (:mod:`tripath.engine.memory_plan`: the worst step of each kind measured on a scratch cache,
   graph pools and headroom reserved, the cache gets what is left of ``gpu_memory_utilization``);
2. the caches, one per attention layer;
3. the warm-up (GPU, Triton backends): every kernel variant the limits allow is compiled
   (:mod:`tripath.engine.warmup`), by worker processes when the Triton cache is empty
   (:mod:`tripath.triton_internals.compile_pool`);
4. the verify graphs (:mod:`tripath.engine.verify_graphs`: speculative decoding, where the backend allows
   them), then the decode graphs (:mod:`tripath.engine.decode_graphs`) in their memory pool;
5. (GPU) the largest eager step, run once writing nothing, so the caching allocator holds a step's activation
   memory when requests arrive, and timed: where its host time is at least ``MIXED_GRAPHS_MIN_HOST_SHARE``
   of its GPU span, steps with prompt tokens get piecewise graphs (:mod:`tripath.engine.mixed_graphs`);
   then the LM head and the sampler for every row count (:func:`warm_sampling`), and the fused LM head and
   draw, timed against them per bucket of row counts (:func:`tripath.engine.fused_sampling.measure`).
"""

from __future__ import annotations

import gc

import logging
import time

import torch

from tripath.attention import ForwardContext
from tripath.triton_internals import CompilePool, collect_compilations, default_workers, warm_up_recording
from tripath.engine import fused_sampling
from tripath.engine.block_manager import blocks_needed
from tripath.engine.config import CPU_DEFAULT_KV_BLOCKS
from tripath.engine.memory_plan import (HEADROOM_FRACTION, MIN_HEADROOM, SCRATCH_BLOCKS, MemoryPlan, check_fits,
                                       kv_blocks_left, measure_step_peaks, run_synthetic_step, worst_steps)
from tripath.engine.mixed_graphs import MixedStepGraphs
from tripath.engine.sampling_params import SamplingParams
from tripath.engine.sampler import make_generator, sample
from tripath.engine.warmup import runner_limits, saved_plan_path, warm_up

logger = logging.getLogger(__name__)

# Piecewise graphs are captured when the largest eager step's host time is at least this share of its GPU
# span (measured at start): on an H200 the mha-tp8 shape measured 0.79–0.97 (host-bound), the 8B shape 0.14.
MIXED_GRAPHS_MIN_HOST_SHARE = 0.5


def start(runner) -> None:
    """Steps 1-5 of the module doc on ``runner`` (which has its model, spec, backend and limits)."""
    config, device = runner.config, runner.device
    warms_up = config.warmup and device.type == "cuda" and runner.backend.capabilities.needs_triton
    pool = compile_pool(runner) if warms_up else None
    try:
        if config.num_kv_blocks is None and device.type == "cuda":
            runner.memory_plan = plan_memory(runner, pool)
            runner.num_blocks = runner.memory_plan.num_blocks
        else:
            runner.num_blocks = config.num_kv_blocks or CPU_DEFAULT_KV_BLOCKS
        runner.caches = [runner.backend.allocate_cache(runner.num_blocks, device) for _ in range(runner.num_layers)]
        if warms_up:
            base = _track_peak(runner)
            runner.warmup_report = warm_up(runner, pool=pool)
            _note_peak(runner, "warm-up peak", base)
    finally:
        if pool is not None:
            pool.close()
    before_graphs = torch.cuda.memory_allocated(device) if runner.memory_plan is not None else 0
    if runner.captures_verify_graphs:
        runner.capture_verify_graphs()
    if runner.captures_decode_graphs:
        runner.capture_decode_graphs()
    if device.type == "cuda":
        runner.largest_step_host_share = reserve_step_memory(runner)
        if runner.uses_mixed_graphs and runner.largest_step_host_share >= MIXED_GRAPHS_MIN_HOST_SHARE:
            capture_mixed_graphs(runner)
    if runner.memory_plan is not None:
        torch.cuda.synchronize(device)
        runner.memory_plan.measured["graph pools"] = torch.cuda.memory_allocated(device) - before_graphs


def compile_pool(runner) -> CompilePool | None:
    """Worker processes for the start's compilations (:mod:`tripath.triton_internals.compile_pool`): with
    ``compile_workers`` > 1 (None: :func:`~tripath.triton_internals.default_workers`) and no saved warm-up
    plan, whose absence means an empty or outdated Triton cache (a warm one would make them idle)."""
    workers = runner.config.compile_workers or default_workers()
    if workers < 2 or saved_plan_path(runner).is_file():
        return None
    return CompilePool(workers)


# ---- the memory plan ------------------------------------------------------------------------------------
def plan_memory(runner, pool: CompilePool | None = None) -> MemoryPlan:
    """The GPU memory plan (:mod:`tripath.engine.memory_plan`): the worst step of each kind measured on a
    scratch cache, the graph pools and headroom reserved, the KV cache sized from the rest of
    ``gpu_memory_utilization``. With a ``pool`` the measured steps' kernels are compiled there first (the
    steps run once with their compilations listed instead of made)."""
    device = runner.device
    steps = worst_steps(runner_limits(runner), runner.spec.extend_chunk_budget)
    runner.penalties.allocate(runner.logits_width())  # held for the engine's life: in use, not a step's
    scratch = [runner.backend.allocate_cache(SCRATCH_BLOCKS, device) for _ in range(runner.num_layers)]
    if pool is not None:
        with collect_compilations() as compilations:
            for step in steps.values():
                run_synthetic_step(runner, step, scratch)
        pool.compile(compilations)
    peaks = measure_step_peaks(runner, steps, scratch)
    del scratch
    torch.cuda.synchronize(device)
    gc.collect()   # an engine the caller dropped may still hold its cache through a reference cycle
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    graph_pools = 0
    if runner.captures_decode_graphs:
        # the decode graphs' batch is at most the measured decode step's; the verify graphs share their pool
        graph_pools += max(peaks["decode"], peaks.get("verify graphs", 0))
        if runner.uses_mixed_graphs:
            graph_pools += peaks["prefill"]  # their pool keeps a step's layer intermediates too
    budget = int(total * runner.config.gpu_memory_utilization)
    headroom = max(MIN_HEADROOM, int(total * HEADROOM_FRACTION))
    per_block = runner.backend.cache_bytes_per_block() * runner.num_layers
    if runner.extra_cache_bytes is not None:   # a draft model's cache of as many blocks
        per_block += runner.extra_cache_bytes(runner.block_size)
    in_use = total - free
    plan = MemoryPlan(total=total, budget=budget, in_use=in_use, weights=torch.cuda.memory_allocated(device),
                      step_peaks=peaks, graph_pools=graph_pools, headroom=headroom, bytes_per_block=per_block,
                      num_blocks=0)
    plan.num_blocks = max(0, kv_blocks_left(budget, in_use, plan.step_peak, graph_pools, headroom, per_block))
    check_fits(plan.num_blocks, runner.block_size, runner.max_model_len, plan.summary())
    logger.info("%s", plan.summary())
    return plan


def _track_peak(runner) -> int:
    if runner.memory_plan is None:
        return 0
    torch.cuda.synchronize(runner.device)
    torch.cuda.reset_peak_memory_stats(runner.device)
    return torch.cuda.memory_allocated(runner.device)


def _note_peak(runner, name: str, base: int) -> None:
    """Record in the memory plan what was allocated above ``base`` since :func:`_track_peak`."""
    if runner.memory_plan is not None:
        torch.cuda.synchronize(runner.device)
        runner.memory_plan.measured[name] = torch.cuda.max_memory_allocated(runner.device) - base


# ---- steps that write nothing ---------------------------------------------------------------------------
def split_prompts(runner, num_tokens: int) -> list[int]:
    """``num_tokens`` tokens as prompt lengths of at most ``max_model_len``."""
    limit = runner.max_model_len
    return [min(limit, num_tokens - start) for start in range(0, num_tokens, limit)]


def largest_prompt_step(runner) -> list[int]:
    """Prompt lengths of the largest step the limits allow: ``max_num_batched_tokens`` tokens in sequences
    of at most ``max_model_len``, at most ``max_num_seqs`` of them."""
    return split_prompts(runner, runner.config.max_num_batched_tokens)[:runner.config.max_num_seqs]


def nothing_written_context(runner, num_tokens: int) -> ForwardContext:
    """A context for prompts of ``num_tokens`` tokens in all (sequences of at most ``max_model_len``) whose
    slots are all −1 and whose rows read block 0: its steps write nothing to the caches."""
    lens = split_prompts(runner, num_tokens)
    plan = runner.backend.plan(lens, [0] * len(lens))
    width = max(blocks_needed(n, runner.block_size) for n in lens)
    block_table = torch.zeros(len(lens), width, dtype=torch.int32, device=runner.device)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=runner.device)
    return ForwardContext(runner.backend, runner.backend.build_metadata(plan, block_table, slots), runner.caches)


def capture_mixed_graphs(runner) -> None:
    """Capture piecewise graphs of steps with prompt tokens for ``config.mixed_cuda_graph_sizes()`` (in the
    decode graphs' memory pool); the capture's attention calls see prompts that write nothing."""
    pool = None if runner.decode_graphs is None else runner.decode_graphs.pool
    runner.mixed_graphs = MixedStepGraphs(runner.model, runner.config.mixed_cuda_graph_sizes(), runner.device,
                                          pool=pool)
    with torch.inference_mode():
        runner.mixed_graphs.capture(lambda n: nothing_written_context(runner, n))
    warm_up_recording()  # the graphs' steps record and replay their layers' launches


@torch.inference_mode()
def reserve_step_memory(runner) -> float | None:
    """Run the largest eager step once on the real caches, writing nothing (every slot −1, every row reading
    block 0), then :func:`warm_sampling` on up to ``max_num_seqs`` of its rows: PyTorch's caching allocator
    then holds the activation memory a step needs (reserved by the memory plan), so no step while serving
    waits for a device allocation. Returns the forward's host time over its GPU span (near 1: the step is
    host-bound); None off a GPU, where only the forward runs."""
    num_tokens = sum(largest_prompt_step(runner))
    ctx = nothing_written_context(runner, num_tokens)
    lens = largest_prompt_step(runner)
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=runner.device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(runner.device)
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


@torch.inference_mode()
def warm_sampling(runner, hidden: torch.Tensor) -> None:
    """Run the eager work after a step's forward once for every row count it can take, before requests
    arrive: the LM head and sampling of ``1 … hidden.shape[0]`` rows (greedy for each count, with a
    temperature, top-k and top-p for powers of two and the largest, whose probabilities are the largest
    temporary a step allocates), and the device-side advance of multi-step decoding. The first LM-head
    product of each row count picks and loads a cuBLAS kernel; on an H200 that stalled the first pass's
    steps by about 3.5 ms each on the mha-tp8 preset, so it belongs to the start."""
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
