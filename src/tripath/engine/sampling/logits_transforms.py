"""The sampler's transforms of a step's logits before temperature: a structured output's mask,
``min_tokens``, ``logit_bias`` and the repetition / frequency / presence penalties, batched on the device.

For a row ``z [V]`` (float32) of a request with parameters ``SamplingParams``, in vLLM's order:

- structured output: ``z[t] = -inf`` for the tokens its grammar does not allow next
  (:mod:`tripath.engine.requests.structured_output`; the mask is filled on the host for the step);
- ``min_tokens``: while the request has fewer outputs, ``z[t] = -inf`` for its stop tokens (the model's
  end-of-sequence ids unless ``ignore_eos``, and ``stop_token_ids``);
- ``logit_bias``: ``z[t] += bias[t]``;
- ``repetition_penalty`` ``r``: for every token ``t`` seen in the prompt or the outputs, ``z[t] / r`` if
  ``z[t] > 0`` else ``z[t] * r``;
- ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p``: ``z[t] -= f * c[t] + p * (c[t] > 0)``, ``c[t]``
  the count of ``t`` among the outputs.

The counts live on the device (:class:`PenaltyState`): one row per *slot*, a slot per running request with
penalties, ``counts [slots, V]`` int32 and ``in_prompt [slots, V]`` bool. A request gets a slot the first
time it samples after being admitted (its counts rebuilt from the outputs it already has: none, or those
kept through a preemption), and each model step adds its sampled tokens on the device — so multi-step
decoding and overlapped steps see every earlier token without a trip through the host. Slots of requests
that stopped running are reclaimed when slots run short. A step whose requests use none of the transforms
costs nothing here (:func:`step_transforms` returns None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tripath.attention.step_ints import to_device
from tripath.engine.requests.request import Request, RequestStatus
from tripath.engine.requests.structured_output import apply_bitmask, new_bitmask


class PenaltyState:
    """Token counts of the running requests with penalties, one device row each (see the module doc).
    ``num_slots``: the most such requests at once (``max_num_seqs``); the rows are allocated on first use."""

    def __init__(self, num_slots: int, device: torch.device):
        self.num_slots = num_slots
        self.device = device
        self.counts: torch.Tensor | None = None     # [num_slots, V] int32
        self.in_prompt: torch.Tensor | None = None  # [num_slots, V] bool
        self.owner: list[Request | None] = [None] * num_slots
        self._slot_of: dict[int, int] = {}          # id(request) -> slot

    def allocate(self, vocab_size: int) -> None:
        """The device rows for a vocabulary of ``vocab_size`` (the logits' width), if not there yet."""
        if self.counts is None:
            self.counts = torch.zeros(self.num_slots, vocab_size, dtype=torch.int32, device=self.device)
            self.in_prompt = torch.zeros(self.num_slots, vocab_size, dtype=torch.bool, device=self.device)

    def slots_for(self, requests: Sequence[Request], vocab_size: int) -> list[int]:
        """A slot for each request (reusing its own, else a free one, its counts rebuilt from its outputs)."""
        self.allocate(vocab_size)
        slots = []
        for request in requests:
            slot = self._slot_of.get(id(request))
            if slot is None or self.owner[slot] is not request:
                slot = self._assign(request)
            slots.append(slot)
        return slots

    def _assign(self, request: Request) -> int:
        free = next((s for s, r in enumerate(self.owner) if r is None), None)
        if free is None:
            self._reclaim()
            free = next((s for s, r in enumerate(self.owner) if r is None), None)
            if free is None:
                raise RuntimeError(f"more than {self.num_slots} running requests with penalties")
        self.owner[free] = request
        self._slot_of[id(request)] = free
        counts, prompt = self.counts[free], self.in_prompt[free]
        counts.zero_()
        prompt.zero_()
        prompt[to_device(request.prompt_token_ids, torch.int64, self.device)] = True
        if request.output_token_ids:
            outputs = to_device(request.output_token_ids, torch.int64, self.device)
            counts.index_add_(0, outputs, torch.ones_like(outputs, dtype=torch.int32))
        return free

    def _reclaim(self) -> None:
        """Free the slots of requests no longer running (a preempted one rebuilds its counts when it runs
        again; the steps already queued on the device have read their rows by the time a slot is reused)."""
        for slot, request in enumerate(self.owner):
            if request is not None and request.status is not RequestStatus.RUNNING:
                self.owner[slot] = None
                self._slot_of.pop(id(request), None)


@dataclass
class StepTransforms:
    """The transforms of one launch's sampled rows, as device index tensors (built by :func:`step_transforms`).

    ``ban_rows / ban_tokens / ban_left``: a stop token of a row under ``min_tokens``, banned while the model
    step index is below ``ban_left`` (outputs still missing when the launch began); ``bias_*``: logit_bias
    entries; ``penalty_rows`` and their ``slots`` with per-row ``repetition / frequency / presence``, and
    ``prefix_rows / prefix_tokens``: tokens counted for one penalty row beyond its slot's (a verify row's
    drafts before it, :mod:`tripath.engine.speculative.verify_transforms`)."""

    grammar_rows: torch.Tensor | None = None
    grammar_mask: torch.Tensor | None = None
    ban_rows: torch.Tensor | None = None
    ban_tokens: torch.Tensor | None = None
    ban_left: torch.Tensor | None = None
    bias_rows: torch.Tensor | None = None
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    penalty_rows: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    state: PenaltyState | None = None
    prefix_rows: torch.Tensor | None = None     # speculative verifies: a penalty row's drafts before it,
    prefix_tokens: torch.Tensor | None = None   # counted on top of its slot's counts (index into penalty_rows)

    def apply(self, logits: torch.Tensor, step: int = 0) -> torch.Tensor:
        """A float32 copy of ``logits [N, V]`` with the transforms applied for model step ``step`` of the
        launch."""
        out = logits.to(torch.float32, copy=True)
        if self.grammar_rows is not None:
            apply_bitmask(out, self.grammar_rows, self.grammar_mask)
        if self.ban_rows is not None:
            neg = torch.where(self.ban_left > step, float("-inf"), 0.0)
            out.index_put_((self.ban_rows, self.ban_tokens), neg, accumulate=True)
        if self.bias_rows is not None:
            out.index_put_((self.bias_rows, self.bias_tokens), self.bias_values, accumulate=True)
        if self.penalty_rows is not None:
            rows = out.index_select(0, self.penalty_rows)
            counts = self.state.counts.index_select(0, self.slots)
            if self.prefix_rows is not None:
                counts.index_put_((self.prefix_rows, self.prefix_tokens), torch.ones_like(self.prefix_rows,
                                                                                          dtype=torch.int32),
                                  accumulate=True)
            seen = self.state.in_prompt.index_select(0, self.slots) | (counts > 0)
            r = self.repetition[:, None]
            rows = torch.where(seen, torch.where(rows > 0, rows / r, rows * r), rows)
            rows -= self.frequency[:, None] * counts + self.presence[:, None] * (counts > 0)
            out.index_copy_(0, self.penalty_rows, rows)
        return out

    def record(self, tokens: torch.Tensor) -> None:
        """Count the tokens just sampled ``[N]`` for the rows with penalties."""
        if self.penalty_rows is not None:
            chosen = tokens.index_select(0, self.penalty_rows)
            self.state.counts.index_put_((self.slots, chosen), torch.ones_like(chosen, dtype=torch.int32),
                                         accumulate=True)


def step_transforms(requests: Sequence[Request], state: PenaltyState, vocab_size: int, device: torch.device,
                    num_steps: int = 1) -> StepTransforms | None:
    """The transforms for a launch of ``num_steps`` model steps whose sampled rows are ``requests`` (row
    ``i``: ``requests[i]``, scheduled: its in-flight tokens count this launch's), or None when none of them
    transforms its logits."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.transforms_logits or r.grammar is not None]
    if not rows:
        return None
    t = StepTransforms()
    constrained = [i for i in rows if requests[i].grammar is not None]
    if constrained:
        if num_steps != 1:
            raise ValueError("a step with structured output runs one model step a launch")
        mask = new_bitmask(len(constrained), vocab_size)
        for j, i in enumerate(constrained):
            requests[i].grammar.fill(mask, j)
        t.grammar_rows = to_device(constrained, torch.int64, device)
        t.grammar_mask = mask.to(device, non_blocking=True)
    ban_rows, ban_tokens, ban_left = [], [], []
    bias_rows, bias_tokens, bias_values = [], [], []
    penalized = []
    for i in rows:
        request = requests[i]
        params = request.sampling_params
        missing = params.min_tokens - (request.num_output_tokens + request.num_inflight_tokens - num_steps)
        if missing > 0:
            stops = set(params.stop_token_ids)
            if not params.ignore_eos:
                stops.update(request.eos_token_ids)
            stops = [s for s in stops if s < vocab_size]
            ban_rows += [i] * len(stops)
            ban_tokens += stops
            ban_left += [missing] * len(stops)
        if params.logit_bias:
            entries = [(tok, b) for tok, b in params.logit_bias.items() if tok < vocab_size]
            bias_rows += [i] * len(entries)
            bias_tokens += [tok for tok, _ in entries]
            bias_values += [b for _, b in entries]
        if params.has_penalties:
            penalized.append(i)
    if ban_rows:
        t.ban_rows, t.ban_tokens = to_device(ban_rows, torch.int64, device), to_device(ban_tokens, torch.int64, device)
        t.ban_left = to_device(ban_left, torch.int64, device)
    if bias_rows:
        t.bias_rows = to_device(bias_rows, torch.int64, device)
        t.bias_tokens = to_device(bias_tokens, torch.int64, device)
        t.bias_values = to_device(bias_values, torch.float32, device)
    if penalized:
        chosen = [requests[i] for i in penalized]
        params = [r.sampling_params for r in chosen]
        t.state = state
        t.penalty_rows = to_device(penalized, torch.int64, device)
        t.slots = to_device(state.slots_for(chosen, vocab_size), torch.int64, device)
        t.repetition = to_device([p.repetition_penalty for p in params], torch.float32, device)
        t.frequency = to_device([p.frequency_penalty for p in params], torch.float32, device)
        t.presence = to_device([p.presence_penalty for p in params], torch.float32, device)
    return t

