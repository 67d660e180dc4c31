"""Tool calling and ``/v1/responses`` as a client meets them: ``tripath serve`` on the tiny random Llama (a real
process on loopback, CPU, torch backend) and the openai SDK. Structured output makes ``tool_choice``
``required`` and a named function produce valid calls whatever the weights: their arguments validate against
the tool's schema, streamed or not. ``auto`` needs ``--enable-auto-tool-choice`` (a 400 naming it without).
``client.responses.create`` and the SDK's ``responses.stream`` helper (which checks the events' order and
identities) read the Responses API's answers."""

import json

import httpx
import pytest

from server_process import ServerProcess

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")
pytest.importorskip("xgrammar")

pytestmark = pytest.mark.usefixtures("pure_torch_one_thread")

NAME = "tiny-hf"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Hello world"}]
# the tiny model's template, rendering an assistant's tool calls and a tool result's id too
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% for c in m.tool_calls or [] %}"
            "<call {{ c.function.name }} {{ c.function.arguments | tojson }}>{% endfor %}"
            "{% if m.tool_call_id %}<for {{ m.tool_call_id }}>{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def server(tiny_hf_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    proc = ServerProcess(["--model", tiny_hf_dir, "--served-model-name", NAME, "--backend", "torch",
                          "--num-kv-blocks", "64", "--max-model-len", "256", "--chat-template", TEMPLATE], log)
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _check_calls(calls, names):
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed_chat(client, **kw):
    """Content, tool calls (assembled by index, as the SDK's helpers do) and finish reason of a streamed chat."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for entry in choice.delta.tool_calls or ():
                call = calls.setdefault(entry.index, {"id": None, "name": None, "arguments": ""})
                if entry.id is not None:
                    assert call["id"] is None, "id sent twice"
                    call["id"], call["name"] = entry.id, entry.function.name
                call["arguments"] += entry.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("parallel", [False, None])
def test_required_makes_valid_calls(client, parallel):
    kw = dict(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0.8,
              seed=3)
    if parallel is not None:
        kw["parallel_tool_calls"] = parallel
    reply = client.chat.completions.create(**kw)
    choice = reply.choices[0]
    if choice.finish_reason == "length":   # several calls may not fit in 200 tokens
        assert parallel is None
        return
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls, SCHEMAS)
    if parallel is False:
        assert len(choice.message.tool_calls) == 1
    content, calls, finish = _streamed_chat(client, **kw)   # the same seed: the same calls, streamed
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_named_function_makes_a_valid_call(client):
    kw = dict(model=NAME, messages=ASK, tools=TOOLS, max_tokens=100, temperature=1.0,
              tool_choice={"type": "function", "function": {"name": "get_time"}})
    for seed in (1, 2):
        reply = client.chat.completions.create(seed=seed, **kw)
        calls = reply.choices[0].message.tool_calls
        _check_calls(calls, ["get_time"])
        assert len(calls) == 1 and reply.choices[0].finish_reason == "stop"   # a named function: as vLLM, OpenAI
        content, streamed, finish = _streamed_chat(client, seed=seed, **kw)
        assert finish == "stop" and content == ""
        assert [(c["name"], c["arguments"]) for c in streamed] == [("get_time", calls[0].function.arguments)]
    with client.chat.completions.stream(seed=2, **kw) as stream:   # the SDK's accumulating helper
        final = stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls
    assert (call.id.startswith("chatcmpl-tool-"), call.function.name) == (True, "get_time")
    assert call.function.arguments == calls[0].function.arguments


def test_tool_choice_errors_and_none(client, server):
    for body, words in (
            ({"tools": TOOLS}, "--enable-auto-tool-choice"),                       # unset means auto
            ({"tools": TOOLS, "tool_choice": "auto"}, "--enable-auto-tool-choice"),
            ({"tool_choice": "auto"}, "needs tools"),
            ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
            ({"tools": [{"type": "web_search"}], "tool_choice": "none"}, "tools[0].type"),
            ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "none"},
             "tools[0].function.name"),
            ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
             "response_format"),
            ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "only assistant"),
            ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                                 "function": {"name": "f", "arguments": "{no"}}]}]},
             "arguments")):
        r = httpx.post(server.url + "/v1/chat/completions", json={"model": NAME, "messages": ASK, "max_tokens": 4,
                                                                  **body}, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert words in r.json()["error"]["message"], (words, r.text)
    reply = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4,
                                           extra_body={"ignore_eos": True})
    assert reply.choices[0].message.tool_calls in (None, []) and reply.choices[0].finish_reason == "length"


def test_history_with_tool_calls_reaches_the_template(client, server):
    """An assistant turn with tool_calls and content null, then the tool's result: rendered (the arguments as
    an object), answered."""
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    reply = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=3, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"
    r = httpx.post(server.url + "/tokenize", json={"messages": history}, timeout=60)
    assert r.status_code == 200, r.text
    text = httpx.post(server.url + "/detokenize", json={"tokens": r.json()["tokens"]}, timeout=60).json()["prompt"]
    assert '<|assistant|><call get_time {"zone": "UTC"}>' in text and "<|tool|>12:00<for call_1>" in text


def test_responses_api(client):
    reply = client.responses.create(model=NAME, input="Hello world", instructions="Be brief.", max_output_tokens=5,
                                    extra_body={"ignore_eos": True})
    assert reply.object == "response" and reply.status == "incomplete" and reply.id.startswith("resp_")
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 5 and reply.usage.input_tokens > 0
    assert reply.usage.total_tokens == reply.usage.input_tokens + 5
    [message] = reply.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert reply.output_text == message.content[0].text
    # the same request streamed, through the SDK's helper: the same text
    with client.responses.stream(model=NAME, input="Hello world", instructions="Be brief.", max_output_tokens=5,
                                 extra_body={"ignore_eos": True}) as stream:
        kinds = [event.type for event in stream]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert "response.output_text.delta" in kinds and "response.output_text.done" in kinds
    events = list(client.responses.create(model=NAME, input="Hello world", max_output_tokens=4, stream=True,
                                          extra_body={"ignore_eos": True}))
    assert type(events[0]).__name__ == "ResponseCreatedEvent" and events[0].response.status == "in_progress"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = events[-1]
    assert type(last).__name__ == "ResponseIncompleteEvent" and last.response.usage.output_tokens == 4
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == last.response.output_text
    # structured output: a tool call is forced, then the conversation continues with its result
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in TOOLS]
    reply = client.responses.create(model=NAME, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Weather?"}]}], tools=tools, tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=200)
    assert reply.status == "completed"
    [call] = reply.output
    assert call.type == "function_call" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    with client.responses.stream(model=NAME, input="Weather?", tools=tools, max_output_tokens=200,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    [call] = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == call.arguments == done[0].arguments
    follow_up = [{"role": "user", "content": "Weather?"},
                 {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                 {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    reply = client.responses.create(model=NAME, input=follow_up, tools=tools, tool_choice="none",
                                    max_output_tokens=3, extra_body={"ignore_eos": True})
    assert reply.output[0].type == "message" and reply.usage.output_tokens == 3


def test_responses_api_refuses_what_it_does_not_do(server):
    url = server.url + "/v1/responses"
    for extra, word in (({"previous_response_id": "resp_1"}, "previous_response_id"),
                        ({"background": True}, "background"),
                        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
                        ({"tools": [{"type": "function", "name": "f"}]}, "--enable-auto-tool-choice"),
                        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
                        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                         "input[0].content[0]"),
                        ({"truncation": "auto"}, "truncation"),
                        ({"temperature": -1}, "temperature")):
        r = httpx.post(url, json={"model": NAME, "input": "hi", **extra}, timeout=60)
        assert r.status_code == 400 and word in r.json()["error"]["message"], (extra, r.text)
    assert httpx.post(url, json={"model": "other", "input": "hi"}, timeout=60).status_code == 404
    assert httpx.get(url + "/resp_123", timeout=60).status_code == 404


@pytest.mark.parametrize("argv, message", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser (one of hermes, "),
    (["--tool-call-parser", "nope"], "argument --tool-call-parser: invalid choice: 'nope'"),
])
def test_tool_flags_usage_errors(capsys, argv, message):
    from tripath.cli import main

    assert main(["serve", "tiny-llama", *argv, "--port", "0"]) == 2
    assert message in capsys.readouterr().err


def test_the_stop_token_adds_no_text(client, server):
    """The token that ends a choice (here a stop_token_ids entry) is in token_ids but not in the text, unless
    include_stop_str_in_output (as vLLM; what keeps an EOS out of the text when a tool parser keeps special
    tokens)."""
    [token] = httpx.post(server.url + "/tokenize", json={"prompt": "g", "add_special_tokens": False},
                         timeout=60).json()["tokens"]
    for include, text in ((False, ""), (True, "g")):
        choice = client.completions.create(model=NAME, prompt="Hello world", max_tokens=5, extra_body={
            "ignore_eos": True, "stop_token_ids": [token], "logit_bias": {str(token): 100},
            "include_stop_str_in_output": include}).choices[0]
        assert (choice.model_extra["token_ids"], choice.finish_reason, choice.text) == ([token], "stop", text)
