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
``application/json``) and sit behind the API key when one is set. A 16 MiB prompt is 3-4 million tokens, and
tokenising it holds the interpreter lock for long stretches (the tokenizer's Python lists, the reply's), so
a body of :data:`TOKENIZE_IN_HELPER_BYTES` or more is tokenised, and its reply built, in the tokenizer helper
process (:mod:`~tripath.server.processes.tokenizer_process`), as are :data:`DETOKENIZE_IN_HELPER_IDS` or more ids
to decode: this process sends the body's bytes and sends back the reply's, and ``/health`` and the streams in
flight keep answering. Smaller requests run in a worker thread (:mod:`~tripath.server.http.tokenizing` builds
the replies of both paths alike); large texts are tokenised one at a time
(:mod:`~tripath.server.http.large_texts`). A helper that dies is a 500 for the request it was serving; the next
one starts another.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

import tripath
from tripath.server.http import protocol as P
from tripath.server.http.engine_requests import check_model, check_ready, in_thread, openapi_body
from tripath.server.http.generation import APIError
from tripath.server.http.request_body import read_json
from tripath.server.http.tokenizing import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
                                            TokenizerSettings, detokenize_body, detokenize_reply, tokenize_body,
                                            tokenize_job, tokenize_reply)
from tripath.server.processes.tokenizer_process import TokenizerProcessDied

TOKENIZE_IN_HELPER_BYTES = 256 << 10   # a /tokenize body this large is tokenised in the helper process
DETOKENIZE_IN_HELPER_IDS = 1 << 16     # a /detokenize of this many ids is decoded in the helper process


def _tokenizer(state):
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer: there is nothing to tokenize or detokenize with")
    return tokenizer


def _settings(state) -> TokenizerSettings:
    return TokenizerSettings(state.engine.max_model_len, state.engine.vocab_size, state.chat_template)


async def _in_helper(state, fn, request: Request) -> Response:
    """``fn(tokenizer, body, settings)`` in the tokenizer helper process, as the response; 500 if it dies first."""
    try:
        reply = await state.tokenizer_helper().run(fn, await request.body(), _settings(state))
    except TokenizerProcessDied as error:
        raise APIError(500, str(error), "server_error") from None
    return _json_response(reply)


def _json_response(reply: bytes | bytearray) -> Response:
    return Response(memoryview(reply), media_type="application/json")


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
        tokenizer = _tokenizer(state)
        size = len(await request.body())   # the body bounds the text
        async with state.large_texts.admit(size):
            if size >= TOKENIZE_IN_HELPER_BYTES:
                return await _in_helper(state, tokenize_body, request)
            return _json_response(await in_thread(tokenize_reply, tokenizer, tokenize_job(body), _settings(state)))

    @app.post("/detokenize", response_model=DetokenizeResponse, openapi_extra=openapi_body(DetokenizeRequest))
    async def detokenize(request: Request):
        body = await _checked(request, DetokenizeRequest)
        tokenizer = _tokenizer(state)
        if len(body.tokens) >= DETOKENIZE_IN_HELPER_IDS:
            return await _in_helper(state, detokenize_body, request)
        return _json_response(await in_thread(detokenize_reply, tokenizer, body.tokens, _settings(state)))

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
