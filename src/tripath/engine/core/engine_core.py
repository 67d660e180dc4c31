"""The engine core: one model, its KV cache, a scheduler and the executor that runs its steps, behind a typed
face that the offline :class:`~tripath.engine.llm.LLM` and the server both drive.

::

    core = EngineCore("tiny-llama", num_kv_blocks=256)
    core.add_request([1, 2, 3], SamplingParams(max_tokens=8), request_id="a")
    while core.has_unfinished_requests():
        result = core.step()          # StepResult: result.outputs, result.failure
    core.info()                       # EngineInfo: limits, backend, KV cache, graphs, start timings

Each :meth:`~EngineCore.step` schedules (decodes, then prompt chunks, then new requests, under the token
budget), runs the model once on the step's batch and returns a :class:`StepResult`: a
:class:`~tripath.engine.requests.request.RequestOutput` for every request that produced a token or finished, and the
step's failure, if any. A step never raises an ``Exception``: whatever fails is reported in one place,
``StepResult.failure`` (:class:`StepFailure`), with the requests it aborted — those the step scheduled when
a launch or a read fails; the running ones when scheduling fails; the running ones, else the waiting ones,
for anything else — and the engine serves on. A device out-of-memory error also shrinks the scheduler's
token budget, so the next steps are smaller. With ``async_scheduling`` (the default; one rank) the steps
overlap: ``step`` schedules and launches step N + 1 on the device, then reads step N's tokens and returns
step N's outputs (:mod:`tripath.engine.core.core_steps`).

The core is not thread-safe: one thread drives it (the ``LLM`` holds its lock around each call; the server's
core loop owns it). :meth:`~EngineCore.grammar_compiler` is the exception: thread-safe, built on first use.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Sequence

from tripath.engine.config import EngineConfig
from tripath.engine.core.core_steps import StepFailure, StepResult, StepRunner
from tripath.engine.core.engine_info import EngineInfo, describe_engine
from tripath.engine.requests.request import Request
from tripath.engine.requests.sampling_params import SamplingParams, check_sampling_token_ids, token_ids_of
from tripath.engine.requests.structured_output import GrammarCompiler
from tripath.engine.runner.model_runner import ModelRunner
from tripath.engine.runner.startup import start as start_executor
from tripath.engine.sampling.generation_defaults import load_generation_defaults, usable_defaults
from tripath.engine.sampling.sampler import make_generator
from tripath.engine.scheduling.block_manager import BlockManager
from tripath.engine.scheduling.scheduler import Scheduler
from tripath.engine.scheduling.stats import EngineStats, StepTokenCounts
from tripath.engine.scheduling.step_pacing import StepPacer
from tripath.triton_internals import compiled_variants

__all__ = ["EngineCore", "StepFailure", "StepResult", "engine_config"]


def engine_config(model, config: EngineConfig | None, engine_options: dict) -> EngineConfig:
    """``config``, or an :class:`EngineConfig` of ``engine_options`` (``TypeError`` for both, or an unknown
    option); ``dtype`` defaults to a built model's own."""
    if config is not None and engine_options:
        raise TypeError(f"pass either config= or engine options ({', '.join(engine_options)}), not both")
    if config is not None:
        return config
    if engine_options.get("dtype") is None and not isinstance(model, (str, os.PathLike)):
        engine_options["dtype"] = next(model.parameters()).dtype
    known = set(EngineConfig.__dataclass_fields__)
    unknown = sorted(set(engine_options) - known)
    if unknown:
        raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; EngineConfig has: {', '.join(sorted(known))}")
    return EngineConfig(**engine_options)


class EngineCore:
    """A model, its KV cache, a scheduler and an executor (see the module doc).

    ``model``: a local directory, a Hugging Face hub id (``org/name``; see :mod:`tripath.models.hub`), a
    preset name, or a built model object (``attention_spec``, ``num_attention_layers``,
    ``config.eos_token_ids``/``max_position``, ``forward(input_ids, positions, ctx)``, ``compute_logits``).
    ``tensor_parallel_size`` > 1 shards it over that many ranks (``model`` a path or a preset; see
    :mod:`tripath.engine.runner.parallel_executor`); :meth:`close` stops their processes. ``tokenizer``: a tokenizer
    object, or a tokenizer's directory or hub id, in place of the model's own; ``revision`` and
    ``download_dir``: the hub repository's revision and the Hugging Face cache. The settings are an
    :class:`EngineConfig` (``config=``) or its fields as keyword arguments.

    ``detokenize`` (True): a finished output carries its ``text`` and its log-probabilities'
    ``decoded_token``; a caller that detokenises itself (the server) passes False, keeping that work off the
    step loop (``text`` is then None). On a GPU the constructor returns once every kernel variant is compiled
    (:mod:`tripath.engine.runner.warmup`), then runs a full garbage collection so that the collector's first pass
    over the start's objects does not pause a step; ``start_seconds`` is how long it all took.
    """

    def __init__(self, model, *, tokenizer=None, config: EngineConfig | None = None, tensor_parallel_size: int = 1,
                 revision: str | None = None, download_dir: str | None = None, detokenize: bool = True,
                 **engine_options):
        self.config = config = engine_config(model, config, engine_options)
        start = time.perf_counter()
        self.model_path = None   # the local directory or preset a model given by name loads from
        if isinstance(model, (str, os.PathLike)):
            from tripath.models.hub import resolve_model_path
            model = self.model_path = resolve_model_path(os.fspath(model), revision=revision, cache_dir=download_dir)
        if isinstance(tokenizer, (str, os.PathLike)):
            from tripath.models import load_tokenizer
            from tripath.models.hub import resolve_model_path
            tokenizer = load_tokenizer(resolve_model_path(os.fspath(tokenizer), weights=False,
                                                          cache_dir=download_dir))
        self.generation_defaults = load_generation_defaults(
            self.model_path if self.model_path is not None and os.path.isdir(self.model_path) else None,
            config.generation_config)
        self.default_sampling_params()   # a default the sampler refuses fails here, naming the field
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tensor_parallel_size!r}")
        speculation = config.speculative_config
        mtp = speculation is not None and speculation.method == "mtp"   # the model's own MTP layer drafts
        self.runner = None
        if tensor_parallel_size > 1 or isinstance(model, str):
            from tripath.models import load_model, load_tokenizer
            from tripath.models.deepseek_mtp import NoMTPLayer
            try:
                if tensor_parallel_size > 1:
                    from tripath.engine.runner.parallel_executor import ParallelExecutor
                    self.runner = ParallelExecutor(model, config, tensor_parallel_size)
                    model = self.runner.model
                else:
                    model = load_model(model, dtype=config.dtype, device=config.device, mtp=mtp)
            except NoMTPLayer as error:
                raise ValueError(f"speculative_config method 'mtp' drafts with the model's multi-token-prediction "
                                 f"layer, and {error}") from None
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(int(t) for t in getattr(model.config, "eos_token_ids", ()) or ())
        draft = extra_cache_bytes = None
        if speculation is not None and speculation.method == "draft_model":
            from tripath.engine.drafters.draft_model import draft_cache_bytes, load_draft_model
            draft = load_draft_model(speculation.model, config)   # its weights in use before the cache is sized
            extra_cache_bytes = draft_cache_bytes(draft, config)
        if mtp:
            from tripath.engine.drafters.mtp import check_mtp_model
            from tripath.engine.runner.mtp_layer import mtp_cache_bytes
            check_mtp_model(model)
            extra_cache_bytes = mtp_cache_bytes(model, config)
        if self.runner is None:
            self.runner = ModelRunner(model, config, extra_cache_bytes=extra_cache_bytes)
        elif draft is not None:   # tensor parallelism: the draft runs beside rank 0's shard, whose plan counts it
            self.runner.reserve_rank0_cache(extra_cache_bytes)
        # the executor's start, in order: plan_memory, allocate_kv_cache, warm_up, capture_graphs
        start_executor(self.runner)
        self.block_manager = BlockManager(self.runner.num_blocks, self.runner.block_size, config.enable_prefix_caching,
                                          recompute_last_hit_block=mtp)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_model_len=self.runner.max_model_len,
                                   enable_chunked_prefill=config.enable_chunked_prefill,
                                   speculation=config.speculative_config,
                                   proposer=self._proposer(config, model, draft))
        # with speculation, steps overlap while nothing is drafted (core_steps); the mtp layer reads every
        # launch's tokens on the host, so it never overlaps
        overlap = config.async_scheduling and self.runner.capabilities.overlap and not mtp
        pacing = config.step_pacing_s
        if pacing > 0 and overlap and config.device.type != "cpu":
            raise ValueError("step_time_target_s on a GPU needs async_scheduling=False: with overlapped steps the "
                             "host does not wait for a step, so it cannot time one")
        pacer = StepPacer(self.scheduler, pacing) if pacing > 0 else None   # on the CPU a launch computes
        # model steps a step of decodes alone may take (multi-step decoding), where the executor can
        # (with speculation, the scheduler takes several only where nothing is drafted; the mtp layer runs
        # over every model step's hidden states, so it takes one)
        self.decode_steps = config.decode_steps if self.runner.capabilities.multi_step and not mtp else 1
        self.detokenize = detokenize
        self.step_tokens = StepTokenCounts()   # new tokens per model step, for stats()
        self._steps = StepRunner(self.scheduler, self.runner, overlap, pacer, self.step_tokens, self._finished_text)
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self.num_requests_added = 0
        self._compiled_at_start = compiled_variants()
        # The start leaves a few hundred thousand objects to the garbage collector (compiled kernels, the
        # warm-up's probes), most of them still young: collected now, the collector's first full pass over
        # them (a pause that grows with them) does not fall into the first requests' steps.
        gc.collect()
        self.start_seconds = time.perf_counter() - start

    # ---- what it is ---------------------------------------------------------------------------------------
    @property
    def overlap(self) -> bool:
        """Whether steps overlap (step N + 1 launched before step N is read)."""
        return self._steps.overlap

    @property
    def num_steps(self) -> int:
        return self._steps.num_steps

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.model.config, "vocab_size", None)

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def backend_name(self) -> str:
        return self.runner.backend.name

    @property
    def num_compiled_since_start(self) -> int:
        """Kernel variants compiled after the engine was built (0 when the warm-up covered every step)."""
        return compiled_variants() - self._compiled_at_start

    def _proposer(self, config: EngineConfig, model, draft):
        """Speculative decoding's proposer (:func:`tripath.engine.drafters.proposers.make_proposer`), or None;
        ``draft``: the draft model, loaded already."""
        if config.speculative_config is None:
            return None
        from tripath.engine.drafters.proposers import make_proposer
        return make_proposer(config.speculative_config, self.runner, config, int(model.config.vocab_size), draft)

    def info(self) -> EngineInfo:
        """What this engine is (see :class:`~tripath.engine.core.engine_info.EngineInfo`)."""
        return describe_engine(self.runner, self.config, model=self.model_path, vocab_size=self.vocab_size or 0,
                               decode_steps=self.decode_steps, start_seconds=self.start_seconds,
                               generation_defaults=self.generation_defaults)

    def default_sampling_params(self) -> SamplingParams:
        """The sampling parameters of requests that pass none: ``SamplingParams()`` with the defaults of the
        model's ``generation_config.json`` (``generation_defaults``, per the ``generation_config`` setting)
        that the engine implements."""
        return SamplingParams(**usable_defaults(self.generation_defaults))

    def memory_report(self) -> str:
        """The GPU memory plan (:mod:`tripath.engine.runner.memory_plan`): weights, KV cache, the reserved worst
        step of each kind, graph pools, headroom, and what was measured at start; on the CPU or with
        ``num_kv_blocks`` set, the cache size alone."""
        plan = getattr(self.runner, "memory_plan", None)
        if plan is not None:
            return plan.summary()
        return (f"KV cache: {self.runner.num_blocks} blocks of {self.runner.block_size} tokens "
                f"({'num_kv_blocks' if self.config.num_kv_blocks else 'the CPU default'}; no GPU memory plan)")

    # ---- requests -----------------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids, params: SamplingParams | None = None, request_id: str | None = None,
                    *, grammar=None, prompt_text: str | None = None) -> str:
        """Queue a prompt's token ids (a sequence of ints or a 1-D integer tensor/array); its request id (given,
        or ``req-<n>``). Nothing is queued when it raises: ``TypeError`` for ids that are not integers,
        ``ValueError`` for an empty prompt, ids outside the vocabulary (in the prompt, ``stop_token_ids`` or
        ``logit_bias``), a request id already queued or running, ``n`` / ``best_of`` above 1 (one completion
        per request), a structured output that does not compile, or a request that could never be served
        (see :class:`Scheduler`). ``grammar``: the compiled grammar of ``params.structured_output`` (from
        ``grammar_compiler().submit(...)``), else it is compiled here; ``prompt_text``: the text the ids
        encode, reported back in the outputs."""
        _check_one_choice(params)
        request = self.make_request(prompt_token_ids, params, request_id, prompt_text=prompt_text, grammar=grammar)
        self.add(request)
        return request.request_id

    def add_requests(self, requests: Sequence[tuple]) -> list[str]:
        """Queue several requests together, or none of them: ``requests`` as ``(prompt_token_ids, params,
        request_id, grammar)`` each (as :meth:`add_request` takes them; ``grammar`` may be None). Raises as
        :meth:`add_request` does for the first request that cannot be queued, and then nothing is queued.
        Their ids, in order."""
        made: list[Request] = []
        for i, (prompt_token_ids, params, request_id, grammar) in enumerate(requests):
            _check_one_choice(params)
            made.append(self.make_request(prompt_token_ids, params, request_id, grammar=grammar,
                                          number=self.num_requests_added + i, taken=[r.request_id for r in made]))
        for request in made:
            self.add(request)
        return [r.request_id for r in made]

    def make_request(self, prompt_token_ids, params: SamplingParams | None = None, request_id: str | None = None,
                     *, prompt_text: str | None = None, name: str = "prompt", number: int | None = None,
                     taken: Sequence[str] = frozenset(), grammar=None) -> Request:
        """A validated request that :meth:`add` will queue, nothing queued yet (see :meth:`add_request` for
        what raises). ``name`` names the prompt in errors; ``number``: the request's number (its default id
        and seed; default: the next one); ``taken``: request ids claimed by requests about to be queued with
        it."""
        params = params if params is not None else self.default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        number = self.num_requests_added if number is None else number
        token_ids = token_ids_of(prompt_token_ids, name, self.vocab_size)
        check_sampling_token_ids(params, self.vocab_size, name)
        live = {r.request_id for r in (*self.scheduler.waiting, *self.scheduler.running)} | set(taken)
        if request_id is None:
            request_id, n = f"req-{number}", 0
            while request_id in live:
                n += 1
                request_id = f"req-{number}-{n}"
        elif not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        elif request_id in live:
            raise ValueError(f"request_id {request_id!r} is already queued or running")
        request = Request(token_ids, params, request_id=request_id, prompt=prompt_text,
                          eos_token_ids=self.eos_token_ids)
        self.scheduler.check(request)
        if params.structured_output is not None:
            request.grammar = self.grammar_compiler().state(params.structured_output, grammar)
        if not params.greedy:
            seed = params.seed if params.seed is not None else hash((self.config.seed, number))
            request.generator = make_generator(seed, self.config.device)
            request.sampling_seed = seed
        return request

    def add(self, request: Request) -> None:
        """Queue a request :meth:`make_request` made."""
        self.scheduler.add(request)
        self.num_requests_added += 1

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False when no such request is queued or running."""
        return self.scheduler.abort(request_id) is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def num_waiting(self) -> int:
        """Requests queued for a place in the batch (new or preempted)."""
        return len(self.scheduler.waiting)

    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler of this engine's tokenizer (built on first use; thread-safe): its
        cache holds ``grammar_cache_mb``, its ``submit`` compiles on its own threads and ``timeout_s`` is
        ``grammar_compile_timeout_s``. ``ValueError`` / ``ImportError`` without a tokenizer or xgrammar."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(
                    self.tokenizer, self.runner.logits_width(), self.eos_token_ids,
                    cache_bytes=self.config.grammar_cache_mb << 20, timeout_s=self.config.grammar_compile_timeout_s)
        return self._grammar_compiler

    # ---- steps --------------------------------------------------------------------------------------------
    def step(self, decode_steps: int | None = None) -> StepResult:
        """One scheduling step and one model run (see the module doc); ``decode_steps``: the most model steps a
        step of decodes alone may take this time (None: the engine's ``decode_steps``)."""
        steps = self.decode_steps if decode_steps is None else max(1, min(decode_steps, self.decode_steps))
        return self._steps.step(steps)

    def stats(self) -> EngineStats:
        """The engine's state and cumulative counters now (requests, KV blocks, prefix cache, preemptions,
        steps, speculative drafts, fused sampling): see :class:`~tripath.engine.scheduling.stats.EngineStats`."""
        blocks, scheduler = self.block_manager, self.scheduler
        total = blocks.num_usable_blocks
        return EngineStats(len(scheduler.running), len(scheduler.waiting), total - blocks.num_free_blocks, total,
                           blocks.num_queried_tokens, blocks.num_hit_tokens, scheduler.num_preemptions,
                           self.num_steps, tuple(self.step_tokens.counts), self.step_tokens.total,
                           *scheduler.draft_counts.stats_fields(),
                           fused_sampling_steps=int(getattr(self.runner, "num_fused_sampling_steps", 0)))

    def decode(self, token_ids: Sequence[int]) -> str | None:
        """``token_ids`` as text (special tokens skipped); None without a tokenizer."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def _finished_text(self, request: Request) -> str | None:
        """A finished request's text, its log-probabilities' tokens decoded (with ``detokenize``)."""
        if not self.detokenize:
            return None
        if self.tokenizer is not None:
            for entries in (request.logprobs or (), request.prompt_logprobs or ()):
                for entry in entries:
                    for token, logprob in (entry or {}).items():
                        if logprob.decoded_token is None:
                            logprob.decoded_token = self.tokenizer.decode([token])
        return self.decode(request.output_token_ids)

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (nothing to do for one rank) and the grammar compiler's
        threads; idempotent."""
        runner = self.__dict__.get("runner")
        if runner is not None:
            runner.close()
        compiler = self.__dict__.get("_grammar_compiler")
        if compiler is not None:
            compiler.close()

    def __enter__(self) -> "EngineCore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()


def _check_one_choice(params) -> None:
    """The step API runs one completion per request: ``ValueError`` for ``n`` / ``best_of`` above 1."""
    if isinstance(params, SamplingParams) and params.num_choices > 1:
        raise ValueError(f"sampling_params asks for {params.num_choices} completions (n / best_of): the step "
                         "API runs one completion per request; add one request per completion (seed + i for "
                         "choice i), or use generate()")
