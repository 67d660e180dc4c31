"""An agent's loop on a real model: ``tripath serve`` SmolLM2-135M-Instruct (CPU, torch backend) with
``--enable-auto-tool-choice --tool-call-parser hermes`` and a ChatML template that renders tools, tool calls and
tool results in the Hermes style (the model's own template ignores them). The openai SDK asks a question with
a tool; on ``tool_calls`` it runs the tool and sends back the assistant message with its ``tool_calls`` and a
``tool`` message with ``tool_call_id`` and the result, until the model answers. With ``auto`` the 135M model
may or may not call the tool: the loop completes and every shape is right; ``required`` and a named function
always call it. The second turn's prompt, rendered by ``/tokenize``, holds the call and the result."""

import json

import httpx
import pytest

from server_process import ServerProcess

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")
pytest.importorskip("xgrammar")

NAME = "smollm2"
QUESTION = "What is the weather in Paris right now?"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                   "required": ["city"]}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def get_weather(city) -> str:
    return json.dumps({"city": city, "forecast": "sunny", "celsius": 22})


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    from tool_templates import HERMES_TOOLS_TEMPLATE

    folder = tmp_path_factory.mktemp("agent")
    template = folder / "hermes_tools.jinja"
    template.write_text(HERMES_TOOLS_TEMPLATE)
    proc = ServerProcess(["--model", smollm2, "--served-model-name", NAME, "--backend", "torch",
                          "--num-kv-blocks", "160", "--max-model-len", "1024", "--enable-auto-tool-choice",
                          "--tool-call-parser", "hermes", "--chat-template", str(template)], folder / "server.log")
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _rendered(server, messages) -> str:
    """The prompt text a chat request of ``messages`` (with the tools) renders."""
    r = httpx.post(server.url + "/tokenize", json={"model": NAME, "messages": messages, "tools": TOOLS}, timeout=60)
    assert r.status_code == 200, r.text
    return httpx.post(server.url + "/detokenize", json={"tokens": r.json()["tokens"]}, timeout=60).json()["prompt"]


def _streamed(client, **kw):
    """A streamed turn as an assistant message dict (content, tool_calls assembled by index) and its finish."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for entry in delta.tool_calls or ():
            if entry.id is not None:
                calls[entry.index] = {"id": entry.id, "type": "function",
                                      "function": {"name": entry.function.name, "arguments": ""}}
            calls[entry.index]["function"]["arguments"] += entry.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish


@pytest.mark.parametrize("tool_choice,stream", [("auto", False), ("auto", True), ("required", True),
                                                (NAMED, False)])
def test_agent_loop(client, server, tool_choice, stream):
    messages = [{"role": "user", "content": QUESTION}]
    calls_made = 0
    for turn in range(3):
        kw = dict(model=NAME, messages=messages, tools=TOOLS, tool_choice=tool_choice if turn == 0 else "auto",
                  parallel_tool_calls=False, max_tokens=40, temperature=0)
        if stream:
            message, finish = _streamed(client, **kw)
        else:
            choice = client.chat.completions.create(**kw).choices[0]
            message, finish = choice.message.model_dump(exclude_none=True), choice.finish_reason
        assert message["role"] == "assistant"
        assert "<|im_end|>" not in (message.get("content") or "")   # special tokens kept (hermes), the EOS not
        if not message.get("tool_calls"):
            assert finish in ("stop", "length") and isinstance(message.get("content"), str)
            break
        assert finish == ("stop" if turn == 0 and tool_choice == NAMED else "tool_calls")   # named: as vLLM
        messages.append(message)
        results = []
        for call in message["tool_calls"]:
            assert call["type"] == "function" and call["id"] and call["function"]["name"] == "get_weather"
            arguments = json.loads(call["function"]["arguments"])
            assert isinstance(arguments, dict)
            results.append((arguments, get_weather(arguments.get("city"))))
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": results[-1][1]})
        calls_made += len(results)
        text = _rendered(server, messages)   # the next turn's prompt: the call and its result are in it
        for arguments, result in results:
            assert '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(arguments) + "}" in text
            assert f"<tool_response>\n{result}\n</tool_response>" in text
    else:   # the model kept calling: it answers once tools are off
        reply = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, tool_choice="none",
                                               max_tokens=24, temperature=0)
        assert isinstance(reply.choices[0].message.content, str) and not reply.choices[0].message.tool_calls
    if tool_choice != "auto":
        assert calls_made >= 1
        assert messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
