"""An incremental scanner of one JSON object inside a growing text (the tool-call parsers' building block).

``ObjectScanner(start)`` follows the object whose ``{`` is at ``text[start]``; each :meth:`ObjectScanner.advance`
scans whatever the text gained since the last call (the text only ever grows: the scanner keeps its position
and state, so a text streamed in any chunking is scanned once, in linear time overall). It checks the JSON
grammar character by character (``error`` is the index of the first character that breaks it), records the
object's own members — each key with the span ``[value_start, value_end)`` of its value, ``value_end`` None
while the value is still open — and sets ``end`` (the index after the closing ``}``) when the object is
complete. Everything it has scanned is a valid prefix of a JSON object, so a caller may pass on the raw text
of an open member value (a tool call's arguments) as it arrives. String escapes are checked only as far as
``\\`` + one character; :func:`json.loads` of the finished object is the final word.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WS = re.compile(r"[ \t\n\r]*")
_STRING_RUN = re.compile(r'[^"\\]*')
_SCALAR_RUN = re.compile(r"[0-9A-Za-z+\-.]*")
_SCALAR = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")

# states: what the next non-space character may be
_VALUE, _KEY_OR_CLOSE, _KEY, _COLON, _VALUE_OR_CLOSE, _AFTER, _STRING, _SCALAR_TOKEN, _DONE = range(9)


@dataclass
class Member:
    """One member of the scanned object: its key and the span of its raw value text."""

    key: str
    value_start: int
    value_end: int | None = None


class ObjectScanner:
    """Scans the JSON object that starts at ``text[start]`` (which must be ``{``) incrementally."""

    def __init__(self, start: int):
        self.start = start
        self.pos = start            # the next character to scan
        self.state = _VALUE
        self.stack: list[str] = []  # open containers, "{" or "["
        self.members: list[Member] = []
        self.end: int | None = None
        self.error: int | None = None
        self._token_start = 0       # the open string or scalar's first character
        self._string_is_key = False
        self._escape = False

    @property
    def done(self) -> bool:
        return self.end is not None or self.error is not None

    def member(self, *keys: str) -> Member | None:
        """The first member whose key is one of ``keys``."""
        return next((m for m in self.members if m.key in keys), None)

    def advance(self, text: str) -> None:
        """Scan ``text`` (the same text as before, possibly longer) up to its end, or to the object's end or the
        first character that is not JSON."""
        n = len(text)
        pos = self.pos
        while pos < n and not self.done:
            state = self.state
            if state == _STRING:
                pos = self._scan_string(text, pos)
                continue
            if state == _SCALAR_TOKEN:
                pos = _SCALAR_RUN.match(text, pos).end()
                if pos == n:
                    break   # the token may go on
                if not _SCALAR.fullmatch(text, self._token_start, pos):
                    self.error = self._token_start
                    break
                self._value_ended(pos)
                continue
            pos = _WS.match(text, pos).end()
            if pos == n:
                break
            pos = self._structural(text[pos], pos)
        self.pos = pos

    def _scan_string(self, text: str, pos: int) -> int:
        n = len(text)
        while pos < n:
            if self._escape:
                self._escape = False
                pos += 1
                continue
            pos = _STRING_RUN.match(text, pos).end()
            if pos == n:
                break
            if text[pos] == "\\":
                self._escape = True
                pos += 1
                continue
            pos += 1   # the closing quote
            if self._string_is_key:
                if len(self.stack) == 1:
                    try:
                        key = json.loads(text[self._token_start:pos])
                    except ValueError:   # a bad escape
                        self.error = self._token_start
                        return pos
                    self.members.append(Member(key, -1))
                self.state = _COLON
            else:
                self._value_ended(pos)
            return pos
        return pos

    def _structural(self, char: str, pos: int) -> int:
        """One character outside strings and scalars, at ``pos``; returns the next position."""
        state, stack = self.state, self.stack
        if state in (_VALUE, _VALUE_OR_CLOSE):
            if state == _VALUE_OR_CLOSE and char == "]":
                return self._close("[", pos)
            if self.stack == [] and char != "{":
                self.error = pos
                return pos
            if len(stack) == 1 and stack[0] == "{":
                self.members[-1].value_start = pos
            if char in "{[":
                stack.append(char)
                self.state = _KEY_OR_CLOSE if char == "{" else _VALUE_OR_CLOSE
            elif char == '"':
                self.state, self._string_is_key, self._token_start = _STRING, False, pos
            elif char in "-0123456789tfn":
                self.state, self._token_start = _SCALAR_TOKEN, pos
            else:
                self.error = pos
                return pos
            return pos + 1
        if state in (_KEY_OR_CLOSE, _KEY):
            if state == _KEY_OR_CLOSE and char == "}":
                return self._close("{", pos)
            if char != '"':
                self.error = pos
                return pos
            self.state, self._string_is_key, self._token_start = _STRING, True, pos
            return pos + 1
        if state == _COLON:
            if char != ":":
                self.error = pos
                return pos
            self.state = _VALUE
            return pos + 1
        # _AFTER: a value of the innermost container has ended
        top = stack[-1]
        if char == ",":
            self.state = _KEY if top == "{" else _VALUE
            return pos + 1
        if char in "}]":
            if (char == "}") != (top == "{"):
                self.error = pos
                return pos
            return self._close(top, pos)
        self.error = pos
        return pos

    def _close(self, container: str, pos: int) -> int:
        self.stack.pop()
        self._value_ended(pos + 1)
        return pos + 1

    def _value_ended(self, end: int) -> None:
        """A value ended just before ``end``: a member of the object (depth 1), or the object itself."""
        if not self.stack:
            self.end, self.state = end, _DONE
            return
        if len(self.stack) == 1 and self.stack[0] == "{" and self.members:
            self.members[-1].value_end = end
        self.state = _AFTER
