"""The OpenAI HTTP API's request and response bodies (the subset the server implements), as pydantic models.

Requests follow vLLM's schema policy: a field the server does not know is accepted and ignored (and logged
once per field name), so clients written for vLLM or OpenAI keep working. Beyond OpenAI's fields the server
takes ``top_k``, ``ignore_eos``, ``stop_token_ids`` and ``chat_template_kwargs``; ``stop`` may hold strings
or token ids. Fields of the API that the engine does not implement are accepted only at their neutral values
(``presence_penalty`` 0, ``logprobs`` off, ``echo`` false, ``tool_choice`` "none" / "auto", ...), and
anything else is a 400 naming them. Response choices carry the generated ``token_ids`` as well as the text.

Types are strict: a number is a JSON number (``"3"`` is no integer, ``true`` no 1), a flag a JSON boolean.
Every numeric field has a range the engine holds (64-bit integers for ``seed`` and ``top_k``), every list a
length cap and every short string a size cap (the ``MAX_*`` constants below; the request body as a whole is
capped by the server's ``--max-request-bytes``).
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

log = logging.getLogger("tripath.server")

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_STOP_STRINGS = 32          # OpenAI takes 4
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
MAX_PROMPTS = 1024             # prompts in one completions request
MAX_CHOICES = 64               # n
MAX_MESSAGES = 4096
MAX_NAME_CHARS = 1024          # model, user, message names and ids
MAX_LOGIT_BIAS = 1024
MAX_TEMPERATURE = 1e30         # the sampler divides float32 logits by it

Int = StrictInt
Float = Union[StrictInt, StrictFloat]   # a JSON number (an integer is a float too), never a string or a bool
Bool = StrictBool
Name = Annotated[StrictStr, Field(max_length=MAX_NAME_CHARS)]
TokenId = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]
StopString = Annotated[StrictStr, Field(max_length=MAX_STOP_STRING_CHARS)]

_logged_unknown: set[str] = set()


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_unknown_fields(self):
        for name in self.model_extra or ():
            key = f"{type(self).__name__}.{name}"
            if key not in _logged_unknown and len(_logged_unknown) < 1024:
                _logged_unknown.add(key)
                log.warning("ignoring the unknown request field %r of %s (logged once)", name[:64],
                            type(self).__name__)
        return self


class StreamOptions(_Request):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False


def _finite(name: str, value: float | None, low: float, high: float) -> None:
    if value is not None and not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{name} must be a finite number in [{low:g}, {high:g}], got {value}")


class _SamplingRequest(_Request):
    model: Name
    # None = unset: the model's default (generation_config.json), else the engine's (server.sampling_defaults)
    max_tokens: Annotated[Int, Field(ge=1, le=INT64_MAX)] | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Annotated[Int, Field(ge=-1, le=INT64_MAX)] | None = None
    repetition_penalty: Float | None = None
    n: Annotated[Int, Field(ge=1, le=MAX_CHOICES)] = 1
    seed: Annotated[Int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)],
                Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)], None] = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: Bool = False
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    presence_penalty: Float = 0.0
    frequency_penalty: Float = 0.0
    logit_bias: Annotated[dict[Annotated[StrictStr, Field(max_length=32)], Float],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None

    @model_validator(mode="after")
    def _neutral_only(self):
        _finite("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if self.top_p is not None and not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _finite("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _finite("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None and self.seed + self.n - 1 > INT64_MAX:
            raise ValueError(f"seed + n - 1 must fit in a signed 64-bit integer (choice i draws with seed + i), "
                             f"got seed {self.seed} with n {self.n}")
        unsupported = {"presence_penalty": self.presence_penalty != 0, "frequency_penalty": self.frequency_penalty != 0,
                       "logit_bias": bool(self.logit_bias),
                       "repetition_penalty": self.repetition_penalty not in (None, 1)}
        unsupported.update(self._unsupported())
        bad = [name for name, is_set in unsupported.items() if is_set]
        if bad:
            raise ValueError(f"{', '.join(bad)} not supported by this server (leave unset)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        return self

    def _unsupported(self) -> dict[str, bool]:
        return {}

    def stop_strings(self) -> list[str]:
        if isinstance(self.stop, str):
            return [self.stop]
        return [s for s in self.stop or () if isinstance(s, str)]

    def stop_ids(self) -> list[int]:
        ids = [t for t in self.stop or () if isinstance(t, int)] if not isinstance(self.stop, str) else []
        return ids + list(self.stop_token_ids or ())


TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(_SamplingRequest):
    prompt: Union[StrictStr, TokenIds, Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_PROMPTS)],
                  Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]]
    max_tokens: Annotated[Int, Field(ge=1, le=INT64_MAX)] | None = None   # unset: 16 (OpenAI), or the model's
    echo: Bool = False
    logprobs: Annotated[Int, Field(ge=0, le=20)] | None = None
    best_of: Annotated[Int, Field(ge=1, le=MAX_CHOICES)] | None = None
    suffix: StrictStr | None = None

    def _unsupported(self) -> dict[str, bool]:
        return {"echo": self.echo, "logprobs": self.logprobs is not None, "suffix": self.suffix is not None,
                "best_of": self.best_of not in (None, self.n)}

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one text or token-id list, or a list of them."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        if all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[dict], None] = None
    name: Name | None = None
    tool_call_id: Name | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: Annotated[Int, Field(ge=1, le=INT64_MAX)] | None = None
    logprobs: Bool = False
    top_logprobs: Annotated[Int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: Bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None

    def _unsupported(self) -> dict[str, bool]:
        return {"logprobs": self.logprobs, "top_logprobs": self.top_logprobs is not None}

    @model_validator(mode="after")
    def _no_forced_tool_calls(self):
        if self.tool_choice is not None and self.tool_choice not in ("none", "auto"):
            raise ValueError(f"tool_choice {self.tool_choice!r} needs tool-call parsing, which this server does "
                             "not support; send tool_choice 'none' or 'auto' (the tools reach the chat template)")
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses ---------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    token_ids: list[int] = []
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tripath"
    max_model_len: int
    vocab_size: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
