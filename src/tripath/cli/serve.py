"""``tripath serve``: the OpenAI-compatible HTTP server on the engine.

    tripath serve /models/Qwen3-8B --backend three_path --port 8000
    tripath serve Qwen/Qwen3-0.6B --served-model-name qwen3 qwen --api-key "$KEY"   # a Hugging Face hub id
    tripath serve tiny-llama --backend torch --num-kv-blocks 64     # a preset: token-id prompts only

The port is bound first (a port in use fails at once) and answers while the engine builds; ``GET /health`` is
200 once the engine is built (and warmed up). The engine runs in its own process (the engine core,
:mod:`tripath.server.transport.core_loop`; ``--engine-in-process``: on a thread of the HTTP process). SIGINT / SIGTERM
stop accepting connections, let in-flight requests finish for up to ``--shutdown-timeout`` seconds, then end
the rest with 503 (a stream gets an error event and ``[DONE]``) and stop the engine, releasing the GPU; the
exit status is then 0, whichever the signal (:mod:`tripath.server.processes.stop_signals`). An
engine core that dies fails the requests in flight, makes ``/health`` answer 503 and the server exit with
status 1. ``--api-server-count N`` > 1 serves through N API server processes in front of the one core, this
process supervising them (:mod:`tripath.server.processes.api_servers`).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import logging
import math
import os
import sys
from typing import Sequence

DEFAULT_HOST, DEFAULT_PORT = "0.0.0.0", 8000   # every interface, as vLLM (a container's port is reachable)
MODEL_HELP = "a local Hugging Face model directory, a Hugging Face hub id (org/name) or a preset name"


def build_parser() -> argparse.ArgumentParser:
    from tripath.cli.engine_options import HelpFormatter, add_engine_arguments
    from tripath.server.http.protocol import MAX_LOGPROBS
    from tripath.server.http.auth import DEFAULT_PUBLIC_PATHS
    from tripath.server.http.connections import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S,
                                                 DEFAULT_MAX_CONNECTIONS, DEFAULT_SEND_TIMEOUT_S, FILES_KEPT)

    parser = argparse.ArgumentParser(prog="tripath serve", description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    parser.add_argument("--model", dest="model_option", metavar="MODEL", default=None,
                        help="the model, as an option (the same as the positional MODEL)")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the names clients pass as 'model' (each accepted, all listed by /v1/models; the "
                             "first names the metrics); default: the model as given")
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help="address to listen on (default: every interface, as vLLM; 127.0.0.1 for this machine "
                             "only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    parser.add_argument("--api-key", default=None,
                        help="the key every request must send as 'Authorization: Bearer <key>' (401 otherwise), "
                             "but on the --public-paths; default: $TRIPATH_API_KEY, else $VLLM_API_KEY, else no "
                             "key. Prefer the environment variable: an option is visible to every user of the "
                             "machine (ps)")
    parser.add_argument("--public-paths", nargs="*", default=list(DEFAULT_PUBLIC_PATHS), metavar="PATH",
                        help=f"paths served without the API key when one is set, exact matches; default: "
                             f"{' '.join(DEFAULT_PUBLIC_PATHS)}; none (the option alone): every path needs the key")
    parser.add_argument("--disable-fastapi-docs", action="store_true",
                        help="serve no API docs: /docs, /redoc and /openapi.json are gone (404); without it they "
                             "need the API key like any other path")
    parser.add_argument("--chat-template", default=None,
                        help="a chat template for chat requests instead of the tokenizer's: a file, or the Jinja "
                             "template itself")
    parser.add_argument("--generation-config", default="auto",
                        help="defaults of the sampling fields a request leaves unset: 'auto' (the model's "
                             "generation_config.json), 'vllm' (the engine's own), or a folder holding a "
                             "generation_config.json")
    parser.add_argument("--max-queue-depth", type=int, default=1024,
                        help="engine requests allowed to wait beyond the --max-num-seqs running ones (>= 1); "
                             "more get 503 at once")
    parser.add_argument("--max-request-bytes", type=int, default=16 << 20,
                        help="largest request body accepted on any route, in bytes (413 above)")
    parser.add_argument("--max-structured-output-bytes", type=int, default=64 << 10, metavar="BYTES",
                        help="largest output constraint a request may send (a JSON schema, regex, grammar, or "
                             "choices together), in bytes (400 above); one this size compiles in up to seconds "
                             "(off the engine's loop)")
    parser.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S, metavar="SECONDS",
                        help="seconds a client has to send a request's headers (408 and closed after)")
    parser.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S, metavar="SECONDS",
                        help="seconds a client has to send a request's body once its headers arrived (408 and "
                             "closed after)")
    parser.add_argument("--send-timeout", type=float, default=DEFAULT_SEND_TIMEOUT_S, metavar="SECONDS",
                        help="seconds a client may leave the server's answer unread (its send buffer full) before "
                             "the connection is dropped (a stream's generation then aborted)")
    parser.add_argument("--max-connections", type=int, default=None, metavar="N",
                        help=f"open connections each API server holds; one more is answered 503 at once and "
                             f"closed; default: {DEFAULT_MAX_CONNECTIONS}, lowered to leave {FILES_KEPT} of the "
                             f"open-file limit (raised to its hard limit at start) to the server")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="seconds a request may take (504 and aborted after); default: no limit")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests may still run after SIGINT / SIGTERM")
    parser.add_argument("--engine-in-process", action="store_true",
                        help="run the engine on a thread of the HTTP process instead of its own process (the "
                             "default splits them, so HTTP, JSON and detokenising do not hold up the engine's steps)")
    parser.add_argument("--api-server-count", type=int, default=1, metavar="N",
                        help="HTTP processes serving the API in front of the one engine core; each takes a share of "
                             "the connections (the kernel spreads them), /metrics on any answers for all. More than "
                             "1 helps at many concurrent streams, where one process's HTTP, JSON and detokenising "
                             "is the bound")
    from tripath.server.http.tools.formats import PARSERS

    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="let tool_choice 'auto' (the default when a chat sends tools) parse the model's tool "
                             "calls, with --tool-call-parser; without it such requests get 400")
    parser.add_argument("--tool-call-parser", default=None, choices=tuple(PARSERS),
                        help="the format of the model's tool calls: hermes (<tool_call>{...}</tool_call>: Hermes, "
                             "Qwen), llama3_json (Llama 3.x JSON), mistral ([TOOL_CALLS]), pythonic ([f(a=1)])")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                        help="log level of the server (and of uvicorn, unless --uvicorn-log-level)")
    parser.add_argument("--uvicorn-log-level", default=None,
                        choices=("critical", "error", "warning", "info", "debug", "trace"),
                        help="log level of uvicorn (its access log is at info); default: --log-level")
    parser.add_argument("--response-role", default="assistant",
                        help="the role of the message a chat completion returns")
    parser.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS,
                        help=f"the most log-probabilities a request may ask for per token (logprobs, top_logprobs, "
                             f"prompt_logprobs; 400 above), at most {MAX_LOGPROBS}")
    parser.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="serve GET /tokenizer_info: the tokenizer's special tokens, class, maximum length and "
                             "chat template (what lm-eval's remote tokenizer reads)")
    parser.add_argument("--enable-lora", action="store_true", help="not supported: refused (see --lora-modules)")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="not supported: tripath serves one model's weights; merge an adapter into them first")
    add_log_arguments(parser)
    add_engine_arguments(parser)
    return parser


def add_log_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``/metrics``, the stats line, the request log and the access log (vLLM's spellings)."""
    from tripath.server.metrics.observability import QUIET_PATHS

    group = parser.add_argument_group("metrics and logs")
    group.add_argument("--metric-names", default="both", choices=("both", "vllm", "tripath"),
                       help="how /metrics names the families vLLM also serves: vllm:* (what vLLM's dashboards "
                            "read), tripath:* (tripath's names before), or both, one beside the other")
    group.add_argument("--disable-log-stats", action="store_true",
                       help="no periodic engine stats line (throughputs, requests running and waiting, KV cache)")
    group.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                       help="seconds between engine stats lines, logged while the engine is busy")
    group.add_argument("--enable-log-requests", action="store_true",
                       help="log each request when it arrives (id, prompt, sampling parameters) and when it ends")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="the old spelling of the default: no request log")
    group.add_argument("--max-log-len", type=int, default=None, metavar="N",
                       help="the request log keeps N characters and N token ids of a prompt (default: all)")
    group.add_argument("--disable-uvicorn-access-log", action="store_true", help="no HTTP access log")
    group.add_argument("--disable-access-log-for-endpoints", default=",".join(QUIET_PATHS), metavar="PATHS",
                       help="comma-separated paths whose access log lines are DEBUG, not INFO (monitors poll them; "
                            "'' for none)")


def _observability(args):
    """The metrics and logs options of ``args`` (an :class:`~tripath.server.metrics.observability.Observability`);
    ``ValueError`` naming the option that is wrong."""
    from tripath.server.metrics.observability import Observability, endpoint_paths

    if args.enable_log_requests and args.disable_log_requests:
        raise ValueError("--enable-log-requests and --disable-log-requests contradict each other: give one")
    if not (math.isfinite(args.log_stats_interval) and args.log_stats_interval > 0):
        raise ValueError(f"--log-stats-interval must be > 0 seconds, got {args.log_stats_interval}")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}")
    endpoint_paths(args.disable_access_log_for_endpoints)
    return Observability(args.metric_names, None if args.disable_log_stats else args.log_stats_interval,
                         args.enable_log_requests, args.max_log_len)


def _listen_options(argv: list[str]) -> tuple[str, int, int]:
    """``--host``, ``--port`` and ``--api-server-count`` of ``argv``, read without the full parser (which loads
    the engine's modules)."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--host", default=DEFAULT_HOST)
    early.add_argument("--port", default=str(DEFAULT_PORT))
    early.add_argument("--api-server-count", default="1")
    known, _ = early.parse_known_args(argv)
    return known.host, int(known.port), int(known.api_server_count)


def _bind_early(argv: list[str]):
    """The listening socket, bound before anything heavy loads; None when ``-h`` is asked for or the address
    is not valid yet (the full parser then names the mistake)."""
    if any(a in ("-h", "--help") for a in argv):
        return None
    from tripath.server.processes.listen import bind_listener

    try:
        host, port, api_servers = _listen_options(argv)
    except (ValueError, SystemExit):
        return None
    if not 0 <= port <= 65535:
        return None
    return bind_listener(host, port, reuse_port=api_servers > 1)


def _refused(args: argparse.Namespace) -> str | None:
    """Why vLLM options of ``args`` cannot be honoured (naming the option and what tripath does instead)."""
    from tripath.cli.engine_options import check_engine_arguments
    from tripath.server.http.protocol import MAX_LOGPROBS

    if args.enable_lora or args.lora_modules:
        return ("--enable-lora / --lora-modules are not supported: tripath serves one model's weights; merge the "
                "adapter into them (peft's merge_and_unload) and serve the merged model")
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        return f"--max-logprobs must be in [0, {MAX_LOGPROBS}] (the most the engine computes), got {args.max_logprobs}"
    if not args.response_role:
        return "--response-role may not be empty"
    return check_engine_arguments(args)


def _usage_error(message: str) -> int:
    print(f"tripath serve: error: {message}", file=sys.stderr)
    return 2


def main_serve(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tripath serve``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from tripath.server.processes.listen import ListenError

    try:
        listener = _bind_early(argv)
    except ListenError as error:
        print(f"tripath serve: error: {error}", file=sys.stderr)
        return 1
    try:
        return _serve(argv, listener)
    finally:
        if listener is not None:
            listener.close()


def _serve(argv: list[str], listener, api_server=None) -> int:
    """Serve ``argv`` on ``listener``: the one HTTP process (it starts the engine core), the supervisor of
    ``--api-server-count`` > 1 (:func:`~tripath.server.processes.api_servers.supervise`), or one of its API servers
    (``api_server``: its :class:`~tripath.server.processes.api_servers.ApiServerRole`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model is not None and args.model_option is not None and args.model != args.model_option:
        parser.error(f"the model is given twice: {args.model!r} and --model {args.model_option!r}")
    model = args.model or args.model_option
    if model is None:
        parser.error("give the model: tripath serve MODEL (" + MODEL_HELP + ")")
    try:
        import uvicorn

        from tripath.server.http.app import build_app
    except ImportError as error:
        return _usage_error(f"{error}; install the server's packages with pip install 'tripath[serve]'")
    for name, value, low in (("--port", args.port, 0), ("--max-queue-depth", args.max_queue_depth, 1),
                             ("--max-request-bytes", args.max_request_bytes, 1), ("--api-server-count",
                                                                                  args.api_server_count, 1),
                             ("--max-structured-output-bytes", args.max_structured_output_bytes, 1),
                             ("--max-connections", 1 if args.max_connections is None else args.max_connections, 1)):
        if value < low:
            return _usage_error(f"{name} must be >= {low}, got {value}")
    for name, value in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout),
                        ("--send-timeout", args.send_timeout)):
        if not 0 < value < float("inf"):
            return _usage_error(f"{name} must be a positive number of seconds, got {value}")
    if args.api_key == "":
        return _usage_error("--api-key is empty: give a key, or leave the option out")
    refused = _refused(args)
    if refused is not None:
        return _usage_error(refused)
    if args.port > 65535:
        return _usage_error(f"--port must be <= 65535, got {args.port}")
    if args.api_server_count > 1 and args.engine_in_process:
        return _usage_error("--api-server-count > 1 needs the engine in its own process: drop --engine-in-process")
    if args.served_model_name is not None and not all(args.served_model_name):
        return _usage_error("--served-model-name: a name may not be empty")
    if args.generation_config not in ("auto", "vllm") and not os.path.isdir(args.generation_config):
        return _usage_error(f"--generation-config: {args.generation_config!r} is neither 'auto', 'vllm' nor a "
                            "folder")
    from tripath.server.http.tools import ToolSettings

    try:
        observability = _observability(args)
        tool_settings = ToolSettings(args.enable_auto_tool_choice, args.tool_call_parser)
    except ValueError as error:
        return _usage_error(str(error))
    chat_template = None
    if args.chat_template is not None:
        from tripath.engine.chat import load_chat_template

        try:
            chat_template = load_chat_template(args.chat_template)
        except ValueError as error:
            return _usage_error(f"--chat-template: {error}")
    from tripath import _env

    api_key, key_source = (args.api_key, "--api-key") if args.api_key is not None else _env.server_api_key()
    names = args.served_model_name or [model]
    from tripath.cli.engine_options import engine_options
    from tripath.server.transport.core_process import LOG_FORMAT, build_engine_core
    from tripath.server.metrics.startup import startup_summary

    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT,
                        force=True)   # `tripath` configured the root logger for its commands already
    # picklable: the engine core process builds the engine and its start-up line with them
    make_engine = functools.partial(build_engine_core, model, tokenizer=args.tokenizer,
                                    generation_config=args.generation_config, **engine_options(args))
    describe = functools.partial(startup_summary, model=model, served_names=names)
    if api_server is None and args.api_server_count > 1:
        from tripath.server.processes.api_servers import supervise
        from tripath.server.transport.core_process import CoreSpec

        if listener is None:
            return _usage_error("--api-server-count > 1 needs a valid --host and --port")
        spec = CoreSpec(make_engine, describe, logging.getLogger().getEffectiveLevel(), LOG_FORMAT,
                        max_waiting=args.max_queue_depth)
        logging.getLogger("tripath.server").info("listening on http://%s:%d with %d API servers; building the "
                                                 "engine for %s", args.host, listener.getsockname()[1],
                                                 args.api_server_count, model)
        return supervise(argv, args.api_server_count, listener, args.host, spec, args.shutdown_timeout, _serve)
    server: uvicorn.Server | None = None

    def on_fatal(error: BaseException) -> None:
        if server is not None:
            server.should_exit = True

    try:
        app = build_app(make_engine, model_name=names, max_queue_depth=args.max_queue_depth,
                        request_timeout_s=args.request_timeout, on_fatal=on_fatal,
                        shutdown_timeout_s=args.shutdown_timeout, max_request_bytes=args.max_request_bytes,
                        api_key=api_key, chat_template=chat_template, describe=describe,
                        engine_in_process=args.engine_in_process, api_server=api_server,
                        public_paths=args.public_paths, docs=not args.disable_fastapi_docs,
                        max_structured_output_bytes=args.max_structured_output_bytes, observability=observability,
                        tool_settings=tool_settings, response_role=args.response_role,
                        max_logprobs=args.max_logprobs, tokenizer_info=args.enable_tokenizer_info_endpoint)
    except ValueError as error:
        return _usage_error(str(error))
    from tripath.server.http.connections import (ConnectionLimits, fitted_max_connections, guarded_protocol,
                                                 raise_open_file_limit)

    limits = ConnectionLimits(args.header_timeout, args.body_timeout,
                              fitted_max_connections(args.max_connections, raise_open_file_limit()),
                              send_timeout_s=args.send_timeout)
    # uvicorn cancels the handlers still running at its graceful timeout; the engine ends them first (503s
    # that reach the clients), so uvicorn's timeout leaves them time to answer.
    loop, http = _fast_or_default()
    # ws="none": the app has no WebSocket routes, and an upgraded connection would leave the guarded protocol
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level or args.log_level,
                            loop=loop, http=guarded_protocol(http, limits), ws="none",
                            timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_ANSWER_S,
                            access_log=not args.disable_uvicorn_access_log)
    from tripath.server.metrics.observability import endpoint_paths, quiet_access_log

    quiet_access_log(endpoint_paths(args.disable_access_log_for_endpoints))   # uvicorn's loggers are set up now
    server = _server_class(uvicorn)(config, app.state.server.engine, args.shutdown_timeout,
                                    follows_supervisor=api_server is not None)
    port = listener.getsockname()[1] if listener is not None else args.port   # --port 0: the one the system gave
    key = f"API key from {key_source}, public paths: {' '.join(args.public_paths) or 'none'}" if api_key else \
        "no API key"
    guards = (f"at most {limits.max_connections} connections, headers within {limits.header_timeout_s:g} s, "
              f"bodies within {limits.body_timeout_s:g} s, answers unread for {limits.send_timeout_s:g} s dropped; "
              f"{key}")
    if api_server is None or api_server.index == 0:
        logging.getLogger("tripath.server").info("%s", guards)
    if api_server is None:
        logging.getLogger("tripath.server").info("listening on http://%s:%d (%s event loop, %s HTTP parser); "
                                                 "building the engine for %s", args.host, port, loop, http, model)
    else:
        logging.getLogger("tripath.server").info("API server %d of %d listening on http://%s:%d (%s event loop, %s "
                                                 "HTTP parser)", api_server.index, api_server.count, args.host,
                                                 port, loop, http)
    from tripath.server.processes.stop_signals import signals_ask_to_exit

    with signals_ask_to_exit(server):   # a drained SIGTERM exits 0, as a drained SIGINT does
        server.run(sockets=[listener] if listener is not None else None)
    engine = app.state.server.engine
    quiet = api_server is not None and api_server.index > 0   # API server 0 speaks for all
    if engine.startup_error is not None:
        if not quiet:
            print(f"tripath serve: error: the engine could not be built: {engine.startup_error}", file=sys.stderr)
        return 1
    if engine.fatal_error is not None:
        if not quiet:
            print(f"tripath serve: error: the engine stopped serving: {engine.fatal_error}", file=sys.stderr)
        return 1
    return 0 if server.started else 1


SHUTDOWN_ANSWER_S = 5.0


def _fast_or_default() -> tuple[str, str]:
    """uvicorn's event loop and HTTP parser: uvloop and httptools where installed (``tripath[serve]`` installs
    them: a streamed token costs the HTTP process less), else asyncio's loop and h11."""
    have = importlib.util.find_spec
    return ("uvloop" if have("uvloop") else "asyncio"), ("httptools" if have("httptools") else "h11")


def _server_class(uvicorn):
    class GracefulServer(uvicorn.Server):
        """uvicorn's server whose shutdown stops the engine ``shutdown_timeout_s`` after the signal: the
        requests still running then get the engine's 503 while their handlers can still answer.

        ``follows_supervisor`` (an API server of ``--api-server-count``): every stop signal asks for the same
        drained stop. uvicorn force-quits on a SIGINT that comes after a first stop signal, skipping the
        drain and the app's shutdown; an API server gets two whenever a terminal's Ctrl-C reaches the whole
        process group, the group's SIGINT and the supervisor's SIGTERM, in either order. The supervisor ends
        an API server that does not stop in time."""

        def __init__(self, config, engine, shutdown_timeout_s: float, follows_supervisor: bool = False):
            super().__init__(config)
            self._engine, self._shutdown_timeout_s = engine, shutdown_timeout_s
            self._follows_supervisor = follows_supervisor

        def handle_exit(self, sig, frame) -> None:
            if self._follows_supervisor:
                self.should_exit = True
            else:
                super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None) -> None:
            loop = asyncio.get_running_loop()
            timer = loop.call_later(self._shutdown_timeout_s,
                                    lambda: loop.run_in_executor(None, self._engine.stop, SHUTDOWN_ANSWER_S))
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return GracefulServer


if __name__ == "__main__":
    raise SystemExit(main_serve())
