"""Chat conversations to prompt token ids through the tokenizer's chat template (``LLM.chat`` and the server).

A conversation is a list of messages ``{"role": ..., "content": ...}``; ``content`` is text or a list of
OpenAI content parts of which only ``{"type": "text", "text": ...}`` is supported. Tool use follows the
OpenAI / Hugging Face convention: an assistant message may carry ``tool_calls`` (``[{"id", "type": "function",
"function": {"name", "arguments"}}]``, its ``content`` then often null) and a ``tool`` message answers one with
``tool_call_id``; the template gets the calls with ``arguments`` as a dict (a JSON string is parsed, as vLLM
does: templates render it with ``tojson``), ``content`` null as ``""``, and ``name`` / ``tool_call_id`` as
given. The template (Jinja, from
the model's tokenizer files, or given: :func:`load_chat_template` reads it from a file or takes it inline)
renders the conversation with the assistant's turn opened, and the text is encoded without adding special
tokens again (templates write their own BOS).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """The model cannot render chat conversations (no tokenizer, or a tokenizer without a chat template)."""


def message_text(content: Any, where: str) -> str:
    """The text of a message's ``content``: a string, or a list of ``{"type": "text", "text": str}`` parts."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, Sequence):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{where}.content[{j}] must be {{'type': 'text', 'text': str}}; other content "
                                 "parts (images, audio, files) are not supported")
            texts.append(part["text"])
        return "".join(texts)
    raise TypeError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")


def normalise_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check a conversation and flatten content parts to text (keeping ``name``, ``tool_call_id`` and an
    assistant's ``tool_calls``); raises ``ValueError``/``TypeError`` naming the bad message."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty; a conversation needs at least one message")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise TypeError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
        entry = {"role": role, "content": message_text(message.get("content"), where)}
        for key in ("name", "tool_call_id"):
            value = message.get(key)
            if value is not None:
                if not isinstance(value, str):
                    raise TypeError(f"{where}.{key} must be a string, got {type(value).__name__}")
                entry[key] = value
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise ValueError(f"{where}.tool_calls: only assistant messages carry tool calls (role is {role!r})")
            entry["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
        out.append(entry)
    return out


def _tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's tool calls as templates take them: ``arguments`` a dict."""
    if isinstance(calls, (str, bytes)) or not isinstance(calls, Sequence):
        raise TypeError(f"{where} must be a list of tool calls, got {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            raise ValueError(f"{at} must be {{'id': str, 'type': 'function', 'function': {{'name': str, "
                             "'arguments': str}}}}")
        if call.get("type", "function") != "function":
            raise ValueError(f"{at}.type must be 'function', got {call.get('type')!r}")
        name, arguments = function.get("name"), function.get("arguments")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{at}.function.name must be a non-empty string, got {name!r}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as error:
                raise ValueError(f"{at}.function.arguments is not valid JSON: {error}") from None
        elif arguments is None:
            arguments = {}
        if not isinstance(arguments, Mapping):
            raise ValueError(f"{at}.function.arguments must be a JSON object (or its JSON text), got "
                             f"{type(arguments).__name__}")
        entry = {"type": "function", "function": {"name": name, "arguments": dict(arguments)}}
        if call.get("id") is not None:
            if not isinstance(call["id"], str):
                raise TypeError(f"{at}.id must be a string, got {type(call['id']).__name__}")
            entry["id"] = call["id"]
        out.append(entry)
    return out


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and hasattr(tokenizer, "apply_chat_template") and \
        bool(getattr(tokenizer, "chat_template", None))


RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tokenize", "add_generation_prompt", "return_dict",
                            "chat_template", "tokenizer_kwargs")


def render_chat(tokenizer, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                template_kwargs: Mapping[str, Any] | None = None, chat_template: str | None = None) -> str:
    """The conversation as the model's prompt text; ``template_kwargs`` are more variables for the template
    (``tools``, ``enable_thinking``, ...); ``chat_template`` (Jinja text) replaces the tokenizer's."""
    template_kwargs = dict(template_kwargs or {})
    reserved = sorted(set(template_kwargs) & set(RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    if tokenizer is None:
        raise ChatTemplateError("chat needs a tokenizer with a chat template; this model has no tokenizer "
                                "(send token ids to the completions API instead)")
    if chat_template is not None:
        template_kwargs["chat_template"] = chat_template
        if not hasattr(tokenizer, "apply_chat_template"):
            raise ChatTemplateError("chat needs a transformers tokenizer (apply_chat_template); this model's "
                                    f"tokenizer is a {type(tokenizer).__name__}")
    elif not has_chat_template(tokenizer):
        raise ChatTemplateError("chat needs a chat template; this model's tokenizer has none (set "
                                "'chat_template' in its tokenizer_config.json, or use the completions API)")
    return tokenizer.apply_chat_template(normalise_messages(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **template_kwargs)


def chat_token_ids(tokenizer, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                   template_kwargs: Mapping[str, Any] | None = None, chat_template: str | None = None) -> list[int]:
    """The conversation's prompt token ids (the rendered template encoded without extra special tokens)."""
    text = render_chat(tokenizer, messages, add_generation_prompt, template_kwargs, chat_template)
    encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [int(t) for t in encoded]


JINJA_MARKS = ("{{", "{%", "{#", "\n")


def load_chat_template(value: str | os.PathLike) -> str:
    """A chat template given as a file (its text) or as the template itself (text holding Jinja marks or a
    newline); ``ValueError`` for a value that is neither, e.g. a file path that does not exist."""
    if isinstance(value, os.PathLike) or (isinstance(value, str) and os.path.isfile(value)):
        path = os.fspath(value)
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"chat template file {path}: cannot read it ({error})") from error
    if not isinstance(value, str):
        raise TypeError(f"chat_template must be a str (a template or a file path), got {type(value).__name__}")
    if any(mark in value for mark in JINJA_MARKS):
        return value
    raise ValueError(f"chat template {value!r} is neither a file that exists nor a Jinja template (no "
                     "'{{', '{%', '{#' or newline in it)")


def encode_text(tokenizer, text: str) -> list[int]:
    """A text prompt's token ids, as ``LLM.add_request`` encodes it (the tokenizer's own special tokens)."""
    encoded = tokenizer.encode(text)
    return [int(t) for t in getattr(encoded, "ids", encoded)]  # `tokenizers` returns an Encoding
