"""``tripath serve`` with vLLM's command line (docs/COMPATIBILITY.md's table, checked against the parser): every
option of the table parses, the refused ones are refused naming the option; a real process started with the
command line of vLLM's users serves; ``--response-role``, ``--max-logprobs``, ``/tokenizer_info``,
``stop_reason`` and ``prompt_logprobs`` as vLLM's; ``--revision`` and ``--download-dir`` of a hub id."""

import json
import re
from pathlib import Path

import httpx
import pytest

from server_process import ServerProcess

pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from tripath.cli.vllm_flags import VLLM_OPTIONS, markdown_table  # noqa: E402

pytestmark = pytest.mark.usefixtures("pure_torch_one_thread")
COMPATIBILITY = Path(__file__).resolve().parents[1] / "docs" / "COMPATIBILITY.md"


def test_the_compatibility_page_shows_the_table():
    assert markdown_table() in COMPATIBILITY.read_text()


@pytest.mark.parametrize("row", VLLM_OPTIONS, ids=[o.option for o in VLLM_OPTIONS])
def test_every_vllm_option_parses_and_the_refused_ones_name_themselves(row, capsys):
    from tripath.cli import main
    from tripath.cli.serve import _refused, build_parser

    args = build_parser().parse_args(["tiny-llama", *row.example])
    refused = _refused(args)
    if row.refused:
        assert refused is not None and row.example[0] in refused
        assert main(["serve", "tiny-llama", *row.example, "--port", "0"]) == 2
        assert row.example[0] in capsys.readouterr().err
    else:
        assert refused is None, refused


def test_vllm_values_parse_as_vllm_means_them():
    from tripath.cli.engine_options import engine_options
    from tripath.cli.serve import build_parser

    args = build_parser().parse_args(["m", "--dtype", "float", "--no-enable-prefix-caching", "--no-enable-chunked-"
                                      "prefill", "--kv-cache-dtype", "fp8_e4m3", "--revision", "v1", "--download-dir",
                                      "/d"])
    options = engine_options(args)
    assert options["dtype"] == "float" and options["kv_cache_dtype"] == "fp8"
    assert options["enable_prefix_caching"] is False and options["enable_chunked_prefill"] is False
    assert options["revision"] == "v1" and options["download_dir"] == "/d"
    assert engine_options(build_parser().parse_args(["m", "--no-prefix-caching"]))["enable_prefix_caching"] is False
    defaults = engine_options(build_parser().parse_args(["m"]))
    assert defaults["enable_prefix_caching"] is True and defaults["enable_chunked_prefill"] is True
    assert build_parser().parse_args(["m"]).host == "0.0.0.0"


@pytest.fixture(scope="module")
def server(tiny_hf_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    proc = ServerProcess([tiny_hf_dir, "--served-model-name", "m", "--backend", "torch", "--enable-prefix-caching",
                          "--enable-chunked-prefill", "--uvicorn-log-level", "warning", "--trust-remote-code",
                          "--dtype", "float", "--response-role", "bot", "--max-logprobs", "5",
                          "--enable-tokenizer-info-endpoint", "--host", "127.0.0.1", "--disable-log-requests"], log)
    yield proc
    proc.close()


def test_a_vllm_command_line_serves_with_its_role_and_logprob_bound(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        chat = client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 3,
                                                         "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "bot"
        streamed = client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 3, "stream": True,
                                                             "messages": [{"role": "user", "content": "hi"}]})
        first = json.loads(streamed.text.split("\n\n")[0][6:])
        assert first["choices"][0]["delta"]["role"] == "bot"
        for body in ({"prompt": "x", "logprobs": 6}, {"prompt": "x", "prompt_logprobs": 6},
                     {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 6}):
            route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = client.post(route, json={"model": "m", "max_tokens": 2, **body})
            assert r.status_code == 400 and "--max-logprobs (5)" in r.json()["error"]["message"], r.text


def test_tokenizer_info_is_what_a_remote_tokenizer_reads(server, tiny_hf_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_hf_dir)
    info = httpx.get(server.url + "/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["chat_template"] == tokenizer.chat_template and info["vocab_size"] == len(tokenizer)
    assert info["tokenizer_class"] == type(tokenizer).__name__ and info["model_max_length"] > 0


def test_tokenizer_info_needs_its_flag(tiny_hf_dir, tmp_path):
    proc = ServerProcess([tiny_hf_dir, "--backend", "torch"], tmp_path / "server.log")
    try:
        assert httpx.get(proc.url + "/tokenizer_info", timeout=30).status_code == 404
    finally:
        proc.close()


def test_stop_reason_names_the_stop_string_or_token_and_prompt_logprobs_come_back(server, tiny_hf_dir):
    from tripath.engine import LLM, SamplingParams

    llm = LLM(tiny_hf_dir, backend="torch", num_kv_blocks=64)
    tokens = llm.generate(["The quick brown"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                          use_tqdm=False)[0].output_token_ids
    text = llm.tokenizer.decode(tokens[:6])
    with httpx.Client(base_url=server.url, timeout=60) as client:
        base = {"model": "m", "prompt": "The quick brown", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        plain = client.post("/v1/completions", json=base).json()["choices"][0]
        assert plain["finish_reason"] == "length" and plain["stop_reason"] is None
        by_token = client.post("/v1/completions", json={**base, "stop_token_ids": [tokens[3]]}).json()["choices"][0]
        assert by_token["finish_reason"] == "stop" and by_token["stop_reason"] == tokens[3]
        stop = text[-3:]
        by_string = client.post("/v1/completions", json={**base, "stop": [stop]}).json()["choices"][0]
        assert by_string["finish_reason"] == "stop" and by_string["stop_reason"] == stop
        streamed = client.post("/v1/completions", json={**base, "stop": [stop], "stream": True}).text
        last = [json.loads(e[6:]) for e in streamed.split("\n\n") if e.startswith("data: {")][-1]
        assert last["choices"][0]["stop_reason"] == stop
        scored = client.post("/v1/completions", json={**base, "prompt_logprobs": 2}).json()["choices"][0]
        positions = scored["prompt_logprobs"]
        prompt_ids = llm.tokenizer.encode("The quick brown")
        assert positions[0] is None and len(positions) == len(prompt_ids)
        for token, entry in zip(prompt_ids[1:], positions[1:]):
            assert str(token) in entry and 2 <= len(entry) <= 3
            assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
        chat = client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2, "prompt_logprobs": 1,
                                                         "messages": [{"role": "user", "content": "hi"}]}).json()
        assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 2
        refused = client.post("/v1/completions", json={**base, "prompt_logprobs": 1, "stream": True})
        assert refused.status_code == 400 and "prompt_logprobs cannot be streamed" in refused.text


def test_revision_and_download_dir_of_a_hub_id(tiny_hf_dir, tmp_path, monkeypatch):
    """A hub id read from ``download_dir`` (a Hugging Face cache laid out as huggingface_hub lays it out) at a
    ``revision``; a revision the cache does not hold is named."""
    import shutil

    from tripath.engine import LLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = tmp_path / "cache" / "models--tripath-test--tiny"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "v1").write_text(commit)
    shutil.copytree(tiny_hf_dir, root / "snapshots" / commit)
    llm = LLM("tripath-test/tiny", backend="torch", num_kv_blocks=16, revision="v1",
              download_dir=str(tmp_path / "cache"))
    assert Path(llm.model_path) == root / "snapshots" / commit and llm.tokenizer is not None
    with pytest.raises(FileNotFoundError, match=re.escape("tripath-test/tiny")):
        LLM("tripath-test/tiny", backend="torch", num_kv_blocks=16, revision="v2", download_dir=str(tmp_path / "cache"))
