"""API keys: with ``--api-key`` (or ``TRIPATH_API_KEY``) every ``/v1/*`` request must send
``Authorization: Bearer <key>``; others get 401 with OpenAI's error body. ``/health``, ``/ping``,
``/metrics``, ``/version``, ``/tokenize`` and ``/detokenize`` stay open, as in vLLM."""

from __future__ import annotations

import secrets

from starlette.responses import JSONResponse

from tripath.server import protocol as P

PROTECTED_PREFIX = "/v1"


class APIKeyCheck:
    """ASGI middleware refusing ``/v1/*`` requests that do not carry ``api_key`` as a bearer token (the
    comparison takes the same time whatever the key sent). CORS pre-flight (``OPTIONS``) passes."""

    def __init__(self, app, api_key: str):
        if not api_key:
            raise ValueError("api_key must be a non-empty string")
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or not (
                path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")):
            return await self.app(scope, receive, send)
        sent = dict(scope.get("headers") or ()).get(b"authorization", b"")
        if secrets.compare_digest(sent, self._expected):
            return await self.app(scope, receive, send)
        message = ("the request has no API key: send 'Authorization: Bearer <key>'" if not sent else
                   "incorrect API key provided")
        body = P.ErrorResponse(error=P.ErrorInfo(message=message, type="invalid_request_error",
                                                 code="invalid_api_key"))
        response = JSONResponse(body.model_dump(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
