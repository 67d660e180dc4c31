"""The OpenAI HTTP API's request and response bodies (the subset the server implements), as pydantic models.

Requests follow vLLM's schema policy: a field the server does not know is accepted and ignored (and logged
once per field name), so clients written for vLLM or OpenAI keep working. Beyond OpenAI's fields the server
takes vLLM's ``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``prompt_logprobs`` and ``chat_template_kwargs``;
``stop`` may hold strings or token ids. Completions take ``logprobs`` (0-20), ``echo`` and ``max_tokens`` 0
(the prompt scored, nothing generated); chats ``logprobs`` / ``top_logprobs``. Fields of the API that the
engine does not implement (``suffix``) are a 400 naming them. ``tools`` / ``tool_choice`` /
``parallel_tool_calls`` are checked and planned by :mod:`tripath.server.http.tools`. Response choices carry the
generated ``token_ids`` as well as the text.

Types are strict: a number is a JSON number (``"3"`` is no integer, ``true`` no 1), a flag a JSON boolean.
Every numeric field has a range the engine holds (64-bit integers for ``seed`` and ``top_k``), every list a
length cap and every short string a size cap (the ``MAX_*`` constants below; the request body as a whole is
capped by the server's ``--max-request-bytes``).
"""

from __future__ import annotations

import logging
import math
import re
import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationInfo,
                      field_validator, model_validator)

from tripath.engine.requests.sampling_params import MAX_REPETITION_PENALTY, MAX_TEMPERATURE, MIN_REPETITION_PENALTY

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
MAX_BIAS = 100.0               # |logit_bias| values, as OpenAI's API
# the sampling fields' ranges (low, high, low excluded), as SamplingParams holds them (float32 logits)
_RANGES = {"temperature": (0.0, MAX_TEMPERATURE, False), "top_p": (0.0, 1.0, True), "min_p": (0.0, 1.0, False),
           "presence_penalty": (-2.0, 2.0, False), "frequency_penalty": (-2.0, 2.0, False),
           "repetition_penalty": (MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY, False)}
# a logit_bias key: ASCII digits, no sign, no leading zero, so each id has one spelling (str.isdigit() passes
# "²", which int() refuses; int() reads " 7", "+7", "0_7" and "٧" as 7)
_DECIMAL_TOKEN_ID = re.compile(r"0|[1-9][0-9]*")
MAX_LOGPROBS = 20              # the engine's (vLLM's default max_logprobs)
MAX_CHOICE_STRINGS = 1024      # guided_choice / structured_outputs.choice
MAX_TOOL_CALLS = 1024          # tool calls of one assistant message

Int = StrictInt
Float = Union[StrictInt, StrictFloat]   # a JSON number (an integer is a float too), never a string or a bool
Bool = StrictBool
Name = Annotated[StrictStr, Field(max_length=MAX_NAME_CHARS)]
TokenId = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]
StopString = Annotated[StrictStr, Field(max_length=MAX_STOP_STRING_CHARS)]

_logged_unknown: set[str] = set()


class RequestModel(BaseModel):
    """The base of every request body: unknown fields allowed (and logged once each, as vLLM does)."""

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


class StreamOptions(RequestModel):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False


class JsonSchemaFormat(RequestModel):
    name: Name | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(RequestModel):
    """vLLM's ``structured_outputs`` field (and its older ``guided_*`` fields)."""

    json_: Union[dict[str, Any], StrictStr, None] = Field(default=None, alias="json")
    json_object: Bool | None = None
    regex: StrictStr | None = None
    choice: Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_CHOICE_STRINGS)] | None = None
    grammar: StrictStr | None = None


class _SamplingRequest(RequestModel):
    model: Name
    # None = unset: the model's default (generation_config.json), else the engine's (server.sampling_defaults)
    max_tokens: Annotated[Int, Field(ge=1, le=INT64_MAX)] | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Annotated[Int, Field(ge=-1, le=INT64_MAX)] | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    n: Annotated[Int, Field(ge=1, le=MAX_CHOICES)] = 1
    seed: Annotated[Int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)],
                Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)], None] = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: Bool = False
    ignore_eos: Bool = False
    min_tokens: Annotated[Int, Field(ge=0, le=INT64_MAX)] = 0
    skip_special_tokens: Bool = True
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    presence_penalty: Float = 0.0
    frequency_penalty: Float = 0.0
    logit_bias: Annotated[dict[Annotated[StrictStr, Field(max_length=32)], Float],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Union[dict[str, Any], StrictStr, None] = None
    guided_regex: StrictStr | None = None
    guided_choice: Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_CHOICE_STRINGS)] | None = None
    guided_grammar: StrictStr | None = None

    def structured_output(self) -> tuple[str, dict[str, Any]] | None:
        """The constraint asked for: the request field that holds it (the error's ``param``) and
        ``StructuredOutput`` keyword arguments; None: unconstrained. A request naming more than one is refused."""
        asked = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ValueError("response_format json_schema needs json_schema.schema")
            asked.append(("response_format.json_schema.schema", {"json": rf.json_schema.schema_}))
        so = self.structured_outputs
        if so is not None:
            fields = {"json": so.json_, "json_object": so.json_object or None, "regex": so.regex,
                      "choice": so.choice, "grammar": so.grammar}
            fields = {k: v for k, v in fields.items() if v is not None}
            if len(fields) != 1:
                raise ValueError("structured_outputs needs exactly one of json, json_object, regex, choice, grammar")
            asked.append((f"structured_outputs.{next(iter(fields))}", fields))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                asked.append((name, {key: getattr(self, name)}))
        if len(asked) > 1:
            raise ValueError(f"more than one output constraint: {', '.join(n for n, _ in asked)}; send one")
        return asked[0] if asked else None

    @field_validator(*_RANGES)
    @classmethod
    def _in_range(cls, value, info: ValidationInfo):
        low, high, low_open = _RANGES[info.field_name]
        if value is not None and not (math.isfinite(value) and (low < value if low_open else low <= value) and
                                      value <= high):
            raise ValueError(f"{info.field_name} must be a finite number in {'(' if low_open else '['}{low:g}, "
                             f"{high:g}], got {value}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias):
        for key, value in (bias or {}).items():
            if not _DECIMAL_TOKEN_ID.fullmatch(key):
                raise ValueError(f"logit_bias keys must be token ids written as plain decimal numbers (\"1234\"), "
                                 f"got {key!r}")
            if not (math.isfinite(value) and -MAX_BIAS <= value <= MAX_BIAS):
                raise ValueError(f"logit_bias[{key}] must be a finite number in [{-MAX_BIAS:g}, {MAX_BIAS:g}], "
                                 f"got {value}")
        return bias

    @model_validator(mode="after")
    def _check_together(self):
        if self.seed is not None and self.seed + self.num_choices - 1 > INT64_MAX:
            raise ValueError(f"seed + {'best_of' if self.num_choices > self.n else 'n'} - 1 must fit in a signed "
                             f"64-bit integer (choice i draws with seed + i), got seed {self.seed}")
        self.structured_output()   # one constraint at most
        bad = [name for name, is_set in self._unsupported().items() if is_set]
        if bad:
            raise ValueError(f"{', '.join(bad)} not supported by this server (leave unset)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        return self

    @property
    def num_choices(self) -> int:
        """Engine requests per prompt (``best_of`` where it asks for more than ``n``)."""
        return self.n

    def _unsupported(self) -> dict[str, bool]:
        return {}

    def logit_bias_ids(self) -> dict[int, float] | None:
        return {int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None

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
    max_tokens: Annotated[Int, Field(ge=0, le=INT64_MAX)] | None = None   # 0: score the prompt (with echo); unset: 16 or the model's
    echo: Bool = False
    logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    prompt_logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Annotated[Int, Field(ge=1, le=MAX_CHOICES)] | None = None
    suffix: StrictStr | None = None

    @model_validator(mode="after")
    def _check_choices(self):
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be >= n ({self.n})")
        if self.stream and self.num_choices > self.n:
            raise ValueError("best_of > n cannot be streamed (the best completions are known at the end)")
        return self

    @property
    def num_choices(self) -> int:
        return max(self.n, self.best_of or 1)

    @property
    def scores_prompt(self) -> int | None:
        """``prompt_logprobs`` the engine computes: vLLM's field, or ``logprobs`` with ``echo``."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo and self.logprobs is not None else None

    def _unsupported(self) -> dict[str, bool]:
        return {"suffix": self.suffix is not None}

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one text or token-id list, or a list of them."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        if isinstance(p[0], int):   # the validated union: a list of token ids, not a list of prompts
            return [p]
        return list(p)


class FunctionCall(RequestModel):
    name: Name
    arguments: Union[StrictStr, dict[str, Any], None] = None   # JSON text of an object (a dict accepted)


class ToolCallMessage(RequestModel):
    """A tool call of an assistant message in the history."""

    id: Name | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[dict], None] = None
    name: Name | None = None
    tool_call_id: Name | None = None
    tool_calls: Annotated[list[ToolCallMessage], Field(max_length=MAX_TOOL_CALLS)] | None = None

    @model_validator(mode="after")
    def _tool_calls_on_assistant(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only assistant messages carry tool calls (role is {self.role!r})")
        return self


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: Annotated[Int, Field(ge=1, le=INT64_MAX)] | None = None
    logprobs: Bool = False
    top_logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    prompt_logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: Bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: Bool | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
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
    stop_reason: int | str | None = None   # the stop string or stop token id that ended it (vLLM's field)
    logprobs: dict[str, Any] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None   # vLLM's field, when asked for


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: str = "assistant"   # the server's --response-role
    content: str | None
    tool_calls: list[dict[str, Any]] = []


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: dict[str, Any] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, Any] | None] | None = None   # vLLM's field, when asked for


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    token_ids: list[int] = []
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: dict[str, Any] | None = None


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
