"""Log-probabilities in the OpenAI API's shapes.

Completions (``logprobs: k``; with ``echo`` the prompt's tokens come first, the first of them without a
log-probability)::

    {"tokens": ["The", " cat"], "token_logprobs": [null, -2.1], "top_logprobs": [null, {" cat": -2.1, ...}],
     "text_offset": [0, 3]}

``top_logprobs[i]`` maps the text of the chosen token and of the ``k`` most likely ones to their
log-probabilities (``k + 1`` entries when the chosen token is not among them, as vLLM returns);
``text_offset[i]`` is where token ``i`` starts in the returned text. Chats (``logprobs: true``,
``top_logprobs: k``)::

    {"content": [{"token": " cat", "logprob": -2.1, "bytes": [32, 99, 97, 116],
                  "top_logprobs": [{"token": ..., "logprob": ..., "bytes": [...]}, ...]}]}

with the ``k`` most likely tokens in rank order. A token's text is its own decoding (``token_id:<id>`` for
a model without a tokenizer); a log-probability of ``-inf`` is written as -9999.0 (JSON has no infinity).
"""

from __future__ import annotations

from typing import Sequence

from tripath.engine.requests.request import PositionLogprobs

FLOOR = -9999.0


def token_text(tokenizer, token: int) -> str:
    return f"token_id:{token}" if tokenizer is None else tokenizer.decode([token])


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


def completion_logprobs(tokenizer, token_ids: Sequence[int], entries: Sequence[PositionLogprobs | None],
                        k: int, text_offset: int = 0) -> dict:
    """The completions shape for ``token_ids`` and their ``entries`` (None: a position without one, the
    first prompt token), offsets counted from ``text_offset``."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    at = text_offset
    for token, entry in zip(token_ids, entries):
        text = token_text(tokenizer, token)
        tokens.append(text)
        offsets.append(at)
        at += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_value(entry[token].logprob))
        ranked = sorted(entry.items(), key=lambda item: item[1].rank)
        top = {text: _value(entry[token].logprob)}
        for other, logprob in ranked[:k]:
            top.setdefault(token_text(tokenizer, other), _value(logprob.logprob))
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def merge_completion_logprobs(parts: Sequence[dict]) -> dict:
    """One completions ``logprobs`` object of consecutive parts (the echoed prompt, then the output)."""
    return {key: [x for part in parts for x in part[key]] for key in
            ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def _chat_entry(tokenizer, token: int, logprob: float) -> dict:
    text = token_text(tokenizer, token)
    return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8", errors="replace"))}


def chat_logprobs(tokenizer, token_ids: Sequence[int], entries: Sequence[PositionLogprobs], k: int) -> dict:
    """The chat shape for ``token_ids`` and their ``entries`` with ``k`` top tokens each."""
    content = []
    for token, entry in zip(token_ids, entries):
        item = _chat_entry(tokenizer, token, entry[token].logprob)
        ranked = sorted(entry.items(), key=lambda pair: pair[1].rank)[:k]
        item["top_logprobs"] = [_chat_entry(tokenizer, other, lp.logprob) for other, lp in ranked]
        content.append(item)
    return {"content": content}
