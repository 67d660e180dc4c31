"""The work of ``/tokenize`` and ``/detokenize``: their request bodies, and the JSON replies built from them.

A small request is answered in a worker thread of the API server (:func:`tokenize_reply`,
:func:`detokenize_reply`); a large one in the tokenizer helper process
(:mod:`~tripath.server.processes.tokenizer_process`), which gets the request's body as it arrived and parses it
again with the same model (:func:`tokenize_body`, :func:`detokenize_body`): the API server sends the bytes it
holds and gets back the reply's bytes, and builds no text, token list or JSON of its own. Both paths run the
same functions after the parse, so they answer the same bytes, errors included
(:class:`~tripath.server.http.generation.APIError`, which pickles whole).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Sequence

import pydantic
from pydantic import BaseModel, Field, StrictStr, model_validator

from tripath.engine.chat import render_chat
from tripath.server.http import protocol as P
from tripath.server.http.engine_requests import chat_template_kwargs, check_vocab_ids
from tripath.server.http.generation import APIError

MAX_DETOKENIZE_TOKENS = 1 << 20
ENCODE_SLICE = 1 << 15   # list items per json.dumps call: each holds the interpreter lock for a few ms at most


class TokenizeRequest(P.RequestModel):
    model: P.Name | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[P.ChatMessage], Field(min_length=1, max_length=P.MAX_MESSAGES)] | None = None
    add_generation_prompt: P.Bool = True
    add_special_tokens: P.Bool | None = None   # default: True for a prompt, False for messages (as vLLM)
    return_token_strs: P.Bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt (text) and messages (a chat conversation)")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(P.RequestModel):
    model: P.Name | None = None
    tokens: Annotated[list[P.TokenId], Field(max_length=MAX_DETOKENIZE_TOKENS)]


class DetokenizeResponse(BaseModel):
    prompt: str


@dataclass(frozen=True)
class TokenizerSettings:
    """The server's facts a reply needs: ``max_model_len``, ``vocab_size`` (the ids ``/detokenize`` takes) and
    the ``--chat-template`` text (None: the tokenizer's)."""

    max_model_len: int
    vocab_size: int
    chat_template: str | None = None


@dataclass(frozen=True)
class TokenizeJob:
    """What a ``/tokenize`` request asks: ``prompt`` text, or chat ``messages`` (plain dicts) rendered with the
    template variables ``template_kwargs``."""

    prompt: str | None
    messages: list[dict[str, Any]] | None
    add_generation_prompt: bool
    add_special_tokens: bool
    return_token_strs: bool
    template_kwargs: dict[str, Any] = field(default_factory=dict)


def tokenize_job(body: TokenizeRequest) -> TokenizeJob:
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        return TokenizeJob(body.prompt, None, body.add_generation_prompt, special, body.return_token_strs)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    return TokenizeJob(None, messages, body.add_generation_prompt, bool(body.add_special_tokens),
                       body.return_token_strs, chat_template_kwargs(body))


def tokenize_reply(tokenizer, job: TokenizeJob, settings: TokenizerSettings) -> bytes:
    """The JSON body ``{"count", "max_model_len", "tokens", "token_strs"}`` of ``job``; 400 when the template
    refuses the messages or the text cannot be encoded."""
    if job.prompt is not None:
        text, param = job.prompt, "prompt"
    else:
        try:
            text = render_chat(tokenizer, job.messages, job.add_generation_prompt, job.template_kwargs,
                               settings.chat_template)
        except Exception as error:  # noqa: BLE001 - as chat completions: the template refused the messages
            raise APIError(400, f"the chat template rejected the messages: {error}", param="messages") from None
        param = "messages"
    try:
        encoded = tokenizer.encode(text, add_special_tokens=job.add_special_tokens)
    except (ValueError, TypeError, UnicodeError) as error:
        raise APIError(400, f"{param} could not be tokenised: {type(error).__name__}: {error}", param=param) from None
    ids = [int(t) for t in getattr(encoded, "ids", encoded)]   # `tokenizers` returns an Encoding
    del encoded   # the tokenizer's own copy (offsets, masks): gone before the reply is built
    strs = None
    if job.return_token_strs:
        convert = getattr(tokenizer, "convert_ids_to_tokens", None) or tokenizer.id_to_token
        strs = [convert(t) for t in ids]
    return json_reply(count=len(ids), max_model_len=settings.max_model_len, tokens=ids, token_strs=strs)


def detokenize_reply(tokenizer, ids: list[int], settings: TokenizerSettings) -> bytes:
    """The JSON body ``{"prompt"}`` of ``ids`` (special tokens kept); 400 for an id outside the vocabulary."""
    if ids:
        check_vocab_ids(settings.vocab_size, ids, "tokens")
    return json_reply(prompt=tokenizer.decode(ids, skip_special_tokens=False))


def tokenize_body(tokenizer, body: bytes, settings: TokenizerSettings) -> bytes:
    """:func:`tokenize_reply` of a ``/tokenize`` request's body (the helper process's side)."""
    return tokenize_reply(tokenizer, tokenize_job(_parse(TokenizeRequest, body)), settings)


def detokenize_body(tokenizer, body: bytes, settings: TokenizerSettings) -> bytes:
    """:func:`detokenize_reply` of a ``/detokenize`` request's body (the helper process's side)."""
    return detokenize_reply(tokenizer, _parse(DetokenizeRequest, body).tokens, settings)


def _parse(model: type[P.RequestModel], body: bytes):
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as error:   # the API server validated these bytes before sending them
        raise APIError(400, f"the body is not a valid request: {error}") from None


def json_list(values: Sequence) -> str:
    """``json.dumps(values)``, a slice at a time (see :data:`ENCODE_SLICE`)."""
    return "[" + ",".join(json.dumps(values[i:i + ENCODE_SLICE], separators=(",", ":"))[1:-1]
                          for i in range(0, len(values), ENCODE_SLICE)) + "]"


def json_reply(**fields) -> bytes:
    """A JSON object of ``fields`` in order (lists encoded by :func:`json_list`), as the bytes to send."""
    parts = [f"{json.dumps(k)}:{json_list(v) if isinstance(v, list) else json.dumps(v)}" for k, v in fields.items()]
    return ("{" + ",".join(parts) + "}").encode("ascii")   # json.dumps escapes what is not ASCII
