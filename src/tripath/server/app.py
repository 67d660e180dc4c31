"""The FastAPI application: OpenAI-compatible routes over an :class:`~tripath.server.engine_loop.EngineLoop`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` answers server-sent events
ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health`` (200 once the engine is built, 503 before
and while shutting down), ``GET /metrics`` (Prometheus text). Errors carry the OpenAI body
``{"error": {"message", "type", "param", "code"}}``: 400 for a bad request (malformed JSON, an unknown or
out-of-range field, a prompt the engine could never serve), 404 for another model's name, 503 when more
than ``max_queue_depth`` requests already wait for the engine, 504 past ``request_timeout_s``, 500 for a
failed engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tripath.engine.chat import chat_token_ids, encode_text
from tripath.engine.request import SamplingParams
from tripath.server import protocol as P
from tripath.server.engine_loop import EngineLoop
from tripath.server.generation import APIError, Generation
from tripath.server.metrics import ServerMetrics

DISCONNECT_POLL_S = 0.25


def _error(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
           code=None) -> JSONResponse:
    body = P.ErrorResponse(error=P.ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for e in error.errors():
        if e.get("type") == "json_invalid":
            return f"the body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", None
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        param = param or (where or None)
        parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    return "; ".join(parts) or "invalid request", param


class ServerState:
    def __init__(self, engine: EngineLoop, metrics: ServerMetrics, model_name: str, max_queue_depth: int,
                 request_timeout_s: float | None):
        self.engine, self.metrics, self.model_name = engine, metrics, model_name
        self.max_queue_depth = max_queue_depth
        self.request_timeout_s = request_timeout_s
        self.outstanding = 0   # engine submissions of live HTTP requests (handler side)


def build_app(make_llm: Callable[[], object], *, model_name: str, max_queue_depth: int = 1024,
              request_timeout_s: float | None = None, on_fatal: Callable[[BaseException], None] | None = None,
              shutdown_timeout_s: float = 30.0) -> FastAPI:
    """The server for the engine ``make_llm()`` builds (called once, on the engine thread, at start-up)."""
    if max_queue_depth < 0:
        raise ValueError(f"max_queue_depth must be >= 0, got {max_queue_depth}")
    if request_timeout_s is not None and not request_timeout_s > 0:
        raise ValueError(f"request_timeout_s must be > 0 or None, got {request_timeout_s}")
    metrics = ServerMetrics()
    engine = EngineLoop(make_llm, metrics, on_fatal)
    state = ServerState(engine, metrics, model_name, max_queue_depth, request_timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, engine.stop, shutdown_timeout_s)

    app = FastAPI(title="tripath", lifespan=lifespan)
    app.state.server = state

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return _error(400, message, param=param)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return _error(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500 else
                      "server_error")

    @app.get("/health")
    async def health():
        if engine.startup_error is not None:
            return JSONResponse({"status": "failed", "error": str(engine.startup_error)}, status_code=500)
        if engine.ready and not engine.alive:
            return JSONResponse({"status": "failed", "error": "the engine thread has stopped"}, status_code=500)
        if not engine.ready:
            return JSONResponse({"status": "starting" if engine.llm is None else "stopping"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        metrics.in_server.set(state.outstanding)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        _check_ready(state)
        return P.ModelList(data=[P.ModelCard(id=model_name, max_model_len=engine.max_model_len,
                                                vocab_size=engine.vocab_size)]).model_dump()

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        _check_ready(state)
        _check_model(state, body.model)
        try:
            raw_prompts = body.prompts()
        except ValueError as error:
            raise APIError(400, str(error), param="prompt") from None
        prompts = [_prompt_ids(state, p, i) for i, p in enumerate(raw_prompts)]
        gen = _generation(state, body, prompts, body.max_tokens)
        return await _respond(state, gen, body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        _check_ready(state)
        _check_model(state, body.model)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            prompt = chat_token_ids(engine.tokenizer, messages, body.add_generation_prompt)
        except (ValueError, TypeError) as error:   # ChatTemplateError included
            raise APIError(400, str(error), param="messages") from None
        except Exception as error:  # noqa: BLE001 - a template that refuses the conversation (jinja raise_exception)
            raise APIError(400, f"the chat template rejected the messages: {error}", param="messages") from None
        _check_ids(state, prompt, "messages")
        gen = _generation(state, body, [prompt], body.output_limit)
        return await _respond(state, gen, body, request, chat=True)

    return app


# ---- request to submissions ------------------------------------------------------------------------------
def _check_ready(state: ServerState) -> None:
    if not state.engine.ready:
        raise APIError(503, "the engine is not ready (starting up or shutting down)", "server_error")


def _check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")


def _check_ids(state: ServerState, ids: list[int], param: str) -> None:
    if not ids:
        raise APIError(400, f"{param} is empty: a prompt needs at least one token", param=param)
    vocab = state.engine.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"{param} holds token ids outside the vocabulary [0, {vocab}): {bad[:8]}", param=param)


def _prompt_ids(state: ServerState, prompt, i: int) -> list[int]:
    param = "prompt" if i == 0 else f"prompt[{i}]"
    if isinstance(prompt, str):
        if state.engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param=param)
        ids = encode_text(state.engine.tokenizer, prompt)
    else:
        ids = [int(t) for t in prompt]
    _check_ids(state, ids, param)
    return ids


def _generation(state: ServerState, body, prompts: list[list[int]], max_tokens: int | None) -> Generation:
    limit = state.engine.max_model_len
    params, choice_prompts = [], []
    stop_ids = body.stop_ids()
    if stop_ids:
        _check_ids(state, stop_ids, "stop_token_ids")
    for prompt in prompts:
        room = limit - len(prompt)
        if room < 1:
            raise APIError(400, f"the prompt ({len(prompt)} tokens) leaves no room to generate within "
                                f"max_model_len ({limit})", param="prompt")
        for j in range(body.n):
            seed = None if body.seed is None else body.seed + j
            try:
                sp = SamplingParams(max_tokens=max_tokens if max_tokens is not None else room,
                                    temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=seed,
                                    stop_token_ids=tuple(stop_ids), ignore_eos=body.ignore_eos)
            except (ValueError, TypeError) as error:
                raise APIError(400, str(error)) from None
            params.append(sp)
            choice_prompts.append(prompt)
    waiting = state.outstanding - state.engine.num_running
    if waiting + len(params) > state.max_queue_depth:
        state.metrics.rejected.labels("queue_full").inc()
        raise APIError(503, f"the server is overloaded: {waiting} requests already wait for the engine "
                            f"(max_queue_depth {state.max_queue_depth}); retry later", "server_error",
                       code="overloaded")
    return Generation(state.engine, choice_prompts, params, body.stop_strings(), state.request_timeout_s)


# ---- responses -------------------------------------------------------------------------------------------
def _sse(payload) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


async def _respond(state: ServerState, gen: Generation, body, request: Request, chat: bool):
    n = len(gen.choices)
    state.outstanding += n
    try:
        await gen.start()
    except BaseException:
        state.outstanding -= n
        raise
    if body.stream:
        released = False

        def release():
            nonlocal released
            if not released:
                released = True
                gen.abort()
                state.outstanding -= n

        return _EventStream(_stream(gen, body, chat, n, release), release)
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
    usage = P.Usage(prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens,
                    total_tokens=gen.prompt_tokens + gen.completion_tokens)
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    if chat:
        choices = [P.ChatChoice(index=i, message=P.AssistantMessage(content=c.text), token_ids=c.token_ids,
                                finish_reason=c.finish_reason) for i, c in enumerate(gen.choices)]
        return P.ChatCompletionResponse(id=rid, model=body.model, choices=choices, usage=usage).model_dump()
    choices = [P.CompletionChoice(index=i, text=c.text, token_ids=c.token_ids, finish_reason=c.finish_reason)
               for i, c in enumerate(gen.choices)]
    return P.CompletionResponse(id=rid, model=body.model, choices=choices, usage=usage).model_dump()


async def _collect(gen: Generation) -> None:
    async for _ in gen.deltas():
        pass


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


async def _stream(gen: Generation, body, chat: bool, n: int, release: Callable[[], None]):
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    model = body.model
    try:
        if chat:
            for i in range(n):
                first = P.ChatChunkChoice(index=i, delta=P.DeltaMessage(role="assistant", content=""))
                yield _sse(P.ChatCompletionChunk(id=rid, model=model, choices=[first]).model_dump(exclude_none=True))
        try:
            async for d in gen.deltas():
                if chat:
                    choice = P.ChatChunkChoice(index=d.index, delta=P.DeltaMessage(content=d.text),
                                               token_ids=d.token_ids, finish_reason=d.finish_reason)
                    chunk = P.ChatCompletionChunk(id=rid, model=model, choices=[choice])
                else:
                    choice = P.CompletionChoice(index=d.index, text=d.text, token_ids=d.token_ids,
                                                finish_reason=d.finish_reason)
                    chunk = P.CompletionResponse(id=rid, model=model, choices=[choice])
                yield _sse(chunk.model_dump())
        except APIError as error:
            info = P.ErrorInfo(message=error.message, type=error.type, code=error.status)
            yield _sse({"error": info.model_dump()})
            yield _sse("[DONE]")
            return
        if body.stream_options is not None and body.stream_options.include_usage:
            usage = P.Usage(prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens,
                            total_tokens=gen.prompt_tokens + gen.completion_tokens)
            cls = P.ChatCompletionChunk if chat else P.CompletionResponse
            yield _sse(cls(id=rid, model=model, choices=[], usage=usage).model_dump())
        yield _sse("[DONE]")
    finally:
        release()
