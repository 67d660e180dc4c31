"""The offline front door: :class:`LLM` — ``generate``, ``chat``, ``stream``, a step API, run metrics — over
an :class:`~tripath.engine.core.engine_core.EngineCore` (the model, its KV cache, the scheduler and the executor).

::

    llm = LLM("tiny-llama", num_kv_blocks=256)
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    llm.last_metrics            # throughput, TTFT, TPOT of that run

    rid = llm.add_request([1, 2, 3], SamplingParams(max_tokens=8))   # step by step: add, then step
    while llm.has_unfinished_requests():
        for out in llm.step(): ...   # out.new_token_ids, out.finished

    with LLM("/models/Qwen3-32B", tensor_parallel_size=2) as llm:   # ranks 1.. in spawned workers
        outs = llm.generate(prompts)

What ``LLM`` adds to the core: text prompts (the tokenizer), ``n`` / ``best_of`` fan-out and grouping,
progress bars and :class:`RunMetrics`, one thread at a time (:mod:`tripath.engine.llm_guards`), and
:class:`~tripath.engine.errors.StepFailed` raised for a step that failed (the core reports it in its
:class:`~tripath.engine.core.engine_core.StepResult`). The core's parts stay readable here (``llm.scheduler``,
``llm.runner``, ``llm.block_manager``, ``llm.config``, ...) for tests and tools; a server drives the core
itself (:attr:`LLM.core`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from tripath.engine.config import EngineConfig
from tripath.engine.core.engine_core import EngineCore
from tripath.engine.errors import StepFailed
from tripath.engine.llm_guards import EngineLock, serialised
from tripath.engine.requests.request import Request, RequestOutput
from tripath.engine.requests.sampling_params import SamplingParams
from tripath.engine.requests.structured_output import GrammarCompiler
from tripath.engine.sampling.choices import choice_params, group_choices
from tripath.engine.scheduling.stats import EngineStats

Prompt = str | Sequence[int]


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




def _core_attribute(name: str, doc: str, settable: bool = False) -> property:
    """A read (or read-write) view of the core's attribute ``name``."""
    def get(self):
        return getattr(self.core, name)

    def set_(self, value):
        setattr(self.core, name, value)

    return property(get, set_ if settable else None, doc=doc)


class LLM:
    """A model, its KV cache and a scheduler (an :class:`~tripath.engine.core.engine_core.EngineCore`, :attr:`core`),
    offline.

    ``model``: a local directory, a Hugging Face hub id (``org/name``: from the local Hugging Face cache, or
    downloaded; see :mod:`tripath.models.hub`) or a preset name (loaded with :func:`tripath.models.load_model`,
    tokenizer with ``load_tokenizer``) or an already built model object (``attention_spec``, ``num_attention_layers``,
    ``config.eos_token_ids``/``max_position``, ``forward(input_ids, positions, ctx)``, ``compute_logits``).
    ``tensor_parallel_size`` > 1 shards the model over that many ranks (``model`` must then be a path or a
    preset; see :mod:`tripath.engine.runner.parallel_executor`); close such an engine with :meth:`close` or a
    ``with`` block to stop its worker processes (garbage collection and interpreter exit also do).
    ``tokenizer``: a tokenizer object, or a tokenizer's directory or hub id, in place of the model's own.
    ``revision``: the hub repository's branch, tag or commit to load (default: main); ``download_dir``: the
    Hugging Face cache to read hub ids from and download them into (default: ``HF_HUB_CACHE``).
    Requests without sampling parameters take :meth:`get_default_sampling_params` (the model's
    ``generation_config.json`` defaults, per ``EngineConfig.generation_config``).
    The engine's settings are an :class:`EngineConfig` (``config=``) or its fields as keyword arguments
    (``LLM("tiny-llama", backend="unified", max_num_seqs=64)``); ``dtype`` defaults to a built model's own.
    On a GPU the constructor returns once every kernel variant is compiled (:mod:`tripath.engine.runner.warmup`);
    ``start_seconds`` is how long it took and :attr:`num_compiled_since_start` counts what compiled later.
    The start ends with a full garbage collection (:func:`gc.collect`), so that the collector's first pass
    over the start's objects does not pause a step. ``detokenize_outputs`` (True): a finished output carries
    its ``text`` and its log-probabilities' ``decoded_token`` (False: ``text`` is None).

    One thread at a time: ``generate``, ``chat``, ``stream`` and the step API (``add_request``, ``step``,
    ``abort_request``) hold the engine's lock (:mod:`tripath.engine.llm_guards`), so calls from several
    threads run one after the other, each whole and with its own results; a thread's call waits while
    another thread's runs. A ``stream`` holds the lock from its first item until it is exhausted or closed.
    """

    def __init__(self, model, *, tokenizer=None, config: EngineConfig | None = None,
                 tensor_parallel_size: int = 1, revision: str | None = None, download_dir: str | None = None,
                 **engine_options):
        self._engine_lock = EngineLock()
        self.last_metrics: RunMetrics | None = None
        self.core = EngineCore(model, tokenizer=tokenizer, config=config, tensor_parallel_size=tensor_parallel_size,
                               revision=revision, download_dir=download_dir, **engine_options)

    config = _core_attribute("config", "The engine's :class:`EngineConfig`.")
    model = _core_attribute("model", "The model (rank 0's shard under tensor parallelism).")
    model_path = _core_attribute("model_path", "The local directory or preset a model given by name loads from.")
    tokenizer = _core_attribute("tokenizer", "The model's tokenizer (None without one).", settable=True)
    eos_token_ids = _core_attribute("eos_token_ids", "The model's end-of-sequence token ids.")
    generation_defaults = _core_attribute("generation_defaults", "The model's ``generation_config.json`` values.")
    runner = _core_attribute("runner", "The executor (``ModelRunner``, or ``ParallelExecutor`` over ranks).")
    scheduler = _core_attribute("scheduler", "The :class:`~tripath.engine.scheduling.scheduler.Scheduler`.")
    block_manager = _core_attribute("block_manager",
                                    "The :class:`~tripath.engine.scheduling.block_manager.BlockManager`.")
    overlap = _core_attribute("overlap", "Whether steps overlap (``async_scheduling`` where the executor can).")
    decode_steps = _core_attribute("decode_steps", "Model steps a step of decodes alone may take.", settable=True)
    detokenize_outputs = _core_attribute("detokenize", "Whether finished outputs carry their text.", settable=True)
    num_steps = _core_attribute("num_steps", "Steps run since start.")
    step_tokens = _core_attribute("step_tokens", "New tokens per model step (``StepTokenCounts``).")
    num_requests_added = _core_attribute("num_requests_added", "Requests queued since start.")
    start_seconds = _core_attribute("start_seconds", "How long the engine took to build (warm-up included).")
    backend_name = _core_attribute("backend_name", "The attention backend's name.")
    num_compiled_since_start = _core_attribute(
        "num_compiled_since_start", "Kernel variants compiled after the engine was built (0 when the warm-up "
        "covered every step).")

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters of requests that pass none: ``SamplingParams()`` with the defaults of the
        model's ``generation_config.json`` (``generation_defaults``, per the ``generation_config`` setting)
        that the engine implements."""
        return self.core.default_sampling_params()

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (nothing to do for one rank) and the grammar compiler's
        threads; idempotent."""
        core = self.__dict__.get("core")
        if core is not None:
            core.close()

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
        text, token_ids = self._prompt_ids(prompt, "prompt")
        return self.core.add_request(token_ids, sampling_params, request_id, grammar=grammar, prompt_text=text)

    def _prompt_ids(self, prompt: Prompt, name: str) -> tuple[str | None, object]:
        """``(text, token ids)`` of a prompt: text encoded with the tokenizer (``TypeError`` without one,
        ``name`` naming the prompt), token ids as given (the core checks them)."""
        if not isinstance(prompt, str):
            return None, prompt
        if self.tokenizer is None:
            raise TypeError(f"{name} is text: a text prompt needs a tokenizer; this model has none, pass token ids")
        encoded = self.tokenizer.encode(prompt)
        return prompt, list(getattr(encoded, "ids", encoded))   # `tokenizers` returns an Encoding

    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler of this engine's tokenizer (built on first use; thread-safe): its
        cache holds ``grammar_cache_mb``, its ``submit`` compiles on its own threads and ``timeout_s`` is
        ``grammar_compile_timeout_s``."""
        return self.core.grammar_compiler()

    @serialised
    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False when no such request is queued or running."""
        return self.core.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def stats(self) -> EngineStats:
        """The engine's state and cumulative counters now (requests, KV blocks, prefix cache, preemptions,
        steps): see :class:`~tripath.engine.scheduling.stats.EngineStats`."""
        return self.core.stats()

    @serialised
    def step(self) -> list[RequestOutput]:
        """One scheduling step and one model run; outputs of the requests that gained a token or finished
        (with overlapped scheduling, in the step launched by the call before this one).

        If the step fails (:class:`~tripath.engine.core.engine_core.StepResult`'s ``failure``), the requests it scheduled
        are aborted (their blocks freed) and :class:`StepFailed` is raised with their ids; a launched step
        before it is completed first, its outputs carried by the exception. If scheduling itself raises,
        every running request is aborted and named (the waiting ones stay queued). A device out-of-memory
        error also shrinks the scheduler's token budget, so the next steps are smaller. Other requests keep
        running."""
        result = self.core.step()
        failure = result.failure
        if failure is not None:
            raise StepFailed(failure.message, list(failure.request_ids), failure.error, result.outputs) from None
        return result.outputs

    def memory_report(self) -> str:
        """The GPU memory plan (:mod:`tripath.engine.runner.memory_plan`): weights, KV cache, the reserved worst
        step of each kind, graph pools, headroom, and what was measured at start; on the CPU or with
        ``num_kv_blocks`` set, the cache size alone."""
        return self.core.memory_report()

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
                self.core.add(request)
                added.append(request.request_id)
            while self.has_unfinished_requests():
                for out in self.step():
                    yield out
                    if taken:
                        lock.adopt()   # resumed, perhaps by another thread: its step() calls re-enter
        except BaseException:
            for request_id in added:
                self.core.abort(request_id)
            raise
        finally:
            if taken:
                lock.release()

    def decode(self, token_ids: Sequence[int]) -> str | None:
        """``token_ids`` as text (special tokens skipped); None without a tokenizer."""
        return self.core.decode(token_ids)

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
                self.core.add(request)
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
                self.core.abort(request_id)
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
            name = f"prompts[{i}]"
            text, token_ids = self._prompt_ids(prompt, name)
            batch.append(self.core.make_request(token_ids, sp, None, prompt_text=text, name=name,
                                                number=self.num_requests_added + i,
                                                taken={r.request_id for r in batch}))
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
