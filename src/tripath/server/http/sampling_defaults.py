"""The sampling fields a request may leave unset, resolved in one place: the request's value where it gave
one, else the model's default (its ``generation_config.json``, :mod:`tripath.engine.sampling.generation_defaults`),
else the engine's own (``SamplingParams``' field defaults). ``max_tokens`` left unset is the model's
``max_new_tokens``, else 16 for completions (OpenAI's default) and the room left in ``max_model_len`` for chat,
and never more than that room. Only fields that ``SamplingParams`` has are returned."""

from __future__ import annotations

import dataclasses

from tripath.engine.requests.sampling_params import SamplingParams
from tripath.engine.sampling.generation_defaults import usable_defaults
from tripath.server.http import protocol as P

DEFAULTED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
COMPLETIONS_MAX_TOKENS = 16


def defaulted_sampling(body, max_tokens: int | None, model_defaults: dict, room: int) -> dict:
    """``SamplingParams`` keyword arguments for ``body``'s defaulted fields and ``max_tokens`` (the request's
    output limit, None when unset); ``room``: the tokens its prompt leaves within ``max_model_len``."""
    engine = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    model = usable_defaults(model_defaults)
    kwargs = {}
    for name in DEFAULTED_FIELDS:
        if name in engine:
            value = getattr(body, name, None)
            kwargs[name] = value if value is not None else model.get(name, engine[name])
    if max_tokens is None:
        fallback = COMPLETIONS_MAX_TOKENS if isinstance(body, P.CompletionRequest) else room
        max_tokens = min(model.get("max_tokens", fallback), room)
    kwargs["max_tokens"] = max_tokens
    return kwargs
