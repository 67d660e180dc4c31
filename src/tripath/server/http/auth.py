"""API keys: with a key (``--api-key``, else ``TRIPATH_API_KEY``, else ``VLLM_API_KEY``) every request must send
``Authorization: Bearer <key>`` — the OpenAI routes, ``/tokenize``, ``/detokenize``, the API docs, and paths
that match no route (so an unknown path is a 401, not a 404 that maps the routes) — except the public paths:
``/health``, ``/ping``, ``/version`` and ``/metrics`` by default (``--public-paths``), which load balancers and
Prometheus reach without a key. Others get 401 with OpenAI's error body.

vLLM guards ``/v1/*`` only; tripath guards everything not listed, so a route added later is closed until it is
named public, and ``/tokenize`` (which does as much work per byte as a completion's prompt) is not open."""

from __future__ import annotations

import secrets
from typing import Iterable

from starlette.responses import JSONResponse

from tripath.server.http import protocol as P

DEFAULT_PUBLIC_PATHS = ("/health", "/ping", "/version", "/metrics")


def check_public_paths(paths: Iterable[str]) -> tuple[str, ...]:
    """``paths`` as the public set; ``ValueError`` naming one that is not an absolute path (``/...``)."""
    paths = tuple(paths)
    for path in paths:
        if not isinstance(path, str) or not path.startswith("/") or any(c.isspace() for c in path):
            raise ValueError(f"a public path must be an absolute path such as /health, got {path!r}")
    return paths


class APIKeyCheck:
    """ASGI middleware refusing requests that do not carry ``api_key`` as a bearer token (the comparison takes
    the same time whatever the key sent), except on ``public_paths`` (exact matches of the request's path).
    CORS pre-flight (``OPTIONS``) passes: it carries no credentials, and runs nothing."""

    def __init__(self, app, api_key: str, public_paths: Iterable[str] = DEFAULT_PUBLIC_PATHS):
        if not api_key:
            raise ValueError("api_key must be a non-empty string")
        self.app = app
        self.public_paths = frozenset(check_public_paths(public_paths))
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or scope.get("path", "") in self.public_paths:
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
