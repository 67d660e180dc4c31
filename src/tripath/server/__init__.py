"""``tripath serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the serving engine.

Layers: :mod:`~tripath.server.protocol` (request / response bodies), :mod:`~tripath.server.engine_loop` (the
one thread that owns the engine), :mod:`~tripath.server.generation` and :mod:`~tripath.server.detokenize`
(a request's choices, streamed text, stop strings), :mod:`~tripath.server.metrics` (Prometheus),
:mod:`~tripath.server.app` (routes) and :mod:`~tripath.server.cli` (the command).
"""
