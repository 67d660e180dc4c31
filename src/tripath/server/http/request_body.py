"""Request bodies: how much of one the server holds, which it accepts, and how it parses them.

- Size: :class:`BodyLimit` answers 413 to a body over ``--max-request-bytes`` on every route, by its
  ``Content-Length`` or as it streams in, before the server holds more of it; and 503 to one that would take
  the bodies held for the requests in flight past 64 times that (1 GiB by default).
- Type: the routes that read a body take JSON only, sent as ``Content-Type: application/json`` (parameters
  such as ``; charset=utf-8`` allowed; a charset other than UTF-8 is not). Anything else, a missing
  Content-Type included, is a 415 naming what is supported. This is what stops a web page from making a
  visitor's browser run completions here: a browser sends a cross-origin POST without asking first (a
  "simple request", no CORS pre-flight) only as ``text/plain``, form data or with no type at all.
- Parsing: :func:`read_json` parses and validates the body into a pydantic model on the event loop
  (pydantic holds the interpreter lock while it validates: a thread would stall the loop as long, and add
  two thread hops to every request). Its JSON parser refuses nesting deeper than 200 levels (a 400), so a
  body nested 100,000 deep costs nothing.
"""

from __future__ import annotations

from typing import TypeVar

import pydantic
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse

from tripath.server.http import protocol as P
from tripath.server.http.generation import APIError

JSON_MEDIA_TYPE = "application/json"
IN_FLIGHT_BODIES = 64   # the bodies of the requests in flight together: at most this many of the largest size
_Body = TypeVar("_Body", bound=pydantic.BaseModel)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return P.ErrorResponse(error=P.ErrorInfo(message=message, type=type, param=param, code=code)).model_dump()


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` (by its Content-Length, or as it streams in) gets 413
    before the server holds more of it; one that would take the bodies of the requests in flight together
    past ``max_total_bytes`` (default :data:`IN_FLIGHT_BODIES` x ``max_bytes``) gets 503, so many large bodies
    at once cannot take the process's memory. A request's body counts until its handler returns."""

    def __init__(self, app, max_bytes: int, max_total_bytes: int | None = None):
        self.app, self.max_bytes = app, max_bytes
        self.max_total_bytes = IN_FLIGHT_BODIES * max_bytes if max_total_bytes is None else max_total_bytes
        self.in_flight = 0   # bytes of the bodies of the requests being served

    def _message(self) -> str:
        return f"the request body is larger than the server's limit of {self.max_bytes} bytes (--max-request-bytes)"

    def _busy(self) -> str:
        return (f"the server is holding {self.in_flight} bytes of request bodies, near its limit of "
                f"{self.max_total_bytes} ({IN_FLIGHT_BODIES} x --max-request-bytes); retry later")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            response = JSONResponse(error_body(self._message(), code="request_too_large"), status_code=413)
            return await response(scope, receive, send)
        if length is not None and self.in_flight + int(length) > self.max_total_bytes:
            response = JSONResponse(error_body(self._busy(), "server_error", code="overloaded"), status_code=503)
            return await response(scope, receive, send)
        held = 0

        async def limited():
            nonlocal held
            message = await receive()
            if message["type"] == "http.request":
                size = len(message.get("body", b""))
                if held + size > self.max_bytes:
                    raise StarletteHTTPException(413, self._message())
                if self.in_flight + size > self.max_total_bytes:
                    raise StarletteHTTPException(503, self._busy())
                held += size
                self.in_flight += size
            return message

        try:
            await self.app(scope, limited, send)
        finally:
            self.in_flight -= held


def content_type_problem(content_type: str | None) -> str | None:
    """Why a body of ``content_type`` (the header's value) is not accepted as JSON; None when it is."""
    supported = f"send the body as JSON with 'Content-Type: {JSON_MEDIA_TYPE}'"
    if content_type is None or not content_type.strip():
        return f"the request has no Content-Type: {supported}"
    media, *params = content_type.split(";")
    if media.strip().lower() != JSON_MEDIA_TYPE:
        return f"Content-Type {media.strip()[:100]!r} is not supported: {supported}"
    for param in params:
        name, _, value = param.partition("=")
        charset = value.strip().strip('"').lower()
        if name.strip().lower() == "charset" and charset not in ("utf-8", "utf8"):
            return f"charset {charset[:40]!r} is not supported: JSON bodies are UTF-8 ({supported})"
    return None


def _parse(model: type[_Body], body: bytes) -> _Body:
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as error:
        raise RequestValidationError(error.errors(include_url=False)) from None


async def read_json(request: Request, model: type[_Body]) -> _Body:
    """The request's body as ``model``: 415 unless it is sent as JSON, 400 when it is not valid (see the module
    doc); parsed and validated on the event loop."""
    problem = content_type_problem(request.headers.get("content-type"))
    if problem is not None:
        raise APIError(415, problem, code="unsupported_media_type")
    try:
        body = await request.body()
    except ClientDisconnect:   # nobody reads the answer: uvicorn drops it
        raise APIError(400, "the client left before sending the whole body") from None
    return _parse(model, body)
