"""The ``tripath`` command: dispatch, errors, and Triton backends on a CPU-only machine."""

import json
import os
import subprocess
import sys

import pytest
import torch

import tripath
from tripath.cli import main


def test_help_and_unknown_command(capsys):
    assert main(["--help"]) == 0
    assert "bench kernels" in capsys.readouterr().out
    assert main(["serve-everything"]) == 2
    assert "unknown command 'serve-everything'" in capsys.readouterr().err
    assert main(["bench", "nothing"]) == 2
    assert "unknown bench 'nothing'" in capsys.readouterr().err
    assert main(["--bogus"]) == 2
    assert "unknown option '--bogus'" in capsys.readouterr().err


def test_version_and_no_arguments(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"tripath {tripath.__version__}"
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: tripath") and "give a command" in err


def test_tripath_command_loads_neither_torch_nor_triton_for_its_usage():
    code = "import sys; from tripath.cli import main; main(['-h']); print(sorted({'torch', 'triton'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_an_unknown_triton_is_a_usage_error_naming_the_known_ones(monkeypatch, capsys):
    from tripath.triton_internals import versions

    monkeypatch.setattr(versions, "current", lambda: versions.adapter_for("3.10.0"))
    assert main(["check-compile", "--list", "--target", "gfx942", "--only", "decode hd64"]) == 2
    err = capsys.readouterr().err
    assert "tripath: error: tripath does not know Triton 3.10.0: it works with Triton 3.6, 3.7, 3.8, 3.9" in err


@pytest.mark.parametrize("argv, message", [
    (["bench", "--device", "bogus"], "argument --device: 'bogus' is not supported; supported: cpu, cuda, cuda:N"),
    (["bench", "backends", "--device", "meta"], "argument --device: 'meta' is not supported"),
    (["bench", "--only-this"], "unrecognized arguments: --only-this"),
])
def test_bench_usage_errors_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: tripath bench backends" in err and message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
@pytest.mark.parametrize("argv", [["bench", "--device", "cuda"], ["bench", "kernels"], ["bench", "tune"]])
def test_gpu_only_benchmarks_refuse_a_cpu_machine(capsys, argv):
    assert main(argv) == 2
    assert "needs a GPU (CUDA or ROCm) and none is visible" in capsys.readouterr().err


def test_generate_refuses_text_for_a_model_directory_without_tokenizer(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 64}))
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hello", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"--prompt: {tmp_path} has no tokenizer" in err and "--prompt-ids" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback to Triton's interpreter")
def test_generate_with_a_triton_backend_on_cpu_uses_the_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tripath.cli", "generate", "--model", "tiny-llama", "--prompt",
                             "hi", "--max-tokens", "2", "--backend", "three_path", "--device", "cpu",
                             "--dtype", "float16"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "backend three_path" in result.stdout
