"""Runs one scheduled step on the model: inputs and attention metadata in plan order, forward, logits, sampling.

Per step (host work once, shared by every layer):

- ``plan = backend.plan(query_lens, context_lens)`` reorders the requests ``[decode | extend | prefill]``;
- flat ``input_ids [T]`` / ``positions [T]`` int64, the new tokens request by request in plan order;
- ``block_table [B, max_blocks]`` int32 (rows in plan order, unused entries 0: block 0 is reserved) and
  ``slot_mapping [T]`` int64, ``block_ids[p // block_size] * block_size + p % block_size`` of position ``p``;
- ``meta = backend.build_metadata(plan, block_table, slot_mapping)``, the model runs under
  ``ForwardContext(backend, meta, caches)`` and logits ``[N, vocab]`` are computed only for the last token of
  each request whose step reaches the end of its tokens (a decode, or the last chunk of a prompt); the
  sampled tokens go back to the scheduler's order.

:meth:`ModelRunner.launch` only queues that work on the device and returns a :class:`LaunchedStep`, whose
``sampled()`` waits for the tokens (copied to pinned host memory behind an event); :meth:`execute` does
both. With overlapped scheduling the engine schedules and launches step N + 1 before it reads step N's
tokens: a decode whose input token is step N's passes ``previous=`` step N, and its ``input_ids`` row is
filled from step N's tokens on the device.

On a GPU the runner warms up before it serves (:mod:`tripath.engine.warmup`: every kernel variant the
limits allow is compiled), then captures the decode graphs (each replayed once, so its upload to the
device is done) and, for models without mixture-of-experts layers, the piecewise graphs of steps with
prompt tokens (:mod:`tripath.engine.mixed_graphs`: the layers between attention calls per padded token
count, attention eager between the replays), and runs the largest eager step once, writing nothing, so the
caching allocator already holds a step's activation memory when requests arrive. Decode-only steps on a GPU
replay a CUDA graph captured for the next padded batch size (padding rows: one query token at position 1
reading block 0, slot −1 so nothing is written); the step's metadata is copied into the captured one with
``meta.copy_``. A launch of ``num_steps > 1`` (multi-step decoding, :meth:`ModelRunner._launch_decode_steps`)
replays that graph ``num_steps`` times, feeding each step's sampled tokens to the next and advancing the
metadata on the device. The KV cache (one per attention layer) has ``num_kv_blocks`` blocks, or on a GPU
what the memory plan leaves of ``gpu_memory_utilization`` once the worst step of each kind, the graphs'
pools and headroom are reserved (:mod:`tripath.engine.memory_plan`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import time

import torch

from tripath.attention import ForwardContext, WatchedPaths, default_block_size, select_backend
from tripath.triton_internals import CompilePool, collect_compilations, default_workers
from tripath.engine.block_manager import blocks_needed
from tripath.engine.config import CPU_DEFAULT_KV_BLOCKS, EngineConfig
from tripath.engine.memory_plan import (HEADROOM_FRACTION, MIN_HEADROOM, SCRATCH_BLOCKS, MemoryPlan, check_fits,
                                       kv_blocks_left, measure_step_peaks, run_synthetic_step, worst_steps)
from tripath.engine.mixed_graphs import MixedStepGraphs
from tripath.engine.request import SamplingParams
from tripath.engine.sampler import make_generator, sample
from tripath.engine.scheduler import ScheduledRequest
from tripath.engine.step_inputs import StepInputBuilder, StepInputs
from tripath.engine.warmup import WarmupReport, runner_limits, saved_plan_path, warm_up
from tripath.triton_internals import warm_up_recording
from tripath.models.layers import Experts

logger = logging.getLogger(__name__)

# Piecewise graphs are captured when the largest eager step's host time is at least this share of its GPU
# span (measured at start): on an H200 the mha-tp8 shape measured 0.79–0.97 (host-bound), the 8B shape 0.14.
MIXED_GRAPHS_MIN_HOST_SHARE = 0.5


class LaunchedStep:
    """A step whose work is queued on the device. ``tokens [K, S]`` int64 (device): row ``j`` holds the
    tokens sampled by model step ``j`` of the ``K`` this launch ran (``K = 1`` but for multi-step decoding),
    column ``k`` those of ``scheduled[sample_rows[k]]``; ``rows``: ``id(request) -> k``. The tokens' copy to
    the host is under way; :meth:`sampled` waits for it."""

    def __init__(self, scheduled: list[ScheduledRequest], sample_rows: list[int], tokens: torch.Tensor | None):
        self.num_scheduled = len(scheduled)
        self.sample_rows = sample_rows
        self.tokens = tokens
        self.requests = [scheduled[i].request for i in sample_rows]  # keeps the ids in ``rows`` unique
        self.rows = {id(r): k for k, r in enumerate(self.requests)}
        self._host, self._ready = tokens, None
        if tokens is not None and tokens.device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()

    @property
    def last_tokens(self) -> torch.Tensor:
        """``[S]``: the tokens of the launch's last model step (the next step's in-flight inputs)."""
        return self.tokens[-1]

    def sampled(self) -> list[list[int]]:
        """The tokens sampled for each scheduled request, in step order (empty where it is mid-prompt);
        waits for the device."""
        out: list[list[int]] = [[] for _ in range(self.num_scheduled)]
        if self.tokens is None:
            return out
        if self._ready is not None:
            self._ready.synchronize()
        for i, tokens in zip(self.sample_rows, self._host.t().tolist()):
            out[i] = tokens
        return out


class ModelRunner:
    """Owns the model, the attention backend and the per-layer KV caches of one engine."""

    supports_overlap = True  # launch() may take the previous step's in-flight tokens

    def __init__(self, model, config: EngineConfig):
        self.model = model
        self.config = config
        self.device = config.device
        is_mla = getattr(model.config, "mla", None) is not None
        self.block_size = config.block_size or default_block_size(config.backend, is_mla, self.device)
        self.spec = model.attention_spec(block_size=self.block_size, kv_cache_dtype=config.kv_cache_dtype,
                                         kv_layout=config.kv_layout, dtype=config.dtype)
        self.backend = select_backend(self.spec, name=config.backend, device=self.device)
        self.num_layers = model.num_attention_layers
        max_position = int(model.config.max_position)  # the rotary tables' rows (rope scaling included)
        self.max_model_len = config.max_model_len or max_position
        if self.max_model_len > max_position:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position ({max_position}): "
                             "its positions (with any rope scaling, which max_position already includes) end there")
        self.max_blocks_per_seq = blocks_needed(self.max_model_len, self.block_size)
        self.inputs = StepInputBuilder(self.device, self.block_size, config.max_num_batched_tokens,
                                       config.max_num_seqs, self.max_blocks_per_seq)
        self.kv_scales_pending = config.calculate_kv_scales  # set from the first step's keys and values
        self.watched_paths = WatchedPaths()  # code paths whose launch recordings were watched (ForwardContext)
        self._logits_upcast_optional: bool | None = None  # whether model.compute_logits takes upcast=
        self.warmup_report: WarmupReport | None = None
        self.memory_plan: MemoryPlan | None = None  # on a GPU with the KV cache sized by the engine
        warms_up = config.warmup and self.device.type == "cuda" and self.backend.capabilities.needs_triton
        pool = self._compile_pool() if warms_up else None
        try:
            if config.num_kv_blocks is None and self.device.type == "cuda":
                self.memory_plan = self._plan_memory(pool)
                self.num_blocks = self.memory_plan.num_blocks
            else:
                self.num_blocks = config.num_kv_blocks or CPU_DEFAULT_KV_BLOCKS
            self.caches = [self.backend.allocate_cache(self.num_blocks, self.device) for _ in range(self.num_layers)]
            if warms_up:
                self._track_peak()
                self.warmup_report = warm_up(self, pool=pool)
                self._note_peak("warm-up peak")
        finally:
            if pool is not None:
                pool.close()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, object, torch.Tensor]] = {}
        self._graph_pool = None
        before_graphs = torch.cuda.memory_allocated(self.device) if self.memory_plan is not None else 0
        if config.use_cuda_graphs and self.graph_safe_backend:
            self.capture_cuda_graphs()
        self.mixed_graphs: MixedStepGraphs | None = None
        self.largest_step_host_share: float | None = None  # host time / GPU span of the largest eager step
        if self.device.type == "cuda":
            self.largest_step_host_share = self._reserve_step_memory()
            if self.uses_mixed_graphs and self.largest_step_host_share >= MIXED_GRAPHS_MIN_HOST_SHARE:
                self.capture_mixed_graphs()
        if self.memory_plan is not None:
            torch.cuda.synchronize(self.device)
            self.memory_plan.measured["graph pools"] = torch.cuda.memory_allocated(self.device) - before_graphs

    def _compile_pool(self) -> CompilePool | None:
        """Worker processes for the start's compilations (:mod:`tripath.triton_internals.compile_pool`): with
        ``compile_workers`` > 1 (None: :func:`~tripath.triton_internals.default_workers`) and no saved
        warm-up plan, whose absence means an empty or outdated Triton cache (a warm one would make them
        idle)."""
        workers = self.config.compile_workers or default_workers()
        if workers < 2 or saved_plan_path(self).is_file():
            return None
        return CompilePool(workers)

    @property
    def uses_mixed_graphs(self) -> bool:
        """Whether steps with prompt tokens may replay piecewise graphs (:mod:`tripath.engine.mixed_graphs`):
        on a GPU with graphs on and ``mixed_cuda_graphs``, on one rank (the decision below is measured per
        process, and ranks that decided differently would run different collectives at start), for a model
        without mixture-of-experts layers.
        They are captured when the largest eager step, timed at start, spends at least
        ``MIXED_GRAPHS_MIN_HOST_SHARE`` of its GPU span launching on the host: below that the GPU is the
        bottleneck of such steps, and the capture would cost start time for nothing."""
        parallel = getattr(self.model, "parallel", None)
        return (self.config.use_cuda_graphs and self.config.mixed_cuda_graphs
                and (parallel is None or parallel.world_size == 1)
                and not any(isinstance(m, Experts) for m in self.model.modules()))

    @property
    def graph_safe_backend(self) -> bool:
        """Whether the backend's forward reads only device tensors of the metadata (graph replay can change
        them). The reference backend loops over the plan's host lists, so it is not."""
        return self.backend.capabilities.cuda_graphs

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits the sampler takes for ``hidden [N, hidden_size]``: in the LM head's dtype where the
        model offers it (``compute_logits(..., upcast=False)``, as tripath's models do), else as the model
        returns them."""
        if self._logits_upcast_optional is None:
            self._logits_upcast_optional = "upcast" in inspect.signature(self.model.compute_logits).parameters
        if self._logits_upcast_optional:
            return self.model.compute_logits(hidden, upcast=False)
        return self.model.compute_logits(hidden)

    # ---- inputs -------------------------------------------------------------------------------------
    def prepare(self, scheduled: list[ScheduledRequest], pad_to: int | None = None,
                previous: LaunchedStep | None = None) -> StepInputs:
        """Build the step's inputs in plan order (:mod:`tripath.engine.step_inputs`). ``pad_to``: decode-only
        steps padded to a captured batch size. The block table is as wide as the step's longest row; a
        graph replay copies just those columns into its captured ``max_blocks_per_seq``-wide table.
        ``previous``: the launched step whose tokens are the in-flight input tokens of this one."""
        query_lens = [s.num_new_tokens for s in scheduled]
        context_lens = [s.num_computed_tokens for s in scheduled]
        num_padding = 0 if pad_to is None else pad_to - len(scheduled)
        query_lens += [1] * num_padding
        context_lens += [1] * num_padding
        plan = self.backend.plan(query_lens, context_lens)
        inputs = self.inputs.build(plan, scheduled, num_padding, None if previous is None else previous.rows)
        if inputs.deferred is not None:
            rows, sources = inputs.deferred
            inputs.input_ids.index_copy_(0, rows, previous.last_tokens.index_select(0, sources))
        return inputs

    # ---- one step -----------------------------------------------------------------------------------
    def execute(self, scheduled: list[ScheduledRequest], num_steps: int = 1) -> list[list[int]]:
        """Run the step; the tokens sampled for each scheduled request (empty where it is mid-prompt)."""
        return self.launch(scheduled, num_steps=num_steps).sampled() if scheduled else []

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledRequest], previous: LaunchedStep | None = None,
               num_steps: int = 1) -> LaunchedStep:
        """Queue the step on the device (inputs, forward, logits, sampling) without waiting for it.
        ``previous``: the step launched before, whose tokens some of these decodes take as input.
        ``num_steps > 1``: a step of single-token decodes run that many times (:meth:`_launch_decode_steps`)."""
        graph_bs = self.graph_batch_size(scheduled)
        inputs = self.prepare(scheduled, pad_to=graph_bs, previous=previous)
        if num_steps > 1:
            return self._launch_decode_steps(scheduled, inputs, graph_bs, num_steps)
        if graph_bs is not None:
            hidden = self._replay(graph_bs, inputs)
        else:
            meta = self.backend.build_metadata(inputs.plan, inputs.block_table, inputs.slot_mapping)
            ctx = ForwardContext(self.backend, meta, self.caches, calibrate_kv_scales=self.kv_scales_pending,
                                 watched=self.watched_paths)
            mixed = self.mixed_graphs
            if mixed is not None and not self.kv_scales_pending and mixed.bucket(inputs.plan.num_tokens):
                hidden = mixed.run(inputs.input_ids, inputs.positions, ctx)
            else:
                hidden = self.model(inputs.input_ids, inputs.positions, ctx)
            self.kv_scales_pending = False
        if not inputs.sample_rows:
            return LaunchedStep(scheduled, [], None)
        logits = self.compute_logits(hidden[inputs.logit_indices])
        requests = [scheduled[i].request for i in inputs.sample_rows]
        tokens = sample(logits, [r.sampling_params for r in requests], [r.generator for r in requests])
        return LaunchedStep(scheduled, inputs.sample_rows, tokens.unsqueeze(0))

    # ---- multi-step decoding ------------------------------------------------------------------------
    @property
    def supports_multi_step(self) -> bool:
        """Whether :meth:`launch` takes ``num_steps > 1``: the backend's decode reads only the metadata's
        tensors, so they can be advanced on the device between the steps."""
        return self.graph_safe_backend

    def _launch_decode_steps(self, scheduled: list[ScheduledRequest], inputs: StepInputs, graph_bs: int | None,
                             num_steps: int) -> LaunchedStep:
        """Run a step of single-token decodes ``num_steps`` times back to back, without the host in between:
        after each step the sampled tokens become the next step's input ids on the device and
        :meth:`AttentionMetadata.advance_decodes_` moves positions, sequence lengths and slots on by one.
        Each step replays the decode graph of ``graph_bs`` rows, or runs eagerly when there is none. The
        requests' blocks must already cover all ``num_steps`` tokens (the scheduler grows them)."""
        n = len(scheduled)
        plan = inputs.plan
        if not self.supports_multi_step:
            raise ValueError(f"the {self.backend.name} backend cannot run several decode steps in one launch")
        if plan.num_decodes != plan.num_requests or plan.num_tokens != plan.num_requests or \
                inputs.sample_rows != list(range(n)):
            raise ValueError("num_steps > 1 needs a step of single-token decodes only")
        requests = [item.request for item in scheduled]
        params, generators = [r.sampling_params for r in requests], [r.generator for r in requests]
        if graph_bs is not None:
            graph, meta, hidden = self._load_graph(graph_bs, inputs)
            ids, positions = self._graph_ids[:graph_bs], self._graph_positions[:graph_bs]
            run = graph.replay
        else:
            meta = self.backend.build_metadata(plan, inputs.block_table, inputs.slot_mapping)
            ids, positions = inputs.input_ids, inputs.positions
            ctx = ForwardContext(self.backend, meta, self.caches, watched=self.watched_paths)
            run = functools.partial(self.model, ids, positions, ctx)
        tokens = torch.empty(num_steps, n, dtype=torch.int64, device=self.device)
        for step in range(num_steps):
            if step:
                ids[:n].copy_(tokens[step - 1])
                meta.advance_decodes_(positions[:n], self.block_size)
            out = run()
            logits = self.compute_logits((hidden if graph_bs is not None else out)[:n])
            tokens[step] = sample(logits, params, generators)
        return LaunchedStep(scheduled, inputs.sample_rows, tokens)

    # ---- CUDA graphs for decode-only steps ----------------------------------------------------------
    def graph_batch_size(self, scheduled: list[ScheduledRequest]) -> int | None:
        """The captured batch size a decode-only step replays (the smallest that holds it), or None: the step
        runs eagerly (it has prompt tokens, or no graphs were captured, or it is larger than every graph)."""
        if not self.graphs or any(s.num_new_tokens != 1 or s.num_computed_tokens == 0 for s in scheduled):
            return None
        return next((b for b in sorted(self.graphs) if b >= len(scheduled)), None)

    def capture_cuda_graphs(self) -> None:
        """Capture the model's forward for decode-only batches of each size in
        ``config.cuda_graph_batch_sizes()`` (largest first, sharing one memory pool), then replay each once
        on its padding metadata (block 0, slot −1: nothing is written)."""
        sizes = self.config.cuda_graph_batch_sizes()
        self._graph_ids = torch.zeros(max(sizes), dtype=torch.int64, device=self.device)
        self._graph_positions = torch.ones(max(sizes), dtype=torch.int64, device=self.device)
        pool = None
        with torch.inference_mode():
            for bs in sorted(sizes, reverse=True):
                plan = self.backend.plan([1] * bs, [1] * bs)
                block_table = torch.zeros(bs, self.max_blocks_per_seq, dtype=torch.int32, device=self.device)
                slots = torch.full((bs,), -1, dtype=torch.int64, device=self.device)
                meta = self.backend.build_metadata(plan, block_table, slots)
                ctx = ForwardContext(self.backend, meta, self.caches)
                ids, positions = self._graph_ids[:bs], self._graph_positions[:bs]
                graph, hidden, pool = self._capture(functools.partial(self.model, ids, positions, ctx), pool)
                self.graphs[bs] = (graph, meta, hidden)
            self._graph_pool = pool
            for graph, _, _ in self.graphs.values():  # a graph's first launch uploads it: not on a request's time
                graph.replay()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def capture_mixed_graphs(self) -> None:
        """Capture piecewise graphs of steps with prompt tokens for ``config.mixed_cuda_graph_sizes()`` (in
        the decode graphs' memory pool); the capture's attention calls see prompts that write nothing."""
        self.mixed_graphs = MixedStepGraphs(self.model, self.config.mixed_cuda_graph_sizes(), self.device,
                                            pool=self._graph_pool)
        with torch.inference_mode():
            self.mixed_graphs.capture(self._nothing_written_context)
        warm_up_recording()  # the graphs' steps record and replay their layers' launches

    def _nothing_written_context(self, num_tokens: int) -> ForwardContext:
        """A context for prompts of ``num_tokens`` tokens in all (sequences of at most ``max_model_len``)
        whose slots are all −1 and whose rows read block 0: its steps write nothing to the caches."""
        lens = self._split_prompts(num_tokens)
        plan = self.backend.plan(lens, [0] * len(lens))
        width = max(blocks_needed(n, self.block_size) for n in lens)
        block_table = torch.zeros(len(lens), width, dtype=torch.int32, device=self.device)
        slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device)
        return ForwardContext(self.backend, self.backend.build_metadata(plan, block_table, slots), self.caches)

    def _capture(self, run, pool):
        """``(graph, static output, pool)`` of ``run`` captured after a warm-up call (kernels compile outside)."""
        run()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = run()
        torch.cuda.synchronize(self.device)
        return graph, hidden, graph.pool()

    def _load_graph(self, bs: int, inputs: StepInputs):
        """``(graph, meta, hidden)`` of the decode graph of ``bs`` rows, its captured metadata and input
        buffers holding the step's."""
        graph, meta, hidden = self.graphs[bs]
        meta.copy_(self.backend.build_metadata(inputs.plan, inputs.block_table, inputs.slot_mapping))
        self._graph_ids[:bs].copy_(inputs.input_ids)
        self._graph_positions[:bs].copy_(inputs.positions)
        return graph, meta, hidden

    def _replay(self, bs: int, inputs: StepInputs) -> torch.Tensor:
        graph, _, hidden = self._load_graph(bs, inputs)
        graph.replay()
        return hidden

    def _largest_prompt_step(self) -> list[int]:
        """Prompt lengths of the largest step the limits allow: ``max_num_batched_tokens`` tokens in
        sequences of at most ``max_model_len``, at most ``max_num_seqs`` of them."""
        return self._split_prompts(self.config.max_num_batched_tokens)[:self.config.max_num_seqs]

    def _split_prompts(self, num_tokens: int) -> list[int]:
        """``num_tokens`` tokens as prompt lengths of at most ``max_model_len``."""
        limit = self.max_model_len
        return [min(limit, num_tokens - start) for start in range(0, num_tokens, limit)]

    def _prompt_forward(self, lens: list[int], block_table: torch.Tensor, slots: torch.Tensor,
                        caches: list) -> torch.Tensor:
        """The model's hidden states ``[sum(lens), hidden]`` for prompts of ``lens`` tokens (ids 0) with the
        given host ``block_table [len(lens), width]`` and ``slots [sum(lens)]``, on ``caches``."""
        plan = self.backend.plan(lens, [0] * len(lens))
        meta = self.backend.build_metadata(plan, block_table.to(self.device), slots.to(self.device))
        ids = torch.zeros(sum(lens), dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        return self.model(ids, positions, ForwardContext(self.backend, meta, caches))

    @torch.inference_mode()
    def _reserve_step_memory(self) -> float | None:
        """Run the largest eager step once on the real caches, writing nothing (every slot −1, every row
        reading block 0), then :meth:`warm_sampling` on up to ``max_num_seqs`` of its rows: PyTorch's caching
        allocator then holds the activation memory a step needs (reserved by the memory plan), so
        no step while serving waits for a device allocation. Returns the forward's host time over its GPU
        span (near 1: the step is host-bound); None off a GPU, where only the forward runs."""
        lens = self._largest_prompt_step()
        width = max(blocks_needed(n, self.block_size) for n in lens)
        block_table = torch.zeros(len(lens), width, dtype=torch.int32)
        slots = torch.full((sum(lens),), -1, dtype=torch.int64)
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            torch.cuda.synchronize(self.device)
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record()
        start = time.perf_counter()
        hidden = self._prompt_forward(lens, block_table, slots, self.caches)
        host_s = time.perf_counter() - start
        if not on_gpu:
            return None
        events[1].record()
        torch.cuda.synchronize(self.device)
        share = host_s / max(events[0].elapsed_time(events[1]) / 1e3, 1e-9)
        self.warm_sampling(hidden[:min(self.config.max_num_seqs, hidden.shape[0])])
        return share

    @torch.inference_mode()
    def warm_sampling(self, hidden: torch.Tensor) -> None:
        """Run the eager work after a step's forward once for every row count it can take, before requests
        arrive: the LM head and sampling of ``1 … hidden.shape[0]`` rows (greedy for each count, with a
        temperature, top-k and top-p for powers of two and the largest, whose probabilities are the largest
        temporary a step allocates), and the device-side advance of multi-step decoding. The first LM-head
        product of each row count picks and loads a cuBLAS kernel; on an H200 that stalled the first pass's
        steps by about 3.5 ms each on the mha-tp8 preset, so it belongs to the start."""
        rows = hidden.shape[0]
        greedy = SamplingParams(temperature=0.0)
        sampled = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
        generator = make_generator(0, self.device)  # not the global generator
        for m in range(1, rows + 1):
            logits = self.compute_logits(hidden[:m])
            sample(logits, [greedy] * m, [None] * m)
            if m & (m - 1) == 0 or m == rows:
                sample(logits, [sampled] * m, [generator] * m)
        if self.supports_multi_step:
            plan = self.backend.plan([1], [1])
            meta = self.backend.build_metadata(plan, torch.zeros(1, 1, dtype=torch.int32, device=self.device),
                                               torch.full((1,), -1, dtype=torch.int64, device=self.device))
            meta.advance_decodes_(torch.ones(1, dtype=torch.int64, device=self.device), self.block_size)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- KV memory ----------------------------------------------------------------------------------
    def _plan_memory(self, pool: CompilePool | None = None) -> MemoryPlan:
        """The GPU memory plan (:mod:`tripath.engine.memory_plan`): the worst step of each kind measured on
        a scratch cache, the graph pools and headroom reserved, the KV cache sized from the rest of
        ``gpu_memory_utilization``. With a ``pool`` the measured steps' kernels are compiled there first
        (the steps run once with their compilations listed instead of made)."""
        device = self.device
        steps = worst_steps(runner_limits(self), self.spec.extend_chunk_budget)
        scratch = [self.backend.allocate_cache(SCRATCH_BLOCKS, device) for _ in range(self.num_layers)]
        if pool is not None:
            with collect_compilations() as compilations:
                for step in steps.values():
                    run_synthetic_step(self, step, scratch)
            pool.compile(compilations)
        peaks = measure_step_peaks(self, steps, scratch)
        del scratch
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        graph_pools = 0
        if self.config.use_cuda_graphs and self.graph_safe_backend:
            graph_pools += peaks["decode"]  # the decode graphs' batch is at most the measured decode step's
            if self.uses_mixed_graphs:
                graph_pools += peaks["prefill"]  # their pool keeps a step's layer intermediates too
        budget = int(total * self.config.gpu_memory_utilization)
        headroom = max(MIN_HEADROOM, int(total * HEADROOM_FRACTION))
        per_block = self.backend.cache_bytes_per_block() * self.num_layers
        in_use = total - free
        plan = MemoryPlan(total=total, budget=budget, in_use=in_use,
                          weights=torch.cuda.memory_allocated(device), step_peaks=peaks, graph_pools=graph_pools,
                          headroom=headroom, bytes_per_block=per_block, num_blocks=0)
        plan.num_blocks = max(0, kv_blocks_left(budget, in_use, plan.step_peak, graph_pools, headroom, per_block))
        check_fits(plan.num_blocks, self.block_size, self.max_model_len, plan.summary())
        logger.info("%s", plan.summary())
        return plan

    def _track_peak(self) -> None:
        if self.memory_plan is not None:
            torch.cuda.synchronize(self.device)
            self._peak_base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def _note_peak(self, name: str) -> None:
        """Record in the memory plan what was allocated above :meth:`_track_peak`'s base since it ran."""
        if self.memory_plan is not None:
            torch.cuda.synchronize(self.device)
            self.memory_plan.measured[name] = torch.cuda.max_memory_allocated(self.device) - self._peak_base
