"""Tool calling's parts without a server: each ``--tool-call-parser`` format (a whole text and the same text
streamed in random chunkings give identical calls and content; malformed output is content), the streamed
deltas as the openai SDK accumulates them, the JSON scanner, the tools' validation and the JSON schemas of a
forced call, and a conversation's tool calls and results reaching the chat template."""

import json
import random

import pytest

jsonschema = pytest.importorskip("jsonschema")

from tripath.engine.chat import normalise_messages, render_chat  # noqa: E402
from tripath.server.http.tools import ChoiceToolStream, ToolError, ToolSettings, plan_tools  # noqa: E402
from tripath.server.http.tools.base import CallArgs, CallEnd, CallStart, Content  # noqa: E402
from tripath.server.http.tools.formats import (PARSERS, HermesParser, Llama3JsonParser, MistralParser,  # noqa: E402
                                          NamedParser, PythonicParser, RequiredParser)
from tripath.server.http.tools.json_scan import ObjectScanner  # noqa: E402
from tripath.server.http.tools.schema import named_schema, required_schema, tool_choice_mode, validate_tools  # noqa: E402

TOOLS = ["get_weather", "add", "no_args"]

# (parser, text, expected content, expected [(name, arguments as a value)])
WELL_FORMED = [
    (HermesParser, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": '
                   '[1, {"a": "}\\" <tool_call>"}]}}\n</tool_call>\n<tool_call>{"arguments": {"a": -1.5e3, "b": '
                   'true}, "name": "add"}</tool_call>\n',
     "Let me check.", [("get_weather", {"city": "Paris", "n": [1, {"a": '}" <tool_call>'}]}),
                       ("add", {"a": -1500.0, "b": True})]),
    (HermesParser, '<tool_call>{"name": "no_args"}</tool_call> and after', "and after", [("no_args", {})]),
    (HermesParser, '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2}"}</tool_call>', "", [("add", {"a": 2})]),
    (HermesParser, 'No call here <tool_ca but text, {"name": "add"}', 'No call here <tool_ca but text, {"name": "add"}',
     []),
    (Llama3JsonParser, '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", '
                       '"parameters": {"city": "X"}}', "", [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "X"})]),
    (Llama3JsonParser, ' {"name": "no_args", "parameters": {}}', "", [("no_args", {})]),
    (Llama3JsonParser, "The answer is 4.", "The answer is 4.", []),
    (MistralParser, 'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", '
                    '"arguments": {"city": "P"}}]', "Sure.", [("add", {"a": 1}), ("get_weather", {"city": "P"})]),
    (MistralParser, '[TOOL_CALLS]add[ARGS]{"a": 2}[TOOL_CALLS]get_weather{"city": "Q"}', "",
     [("add", {"a": 2}), ("get_weather", {"city": "Q"})]),
    (PythonicParser, '[get_weather(city="Pa]ris", days=-3, x=[1, (2, 3)], y={"k": None}), add(a=true)]', "",
     [("get_weather", {"city": "Pa]ris", "days": -3, "x": [1, [2, 3]], "y": {"k": None}}), ("add", {"a": True})]),
    (PythonicParser, "<|python_start|>[no_args()]<|python_end|>", "", [("no_args", {})]),
    (PythonicParser, "[get_weather(city='a\\'] \"b')] then text", "then text", [("get_weather", {"city": "a'] \"b"})]),
]

MALFORMED = [   # (parser, text): all content, and no call announced while streaming
    (HermesParser, 'Hi <tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>'),
    (HermesParser, "Hi <tool_call>not json</tool_call>"),
    (HermesParser, '<tool_call>{"name": 3, "arguments": {}}</tool_call>'),
    (HermesParser, '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>'),
    (HermesParser, '<tool_call>{"name": "add"'),   # cut off before its arguments began
    (Llama3JsonParser, '{"name": "John", "age": 3}'),
    (Llama3JsonParser, '{"title": "a JSON answer", "parameters": {}}'),
    (MistralParser, "[TOOL_CALLS] nothing parseable"),
    (PythonicParser, "[1] is a citation"),
    (PythonicParser, '[get_weather(city=__import__("os").system("echo hacked"))]'),
    (PythonicParser, '[get_weather("positional")]'),
    (PythonicParser, "[unknown_tool(a=1)]"),
]


def parse(cls, text, chunks=None, tools=TOOLS):
    """(content, calls as (name, arguments text), events) of ``text`` fed whole or in ``chunks``."""
    parser = cls(tools)
    events = []
    for chunk in chunks or [text]:
        events += parser.feed(chunk)
    events += parser.finish()
    return parser.content, [(c.name, c.arguments) for c in parser.calls], events, parser


def random_chunks(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 40)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def replay(events):
    """The content and calls a client assembles from the events."""
    content, calls = "", {}
    for e in events:
        if isinstance(e, Content):
            content += e.text
        elif isinstance(e, CallStart):
            calls[e.index] = [e.name, ""]
        elif isinstance(e, CallArgs):
            calls[e.index][1] += e.text
    return content, [tuple(c) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("cls,text,content,calls", WELL_FORMED)
def test_parsers_whole_and_streamed_agree(cls, text, content, calls):
    whole_content, whole_calls, events, _ = parse(cls, text)
    assert whole_content == content
    assert [(n, json.loads(a)) for n, a in whole_calls] == calls
    assert replay(events) == (whole_content, whole_calls)
    assert [e.arguments for e in events if isinstance(e, CallEnd)] == [a for _, a in whole_calls]
    rng = random.Random(hash(text) & 0xFFFF)
    for chunking in [list(text)] + [random_chunks(text, rng) for _ in range(40)]:
        streamed_content, streamed_calls, events, _ = parse(cls, text, chunking)
        assert (streamed_content, streamed_calls) == (whole_content, whole_calls), chunking
        assert replay(events) == (whole_content, whole_calls), chunking


@pytest.mark.parametrize("cls,text", MALFORMED)
def test_malformed_output_is_content(cls, text):
    content, calls, events, parser = parse(cls, text)
    assert (content, calls) == (text, [])
    rng = random.Random(7)
    for chunking in [list(text)] + [random_chunks(text, rng) for _ in range(20)]:
        content, calls, events, parser = parse(cls, text, chunking)
        assert (content, calls) == (text, []) and parser.started == 0
        assert replay(events) == (text, [])


def test_arguments_stream_as_they_arrive_and_markers_are_held_back():
    parser = HermesParser(TOOLS)
    assert parser.feed("Sure <tool_") == [Content("Sure")]   # the space and the partial marker wait
    assert parser.feed('call>{"name": "get_weather", "argu') == []   # no arguments yet: not announced
    events = parser.feed('ments": {"city": "Pa')
    assert isinstance(events[0], CallStart) and events[0].name == "get_weather"
    assert events[1] == CallArgs(0, '{"city": "Pa')
    assert parser.feed('ris"}') == [CallArgs(0, 'ris"}')]
    assert isinstance(parser.feed("}</tool_call>")[0], CallEnd)
    assert parser.feed(" done") == [Content("done")]
    # a number at the end may go on: held until it ends
    named = NamedParser("add")
    assert [type(e) for e in named.feed('{"a": 12')] == [CallStart, CallArgs]
    assert named.feed("3}") == [CallArgs(0, "3}"), CallEnd(0, '{"a": 123}')]


def test_a_call_that_breaks_after_it_was_announced():
    """Streams keep what they sent; the content is the text from where the call began, in both modes."""
    text = 'Hi <tool_call>{"name": "add", "arguments": {"a": 1, oops}}</tool_call>'
    content, calls, events, parser = parse(HermesParser, text)
    assert (content, calls, parser.started) == (text, [], 0)
    streamed, calls, events, parser = parse(HermesParser, text, list(text))
    assert (streamed, calls, len(parser.broken)) == (text, [], 1)
    assert replay(events) == (text, [("add", '{"a": 1, ')])
    # cut off by max_tokens in the middle of the arguments: the same
    content, calls, _, parser = parse(HermesParser, '<tool_call>{"name": "add", "arguments": {"a": 1')
    assert calls == [] and parser.started == 1 and content.startswith("<tool_call>")


def test_required_and_named_outputs():
    text = '[{"name": "add", "parameters": {"a": 1}}, {"name": "no_args", "parameters": {}}]'
    assert parse(RequiredParser, text)[:2] == ("", [("add", '{"a": 1}'), ("no_args", "{}")])
    cut = '[{"name": "add", "parameters": {"a"'
    assert parse(RequiredParser, cut)[:2] == (cut, [])
    parser = NamedParser("add")
    parser.feed('{"x": [1, 2]}')
    parser.finish()
    assert (parser.content, [(c.name, c.arguments) for c in parser.calls]) == ("", [("add", '{"x": [1, 2]}')])


def test_chat_deltas_accumulate_as_the_sdk_does():
    """``delta.tool_calls``: index, id, type and name once, then argument fragments; the SDK's accumulation
    (by index, arguments concatenated) gives the whole text's calls."""
    text = 'x <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' \
           '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    stream = ChoiceToolStream(HermesParser(TOOLS))
    content, calls = "", {}
    pieces = list(text)
    for i, piece in enumerate(pieces):
        delta_content, tool_calls = stream.push(piece, i == len(pieces) - 1)
        content += delta_content
        for entry in tool_calls:
            if "id" in entry:
                assert entry["index"] not in calls and entry["type"] == "function"
                calls[entry["index"]] = {"id": entry["id"], "name": entry["function"]["name"], "arguments": ""}
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
            calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
    assert content == "x"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [("get_weather", {"city": "Paris"}), ("add", {"a": 1})]
    assert stream.finish_reason("stop") == "tool_calls" and stream.finish_reason("length") == "length"


def test_object_scanner_spans_and_errors():
    text = 'xx{"name": "f", "arguments": {"a": [1, "]}"], "b": null}, "k": 1.5}tail'
    scanner = ObjectScanner(2)
    for end in range(3, len(text) + 1):   # one character at a time
        scanner.advance(text[:end])
    assert scanner.end == len(text) - 4 and scanner.error is None
    assert {m.key: text[m.value_start:m.value_end] for m in scanner.members} == \
        {"name": '"f"', "arguments": '{"a": [1, "]}"], "b": null}', "k": "1.5"}
    for bad in ('{"a" 1}', '{"a": 1,}', '{"a": [1}', "{'a': 1}", '{"a": tru}', '{"a": 01}'):
        scanner = ObjectScanner(0)
        scanner.advance(bad)
        assert scanner.error is not None and scanner.end is None, bad


def test_tool_validation_names_the_field():
    ok = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    assert validate_tools(ok)[0].name == "get_weather"
    bad = [
        ([{"type": "web_search"}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
         "tools[0].function.parameters"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"properties": []}}}],
         "tools[0].function.parameters.properties"),
        ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
         "tools[1].function.name"),
    ]
    for tools, param in bad:
        with pytest.raises(ToolError) as error:
            validate_tools(tools)
        assert error.value.param == param, (error.value.param, param)
    with pytest.raises(ToolError) as error:
        validate_tools([{"type": "function", "name": "f", "parameters": 3}], flat=True)
    assert error.value.param == "tools[0].parameters"
    tools = validate_tools(ok)
    assert tool_choice_mode(None, tools) == ("auto", None) and tool_choice_mode(None, []) == ("none", None)
    assert tool_choice_mode("required", []) == ("none", None)
    assert tool_choice_mode({"type": "function", "function": {"name": "get_weather"}}, tools) == \
        ("named", "get_weather")
    for choice in ({"type": "function", "function": {"name": "nope"}}, {"type": "function"}, "sometimes"):
        with pytest.raises(ToolError, match="tool_choice"):
            tool_choice_mode(choice, tools)


def test_auto_needs_the_flags():
    tools = [{"type": "function", "function": {"name": "f"}}]
    with pytest.raises(ToolError, match="--enable-auto-tool-choice") as error:
        plan_tools(tools, None, None, ToolSettings())
    assert error.value.param == "tool_choice"
    assert plan_tools(tools, "none", None, ToolSettings()).parses is False
    plan = plan_tools(tools, "auto", None, ToolSettings(True, "mistral"))
    assert plan.parser_class is MistralParser and plan.keeps_special_tokens
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ToolSettings(auto=True)
    with pytest.raises(ValueError, match="hermes"):
        ToolSettings(parser="nope")
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"}
    with pytest.raises(ToolError, match="response_format"):
        plan_tools(tools, "required", None, ToolSettings(), constrained=True)


def test_forced_call_schemas():
    point = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    tools = validate_tools([
        {"type": "function", "function": {"name": "move", "parameters": {
            "type": "object", "properties": {"to": {"$ref": "#/$defs/Point"}}, "required": ["to"],
            "$defs": {"Point": point}}}},
        {"type": "function", "function": {"name": "stop"}}])
    schema = required_schema(tools)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "move", "parameters": {"to": {"x": 1}}}, {"name": "stop", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "move", "parameters": {"to": {}}}], [{"name": "fly", "parameters": {}}],
                [{"name": "stop", "parameters": {"extra": 1}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert required_schema(tools, parallel=False)["maxItems"] == 1
    assert named_schema(tools[1]) == {"type": "object", "properties": {}, "additionalProperties": False}
    assert named_schema(tools[0])["$defs"] == {"Point": point}
    clash = validate_tools([{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "$defs": {"P": {"type": t}}}}} for n, t in (("a", "string"), ("b", "number"))])
    with pytest.raises(ToolError, match=r"\$defs.P"):
        required_schema(clash)


def test_tool_history_reaches_the_template():
    from server_models import build_tokenizer
    from tool_templates import HERMES_TOOLS_TEMPLATE

    tokenizer = build_tokenizer(HERMES_TOOLS_TEMPLATE)
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = render_chat(tokenizer, messages, template_kwargs={"tools": tools})
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n22 C, sunny\n</tool_response>" in text and '"name": "get_weather"' in text
    normalised = normalise_messages(messages)
    assert normalised[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert normalised[2]["tool_call_id"] == "call_1"
    for bad, where in (
            ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
             r"messages\[0\].tool_calls\[0\].function.arguments"),
            ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
             r"messages\[0\].tool_calls\[0\].function.arguments"),
            ({"role": "assistant", "tool_calls": [{"type": "function"}]}, r"messages\[0\].tool_calls\[0\]"),
            ({"role": "user", "content": "x", "tool_calls": []}, r"messages\[0\].tool_calls"),
            ({"role": "tool", "content": "x", "tool_call_id": 5}, r"messages\[0\].tool_call_id")):
        with pytest.raises((ValueError, TypeError), match=where):
            normalise_messages([bad])


SOUP = ['<tool_call>', '</tool_call>', '[TOOL_CALLS]', '[ARGS]', '<|python_tag|>', '<|python_start|>', '{', '}',
        '[', ']', '(', ')', '"', "'", '\\', ':', ',', ';', ' ', '\n', '"name"', '"arguments"', '"parameters"',
        '"add"', '"get_weather"', 'add', 'get_weather', 'a=', '1', '-2.5e3', 'true', 'null', 'x', 'é', '"s"']


@pytest.mark.parametrize("cls", [*PARSERS.values(), RequiredParser])
def test_random_text_parses_the_same_whole_and_streamed(cls):
    """Whatever the text (a soup of the formats' pieces), no parser raises, and feeding it whole or in any
    chunking gives the same content and calls; every call's arguments is the JSON text of an object."""
    rng = random.Random(sum(map(ord, cls.__name__)))
    for _ in range(300):
        text = "".join(rng.choice(SOUP) for _ in range(rng.randint(0, 30)))
        if rng.random() < 0.3:   # a well-formed call among the soup
            text += rng.choice(['<tool_call>{"name": "add", "arguments": {"a": [1, "}"]}}</tool_call>',
                                '{"name": "add", "parameters": {"a": 1}}', '[add(a=1)]',
                                '[TOOL_CALLS][{"name": "add", "arguments": {}}]',
                                '[{"name": "add", "parameters": {"a": 1}}]'])
            text += "".join(rng.choice(SOUP) for _ in range(rng.randint(0, 5)))
        whole = parse(cls, text)[:2]
        for chunking in (list(text), random_chunks(text, rng)):
            assert parse(cls, text, chunking)[:2] == whole, (text, chunking)
        for _, arguments in whole[1]:
            assert isinstance(json.loads(arguments), dict)
        if not whole[1] and "[]" not in text.replace(" ", "").replace("\n", ""):   # an empty call list is dropped
            assert whole[0] == text   # no call: the text is the content, all of it
