"""Runs one scheduled step on the model: inputs and attention metadata in plan order, forward, logits, sampling.

Per step (host work once, shared by every layer):

- ``plan = backend.plan(query_lens, context_lens)`` reorders the requests ``[decode | extend | prefill]``;
- flat ``input_ids [T]`` / ``positions [T]`` int64, the new tokens request by request in plan order;
- ``block_table [B, max_blocks]`` int32 (rows in plan order, unused entries 0: block 0 is reserved) and
  ``slot_mapping [T]`` int64, ``block_ids[p // block_size] * block_size + p % block_size`` of position ``p``;
- the metadata's integers (``backend.step_ints(plan)``) staged with the block table, the int32 arrays and
  the int64 ones each sent in one copy; ``meta = inputs.metadata(backend)``, the model runs under
  ``ForwardContext(backend, meta, caches)`` and logits ``[N, vocab]`` are computed only for the last token of
  each request whose step reaches the end of its tokens (a decode, or the last chunk of a prompt); the
  sampled tokens go back to the scheduler's order (:mod:`tripath.engine.sampling.step_sampling`); where every sampled
  request allows it and the start chose it for the step's row count, the tokens are drawn straight from the
  hidden states instead, without logits (:mod:`tripath.engine.sampling.fused_sampling`).

A step takes one of four routes, chosen in one place (:meth:`ModelRunner.route`): a decode-only step
replays the decode graph of its padded batch size (:mod:`tripath.engine.runner.decode_graphs`); with speculative
decoding, a step of decodes and verifies alone replays the verify graph of its padded batch size
(:mod:`tripath.engine.runner.verify_graphs`, draft trees' masks too when the engine drafts trees); a step with
prompt tokens replays the graphs of its padded token count where captured: whole steps for a backend of
``GraphSupport.ALL`` (:mod:`tripath.engine.runner.whole_step_graphs`), else piecewise graphs between eager
attention calls whose first layer's launches the others replay (:mod:`tripath.engine.runner.mixed_graphs`);
any other step runs the model eagerly.

:meth:`ModelRunner.launch` only queues that work on the device and returns a
:class:`~tripath.engine.runner.launched_step.LaunchedStep`, whose ``sampled()`` waits for the tokens (copied to
pinned host memory behind an event); :meth:`execute` does both. With overlapped scheduling the engine
schedules and launches step N + 1 before it reads step N's tokens: a decode whose input token is step N's
passes ``previous=`` step N, and its ``input_ids`` row is filled from step N's tokens on the device. A launch
of ``num_steps > 1`` (multi-step decoding, :meth:`ModelRunner._launch_decode_steps`) runs that many model
steps of single-token decodes back to back, feeding each step's sampled tokens to the next and advancing
the metadata on the device. A runner with a ``hidden_observer`` (speculative decoding's ``mtp`` proposer)
hands it each launch's hidden states before the final norm once the step's sampling is queued (the model keeps
them: ``keep_prenorm_hidden``; on a graph route, the graph's own tensor).

The constructor builds the spec, the backend and the input builder; the engine then starts the runner through
its phases, in order (:func:`tripath.engine.runner.startup.start`: :meth:`~ModelRunner.plan_memory`,
:meth:`~ModelRunner.allocate_kv_cache`, :meth:`~ModelRunner.warm_up`, :meth:`~ModelRunner.capture_graphs`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect

import torch

from tripath.attention import ForwardContext, WatchedPaths, default_block_size, select_backend
from tripath.attention.backends.base import GraphSupport
from tripath.attention.step_ints import to_device
from tripath.engine.config import EngineConfig
from tripath.engine.runner import startup
from tripath.engine.runner.decode_graphs import DecodeGraphs
from tripath.engine.runner.draft_trees import check_draft_trees, move_tree_paths
from tripath.engine.runner.executor import ExecutorCapabilities
from tripath.engine.runner.launched_step import LaunchedStep, SampledStep, StepLogprobs
from tripath.engine.runner.memory_plan import MemoryPlan
from tripath.engine.runner.mixed_graphs import MixedStepGraphs
from tripath.engine.runner.step_inputs import StepInputBuilder, StepInputs
from tripath.engine.runner.verify_graphs import VerifyGraphs
from tripath.engine.runner.warmup import WarmupReport
from tripath.engine.sampling import fused_sampling
from tripath.engine.sampling.logits_transforms import PenaltyState
from tripath.engine.sampling.logprobs import position_logprobs
from tripath.engine.sampling.step_sampling import LaunchSampler, score_prompts
from tripath.engine.scheduling.block_manager import blocks_needed
from tripath.engine.scheduling.scheduler import ScheduledRequest
from tripath.engine.speculative.acceptance import accept_drafts, accept_tree
from tripath.engine.speculative.verify_transforms import verify_transforms
from tripath.engine.speculative.trees import chain_parents
from tripath.models.layers import Experts
from tripath.triton_internals import CompilePool


class Route(enum.Enum):
    """How a step runs (:meth:`ModelRunner.route`)."""

    DECODE_GRAPH = "decode graph"
    VERIFY_GRAPH = "verify graph"
    MIXED_GRAPHS = "prompt-step graphs"   # piecewise, or whole steps (GraphSupport.ALL)
    EAGER = "eager"


class ModelRunner(startup.RunnerStart):
    """Owns the model, the attention backend and the per-layer KV caches of one engine (an
    :class:`~tripath.engine.runner.executor.Executor` in the engine's own process). ``extra_cache_bytes``: for a
    cache of another model sized to the same blocks (speculative decoding's draft model), its bytes per block
    as a function of the block size, counted by the GPU memory plan. Built, it has its spec, backend and input
    builder; it serves once :func:`tripath.engine.runner.startup.start` has run its phases."""

    def __init__(self, model, config: EngineConfig, *, extra_cache_bytes=None):
        self.model = model
        self.extra_cache_bytes = extra_cache_bytes   # block_size -> bytes another cache sized with this one takes
        self.hidden_observer = None   # the mtp proposer: observe(scheduled, inputs, prenorm [T, H]) (module doc)
        speculation = config.speculative_config
        if speculation is not None and speculation.needs_target_hidden:
            model.keep_prenorm_hidden = True
        self.config = config
        self.device = config.device
        is_mla = getattr(model.config, "mla", None) is not None
        self.block_size = config.block_size or default_block_size(config.backend, is_mla, self.device)
        self.spec = model.attention_spec(block_size=self.block_size, kv_cache_dtype=config.kv_cache_dtype,
                                         kv_layout=config.kv_layout, dtype=config.dtype)
        self.backend = select_backend(self.spec, name=config.backend, device=self.device)
        verify_len = 1 if speculation is None else 1 + speculation.num_speculative_tokens
        if verify_len <= self.backend.capabilities.max_decode_threshold and verify_len > 1:
            # verifies go to the backend's decode path (else, e.g. two_path, they are extends)
            self.spec = dataclasses.replace(self.spec, decode_threshold=verify_len)
            self.backend = select_backend(self.spec, name=self.backend.name, device=self.device)
        if speculation is not None and speculation.uses_trees:
            check_draft_trees(self.backend, self.spec, verify_len)
        self.num_layers = model.num_attention_layers
        max_position = int(model.config.max_position)  # the rotary tables' rows (rope scaling included)
        self.max_model_len = config.max_model_len or max_position
        if self.max_model_len > max_position:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position ({max_position}): "
                             "its positions (with any rope scaling, which max_position already includes) end there")
        self.max_blocks_per_seq = blocks_needed(self.max_model_len, self.block_size)
        self.inputs = StepInputBuilder(self.device, self.block_size, config.max_num_batched_tokens,
                                       config.max_num_seqs, self.max_blocks_per_seq)
        graph_safe = self.backend.capabilities.graphs is not GraphSupport.NONE
        self.capabilities = ExecutorCapabilities(overlap=True, multi_step=graph_safe)
        self.kv_scales_pending = config.calculate_kv_scales  # set from the first step's keys and values
        self.penalties = PenaltyState(config.max_num_seqs, self.device)  # token counts for the penalties
        self.watched_paths = WatchedPaths()  # code paths whose launch recordings were watched (ForwardContext)
        self._logits_upcast_optional: bool | None = None  # whether model.compute_logits takes upcast=
        self.warmup_report: WarmupReport | None = None
        self.memory_plan: MemoryPlan | None = None  # on a GPU with the KV cache sized by the engine
        self.num_blocks = 0
        self.caches: list = []
        self.decode_graphs: DecodeGraphs | None = None
        self.verify_graphs: VerifyGraphs | None = None
        self.mixed_graphs: MixedStepGraphs | None = None
        self.largest_step_host_share: float | None = None  # host time / GPU span of the largest eager step
        self.samples = True   # False on a tensor-parallel worker: logits computed (collectives), nothing sampled
        self.share_tree_moves = None   # rank 0 of tensor parallelism: hands an accepted tree's slot moves on
        self.fused_sampling = fused_sampling.choose(self)   # which steps draw without logits (set at start)
        self.num_fused_sampling_steps = 0   # model steps whose tokens were drawn so
        self._phases = startup.PhaseOrder("ModelRunner")   # plan_memory, allocate_kv_cache, warm_up, capture_graphs
        self._compile_pool: CompilePool | None = None   # the start's, from plan_memory to the end of warm_up

    @property
    def captures_decode_graphs(self) -> bool:
        """Whether decode-only steps replay CUDA graphs: graphs on, and a backend whose decode forward reads
        only device tensors (:attr:`GraphSupport.DECODE` or ``ALL``: graph replay changes them)."""
        return self.config.use_cuda_graphs and self.backend.capabilities.graphs is not GraphSupport.NONE

    @property
    def captures_verify_graphs(self) -> bool:
        """Whether steps of decodes and verifies alone (speculative decoding) replay CUDA graphs: decode graphs
        captured, verifies in the decode slice (``decode_threshold = 1 + k``) and a backend whose verify route
        reads only device tensors (:attr:`Capabilities.verify_graphs`)."""
        return self.captures_decode_graphs and self.spec.decode_threshold > 1 and \
            self.backend.capabilities.verify_graphs

    @property
    def uses_mixed_graphs(self) -> bool:
        """Whether steps with prompt tokens may replay graphs: on a GPU with graphs on and ``mixed_cuda_graphs``,
        on one rank (ranks must run the same collectives), for a model without mixture-of-experts layers.
        Whole steps for a backend of :attr:`GraphSupport.ALL` (:mod:`tripath.engine.runner.whole_step_graphs`),
        else piecewise graphs (:mod:`tripath.engine.runner.mixed_graphs`), captured when the largest eager step
        measures host-bound at start (:data:`tripath.engine.runner.startup.MIXED_GRAPHS_MIN_HOST_SHARE`)."""
        parallel = getattr(self.model, "parallel", None)
        return (self.config.use_cuda_graphs and self.config.mixed_cuda_graphs
                and (parallel is None or parallel.world_size == 1)
                and not any(isinstance(m, Experts) for m in self.model.modules()))

    def capture_decode_graphs(self) -> None:
        """Capture the decode graphs for ``config.cuda_graph_batch_sizes()`` (:class:`DecodeGraphs`)."""
        self.decode_graphs = DecodeGraphs(self.model, self.backend, self.caches, self.config.cuda_graph_batch_sizes(),
                                          self.max_blocks_per_seq, self.device)
        pool = None if self.verify_graphs is None else self.verify_graphs.pool
        self.decode_graphs.capture(pool)

    def capture_verify_graphs(self) -> None:
        """Capture the verify graphs (:class:`VerifyGraphs`) for ``config.cuda_graph_batch_sizes()``, before
        the decode graphs, which then share their memory pool."""
        speculation = self.config.speculative_config
        self.verify_graphs = VerifyGraphs(self.model, self.backend, self.caches, self.config.cuda_graph_batch_sizes(),
                                          self.max_blocks_per_seq, self.block_size, self.spec.decode_threshold,
                                          self.device, trees=speculation is not None and speculation.uses_trees)
        self.verify_graphs.capture()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits the sampler takes for ``hidden [N, hidden_size]``: in the LM head's dtype where the
        model offers it (``compute_logits(..., upcast=False)``, as tripath's models do), else as the model
        returns them."""
        if self._logits_upcast_optional is None:
            self._logits_upcast_optional = "upcast" in inspect.signature(self.model.compute_logits).parameters
        if self._logits_upcast_optional:
            return self.model.compute_logits(hidden, upcast=False)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def logits_width(self) -> int:
        """Columns of the logits :meth:`compute_logits` returns (the vocabulary, padded as the model pads it)."""
        hidden = torch.zeros(1, int(self.model.config.hidden_size), dtype=self.config.dtype, device=self.device)
        return int(self.compute_logits(hidden).shape[-1])

    # ---- the route ----------------------------------------------------------------------------------
    def route(self, scheduled: list[ScheduledRequest]) -> tuple[Route, int | None]:
        """How the step runs, and the graph's padded batch size: decodes alone replay the smallest decode graph
        holding them, decodes and verifies alone the smallest verify graph (draft trees only where it takes
        their masks); a step whose token count has a bucket (KV scales set) replays it (draft trees only in
        piecewise graphs, whose attention runs on the step's own metadata); anything else, eager."""
        graphs = self.decode_graphs
        if graphs is not None and all(s.num_new_tokens == 1 and s.num_computed_tokens > 0 for s in scheduled):
            bs = graphs.batch_size(len(scheduled))
            if bs is not None:
                return Route.DECODE_GRAPH, bs
        verify = self.verify_graphs
        trees = any(s.draft_parents is not None for s in scheduled)   # only verify graphs may take their masks
        if verify is not None and (verify.trees or not trees) and verify.takes(scheduled):
            bs = verify.batch_size(len(scheduled))
            if bs is not None:
                return Route.VERIFY_GRAPH, bs
        mixed = self.mixed_graphs
        if mixed is not None and not self.kv_scales_pending and (not trees or isinstance(mixed, MixedStepGraphs)) \
                and mixed.bucket(sum(s.num_new_tokens for s in scheduled)):
            return Route.MIXED_GRAPHS, None
        return Route.EAGER, None

    # ---- inputs -------------------------------------------------------------------------------------
    def prepare(self, scheduled: list[ScheduledRequest], pad_to: int | None = None,
                previous: LaunchedStep | None = None) -> StepInputs:
        """Build the step's inputs in plan order (:mod:`tripath.engine.runner.step_inputs`). ``pad_to``: decode-only
        steps padded to a captured batch size. The block table is as wide as the step's longest row; a
        graph replay copies just those columns into its captured ``max_blocks_per_seq``-wide table.
        ``previous``: the launched step whose tokens are the in-flight input tokens of this one."""
        query_lens = [s.num_new_tokens for s in scheduled]
        context_lens = [s.num_computed_tokens for s in scheduled]
        num_padding = 0 if pad_to is None else pad_to - len(scheduled)
        query_lens += [1] * num_padding
        context_lens += [1] * num_padding
        plan = self.backend.plan(query_lens, context_lens)
        inputs = self.inputs.build(plan, scheduled, num_padding, None if previous is None else previous.rows,
                                   ints=self.backend.step_ints(plan))
        if inputs.deferred is not None:
            rows, sources = inputs.deferred
            inputs.input_ids.index_copy_(0, rows, previous.last_tokens.index_select(0, sources))
        return inputs

    # ---- one step -----------------------------------------------------------------------------------
    def execute(self, scheduled: list[ScheduledRequest], num_steps: int = 1, fused: bool | None = None) -> SampledStep:
        """Run the step; the tokens (and log-probabilities) of each scheduled request."""
        if not scheduled:
            return SampledStep.empty(0)
        return self.launch(scheduled, num_steps=num_steps, fused=fused).sampled()

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledRequest], previous: LaunchedStep | None = None,
               num_steps: int = 1, fused: bool | None = None) -> LaunchedStep:
        """Queue the step on the device (inputs, forward, logits, sampling) without waiting for it.
        ``previous``: the step launched before, whose tokens some of these decodes take as input.
        ``num_steps > 1``: a step of single-token decodes run that many times (:meth:`_launch_decode_steps`).
        ``fused``: whether its tokens are drawn without logits (None: :meth:`step_draws_fused` decides; a
        tensor-parallel rank takes rank 0's decision, as their collectives must match)."""
        if fused is None:
            fused = self.step_draws_fused(scheduled)
        route, graph_bs = self.route(scheduled)
        pad_to = graph_bs if route is Route.DECODE_GRAPH else None   # a verify graph pads on its own
        inputs = self.prepare(scheduled, pad_to=pad_to, previous=previous)
        if num_steps > 1:
            if self.hidden_observer is not None:
                raise ValueError("num_steps > 1 (multi-step decoding) does not hand its hidden states on: run "
                                 "one step at a time with a hidden-state observer (the mtp proposer)")
            return self._launch_decode_steps(scheduled, inputs, pad_to, num_steps, fused)
        prenorm = None
        if route is Route.DECODE_GRAPH:
            hidden = self.decode_graphs.replay(graph_bs, inputs)
        elif route is Route.VERIFY_GRAPH:
            hidden, prenorm = self.verify_graphs.replay(graph_bs, inputs)
        else:
            meta = inputs.metadata(self.backend)
            ctx = ForwardContext(self.backend, meta, self.caches, calibrate_kv_scales=self.kv_scales_pending,
                                 watched=self.watched_paths)
            if route is Route.MIXED_GRAPHS:
                hidden = self.mixed_graphs.run(inputs.input_ids, inputs.positions, ctx)
            else:
                hidden = self.model(inputs.input_ids, inputs.positions, ctx)
            self.kv_scales_pending = False
        launched = self._sample(scheduled, inputs, hidden, fused)
        if self.hidden_observer is not None:   # after the tokens' copy was queued: they do not wait for it
            if prenorm is None:
                prenorm = self._prenorm_hidden(route, graph_bs, hidden.shape[0])
            self.hidden_observer.observe(scheduled, inputs, prenorm)
        return launched

    def _prenorm_hidden(self, route: Route, graph_bs: int | None, num_rows: int) -> torch.Tensor:
        """The step's hidden states before the final norm, ``[num_rows, H]`` in plan order: the model's
        (eager), or those of the graph just replayed."""
        if route is Route.DECODE_GRAPH:
            return self.decode_graphs.prenorm[graph_bs][:num_rows]
        if route is Route.MIXED_GRAPHS:
            return self.mixed_graphs.prenorm(num_rows)
        return self.model.prenorm_hidden[:num_rows]

    def _sample(self, scheduled: list[ScheduledRequest], inputs: StepInputs, hidden: torch.Tensor,
                fused: bool = False) -> LaunchedStep:
        """Logits, sampling and (for verifies) acceptance of a step whose forward is queued; ``fused``: the
        tokens drawn straight from the hidden states instead (:mod:`tripath.engine.sampling.fused_sampling`)."""
        prompt = score_prompts(scheduled, inputs.plan, hidden, self.compute_logits)
        if not inputs.sample_rows and not inputs.verify_rows:
            return LaunchedStep(scheduled, [], None, self._step_logprobs(None, prompt))
        num_sampled = len(inputs.sample_rows)
        rows = hidden[inputs.logit_indices]
        if fused:   # a tensor-parallel worker draws too: the LM head's collectives run in the draw
            sampler = self._sampler([scheduled[i].request for i in inputs.sample_rows])
            positions = self._row_positions(inputs, num_sampled, sampler.any_sampled)
            tokens = sampler.draw_fused(self.model, rows, positions).unsqueeze(0)
            self.num_fused_sampling_steps += 1
            if not self.samples:
                return LaunchedStep(scheduled, [], None)
            return LaunchedStep(scheduled, inputs.sample_rows, tokens, self._step_logprobs(sampler, prompt))
        logits = self.compute_logits(rows)
        if not self.samples:   # a tensor-parallel worker: the LM head's collectives ran; rank 0 samples
            return LaunchedStep(scheduled, [], None)
        sampler = self._sampler([scheduled[i].request for i in inputs.sample_rows])
        positions = self._row_positions(inputs, num_sampled, sampler.needs_positions)
        tokens = sampler(logits[:num_sampled], 0, positions).unsqueeze(0) if num_sampled else None
        if inputs.verify_rows:
            tokens, verify_logprobs = self._verify(scheduled, inputs, logits[num_sampled:], tokens)
            step_logprobs = self._step_logprobs(sampler, prompt, verify_logprobs)
            if step_logprobs is not None and verify_logprobs is not None:
                step_logprobs.verify_columns = [num_sampled + j for j in step_logprobs.verify_columns]
            return LaunchedStep(scheduled, inputs.sample_rows + inputs.verify_rows, tokens, step_logprobs,
                                ragged=True)
        return LaunchedStep(scheduled, inputs.sample_rows, tokens, self._step_logprobs(sampler, prompt))

    def _verify(self, scheduled: list[ScheduledRequest], inputs: StepInputs, logits: torch.Tensor,
                tokens: torch.Tensor | None) -> tuple[torch.Tensor, tuple | None]:
        """The verifies' tokens (``accept_drafts`` on the rows' transformed logits; draft trees:
        ``accept_tree``, then their paths' cache rows move) beside the other rows' ``tokens [1, S]``: ``[K + 1,
        S + B]``, -1 past each column's tokens; and, for the verifies that ask, ``(their indices among the
        verifies, rows each, k each, LogprobRows)`` of every row scored with the token the verify yields there."""
        items = [scheduled[i] for i in inputs.verify_rows]
        args = ([item.request.sampling_params for item in items], [item.request.generator for item in items])
        transforms = verify_transforms(items, self.penalties, logits.shape[-1], logits.device)
        path_rows, scored = None, logits if transforms is None else transforms.apply(logits)   # rows: trees' paths
        if any(item.draft_parents is not None for item in items):
            grid, paths = accept_tree(scored, [item.draft_token_ids for item in items], [chain_parents(len(
                item.draft_token_ids)) if item.draft_parents is None else item.draft_parents for item in items], *args)
            move_tree_paths(self.caches, inputs, paths, share=self.share_tree_moves)
            path_rows = [[0] + [1 + t for t in path] for path in paths]
        else:
            grid = accept_drafts(scored, [item.draft_token_ids for item in items], *args)
        if transforms is not None:
            transforms.record(grid)   # the penalties' counts gain the tokens each verify yields
        verified, logprobs = grid.t(), None
        asking = [j for j, item in enumerate(items) if item.request.sampling_params.logprobs is not None]
        if asking:
            counts = [item.num_new_tokens for item in items]
            starts = [sum(counts[:j]) for j in range(len(items))]
            row = (lambda j, c: c) if path_rows is None else \
                (lambda j, c: path_rows[j][c] if c < len(path_rows[j]) else 0)   # past the yield: dropped
            rows = [starts[j] + row(j, c) for j in asking for c in range(counts[j])]
            cells = [(j, c) for j in asking for c in range(counts[j])]
            device = logits.device
            pick = to_device(rows, torch.int64, device)
            where = to_device([j for j, _ in cells] + [c for _, c in cells], torch.int64, device).view(2, -1)
            chosen = grid[where[0], where[1]].clamp(min=0)   # rows past the yield: dropped on the host
            ks = [items[j].request.sampling_params.logprobs for j in asking]
            logprobs = (asking, [counts[j] for j in asking], ks,
                        position_logprobs(logits.index_select(0, pick), chosen, max(ks)))
        if tokens is None:
            return verified, logprobs
        padded = torch.full((verified.shape[0], tokens.shape[1]), -1, dtype=tokens.dtype, device=tokens.device)
        padded[:1] = tokens
        return torch.cat([padded, verified], dim=1), logprobs

    def _sampler(self, requests, num_steps: int = 1) -> LaunchSampler:
        return LaunchSampler(requests, self.penalties, self.device, num_steps)

    def step_draws_fused(self, scheduled: list[ScheduledRequest]) -> bool:
        """Whether the step draws its tokens without logits (:mod:`tripath.engine.sampling.fused_sampling`): it verifies
        no drafts, every request it samples allows it and the start chose it for its row count and kind. One
        pass over the step, whose requests' verdicts are cached on their sampling parameters."""
        choice = self.fused_sampling
        if choice is None or not choice.may_use(len(scheduled)):
            return False
        rows, sampled = 0, False
        for item in scheduled:
            if item.draft_token_ids:
                return False
            if item.samples:
                params = item.request.sampling_params
                if params.full_logits_reason is not None:
                    return False
                rows += 1
                sampled = sampled or params.temperature != 0
        return rows > 0 and choice.use(rows, sampled)

    @staticmethod
    def _row_positions(inputs: StepInputs, num_rows: int, needed: bool) -> torch.Tensor | None:
        """``[num_rows]`` positions of the sample rows' last tokens (the noise's counter), when ``needed``."""
        return inputs.positions.index_select(0, inputs.logit_indices[:num_rows]) if needed and num_rows else None

    @staticmethod
    def _step_logprobs(sampler: LaunchSampler | None, prompt, verify=None) -> StepLogprobs | None:
        if (sampler is None or not sampler.logprobs) and prompt is None and verify is None:
            return None
        rows, ks, sampled = ([], [], []) if sampler is None else \
            (sampler.logprob_rows, sampler.logprob_ks, sampler.logprobs)
        requests, counts, pks, scored = prompt if prompt is not None else ([], [], [], None)
        out = StepLogprobs(rows, ks, sampled, requests, counts, pks, scored)
        if verify is not None:
            out.verify_columns, out.verify_counts, out.verify_ks, out.verify = verify
        return out

    # ---- multi-step decoding ------------------------------------------------------------------------
    def _launch_decode_steps(self, scheduled: list[ScheduledRequest], inputs: StepInputs, graph_bs: int | None,
                             num_steps: int, fused: bool = False) -> LaunchedStep:
        """Run a step of single-token decodes ``num_steps`` times back to back, without the host in between:
        after each step the sampled tokens become the next step's input ids on the device and
        :meth:`AttentionMetadata.advance_decodes_` moves positions, sequence lengths and slots on by one.
        Each step replays the decode graph of ``graph_bs`` rows, or runs eagerly when there is none. The
        requests' blocks must already cover all ``num_steps`` tokens (the scheduler grows them)."""
        n = len(scheduled)
        plan = inputs.plan
        if not self.capabilities.multi_step:
            raise ValueError(f"the {self.backend.name} backend cannot run several decode steps in one launch")
        if plan.num_decodes != plan.num_requests or plan.num_tokens != plan.num_requests or \
                inputs.sample_rows != list(range(n)):
            raise ValueError("num_steps > 1 needs a step of single-token decodes only")
        sampler = self._sampler([item.request for item in scheduled], num_steps)
        if graph_bs is not None:
            graph, meta, hidden = self.decode_graphs.load(graph_bs, inputs)
            ids, positions = self.decode_graphs.input_ids[:graph_bs], self.decode_graphs.positions[:graph_bs]
            run = graph.replay
        else:
            meta = inputs.metadata(self.backend)
            ids, positions = inputs.input_ids, inputs.positions
            ctx = ForwardContext(self.backend, meta, self.caches, watched=self.watched_paths)
            run = functools.partial(self.model, ids, positions, ctx)
        tokens = torch.empty(num_steps, n, dtype=torch.int64, device=self.device)
        for step in range(num_steps):
            if step:
                ids[:n].copy_(tokens[step - 1])
                meta.advance_decodes_(positions[:n], self.block_size)
            out = run()
            rows = (hidden if graph_bs is not None else out)[:n]
            if fused:
                tokens[step] = sampler.draw_fused(self.model, rows, positions[:n])
            else:
                tokens[step] = sampler(self.compute_logits(rows), step, positions[:n])
        self.num_fused_sampling_steps += num_steps if fused else 0
        return LaunchedStep(scheduled, inputs.sample_rows, tokens, self._step_logprobs(sampler, None))
