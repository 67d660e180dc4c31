"""``tripath serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the serving engine, started and
answering as vLLM's does.

Layers: :mod:`~tripath.server.protocol` (request / response bodies); the engine, behind one interface
(:mod:`~tripath.server.submissions`): one loop over the :class:`~tripath.engine.core.EngineCore`
(:mod:`~tripath.server.core_loop`, with :mod:`~tripath.server.engine_steps`), in its own process (the
default: :mod:`~tripath.server.core_process`, and :mod:`~tripath.server.engine_client` its side in the HTTP
process) or on a thread of the HTTP process (:mod:`~tripath.server.in_process`), their messages
:mod:`~tripath.server.core_messages` (over pipes: :mod:`~tripath.server.core_wire`); :mod:`~tripath.server.generation` and :mod:`~tripath.server.detokenize`
(a request's choices, streamed text, stop strings), :mod:`~tripath.server.sse` (stream framing),
:mod:`~tripath.server.sampling_defaults` (unset sampling fields), :mod:`~tripath.server.metrics` (Prometheus,
vLLM's names, also as ``tripath:``; :mod:`~tripath.server.metric_kinds`) and :mod:`~tripath.server.metrics_peers`
(merged across API servers), :mod:`~tripath.server.observability` (the metrics and logs options, the access
log), :mod:`~tripath.server.stats_log` (the periodic stats line), :mod:`~tripath.server.request_log`,
:mod:`~tripath.server.api_servers` (``--api-server-count``: several API server processes on one core),
:mod:`~tripath.server.app` (routes), :mod:`~tripath.server.chat_prepare` (the chat path of chats and
responses), :mod:`~tripath.server.tools` (tools, ``tool_choice`` and the tool-call parsers),
:mod:`~tripath.server.openai_responses` and :mod:`~tripath.server.responses_output` (``/v1/responses``),
:mod:`~tripath.server.utility_routes` (``/tokenize``, ``/detokenize``, ``/version``), :mod:`~tripath.server.auth` (``--api-key``), :mod:`~tripath.server.listen` (the port, bound
first), :mod:`~tripath.server.startup` (the start-up log line) and :mod:`~tripath.server.cli` (the command).
"""
