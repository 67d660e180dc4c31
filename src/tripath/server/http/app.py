"""The FastAPI application: OpenAI-compatible routes over an engine (:class:`~tripath.server.transport.submissions.Engine`:
the engine core in its own process, :mod:`~tripath.server.transport.engine_client`, or in this one,
:mod:`~tripath.server.transport.in_process`).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` answers server-sent events
ending in ``data: [DONE]``; tools and tool calls: :mod:`~tripath.server.http.tools`), ``POST /v1/responses``
(:mod:`~tripath.server.http.openai_responses`), ``GET /v1/models`` (every served name), ``GET /health`` and ``GET`` / ``POST
/ping`` (200 once the engine is built; 503 before, while shutting down and once the engine has died; 500
when it could not be built), ``GET /metrics`` (Prometheus text, :mod:`~tripath.server.metrics.metrics`; of every API
server when this is one of several, :mod:`~tripath.server.processes.metrics_peers`), vLLM's ``POST /tokenize``, ``POST
/detokenize``, ``GET /version`` (:mod:`~tripath.server.http.utility_routes`), and FastAPI's ``/docs``, ``/redoc``,
``/openapi.json`` unless ``docs`` is off. With an ``api_key`` every path but the public ones needs it as a
bearer token (401 otherwise; :mod:`~tripath.server.http.auth`). Errors carry the OpenAI body ``{"error":
{"message", "type", "param", "code"}}``: 400 for a bad request (malformed JSON, a field of the wrong type or
out of range, a prompt the engine could never serve, more choices than the server could ever hold, an output
constraint over ``max_structured_output_bytes``), 404 for a model name the server does not serve, 413 for a
body over ``max_request_bytes``, 415 for a body not sent as JSON (:mod:`~tripath.server.http.request_body`), 503
when more than ``max_queue_depth`` engine requests would wait beyond the ``max_num_seqs`` the engine runs at
once (or the bodies in flight would pass 64 x ``max_request_bytes``), 504 past ``request_timeout_s``, 500 for
a failed engine step.

Python work that grows with what a client sends (tokenising text prompts, rendering chat templates,
matching stop strings, decoding echoed prompts, building large replies) runs in worker threads, so one large
request does not stall the others or ``/health``; a large ``/tokenize`` runs in a helper process
(:mod:`~tripath.server.http.utility_routes`). The body is parsed on the event loop (pydantic holds the
interpreter lock while it validates: a thread would stall the loop as long, and add two thread hops to every
request), bounded by ``max_request_bytes``; token-id prompts are checked there too, at C speed (``min`` /
``max``). Connections themselves (header, body and send timeouts, a connection cap) are bounded below the
app, in :mod:`~tripath.server.http.connections`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tripath.engine.core.engine_core import EngineCore
from tripath.engine.core.engine_info import EngineInfo
from tripath.server.http import protocol as P
from tripath.server.processes.api_servers import ApiServerRole, watch_supervisor
from tripath.server.http.auth import DEFAULT_PUBLIC_PATHS, APIKeyCheck, check_public_paths
from tripath.server.http.chat_prepare import prepare_chat
from tripath.server.transport.engine_client import EngineClient
from tripath.server.transport.in_process import InProcessClient
from tripath.server.http.engine_requests import (check_fits, check_model, check_ready, echo_texts, encode_prompts,
                                                 generation, in_thread, openapi_body, structured_output)
from tripath.server.http.generation import APIError
from tripath.server.metrics.metric_kinds import render as render_families
from tripath.server.metrics.metrics import ServerMetrics
from tripath.server.processes.metrics_peers import MetricsPeers
from tripath.server.metrics.observability import Observability
from tripath.server.http.request_body import BodyLimit, error_body, read_json
from tripath.server.metrics.request_log import RequestLog
from tripath.server.http.responses import respond
from tripath.server.http.server_state import DEFAULT_MAX_STRUCTURED_OUTPUT_BYTES, ServerState
from tripath.server.metrics.stats_log import log_engine_stats
from tripath.server.transport.submissions import Engine
from tripath.server.http.tools import ToolSettings

log = logging.getLogger("tripath.server")

DEFAULT_MAX_REQUEST_BYTES = 16 << 20


def _error(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
           code=None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status)


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """A pydantic error as ``(message, param)``: each problem as ``field: what`` (the field named once), the
    first field as ``param``."""
    parts, param = [], None
    for e in error.errors():
        if e.get("type") == "json_invalid":
            return f"the body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", None
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        param = param or (where or None)
        msg = str(e.get("msg")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where and not msg.startswith(loc[-1]) else msg)
    return "; ".join(parts) or "invalid request", param


def build_app(make_engine: Callable[[], EngineCore] | None, *, model_name: str | Sequence[str], max_queue_depth: int = 1024,
              request_timeout_s: float | None = None, on_fatal: Callable[[BaseException], None] | None = None,
              shutdown_timeout_s: float = 30.0, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              api_key: str | None = None, chat_template: str | None = None,
              describe: Callable[[EngineInfo], str] | None = None, engine_in_process: bool = False,
              api_server: ApiServerRole | None = None, public_paths: Sequence[str] = DEFAULT_PUBLIC_PATHS,
              docs: bool = True, max_structured_output_bytes: int = DEFAULT_MAX_STRUCTURED_OUTPUT_BYTES,
              observability: Observability | None = None, tool_settings: ToolSettings | None = None,
              response_role: str = "assistant", max_logprobs: int = P.MAX_LOGPROBS,
              tokenizer_info: bool = False) -> FastAPI:
    """The server for the :class:`~tripath.engine.core.engine_core.EngineCore` ``make_engine()`` builds at start-up: in the
    engine core process it spawns (``make_engine`` and ``describe`` are pickled to it: top-level functions or
    ``functools.partial`` of them, e.g. of :func:`~tripath.server.transport.core_process.build_engine_core`), or with
    ``engine_in_process`` on a thread of this process (any callable).

    ``model_name``: the served name, or several (each accepted as a request's ``model``, all listed by
    ``/v1/models``; the first is the metrics' ``model_name``). ``api_key``: required on every path but
    ``public_paths`` (:mod:`~tripath.server.http.auth`); ``docs``: serve ``/docs``, ``/redoc`` and ``/openapi.json``;
    ``max_structured_output_bytes``: the largest output constraint (schema, regex, grammar, choices) a request
    may send; ``response_role``: the role of a chat completion's message; ``max_logprobs``: the most
    log-probabilities a request may ask for per token (400 beyond); ``tokenizer_info``: serve
    ``GET /tokenizer_info``; ``chat_template``: Jinja text used by chat requests instead of the tokenizer's;
    ``describe(info)``: the start-up log line of the built engine's
    :class:`~tripath.engine.core.engine_info.EngineInfo`. ``api_server``: this server is one of several in front
    of an engine core another process started (:mod:`~tripath.server.processes.api_servers`; ``make_engine`` is not
    used): it talks to that core, and its ``/metrics`` answers for all of them
    (:mod:`~tripath.server.processes.metrics_peers`).
    ``observability``: metric names, the stats line and the request log (default: :class:`Observability`'s);
    ``tool_settings``: ``--enable-auto-tool-choice`` / ``--tool-call-parser`` (default: neither)."""
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"model_name must be a non-empty name or list of names, got {model_name!r}")
    if max_queue_depth < 1:
        raise ValueError(f"max_queue_depth must be >= 1, got {max_queue_depth}")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    if request_timeout_s is not None and not request_timeout_s > 0:
        raise ValueError(f"request_timeout_s must be > 0 or None, got {request_timeout_s}")
    if max_structured_output_bytes < 1:
        raise ValueError(f"max_structured_output_bytes must be >= 1, got {max_structured_output_bytes}")
    public_paths = check_public_paths(public_paths)
    obs = observability or Observability()
    metrics = ServerMetrics(names[0], names=obs.metric_names)
    if api_server is not None:
        if engine_in_process:
            raise ValueError("an API server of several talks to the engine core process: engine_in_process "
                             "cannot be set with api_server")
        engine: Engine = EngineClient(None, metrics, on_fatal, core=api_server.channel)
    else:
        engine = (InProcessClient if engine_in_process else EngineClient)(make_engine, metrics, on_fatal, describe)
    if not 0 <= max_logprobs <= P.MAX_LOGPROBS:
        raise ValueError(f"max_logprobs must be in [0, {P.MAX_LOGPROBS}], got {max_logprobs}")
    state = ServerState(engine, metrics, names, max_queue_depth, request_timeout_s, chat_template,
                        max_structured_output_bytes, RequestLog(obs.max_log_len) if obs.log_requests else None,
                        response_role, max_logprobs, tokenizer_info)
    state.tool_settings = tool_settings or ToolSettings()
    peers = None
    if api_server is not None and api_server.count > 1:
        peers = MetricsPeers(api_server.folder, api_server.index, api_server.count, metrics.registry,
                             refresh=lambda: metrics.in_server.set(state.outstanding), names=obs.metric_names)

    async def families() -> list:   # this server's metrics, or every API server's
        if peers is not None:
            return await peers.families()
        metrics.in_server.set(state.outstanding)
        return metrics.families()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if peers is not None:
            await peers.start()
        if api_server is not None and on_fatal is not None:
            watch_supervisor(lambda: on_fatal(RuntimeError("the tripath serve supervisor is gone")))
        engine.start()
        stats = None
        if obs.log_stats_interval_s is not None and (api_server is None or api_server.index == 0):
            log.info("engine stats every %g s (--log-stats-interval)", obs.log_stats_interval_s)
            stats = asyncio.ensure_future(log_engine_stats(obs.log_stats_interval_s, families))
        yield
        await asyncio.get_running_loop().run_in_executor(None, state.close)   # the tokenizer helper, if any
        if stats is not None:
            stats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stats
        await asyncio.get_running_loop().run_in_executor(None, engine.stop, shutdown_timeout_s)
        if peers is not None:
            await peers.close()
        if api_server is not None:
            log.info("API server %d of %d stopped; it served %d engine requests", api_server.index,
                     api_server.count, metrics.num_ended)

    off = {} if docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="tripath", lifespan=lifespan, **off)
    app.state.server = state
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    if api_key:   # added last: it runs first
        app.add_middleware(APIKeyCheck, api_key=api_key, public_paths=public_paths)

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
        if engine.fatal_error is not None:
            return JSONResponse({"status": "failed", "error": str(engine.fatal_error)}, status_code=503)
        if not engine.ready:
            return JSONResponse({"status": "starting" if engine.starting else "stopping"}, status_code=503)
        return {"status": "ok"}

    app.add_api_route("/ping", health, methods=["GET", "POST"])
    from tripath.server.http.utility_routes import add_utility_routes   # it uses this module's helpers
    add_utility_routes(app, state)
    from tripath.server.http.openai_responses import add_responses_routes
    add_responses_routes(app, state)

    @app.get("/metrics")
    async def prometheus():
        body = render_families(await families(), obs.metric_names)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        check_ready(state)
        return P.ModelList(data=[P.ModelCard(id=name, max_model_len=engine.max_model_len,
                                                vocab_size=engine.vocab_size) for name in names]).model_dump()

    @app.post("/v1/completions", openapi_extra=openapi_body(P.CompletionRequest))
    async def completions(request: Request):
        body = await read_json(request, P.CompletionRequest)
        check_ready(state)
        check_model(state, body.model)
        check_fits(state, body.n * (1 if isinstance(body.prompt, str) or isinstance(body.prompt[0], int)
                                     else len(body.prompt)))
        try:
            raw_prompts = body.prompts()
        except ValueError as error:
            raise APIError(400, str(error), param="prompt") from None
        prompts = await encode_prompts(state, raw_prompts, await request.body())
        structured = await structured_output(state, body)
        echo = await in_thread(echo_texts, state, raw_prompts, prompts) if body.echo else None
        gen = generation(state, body, prompts, body.max_tokens, structured)   # no await from here to respond
        return await respond(state, gen, body, request, chat=False, echo=echo)

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(P.ChatCompletionRequest))
    async def chat_completions(request: Request):
        body = await read_json(request, P.ChatCompletionRequest)
        check_ready(state)
        check_model(state, body.model)
        check_fits(state, body.n)
        gen, tools = await prepare_chat(state, body, await request.body())
        return await respond(state, gen, body, request, chat=True, tools=tools)

    return app
