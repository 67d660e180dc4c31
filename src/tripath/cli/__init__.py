"""The ``tripath`` command; in this package, the command lines it parses: ``tripath generate``
(``generate.py``), ``tripath serve`` (``serve.py``, with ``vllm_flags.py``: ``vllm serve``'s options as
it takes them) and the engine's options both share (``engine_options.py``).

Every command is an entry of :data:`COMMANDS` (``tripath <name>``) or :data:`BENCH_COMMANDS`
(``tripath bench <name>``): a help line and the ``"module:function"`` that runs it. The function takes the
rest of the command line (a list of strings, parsed by its own ``argparse`` parser) and returns the exit
status; it is imported only when its command runs, so ``tripath --version`` loads neither torch nor triton.
Adding a command is one entry in one of the two tables.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Callable, Sequence

from tripath import __version__

COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("benchmarks: every backend on mixed steps (default), or one of `tripath bench -h`",
              "tripath.cli:main_bench"),
    "check-compile": ("compile every Triton kernel for gfx942, gfx950 and sm_90 and judge the code",
                      "tripath.portability.check_compile:main_check_compile"),
    "generate": ("generate text with the serving engine (a Hugging Face directory or a preset)",
                 "tripath.cli.generate:main_generate"),
    "serve": ("an OpenAI-compatible HTTP server on the engine (needs tripath[serve])",
              "tripath.cli.serve:main_serve"),
}

BENCH_COMMANDS: dict[str, tuple[str, str]] = {
    "backends": ("every MHA and MLA backend on mixed steps, checked against torch, time per step (default)",
                 "tripath.bench.backends:main_bench"),
    "kernels": ("every op vs the measured copy bandwidth / matmul rate and PyTorch SDPA (GPU)",
                "tripath.bench.kernels:main_kernels"),
    "tune": ("sweep the decode / prefill / MLA decode launch configurations (GPU)",
             "tripath.bench.tune:main_tune"),
    "serve": ("whole requests through the engine per backend: start, passes, TTFT/TPOT, the roofline floor",
              "tripath.bench.serve:main_serve"),
    "decode-step": ("a decode step's GPU time against its floor, its kernels, and cuBLAS's skinny GEMMs (GPU)",
                    "tripath.bench.decode_step:main"),
    "host": ("host time of one mixed step's attention per MHA backend: forward, recording, replay, layers",
             "tripath.bench.host:main_host"),
    "core-transport": ("the server's pipe to its engine core: one step's update encoded, sent, decoded",
                       "tripath.bench.core_transport:main"),
    "speculative": ("speculative decoding's TPOT and tok/s against a set acceptance (oracle drafts)",
                    "tripath.bench.speculative:main"),
    "cpu-prefill": ("a long prompt's prefill on the CPU: tripath's CPU backends against transformers",
                    "tripath.bench.cpu_prefill:main"),
}
DEFAULT_BENCH = "backends"
# Commands whose Triton kernels run in Triton's interpreter when the machine has no GPU.
INTERPRET_ON_CPU = {"bench backends", "bench host"}


def _load(target: str) -> Callable[[list[str]], int]:
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


def _interpret_on_cpu() -> None:
    """Without a GPU, run Triton kernels in the interpreter (must happen before triton is imported)."""
    from tripath.triton_internals.interpreter import interpret_without_gpu

    interpret_without_gpu()


def _parser(prog: str, commands: dict[str, tuple[str, str]], description: str,
            epilog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog)
    if prog == "tripath":
        parser.add_argument("--version", action="version", version=f"tripath {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name, (help_text, _) in commands.items():
        # add_help=False: `-h` after the command goes to the command's own parser.
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _dispatch(prog: str, commands: dict[str, tuple[str, str]], argv: list[str], description: str,
              epilog: str, default: str | None = None) -> int:
    parser = _parser(prog, commands, description, epilog)
    if not argv and default is None:
        parser.print_usage(sys.stderr)
        print(f"{prog}: error: give a command (one of {', '.join(commands)}); `{prog} -h` for help",
              file=sys.stderr)
        return 2
    if default is not None and (not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help"))):
        argv = [default] + argv
    if not argv[0].startswith("-") and argv[0] not in commands:
        kind = "command" if default is None else prog.split()[-1]
        parser.print_usage(sys.stderr)
        print(f"{prog}: error: unknown {kind} {argv[0]!r} (one of {', '.join(commands)})", file=sys.stderr)
        return 2
    try:
        args, rest = parser.parse_known_args(argv[:1])
    except SystemExit as exit_:  # -h, --version, an unknown command: argparse has printed the message
        return int(exit_.code or 0)
    if args.command is None:  # an option where the command belongs
        parser.print_usage(sys.stderr)
        print(f"{prog}: error: unknown option {argv[0]!r}; give a command first", file=sys.stderr)
        return 2
    name = f"{prog.removeprefix('tripath').strip()} {args.command}".strip()
    if name in INTERPRET_ON_CPU:
        _interpret_on_cpu()
    from tripath.triton_internals.versions import UnsupportedTriton

    try:
        return int(_load(commands[args.command][1])(rest + argv[1:]) or 0)
    except SystemExit as exit_:  # a command's argparse error or refusal (exit 2 with its message)
        if isinstance(exit_.code, str):
            print(exit_.code, file=sys.stderr)
            return 2
        return int(exit_.code or 0)
    except UnsupportedTriton as exc:  # the installed Triton is one tripath has no adapter for
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def main_bench(argv: Sequence[str]) -> int:
    """``tripath bench [<command>] ...``: the benchmark commands; without one, ``bench backends``."""
    return _dispatch("tripath bench", BENCH_COMMANDS, list(argv), "tripath's benchmarks.",
                     "`tripath bench <command> -h` describes a command's options.", DEFAULT_BENCH)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tripath``; returns the exit status (2 for a usage error)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("generate", "serve"):
        backend = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--backend"), None)
        backend = backend or next((a.split("=", 1)[1] for a in argv if a.startswith("--backend=")), None)
        if backend not in (None, "auto", "torch"):
            _interpret_on_cpu()  # a Triton backend asked for on a CPU-only machine runs in the interpreter
    bench = ", ".join(f"`tripath bench {name}`" for name in BENCH_COMMANDS)
    return _dispatch("tripath", COMMANDS, argv, "Phase-routed attention for LLM serving: benchmarks, the "
                     "portability check and the serving engine.",
                     f"Benchmarks: {bench}. `tripath <command> -h` describes a command's options.")


if __name__ == "__main__":
    raise SystemExit(main())
