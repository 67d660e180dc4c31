"""Tool-call parsing: the events, the finished call, and :class:`ToolParser`, the base of the formats
(:mod:`tripath.server.http.tools.formats`).

A parser is fed a model's output as it streams (:meth:`ToolParser.feed`, any chunking) and told when it ends
(:meth:`ToolParser.finish`); each call returns :class:`Content`, :class:`CallStart`, :class:`CallArgs` and
:class:`CallEnd` events. Parsing a whole text is ``feed(text)`` then ``finish()``: the same code, so the
calls and the content a stream gives are those of the whole text, however it was chunked. Decisions depend
on the text alone: text that may still turn into a call (a partial ``<tool_call>``, whitespace before one,
a JSON object whose name has not arrived) is held back until the text decides it.

Contract of every parser: a call's ``arguments`` is the JSON text of an object — the model's own text of it
where it wrote an object (so it streams as it arrives), else ``json.dumps`` of what it wrote. A call is
announced (:class:`CallStart`) once its name is known, is one of the request's tools, and its arguments have
begun; whitespace directly before or after a call is dropped. Output that does not parse as the format is
content: from the first character that breaks a call to the end, the text is content (a stream that had
announced that call keeps it as sent: :attr:`ToolParser.broken`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Callable, Iterable

from tripath.server.http.tools.json_scan import ObjectScanner

WHITESPACE = re.compile(r"[ \t\n\r]*")
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class Content:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class CallArgs:
    index: int
    text: str


@dataclass
class CallEnd:
    index: int
    arguments: str


@dataclass
class ToolCall:
    """A finished call: ``arguments`` is the JSON text of an object."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class _Open:
    index: int
    id: str
    name: str
    sent: int = 0   # characters of its arguments sent


def chat_tool_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _hold_start(text: str, pos: int, marker: str) -> int:
    """Where the text that may begin ``marker`` (a proper prefix of it at the end, and the whitespace before
    it) starts; ``len(text)`` when none."""
    n = len(text)
    hold = n
    for size in range(min(len(marker) - 1, n - pos), 0, -1):
        if marker.startswith(text[n - size:]):
            hold = n - size
            break
    while hold > pos and text[hold - 1] in " \t\n\r":
        hold -= 1
    return hold


def _space_before(text: str, pos: int, k: int) -> int:
    while k > pos and text[k - 1] in " \t\n\r":
        k -= 1
    return k


class ToolParser:
    """Base of the parsers: the text, the events, the calls; subclasses implement the format's states as
    ``_s_<state>`` methods returning True when they made progress (False: they need more text)."""

    name = ""
    keeps_special_tokens = False   # its markers are special tokens: decode the output with them
    marker = ""                    # what opens the calls (formats with content around them)
    start_state = "text"

    def __init__(self, tool_names: Iterable[str], new_id: Callable[[], str] = chat_tool_id):
        self.tool_names = frozenset(tool_names)
        self.new_id = new_id
        self.text = ""
        self.pos = 0                  # text before it is consumed
        self.state = self.start_state
        self.final = False
        self.calls: list[ToolCall] = []
        self.broken: list[_Open] = []   # calls announced, then broken (streams keep what they sent)
        self._content: list[str] = []
        self._events: list = []
        self._open: _Open | None = None
        self._attempt = 0             # where the text of the call being read starts (content if it breaks)
        self._after_call = False      # drop the whitespace that follows a call
        self._scanner: ObjectScanner | None = None
        self._scanner_name: str | None = None   # the call's name when the object is its arguments
        self._name: str | None = None

    # ---- driving --------------------------------------------------------------------------------------
    def feed(self, text: str) -> list:
        """Add output text; the events it completes."""
        if self.final:
            raise RuntimeError("feed after finish")
        self.text += text
        return self._run()

    def finish(self) -> list:
        """The output has ended: resolve what was held back; the last events."""
        if self.final:
            return []
        self.final = True
        events = self._run()
        if self._open is not None:   # a call still open at the end (cannot happen: states break it)
            self.broken.append(self._open)
            self._open = None
        return events

    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def started(self) -> int:
        """Calls announced so far (finished, open or broken)."""
        return len(self.calls) + len(self.broken) + (self._open is not None)

    def _run(self) -> list:
        while getattr(self, f"_s_{self.state}")():
            pass
        events, self._events = self._events, []
        return events

    # ---- events ---------------------------------------------------------------------------------------
    def _emit(self, text: str) -> None:
        if text:
            self._content.append(text)
            if self._events and isinstance(self._events[-1], Content):
                self._events[-1].text += text
            else:
                self._events.append(Content(text))

    def _start(self, name: str) -> None:
        self._open = _Open(self.started, self.new_id(), name)
        self._events.append(CallStart(self._open.index, self._open.id, name))

    def _send(self, start: int, end: int) -> None:
        """The open call's arguments are ``text[start:end]`` so far: send what was not sent."""
        call = self._open
        if end - start > call.sent:
            self._events.append(CallArgs(call.index, self.text[start + call.sent:end]))
            call.sent = end - start

    def _end(self, arguments: str) -> None:
        """The open call ends with ``arguments`` (its text sent so far is a prefix of them)."""
        call = self._open
        if len(arguments) > call.sent:
            self._events.append(CallArgs(call.index, arguments[call.sent:]))
        call, self._open = self._open, None
        self.calls.append(ToolCall(call.id, call.name, arguments))
        self._events.append(CallEnd(call.index, arguments))

    def _break(self) -> bool:
        """The call being read is not one: everything from where it began is content."""
        if self._open is not None:
            self.broken.append(self._open)
            self._open = None
        self._scanner, self._after_call = None, False
        self.state, self.pos = "plain", self._attempt
        return True

    def _known(self, name) -> bool:
        return isinstance(name, str) and name in self.tool_names

    # ---- shared states --------------------------------------------------------------------------------
    def _s_plain(self) -> bool:
        if self._after_call:   # whitespace after a call
            self.pos = WHITESPACE.match(self.text, self.pos).end()
            self._after_call = self.pos == len(self.text)
        self._emit(self.text[self.pos:])
        self.pos = len(self.text)
        return False

    def _skip_space(self) -> int | None:
        """The position after whitespace at ``pos``; None when the text ends there (more may come)."""
        pos = WHITESPACE.match(self.text, self.pos).end()
        return None if pos == len(self.text) else pos

    def _s_text(self) -> bool:
        """Content, until the format's marker."""
        text, n = self.text, len(self.text)
        if self._after_call:
            self.pos = WHITESPACE.match(text, self.pos).end()
            if self.pos == n:
                return False
            self._after_call = False
        k = text.find(self.marker, self.pos)
        if k < 0:
            hold = n if self.final else _hold_start(text, self.pos, self.marker)
            self._emit(text[self.pos:hold])
            self.pos = hold
            return False
        self._attempt = _space_before(text, self.pos, k)
        self._emit(text[self.pos:self._attempt])
        self.pos, self.state = k + len(self.marker), "after_marker"
        return True

    def _begin_object(self, at: int, name: str | None = None) -> None:
        """Read a call object at ``text[at]``: ``{"name", "arguments"}``, or (``name`` given) its arguments."""
        self._scanner, self._scanner_name, self._name = ObjectScanner(at), name, name
        self.pos = at
        if name is not None:
            self._start(name)

    def _read_object(self) -> str:
        """Advance the call object: ``"open"``, ``"done"`` (the call has ended) or ``"broken"``."""
        scanner, text = self._scanner, self.text
        scanner.advance(text)
        if scanner.error is not None:
            return "broken"
        if self._scanner_name is not None:   # the object is the arguments
            if scanner.end is None:
                self._send(scanner.start, scanner.pos)
                return "open"
            raw = text[scanner.start:scanner.end]
            if not isinstance(_loads(raw), dict):
                return "broken"
            self._end(raw)
            return "done"
        if self._name is None:
            member = scanner.member("name")
            if member is not None and member.value_end is not None:
                name = _loads(text[member.value_start:member.value_end])
                if not self._known(name):
                    return "broken"
                self._name = name
        args = scanner.member(*ARGUMENT_KEYS)
        streams = args is not None and args.value_start >= 0 and text[args.value_start] == "{"
        if self._name is not None and self._open is None and streams:
            self._start(self._name)
        if self._open is not None and streams:
            self._send(args.value_start, args.value_end if args.value_end is not None else scanner.pos)
        if scanner.end is None:
            return "open"
        obj = _loads(text[scanner.start:scanner.end])
        if not isinstance(obj, dict) or self._name is None:
            return "broken"
        if args is None:
            arguments = "{}"
        elif streams:
            arguments = text[args.value_start:args.value_end]
        else:   # arguments written as a JSON string holding the object
            value = obj[args.key]
            inner = _loads(value) if isinstance(value, str) else None
            if value is None:
                arguments = "{}"
            elif isinstance(inner, dict):
                arguments = value
            else:
                return "broken"
        if self._open is None:
            self._start(self._name)
        self._end(arguments)
        return "done"

    def _s_object(self) -> bool:
        outcome = self._read_object()
        if outcome == "broken" or (outcome == "open" and self.final):
            return self._break()
        if outcome == "open":
            return False
        self.pos, self._scanner = self._scanner.end, None
        self.state = self.after_object
        return True

    after_object = "text"

    # arrays of call objects: [{...}, {...}]
    def _s_array(self) -> bool:
        """After ``[``: a call object or ``]``."""
        pos = self._skip_space()
        if pos is None:
            return self.final and self._break()
        if self.text[pos] == "]":
            self.pos, self.state, self._after_call = pos + 1, self.after_array, True
            return True
        return self._object_at(pos, "array_next")

    def _object_at(self, pos: int, after: str) -> bool:
        """A call object starts at ``pos`` (else the attempt breaks): read it, then go to state ``after``."""
        if self.text[pos] != "{":
            return self._break()
        self._begin_object(pos)
        self.state, self.after_object = "object", after
        return True

    def _object_next(self, after: str) -> bool:
        """A call object after optional white space (see :meth:`_object_at`)."""
        pos = self._skip_space()
        if pos is None:
            return self.final and self._break()
        return self._object_at(pos, after)

    def _s_array_next(self) -> bool:
        pos = self._skip_space()
        if pos is None:
            return self.final and self._break()
        char = self.text[pos]
        if char == ",":
            self._attempt = self.pos
            self.pos, self.state = pos + 1, "array"
            return True
        if char == "]":
            self.pos, self.state, self._after_call = pos + 1, self.after_array, True
            return True
        self._attempt = self.pos
        return self._break()

    after_array = "text"


def _loads(raw: str):
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _loads(raw: str):
    try:
        return json.loads(raw)
    except ValueError:
        return None


