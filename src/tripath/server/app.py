"""The FastAPI application: OpenAI-compatible routes over an engine (:class:`~tripath.server.submissions.Engine`:
the engine core in its own process, :mod:`~tripath.server.engine_client`, or in this one,
:mod:`~tripath.server.engine_loop`).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` answers server-sent events
ending in ``data: [DONE]``), ``GET /v1/models`` (every served name), ``GET /health`` and ``GET`` / ``POST
/ping`` (200 once the engine is built; 503 before, while shutting down and once the engine has died; 500
when it could not be built), ``GET /metrics`` (Prometheus text, :mod:`~tripath.server.metrics`; of every API
server when this is one of several, :mod:`~tripath.server.metrics_peers`), vLLM's ``POST /tokenize``, ``POST
/detokenize``, ``GET /version`` (:mod:`~tripath.server.utility_routes`), and FastAPI's ``/docs``, ``/redoc``,
``/openapi.json`` unless ``docs`` is off. With an ``api_key`` every path but the public ones needs it as a
bearer token (401 otherwise; :mod:`~tripath.server.auth`). Errors carry the OpenAI body ``{"error":
{"message", "type", "param", "code"}}``: 400 for a bad request (malformed JSON, a field of the wrong type or
out of range, a prompt the engine could never serve, more choices than the server could ever hold, an output
constraint over ``max_structured_output_bytes``), 404 for a model name the server does not serve, 413 for a
body over ``max_request_bytes``, 415 for a body not sent as JSON (:mod:`~tripath.server.request_body`), 503
when more than ``max_queue_depth`` engine requests would wait beyond the ``max_num_seqs`` the engine runs at
once (or the bodies in flight would pass 64 x ``max_request_bytes``), 504 past ``request_timeout_s``, 500 for
a failed engine step.

Python work that grows with what a client sends (tokenising text prompts, rendering chat templates,
matching stop strings, decoding echoed prompts, building large replies) runs in worker threads, so one large
request does not stall the others or ``/health``. The body is parsed on the event loop (pydantic holds the
interpreter lock while it validates: a thread would stall the loop as long, and add two thread hops to every
request), bounded by ``max_request_bytes``; token-id prompts are checked there too, at C speed (``min`` /
``max``). Connections themselves (header, body and send timeouts, a connection cap) are bounded below the
app, in :mod:`~tripath.server.connections`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from typing import Callable, Sequence

import pydantic

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tripath.engine.chat import chat_token_ids, encode_text
from tripath.engine.request import SamplingParams
from tripath.engine.structured_output import StructuredOutput, constraint_size
from tripath.server import protocol as P
from tripath.server.api_servers import ApiServerRole, watch_supervisor
from tripath.server.auth import DEFAULT_PUBLIC_PATHS, APIKeyCheck, check_public_paths
from tripath.server.engine_client import EngineClient
from tripath.server.engine_loop import EngineLoop
from tripath.server.generation import APIError, Generation
from tripath.server.large_texts import LargeTextGate
from tripath.server.request_body import BodyLimit, error_body, read_json
from tripath.server.responses import respond
from tripath.server.metrics import ServerMetrics
from tripath.server.metrics_peers import MetricsPeers
from tripath.server.sampling_defaults import defaulted_sampling
from tripath.server.submissions import Engine

log = logging.getLogger("tripath.server")

DEFAULT_MAX_REQUEST_BYTES = 16 << 20
DEFAULT_MAX_STRUCTURED_OUTPUT_BYTES = 64 << 10


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


class ServerState:
    def __init__(self, engine: Engine, metrics: ServerMetrics, model_names: Sequence[str], max_queue_depth: int,
                 request_timeout_s: float | None, chat_template: str | None = None,
                 max_structured_output_bytes: int = DEFAULT_MAX_STRUCTURED_OUTPUT_BYTES,
                 response_role: str = "assistant", max_logprobs: int = P.MAX_LOGPROBS, tokenizer_info: bool = False):
        self.engine, self.metrics = engine, metrics
        self.model_names = list(model_names)   # each accepted as a request's model; the first names the metrics
        self.model_name = self.model_names[0]
        self.chat_template = chat_template     # Jinja text in place of the tokenizer's, or None
        self.max_queue_depth = max_queue_depth
        self.request_timeout_s = request_timeout_s
        self.max_structured_output_bytes = max_structured_output_bytes
        self.response_role = response_role     # the role of a chat completion's message
        self.max_logprobs = max_logprobs       # the most log-probabilities a request may ask for per token
        self.tokenizer_info = tokenizer_info   # serve GET /tokenizer_info
        self.outstanding = 0   # engine submissions of live HTTP requests (handler side)
        self.large_texts = LargeTextGate()

    @property
    def capacity(self) -> int:
        """Engine requests the server holds at once: the ``max_num_seqs`` the engine runs and
        ``max_queue_depth`` more waiting."""
        return self.engine.max_num_seqs + self.max_queue_depth


def build_app(make_llm: Callable[[], object], *, model_name: str | Sequence[str], max_queue_depth: int = 1024,
              request_timeout_s: float | None = None, on_fatal: Callable[[BaseException], None] | None = None,
              shutdown_timeout_s: float = 30.0, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              api_key: str | None = None, chat_template: str | None = None,
              describe: Callable[[object], str] | None = None, engine_in_process: bool = False,
              api_server: ApiServerRole | None = None, public_paths: Sequence[str] = DEFAULT_PUBLIC_PATHS,
              docs: bool = True, max_structured_output_bytes: int = DEFAULT_MAX_STRUCTURED_OUTPUT_BYTES,
              response_role: str = "assistant", max_logprobs: int = P.MAX_LOGPROBS,
              tokenizer_info: bool = False) -> FastAPI:
    """The server for the engine ``make_llm()`` builds at start-up: in the engine core process it spawns
    (``make_llm`` and ``describe`` are pickled to it: top-level functions or ``functools.partial`` of them), or
    with ``engine_in_process`` on a thread of this process (any callable).

    ``model_name``: the served name, or several (each accepted as a request's ``model``, all listed by
    ``/v1/models``; the first is the metrics' ``model_name``). ``api_key``: required on every path but
    ``public_paths`` (:mod:`~tripath.server.auth`); ``docs``: serve ``/docs``, ``/redoc`` and ``/openapi.json``;
    ``max_structured_output_bytes``: the largest output constraint (schema, regex, grammar, choices) a request
    may send; ``response_role``: the role of a chat completion's message; ``max_logprobs``: the most
    log-probabilities a request may ask for per token (400 beyond); ``tokenizer_info``: serve
    ``GET /tokenizer_info``; ``chat_template``: Jinja text used by chat requests instead of the tokenizer's;
    ``describe(llm)``: the start-up log line of the built engine. ``api_server``: this server is one of several in front of an engine
    core another process started (:mod:`~tripath.server.api_servers`; ``make_llm`` is not used): it talks to
    that core, and its ``/metrics`` answers for all of them (:mod:`~tripath.server.metrics_peers`)."""
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
    metrics = ServerMetrics(names[0])
    if api_server is not None:
        if engine_in_process:
            raise ValueError("an API server of several talks to the engine core process: engine_in_process "
                             "cannot be set with api_server")
        engine: Engine = EngineClient(None, metrics, on_fatal, core=api_server.channel)
    else:
        engine = (EngineLoop if engine_in_process else EngineClient)(make_llm, metrics, on_fatal, describe)
    if not 0 <= max_logprobs <= P.MAX_LOGPROBS:
        raise ValueError(f"max_logprobs must be in [0, {P.MAX_LOGPROBS}], got {max_logprobs}")
    state = ServerState(engine, metrics, names, max_queue_depth, request_timeout_s, chat_template,
                        max_structured_output_bytes, response_role, max_logprobs, tokenizer_info)
    peers = None
    if api_server is not None and api_server.count > 1:
        peers = MetricsPeers(api_server.folder, api_server.index, api_server.count, metrics.registry,
                             refresh=lambda: metrics.in_server.set(state.outstanding))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if peers is not None:
            await peers.start()
        if api_server is not None and on_fatal is not None:
            watch_supervisor(lambda: on_fatal(RuntimeError("the tripath serve supervisor is gone")))
        engine.start()
        yield
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
    from tripath.server.utility_routes import add_utility_routes   # it uses this module's helpers
    add_utility_routes(app, state)

    @app.get("/metrics")
    async def prometheus():
        if peers is not None:
            body = await peers.render()
        else:
            metrics.in_server.set(state.outstanding)
            body = metrics.render()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        _check_ready(state)
        return P.ModelList(data=[P.ModelCard(id=name, max_model_len=engine.max_model_len,
                                                vocab_size=engine.vocab_size) for name in names]).model_dump()

    @app.post("/v1/completions", openapi_extra=_schema(P.CompletionRequest))
    async def completions(request: Request):
        body = await read_json(request, P.CompletionRequest)
        _check_ready(state)
        _check_model(state, body.model)
        _check_fits(state, body.n * (1 if isinstance(body.prompt, str) or isinstance(body.prompt[0], int)
                                     else len(body.prompt)))
        try:
            raw_prompts = body.prompts()
        except ValueError as error:
            raise APIError(400, str(error), param="prompt") from None
        if any(isinstance(p, str) for p in raw_prompts):   # tokenising text: in a worker thread
            async with state.large_texts.admit(sum(len(p) for p in raw_prompts if isinstance(p, str))):
                prompts = await _in_thread(lambda: [_prompt_ids(state, p, i) for i, p in enumerate(raw_prompts)])
        else:   # token ids: a bounds check at C speed, here
            prompts = [_prompt_ids(state, p, i) for i, p in enumerate(raw_prompts)]
        structured = await _structured_output(state, body)
        echo = await _in_thread(_echo_texts, state, raw_prompts, prompts) if body.echo else None
        gen = _generation(state, body, prompts, body.max_tokens, structured)   # no await from here to respond
        return await respond(state, gen, body, request, chat=False, echo=echo)

    @app.post("/v1/chat/completions", openapi_extra=_schema(P.ChatCompletionRequest))
    async def chat_completions(request: Request):
        body = await read_json(request, P.ChatCompletionRequest)
        _check_ready(state)
        _check_model(state, body.model)
        _check_fits(state, body.n)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        async with state.large_texts.admit(len(await request.body())):   # the body bounds the messages' text
            prompt = await _in_thread(_chat_prompt, state, messages, body.add_generation_prompt,
                                      _chat_template_kwargs(body))
        structured = await _structured_output(state, body)
        gen = _generation(state, body, [prompt], body.output_limit, structured)
        return await respond(state, gen, body, request, chat=True)

    return app


# ---- request to submissions ------------------------------------------------------------------------------
def _schema(model: type[pydantic.BaseModel]) -> dict:
    """The OpenAPI description of a body the handler parses itself."""
    return {"requestBody": {"content": {"application/json": {"schema": model.model_json_schema()}}, "required": True}}


async def _in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))


def _chat_template_kwargs(body) -> dict:
    """The template variables of a chat body: its ``chat_template_kwargs``, and ``tools`` unless they set it."""
    template_kwargs = dict(body.chat_template_kwargs or {})
    if body.tools is not None and "tools" not in template_kwargs:
        template_kwargs["tools"] = body.tools
    return template_kwargs


def _chat_prompt(state: ServerState, messages: list[dict], add_generation_prompt: bool,
                 template_kwargs: dict) -> list[int]:
    try:
        prompt = chat_token_ids(state.engine.tokenizer, messages, add_generation_prompt, template_kwargs,
                                state.chat_template)
    except (ValueError, TypeError, UnicodeError) as error:   # ChatTemplateError included
        raise APIError(400, str(error), param="messages") from None
    except Exception as error:  # noqa: BLE001 - a template that refuses the conversation (jinja raise_exception)
        raise APIError(400, f"the chat template rejected the messages: {error}", param="messages") from None
    _check_ids(state, prompt, "messages")
    return prompt


def _check_fits(state: ServerState, num_choices: int) -> None:
    """A request of more engine requests (prompts x n) than the server ever holds could never run: 400."""
    if num_choices > state.capacity:
        raise APIError(400, f"the request needs {num_choices} engine requests (prompts x n) but this server holds "
                            f"at most {state.capacity} at once (max_num_seqs {state.engine.max_num_seqs} + "
                            f"max_queue_depth {state.max_queue_depth})", param="n")


def _check_ready(state: ServerState) -> None:
    if not state.engine.ready:
        raise APIError(503, "the engine is not ready (starting up or shutting down)", "server_error")


def _check_model(state: ServerState, model: str) -> None:
    if model not in state.model_names:
        served = ", ".join(repr(n) for n in state.model_names)
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served}",
                       param="model", code="model_not_found")


def _check_ids(state: ServerState, ids: list[int], param: str) -> None:
    if not ids:
        raise APIError(400, f"{param} is empty: a prompt needs at least one token", param=param)
    vocab = state.engine.vocab_size
    if min(ids) >= 0 and max(ids) < vocab:
        return
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"{param} holds token ids outside the vocabulary [0, {vocab}): {bad[:8]}", param=param)


def _prompt_ids(state: ServerState, prompt, i: int) -> list[int]:
    param = "prompt" if i == 0 else f"prompt[{i}]"
    if isinstance(prompt, str):
        if state.engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param=param)
        try:
            ids = encode_text(state.engine.tokenizer, prompt)
        except (ValueError, TypeError, UnicodeError) as error:   # e.g. a lone surrogate: not encodable text
            raise APIError(400, f"{param} could not be tokenised: {type(error).__name__}: {error}",
                           param=param) from None
    else:
        ids = prompt   # validated token ids (ints >= 0)
    _check_ids(state, ids, param)
    return ids


async def _structured_output(state: ServerState, body) -> StructuredOutput | None:
    """The request's output constraint, checked in a worker thread (the engine compiles it off its loop when the
    request arrives, and refuses the request with 400 if it does not compile)."""
    asked = body.structured_output()
    return None if asked is None else await _in_thread(_constraint, state, *asked)


def _constraint(state: ServerState, param: str, asked: dict) -> StructuredOutput:
    """``asked`` (``StructuredOutput`` keyword arguments from the request field ``param``) as a checked
    constraint: 400 naming ``param`` when it is larger than ``--max-structured-output-bytes``, nested too
    deep, or does not compile."""
    size, limit = constraint_size(next(iter(asked.values()))), state.max_structured_output_bytes
    if size > limit:
        raise APIError(400, f"{param} is {size} bytes; this server takes output constraints (a schema, regex, "
                            f"grammar or choices) of at most {limit} bytes (--max-structured-output-bytes)",
                       param=param, code="structured_output_too_large")
    try:
        spec = StructuredOutput(**{k: tuple(v) if k == "choice" else v for k, v in asked.items()})
    except (ValueError, TypeError, ImportError) as error:
        raise APIError(400, f"{param}: {error}", param=param) from None
    except RecursionError:   # a defence: StructuredOutput bounds the nesting before anything recurses
        raise APIError(400, f"{param} is nested too deeply", param=param) from None
    return spec


def _check_logprobs(state: ServerState, body, chat: bool) -> None:
    """The request's log-probabilities within ``--max-logprobs``; ``prompt_logprobs`` not streamed (as vLLM)."""
    asked = (("top_logprobs", body.top_logprobs) if chat else ("logprobs", body.logprobs),
             ("prompt_logprobs", body.prompt_logprobs))
    for name, value in asked:
        if value is not None and value > state.max_logprobs:
            raise APIError(400, f"{name} ({value}) is more than the server's --max-logprobs ({state.max_logprobs})",
                           param=name)
    if body.stream and body.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs cannot be streamed: ask for them without stream", param="prompt_logprobs")


def _generation(state: ServerState, body, prompts: list[list[int]], max_tokens: int | None,
                structured: StructuredOutput | None = None) -> Generation:
    """The engine submissions of a request: ``prompts`` x ``num_choices`` (``n``, or ``best_of``), choice
    ``j`` of a prompt seeded ``seed + j``. ``max_tokens`` 0 (completions): the prompt is scored and one token
    is run and hidden."""
    limit = state.engine.max_model_len
    chat = isinstance(body, P.ChatCompletionRequest)
    params, choice_prompts = [], []
    stop_ids = body.stop_ids()
    if stop_ids:
        _check_ids(state, stop_ids, "stop_token_ids")
    bias = body.logit_bias_ids()
    if bias:
        _check_ids(state, list(bias), "logit_bias")
    hidden = max_tokens == 0
    _check_logprobs(state, body, chat)
    if chat:
        logprobs, prompt_logprobs = ((body.top_logprobs or 0) if body.logprobs else None), body.prompt_logprobs
    else:
        logprobs, prompt_logprobs = body.logprobs, body.scores_prompt
    ranked = body.num_choices > body.n   # best_of: the choices keep their log-probabilities to be ranked
    for prompt in prompts:
        room = limit - len(prompt)
        if room < 1:
            raise APIError(400, f"the prompt ({len(prompt)} tokens) leaves no room to generate within "
                                f"max_model_len ({limit})", param="prompt")
        for j in range(body.num_choices):
            seed = None if body.seed is None else body.seed + j
            try:
                sampling = defaulted_sampling(body, max_tokens, state.engine.generation_defaults, room)
                if hidden:
                    sampling["max_tokens"] = 1
                sp = SamplingParams(
                    **sampling, seed=seed, stop_token_ids=tuple(stop_ids), ignore_eos=body.ignore_eos,
                    min_tokens=body.min_tokens, presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty, logit_bias=bias,
                    logprobs=0 if ranked and logprobs is None else logprobs, prompt_logprobs=prompt_logprobs,
                    structured_output=structured)
            except (ValueError, TypeError) as error:   # SamplingParams' messages start with the field
                raise APIError(400, str(error), param=_named_field(str(error))) from None
            params.append(sp)
            choice_prompts.append(prompt)
    _check_fits(state, len(params))
    if state.outstanding + len(params) > state.capacity:
        state.metrics.rejected.labels("queue_full").inc()
        waiting = max(0, state.outstanding - state.engine.max_num_seqs)
        raise APIError(503, f"the server is overloaded: {state.outstanding} engine requests in flight, {waiting} "
                            f"beyond the {state.engine.max_num_seqs} the engine runs at once (max_queue_depth "
                            f"{state.max_queue_depth}); retry later", "server_error", code="overloaded")
    return Generation(state.engine, choice_prompts, params, body.stop_strings(), state.request_timeout_s,
                      prompt_tokens=sum(len(p) for p in prompts), include_stop=body.include_stop_str_in_output,
                      skip_special_tokens=body.skip_special_tokens, hidden=hidden)


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def _named_field(message: str) -> str | None:
    """The ``SamplingParams`` field a message of its checks opens with (``logit_bias[5] must ...``), else None."""
    word = message.split(" ", 1)[0].split("[", 1)[0]
    return word if word in _SAMPLING_FIELDS else None


def _echo_texts(state: ServerState, raw_prompts, prompts: list[list[int]]) -> list[str]:
    """Each prompt's text as a response with ``echo`` repeats it (text prompts as sent, token ids decoded)."""
    tokenizer = state.engine.tokenizer
    return [p if isinstance(p, str) else ("" if tokenizer is None else tokenizer.decode(ids))
            for p, ids in zip(raw_prompts, prompts)]
