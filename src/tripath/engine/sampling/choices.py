"""Several completions of one prompt (``SamplingParams(n=..., best_of=...)``): one engine request each.

Choice ``i`` of a prompt runs with the prompt's parameters but ``n = 1`` and, when a ``seed`` is given,
``seed + i``, so the choices differ and each is reproducible alone. With ``best_of`` > ``n``, ``best_of``
choices run, each keeping the log-probabilities of its tokens (``logprobs`` at least 0), and the ``n`` of
highest cumulative log-probability are returned, best first (ties: the lower index first); log-probabilities
the caller did not ask for are dropped from the result.
"""

from __future__ import annotations

import dataclasses

from tripath.engine.requests.request import RequestOutput
from tripath.engine.requests.sampling_params import SamplingParams


def choice_params(params: SamplingParams) -> list[SamplingParams]:
    """The parameters of each engine request of a prompt asking for ``params.num_choices`` completions."""
    if params.num_choices == 1:
        return [params]
    ranked = params.best_of is not None and params.best_of > params.n
    out = []
    for i in range(params.num_choices):
        out.append(dataclasses.replace(
            params, n=1, best_of=None, seed=None if params.seed is None else params.seed + i,
            logprobs=params.logprobs if params.logprobs is not None or not ranked else 0))
    return out


def group_choices(outputs: list[RequestOutput], params: SamplingParams) -> RequestOutput:
    """One :class:`RequestOutput` for a prompt's finished choices ``outputs`` (in choice order): ``outputs``
    numbered ``0 .. n - 1`` (the best ``n`` by cumulative log-probability with ``best_of``)."""
    if len(outputs) == 1:
        return outputs[0]
    completions = [o.outputs[0] for o in outputs]
    if params.best_of is not None and params.best_of > params.n:
        order = sorted(range(len(completions)), key=lambda i: (-completions[i].cumulative_logprob, i))
        completions = [completions[i] for i in order[:params.n]]
        if params.logprobs is None:
            completions = [dataclasses.replace(c, logprobs=None, cumulative_logprob=None) for c in completions]
    completions = [dataclasses.replace(c, index=i) for i, c in enumerate(completions)]
    first = outputs[0]
    return RequestOutput(first.request_id, first.prompt, first.prompt_token_ids, completions,
                         all(o.finished for o in outputs), prompt_logprobs=first.prompt_logprobs, ttft=first.ttft,
                         tpot=first.tpot, num_preemptions=sum(o.num_preemptions for o in outputs))


