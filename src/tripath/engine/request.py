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
import itertools
import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch


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
    """How to pick each next token.

    ``temperature`` 0 is greedy (argmax); otherwise logits are divided by it, cut to the ``top_k`` most
    likely tokens (``-1`` or 0 = all) and to the smallest set whose probability reaches ``top_p``, and sampled
    with a per-request generator (seeded by ``seed``, or by the engine's seed and the request's number), so a
    request's tokens do not depend on what else is in the batch. Generation stops after ``max_tokens``, at an
    end-of-sequence token of the model (unless ``ignore_eos``) or at any of ``stop_token_ids``. Every field is
    range-checked against what the sampler holds: ``top_k``, ``max_tokens`` and stop ids fit in int64,
    ``seed`` in ``[-2**63, 2**63 - 1]`` (distinct seeds give distinct generators), ``temperature`` <= 1e30.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX:
            raise ValueError(f"max_tokens must be an int in [1, 2**63 - 1], got {self.max_tokens!r}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be finite and in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got "
                             f"{self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1   # the sampler's int64 tensors and 64-bit generator seeds
MAX_TEMPERATURE = 1e30   # logits are divided by it in float32


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

    def __post_init__(self):
        self.prompt_token_ids = token_ids_of(self.prompt_token_ids, "prompt_token_ids")
        if not self.request_id:
            self.request_id = str(self.index)

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
        """Record a sampled token and finish the request when it hits a stop condition."""
        now = time.perf_counter() if now is None else now
        if self.first_token_time is None:
            self.first_token_time = now
        self.output_token_ids.append(int(token_id))
        params = self.sampling_params
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            self.finish(FinishReason.STOP, now)
        elif self.num_output_tokens >= params.max_tokens:
            self.finish(FinishReason.LENGTH, now)

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
class RequestOutput:
    """What the engine reports about a request after a step (and, finished, at the end of ``generate``).

    ``output_token_ids`` are all outputs so far and ``new_token_ids`` the ones this step added (streaming).
    ``text`` is the decoded output once the request has finished (None without a tokenizer).
    ``prompt_token_ids`` is the request's own list (not a copy: streaming steps report thousands of
    requests a second); treat it as read-only.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    text: str | None = None
    ttft: float | None = None
    tpot: float | None = None
    num_preemptions: int = 0

    @classmethod
    def of(cls, request: Request, new_token_ids: Sequence[int] = (), text: str | None = None) -> "RequestOutput":
        return cls(request.request_id, request.prompt, request.prompt_token_ids,
                   list(request.output_token_ids), list(new_token_ids), request.is_finished,
                   request.finish_reason, text, request.ttft, request.tpot, request.num_preemptions)
