"""Compilations made in child processes (tripath.triton_internals.compile_pool): the JIT's compilations are
listed instead of made, workers compile them into Triton's cache under the JIT's own keys (so the JIT then
loads them), a failure is reported rather than raised, and other threads keep compiling meanwhile."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tripath.engine import EngineConfig
from tripath.triton_internals import CompilePool, Compilation, collect_compilations

TESTS = Path(__file__).resolve().parent


def test_listed_compilations_are_made_by_workers_under_the_jits_keys(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(TESTS), *sys.path]))
    proc = subprocess.run([sys.executable, str(TESTS / "compile_pool_child.py"), "2"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["found"] == 2 and seen["names"] == ["rms_norm_kernel"]  # the repeated variant counts once
    assert seen["skipped_launches"] == [None, None, None]  # nothing compiled, nothing launched
    assert seen["entries_before_pool"] == 0
    assert seen["pool_compiled"] == 2 and seen["pool_failed"] == [] and seen["pool_workers"] == 2
    assert seen["entries_after_pool"] == 2
    # the JIT found both in the cache: a key of its own would have added an entry
    assert seen["entries_after_jit"] == 2 and seen["jit_kernels"] == ["CompiledKernel"] * 3


def test_a_compilation_a_worker_cannot_make_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    missing = Compilation("tripath.kernels.no_such_module", "kernel", {"x": "*fp32"}, {}, {}, {"num_warps": 4},
                          ("cuda", 90, 32))
    with CompilePool(2) as pool:
        assert pool.compile([]).compiled == 0
        report = pool.compile([missing, missing])
        assert report.workers == 2 and report.compiled == 0
        assert len(report.failed) == 2 and "no_such_module" in report.failed[0]
        assert pool.compile([missing]).failed and len(pool.report.failed) == 3  # the workers serve again


def test_other_threads_are_not_collected():
    from triton import knobs

    answers = []
    with collect_compilations():
        hook = knobs.runtime.jit_cache_hook
        thread = threading.Thread(target=lambda: answers.append(hook(
            key=None, repr="", fn=None, compile={}, is_manual_warmup=False, already_compiled=False)))
        thread.start()
        thread.join()
    assert answers == [None]  # not skipped: that thread's JIT compiles
    assert knobs.runtime.jit_cache_hook is None  # restored


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "4"])
def test_compile_workers_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="compile_workers"):
        EngineConfig(compile_workers=bad)


def test_the_command_line_option_reaches_the_engine_config():
    import argparse

    from tripath.cli.engine_options import add_engine_arguments, engine_options

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    for argv, expected in (([], None), (["--compile-workers", "3"], 3)):
        options = engine_options(parser.parse_args(argv))
        for name in ("tensor_parallel_size", "revision", "download_dir"):   # LLM's options, not the config's
            options.pop(name)
        assert EngineConfig(**options).compile_workers == expected
