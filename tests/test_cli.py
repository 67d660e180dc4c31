"""The ``tripath`` command: dispatch, errors, and Triton backends on a CPU-only machine."""

import os
import subprocess
import sys

import pytest
import torch

from tripath.cli import main


def test_help_and_unknown_command(capsys):
    assert main(["--help"]) == 0
    assert "bench kernels" in capsys.readouterr().out
    assert main(["serve-everything"]) == 2
    assert "unknown command 'serve-everything'" in capsys.readouterr().err
    assert main(["bench", "nothing"]) == 2
    assert "unknown bench 'nothing'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a Hopper GPU")
def test_bench_wgmma_needs_a_hopper_gpu(capsys):
    assert main(["bench", "wgmma"]) == 2
    assert "needs an sm_90 GPU" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback to Triton's interpreter")
def test_generate_with_a_triton_backend_on_cpu_uses_the_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tripath.cli", "generate", "--model", "tiny-llama", "--prompt",
                             "hi", "--max-tokens", "2", "--backend", "three_path", "--device", "cpu",
                             "--dtype", "float16"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "backend three_path" in result.stdout
