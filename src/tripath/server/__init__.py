"""``tripath serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the serving engine, started and
answering as vLLM's does.

Its parts, each importing only the ones after it (and the engine): :mod:`~tripath.server.http` (the app,
routes, request and response shaping, tools), :mod:`~tripath.server.processes` (API server processes,
signals, the listening socket, ``/metrics`` across processes), :mod:`~tripath.server.transport` (the loop
around the :class:`~tripath.engine.core.engine_core.EngineCore`, in its own process or on a thread, and the
typed messages and pipes between it and the HTTP side), :mod:`~tripath.server.metrics` (Prometheus, the
stats line, the logs). The command line is :mod:`tripath.cli.serve`.
"""
