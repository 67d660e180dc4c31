"""Completion and chat prompts of large texts, tokenised in the tokenizer helper process
(``tripath.server.http.large_prompts``): the helper reads the prompt from the request's body again and answers
the ids the worker thread's path computes, or only their count when they leave no room within
``max_model_len``; its errors are the worker thread's, raised again in the API server."""

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from tripath.engine.chat import chat_token_ids, encode_text  # noqa: E402
from tripath.server.http import protocol as P  # noqa: E402
from tripath.server.http.generation import APIError  # noqa: E402
from tripath.server.http.large_prompts import (PROMPT_IN_HELPER_CHARS, chat_ids, chat_messages,  # noqa: E402
                                               chat_prompt_reply, completion_prompt_reply, pack_ids, unpack_ids)
from tripath.server.http.openai_responses import ResponsesRequest, chat_request, responses_messages  # noqa: E402
from tripath.server.processes.tokenizer_process import TokenizerProcess  # noqa: E402
from tripath.server.transport.core_wire import tokenizer_handle  # noqa: E402

PROSE = "Large prompts: naïve café, 🙂, <s> and </s> too. "
TEXT = PROSE * (PROMPT_IN_HELPER_CHARS // len(PROSE) + 1)
NO_LIMIT = 1 << 30


@pytest.fixture(scope="module")
def tokenizer(tiny_hf_dir):
    from tripath.models import load_tokenizer
    return load_tokenizer(tiny_hf_dir)


@pytest.fixture(scope="module")
def helper(tokenizer):
    process = TokenizerProcess(tokenizer_handle(tokenizer))
    yield process
    process.close()


def _raised(fn, *args) -> APIError:
    with pytest.raises(APIError) as caught:
        fn(*args)
    return caught.value


def test_ids_pack_with_their_count_and_only_when_they_leave_room():
    ids = [0, 1, 2**31 - 1, 7]
    assert unpack_ids(pack_ids(ids, 5), 5) == ids
    assert len(pack_ids(ids, 4)) == 4   # the count alone
    error = _raised(unpack_ids, pack_ids(ids, 4), 4)
    assert error.status == 400 and error.param == "prompt" and "prompt (4 tokens) leaves no room" in error.message
    assert unpack_ids(pack_ids([], 1), 1) == []


def test_a_completions_prompt_read_in_the_helper_has_the_worker_threads_ids(helper, tokenizer):
    assert len(TEXT) >= PROMPT_IN_HELPER_CHARS
    body = json.dumps({"model": "m", "prompt": ["Hi", TEXT[:1000], TEXT], "max_tokens": 1}).encode()
    assert P.CompletionRequest.model_validate_json(body).prompts()[2] == TEXT
    for index in (1, 2):
        expected = encode_text(tokenizer, json.loads(body)["prompt"][index])
        reply = helper.call(completion_prompt_reply, body, index, f"prompt[{index}]", NO_LIMIT)
        assert unpack_ids(reply, NO_LIMIT) == expected and len(expected) > (10_000 if index == 2 else 100)
    limit = len(encode_text(tokenizer, TEXT))   # exactly max_model_len tokens: no room to generate
    reply = helper.call(completion_prompt_reply, body, 2, "prompt[2]", limit)
    assert len(reply) == 4
    assert _raised(unpack_ids, reply, limit).message == (
        f"the prompt ({limit} tokens) leaves no room to generate within max_model_len ({limit})")


def test_a_chat_prompt_read_in_the_helper_has_the_worker_threads_ids(helper, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    body = json.dumps({"model": "m", "messages": messages}).encode()
    assert len(body) >= PROMPT_IN_HELPER_CHARS
    expected = chat_token_ids(tokenizer, chat_messages(body), True, {})
    for add_generation_prompt in (True, False):
        reply = helper.call(chat_prompt_reply, body, chat_messages, add_generation_prompt, {}, None, NO_LIMIT)
        assert unpack_ids(reply, NO_LIMIT) == chat_token_ids(tokenizer, chat_messages(body), add_generation_prompt,
                                                             {})
    assert len(expected) > 10_000
    refusing = "{{ raise_exception('no system messages here') }}"
    local = _raised(chat_ids, tokenizer, chat_messages(body), True, {}, refusing)
    remote = _raised(helper.call, chat_prompt_reply, body, chat_messages, True, {}, refusing, NO_LIMIT)
    assert (remote.status, remote.message, remote.param) == (local.status, local.message, local.param)
    assert local.param == "messages" and "no system messages here" in local.message


def test_a_responses_body_gives_the_chat_paths_messages(helper, tokenizer):
    body = json.dumps({"model": "m", "instructions": "Be brief.", "input": [
        {"role": "user", "content": TEXT},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"}]}).encode()
    state = type("State", (), {"tool_settings": None})()
    chat = chat_request(state, ResponsesRequest.model_validate_json(body))
    assert responses_messages(body) == [m.model_dump(exclude_none=True) for m in chat.messages]
    reply = helper.call(chat_prompt_reply, body, responses_messages, True, {}, None, NO_LIMIT)
    assert unpack_ids(reply, NO_LIMIT) == chat_token_ids(tokenizer, responses_messages(body), True, {})
