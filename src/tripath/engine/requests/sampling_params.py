"""What a request asks of the sampler (:class:`SamplingParams`, validated on construction: each error names the
field and what is allowed) and a prompt's token ids (:func:`token_ids_of`)."""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from tripath.engine.requests.structured_output import StructuredOutput


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


def check_sampling_token_ids(params, vocab_size: int | None, name: str = "prompt") -> None:
    """Raise ``ValueError`` when ``params.stop_token_ids`` or a ``params.logit_bias`` key is outside
    ``[0, vocab_size)``, naming the field, the id and the vocabulary size (``name``: whose parameters, in the
    message). Nothing to check without a known ``vocab_size``."""
    if vocab_size is None:
        return
    for field, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ())):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"sampling_params.{field} for {name} holds token id {bad}, outside the model's "
                             f"vocabulary [0, {vocab_size}) of {vocab_size} tokens")


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

    ``structured_output`` (:class:`~tripath.engine.requests.structured_output.StructuredOutput`): the tokens are
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
    def plain_temperature(self) -> bool:
        """Whether the tokens are drawn from ``softmax(logits / temperature)`` with nothing cut (no top-k, top-p
        or min-p): such rows are drawn by Gumbel-max with counter-based noise (:mod:`tripath.engine.sampling.sampler`)."""
        return not self.greedy and self.top_k < 1 and self.top_p == 1 and self.min_p == 0

    @functools.cached_property
    def full_logits_reason(self) -> str | None:
        """Why a row of this request needs its whole row of logits, or None where its token can be drawn
        straight from the LM head (:mod:`tripath.engine.sampling.fused_sampling`): greedy or a plain temperature, no
        penalties, ``logit_bias``, ``min_tokens`` or structured output, no log-probabilities but a greedy
        token's own (its rank is 1; a sampled token's rank needs every logit)."""
        if self.structured_output is not None:
            return "structured output"
        if self.transforms_logits:
            return "penalties, logit_bias or min_tokens"
        if not self.greedy and not self.plain_temperature:
            return "top-k, top-p or min-p"
        if self.logprobs is not None and (self.logprobs > 0 or not self.greedy):
            return "log-probabilities beyond a greedy token's own"
        return None

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
