"""The Responses API's answer (:class:`ResponsesRender`): the ``response`` object, or its stream of events.

The output is built from the tool parser's events (content, call start, arguments, call end; a chat without
parsing gives content only) by one :class:`_Output`, streamed or not, so both give the same items: a
``message`` item (``output_text`` content) for each run of content, a ``function_call`` item (``call_id``,
``name``, ``arguments``) for each call, in the order the model wrote them; an output with neither is one empty
message. The non-streamed answer leaves out a call whose text broke off (its text is content); a stream
closes the item it had opened with ``status: "incomplete"``.

Events (``event: <type>`` and ``data: <JSON>`` with ``type`` and ``sequence_number``), as OpenAI sends them:
``response.created``, ``response.in_progress``; per message ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` ..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; per call ``response.output_item.added``,
``response.function_call_arguments.delta`` ..., ``response.function_call_arguments.done``,
``response.output_item.done``; then ``response.completed`` — or ``response.incomplete`` when
``max_output_tokens`` cut the output (status ``"incomplete"``, ``incomplete_details.reason:
"max_output_tokens"``). A failure mid-stream is an ``error`` event (``code``, ``message``, ``param``).
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Callable, Iterator

from tripath.server.http.generation import APIError, Generation
from tripath.server.http.tools import ToolPlan
from tripath.server.http.tools.base import CallArgs, CallEnd, CallStart, Content
from tripath.server.http.tools.formats import mistral_tool_id


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _Output:
    """Output items from parser events; ``emit(type, **fields)`` is told each streamed event (a no-op when
    not streaming)."""

    def __init__(self, emit: Callable[..., None]):
        self.emit = emit
        self.items: list[dict] = []   # by output_index
        self.message: dict | None = None
        self.calls: dict[int, dict] = {}   # open calls by the parser's call index

    def handle(self, event) -> None:
        if isinstance(event, Content):
            self._content(event.text)
        elif isinstance(event, CallStart):
            self._close_message("completed")
            item = {"id": _id("fc"), "type": "function_call", "call_id": event.id, "name": event.name,
                    "arguments": "", "status": "in_progress"}
            self.calls[event.index] = item
            self._add(item)
        elif isinstance(event, CallArgs):
            item = self.calls[event.index]
            item["arguments"] += event.text
            self.emit("response.function_call_arguments.delta", item_id=item["id"],
                      output_index=self.items.index(item), delta=event.text)
        elif isinstance(event, CallEnd):
            item = self.calls.pop(event.index)
            self._close_call(item, "completed")

    def _add(self, item: dict) -> None:
        self.items.append(item)
        self.emit("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))

    def _open_message(self) -> None:
        self.message = {"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                        "content": []}
        self._add(self.message)
        self.emit("response.content_part.added", item_id=self.message["id"], output_index=len(self.items) - 1,
                  content_index=0, part=_text_part(""))
        self.message["content"].append(_text_part(""))

    def _content(self, text: str) -> None:
        if not text:
            return
        if self.message is None:
            self._open_message()
        part = self.message["content"][0]
        part["text"] += text
        self.emit("response.output_text.delta", item_id=self.message["id"],
                  output_index=self.items.index(self.message), content_index=0, delta=text, logprobs=[])

    def _close_message(self, status: str) -> None:
        message, self.message = self.message, None
        if message is None:
            return
        index, part = self.items.index(message), message["content"][0]
        self.emit("response.output_text.done", item_id=message["id"], output_index=index, content_index=0,
                  text=part["text"], logprobs=[])
        self.emit("response.content_part.done", item_id=message["id"], output_index=index, content_index=0,
                  part=dict(part))
        message["status"] = status
        self.emit("response.output_item.done", output_index=index, item=message)

    def _close_call(self, item: dict, status: str) -> None:
        index = self.items.index(item)
        self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                  name=item["name"], arguments=item["arguments"])
        item["status"] = status
        self.emit("response.output_item.done", output_index=index, item=item)

    def close(self, status: str, keep_broken: bool) -> None:
        """The output has ended (``status`` of its message): close what is open; an output with no item gets
        an empty message. ``keep_broken``: keep the calls that broke off (as ``incomplete``; streams)."""
        self._close_message(status)
        for item in list(self.calls.values()):
            if keep_broken:
                self._close_call(item, "incomplete")
            else:
                self.items.remove(item)
        self.calls.clear()
        if not self.items:
            self._open_message()
            self._close_message(status)


class ResponsesRender:
    """The answer to one ``/v1/responses`` request (``body``: its :class:`ResponsesRequest`)."""

    def __init__(self, body, plan: ToolPlan | None):
        self.body, self.plan = body, plan
        self.id, self.created_at = _id("resp"), int(time.time())
        mistral = plan is not None and plan.new_id is mistral_tool_id
        self.new_id = mistral_tool_id if mistral else (lambda: _id("call"))

    def _events_of(self, text: str, final: bool, parser) -> list:
        if parser is None:
            return [Content(text)] if text else []
        events = parser.feed(text) if text else []
        return events + parser.finish() if final else events

    def _parser(self):
        return self.plan.parser(self.new_id) if self.plan is not None else None

    def _response(self, status: str, output: list[dict], gen: Generation | None) -> dict:
        body, plan = self.body, self.plan
        usage = None if gen is None else {
            "input_tokens": gen.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": gen.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": gen.prompt_tokens + gen.completion_tokens}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "model": body.model, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": None, "store": False, "temperature": body.temperature, "top_p": body.top_p,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice if body.tool_choice is not None else
            ("auto" if plan is not None and plan.tools else "none"),
            "tools": [t.responses() for t in plan.tools] if plan is not None else [],
            "truncation": "disabled", "usage": usage, "user": body.user}

    @staticmethod
    def _status(finish_reason: str | None) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    def response(self, gen: Generation) -> dict:
        choice = gen.choices[0]
        output = _Output(lambda *a, **k: None)
        for event in self._events_of(choice.text, True, self._parser()):
            output.handle(event)
        status = self._status(choice.finish_reason)
        output.close(status, keep_broken=False)
        return self._response(status, output.items, gen)

    async def events(self, gen: Generation, release: Callable[[], None]) -> Iterator[str]:
        sequence = itertools.count()
        pending: list[str] = []

        def emit(kind: str, **fields) -> None:
            data = json.dumps({"type": kind, "sequence_number": next(sequence), **fields}, separators=(",", ":"))
            pending.append(f"event: {kind}\ndata: {data}\n\n")

        def flush() -> str:
            out = "".join(pending)
            pending.clear()
            return out

        try:
            emit("response.created", response=self._response("in_progress", [], None))
            emit("response.in_progress", response=self._response("in_progress", [], None))
            yield flush()
            output, parser, finish = _Output(emit), self._parser(), None
            try:
                async for d in gen.deltas():
                    finish = d.finish_reason or finish
                    for event in self._events_of(d.text, d.finish_reason is not None, parser):
                        output.handle(event)
                    if pending:
                        yield flush()
            except APIError as error:
                emit("error", code=str(error.code or error.status), message=error.message, param=error.param)
                yield flush()
                return
            status = self._status(finish)
            output.close(status, keep_broken=True)
            emit("response.completed" if status == "completed" else "response.incomplete",
                 response=self._response(status, output.items, gen))
            yield flush()
        finally:
            release()
