"""Responses of the completions and chat routes: one JSON body, or server-sent events ending in ``[DONE]``.

A request's choices are its :class:`~tripath.server.http.generation.Generation`'s, prompt-major (choice
``p * n + j`` is completion ``j`` of prompt ``p``); with ``best_of`` the ``n`` best of each prompt's
``best_of`` completions (by cumulative log-probability) are returned, renumbered. With ``echo`` a
completion's text (and ``logprobs``) starts with its prompt's. Log-probabilities take the API's shapes
(:mod:`tripath.server.http.logprob_format`); streamed events are framed by :mod:`tripath.server.http.sse`. A chat with
tools (a :class:`~tripath.server.http.tools.ToolPlan` that parses) answers each choice's output as content and
``tool_calls`` (:mod:`tripath.server.http.tools.plan`). Another API's shapes (``render``: the Responses API,
:mod:`tripath.server.http.openai_responses`) take the same run, accounting and disconnect handling.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from typing import AsyncIterator, Callable, Protocol

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tripath.server.http import protocol as P
from tripath.server.http import sse
from tripath.server.http.generation import APIError, ChoiceState, Delta, Generation
from tripath.server.http.logprob_format import chat_logprobs, completion_logprobs, merge_completion_logprobs
from tripath.server.http.tools import ChoiceToolStream, ToolPlan, chat_message

DISCONNECT_POLL_S = 0.25
LARGE_REPLY_TOKENS = 4096   # a whole reply of more tokens is built and encoded in a worker thread


class Render(Protocol):
    """An API's answer to a finished generation (``response``) or its stream of server-sent events."""

    def response(self, gen: Generation) -> dict: ...

    def events(self, gen: Generation, release: Callable[[], None]) -> AsyncIterator[str]: ...


async def respond(state, gen: Generation, body, request: Request, chat: bool, echo: list[str] | None = None,
                  tools: ToolPlan | None = None, render: Render | None = None):
    """Run ``gen`` and answer: a stream when ``body.stream``, else the whole response (499 when the client
    left first). ``echo``: the prompts' texts to repeat (completions with ``echo``); ``tools``: a chat's tool
    plan; ``render``: another API's shapes in place of completions' / chat's."""
    n = len(gen.choices)
    state.outstanding += n
    try:
        await gen.start()
    except BaseException:
        state.outstanding -= n
        raise
    tokenizer = state.engine.tokenizer
    if body.stream:
        released = False

        def release():
            nonlocal released
            if not released:
                released = True
                gen.abort()
                state.outstanding -= n

        events = render.events(gen, release) if render is not None else \
            _stream(gen, body, chat, echo, tokenizer, release, tools, state.response_role)
        return _EventStream(events, release)
    try:
        collect = asyncio.ensure_future(_collect(gen))
        while not collect.done():
            await asyncio.wait({collect}, timeout=DISCONNECT_POLL_S)
            if not collect.done() and await request.is_disconnected():
                collect.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await collect
                return Response(status_code=499)
        collect.result()
    finally:
        state.outstanding -= n
    if render is not None:
        build = functools.partial(render.response, gen)
    elif chat:
        build = functools.partial(_chat_response, gen, body, tokenizer, tools, state.response_role)
    else:
        build = functools.partial(_completion_response, gen, body, tokenizer, echo)
    tokens = gen.completion_tokens + (gen.prompt_tokens if echo else 0)
    scores_prompt = getattr(body, "prompt_logprobs", None) is not None
    if _wants_logprobs(body, chat) or scores_prompt or tokens > LARGE_REPLY_TOKENS:
        # per-token text of every position, or just many tokens: built and encoded off the event loop
        return await asyncio.get_running_loop().run_in_executor(None, lambda: _encoded(build()))
    return build()


def _encoded(reply: dict) -> Response:
    """``reply`` as a JSON response, encoded here (as Starlette's JSONResponse encodes; FastAPI would first copy
    a returned dict element by element on the event loop)."""
    return Response(json.dumps(reply, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8"),
                    media_type="application/json")


async def _collect(gen: Generation) -> None:
    async for _ in gen.deltas():
        pass


def _wants_logprobs(body, chat: bool) -> bool:
    return bool(body.logprobs) if chat else body.logprobs is not None


def _returned(gen: Generation, body) -> list[tuple[int, ChoiceState]]:
    """``(prompt index, choice)`` of each choice returned, in order."""
    per_prompt = body.num_choices
    out = []
    for p in range(len(gen.choices) // per_prompt):
        group = gen.choices[p * per_prompt:(p + 1) * per_prompt]
        if per_prompt > body.n:
            order = sorted(range(per_prompt), key=lambda i: (-group[i].cumulative_logprob, i))
            group = [group[i] for i in order[:body.n]]
        out += [(p, c) for c in group]
    return out


def _usage_fields(gen: Generation) -> dict:
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens}


def _usage(gen: Generation) -> P.Usage:
    return P.Usage(**_usage_fields(gen))


def _completion_logprobs(tokenizer, body, c: ChoiceState, echo_text: str | None) -> dict | None:
    if body.logprobs is None:
        return None
    parts = []
    if echo_text is not None:
        prompt = c.sub.prompt_token_ids
        parts.append(completion_logprobs(tokenizer, prompt, c.prompt_logprobs or [None] * len(prompt), body.logprobs))
    parts.append(completion_logprobs(tokenizer, c.token_ids, c.logprobs or [], body.logprobs,
                                     len(echo_text) if echo_text is not None else 0))
    return merge_completion_logprobs(parts)


def _prompt_logprobs(tokenizer, body, c: ChoiceState) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs`` of a choice's prompt: per position None (the first) or ``{token id: {logprob,
    rank, decoded_token}}``, the prompt's token and the top ``prompt_logprobs``."""
    if body.prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                      "decoded_token": None if tokenizer is None else tokenizer.decode([t])}
             for t, lp in entry.items()} for entry in (c.prompt_logprobs or [None])]


def _completion_response(gen: Generation, body, tokenizer, echo: list[str] | None) -> dict:
    choices = []
    for i, (p, c) in enumerate(_returned(gen, body)):
        echo_text = None if echo is None else echo[p]
        choices.append(P.CompletionChoice(index=i, text=(echo_text or "") + c.text, token_ids=c.token_ids,
                                          finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                          logprobs=_completion_logprobs(tokenizer, body, c, echo_text),
                                          prompt_logprobs=_prompt_logprobs(tokenizer, body, c)))
    return P.CompletionResponse(id=P.new_id("cmpl"), model=body.model, choices=choices, usage=_usage(gen)).model_dump()


def _chat_response(gen: Generation, body, tokenizer, tools: ToolPlan | None, role: str) -> dict:
    choices = []
    for i, (_, c) in enumerate(_returned(gen, body)):
        logprobs = chat_logprobs(tokenizer, c.token_ids, c.logprobs or [], body.top_logprobs or 0) \
            if body.logprobs else None
        content, tool_calls, finish_reason = chat_message(tools, c.text, c.finish_reason)
        message = P.AssistantMessage(role=role, content=content, tool_calls=tool_calls)
        choices.append(P.ChatChoice(index=i, message=message, token_ids=c.token_ids, finish_reason=finish_reason,
                                    stop_reason=c.stop_reason, logprobs=logprobs))
    return P.ChatCompletionResponse(id=P.new_id("chatcmpl"), model=body.model, choices=choices, usage=_usage(gen),
                                    prompt_logprobs=_prompt_logprobs(tokenizer, body, gen.choices[0])).model_dump()


class _EventStream(StreamingResponse):
    """Server-sent events that release their request however the response ends, even when the client left
    before the first event."""

    def __init__(self, events, release: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._release = release

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def _completion_chunk_choice(gen: Generation, body, tokenizer, echo, d: Delta, offsets: dict[int, int]) -> dict:
    """A completions chunk's choice for ``d``; its first chunk carries the echoed prompt. ``offsets``: each
    choice's text returned so far (for ``text_offset``), updated."""
    c = gen.choices[d.index]
    first = d.index not in offsets
    echo_text = echo[d.index // body.num_choices] if echo is not None and first else None
    at = offsets.get(d.index, 0)
    text = (echo_text or "") + d.text
    logprobs = None
    if body.logprobs is not None:
        parts = []
        if echo_text is not None:
            prompt = c.sub.prompt_token_ids
            parts.append(completion_logprobs(tokenizer, prompt, c.prompt_logprobs or [None] * len(prompt),
                                             body.logprobs))
        parts.append(completion_logprobs(tokenizer, d.token_ids, d.logprobs or [], body.logprobs,
                                         at + len(echo_text or "")))
        logprobs = merge_completion_logprobs(parts)
    offsets[d.index] = at + len(text)
    return sse.completion_choice(d.index, text, d.token_ids, d.finish_reason, logprobs,
                                 c.stop_reason if d.finish_reason else None)


async def _stream(gen: Generation, body, chat: bool, echo, tokenizer, release: Callable[[], None],
                  tools: ToolPlan | None = None, role: str = "assistant"):
    framer = sse.ChunkFramer(P.new_id("chatcmpl" if chat else "cmpl"), body.model, chat)
    parsing = tools is not None and tools.parses
    streams = [ChoiceToolStream(tools.parser(), tools.mode == "named") for _ in gen.choices] if parsing else None
    options = body.stream_options
    continuous = options is not None and options.continuous_usage_stats
    offsets: dict[int, int] = {}
    try:
        if chat:
            for i in range(len(gen.choices)):
                first = sse.chat_choice(i, "", [], None, role=role)
                yield framer.chunk([first], _usage_fields(gen) if continuous else None)
        try:
            async for d in gen.deltas():
                usage = _usage_fields(gen) if continuous else None
                if chat:
                    logprobs = chat_logprobs(tokenizer, d.token_ids, d.logprobs or [], body.top_logprobs or 0) \
                        if body.logprobs else None
                    stop_reason = gen.choices[d.index].stop_reason if d.finish_reason else None
                    if streams is None:
                        choice = sse.chat_choice(d.index, d.text, d.token_ids, d.finish_reason, logprobs,
                                                 stop_reason=stop_reason)
                    else:
                        tool_stream = streams[d.index]
                        content, tool_calls = tool_stream.push(d.text, d.finish_reason is not None)
                        choice = sse.chat_choice(d.index, content if content or not tool_calls else None,
                                                 d.token_ids, tool_stream.finish_reason(d.finish_reason), logprobs,
                                                 tool_calls=tool_calls or None, stop_reason=stop_reason)
                else:
                    choice = _completion_chunk_choice(gen, body, tokenizer, echo, d, offsets)
                yield framer.chunk([choice], usage)
        except APIError as error:
            info = P.ErrorInfo(message=error.message, type=error.type, code=error.status)
            yield sse.event({"error": info.model_dump()})
            yield sse.DONE
            return
        if options is not None and options.include_usage:
            yield framer.chunk([], _usage_fields(gen))
        yield sse.DONE
    finally:
        release()
