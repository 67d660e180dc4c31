"""The sampling side of one launch: the rows' logit transforms, the sampler, and the log-probabilities the
requests ask for (:class:`LaunchSampler`), plus the prompt positions a step scores (:func:`score_prompts`).

A launch samples the last token of each scheduled request that reaches the end of its tokens (its *sample
rows*), once per model step (several for multi-step decoding). Requests that ask for nothing beyond tokens
cost one list scan per launch here; the transforms (:mod:`tripath.engine.sampling.logits_transforms`) and the
log-probabilities (:mod:`tripath.engine.sampling.logprobs`) run only for the rows that use them, batched on the
device. A launch whose rows all allow it draws from the hidden states instead, without logits
(:meth:`LaunchSampler.draw_fused`; which launches do: :mod:`tripath.engine.sampling.fused_sampling`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from tripath.attention.step_ints import to_device
from tripath.engine.requests.request import Request
from tripath.engine.sampling.logits_transforms import PenaltyState, step_transforms
from tripath.engine.sampling.logprobs import LogprobRows, position_logprobs, prompt_logprobs
from tripath.engine.sampling.sampler import sample


def noise_seed(request) -> int:
    """The key of a request's draws by Gumbel-max: its ``sampling_seed`` (its generator's), else its ``seed``,
    else 0."""
    seed = getattr(request, "sampling_seed", None)
    return (request.sampling_params.seed or 0) if seed is None else seed


class LaunchSampler:
    """Samples ``requests`` (the launch's sample rows, in row order) for each model step of a launch and
    keeps the log-probabilities of the rows with ``logprobs`` set (one :class:`LogprobRows` per step).
    Rows drawn with noise (plain temperature) take their request's ``sampling_seed`` and the position passed
    with each model step's logits."""

    def __init__(self, requests: Sequence[Request], penalties: PenaltyState, device: torch.device, num_steps: int = 1):
        self.requests, self.penalties, self.num_steps = requests, penalties, num_steps
        self.device = device
        self.params = [r.sampling_params for r in requests]
        self.generators = [r.generator for r in requests]
        self.any_sampled = any(p.temperature != 0 for p in self.params)
        self.needs_positions = self.any_sampled and any(p.plain_temperature for p in self.params)
        self._seeds = self._temperature = None
        self.transforms = None
        self._transforms_built = False
        self.logprob_rows = [i for i, p in enumerate(self.params) if p.logprobs is not None]
        self.logprob_ks = [self.params[i].logprobs for i in self.logprob_rows]
        self._pick = to_device(self.logprob_rows, torch.int64, device) if self.logprob_rows else None
        self.logprobs: list[LogprobRows] = []

    def __call__(self, logits: torch.Tensor, step: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens ``[N]`` for the rows' ``logits [N, V]`` at model step ``step`` of the launch; ``positions [N]``
        (int64, device): each row's position, the noise's counter (needed when :attr:`needs_positions`)."""
        if not self._transforms_built:  # the logits' width is the vocabulary the transforms index
            self.transforms = step_transforms(self.requests, self.penalties, logits.shape[-1], logits.device,
                                              self.num_steps)
            self._transforms_built = True
        noise = (self.seeds, positions) if self.needs_positions else None
        tokens = sample(logits, self.params, self.generators, self.transforms, step, noise)
        if self._pick is not None:
            self.logprobs.append(position_logprobs(logits.index_select(0, self._pick),
                                                   tokens.index_select(0, self._pick), max(self.logprob_ks)))
        return tokens

    @property
    def seeds(self) -> torch.Tensor:
        """``[N]`` int64: each row's noise key (:func:`noise_seed`)."""
        if self._seeds is None:
            self._seeds = to_device([noise_seed(r) for r in self.requests], torch.int64, self.device)
        return self._seeds

    def draw_fused(self, model, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Tokens ``[N]`` straight from the rows' hidden states ``hidden [N, hidden_size]`` by
        ``model.sample_tokens`` (every row drawable so: :mod:`tripath.engine.sampling.fused_sampling`), with the greedy
        rows' own log-probabilities (rank 1, no top tokens) where asked."""
        if not self.any_sampled:
            draw = model.sample_tokens(hidden)
        else:
            if self._temperature is None:
                self._temperature = to_device([p.temperature for p in self.params], torch.float32, self.device)
            draw = model.sample_tokens(hidden, self._temperature, self.seeds, positions)
        if self._pick is not None:
            chosen = draw.tokens.index_select(0, self._pick)
            none = draw.lse.index_select(0, self._pick)[:, None][:, :0]   # no top tokens: [R, 0]
            self.logprobs.append(LogprobRows(chosen, draw.logprobs.index_select(0, self._pick), torch.ones_like(chosen),
                                             chosen[:, None][:, :0], none))
        return draw.tokens


def score_prompts(scheduled, plan, hidden: torch.Tensor,
                  compute_logits: Callable[[torch.Tensor], torch.Tensor]):
    """Prompt log-probabilities of this step's prompt positions for the scheduled requests with
    ``prompt_logprobs`` set, or None when there are none. A position ``p`` of a request's step is scored
    with the next prompt token (``p + 1 < len(prompt)``) unless an earlier step already did (preempted and
    recomputed). Returns ``(requests, counts, ks, rows)``: for each such request (index into ``scheduled``) the
    number of positions scored and its ``k``, and the :class:`LogprobRows` of all of them in that order."""
    wanted = [i for i, item in enumerate(scheduled) if item.request.sampling_params.prompt_logprobs is not None]
    if not wanted:
        return None
    starts = {}
    at = 0
    for i, n in zip(plan.order, plan.query_lens):  # token offset of each request in the step's flat layout
        starts[i] = at
        at += n
    requests, counts, ks, rows, targets = [], [], [], [], []
    for i in wanted:
        item, request = scheduled[i], scheduled[i].request
        first = max(item.num_computed_tokens, request.num_prompt_logprobs_done)
        stop = min(item.num_computed_tokens + item.num_new_tokens, request.num_prompt_tokens - 1)
        if stop <= first:
            continue
        positions = np.arange(first, stop)
        rows.append(starts[i] + positions - item.num_computed_tokens)
        targets.append(np.asarray(request.prompt_token_ids[first + 1:stop + 1], dtype=np.int64))
        requests.append(i)
        counts.append(stop - first)
        ks.append(request.sampling_params.prompt_logprobs)
    if not requests:
        return None
    device = hidden.device
    row_index = to_device(np.concatenate(rows).tolist(), torch.int64, device)   # pinned: from a list
    target_ids = to_device(np.concatenate(targets).tolist(), torch.int64, device)
    return requests, counts, ks, prompt_logprobs(hidden, row_index, target_ids, max(ks), compute_logits)
