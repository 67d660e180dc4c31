"""OpenAI's Responses API, as vLLM serves it: ``POST /v1/responses`` over the chat path.

A request becomes a chat request (:func:`chat_request`) and runs as one (:func:`~tripath.server.http.chat_prepare.
prepare_chat`: the chat template, tools and ``tool_choice``, sampling defaults, stop handling, detokenising);
only the answer's shapes differ (:mod:`~tripath.server.http.responses_output`). The conversion:

- ``instructions`` → a leading ``system`` message; ``input`` as text → one ``user`` message; ``input`` as items:
  ``message`` items (``role`` user / system / developer / assistant; ``content`` text or ``input_text`` /
  ``output_text`` parts) → messages; ``function_call`` items (``call_id``, ``name``, ``arguments``) → the
  ``tool_calls`` of an assistant message (joining the assistant message or calls just before them: one
  turn); ``function_call_output`` items (``call_id``, ``output``) → ``tool`` messages with ``tool_call_id``
  (and the function's ``name`` where a call of the input gives it).
- ``tools`` (``{"type": "function", "name", "description", "parameters", "strict"}``), ``tool_choice``
  (``"none"`` / ``"auto"`` / ``"required"`` / ``{"type": "function", "name"}``), ``parallel_tool_calls`` → the
  chat fields; ``max_output_tokens`` → ``max_tokens``; ``temperature``, ``top_p``, ``stream``, ``user`` as they
  are; ``text.format`` (``text`` / ``json_object`` / ``json_schema``) → ``response_format``; vLLM's sampling
  extras (``top_k``, ``min_p``, ``seed``, ``stop``, ...) pass through.

Refused with 400 naming the field: ``previous_response_id``, ``conversation`` and ``item_reference`` items
(nothing is stored: send the whole conversation), ``background: true``, ``prompt`` (stored prompts),
``max_tool_calls``, ``top_logprobs`` > 0, ``truncation: "auto"``, tools other than functions (web search,
file search, MCP, ...), and content parts other than text. Accepted and ignored: ``store`` (answered
``false``), ``include``, ``reasoning``, ``service_tier``, ``stream_options``. ``GET /v1/responses/{id}`` is a
404 (nothing is stored).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import pydantic
from fastapi import FastAPI, Request
from pydantic import Field, StrictStr, model_validator

from tripath.server.http import protocol as P
from tripath.server.http.engine_requests import check_model, check_ready, openapi_body
from tripath.server.http.generation import APIError
from tripath.server.http.responses import respond
from tripath.server.http.tools import ToolError, plan_tools

PASSED_THROUGH = ("top_k", "min_p", "repetition_penalty", "seed", "presence_penalty", "frequency_penalty", "stop",
                  "stop_token_ids", "ignore_eos", "min_tokens", "skip_special_tokens", "include_stop_str_in_output",
                  "logit_bias", "chat_template_kwargs")
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(P.RequestModel):
    model: P.Name
    input: Union[StrictStr, Annotated[list[dict[str, Any]], Field(min_length=1, max_length=P.MAX_MESSAGES)]]
    instructions: StrictStr | None = None
    max_output_tokens: Annotated[P.Int, Field(ge=1, le=P.INT64_MAX)] | None = None
    temperature: P.Float | None = None
    top_p: P.Float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: P.Bool | None = None
    stream: P.Bool = False
    store: P.Bool | None = None
    metadata: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    user: P.Name | None = None
    include: list[Any] | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: StrictStr | None = None
    stream_options: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: Annotated[P.Int, Field(ge=0, le=P.MAX_LOGPROBS)] | None = None
    previous_response_id: StrictStr | None = None
    conversation: Any = None
    background: P.Bool | None = None
    prompt: Any = None
    max_tool_calls: Any = None

    @model_validator(mode="after")
    def _unsupported(self):
        refused = {
            "previous_response_id": (self.previous_response_id is not None,
                                     "this server stores no responses: send the whole conversation in input"),
            "conversation": (self.conversation is not None, "this server stores no conversations: send the whole "
                                                            "conversation in input"),
            "background": (bool(self.background), "background responses are not supported"),
            "prompt": (self.prompt is not None, "stored prompts are not supported: send instructions and input"),
            "max_tool_calls": (self.max_tool_calls is not None, "not supported (leave unset)"),
            "top_logprobs": (bool(self.top_logprobs), "log-probabilities are not returned by /v1/responses (use "
                                                      "/v1/chat/completions with logprobs)"),
            "truncation": (self.truncation == "auto", "'auto' truncation is not supported: a prompt longer than "
                                                      "the model's context is a 400"),
        }
        bad = [f"{name}: {why}" for name, (is_set, why) in refused.items() if is_set]
        if bad:
            raise ValueError("; ".join(bad))
        return self


def _text(content: Any, where: str) -> str:
    """A message item's text: a string, or text parts (``input_text`` / ``output_text``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be text or a list of input_text parts, got {type(content).__name__}",
                       param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}[{j}] must be {{'type': 'input_text', 'text': str}}; {kind or 'this part'} "
                                "is not supported (text only)", param=f"{where}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{key} must be a string, got {type(value).__name__}", param=f"{where}.{key}")
    return value


def chat_messages(body: ResponsesRequest) -> list[dict]:
    """``instructions`` and ``input`` as chat messages."""
    messages: list[dict] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    names: dict[str, str] = {}
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise APIError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}",
                               param=f"{where}.role")
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call_id, name = _string(item, "call_id", where), _string(item, "name", where)
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": _string(item, "arguments", where)}}
            names[call_id] = name
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":   # the same turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            message = {"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"), f"{where}.output")}
            if call_id in names:
                message["name"] = names[call_id]
            messages.append(message)
        else:
            why = "this server stores no items: send their content" if kind == "item_reference" else \
                "not supported (message, function_call and function_call_output items are)"
            raise APIError(400, f"{where}.type {kind!r}: {why}", param=f"{where}.type")
    if not messages:
        raise APIError(400, "input holds no message", param="input")
    return messages


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    raise APIError(400, f"text.format must be of type text, json_object or json_schema, got {fmt!r}",
                   param="text.format")


def responses_messages(payload: bytes) -> list[dict]:
    """The messages of a ``/v1/responses`` body as the chat path hands them to the template (read again from
    the body in the tokenizer helper process: :mod:`~tripath.server.http.large_prompts`)."""
    body = ResponsesRequest.model_validate_json(payload)
    chat = P.ChatCompletionRequest.model_validate({"model": body.model, "messages": chat_messages(body)})
    return [m.model_dump(exclude_none=True) for m in chat.messages]


def chat_request(state, body: ResponsesRequest) -> P.ChatCompletionRequest:
    """The chat request that runs ``body`` (its tools checked here, so errors name the Responses fields)."""
    try:
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, state.tool_settings, flat=True,
                          constrained=_response_format(body.text) is not None)
    except ToolError as error:
        raise APIError(400, str(error), param=error.param) from None
    chat: dict[str, Any] = {"model": body.model, "messages": chat_messages(body), "stream": body.stream}
    for key, value in (("max_tokens", body.max_output_tokens), ("temperature", body.temperature),
                       ("top_p", body.top_p), ("user", body.user), ("parallel_tool_calls", body.parallel_tool_calls),
                       ("response_format", _response_format(body.text))):
        if value is not None:
            chat[key] = value
    if plan is not None:
        chat["tools"] = plan.template_tools()
        chat["tool_choice"] = {"type": "function", "function": {"name": plan.function}} if plan.mode == "named" \
            else plan.mode
    chat.update({k: v for k, v in (body.model_extra or {}).items() if k in PASSED_THROUGH})
    try:
        return P.ChatCompletionRequest.model_validate(chat)
    except pydantic.ValidationError as error:
        first = error.errors(include_url=False)[0]
        where = ".".join(str(x) for x in first.get("loc", ())).replace("max_tokens", "max_output_tokens")
        raise APIError(400, f"{where}: {first.get('msg')}" if where else str(first.get("msg")),
                       param=where or None) from None


def add_responses_routes(app: FastAPI, state) -> None:
    """Add ``POST /v1/responses`` and ``GET /v1/responses/{id}`` (always 404) to ``app``."""
    from tripath.server.http.request_body import read_json
    from tripath.server.http.chat_prepare import prepare_chat
    from tripath.server.http.responses_output import ResponsesRender

    @app.post("/v1/responses", openapi_extra=openapi_body(ResponsesRequest))
    async def create_response(request: Request):
        body = await read_json(request, ResponsesRequest)
        check_ready(state)
        check_model(state, body.model)
        chat = chat_request(state, body)
        gen, plan = await prepare_chat(state, chat, await request.body(), responses_messages)
        return await respond(state, gen, chat, request, chat=True, render=ResponsesRender(body, plan))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        raise APIError(404, f"response {response_id[:64]!r} not found: this server stores no responses",
                       param="response_id", code="not_found")
