"""The OpenAI HTTP API's request and response bodies (the subset the server implements), as pydantic models.

Requests forbid unknown fields (a typo is a 400, not a silently ignored option). Beyond OpenAI's fields the
server takes ``top_k``, ``ignore_eos`` and ``stop_token_ids``; ``stop`` may hold strings or token ids.
Fields of the API that the engine does not implement are accepted only at their neutral values
(``presence_penalty`` 0, ``logprobs`` off, ``echo`` false, ...), and anything else is a 400 naming them.
Response choices carry the generated ``token_ids`` as well as the text.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    n: int = Field(1, ge=1, le=64)
    seed: int | None = None
    stop: Union[str, list[str], list[int], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _neutral_only(self):
        unsupported = {"presence_penalty": self.presence_penalty != 0, "frequency_penalty": self.frequency_penalty != 0,
                       "logit_bias": bool(self.logit_bias)}
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


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

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
    content: Union[str, list[dict], None] = None
    name: str | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def _unsupported(self) -> dict[str, bool]:
        return {"logprobs": self.logprobs, "top_logprobs": self.top_logprobs is not None}

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
