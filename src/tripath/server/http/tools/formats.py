"""The tool-call formats (``--tool-call-parser``), as those model families emit them:

- ``hermes`` (Hermes, Qwen 2.5 / 3, SmolLM3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number, with content around them.
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the output is ``{"name": ..., "parameters":
  {...}}`` (optionally after ``<|python_tag|>``), several separated by ``;``.
- ``mistral``: content, then ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``; also the newer
  ``[TOOL_CALLS]name{...}`` / ``[TOOL_CALLS]name[ARGS]{...}``.
- ``pythonic`` (Llama 3.2 / 4, ToolACE): the output is ``[f(a=1, b="x"), g()]`` (optionally inside
  ``<|python_start|>`` ... ``<|python_end|>``); read with :mod:`ast`, literals only, never evaluated.

Two more serve the ``tool_choice`` values that structured output forces: :class:`RequiredParser` (the output
is a JSON array of ``{"name", "parameters"}``) and :class:`NamedParser` (the output is the function's
arguments). The contract they all keep is :mod:`tripath.server.http.tools.base`'s.
"""

from __future__ import annotations

import ast
import json
import math
import re
import uuid
from typing import Callable

from tripath.server.http.tools.base import ToolParser, WHITESPACE, chat_tool_id

_IDENTIFIER = re.compile(r"[A-Za-z0-9_.\-]*")


class HermesParser(ToolParser):
    name = "hermes"
    keeps_special_tokens = True
    marker, closer = "<tool_call>", "</tool_call>"

    def _s_after_marker(self) -> bool:
        return self._object_next("closing")

    def _s_closing(self) -> bool:
        text = self.text
        pos = WHITESPACE.match(text, self.pos).end()
        tail = text[pos:pos + len(self.closer)]
        if tail != self.closer and self.closer.startswith(tail) and pos + len(tail) == len(text) and not self.final:
            return False   # maybe the closing tag
        self.pos = pos + len(self.closer) if tail == self.closer else pos
        self.state, self._after_call = "text", True
        return True


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    tag = "<|python_tag|>"
    start_state = "start"

    def _s_start(self) -> bool:
        pos = self._skip_space()
        if pos is None:
            return self.final and self._break()
        rest = self.text[pos:pos + len(self.tag)]
        if rest == self.tag:
            self.pos = pos + len(self.tag)
        elif self.tag.startswith(rest) and pos + len(rest) == len(self.text) and not self.final:
            return False
        elif self.text[pos] != "{":
            return self._break()
        self.state = "call"
        return True

    def _s_call(self) -> bool:
        return self._object_next("separator")

    def _s_separator(self) -> bool:
        pos = self._skip_space()
        if pos is None:
            return False   # the end, or more to come
        self._attempt = self.pos
        if self.text[pos] == ";":
            self.pos, self.state = pos + 1, "call"
        else:   # text after the calls: content
            self.pos, self.state = pos, "plain"
        return True


class MistralParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True
    marker, args_marker = "[TOOL_CALLS]", "[ARGS]"

    def _s_after_marker(self) -> bool:
        pos = self._skip_space()
        if pos is None:
            return self.final and self._break()
        if self.text[pos] == "[":
            self.pos, self.state, self.after_array = pos + 1, "array", "text"
            return True
        self.pos, self.state = pos, "named"
        return True

    def _s_named(self) -> bool:
        """``name{...}`` or ``name[ARGS]{...}`` (Mistral's tokenizers from v11)."""
        text = self.text
        end = _IDENTIFIER.match(text, self.pos).end()
        if end == len(text):
            return self.final and self._break()
        name = text[self.pos:end]
        if not self._known(name):
            return self._break()
        rest = text[end:end + len(self.args_marker)]
        if rest == self.args_marker:
            end += len(self.args_marker)
        elif self.args_marker.startswith(rest) and end + len(rest) == len(text):
            return self.final and self._break()
        if end == len(text):
            return self.final and self._break()
        if text[end] != "{":
            return self._break()
        self._begin_object(end, name)
        self.state, self.after_object, self._after_call = "object", "text", True
        return True


class RequiredParser(ToolParser):
    """``tool_choice: "required"``: the output is a JSON array of ``{"name", "parameters"}`` (the grammar
    forces it; a truncated one is content)."""

    name = "required"
    start_state = "start"

    def _s_start(self) -> bool:
        pos = self._skip_space()
        if pos is None:
            return self.final and self._break()
        if self.text[pos] != "[":
            return self._break()
        self.pos, self.state, self.after_array = pos + 1, "array", "plain"
        return True


class NamedParser(ToolParser):
    """``tool_choice`` naming a function: the output is that function's arguments object."""

    name = "named"
    start_state = "start"

    def __init__(self, function: str, new_id: Callable[[], str] = chat_tool_id):
        super().__init__([function], new_id)
        self.function = function

    def _s_start(self) -> bool:
        pos = self._skip_space()
        if pos is None:
            return self.final and self._break()
        if self.text[pos] != "{":
            return self._break()
        self._begin_object(pos, self.function)
        self.state, self.after_object, self._after_call = "object", "plain", True
        return True


class PythonicParser(ToolParser):
    name = "pythonic"
    start_state = "start"
    opener, closer = "<|python_start|>", "<|python_end|>"
    _quote = re.compile(r"""["'\[\]\\]""")

    def __init__(self, tool_names, new_id: Callable[[], str] = chat_tool_id):
        super().__init__(tool_names, new_id)
        self._depth, self._quote_char, self._list_start = 0, None, 0

    def _s_start(self) -> bool:
        pos = self._skip_space()
        if pos is None:
            return self.final and self._break()
        rest = self.text[pos:pos + len(self.opener)]
        if rest == self.opener:
            pos = WHITESPACE.match(self.text, pos + len(self.opener)).end()
            if pos == len(self.text):
                return self.final and self._break()
        elif self.opener.startswith(rest) and pos + len(rest) == len(self.text) and not self.final:
            return False
        if self.text[pos] != "[":
            return self._break()
        self._list_start, self.pos, self._depth, self.state = pos, pos + 1, 1, "list"
        return True

    def _s_list(self) -> bool:
        """Until the ``]`` that closes the list (brackets inside strings do not count)."""
        text = self.text
        while True:
            match = self._quote.search(text, self.pos)
            if match is None:
                self.pos = max(self.pos, len(text))   # past an escape at the end: its character is skipped
                return self.final and self._break()
            char, self.pos = match.group(), match.end()
            if char == "\\":
                self.pos += 1
            elif self._quote_char is not None:
                self._quote_char = None if char == self._quote_char else self._quote_char
            elif char in "\"'":
                self._quote_char = char
            else:
                self._depth += 1 if char == "[" else -1
                if self._depth == 0:
                    break
        calls = _python_calls(text[self._list_start:self.pos], self.tool_names)
        if calls is None:
            return self._break()
        for name, arguments in calls:
            self._start(name)
            self._end(arguments)
        self.state, self._after_call = "trailer", True
        return True

    def _s_trailer(self) -> bool:
        pos = WHITESPACE.match(self.text, self.pos).end()
        rest = self.text[pos:pos + len(self.closer)]
        if rest == self.closer:
            self.pos = pos + len(self.closer)
        elif self.closer.startswith(rest) and pos + len(rest) == len(self.text) and not self.final:
            return False
        else:
            self.pos = pos
        self.state = "plain"   # text after the list is content
        return True


def _python_calls(source: str, tool_names) -> list[tuple[str, str]] | None:
    """``[f(a=1), ...]`` as (name, arguments JSON) pairs; None when it is not a list of calls with literal
    keyword arguments to known tools."""
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List):
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and node.func.id in tool_names and all(k.arg is not None for k in node.keywords)):
            return None
        try:
            arguments = {k.arg: _literal(k.value) for k in node.keywords}
            calls.append((node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)))
        except (ValueError, TypeError, RecursionError):
            return None
    return calls


_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def _literal(node: ast.AST):
    """A JSON value of a Python literal (numbers, strings, lists, tuples, dicts with string keys, True / False /
    None and JSON's true / false / null); ValueError for anything else."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (bool, int, float, str))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ValueError("not a finite number")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("a sign on a non-number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(k) if k is not None else None for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("dict keys must be strings")
        return {k: _literal(v) for k, v in zip(keys, node.values)}
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    raise ValueError(f"not a literal: {type(node).__name__}")


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser,
                                                             PythonicParser)}


def mistral_tool_id() -> str:
    """Mistral's templates take nine alphanumeric characters."""
    return uuid.uuid4().hex[:9]
