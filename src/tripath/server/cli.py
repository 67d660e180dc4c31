"""``tripath serve``: the OpenAI-compatible HTTP server on the engine.

    tripath serve --model /models/Qwen3-8B --backend three_path --port 8000
    tripath serve --model tiny-llama --backend torch --num-kv-blocks 64     # a preset: token-id prompts only

The port answers at once; ``GET /health`` is 200 once the engine is built (and warmed up). SIGINT / SIGTERM
stop accepting connections, let in-flight requests finish for up to ``--shutdown-timeout`` seconds, then end
the rest with 503 (a stream gets an error event and ``[DONE]``) and release the GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Sequence

from tripath.engine.cli_options import add_engine_arguments, engine_options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tripath serve", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="local Hugging Face model directory or preset name")
    parser.add_argument("--served-model-name", default=None, help="the name clients pass as 'model' "
                        "(default: --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-queue-depth", type=int, default=1024,
                        help="engine requests allowed to wait beyond the --max-num-seqs running ones (>= 1); "
                             "more get 503 at once")
    parser.add_argument("--max-request-bytes", type=int, default=16 << 20,
                        help="largest request body accepted (413 above; default 16 MiB)")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="seconds a request may take (504 and aborted after); default: no limit")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests may still run after SIGINT / SIGTERM")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    add_engine_arguments(parser)
    return parser


def main_serve(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tripath serve``; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        import uvicorn

        from tripath.server.app import build_app
    except ImportError as error:
        print(f"tripath serve: error: {error}; install the server's packages with pip install 'tripath[serve]'",
              file=sys.stderr)
        return 2
    for name, value, low in (("--port", args.port, 0), ("--max-queue-depth", args.max_queue_depth, 1),
                             ("--max-request-bytes", args.max_request_bytes, 1)):
        if value < low:
            print(f"tripath serve: error: {name} must be >= {low}, got {value}", file=sys.stderr)
            return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def make_llm():
        from tripath.engine import LLM

        return LLM(args.model, **engine_options(args))

    server: uvicorn.Server | None = None

    def on_fatal(error: BaseException) -> None:
        if server is not None:
            server.should_exit = True

    try:
        app = build_app(make_llm, model_name=args.served_model_name or args.model,
                        max_queue_depth=args.max_queue_depth, request_timeout_s=args.request_timeout,
                        on_fatal=on_fatal, shutdown_timeout_s=args.shutdown_timeout,
                        max_request_bytes=args.max_request_bytes)
    except ValueError as error:
        print(f"tripath serve: error: {error}", file=sys.stderr)
        return 2
    # uvicorn cancels the handlers still running at its graceful timeout; the engine ends them first (503s
    # that reach the clients), so uvicorn's timeout leaves them time to answer.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_ANSWER_S)
    server = _server_class(uvicorn)(config, app.state.server.engine, args.shutdown_timeout)
    try:
        server.run()   # after a graceful shutdown uvicorn re-raises the signal that asked for it
    except KeyboardInterrupt:
        pass
    engine = app.state.server.engine
    if engine.startup_error is not None:
        print(f"tripath serve: error: the engine could not be built: {engine.startup_error}", file=sys.stderr)
        return 1
    return 0 if server.started else 1


SHUTDOWN_ANSWER_S = 5.0


def _server_class(uvicorn):
    class GracefulServer(uvicorn.Server):
        """uvicorn's server whose shutdown stops the engine ``shutdown_timeout_s`` after the signal: the
        requests still running then get the engine's 503 while their handlers can still answer."""

        def __init__(self, config, engine, shutdown_timeout_s: float):
            super().__init__(config)
            self._engine, self._shutdown_timeout_s = engine, shutdown_timeout_s

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
