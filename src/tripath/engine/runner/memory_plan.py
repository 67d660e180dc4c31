"""The engine's GPU memory plan: what every step can need, reserved before the KV cache takes the rest.

The budget is ``gpu_memory_utilization × total``. From it the plan takes, in order:

- ``in use``: what the device held when planning began (the weights, the CUDA context, other processes);
- ``step peak``: the most memory one step takes above that (its peak in the caching allocator, which
  counts the segments its mixed sizes leave partly used), measured at start by running the worst
  step of each kind (:func:`worst_steps`) through the whole model on a small scratch cache (every slot −1,
  block ids wrapping inside it: the step reads garbage and writes nothing, which changes no size), then
  the LM head and sampling of its rows. The kinds: the largest prefill, one extend on the longest context
  (its context gathered chunk by chunk, MLA's chunks up-projected), many extends (many chunks, merged),
  ``max_num_seqs`` decodes on the longest contexts (split-KV partial results), a mix of decodes, an
  extend and a prefill, and with speculative decoding verifies of ``decode_threshold`` tokens (every token's
  logits sampled). Steps run one at a time, so the largest of them is reserved once;
- ``graph pools``: the CUDA graphs' private memory: a decode step of the largest captured batch (with verify
  graphs, the larger of that and the largest verify graph's step, measured too: they share the pool), and, when
  steps with prompt tokens may replay piecewise graphs, the largest prefill's activations again (the
  graphs keep their own copy of the layers' intermediates);
- ``headroom``: what grows outside the plan's measurements: fragmentation of the caching allocator over a
  workload's varied steps, cuBLAS workspaces, the kernels the warm-up loads and their local memory
  (:data:`HEADROOM_FRACTION` of the device, at least :data:`MIN_HEADROOM`: on an 80 GB H100 the
  ``deepseek-r1-attn-tp8`` preset with ``mla_triton`` held 1.6 GiB beyond its plan's other parts).

What is left is the KV cache, in whole blocks. The engine refuses to start when that cannot hold one
sequence of ``max_model_len`` tokens (the message names the settings to change), and
:meth:`MemoryPlan.summary` / ``LLM.memory_report()`` state the plan beside what was measured after the
graphs were captured.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np
import torch

from tripath.engine.runner.warmup import RunnerBasics, Step, WarmupLimits, runner_limits, synthetic_tables
from tripath.triton_internals import CompilePool, collect_compilations

if TYPE_CHECKING:
    from tripath.attention import AttentionSpec
    from tripath.engine.sampling.logits_transforms import PenaltyState

logger = logging.getLogger(__name__)

HEADROOM_FRACTION = 0.01
MIN_HEADROOM = 2 * 2**30
VERIFY_GRAPHS = "verify graphs"   # the step measured for the verify graphs' pool, not an eager step's peak
SCRATCH_BLOCKS = 64  # the scratch cache the worst steps read (block ids wrap inside it)
GiB = 2**30


class PlanningRunner(RunnerBasics, Protocol):
    """What the memory plan reads of a runner (a :class:`~tripath.engine.runner.model_runner.ModelRunner` is one): the
    model and backend its synthetic steps run, the limits that make the worst steps, what a block of cache
    costs and which graphs will keep a pool. It assigns nothing."""

    @property
    def spec(self) -> AttentionSpec: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def penalties(self) -> PenaltyState: ...         # the sampler's penalty rows (a step's sampling uses them)

    @property
    def extra_cache_bytes(self) -> Callable[[int], int] | None: ...   # a draft model's cache, per block

    @property
    def captures_decode_graphs(self) -> bool: ...

    @property
    def captures_verify_graphs(self) -> bool: ...    # the verify graphs' batches are steps to reach

    @property
    def uses_mixed_graphs(self) -> bool: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def worst_steps(limits: WarmupLimits, chunk_budget: int) -> dict[str, Step]:
    """The steps whose memory the plan measures, as ``(query_lens, context_lens)`` within ``limits``
    (``chunk_budget``: the backend's extend chunk budget, tokens of context gathered at once)."""
    s, n, l, dq = limits.max_num_seqs, limits.max_num_batched_tokens, limits.max_model_len, limits.decode_threshold
    steps: dict[str, Step] = {}
    prefill = [min(l, n - start) for start in range(0, n, l)][:s]
    steps["prefill"] = (prefill, [0] * len(prefill))
    q = min(n, l - 1)
    if q > dq:
        steps["extend"] = ([q], [l - q])  # the longest context: every chunk full, the joined tail the largest
    e = min(s, n // (dq + 1))
    q = min(n // e, l - 1) if e >= 2 else 0   # each with a context: at most max_model_len - 1 new tokens
    if e >= 2 and q > dq:
        chunk = max(1, chunk_budget // e)
        steps["extends"] = ([q] * e, [min(l - q, 4 * chunk)] * e)  # several chunks each: partials and merges
    d = min(s, n)
    steps["decode"] = ([1] * d, [l - 1] * d)
    d = min(s, n) - 2
    rest = n - d
    qe = min(rest // 2, l - 1)   # an extend and a prefill, each within max_model_len
    qp = min(rest - qe, l)
    if d >= 1 and qe > dq and qp >= 1:
        steps["mixed"] = ([1] * d + [qe, qp], [l - 1] * d + [l - qe, 0])
    v = min(s, n // dq)
    if dq > 1 and v >= 1 and l > dq:   # speculative decoding: verifies, every token's logits sampled
        steps["verify"] = ([dq] * v, [l - dq] * v)
    g = max(limits.verify_graph_sizes, default=0)
    if dq > 1 and g >= 1 and l > dq:   # the largest verify graph (its pool; no eager step is that large)
        steps[VERIFY_GRAPHS] = ([dq] * g, [l - dq] * g)
    return steps


@dataclass
class MemoryPlan:
    """Bytes of each part of the plan (see the module doc) and the KV cache they leave."""

    total: int
    budget: int
    in_use: int
    weights: int
    step_peaks: dict[str, int]
    graph_pools: int
    headroom: int
    bytes_per_block: int
    num_blocks: int
    measured: dict[str, int] = field(default_factory=dict)  # filled in after start (graph pools, peak)

    @property
    def step_peak(self) -> int:
        return max((v for k, v in self.step_peaks.items() if k != VERIFY_GRAPHS), default=0)

    @property
    def kv_cache(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def planned_peak(self) -> int:
        """The most the engine's steps should ever hold: everything but the headroom."""
        return self.in_use + self.kv_cache + self.step_peak + self.graph_pools

    def summary(self) -> str:
        lines = [f"GPU memory plan: {self.budget / GiB:.2f} GiB budget of {self.total / GiB:.2f} GiB",
                 f"  in use at start   {self.in_use / GiB:8.2f} GiB (weights {self.weights / GiB:.2f} GiB)",
                 f"  KV cache          {self.kv_cache / GiB:8.2f} GiB ({self.num_blocks} blocks of "
                 f"{self.bytes_per_block / 2**20:.3f} MiB, all layers)",
                 f"  step peak         {self.step_peak / GiB:8.2f} GiB (" + ", ".join(
                     f"{k} {v / GiB:.2f}" for k, v in self.step_peaks.items()) + ")",
                 f"  graph pools       {self.graph_pools / GiB:8.2f} GiB",
                 f"  headroom          {self.headroom / GiB:8.2f} GiB"]
        for name, value in self.measured.items():
            lines.append(f"  measured {name:<17} {value / GiB:.2f} GiB")
        return "\n".join(lines)


def kv_blocks_left(budget: int, in_use: int, step_peak: int, graph_pools: int, headroom: int,
                   bytes_per_block: int) -> int:
    """Whole KV blocks that fit in what the plan leaves of ``budget`` (may be negative)."""
    return int((budget - in_use - step_peak - graph_pools - headroom) // bytes_per_block)


def check_fits(num_blocks: int, block_size: int, max_model_len: int, plan_text: str) -> None:
    """Refuse a plan whose KV cache cannot hold one sequence of ``max_model_len`` tokens (block 0 is
    reserved), naming the settings that change it."""
    need = -(-max_model_len // block_size)
    if num_blocks - 1 >= need:
        return
    have = max(0, num_blocks - 1) * block_size
    raise RuntimeError(
        f"the KV cache left by the memory plan holds {have} tokens, fewer than one sequence of max_model_len "
        f"({max_model_len}) needs: lower max_model_len, or lower max_num_seqs / max_num_batched_tokens (their "
        f"worst step is reserved), or raise gpu_memory_utilization.\n{plan_text}")


def run_synthetic_step(runner: PlanningRunner, step: Step, caches: list) -> None:
    """Run ``step`` through the whole model on ``caches`` (synthetic block table wrapping inside them, every
    slot −1: nothing is written), then what a real step of that shape may do after it at most: score every
    token as a prompt position (``prompt_logprobs``), and sample the last tokens' rows (at most
    ``max_num_seqs``) with penalties, top-k / top-p filtering and ``logprobs`` — the memory of a real step."""
    from tripath.attention import ForwardContext
    from tripath.attention.validate import cache_geometry
    from tripath.engine.requests.request import Request, RequestStatus
    from tripath.engine.requests.sampling_params import MAX_LOGPROBS, SamplingParams
    from tripath.engine.sampling.logprobs import prompt_logprobs
    from tripath.engine.sampling.sampler import make_generator
    from tripath.engine.sampling.step_sampling import LaunchSampler

    backend, device = runner.backend, runner.device
    plan = backend.plan(*step)
    num_blocks = cache_geometry(caches[0])[0]
    block_table, slots = synthetic_tables(plan, runner.block_size, num_blocks, device)
    meta = backend.build_metadata(plan, block_table, slots)
    positions = torch.from_numpy(np.concatenate([np.arange(c, c + q) for q, c in
                                                 zip(plan.query_lens, plan.context_lens)])).to(device)
    ids = torch.zeros(plan.num_tokens, dtype=torch.int64, device=device)
    with torch.inference_mode():
        hidden = runner.model(ids, positions, ForwardContext(backend, meta, caches))
        every = torch.arange(plan.num_tokens, device=device)
        prompt_logprobs(hidden, every, torch.zeros_like(every), MAX_LOGPROBS, runner.compute_logits)
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1,
                                frequency_penalty=0.1, logprobs=MAX_LOGPROBS)
        generator = make_generator(0, device)  # not the global generator
        if plan.num_verifies:   # a verify step samples every token of its verifies
            _verify_rows(runner, plan, hidden, params, generator)
        last = np.cumsum(plan.query_lens)[:runner.config.max_num_seqs] - 1
        logits = runner.compute_logits(hidden[torch.from_numpy(last).to(device)])
        del hidden
        requests = [Request([1], params, request_id=f"plan-{i}", status=RequestStatus.FINISHED, generator=generator)
                    for i in range(logits.shape[0])]
        LaunchSampler(requests, runner.penalties, device)(logits)


def _verify_rows(runner: PlanningRunner, plan, hidden: torch.Tensor, params, generator) -> None:
    """A verify step's sampling at its largest: the logits of every verify token, the penalties' transformed
    copy of them (:mod:`tripath.engine.speculative.verify_transforms`), the acceptance rule with temperature
    and top-k / top-p on all of them, and their log-probabilities."""
    from tripath.engine.requests.request import Request, RequestStatus
    from tripath.engine.requests.sampling_params import MAX_LOGPROBS
    from tripath.engine.sampling.logprobs import position_logprobs
    from tripath.engine.scheduling.scheduler import ScheduledRequest
    from tripath.engine.speculative.acceptance import accept_drafts
    from tripath.engine.speculative.verify_transforms import verify_transforms

    nd, nv = plan.num_decodes, plan.num_verifies
    first = sum(plan.query_lens[:nd - nv])
    lens = plan.query_lens[nd - nv:nd]
    logits = runner.compute_logits(hidden[first:first + sum(lens)])
    items = [ScheduledRequest(Request([1], params, request_id=f"plan-verify-{i}", status=RequestStatus.FINISHED),
                              q, 1, True, [0] * (q - 1)) for i, q in enumerate(lens)]
    scored = verify_transforms(items, runner.penalties, logits.shape[-1], logits.device).apply(logits)
    grid = accept_drafts(scored, [[0] * (q - 1) for q in lens], [params] * nv, [generator] * nv)
    position_logprobs(logits, grid.new_zeros(logits.shape[0]), MAX_LOGPROBS)


def measure_step_peaks(runner: PlanningRunner, steps: dict[str, Step], caches: list) -> dict[str, int]:
    """Bytes each of ``steps`` takes from the device above what it held before the step: the larger of its
    allocation peak and its peak in PyTorch's caching allocator, whose segments of a step's mixed sizes hold
    more than the step allocates at once (the device is synchronised and the allocator's cache emptied
    between steps)."""
    peaks = {}
    for name, step in steps.items():
        torch.cuda.synchronize(runner.device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(runner.device)
        base_reserved = torch.cuda.memory_reserved(runner.device)
        torch.cuda.reset_peak_memory_stats(runner.device)
        try:
            run_synthetic_step(runner, step, caches)
            torch.cuda.synchronize(runner.device)
        except torch.OutOfMemoryError as error:
            q, c = step
            raise RuntimeError(
                f"the engine's worst {name} step ({len(q)} requests, {sum(q)} new tokens, contexts up to "
                f"{max(c)}) does not fit on the device beside the weights: lower max_num_batched_tokens, "
                f"max_num_seqs or max_model_len ({error})") from None
        peaks[name] = max(torch.cuda.max_memory_allocated(runner.device) - base,
                          torch.cuda.max_memory_reserved(runner.device) - base_reserved)
    torch.cuda.empty_cache()
    return peaks


def plan_gpu_memory(runner: PlanningRunner, pool: CompilePool | None = None) -> MemoryPlan:
    """The GPU memory plan (see the module doc): the worst step of each kind measured on a scratch cache, the
    graph pools and headroom reserved, the KV cache sized from the rest of ``gpu_memory_utilization``. With a
    ``pool`` the measured steps' kernels are compiled there first (the steps run once with their compilations
    listed instead of made)."""
    device = runner.device
    steps = worst_steps(runner_limits(runner), runner.spec.extend_chunk_budget)
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
        graph_pools += max(peaks["decode"], peaks.get(VERIFY_GRAPHS, 0))
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
