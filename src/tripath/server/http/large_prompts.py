"""Completion and chat prompts of large texts, tokenised in the tokenizer helper process.

A prompt of megabytes of text pauses the API server's event loop while it is tokenised there, as a large
``/tokenize`` did (:mod:`~tripath.server.http.utility_routes`): the tokenizer builds Python lists of millions
of ids holding the interpreter lock. A text prompt of :data:`PROMPT_IN_HELPER_CHARS` characters or more, and a
chat body of as many bytes, is therefore rendered and tokenised in the helper process
(:mod:`~tripath.server.processes.tokenizer_process`), which gets the request's body as it arrived and reads the
text from it again, so this process copies nothing. The helper sends back the prompt's token count, and its
ids only when they leave room to generate within ``max_model_len`` (``count < limit``), as int32: a prompt
the engine could never run costs this process four bytes and the 400 it gets, and one it can run at most
``max_model_len`` ids. The errors are the in-process path's: the same :class:`APIError` (status, message,
``param``), raised in the helper and again here.
"""

from __future__ import annotations

from array import array

from tripath.engine.chat import chat_token_ids, encode_text
from tripath.server.http import protocol as P
from tripath.server.http.generation import APIError
from tripath.server.processes.tokenizer_process import TokenizerProcessDied

PROMPT_IN_HELPER_CHARS = 256 << 10   # a text prompt (or a chat body, in bytes) this large: tokenised in the helper
COUNT_BYTES = 4


def no_room(count: int, limit: int) -> APIError:
    """The 400 of a prompt of ``count`` tokens that leaves nothing to generate within ``max_model_len``."""
    return APIError(400, f"the prompt ({count} tokens) leaves no room to generate within max_model_len ({limit})",
                    param="prompt")


def text_ids(tokenizer, text: str, param: str) -> list[int]:
    """A text prompt's ids (as ``LLM.add_request`` encodes it); 400 naming ``param`` for text that cannot be
    encoded (a lone surrogate, say)."""
    try:
        return encode_text(tokenizer, text)
    except (ValueError, TypeError, UnicodeError) as error:
        raise APIError(400, f"{param} could not be tokenised: {type(error).__name__}: {error}", param=param) from None


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool, template_kwargs: dict,
             chat_template: str | None) -> list[int]:
    """A conversation's prompt ids; 400 naming ``messages`` when the template refuses it or its text cannot be
    encoded."""
    try:
        return chat_token_ids(tokenizer, messages, add_generation_prompt, template_kwargs, chat_template)
    except (ValueError, TypeError, UnicodeError) as error:   # ChatTemplateError included
        raise APIError(400, str(error), param="messages") from None
    except Exception as error:  # noqa: BLE001 - a template that refuses the conversation (jinja raise_exception)
        raise APIError(400, f"the chat template rejected the messages: {error}", param="messages") from None


def pack_ids(ids: list[int], limit: int) -> bytes:
    """``len(ids)`` as four little-endian bytes, then the ids as int32 when ``len(ids) < limit``."""
    head = len(ids).to_bytes(COUNT_BYTES, "little")
    return head + array("i", ids).tobytes() if len(ids) < limit else head


def unpack_ids(reply: bytes | bytearray, limit: int) -> list[int]:
    """The ids :func:`pack_ids` packed; :func:`no_room` when there were ``limit`` or more."""
    count = int.from_bytes(reply[:COUNT_BYTES], "little")
    if count >= limit:
        raise no_room(count, limit)
    ids = array("i")
    ids.frombytes(memoryview(reply)[COUNT_BYTES:])
    return ids.tolist()


def completion_prompt_reply(tokenizer, payload: bytes, index: int, param: str, limit: int) -> bytes:
    """(In the helper.) :func:`pack_ids` of text prompt ``index`` of ``payload``, a completions body as it
    arrived (the API server validated it: parsing it again here saves that process a copy of the text)."""
    text = P.CompletionRequest.model_validate_json(payload).prompts()[index]
    return pack_ids(text_ids(tokenizer, text, param), limit)


def chat_prompt_reply(tokenizer, payload: bytes, messages_of, add_generation_prompt: bool, template_kwargs: dict,
                      chat_template: str | None, limit: int) -> bytes:
    """(In the helper.) :func:`pack_ids` of the prompt ids of the conversation ``messages_of(payload)`` reads
    from a request's body as it arrived (:func:`chat_messages` or another route's reader)."""
    messages = messages_of(payload)
    return pack_ids(chat_ids(tokenizer, messages, add_generation_prompt, template_kwargs, chat_template), limit)


def chat_messages(payload: bytes) -> list[dict]:
    """The messages of a chat completions body, as the route hands them to the template."""
    return [m.model_dump(exclude_none=True) for m in P.ChatCompletionRequest.model_validate_json(payload).messages]


async def completion_prompt_in_helper(state, body: bytes, index: int, param: str) -> list[int]:
    """The ids of text prompt ``index`` of a completions ``body``, tokenised in ``state``'s helper process."""
    limit = state.engine.max_model_len
    return unpack_ids(await _run(state, completion_prompt_reply, body, index, param, limit), limit)


async def chat_prompt_in_helper(state, body: bytes, messages_of, add_generation_prompt: bool,
                                template_kwargs: dict) -> list[int]:
    """The prompt ids of a chat request's conversation (``messages_of(body)``), rendered and tokenised in
    ``state``'s helper process."""
    limit = state.engine.max_model_len
    return unpack_ids(await _run(state, chat_prompt_reply, body, messages_of, add_generation_prompt, template_kwargs,
                                 state.chat_template, limit), limit)


async def _run(state, fn, payload: bytes, *args) -> bytearray:
    try:
        return await state.tokenizer_helper().run(fn, payload, *args)
    except TokenizerProcessDied as error:
        raise APIError(500, str(error), "server_error") from None
