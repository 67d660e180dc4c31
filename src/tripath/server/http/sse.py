"""Server-sent events of a streamed completion or chat: ``data: <JSON>\\n\\n``, ending in ``data: [DONE]``.

A stream's chunks repeat ``id``, ``object``, ``created`` and ``model``: :class:`ChunkFramer` encodes them once
per stream, so each event encodes only its choices (and usage). The chunks are those of OpenAI's API (the
same fields, in the same order, as :class:`~tripath.server.http.protocol.CompletionResponse` and
:class:`~tripath.server.http.protocol.ChatCompletionChunk` give): a completions choice ``{"index", "text",
"token_ids", "finish_reason", "stop_reason", "logprobs"}``, a chat choice ``{"index", "delta": {"role",
"content", "tool_calls"?}, "token_ids", "finish_reason", "stop_reason", "logprobs"}``.
"""

from __future__ import annotations

import json
import time

DONE = "data: [DONE]\n\n"


def encode(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def event(payload) -> str:
    """One event of a JSON value, or of text as it is (``[DONE]``)."""
    return f"data: {payload if isinstance(payload, str) else encode(payload)}\n\n"


class ChunkFramer:
    """The events of one stream (``chat``: chat completion chunks, else completions)."""

    def __init__(self, response_id: str, model: str, chat: bool):
        kind = "chat.completion.chunk" if chat else "text_completion"
        self._head = (f'data: {{"id":{encode(response_id)},"object":"{kind}","created":{int(time.time())},'
                      f'"model":{encode(model)},"choices":[')

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body = ",".join(encode(c) for c in choices)
        return f'{self._head}{body}],"usage":{"null" if usage is None else encode(usage)}}}\n\n'


def completion_choice(index: int, text: str, token_ids: list[int], finish_reason: str | None,
                      logprobs: dict | None = None, stop_reason: int | str | None = None) -> dict:
    return {"index": index, "text": text, "token_ids": token_ids, "finish_reason": finish_reason,
            "stop_reason": stop_reason, "logprobs": logprobs}


def chat_choice(index: int, content: str | None, token_ids: list[int], finish_reason: str | None,
                logprobs: dict | None = None, role: str | None = None, tool_calls: list[dict] | None = None,
                stop_reason: int | str | None = None) -> dict:
    """A chat chunk's choice; ``tool_calls``: the ``delta.tool_calls`` entries of a chat with tools."""
    delta = {"role": role, "content": content}
    if tool_calls:
        delta["tool_calls"] = tool_calls
    return {"index": index, "delta": delta, "token_ids": token_ids, "finish_reason": finish_reason,
            "stop_reason": stop_reason, "logprobs": logprobs}
