"""Triton compilations made in parallel child processes, for the warm-up at engine start.

Compiling one kernel variant (Triton's front end, LLVM, then ptxas or the AMD linker) keeps one CPU core
busy for 0.1–3 s, and a backend's warm-up compiles tens to hundreds of variants; one after the other they
are most of a start with an empty Triton cache. They are independent of each other, so:

1. Inside :func:`collect_compilations` every compilation the Triton JIT of this thread would start (a
   variant missing from its in-memory cache) is noted and skipped, through Triton's ``jit_cache_hook``: the
   launch that needed it launches nothing. Running the warm-up's steps inside it lists the compilations
   those steps need, each once.
2. :meth:`CompilePool.compile` hands them to child processes (``python -m tripath.triton_internals.compile_pool``), each
   taking the next one from a shared queue until none is left. A child rebuilds the JIT's source from the
   kernel's module and name, signature, constexprs, attributes and options, exactly as the JIT would, and
   compiles it for the parent's GPU target into the parent's Triton cache directory, with the host-side
   launch stub that Triton would otherwise build with the C compiler at the kernel's first load. The
   children import Triton and the kernels' modules only (no PyTorch, no CUDA context, no model, nothing
   of the parent's main script), and start when the pool is made, so their start-up overlaps the
   caller's work.
3. The steps then run for real: each variant comes from the disk cache (milliseconds) instead of being
   compiled. What a child could not compile (a kernel not importable by its name, a failure) the JIT
   compiles there as usual, so its error, if any, is raised where it belongs.

The outcome is the same kernels with the same cache keys: only where they are compiled changes.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from tripath.triton_internals import interpreter, versions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Compilation:
    """One compilation as the JIT starts it (``JITFunction._do_compile``): the ``@triton.jit`` function by
    ``module`` and ``name``, the ``signature`` (argument name → Triton type), ``constexprs`` and ``attrs``
    (argument path → value / attributes), the launch ``options`` and the target ``(backend, arch,
    warp_size)``. Plain data, so it can be pickled to a child process."""

    module: str
    name: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    target: tuple


@dataclass
class PoolReport:
    """What a :class:`CompilePool` did: compilations made and failed, worker processes, seconds of compiling."""

    compiled: int = 0
    launchers: int = 0  # of those, how many had their launch stub built too
    failed: list[str] = field(default_factory=list)
    workers: int = 0
    seconds: float = 0.0


@contextlib.contextmanager
def collect_compilations() -> Iterator[list[Compilation]]:
    """Within the block, this thread's Triton launches that would compile a new variant skip the compilation
    and launch nothing; the compilations are listed (each once) in the yielded list. Other threads compile
    and launch as usual."""
    adapter = versions.current()
    found: list[Compilation] = []
    seen: set = set()
    owner = threading.get_ident()
    previous = adapter.jit_cache_hook()

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        if threading.get_ident() != owner:
            return previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                            already_compiled=already_compiled) if previous is not None else None
        compilation = Compilation(**adapter.compilation_from_hook(fn, compile))
        ident = (compilation.module, compilation.name, key, *compilation.target[:2])
        if ident not in seen:
            seen.add(ident)
            found.append(compilation)
        return True  # skip: the compilation happens in a worker, the launch not at all

    adapter.set_jit_cache_hook(hook)
    try:
        yield found
    finally:
        adapter.set_jit_cache_hook(previous)


def default_workers() -> int:
    """Worker processes to use: the CPU cores this process may run on, less one for it, at most 16."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(16, cores - 1))


def _child_env() -> dict:
    """The children's environment: this process's, its Triton cache directory and import path made explicit
    (so the children write where this process reads and import the same kernel sources), no interpreter."""
    env = interpreter.child_environment(interpret=False, cache_dir=versions.current().cache_dir())
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p or os.curdir) for p in sys.path)
    return env


def _encode(item) -> bytes:
    return base64.b64encode(pickle.dumps(item)) + b"\n"


class CompilePool:
    """``workers`` child processes (default :func:`default_workers`) that compile what :meth:`compile` hands
    them. They start at once and import Triton while the caller goes on, so their start overlaps the
    caller's work; :meth:`close` (or leaving a ``with`` block) ends them. A worker that cannot start or dies
    costs only its share of the speed-up: what it did not compile stays for the JIT. ``report`` sums every
    :meth:`compile` call."""

    def __init__(self, workers: int | None = None):
        self.report = PoolReport(workers=max(1, workers or default_workers()))
        self._lock = threading.Lock()
        self._procs: list = []
        env = _child_env()
        for _ in range(self.report.workers):
            log = tempfile.TemporaryFile()
            try:
                proc = subprocess.Popen([sys.executable, "-m", "tripath.triton_internals.compile_pool"], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
            except OSError as err:
                log.close()
                logger.warning("could not start a compile worker: %s", err)
                continue
            self._procs.append((proc, log))

    def __enter__(self) -> "CompilePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def compile(self, compilations: Sequence[Compilation]) -> PoolReport:
        """Compile ``compilations`` into Triton's cache directory, each worker taking the next one until none
        is left; returns this call's report."""
        start = time.perf_counter()
        report = PoolReport(workers=len(self._procs))
        pending = list(reversed(compilations))
        threads = [threading.Thread(target=self._drive, args=(proc, log, pending, report), daemon=True)
                   for proc, log in self._procs if proc.poll() is None][:max(1, len(pending))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        report.seconds = time.perf_counter() - start
        self.report.compiled += report.compiled
        self.report.launchers += report.launchers
        self.report.failed += report.failed
        self.report.seconds += report.seconds
        return report

    def _drive(self, proc, log, pending: list, report: PoolReport) -> None:
        try:
            while True:
                with self._lock:
                    if not pending:
                        return
                    item = pending.pop()
                proc.stdin.write(_encode(item))
                proc.stdin.flush()
                reply = proc.stdout.readline()
                if not reply:
                    raise BrokenPipeError("the worker exited")
                error, launcher = pickle.loads(base64.b64decode(reply))
                with self._lock:
                    if error is None:
                        report.compiled += 1
                        report.launchers += launcher
                    else:
                        report.failed.append(f"{item.module}:{item.name}: {error}")
        except OSError as err:  # BrokenPipeError included
            log.seek(0)
            tail = log.read()[-2000:].decode(errors="replace")
            logger.warning("a compile worker stopped (%s); its compilations stay for the JIT\n%s", err, tail)

    def close(self) -> None:
        """End the workers (each finishes the compilation it is making, if any)."""
        for proc, log in self._procs:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            proc.wait()
            proc.stdout.close()
            log.close()
        self._procs = []


def compile_one(item: Compilation):
    """Compile ``item`` in this process as the JIT would (its source, target and options), into Triton's
    cache directory; returns the compiled kernel."""
    adapter = versions.current()
    kernel = getattr(importlib.import_module(item.module), item.name)
    if not isinstance(kernel, adapter.jit_function_type()):
        raise TypeError(f"{item.module}:{item.name} is a {type(kernel).__name__}, not a JITFunction")
    source = adapter.ast_source(kernel, item.signature, item.constexprs, item.attrs)
    return adapter.compile(source, item.target, item.options)


def build_launcher(compiled, backend: str) -> None:
    """Build ``compiled``'s launch stub into Triton's cache, as its first load in the engine would (a C
    compilation): needs the GPU driver's library, not a GPU or a CUDA context."""
    versions.current().build_launch_stub(compiled, backend)


def _serve() -> int:
    """The worker: one pickled :class:`Compilation` a line on stdin, one pickled reply a line on stdout
    (``(None or the error's text, whether the launch stub was built)``); Triton's own printing goes to
    stderr."""
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout = sys.stderr
    for line in sys.stdin.buffer:
        item = pickle.loads(base64.b64decode(line))
        try:
            compiled = compile_one(item)
        except Exception as exc:  # reported to the parent, whose JIT compiles it again and raises there
            replies.write(_encode((f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                                   False)))
            replies.flush()
            continue
        try:
            build_launcher(compiled, item.target[0])
            launcher = True
        except Exception as exc:  # no driver library here (a machine without the GPU): built at first load
            print(f"no launch stub for {item.module}:{item.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
            launcher = False
        replies.write(_encode((None, launcher)))
        replies.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(_serve())
