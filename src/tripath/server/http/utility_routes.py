"""vLLM's utility routes beside the OpenAI API: ``POST /tokenize``, ``POST /detokenize``, ``GET /version`` and,
with ``--enable-tokenizer-info-endpoint``, ``GET /tokenizer_info`` (the tokenizer's class, special tokens,
maximum length and chat template: what lm-eval's remote tokenizer reads).

``/tokenize`` takes ``{"model"?, "prompt": str, "add_special_tokens"?: true}`` (the ids a completions request
would use) or ``{"model"?, "messages": [...], "add_generation_prompt"?: true, "add_special_tokens"?: false,
"chat_template_kwargs"?, "tools"?}`` (the ids a chat request would use) and answers ``{"count", "max_model_len",
"tokens", "token_strs"}`` (``token_strs`` with ``"return_token_strs": true``, else null). ``/detokenize``
takes ``{"model"?, "tokens": [...]}`` and answers ``{"prompt": str}`` (special tokens kept). A ``model`` that
is given must be one of the served names (404 otherwise); a model without a tokenizer gets 400.

Both read JSON bodies as the OpenAI routes do (bounded by ``--max-request-bytes``, 415 unless sent as
``application/json``) and sit behind the API key when one is set. A 16 MiB prompt is 3-4 million tokens: the
tokenising, the decoding and the encoding of the reply all run in a worker thread, the reply's lists encoded
a slice at a time so the event loop gets the interpreter lock between slices, and ``/health`` and the
streams in flight keep answering; large texts are tokenised one at a time (:mod:`~tripath.server.http.large_texts`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, StrictStr, model_validator

import tripath
from tripath.engine.chat import render_chat
from tripath.server.http import protocol as P
from tripath.server.http.engine_requests import (chat_template_kwargs, check_ids, check_model, check_ready, in_thread,
                                                 openapi_body)
from tripath.server.http.generation import APIError
from tripath.server.http.request_body import read_json

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


def _tokenizer(state):
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer: there is nothing to tokenize or detokenize with")
    return tokenizer


def _tokenize(state, body: TokenizeRequest) -> Response:
    tokenizer = _tokenizer(state)
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        text, param = body.prompt, "prompt"
    else:
        special = bool(body.add_special_tokens)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            text = render_chat(tokenizer, messages, body.add_generation_prompt, chat_template_kwargs(body),
                               state.chat_template)
        except Exception as error:  # noqa: BLE001 - as chat completions: the template refused the messages
            raise APIError(400, f"the chat template rejected the messages: {error}", param="messages") from None
        param = "messages"
    try:
        encoded = tokenizer.encode(text, add_special_tokens=special)
    except (ValueError, TypeError, UnicodeError) as error:
        raise APIError(400, f"{param} could not be tokenised: {type(error).__name__}: {error}", param=param) from None
    ids = [int(t) for t in getattr(encoded, "ids", encoded)]   # `tokenizers` returns an Encoding
    del encoded   # the tokenizer's own copy (offsets, masks): gone before the reply is built
    strs = None
    if body.return_token_strs:
        convert = getattr(tokenizer, "convert_ids_to_tokens", None) or tokenizer.id_to_token
        strs = [convert(t) for t in ids]
    return _json_reply(count=len(ids), max_model_len=state.engine.max_model_len, tokens=ids, token_strs=strs)


def _detokenize(state, body: DetokenizeRequest) -> Response:
    tokenizer = _tokenizer(state)
    if body.tokens:
        check_ids(state, body.tokens, "tokens")
    return _json_reply(prompt=tokenizer.decode(list(body.tokens), skip_special_tokens=False))


def _json_list(values: Sequence) -> str:
    """``json.dumps(values)``, a slice at a time (see :data:`ENCODE_SLICE`)."""
    return "[" + ",".join(json.dumps(values[i:i + ENCODE_SLICE], separators=(",", ":"))[1:-1]
                          for i in range(0, len(values), ENCODE_SLICE)) + "]"


def _json_reply(**fields) -> Response:
    """A JSON response of ``fields`` in order (lists encoded by :func:`_json_list`), encoded here: in the worker
    thread that built it, not on the event loop."""
    parts = [f"{json.dumps(k)}:{_json_list(v) if isinstance(v, list) else json.dumps(v)}"
             for k, v in fields.items()]
    return Response(("{" + ",".join(parts) + "}").encode("ascii"),   # json.dumps escapes what is not ASCII
                    media_type="application/json")


def add_utility_routes(app: FastAPI, state) -> None:
    """Add ``/tokenize``, ``/detokenize``, ``/version`` and (``state.tokenizer_info``) ``/tokenizer_info`` to
    ``app`` (served by ``state``)."""
    async def _checked(request: Request, model: type[P.RequestModel]):
        body = await read_json(request, model)
        check_ready(state)
        if body.model is not None:
            check_model(state, body.model)
        return body

    @app.post("/tokenize", response_model=TokenizeResponse, openapi_extra=openapi_body(TokenizeRequest))
    async def tokenize(request: Request):
        body = await _checked(request, TokenizeRequest)
        async with state.large_texts.admit(len(await request.body())):   # the body bounds the text
            return await in_thread(_tokenize, state, body)

    @app.post("/detokenize", response_model=DetokenizeResponse, openapi_extra=openapi_body(DetokenizeRequest))
    async def detokenize(request: Request):
        body = await _checked(request, DetokenizeRequest)
        return await in_thread(_detokenize, state, body)

    @app.get("/version")
    async def version():
        return {"version": tripath.__version__}

    if state.tokenizer_info:
        @app.get("/tokenizer_info")
        async def tokenizer_info():
            check_ready(state)
            return await in_thread(_tokenizer_info, state)


TOKENIZER_FIELDS = ("bos_token", "eos_token", "pad_token", "unk_token", "model_max_length", "add_bos_token",
                    "add_eos_token", "clean_up_tokenization_spaces")


def _tokenizer_info(state) -> dict:
    """The tokenizer's facts a remote client needs to tokenise as the server does (``--enable-tokenizer-info-
    endpoint``): its class, special tokens as text, ``model_max_length`` (the server's ``max_model_len``),
    vocabulary size and chat template (the server's ``--chat-template`` when given)."""
    tokenizer = _tokenizer(state)
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
    for name in TOKENIZER_FIELDS:
        value = getattr(tokenizer, name, None)
        if isinstance(value, (str, bool)) or value is None:
            info[name] = value
    info["model_max_length"] = state.engine.max_model_len
    info["vocab_size"] = len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.get_vocab_size()
    info["chat_template"] = state.chat_template or getattr(tokenizer, "chat_template", None)
    return info
