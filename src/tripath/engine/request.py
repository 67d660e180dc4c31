"""Requests as the engine tracks them: sampling parameters, token state, timings, and the results it returns.

A request's tokens are ``prompt_token_ids + output_token_ids``, then ``num_inflight_tokens`` (0 or 1) that a
launched step is sampling and the engine has not read back yet (overlapped scheduling). ``num_computed_tokens``
of them have their K/V in the paged cache, or in a step already launched (the blocks listed in
``block_ids``, block ``i`` holding positions ``i * block_size .. (i + 1) * block_size - 1``). A step feeds
``num_new_tokens`` more; when they reach the end of the sequence the step's last logits give the next token.
Preemption by recompute frees the blocks and resets ``num_computed_tokens`` to 0 while keeping the outputs,
so the request later re-prefills ``prompt + outputs`` and continues exactly where it stopped.
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch

from tripath.engine.structured_output import GrammarState, StructuredOutput


def token_ids_of(prompt, name: str = "prompt", vocab_size: int | None = None) -> list[int]:
    """``prompt`` as a list of Python ints: a sequence of integers (``int``, numpy integers; not ``bool``,
    not floats), or a 1-D integer ``torch.Tensor`` / ``numpy.ndarray``. Raises ``TypeError`` for other types
    and ``ValueError`` for an empty prompt or (with ``vocab_size``) ids outside ``[0, vocab_size)``; the
    message names ``name``."""
    if isinstance(prompt, (torch.Tensor, np.ndarray)):
        kind = "tensor" if isinstance(prompt, torch.Tensor) else "array"
        integer = (not prompt.dtype.is_floating_point and not prompt.dtype.is_complex
                   and prompt.dtype != torch.bool) if kind == "tensor" else np.issubdtype(prompt.dtype, np.integer)
        if prompt.ndim != 1 or not integer:
            raise TypeError(f"{name} as a {kind} must be 1-D with an integer dtype, got shape "
                            f"{tuple(prompt.shape)} and dtype {prompt.dtype}")
        ids = [int(t) for t in prompt.tolist()]
    elif isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        raise TypeError(f"{name} must be a sequence of integer token ids (or a 1-D integer tensor/array), got "
                        f"{type(prompt).__name__}")
    elif all(type(t) is int for t in prompt):  # the common case, checked at C speed
        ids = list(prompt)
    else:
        ids = []
        for i, t in enumerate(prompt):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
                raise TypeError(f"{name}[{i}] must be an integer token id, got {type(t).__name__} {t!r}")
            ids.append(int(t))
    if not ids:
        raise ValueError(f"{name} is empty: a prompt needs at least one token")
    if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(i for i, t in enumerate(ids) if not 0 <= t < vocab_size)
        raise ValueError(f"{name}[{bad}] = {ids[bad]} is outside the vocabulary [0, {vocab_size})")
    return ids


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and what to report beside it.

    The sampler transforms a row of logits in this order (as vLLM does): ``min_tokens`` bans the stop tokens
    (the model's end-of-sequence ids and ``stop_token_ids``) while fewer outputs exist; ``logit_bias`` adds
    its values; ``repetition_penalty`` ``r`` divides the positive and multiplies the negative logits of tokens
    seen in the prompt or the outputs; ``frequency_penalty`` subtracts ``f * count`` and ``presence_penalty``
    ``p * (count > 0)`` for each token's count among the outputs. Then ``temperature`` 0 is greedy (argmax);
    otherwise logits are divided by it, cut to the tokens at least ``min_p`` times as likely as the most likely
    one, to the ``top_k`` most likely tokens (``-1`` or 0 = all) and to the smallest set whose probability
    reaches ``top_p``, and sampled with a per-request generator (seeded by
    ``seed``, or by the engine's seed and the request's number), so a request's tokens do not depend on what
    else is in the batch. Generation stops after ``max_tokens``, at an end-of-sequence token of the model
    (unless ``ignore_eos``) or at any of ``stop_token_ids`` (neither before ``min_tokens``).

    ``structured_output`` (:class:`~tripath.engine.structured_output.StructuredOutput`): the tokens are
    constrained to a JSON schema, a regular expression, a choice of strings or a grammar; the disallowed
    tokens' logits are ``-inf`` before everything above.

    ``logprobs`` ``k``: each output token's log-probability with its rank, and the ``k`` most likely tokens
    (0: the sampled token alone); ``prompt_logprobs`` ``k``: the same for every prompt token after the first
    (the first has none). Log-probabilities are ``log_softmax`` of the model's logits in float32, before any
    of the transforms above. At most :data:`MAX_LOGPROBS`. ``n`` (``LLM.generate`` only): independent
    completions of the prompt, choice ``i`` seeded ``seed + i``; ``best_of`` >= ``n``: that many are generated
    and the ``n`` of highest cumulative log-probability returned.

    Every field is range-checked against what the sampler holds: ``top_k``, ``max_tokens`` and token ids fit
    in int64, ``seed`` in ``[-2**63, 2**63 - 1]`` (distinct seeds give distinct generators), ``temperature``
    <= 1e30, ``repetition_penalty`` in [1e-30, 1e30], the other penalties in [-2, 2], ``logit_bias`` values
    in [-1e8, 1e8]. The sampler computes in float32: with these bounds no transform of a logit up to 1e8 in
    size overflows to inf (which would turn the softmax into NaN), whereas a ``repetition_penalty`` of
    1e-300 would be 0 in float32 and 1e-40 would overflow a logit of 10 divided by it. A temperature or
    ``top_p`` that is 0 in float32 samples the most likely token, as the smallest positive values do.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    best_of: int | None = None
    structured_output: StructuredOutput | None = None

    def __post_init__(self):
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX:
            raise ValueError(f"max_tokens must be an int in [1, 2**63 - 1], got {self.max_tokens!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be finite and in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got "
                             f"{self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT64_MAX:
            raise ValueError(f"top_k must be an int in [1, 2**63 - 1], or -1 / 0 for no limit, got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise TypeError(f"seed must be an int or None, got {type(self.seed).__name__}")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise ValueError(f"seed must be in [-2**63, 2**63 - 1] (a 64-bit generator seed), got {self.seed}")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise TypeError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")
        stop = self.stop_token_ids
        stop = [stop] if _is_int(stop) else stop
        stop = tuple(token_ids_of(stop, "stop_token_ids")) if stop else ()
        bad = next((t for t in stop if not 0 <= t <= INT64_MAX), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids must be in [0, 2**63 - 1], got {bad}")
        object.__setattr__(self, "stop_token_ids", stop)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens ({self.max_tokens})], got "
                             f"{self.min_tokens!r}")
        if not (math.isfinite(self.repetition_penalty) and
                MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] "
                             f"(1 = off; the sampler divides logits by it in float32), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {value}")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n must be an int in [1, {MAX_CHOICES}], got {self.n!r}")
        if self.best_of is not None and (not _is_int(self.best_of) or not self.n <= self.best_of <= MAX_CHOICES):
            raise ValueError(f"best_of must be None or an int in [n ({self.n}), {MAX_CHOICES}], got {self.best_of!r}")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise TypeError(f"structured_output must be a StructuredOutput, got "
                            f"{type(self.structured_output).__name__}")
        if self.seed is not None and self.seed + self.num_choices - 1 > INT64_MAX:
            raise ValueError(f"seed + best_of - 1 must fit in a signed 64-bit integer (choice i draws with seed + i), "
                             f"got seed {self.seed} with {self.num_choices} choices")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def num_choices(self) -> int:
        """Completions generated for the prompt: ``best_of`` if set, else ``n``."""
        return self.best_of if self.best_of is not None else self.n

    @functools.cached_property
    def transforms_logits(self) -> bool:
        """Whether the sampler changes this request's logits before temperature (penalties, bias, min_tokens)."""
        return (self.min_tokens > 0 or bool(self.logit_bias) or self.has_penalties)

    @functools.cached_property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def _logit_bias(bias) -> dict[int, float] | None:
    """``logit_bias`` as ``{token id: finite float}`` (None when empty); raises naming the bad entry."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise TypeError(f"logit_bias must be a mapping of token id to bias, got {type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS}")
    out = {}
    for token, value in bias.items():
        if not _is_int(token) or not 0 <= token <= INT64_MAX:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not (
                math.isfinite(value) and abs(value) <= MAX_LOGIT_BIAS_VALUE):
            raise ValueError(f"logit_bias[{token}] must be a number in [{-MAX_LOGIT_BIAS_VALUE:g}, "
                             f"{MAX_LOGIT_BIAS_VALUE:g}], got {value!r}")
        out[int(token)] = float(value)
    return out or None


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1   # the sampler's int64 tensors and 64-bit generator seeds
MAX_TEMPERATURE = 1e30   # logits are divided by it in float32
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-30, 1e30   # positive logits / r, negative ones * r, in float32
MAX_LOGIT_BIAS_VALUE = 1e8   # |bias|: (logit + bias) / MIN_REPETITION_PENALTY stays below float32's 3.4e38
MAX_LOGPROBS = 20        # most likely tokens reported per position (vLLM's default max_logprobs)
MAX_CHOICES = 64         # n and best_of
MAX_LOGIT_BIAS = 1024    # entries of logit_bias


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # queued, or preempted and waiting to be recomputed
    RUNNING = "running"      # holds KV blocks and is scheduled every step
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"        # max_tokens reached
    STOP = "stop"            # an end-of-sequence or stop token was sampled
    ABORTED = "aborted"      # the caller aborted it
    ERROR = "error"          # it cannot go on (``Request.error`` says why): the token sampled was dropped


_request_counter = itertools.count()


@dataclass(eq=False)
class Request:
    """One generation request and its progress (owned by the scheduler)."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    request_id: str = ""
    prompt: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_inflight_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)   # chained hashes of the leading full blocks
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    index: int = field(default_factory=lambda: next(_request_counter))
    logprobs: list[PositionLogprobs] | None = None           # per output token, when sampling_params.logprobs
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # per prompt token, when prompt_logprobs
    cumulative_logprob: float | None = None                  # with logprobs: the sum over the output tokens
    grammar: GrammarState | None = None                      # with structured_output: its matcher
    error: str | None = None                                 # why it finished with FinishReason.ERROR

    def __post_init__(self):
        self.prompt_token_ids = token_ids_of(self.prompt_token_ids, "prompt_token_ids")
        if not self.request_id:
            self.request_id = str(self.index)
        if self.sampling_params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]   # the first prompt token has no log-probability

    @property
    def num_prompt_logprobs_done(self) -> int:
        """Prompt positions whose next token's log-probability is recorded (the prefix cache may serve
        those, and only those, when the request is admitted again)."""
        return 0 if self.prompt_logprobs is None else len(self.prompt_logprobs) - 1

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"outputs={self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={self.block_ids})")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens, in-flight ones included, whose K/V no step has computed yet (1 for a decode)."""
        return self.num_tokens + self.num_inflight_tokens - self.num_computed_tokens

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens ``start .. stop - 1`` of ``prompt + outputs``."""
        prompt = self.prompt_token_ids
        if stop <= len(prompt):
            return prompt[start:stop]
        if start >= len(prompt):
            return self.output_token_ids[start - len(prompt):stop - len(prompt)]
        return prompt[start:] + self.output_token_ids[:stop - len(prompt)]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int, now: float | None = None) -> None:
        """Record a sampled token and finish the request when it hits a stop condition. A token its structured
        output's grammar does not allow (the request's other settings left the grammar no token, e.g.
        ``min_tokens`` past where the grammar must end) is not recorded: the request finishes with
        :attr:`FinishReason.ERROR` and :attr:`error` says why."""
        now = time.perf_counter() if now is None else now
        if self.first_token_time is None:
            self.first_token_time = now
        if self.grammar is not None and not self.grammar.accept(token_id):
            self.error = self._grammar_error(int(token_id))
            self.finish(FinishReason.ERROR, now)
            return
        self.output_token_ids.append(int(token_id))
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens and (token_id in params.stop_token_ids or (
                not params.ignore_eos and token_id in self.eos_token_ids)):
            self.finish(FinishReason.STOP, now)
        elif self.num_output_tokens >= params.max_tokens:
            self.finish(FinishReason.LENGTH, now)

    def _grammar_error(self, token_id: int) -> str:
        params = self.sampling_params
        why = ""
        if self.num_output_tokens < params.min_tokens:
            why = (f"; min_tokens ({params.min_tokens}) keeps the end of the sequence out where the grammar "
                   "must end")
        return (f"the structured output's grammar does not allow token {token_id} at output position "
                f"{self.num_output_tokens}: the request's settings left no allowed token to sample{why}")

    def finish(self, reason: FinishReason, now: float | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.perf_counter() if now is None else now

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first output token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (None with fewer than two outputs)."""
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class Logprob:
    """One token's log-probability at a position, its 1-based rank among the vocabulary (1: the most
    likely) and its text (set when the request finishes, with a tokenizer)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]   # token id -> Logprob: the chosen token and the top-k of one position


@dataclass
class CompletionOutput:
    """One completion of a prompt (as vLLM's): ``token_ids`` so far, ``text`` (decoded once finished; None
    without a tokenizer), ``logprobs`` one :data:`PositionLogprobs` per token when asked for, the sum of the
    chosen tokens' log-probabilities (``cumulative_logprob``, None when not asked for), and ``finish_reason``
    (None while running; ``error`` says why for :attr:`FinishReason.ERROR`)."""

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None   # with finish_reason ERROR: why

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What the engine reports about a request after a step (and, finished, at the end of ``generate``), in
    vLLM's shape: ``outputs[i]`` is completion ``i`` (one per engine request; ``LLM.generate`` with
    ``SamplingParams(n=...)`` groups them). ``prompt_logprobs``: ``[None, {...}, ...]``, one entry per prompt
    token when asked for.

    ``new_token_ids`` are the tokens this step added to ``outputs[0]`` (streaming) and ``new_logprobs`` their
    log-probabilities. ``prompt_token_ids`` is the request's own list (not a copy: streaming steps report
    thousands of requests a second); treat it as read-only. ``text``, ``output_token_ids`` and
    ``finish_reason`` are shortcuts to ``outputs[0]``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    ttft: float | None = None
    tpot: float | None = None
    num_preemptions: int = 0

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def output_token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason

    @classmethod
    def of(cls, request: Request, new_token_ids: Sequence[int] = (), text: str | None = None,
           new_logprobs: list[PositionLogprobs] | None = None) -> "RequestOutput":
        """The output of ``request`` after a step that added ``new_token_ids`` (and ``new_logprobs``)."""
        completion = CompletionOutput(0, text, list(request.output_token_ids), request.cumulative_logprob,
                                      None if request.logprobs is None else list(request.logprobs),
                                      request.finish_reason, request.error)
        return cls(request.request_id, request.prompt, request.prompt_token_ids, [completion], request.is_finished,
                   list(new_token_ids), new_logprobs, request.prompt_logprobs, request.ttft, request.tpot,
                   request.num_preemptions)
