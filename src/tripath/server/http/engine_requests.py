"""From a validated request body to the engine: the checks every route makes (the engine ready, a served
model, token ids in the vocabulary, room in ``max_model_len`` and in the server's queue), a prompt's token ids,
a chat's rendered prompt, the output constraint, and the :class:`~tripath.server.http.generation.Generation` of a
request's choices; work that grows with what a client sends runs in worker threads (:func:`in_thread`).
``state`` is the app's :class:`~tripath.server.http.server_state.ServerState`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from typing import TYPE_CHECKING

import pydantic

from tripath.engine.requests.sampling_params import SamplingParams
from tripath.engine.requests.structured_output import StructuredOutput, constraint_size
from tripath.server.http import protocol as P
from tripath.server.http.generation import APIError, Generation
from tripath.server.http.large_prompts import (PROMPT_IN_HELPER_CHARS, chat_ids, completion_prompt_in_helper,
                                               text_ids)
from tripath.server.http.sampling_defaults import defaulted_sampling

if TYPE_CHECKING:
    from tripath.server.http.server_state import ServerState

def openapi_body(model: type[pydantic.BaseModel]) -> dict:
    """The OpenAPI description of a body the handler parses itself."""
    return {"requestBody": {"content": {"application/json": {"schema": model.model_json_schema()}}, "required": True}}


async def in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))


def chat_template_kwargs(body) -> dict:
    """The template variables of a chat body: its ``chat_template_kwargs``, and ``tools`` unless they set it."""
    template_kwargs = dict(body.chat_template_kwargs or {})
    if body.tools is not None and "tools" not in template_kwargs:
        template_kwargs["tools"] = body.tools
    return template_kwargs


def chat_prompt(state: ServerState, messages: list[dict], add_generation_prompt: bool,
                 template_kwargs: dict) -> list[int]:
    prompt = chat_ids(state.engine.tokenizer, messages, add_generation_prompt, template_kwargs, state.chat_template)
    check_ids(state, prompt, "messages")
    return prompt


def check_fits(state: ServerState, num_choices: int) -> None:
    """A request of more engine requests (prompts x n) than the server ever holds could never run: 400."""
    if num_choices > state.capacity:
        raise APIError(400, f"the request needs {num_choices} engine requests (prompts x n) but this server holds "
                            f"at most {state.capacity} at once (max_num_seqs {state.engine.max_num_seqs} + "
                            f"max_queue_depth {state.max_queue_depth})", param="n")


def check_ready(state: ServerState) -> None:
    if not state.engine.ready:
        raise APIError(503, "the engine is not ready (starting up or shutting down)", "server_error")


def check_model(state: ServerState, model: str) -> None:
    if model not in state.model_names:
        served = ", ".join(repr(n) for n in state.model_names)
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served}",
                       param="model", code="model_not_found")


def check_ids(state: ServerState, ids: list[int], param: str) -> None:
    check_vocab_ids(state.engine.vocab_size, ids, param)


def check_vocab_ids(vocab: int, ids: list[int], param: str) -> None:
    """400 naming ``param`` when ``ids`` is empty or holds an id outside ``[0, vocab)``."""
    if not ids:
        raise APIError(400, f"{param} is empty: a prompt needs at least one token", param=param)
    if min(ids) >= 0 and max(ids) < vocab:
        return
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"{param} holds token ids outside the vocabulary [0, {vocab}): {bad[:8]}", param=param)


async def encode_prompts(state: ServerState, raw_prompts: list, raw: bytes) -> list[list[int]]:
    """The token ids of a completions request's prompts (``raw``: its HTTP body): token ids checked here (at C
    speed); texts in a worker thread, through the server's gate for large texts, and a text of
    :data:`~tripath.server.http.large_prompts.PROMPT_IN_HELPER_CHARS` characters or more in the tokenizer helper
    process, which reads it from ``raw`` (:mod:`~tripath.server.http.large_prompts`)."""
    if not any(isinstance(p, str) for p in raw_prompts):
        return [prompt_ids(state, p, i) for i, p in enumerate(raw_prompts)]
    large = set() if state.engine.tokenizer is None else \
        {i for i, p in enumerate(raw_prompts) if isinstance(p, str) and len(p) >= PROMPT_IN_HELPER_CHARS}
    async with state.large_texts.admit(sum(len(p) for p in raw_prompts if isinstance(p, str))):
        ids = await in_thread(lambda: {i: prompt_ids(state, p, i) for i, p in enumerate(raw_prompts) if i not in large})
        for i in sorted(large):
            param = "prompt" if i == 0 else f"prompt[{i}]"
            ids[i] = await completion_prompt_in_helper(state, raw, i, param)
            check_ids(state, ids[i], param)
    return [ids[i] for i in range(len(raw_prompts))]


def prompt_ids(state: ServerState, prompt, i: int) -> list[int]:
    param = "prompt" if i == 0 else f"prompt[{i}]"
    if isinstance(prompt, str):
        if state.engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param=param)
        ids = text_ids(state.engine.tokenizer, prompt, param)
    else:
        ids = prompt   # validated token ids (ints >= 0)
    check_ids(state, ids, param)
    return ids


async def structured_output(state: ServerState, body) -> StructuredOutput | None:
    """The request's output constraint, checked in a worker thread (the engine compiles it off its loop when the
    request arrives, and refuses the request with 400 if it does not compile)."""
    asked = body.structured_output()
    return None if asked is None else await in_thread(constraint, state, *asked)


def constraint(state: ServerState, param: str, asked: dict) -> StructuredOutput:
    """``asked`` (``StructuredOutput`` keyword arguments from the request field ``param``) as a checked
    constraint: 400 naming ``param`` when it is larger than ``--max-structured-output-bytes``, nested too
    deep, or does not compile."""
    size, limit = constraint_size(next(iter(asked.values()))), state.max_structured_output_bytes
    if size > limit:
        raise APIError(400, f"{param} is {size} bytes; this server takes output constraints (a schema, regex, "
                            f"grammar or choices) of at most {limit} bytes (--max-structured-output-bytes)",
                       param=param, code="structured_output_too_large")
    try:
        spec = StructuredOutput(**{k: tuple(v) if k == "choice" else v for k, v in asked.items()})
    except (ValueError, TypeError, ImportError) as error:
        raise APIError(400, f"{param}: {error}", param=param) from None
    except RecursionError:   # a defence: StructuredOutput bounds the nesting before anything recurses
        raise APIError(400, f"{param} is nested too deeply", param=param) from None
    return spec


def check_logprobs(state: ServerState, body, chat: bool) -> None:
    """The request's log-probabilities within ``--max-logprobs``; ``prompt_logprobs`` not streamed (as vLLM)."""
    asked = (("top_logprobs", body.top_logprobs) if chat else ("logprobs", body.logprobs),
             ("prompt_logprobs", body.prompt_logprobs))
    for name, value in asked:
        if value is not None and value > state.max_logprobs:
            raise APIError(400, f"{name} ({value}) is more than the server's --max-logprobs ({state.max_logprobs})",
                           param=name)
    if body.stream and body.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs cannot be streamed: ask for them without stream", param="prompt_logprobs")


def generation(state: ServerState, body, prompts: list[list[int]], max_tokens: int | None,
                structured: StructuredOutput | None = None) -> Generation:
    """The engine submissions of a request: ``prompts`` x ``num_choices`` (``n``, or ``best_of``), choice
    ``j`` of a prompt seeded ``seed + j``. ``max_tokens`` 0 (completions): the prompt is scored and one token
    is run and hidden."""
    limit = state.engine.max_model_len
    chat = isinstance(body, P.ChatCompletionRequest)
    params, choice_prompts = [], []
    stop_ids = body.stop_ids()
    if stop_ids:
        check_ids(state, stop_ids, "stop_token_ids")
    bias = body.logit_bias_ids()
    if bias:
        check_ids(state, list(bias), "logit_bias")
    hidden = max_tokens == 0
    check_logprobs(state, body, chat)
    if chat:
        logprobs, prompt_logprobs = ((body.top_logprobs or 0) if body.logprobs else None), body.prompt_logprobs
    else:
        logprobs, prompt_logprobs = body.logprobs, body.scores_prompt
    ranked = body.num_choices > body.n   # best_of: the choices keep their log-probabilities to be ranked
    for prompt in prompts:
        room = limit - len(prompt)
        if room < 1:
            raise APIError(400, f"the prompt ({len(prompt)} tokens) leaves no room to generate within "
                                f"max_model_len ({limit})", param="prompt")
        for j in range(body.num_choices):
            seed = None if body.seed is None else body.seed + j
            try:
                sampling = defaulted_sampling(body, max_tokens, state.engine.generation_defaults, room)
                if hidden:
                    sampling["max_tokens"] = 1
                sp = SamplingParams(
                    **sampling, seed=seed, stop_token_ids=tuple(stop_ids), ignore_eos=body.ignore_eos,
                    min_tokens=body.min_tokens, presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty, logit_bias=bias,
                    logprobs=0 if ranked and logprobs is None else logprobs, prompt_logprobs=prompt_logprobs,
                    structured_output=structured)
            except (ValueError, TypeError) as error:   # SamplingParams' messages start with the field
                raise APIError(400, str(error), param=named_field(str(error))) from None
            params.append(sp)
            choice_prompts.append(prompt)
    check_fits(state, len(params))
    if state.outstanding + len(params) > state.capacity:
        state.metrics.rejected.labels("queue_full").inc()
        waiting = max(0, state.outstanding - state.engine.max_num_seqs)
        raise APIError(503, f"the server is overloaded: {state.outstanding} engine requests in flight, {waiting} "
                            f"beyond the {state.engine.max_num_seqs} the engine runs at once (max_queue_depth "
                            f"{state.max_queue_depth}); retry later", "server_error", code="overloaded")
    return Generation(state.engine, choice_prompts, params, body.stop_strings(), state.request_timeout_s,
                      prompt_tokens=sum(len(p) for p in prompts), include_stop=body.include_stop_str_in_output,
                      skip_special_tokens=body.skip_special_tokens, hidden=hidden,
                      choices_per_prompt=body.num_choices, n=body.n, request_log=state.request_log)


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def named_field(message: str) -> str | None:
    """The ``SamplingParams`` field a message of its checks opens with (``logit_bias[5] must ...``), else None."""
    word = message.split(" ", 1)[0].split("[", 1)[0]
    return word if word in _SAMPLING_FIELDS else None


def echo_texts(state: ServerState, raw_prompts, prompts: list[list[int]]) -> list[str]:
    """Each prompt's text as a response with ``echo`` repeats it (text prompts as sent, token ids decoded)."""
    tokenizer = state.engine.tokenizer
    return [p if isinstance(p, str) else ("" if tokenizer is None else tokenizer.decode(ids))
            for p, ids in zip(raw_prompts, prompts)]
