"""``tripath serve`` as vLLM's users start and call it (a real process on loopback, CPU, torch backend, the
official ``openai`` client): the model and its tokenizer as Hugging Face hub ids from a local cache with
``HF_HUB_OFFLINE=1``, the positional MODEL, ``--api-key``, several ``--served-model-name``, ``--chat-template``,
sizes such as ``0.3k``, ``generation_config.json`` defaults, ``/tokenize``, ``/detokenize``, ``/version``,
``/ping``, the start-up log; a port in use; usage errors naming the flag."""

import json
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest

from server_process import SRC, ServerProcess

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from server_models import save_tiny_hf_llama  # noqa: E402  (needs transformers)
from tripath.engine import LLM, SamplingParams  # noqa: E402

MODEL_ID, TOKENIZER_ID = "tripath-test/tiny-llama", "tripath-test/tiny-tokenizer"
NAMES = ["tiny", "tiny-alias"]
API_KEY = "sk-test-123"
KEY = {"Authorization": f"Bearer {API_KEY}"}
TEMPLATE = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
GENERATION_CONFIG = {"temperature": 0, "top_k": 50, "max_new_tokens": 5, "min_p": 0.05, "do_sample": True}
WEIGHT_FILES = ("config.json", "model.safetensors", "generation_config.json")


pytestmark = pytest.mark.usefixtures("pure_torch_one_thread")


def _snapshot(cache, repo_id: str, files: dict) -> None:
    """A Hugging Face cache entry as ``huggingface_hub`` lays it out: refs/main -> a commit's snapshot folder."""
    root = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, source in files.items():
        shutil.copy(source, snapshot / name)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A local Hugging Face cache holding a weights-only model (its generation_config.json with sampling
    fields) and, apart, its tokenizer; returns ``(cache, tokenizer)``."""
    built = tmp_path_factory.mktemp("built")
    tokenizer = save_tiny_hf_llama(built)
    generation = json.loads((built / "generation_config.json").read_text())
    (built / "generation_config.json").write_text(json.dumps({**generation, **GENERATION_CONFIG}))
    cache = tmp_path_factory.mktemp("hf-cache")
    _snapshot(cache, MODEL_ID, {name: built / name for name in WEIGHT_FILES})
    _snapshot(cache, TOKENIZER_ID, {p.name: p for p in built.iterdir() if p.name not in WEIGHT_FILES})
    return cache, tokenizer


@pytest.fixture(scope="module")
def server(hub_cache, tmp_path_factory):
    cache, _ = hub_cache
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    log = tmp_path_factory.mktemp("log") / "server.log"
    proc = ServerProcess([MODEL_ID, "--tokenizer", TOKENIZER_ID, "--served-model-name", *NAMES, "--api-key",
                          API_KEY, "--chat-template", str(template), "--backend", "torch", "--num-kv-blocks", "64",
                          "--max-model-len", "0.3k", "--max-num-batched-tokens", "1K"], log, log_level="info",
                         env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def llm(hub_cache):
    """The same model in-process, both names resolved through the same cache."""
    from huggingface_hub import constants

    cache, _ = hub_cache
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(constants, "HF_HUB_CACHE", str(cache))
        mp.setattr(constants, "HF_HUB_OFFLINE", True)
        return LLM(MODEL_ID, tokenizer=TOKENIZER_ID, backend="torch", num_kv_blocks=64, max_model_len=300)


def client(server, key=API_KEY):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_api_key_guards_every_path_but_the_public_ones(server):
    with pytest.raises(openai.AuthenticationError) as error:
        client(server, "wrong").models.list()
    assert error.value.status_code == 401 and error.value.body["code"] == "invalid_api_key"
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"]
    assert [m.id for m in client(server).models.list().data] == NAMES
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/metrics"),
                         ("GET", "/version")):
        assert httpx.request(method, server.url + path).status_code == 200, path
    import tripath
    assert httpx.get(server.url + "/version").json() == {"version": tripath.__version__}
    # vLLM leaves /tokenize, /detokenize and FastAPI's docs open; here they need the key, as does a path that
    # matches no route (a 401, not a 404 that would map the routes)
    for method, path, body in (("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [5]}),
                               ("GET", "/docs", None), ("GET", "/redoc", None), ("GET", "/openapi.json", None),
                               ("GET", "/no/such/path", None), ("GET", "/health/", None)):
        r = httpx.request(method, server.url + path, json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
    for method, path, body, status in (("POST", "/tokenize", {"prompt": "hi"}, 200), ("GET", "/docs", None, 200),
                                       ("GET", "/openapi.json", None, 200), ("GET", "/no/such/path", None, 404)):
        r = httpx.request(method, server.url + path, json=body, headers=KEY)
        assert r.status_code == status, (path, r.text)
    assert "/tokenize" in httpx.get(server.url + "/openapi.json", headers=KEY).json()["paths"]


def test_every_served_name_is_accepted_and_the_first_names_the_metrics(server):
    c = client(server)
    for name in NAMES:
        out = c.completions.create(model=name, prompt="Hello", max_tokens=2, extra_body={"ignore_eos": True})
        assert out.model == name and len(out.choices[0].model_extra["token_ids"]) == 2
    with pytest.raises(openai.NotFoundError, match="serves 'tiny', 'tiny-alias'"):
        c.completions.create(model="other", prompt="Hello", max_tokens=2)
    metrics = server.metrics()
    assert any('model_name="tiny"' in k for k in metrics) and not any('model_name="tiny-alias"' in k for k in metrics)


def test_tokenize_and_detokenize_round_trip(server, hub_cache):
    _, tokenizer = hub_cache
    text = "The quick brown fox, naïve café ✓"
    r = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": text, "return_token_strs": True},
                   headers=KEY)
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == tokenizer.encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 300
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    back = httpx.post(server.url + "/detokenize", json={"model": "tiny-alias", "tokens": body["tokens"]},
                      headers=KEY)
    assert back.status_code == 200 and back.json() == {"prompt": text}
    usage = client(server).completions.create(model="tiny", prompt=text, max_tokens=1).usage
    assert usage.prompt_tokens == body["count"]   # the ids a completions request uses
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [1, 10 ** 6]}, headers=KEY)
    assert bad.status_code == 400 and "tokens" in bad.json()["error"]["message"]
    missing = httpx.post(server.url + "/tokenize", json={"model": "tiny"}, headers=KEY)
    assert missing.status_code == 400 and "prompt" in missing.json()["error"]["message"]
    other = httpx.post(server.url + "/tokenize", json={"model": "nope", "prompt": "x"}, headers=KEY)
    assert other.status_code == 404


def test_chat_template_is_applied_exactly(server, hub_cache, llm):
    _, tokenizer = hub_cache
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello server!"}]
    text = tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert text.startswith("[SYSTEM] Be brief.\n[USER] Hello server!\n[ASSISTANT]")
    want = tokenizer(text, add_special_tokens=False)["input_ids"]
    r = httpx.post(server.url + "/tokenize", json={"model": "tiny", "messages": messages}, headers=KEY)
    assert r.status_code == 200 and r.json()["tokens"] == want
    reply = client(server).chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    assert reply.usage.prompt_tokens == len(want)
    expected = llm.chat(messages, SamplingParams(max_tokens=6, temperature=0), chat_template=TEMPLATE,
                        use_tqdm=False)[0]
    assert expected.prompt_token_ids == want
    assert reply.choices[0].model_extra["token_ids"] == expected.output_token_ids


def test_generation_config_defaults_fill_only_unset_fields(server, llm):
    c = client(server)
    kw = dict(model="tiny", prompt="Hello world", extra_body={"ignore_eos": True})
    unset = c.completions.create(**kw).choices[0].model_extra["token_ids"]
    assert len(unset) == 5                                                   # max_new_tokens
    greedy = c.completions.create(max_tokens=9, temperature=0, **kw).choices[0].model_extra["token_ids"]
    assert len(greedy) == 9 and greedy[:5] == unset                          # temperature 0 by default
    sampled = c.completions.create(max_tokens=9, temperature=1.0, seed=3, **kw).choices[0].model_extra["token_ids"]
    assert sampled != greedy                                                 # a set temperature wins
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                     extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5
    assert llm.generation_defaults == {"temperature": 0, "max_tokens": 5, "min_p": 0.05}
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0, max_tokens=5, min_p=0.05)
    log = server.log_path.read_text()
    assert "sampling defaults from generation_config.json: temperature=0, min_p=0.05, max_tokens=5" in log


def test_startup_log_describes_the_engine(server):
    line = next(line for line in server.log_path.read_text().splitlines() if "engine ready:" in line)
    for part in (f"model {MODEL_ID} (", "served as tiny, tiny-alias", "float32 on cpu", "backend torch (asked for)",
                 "KV cache 63 blocks x 16 tokens = 1008 tokens", "max_model_len 300, max_num_seqs 256, "
                 "max_num_batched_tokens 1024", "CUDA graphs off", "start "):
        assert part in line, (part, line)


def _serve(*args: str, timeout: float = 60, **env) -> subprocess.CompletedProcess:
    import os
    full_env = dict(os.environ, PYTHONPATH=SRC, TRITON_INTERPRET="0", **env)
    return subprocess.run([sys.executable, "-m", "tripath.cli", "serve", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def test_a_port_in_use_fails_at_once_before_the_engine_builds():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.perf_counter()
        result = _serve("tiny-llama", "--backend", "torch", "--port", str(port), "--log-level", "info")
        elapsed = time.perf_counter() - start
    assert result.returncode == 1, result.stderr
    assert f"cannot listen on 0.0.0.0:{port}: the port is in use by another process" in result.stderr
    # at once: before anything of the engine (its core process, the model) started, whatever the machine's speed
    assert "--port" in result.stderr and "engine" not in result.stderr and "tiny-llama" not in result.stderr
    print(f"a port in use: exit after {elapsed:.2f} s (interpreter start included)")


def test_a_hub_id_missing_from_the_offline_cache_is_named(tmp_path):
    result = _serve("tripath-test/not-cached", "--backend", "torch", "--port", "0", HF_HUB_OFFLINE="1",
                    HF_HUB_CACHE=str(tmp_path))
    assert result.returncode == 1
    assert "'tripath-test/not-cached' is neither a local model directory nor a preset" in result.stderr
    assert f"not in the local cache ({tmp_path}), and HF_HUB_OFFLINE=1 forbids downloading it" in result.stderr


@pytest.mark.parametrize("argv, message", [
    (["tiny-llama", "--max-model-len", "4x"], "argument --max-model-len: '4x' is not a token count"),
    (["tiny-llama", "--max-num-batched-tokens", "1.5K"], "argument --max-num-batched-tokens: '1.5K': binary "
                                                         "suffixes take whole numbers"),
    (["tiny-llama", "--model", "tiny-qwen3"], "the model is given twice: 'tiny-llama' and --model 'tiny-qwen3'"),
    ([], "give the model: tripath serve MODEL"),
    (["tiny-llama", "--chat-template", "missing.jinja"], "--chat-template: chat template 'missing.jinja' is "
                                                          "neither a file that exists nor a Jinja template"),
    (["tiny-llama", "--generation-config", "no/such/folder"], "--generation-config: 'no/such/folder' is neither"),
    (["tiny-llama", "--api-key", ""], "--api-key is empty: give a key, or leave the option out"),
    (["tiny-llama", "--public-paths", "health"], "a public path must be an absolute path such as /health"),
    (["tiny-llama", "--header-timeout", "0"], "--header-timeout must be a positive number of seconds, got 0.0"),
    (["tiny-llama", "--body-timeout", "inf"], "--body-timeout must be a positive number of seconds, got inf"),
    (["tiny-llama", "--send-timeout", "-1"], "--send-timeout must be a positive number of seconds, got -1.0"),
    (["tiny-llama", "--max-connections", "0"], "--max-connections must be >= 1, got 0"),
    (["tiny-llama", "--max-structured-output-bytes", "0"], "--max-structured-output-bytes must be >= 1, got 0"),
])
def test_usage_errors_name_the_flag(capsys, argv, message):
    from tripath.cli import main

    assert main(["serve", *argv, "--port", "0"]) == 2
    assert message in capsys.readouterr().err


def test_help_shows_the_defaults(capsys):
    from tripath.cli import main

    assert main(["serve", "-h"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for part in ("[model]", "--max-queue-depth MAX_QUEUE_DEPTH engine requests allowed", "(default: 1024)",
                 "-tp TENSOR_PARALLEL_SIZE, --tensor-parallel-size", "--api-key", "--generation-config",
                 "(default: auto)", "k = 1000 and K = 1024", "Prefer the environment variable",
                 "default: /health /ping /version /metrics", "--disable-fastapi-docs", "--header-timeout SECONDS",
                 "(default: 10.0)", "--body-timeout SECONDS", "(default: 60.0)", "--send-timeout SECONDS",
                 "--max-connections N", "--max-structured-output-bytes BYTES", "(default: 65536)"):
        assert part in out, part


def test_token_counts_read_as_vllm_reads_them():
    import argparse

    from tripath.cli.engine_options import token_count

    assert [token_count(t) for t in ("300", "4k", "0.3k", "25.6k", "32K", "1M", "2m", "1G")] == \
        [300, 4000, 300, 25600, 32768, 1 << 20, 2_000_000, 1 << 30]
    for bad in ("4x", "-1", "1.5K", "k", "1.5", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            token_count(bad)


def test_the_api_key_middleware_and_its_environment_variables(monkeypatch):
    """In process, without an engine: the key check alone (public paths are exact matches, configurable), and
    TRIPATH_API_KEY before VLLM_API_KEY, read in tripath._env."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from tripath import _env
    from tripath.server.http.auth import APIKeyCheck

    ok = Starlette(routes=[Route(path, lambda r: PlainTextResponse("ok")) for path in
                           ("/v1/models", "/v10", "/health", "/tokenize", "/custom")])
    with TestClient(APIKeyCheck(ok, "k1")) as h:
        assert h.get("/v1/models").status_code == 401
        assert h.get("/v1/models", headers={"Authorization": "Bearer k2"}).json()["error"]["code"] == \
            "invalid_api_key"
        assert h.get("/v1/models", headers={"Authorization": "Bearer k1"}).text == "ok"
        assert h.get("/health").text == "ok"
        for path in ("/v10", "/tokenize", "/custom", "/health/x"):
            assert h.get(path).status_code == 401, path
    with TestClient(APIKeyCheck(ok, "k1", public_paths=["/custom"])) as h:
        assert h.get("/custom").text == "ok" and h.get("/health").status_code == 401
    with TestClient(APIKeyCheck(ok, "k1", public_paths=[])) as h:
        assert h.get("/health").status_code == 401
    with pytest.raises(ValueError, match="a public path must be an absolute path such as /health, got 'health'"):
        APIKeyCheck(ok, "k1", public_paths=["health"])
    monkeypatch.delenv("TRIPATH_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert _env.server_api_key() == (None, None)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert _env.server_api_key() == ("from-vllm", "VLLM_API_KEY")
    monkeypatch.setenv("TRIPATH_API_KEY", "from-env")
    assert _env.server_api_key() == ("from-env", "TRIPATH_API_KEY")
