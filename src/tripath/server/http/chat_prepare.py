"""The chat path shared by ``/v1/chat/completions`` and ``/v1/responses``: a validated chat request to its
:class:`~tripath.server.http.generation.Generation` and :class:`~tripath.server.http.tools.ToolPlan`.

In order: the tool plan (400 naming the field for bad ``tools`` / ``tool_choice``, or ``auto`` without the
server's flags), the prompt (the chat template in a worker thread, through the server's gate for large texts,
in the tokenizer helper process for a body of ``PROMPT_IN_HELPER_CHARS`` bytes or more,
given the tools in the chat API's shape and the history's tool calls and results), the output constraint (the
plan's JSON schema for ``required`` / a named function, held to ``--max-structured-output-bytes`` and checked
here, so a schema xgrammar cannot enforce is a 400 naming ``tools``; else the request's ``response_format`` /
``structured_outputs``), and the engine submissions, decoded with special tokens kept when the plan's format
needs its markers (``hermes``, ``mistral``, as vLLM does).

The first request with tools also checks that the chat template rendered them (a tool's name in the
prompt): a template that ignores ``tools`` leaves the model blind to them, which is logged once, naming
``--chat-template``.
"""

from __future__ import annotations

import json
import logging

from tripath.server.http.engine_requests import (chat_prompt, check_ids, constraint, generation, in_thread,
                                                 structured_output)
from tripath.server.http.generation import APIError, Generation
from tripath.server.http.large_prompts import PROMPT_IN_HELPER_CHARS, chat_messages, chat_prompt_in_helper
from tripath.server.http.tools import ToolError, ToolPlan, plan_tools

log = logging.getLogger("tripath.server")


async def prepare_chat(state, body, raw: bytes, messages_of=chat_messages) -> tuple[Generation, ToolPlan | None]:
    """``body``: a :class:`~tripath.server.http.protocol.ChatCompletionRequest` the route has checked (ready, model,
    fits); ``raw``: the HTTP body it came in (its size bounds the messages' text), from which ``messages_of``
    reads ``body``'s messages again where a large one is tokenised in the helper process
    (:mod:`~tripath.server.http.large_prompts`). Raises :class:`~tripath.server.http.generation.APIError`."""
    try:
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, state.tool_settings,
                          constrained=body.structured_output() is not None)
    except ToolError as error:
        raise APIError(400, str(error), param=error.param) from None
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    template_kwargs = dict(body.chat_template_kwargs or {})
    if plan is not None and plan.tools and "tools" not in template_kwargs:
        template_kwargs["tools"] = plan.template_tools()
    async with state.large_texts.admit(len(raw)):
        if len(raw) >= PROMPT_IN_HELPER_CHARS:
            prompt = await chat_prompt_in_helper(state, raw, messages_of, body.add_generation_prompt, template_kwargs)
            check_ids(state, prompt, "messages")
        else:
            prompt = await in_thread(chat_prompt, state, messages, body.add_generation_prompt, template_kwargs)
    if plan is not None and plan.tools and not getattr(state, "tools_template_checked", False):
        state.tools_template_checked = True
        await in_thread(_check_template_renders_tools, state, prompt, plan)
    if plan is not None and plan.schema is not None:
        structured = await in_thread(_tool_constraint, state, plan)
    else:
        structured = await structured_output(state, body)
    if plan is not None and plan.keeps_special_tokens and body.skip_special_tokens:
        body = body.model_copy(update={"skip_special_tokens": False})
    return generation(state, body, [prompt], body.output_limit, structured), plan


def _tool_constraint(state, plan: ToolPlan):
    text = json.dumps(plan.schema)
    spec = constraint(state, "tools", {"json": text})   # the size limit and the nesting bound
    try:
        import xgrammar

        xgrammar.Grammar.from_json_schema(text, any_whitespace=False)
    except ImportError:
        raise APIError(400, "tool_choice 'required' or a named function needs structured output (pip install "
                            "xgrammar)", param="tool_choice") from None
    except Exception as error:  # noqa: BLE001 - xgrammar raises RuntimeError / its own types for bad schemas
        raise APIError(400, f"the tools' parameters cannot be enforced as a JSON schema for tool_choice "
                            f"{plan.mode!r}: {error}", param="tools") from None
    return spec


def _check_template_renders_tools(state, prompt: list[int], plan: ToolPlan) -> None:
    text = state.engine.tokenizer.decode(prompt)
    if not any(tool.name in text for tool in plan.tools):
        log.warning("the chat template does not render the request's tools (no tool name in the prompt): the "
                    "model cannot see them; serve with --chat-template set to a template that renders tools "
                    "(checked once, on the first request with tools)")
