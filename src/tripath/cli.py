"""The ``tripath`` command.

``tripath bench`` (backends on mixed steps), ``tripath bench kernels`` (ops vs floors and SDPA, GPU),
``tripath bench tune`` (launch-config sweep, GPU), ``tripath bench wgmma`` (Hopper wgmma rates and the MLA
decode's instruction floor), ``tripath check-compile`` (portability: every kernel for
gfx942 / gfx950 / sm_90), ``tripath generate`` (the serving engine on a model or preset), ``tripath serve``
(an OpenAI-compatible server on it) and ``tripath bench serve --url`` (the online serving benchmark).
"""

from __future__ import annotations

import os
import sys

USAGE = """usage: tripath <command> [options]

commands:
  bench [--device D]      every backend on mixed steps, checked against torch, time per step (default job)
  bench kernels [--out F] ops on the ANCHORS.md shapes vs measured floors and PyTorch SDPA (GPU)
  bench tune              sweep decode/prefill launch configurations (GPU)
  bench wgmma [--out F]   chained wgmma rates per shape and the MLA decode's instruction floor (sm_90 GPU)
  check-compile           compile every Triton kernel for gfx942, gfx950 and sm_90 and judge the code
  generate --model M ...  generate text with the serving engine (a Hugging Face directory or a preset)
  serve --model M ...     an OpenAI-compatible HTTP server on the engine (needs tripath[serve])
  bench serve --url U     the online serving benchmark against a running server
"""


def _interpret_on_cpu() -> None:
    """Without a GPU, run Triton kernels in the interpreter (must happen before triton is imported)."""
    if "TRITON_INTERPRET" not in os.environ:
        import torch
        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"


def _backend_arg(args: list[str]) -> str | None:
    backend = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--backend"), None)
    return backend or next((a.split("=", 1)[1] for a in args if a.startswith("--backend=")), None)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "bench":
        sub = rest[0] if rest and not rest[0].startswith("-") else None
        if sub == "kernels":
            from tripath.bench.kernels import main_kernels
            return main_kernels(rest[1:])
        if sub == "tune":
            from tripath.bench.tune import main_tune
            return main_tune(rest[1:])
        if sub == "wgmma":
            from tripath.bench.wgmma import main_wgmma
            return main_wgmma(rest[1:])
        if sub == "serve":
            if any(a in ("--url", "-h", "--help") or a.startswith("--url=") for a in rest[1:]):
                from tripath.bench.serve_online import main_online
                return main_online(rest[1:])
            print("tripath bench serve: error: only the online mode (--url http://HOST:PORT) is in this build",
                  file=sys.stderr)
            return 2
        if sub not in (None, "backends"):
            print(f"unknown bench {sub!r}\n\n{USAGE}", file=sys.stderr)
            return 2
        _interpret_on_cpu()
        from tripath.bench.backends import main_bench
        return main_bench(rest[1:] if sub else rest)
    if command == "check-compile":
        from tripath.bench.check_compile import main_check_compile
        return main_check_compile(rest)
    if command == "generate":
        backend = next((rest[i + 1] for i, a in enumerate(rest[:-1]) if a == "--backend"), None)
        backend = backend or next((a.split("=", 1)[1] for a in rest if a.startswith("--backend=")), None)
        if backend not in (None, "auto", "torch"):
            _interpret_on_cpu()  # a Triton backend asked for on a CPU-only machine runs in the interpreter
        from tripath.engine.cli_generate import main_generate
        return main_generate(rest)
    if command == "serve":
        if _backend_arg(rest) not in (None, "auto", "torch"):
            _interpret_on_cpu()
        from tripath.server.cli import main_serve
        return main_serve(rest)
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
