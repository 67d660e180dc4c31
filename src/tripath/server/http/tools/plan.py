"""What a request's tools make of its generation (:class:`ToolPlan`), and its output as tool calls.

The server's settings (:class:`ToolSettings`) are vLLM's flags: ``--enable-auto-tool-choice`` lets
``tool_choice: "auto"`` parse the output with ``--tool-call-parser``'s format. A request's plan
(:func:`plan_tools`):

=============  ==================================  ===========================================================
tool_choice    the generation                      the output
=============  ==================================  ===========================================================
``none``       tools rendered by the chat template  content only
``auto``       the same (the flags are needed:      the parser's calls and content; the parser's markers are
               a 400 naming them otherwise)         kept in the decoded text where they are special tokens
``required``   constrained to a JSON array of       the array's calls
               ``{"name", "parameters"}``
named          constrained to its arguments         one call of that function
=============  ==================================  ===========================================================

Unset, ``tool_choice`` is ``auto`` when tools are sent (vLLM's default). A choice whose output made calls
finishes with ``finish_reason: "tool_calls"`` (a truncated one keeps ``"length"``; a named function's,
``"stop"``, as vLLM and OpenAI answer it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from tripath.server.http.tools.base import CallArgs, CallStart, Content, ToolCall, ToolParser, chat_tool_id
from tripath.server.http.tools.formats import PARSERS, NamedParser, RequiredParser, mistral_tool_id
from tripath.server.http.tools.schema import Tool, ToolError, required_schema, named_schema, tool_choice_mode, \
    validate_tools

AUTO_FLAGS = "--enable-auto-tool-choice and --tool-call-parser"


@dataclass(frozen=True)
class ToolSettings:
    """The server's tool-call settings: ``auto`` (``--enable-auto-tool-choice``) and ``parser``
    (``--tool-call-parser``, one of :data:`~tripath.server.http.tools.formats.PARSERS`)."""

    auto: bool = False
    parser: str | None = None

    def __post_init__(self):
        if self.parser is not None and self.parser not in PARSERS:
            raise ValueError(f"tool_call_parser {self.parser!r} is not known; choose one of {', '.join(PARSERS)}")
        if self.auto and self.parser is None:
            raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser (one of {', '.join(PARSERS)})")


@dataclass
class ToolPlan:
    tools: list[Tool]
    mode: str                                   # none | auto | required | named
    function: str | None = None                 # named: the function
    parser_class: type[ToolParser] | None = None  # auto: the format
    schema: dict | None = None                  # required / named: the constraint
    new_id: Callable[[], str] = field(default=chat_tool_id)

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    @property
    def keeps_special_tokens(self) -> bool:
        return self.mode == "auto" and self.parser_class.keeps_special_tokens

    def template_tools(self) -> list[dict]:
        """The tools as chat templates take them (the chat API's shape)."""
        return [t.chat() for t in self.tools]

    def parser(self, new_id: Callable[[], str] | None = None) -> ToolParser | None:
        """A fresh parser of one choice's output (None: ``tool_choice: "none"``)."""
        new_id = new_id or self.new_id
        names = [t.name for t in self.tools]
        if self.mode == "auto":
            return self.parser_class(names, new_id)
        if self.mode == "required":
            return RequiredParser(names, new_id)
        if self.mode == "named":
            return NamedParser(self.function, new_id)
        return None

    def extract(self, text: str, new_id: Callable[[], str] | None = None) -> tuple[str, list[ToolCall]]:
        """A whole output's content and calls."""
        parser = self.parser(new_id)
        if parser is None:
            return text, []
        parser.feed(text)
        parser.finish()
        return parser.content, parser.calls


def plan_tools(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None, settings: ToolSettings, *,
               flat: bool = False, constrained: bool = False) -> ToolPlan | None:
    """The plan of a request's ``tools`` / ``tool_choice`` (None: it has neither); ``constrained``: the request
    has another output constraint (``response_format``, ...). Raises :class:`ToolError`."""
    if tools is None and tool_choice is None:
        return None
    checked = validate_tools(tools, flat) if tools is not None else []
    mode, function = tool_choice_mode(tool_choice, checked, flat)
    plan = ToolPlan(checked, mode, function)
    if mode == "auto":
        if not settings.auto:
            raise ToolError(f"tool_choice 'auto' (the default when tools are sent) needs the server started with "
                            f"{AUTO_FLAGS}; send tool_choice 'none' to give the tools to the chat template without "
                            "parsing calls, or 'required' / a named function to force a call", "tool_choice")
        plan.parser_class = PARSERS[settings.parser]
        if settings.parser == "mistral":
            plan.new_id = mistral_tool_id
    elif mode in ("required", "named"):
        if constrained:
            raise ToolError(f"tool_choice {tool_choice!r} forces a call through structured output; it cannot be "
                            "combined with response_format, structured_outputs or guided_*", "tool_choice")
        plan.schema = required_schema(checked, parallel_tool_calls is not False) if mode == "required" else \
            named_schema(next(t for t in checked if t.name == function))
    return plan


# ---- the chat API's shapes ---------------------------------------------------------------------------------
def finish_reason(reason: str | None, made_calls: bool, named: bool = False) -> str | None:
    """A choice that made calls and stopped finishes with ``"tool_calls"``; one forced to a named function
    keeps ``"stop"`` (as vLLM and OpenAI answer it)."""
    return "tool_calls" if made_calls and reason == "stop" and not named else reason


def chat_message(plan: ToolPlan | None, text: str, reason: str | None) -> tuple[str | None, list[dict], str | None]:
    """``(content, tool_calls, finish_reason)`` of a whole chat choice (content None when calls took it all)."""
    if plan is None or not plan.parses:
        return text, [], reason
    content, calls = plan.extract(text)
    if not calls:
        return content, [], reason
    return content or None, [c.openai() for c in calls], finish_reason(reason, True, plan.mode == "named")


class ChoiceToolStream:
    """One streamed chat choice's output through its parser: each piece of text becomes the content and the
    ``delta.tool_calls`` entries it completes (``index``; ``id``, ``type`` and ``function.name`` once, then
    ``function.arguments`` fragments)."""

    def __init__(self, parser: ToolParser, named: bool = False):
        self.parser, self.named = parser, named

    def push(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        events = self.parser.feed(text) if text else []
        if finished:
            events += self.parser.finish()
        content, calls = [], {}
        for event in events:
            if isinstance(event, Content):
                content.append(event.text)
            elif isinstance(event, CallStart):
                calls[event.index] = {"index": event.index, "id": event.id, "type": "function",
                                      "function": {"name": event.name, "arguments": ""}}
            elif isinstance(event, CallArgs):
                entry = calls.setdefault(event.index, {"index": event.index, "function": {"arguments": ""}})
                entry["function"]["arguments"] += event.text
        return "".join(content), list(calls.values())

    def finish_reason(self, reason: str | None) -> str | None:
        return finish_reason(reason, self.parser.started > 0, self.named)


__all__ = ["AUTO_FLAGS", "ChoiceToolStream", "ToolError", "ToolPlan", "ToolSettings", "chat_message",
           "finish_reason", "plan_tools"]
