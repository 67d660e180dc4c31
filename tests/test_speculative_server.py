"""``tripath serve --speculative-config`` as a client uses it: a real server process on loopback with n-gram
speculation, greedy completions equal to the engine's without speculation, vLLM's spec-decode metrics, and a
bad configuration refused at the command line, naming the flag."""

import subprocess
import sys

import httpx
import pytest
import torch

from server_process import SRC, ServerProcess

pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from tripath.engine import LLM, SamplingParams  # noqa: E402

if torch.cuda.is_available():
    ENGINE_ARGS = ["--backend", "three_path", "--device", "cuda", "--dtype", "float16", "--enforce-eager"]
    ENGINE = dict(backend="three_path", device="cuda", dtype="float16", enforce_eager=True)
else:
    ENGINE_ARGS = ["--backend", "torch"]
    ENGINE = dict(backend="torch")
PROMPTS = ["ab ab ab ab ab ab ab", "hello world hello world hello", "the cat the cat the"]

pytestmark = pytest.mark.usefixtures("pure_torch_one_thread")


@pytest.fixture(scope="module")
def spec_server(tiny_hf_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    server = ServerProcess(["--model", tiny_hf_dir, "--served-model-name", "tiny", *ENGINE_ARGS, "--num-kv-blocks",
                            "64", "--max-model-len", "256", "--speculative-config",
                            '{"method": "ngram", "num_speculative_tokens": 3}'], log)
    yield server
    server.close()


def test_greedy_completions_and_metrics_with_speculation(spec_server, tiny_hf_dir):
    want = LLM(tiny_hf_dir, num_kv_blocks=64, max_model_len=256, **ENGINE).generate(
        PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
    for prompt, expected in zip(PROMPTS, want):
        reply = httpx.post(spec_server.url + "/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0,
                                 "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == expected.text
    metrics = spec_server.metrics()
    labels = '{engine="0",model_name="tiny"}'
    drafted = metrics[f"vllm:spec_decode_num_draft_tokens_total{labels}"]
    assert metrics[f"vllm:spec_decode_num_drafts_total{labels}"] > 0 and drafted > 0
    assert 0 <= metrics[f"vllm:spec_decode_num_accepted_tokens_total{labels}"] <= drafted


def test_a_bad_speculative_config_names_the_flag(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tripath.cli", "serve", "--model", "tiny-llama", "--port", "0",
                             "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'],
                            capture_output=True, text=True, timeout=120, env={"PYTHONPATH": SRC, "PATH": "/usr/bin"})
    assert result.returncode == 2
    assert "argument --speculative-config: speculative_config method 'eagle' is not available" in result.stderr
