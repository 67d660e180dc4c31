"""The engine's front door: :class:`LLM` — offline ``generate`` and a step API for servers — plus run metrics.

::

    llm = LLM("tiny-llama", num_kv_blocks=256)
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    llm.last_metrics            # throughput, TTFT, TPOT of that run

    rid = llm.add_request([1, 2, 3], SamplingParams(max_tokens=8))   # servers: add, then step
    while llm.has_unfinished_requests():
        for out in llm.step(): ...   # out.new_token_ids, out.finished

    with LLM("/models/Qwen3-32B", tensor_parallel_size=2) as llm:   # ranks 1.. in spawned workers
        outs = llm.generate(prompts)

Each ``step`` schedules (decodes, then prompt chunks, then new requests, under the token budget), runs the
model once on the step's batch and returns a :class:`RequestOutput` for every request that produced a token
or finished. With ``async_scheduling`` (the default; one rank) the steps overlap: ``step`` schedules and
launches step N + 1 on the device, then reads step N's tokens and returns step N's outputs, so the host's
work for a step runs while the device computes the one before (see :mod:`tripath.engine.scheduler`).
"""

from __future__ import annotations

import gc
import logging
import os
import statistics
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from tripath.engine.block_manager import BlockManager
from tripath.engine.config import EngineConfig
from tripath.engine.errors import StepFailed
from tripath.engine.choices import choice_params, group_choices
from tripath.engine.generation_defaults import load_generation_defaults, usable_defaults
from tripath.engine.launched_step import LaunchedStep, SampledStep
from tripath.engine.llm_guards import EngineLock, check_sampling_token_ids, serialised
from tripath.engine.model_runner import ModelRunner
from tripath.engine.request import Request, RequestOutput
from tripath.engine.sampling_params import SamplingParams, token_ids_of
from tripath.engine.sampler import make_generator
from tripath.engine.stats import EngineStats, StepTokenCounts
from tripath.triton_internals import compiled_variants
from tripath.engine.scheduler import Scheduler, SchedulerOutput
from tripath.engine.step_pacing import StepPacer
from tripath.engine.structured_output import GrammarCompiler

Prompt = str | Sequence[int]
logger = logging.getLogger(__name__)


@dataclass
class RunMetrics:
    """One ``generate`` run: token counts, wall time, throughputs (tokens/s), TTFT and TPOT (seconds)."""

    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    elapsed_s: float
    num_steps: int
    num_preemptions: int
    prefix_hit_rate: float
    mean_ttft_s: float
    p50_ttft_s: float
    mean_tpot_s: float

    @property
    def output_throughput(self) -> float:
        return self.num_output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def total_throughput(self) -> float:
        return (self.num_prompt_tokens + self.num_output_tokens) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def summary(self) -> str:
        return (f"{self.num_requests} requests, {self.num_prompt_tokens} prompt + {self.num_output_tokens} output "
                f"tokens in {self.elapsed_s:.2f} s ({self.num_steps} steps): {self.output_throughput:.1f} output "
                f"tok/s, {self.total_throughput:.1f} total tok/s; TTFT mean {self.mean_ttft_s * 1e3:.1f} ms "
                f"(p50 {self.p50_ttft_s * 1e3:.1f}), TPOT mean {self.mean_tpot_s * 1e3:.2f} ms; "
                f"{self.num_preemptions} preemptions, prefix hit rate {self.prefix_hit_rate:.0%}")

    @classmethod
    def of(cls, requests: list[Request], elapsed_s: float, num_steps: int, num_preemptions: int,
           prefix_hit_rate: float) -> "RunMetrics":
        ttfts = [r.ttft for r in requests if r.ttft is not None]
        tpots = [r.tpot for r in requests if r.tpot is not None]
        return cls(len(requests), sum(r.num_prompt_tokens for r in requests),
                   sum(r.num_output_tokens for r in requests), elapsed_s, num_steps, num_preemptions,
                   prefix_hit_rate, statistics.fmean(ttfts) if ttfts else 0.0,
                   statistics.median(ttfts) if ttfts else 0.0, statistics.fmean(tpots) if tpots else 0.0)


class LLM:
    """A model, its KV cache and a scheduler.

    ``model``: a local directory, a Hugging Face hub id (``org/name``: from the local Hugging Face cache, or
    downloaded; see :mod:`tripath.models.hub`) or a preset name (loaded with :func:`tripath.models.load_model`,
    tokenizer with ``load_tokenizer``) or an already built model object (``attention_spec``, ``num_attention_layers``,
    ``config.eos_token_ids``/``max_position``, ``forward(input_ids, positions, ctx)``, ``compute_logits``).
    ``tensor_parallel_size`` > 1 shards the model over that many ranks (``model`` must then be a path or a
    preset; see :mod:`tripath.engine.parallel_executor`); close such an engine with :meth:`close` or a
    ``with`` block to stop its worker processes (garbage collection and interpreter exit also do).
    ``tokenizer``: a tokenizer object, or a tokenizer's directory or hub id, in place of the model's own.
    ``revision``: the hub repository's branch, tag or commit to load (default: main); ``download_dir``: the
    Hugging Face cache to read hub ids from and download them into (default: ``HF_HUB_CACHE``).
    Requests without sampling parameters take :meth:`get_default_sampling_params` (the model's
    ``generation_config.json`` defaults, per ``EngineConfig.generation_config``).
    The engine's settings are an :class:`EngineConfig` (``config=``) or its fields as keyword arguments
    (``LLM("tiny-llama", backend="unified", max_num_seqs=64)``); ``dtype`` defaults to a built model's own.
    On a GPU the constructor returns once every kernel variant is compiled (:mod:`tripath.engine.warmup`);
    ``start_seconds`` is how long it took and :attr:`num_compiled_since_start` counts what compiled later.
    The start ends with a full garbage collection (:func:`gc.collect`), so that the collector's first pass
    over the start's objects does not pause a step. ``detokenize_outputs`` (True): a finished output carries
    its ``text`` and its log-probabilities' ``decoded_token``; a caller that detokenises itself (the server's
    engine core) sets it False, keeping that work off the step loop (``text`` is then None).

    One thread at a time: ``generate``, ``chat``, ``stream`` and the step API (``add_request``, ``step``,
    ``abort_request``) hold the engine's lock (:mod:`tripath.engine.llm_guards`), so calls from several
    threads run one after the other, each whole and with its own results; a thread's call waits while
    another thread's runs. A ``stream`` holds the lock from its first item until it is exhausted or closed.
    """

    def __init__(self, model, *, tokenizer=None, config: EngineConfig | None = None,
                 tensor_parallel_size: int = 1, revision: str | None = None, download_dir: str | None = None,
                 **engine_options):
        if config is not None and engine_options:
            raise TypeError(f"pass either config= or engine options ({', '.join(engine_options)}), not both")
        if config is None:
            if engine_options.get("dtype") is None and not isinstance(model, str):
                engine_options["dtype"] = next(model.parameters()).dtype
            known = set(EngineConfig.__dataclass_fields__)
            unknown = sorted(set(engine_options) - known)
            if unknown:
                raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; EngineConfig has: "
                                f"{', '.join(sorted(known))}")
            config = EngineConfig(**engine_options)
        self.config = config
        start = time.perf_counter()
        self.model_path = None   # the local directory or preset a model given by name loads from
        if isinstance(model, (str, os.PathLike)):
            from tripath.models.hub import resolve_model_path
            model = self.model_path = resolve_model_path(os.fspath(model), revision=revision,
                                                         cache_dir=download_dir)
        if isinstance(tokenizer, (str, os.PathLike)):
            from tripath.models import load_tokenizer
            from tripath.models.hub import resolve_model_path
            tokenizer = load_tokenizer(resolve_model_path(os.fspath(tokenizer), weights=False,
                                                          cache_dir=download_dir))
        self.generation_defaults = load_generation_defaults(
            self.model_path if self.model_path is not None and os.path.isdir(self.model_path) else None,
            config.generation_config)
        self.get_default_sampling_params()   # a default the sampler refuses fails here, naming the field
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tensor_parallel_size!r}")
        self.runner = None
        if tensor_parallel_size > 1:
            from tripath.engine.parallel_executor import ParallelExecutor
            from tripath.models import load_tokenizer
            self.runner = ParallelExecutor(model, self.config, tensor_parallel_size)
            model = self.runner.model
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model)
        elif isinstance(model, str):
            from tripath.models import load_model, load_tokenizer
            model = load_model(model, dtype=self.config.dtype, device=self.config.device)
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(int(t) for t in getattr(model.config, "eos_token_ids", ()) or ())
        if self.runner is None:
            self.runner = ModelRunner(model, self.config)
        self.block_manager = BlockManager(self.runner.num_blocks, self.runner.block_size,
                                          self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=self.config.max_num_seqs,
                                   max_num_batched_tokens=self.config.max_num_batched_tokens,
                                   max_model_len=self.runner.max_model_len,
                                   enable_chunked_prefill=self.config.enable_chunked_prefill,
                                   speculation=self.config.speculative_config)
        speculating = self.config.speculative_config is not None   # verify steps read their drafts' outcome
        self.overlap = self.config.async_scheduling and self.runner.capabilities.overlap and not speculating
        pacing = self.config.step_pacing_s
        if pacing > 0 and self.overlap and self.config.device.type != "cpu":
            raise ValueError("step_time_target_s on a GPU needs async_scheduling=False: with overlapped steps the "
                             "host does not wait for a step, so it cannot time one")
        self._pacer = StepPacer(self.scheduler, pacing) if pacing > 0 else None   # on the CPU a launch computes
        # model steps a step of decodes alone may take (multi-step decoding), where the executor can
        self.decode_steps = self.config.decode_steps if self.runner.capabilities.multi_step and not speculating else 1
        self._inflight: tuple[SchedulerOutput, LaunchedStep] | None = None  # launched, tokens not read yet
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self._engine_lock = EngineLock()
        self.detokenize_outputs = True
        self.num_requests_added = 0
        self.num_steps = 0
        self.step_tokens = StepTokenCounts()   # new tokens per model step, for stats()
        self.last_metrics: RunMetrics | None = None
        self._compiled_at_start = compiled_variants()
        # The start leaves a few hundred thousand objects to the garbage collector (compiled kernels, the
        # warm-up's probes), most of them still young: collected now, the collector's first full pass over
        # them (0.2 s on mha-tp8) does not fall into the first requests' steps.
        gc.collect()
        self.start_seconds = time.perf_counter() - start

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters of requests that pass none: ``SamplingParams()`` with the defaults of the
        model's ``generation_config.json`` (``generation_defaults``, per the ``generation_config`` setting)
        that the engine implements."""
        return SamplingParams(**usable_defaults(self.generation_defaults))

    @property
    def num_compiled_since_start(self) -> int:
        """Kernel variants compiled after the engine was built (0 when the warm-up covered every step)."""
        return compiled_variants() - self._compiled_at_start

    @property
    def backend_name(self) -> str:
        return self.runner.backend.name

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (nothing to do for one rank) and the grammar compiler's
        threads; idempotent."""
        runner = self.__dict__.get("runner")
        if runner is not None:
            runner.close()
        compiler = self.__dict__.get("_grammar_compiler")
        if compiler is not None:
            compiler.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()

    # ---- step API -----------------------------------------------------------------------------------
    @serialised
    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, *, grammar=None) -> str:
        """Queue a prompt (text, with the model's tokenizer, or token ids: a sequence of ints or a 1-D integer
        tensor/array); returns its request id. Nothing is queued when it raises: ``TypeError`` for a prompt
        that is not text or integer ids, ``ValueError`` for an empty prompt, ids outside the vocabulary (in
        the prompt, ``stop_token_ids`` or ``logit_bias``), a request id already queued or running, a structured
        output that does not compile, or a request that could never be served (see :class:`Scheduler`).

        A structured output's grammar is compiled here, in the caller's thread, unless cached or given:
        ``grammar``, the compiled grammar of ``sampling_params.structured_output`` (from
        ``grammar_compiler().submit(...)``, which compiles off the caller's thread)."""
        if sampling_params is not None and isinstance(sampling_params, SamplingParams) and \
                sampling_params.num_choices > 1:
            raise ValueError(f"sampling_params asks for {sampling_params.num_choices} completions (n / best_of): "
                             "the step API runs one completion per request; add one request per completion "
                             "(seed + i for choice i), or use generate()")
        request = self._make_request(prompt, sampling_params, request_id, "prompt", self.num_requests_added,
                                     grammar=grammar)
        self.scheduler.add(request)
        self.num_requests_added += 1
        return request.request_id

    def _make_request(self, prompt: Prompt, sampling_params: SamplingParams | None, request_id: str | None,
                      name: str, number: int, taken: set[str] = frozenset(), grammar=None) -> Request:
        """A validated request (``name`` names the prompt in errors) that :meth:`Scheduler.add` will accept;
        ``taken``: request ids claimed by requests about to be queued with it; ``grammar``: its structured
        output's compiled grammar, when compiled already."""
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TypeError(f"{name} is text: a text prompt needs a tokenizer; this model has none, pass "
                                "token ids")
            encoded = self.tokenizer.encode(prompt)
            text, token_ids = prompt, list(getattr(encoded, "ids", encoded))  # `tokenizers` returns an Encoding
        else:
            text, token_ids = None, prompt
        token_ids = token_ids_of(token_ids, name, getattr(self.model.config, "vocab_size", None))
        check_sampling_token_ids(params, getattr(self.model.config, "vocab_size", None), name)
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
        request = Request(token_ids, params, request_id=request_id, prompt=text, eos_token_ids=self.eos_token_ids)
        self.scheduler.check(request)
        if params.structured_output is not None:
            request.grammar = self.grammar_compiler().state(params.structured_output, grammar)
        if not params.greedy:
            seed = params.seed if params.seed is not None else hash((self.config.seed, number))
            request.generator = make_generator(seed, self.config.device)
        return request

    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler of this engine's tokenizer (built on first use; thread-safe): its
        cache holds ``grammar_cache_mb``, its ``submit`` compiles on its own threads and ``timeout_s`` is
        ``grammar_compile_timeout_s``."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(
                    self.tokenizer, self.runner.logits_width(), self.eos_token_ids,
                    cache_bytes=self.config.grammar_cache_mb << 20, timeout_s=self.config.grammar_compile_timeout_s)
        return self._grammar_compiler

    @serialised
    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False when no such request is queued or running."""
        return self.scheduler.abort(request_id) is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def stats(self) -> EngineStats:
        """The engine's state and cumulative counters now (requests, KV blocks, prefix cache, preemptions,
        steps): see :class:`~tripath.engine.stats.EngineStats`."""
        blocks, scheduler = self.block_manager, self.scheduler
        total = blocks.num_usable_blocks
        return EngineStats(len(scheduler.running), len(scheduler.waiting), total - blocks.num_free_blocks, total,
                           blocks.num_queried_tokens, blocks.num_hit_tokens, scheduler.num_preemptions,
                           self.num_steps, tuple(self.step_tokens.counts), self.step_tokens.total,
                           *scheduler.draft_counts.stats_fields())

    @serialised
    def step(self) -> list[RequestOutput]:
        """One scheduling step and one model run; outputs of the requests that gained a token or finished
        (with overlapped scheduling, in the step launched by the call before this one).

        If the step raises, the requests it scheduled are aborted (their blocks freed) and
        :class:`StepFailed` is raised with their ids; a launched step before it is completed first, its
        outputs carried by the exception. If scheduling itself raises, every running request is aborted and
        named (the waiting ones stay queued). A device out-of-memory error also shrinks the scheduler's token
        budget, so the next steps are smaller. Other requests keep running."""
        previous, self._inflight = self._inflight, None
        try:
            out = self.scheduler.schedule(self.decode_steps)
        except Exception as error:  # noqa: BLE001 - no step was formed: what ran is failed, nothing is lost unseen
            outputs = self._read(previous) if previous is not None else []
            running = [r.request_id for r in list(self.scheduler.running)]
            for request_id in running:
                self.scheduler.abort(request_id)
            raise self._step_failed(error, running, outputs) from None
        if out.is_empty:
            if previous is None:
                if self.scheduler.has_unfinished:
                    raise RuntimeError("the scheduler could not schedule any unfinished request")
                return []
            return self._read(previous)
        early: list[RequestOutput] | None = None
        if self.overlap and previous is not None and any(s.request.grammar is not None for s in out.scheduled):
            early = self._read_before(previous, out)   # the grammars' masks need the previous step's tokens
            out.scheduled = [s for s in out.scheduled if not s.request.is_finished]  # the read ended them
            if not out.scheduled:
                return early
            previous = None   # read: every input token of ``out`` is on the host now
        try:
            started = time.perf_counter()
            launched = self.runner.launch(out.scheduled, None if previous is None else previous[1],
                                          num_steps=out.num_steps)
            if self.overlap:
                self._inflight = (out, launched)
            else:
                sampled = launched.sampled()
            if self._pacer is not None and out.num_steps == 1:
                self._pacer.observe(sum(item.num_new_tokens for item in out.scheduled), time.perf_counter() - started)
        except Exception as error:  # noqa: BLE001 - fails this step's requests only
            outputs = early or []
            try:
                if previous is not None and early is None:
                    outputs = self._read(previous)
            finally:
                failed = self._abort_scheduled(out)
            raise self._step_failed(error, failed, outputs) from None
        except BaseException:
            try:
                if previous is not None and early is None:
                    self._read(previous)
            finally:
                self._abort_scheduled(out)
            raise
        self.num_steps += 1
        self.step_tokens.observe(out.num_tokens, out.num_steps)
        if not self.overlap:
            return self._complete(out, sampled)
        if early is not None:
            return early
        if previous is None:
            return []
        try:
            return self._read(previous)
        except Exception as error:  # noqa: BLE001
            self._inflight = None
            raise self._step_failed(error, self._abort_scheduled(previous[0], out), []) from None
        except BaseException:
            self._inflight = None
            self._abort_scheduled(previous[0], out)
            raise

    def _read_before(self, previous: tuple[SchedulerOutput, LaunchedStep], out: SchedulerOutput
                     ) -> list[RequestOutput] | None:
        """Read ``previous`` before launching ``out`` (a step with structured output). On failure ``out``'s
        requests are aborted too and :class:`StepFailed` names both steps' requests."""
        try:
            return self._read(previous)
        except Exception as error:  # noqa: BLE001
            raise self._step_failed(error, self._abort_scheduled(previous[0], out), []) from None
        except BaseException:
            self._abort_scheduled(previous[0], out)
            raise

    def _step_failed(self, error: Exception, request_ids: list[str], outputs: list[RequestOutput]) -> StepFailed:
        """The :class:`StepFailed` for ``error``: logged with its traceback, whose frames (and the step's
        tensors they hold) are then released; on a device out-of-memory error the token budget shrinks."""
        logger.error("a step failed; its %d requests are aborted:\n%s", len(request_ids),
                     "".join(traceback.format_exception(error)))
        traceback.clear_frames(error.__traceback__)
        if isinstance(error, torch.OutOfMemoryError):
            budget = self.scheduler.shrink_token_budget()
            logger.warning("out of device memory in a step: the scheduler now takes at most %d tokens a step",
                           budget)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return StepFailed(f"the engine step failed: {type(error).__name__}: {error}", request_ids, error, outputs)

    def _read(self, launched: tuple[SchedulerOutput, LaunchedStep]) -> list[RequestOutput]:
        """Wait for a launched step's tokens and complete it."""
        out, step = launched
        return self._complete(out, step.sampled())

    def _complete(self, out: SchedulerOutput, sampled: SampledStep) -> list[RequestOutput]:
        """Hand a finished step's tokens to the scheduler and its log-probabilities to their requests; the
        outputs of the requests that gained a token or finished."""
        before = [item.request.num_output_tokens for item in out.scheduled]
        finished = {id(r) for r in self.scheduler.update(out, sampled.tokens)}
        outputs = []
        for i, (item, count) in enumerate(zip(out.scheduled, before)):
            request = item.request
            new = request.output_token_ids[count:]
            new_logprobs = None
            if sampled.logprobs[i] is not None and request.logprobs is not None:
                new_logprobs = sampled.logprobs[i][:len(new)]   # tokens after a stop are dropped
                request.logprobs.extend(new_logprobs)
                request.cumulative_logprob += sum(entry[token].logprob for token, entry in zip(new, new_logprobs))
            if sampled.prompt_logprobs[i] is not None and request.prompt_logprobs is not None:
                request.prompt_logprobs.extend(sampled.prompt_logprobs[i])
            if new or id(request) in finished:
                text = None
                if request.is_finished and self.detokenize_outputs:
                    text = self.decode(request.output_token_ids)
                    self._decode_logprobs(request)
                outputs.append(RequestOutput.of(request, new, text, new_logprobs))
        return outputs

    def _decode_logprobs(self, request: Request) -> None:
        """Each reported token's text (``Logprob.decoded_token``), once the request has finished."""
        if self.tokenizer is None:
            return
        for entries in (request.logprobs or (), request.prompt_logprobs or ()):
            for entry in entries:
                for token, logprob in (entry or {}).items():
                    if logprob.decoded_token is None:
                        logprob.decoded_token = self.tokenizer.decode([token])

    def _abort_scheduled(self, *outs: SchedulerOutput) -> list[str]:
        """Abort the unfinished requests of ``outs``; their ids."""
        aborted = []
        for out in outs:
            for item in out.scheduled:
                if not item.request.is_finished and self.scheduler.abort(item.request.request_id) is not None:
                    aborted.append(item.request.request_id)
        return aborted

    def memory_report(self) -> str:
        """The GPU memory plan (:mod:`tripath.engine.memory_plan`): weights, KV cache, the reserved worst
        step of each kind, graph pools, headroom, and what was measured at start; on the CPU or with
        ``num_kv_blocks`` set, the cache size alone."""
        plan = getattr(self.runner, "memory_plan", None)
        if plan is not None:
            return plan.summary()
        return (f"KV cache: {self.runner.num_blocks} blocks of {self.runner.block_size} tokens "
                f"({'num_kv_blocks' if self.config.num_kv_blocks else 'the CPU default'}; no GPU memory plan)")

    def stream(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Add ``prompts`` and yield each step's outputs until all of them finish. It holds the engine from
        its first item until it is exhausted or closed: other threads' calls wait meanwhile, so close a stream
        left unfinished (``with contextlib.closing(llm.stream(...))``); closing it, or an exception in a step,
        aborts its unfinished requests."""
        lock = self._engine_lock
        taken = lock.take()
        added: list[str] = []
        try:
            for request in self._make_requests(*self._normalise(prompts, sampling_params)):
                self.scheduler.add(request)
                self.num_requests_added += 1
                added.append(request.request_id)
            while self.has_unfinished_requests():
                for out in self.step():
                    yield out
                    if taken:
                        lock.adopt()   # resumed, perhaps by another thread: its step() calls re-enter
        except BaseException:
            for request_id in added:
                self.scheduler.abort(request_id)
            raise
        finally:
            if taken:
                lock.release()

    def decode(self, token_ids: Sequence[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    # ---- offline ------------------------------------------------------------------------------------
    @serialised
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt; outputs in the prompts' order. Metrics of the run go to ``last_metrics``.

        ``prompts``: one prompt or a list; a prompt is text or token ids (a sequence of ints, or a 1-D integer
        tensor/array). ``sampling_params``: one for all, or one per prompt (default:
        :meth:`get_default_sampling_params`).

        Every prompt is checked before any is queued (see :meth:`add_request`), so a bad one raises alone and
        touches nothing. If a step raises, this run's requests are aborted first: the engine is left idle,
        every block back in the free pool. Calls from several threads run one after the other (see
        :class:`LLM`); ``RuntimeError`` when requests added with :meth:`add_request` are unfinished.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("generate() needs an idle engine: finish or abort the requests added with "
                               "add_request() first")
        prompts, params = self._normalise(prompts, sampling_params)
        params = [self.get_default_sampling_params() if p is None else p for p in params]
        choices = [p.num_choices for p in params]
        batch = self._make_requests([x for x, c in zip(prompts, choices) for _ in range(c)],
                                    [choice for p in params for choice in choice_params(p)], choices=True)
        start = time.perf_counter()
        steps0, preempt0 = self.num_steps, self.scheduler.num_preemptions
        hits0, queried0 = self.block_manager.num_hit_tokens, self.block_manager.num_queried_tokens
        requests = {r.request_id: r for r in batch}
        ids = list(requests)
        finished: dict[str, RequestOutput] = {}
        try:
            for request in batch:
                self.scheduler.add(request)
                self.num_requests_added += 1
            with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm, dynamic_ncols=True) as bar:
                while self.has_unfinished_requests():
                    for out in self.step():
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update(1)
                    elapsed = time.perf_counter() - start
                    produced = sum(r.num_output_tokens for r in requests.values())
                    bar.set_postfix_str(f"{produced / max(elapsed, 1e-9):.1f} output tok/s", refresh=False)
        except BaseException:
            for request_id in ids:
                self.scheduler.abort(request_id)
            raise
        elapsed = time.perf_counter() - start
        queried = self.block_manager.num_queried_tokens - queried0
        hit_rate = (self.block_manager.num_hit_tokens - hits0) / queried if queried else 0.0
        self.last_metrics = RunMetrics.of(list(requests.values()), elapsed, self.num_steps - steps0,
                                          self.scheduler.num_preemptions - preempt0, hit_rate)
        results, at = [], 0
        for p, c in zip(params, choices):
            results.append(group_choices([finished[i] for i in ids[at:at + c]], p))
            at += c
        return results

    def _make_requests(self, prompts: list[Prompt], params: list[SamplingParams], choices: bool = False
                       ) -> list[Request]:
        """Validated requests for ``prompts`` (the first bad one raises, naming ``prompts[i]``), nothing queued.
        ``choices``: the params are already one completion each (:func:`choice_params`)."""
        if not choices:
            many = next((i for i, p in enumerate(params) if p.num_choices > 1), None)
            if many is not None:
                raise ValueError(f"sampling_params[{many}] asks for {params[many].num_choices} completions (n / "
                                 "best_of): only generate() and chat() fan a prompt out; add one request per "
                                 "completion here")
        batch: list[Request] = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            batch.append(self._make_request(prompt, sp, None, f"prompts[{i}]", self.num_requests_added + i,
                                            {r.request_id for r in batch}))
        return batch

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, use_tqdm: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Complete chat conversations through the tokenizer's chat template (see :mod:`tripath.engine.chat`).

        ``messages``: one conversation (a list of ``{"role", "content"}`` dicts) or a list of them; outputs in
        their order, as :meth:`generate`. ``chat_template``: a Jinja template (or a file holding one) in place
        of the tokenizer's. Raises :class:`~tripath.engine.chat.ChatTemplateError` (a ``ValueError``) when the
        model has no tokenizer, or neither ``chat_template`` nor the tokenizer has a template.
        """
        from tripath.engine.chat import chat_token_ids, load_chat_template

        template = load_chat_template(chat_template) if chat_template is not None else None
        if isinstance(messages, Sequence) and messages and isinstance(messages[0], dict):
            messages = [messages]
        prompts = [chat_token_ids(self.tokenizer, conversation, add_generation_prompt, chat_template=template)
                   for conversation in messages]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    @staticmethod
    def _normalise(prompts, sampling_params) -> tuple[list[Prompt], list[SamplingParams]]:
        """``(prompts, params)`` as equal-length lists: one prompt (text, a flat sequence of numbers, a 1-D
        tensor/array) becomes a list of one; ``sampling_params`` one for all or one per prompt."""
        if isinstance(prompts, (torch.Tensor, np.ndarray)):
            prompts = [prompts] if prompts.ndim == 1 else list(prompts)
        elif isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and not any(
                isinstance(t, (str, bytes, Sequence, torch.Tensor, np.ndarray)) for t in prompts)):
            prompts = [prompts]
        elif not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts is empty")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)   # None: the engine's defaults (_make_request)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        return prompts, params
