"""The tokenizer helper process (``tripath.server.processes.tokenizer_process``) and the /tokenize and
/detokenize work it runs (``tripath.server.http.tokenizing``): a body sent to the helper is answered with the
same bytes as the worker thread's path, errors included; a helper that dies (killed while idle, or during a
call) is replaced by the next call; a closed one is gone."""

import asyncio
import json
import os
import signal
import threading
import time

import pytest

from server_process import running

pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from tripath.server.http.generation import APIError  # noqa: E402
from tripath.server.http.tokenizing import (DetokenizeRequest, TokenizeRequest, TokenizerSettings,  # noqa: E402
                                            detokenize_body, detokenize_reply, tokenize_body, tokenize_job,
                                            tokenize_reply)
from tripath.server.http.utility_routes import DETOKENIZE_IN_HELPER_IDS, TOKENIZE_IN_HELPER_BYTES  # noqa: E402
from tripath.server.processes.tokenizer_process import TokenizerProcess, TokenizerProcessDied  # noqa: E402
from tripath.server.transport.core_wire import tokenizer_handle  # noqa: E402

PROSE = "The quick brown fox jumps over the lazy dog; naïve café, 🙂 and <s> too. "


@pytest.fixture(scope="module")
def tokenizer(tiny_hf_dir):
    from tripath.models import load_tokenizer
    return load_tokenizer(tiny_hf_dir)


@pytest.fixture(scope="module")
def settings(tokenizer):
    return TokenizerSettings(max_model_len=256, vocab_size=len(tokenizer))


@pytest.fixture(scope="module")
def helper(tokenizer):
    process = TokenizerProcess(tokenizer_handle(tokenizer))
    assert process.handle[0] == "path"   # it loads the tokenizer from the directory the server loaded
    yield process
    process.close()


def _prompt_body(size: int, **fields) -> bytes:
    """A /tokenize body of exactly ``size`` bytes: prose as the prompt, spaces after it (JSON allows them)."""
    text = PROSE * (size // len(PROSE) + 1)
    excess = len(json.dumps({**fields, "prompt": text}).encode()) - size
    body = json.dumps({**fields, "prompt": text[:-excess]}).encode()   # a character is a byte or more
    return body + b" " * (size - len(body))


def _in_thread(tokenizer, body: bytes, settings) -> bytes:
    """What the worker thread's path answers for ``body``."""
    return tokenize_reply(tokenizer, tokenize_job(TokenizeRequest.model_validate_json(body)), settings)


def test_the_helper_answers_the_bytes_of_the_worker_threads_path(helper, tokenizer, settings):
    below, above = _prompt_body(TOKENIZE_IN_HELPER_BYTES - 1), _prompt_body(TOKENIZE_IN_HELPER_BYTES)
    assert len(below) < TOKENIZE_IN_HELPER_BYTES <= len(above)
    strs = _prompt_body(TOKENIZE_IN_HELPER_BYTES + 10, return_token_strs=True, add_special_tokens=False)
    chat = json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": PROSE * (TOKENIZE_IN_HELPER_BYTES // len(PROSE))}],
                       "add_generation_prompt": True}).encode()
    assert len(strs) >= TOKENIZE_IN_HELPER_BYTES and len(chat) >= TOKENIZE_IN_HELPER_BYTES
    for body in (below, above, strs, chat):
        local = _in_thread(tokenizer, body, settings)
        assert bytes(helper.call(tokenize_body, body, settings)) == local
        reply, text = json.loads(local), TokenizeRequest.model_validate_json(body).prompt
        if text is not None:
            assert reply["tokens"] == tokenizer.encode(text, add_special_tokens="add_special_tokens" not in
                                                       json.loads(body))
        assert reply["count"] == len(reply["tokens"]) > 10_000 and reply["max_model_len"] == 256

    ids = json.loads(_in_thread(tokenizer, above, settings))["tokens"]
    for count in (DETOKENIZE_IN_HELPER_IDS - 1, DETOKENIZE_IN_HELPER_IDS):
        body = json.dumps({"tokens": (ids * 2)[:count]}).encode()
        local = detokenize_reply(tokenizer, DetokenizeRequest.model_validate_json(body).tokens, settings)
        assert bytes(helper.call(detokenize_body, body, settings)) == local
        assert json.loads(local)["prompt"] == tokenizer.decode((ids * 2)[:count], skip_special_tokens=False)


def test_errors_cross_as_the_same_api_errors(helper, tokenizer, settings):
    refused = json.dumps({"messages": [{"role": "user", "content": "hi"}],
                          "chat_template_kwargs": {"tokenize": True}}).encode()
    with pytest.raises(APIError) as local:
        _in_thread(tokenizer, refused, settings)
    with pytest.raises(APIError) as helped:
        helper.call(tokenize_body, refused, settings)
    assert (helped.value.status, helped.value.message, helped.value.param) == \
        (local.value.status, local.value.message, local.value.param) == (400, local.value.message, "messages")
    assert "chat template" in local.value.message
    with pytest.raises(APIError, match=r"outside the vocabulary") as outside:
        helper.call(detokenize_body, json.dumps({"tokens": [5, len(tokenizer) + 3]}).encode(), settings)
    assert outside.value.status == 400 and outside.value.param == "tokens"
    with pytest.raises(RuntimeError, match="UnpicklableError: it stays in the helper"):
        helper.call(raise_unpicklable, b"")
    assert json.loads(helper.call(tokenize_body, b'{"prompt": "still here"}', settings))["count"] > 0


class UnpicklableError(Exception):
    def __init__(self, message, extra):   # unpickling calls UnpicklableError(message): a TypeError
        super().__init__(message)


def raise_unpicklable(tokenizer, payload):
    raise UnpicklableError("it stays in the helper", 1)


def exit_now(tokenizer, payload):
    os._exit(3)


def test_a_helper_that_dies_is_replaced_by_the_next_call(helper, settings):
    body = b'{"prompt": "hello there"}'
    expected = bytes(helper.call(tokenize_body, body, settings))
    idle = helper.pid
    os.kill(idle, signal.SIGKILL)   # killed while idle: the next call goes to a new helper, at once
    assert bytes(helper.call(tokenize_body, body, settings)) == expected
    assert helper.pid not in (None, idle)
    during = helper.pid
    with pytest.raises(TokenizerProcessDied, match=f"process {during} ended"):
        helper.call(exit_now, b"")   # the helper dies with the call: that call fails, not retried
    assert helper.pid is None and not running(during)
    assert bytes(helper.call(tokenize_body, body, settings)) == expected
    assert helper.pid not in (None, idle, during)


def sleep_then_echo(tokenizer, payload, seconds):
    time.sleep(seconds)
    return payload


def test_a_closed_helper_is_gone_and_its_calls_fail(tokenizer, settings):
    process = TokenizerProcess(tokenizer_handle(tokenizer))
    assert process.pid is None   # started on the first call
    assert asyncio.run(process.run(sleep_then_echo, b"echo", 0)) == b"echo"
    pid, outcome = process.pid, []

    def slow_call():
        try:
            outcome.append(asyncio.run(process.run(sleep_then_echo, b"never", 60)))
        except TokenizerProcessDied as error:
            outcome.append(error)

    waiting = threading.Thread(target=slow_call)
    waiting.start()
    time.sleep(0.5)
    process.close()
    waiting.join(10)
    assert isinstance(outcome[0], TokenizerProcessDied)   # the call in flight failed, at once
    assert not running(pid) and process.pid is None
    with pytest.raises(TokenizerProcessDied, match="closed"):
        process.call(tokenize_body, b'{"prompt": "hi"}', settings)
