"""The sampler's logit transforms on a step's verify rows: a structured output's mask, ``min_tokens``,
``logit_bias`` and the penalties (:mod:`tripath.engine.sampling.logits_transforms`), each row as a
non-speculative step at its place would apply them.

Row ``r`` of a verify decides the token after the request's pending token and its first ``r`` drafts (a draft
tree's node: after its path), so it takes

- the mask of the grammar's state after those drafts
  (:meth:`~tripath.engine.requests.structured_output.GrammarState.fill_drafts`, the matcher advanced and rolled
  back);
- ``min_tokens``: the stop tokens banned while the request's outputs and the ``r`` drafts fall short of it;
- ``logit_bias`` as every row;
- the penalties over the request's token counts (:class:`~tripath.engine.sampling.logits_transforms.PenaltyState`)
  plus those ``r`` drafts.

Acceptance compares each draft with (greedy) or samples against the transformed distribution, as a
non-speculative step draws from it, so a draft the grammar refuses is never kept. Only acceptance reads the
transformed copy: log-probabilities stay those of the raw logits, as for sampled rows. After acceptance
:meth:`VerifyTransforms.record` counts the tokens each verify yielded for its penalties.
"""

from __future__ import annotations

from typing import Sequence

import torch

from tripath.attention.step_ints import to_device
from tripath.engine.requests.structured_output import new_bitmask
from tripath.engine.sampling.logits_transforms import PenaltyState, StepTransforms


def _paths(drafts: Sequence[int], parents: Sequence[int] | None) -> list[list[int]]:
    """The drafts before each row of a verify: ``[]`` for row 0, then each draft's path (itself last)."""
    paths: list[list[int]] = [[]]
    for i in range(len(drafts)):
        parent = i - 1 if parents is None else parents[i]
        paths.append(paths[parent + 1] + [drafts[i]])
    return paths


class VerifyTransforms:
    """The transforms of the rows of ``verifies`` (scheduled requests with drafts, request after request,
    ``num_new_tokens`` rows each), built by :func:`verify_transforms`."""

    def __init__(self, rows: StepTransforms, penalized: list[int], slots: list[int], device: torch.device):
        self.rows = rows
        self.penalized = to_device(penalized, torch.int64, device) if penalized else None   # verify indices
        self.slots = to_device(slots, torch.int64, device) if penalized else None           # their slots

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A float32 copy of the verifies' ``logits [R, V]`` with each row's transforms applied."""
        return self.rows.apply(logits)

    def record(self, grid: torch.Tensor) -> None:
        """Count, for the penalties, the tokens each verify yielded: ``grid [B, W]`` (acceptance's, -1 past a
        verify's tokens), on the device."""
        if self.penalized is None:
            return
        yielded = grid.index_select(0, self.penalized)
        slots = self.slots[:, None].expand_as(yielded)
        self.rows.state.counts.index_put_((slots.reshape(-1), yielded.clamp(min=0).reshape(-1)),
                                          (yielded >= 0).to(torch.int32).reshape(-1), accumulate=True)


def verify_transforms(verifies: Sequence, penalties: PenaltyState, vocab_size: int,
                      device: torch.device) -> VerifyTransforms | None:
    """The transforms of ``verifies``' rows, or None when none of them has any (module doc)."""
    chosen = [j for j, item in enumerate(verifies)
              if item.request.grammar is not None or item.request.sampling_params.transforms_logits]
    if not chosen:
        return None
    starts = [0]
    for item in verifies[:-1]:
        starts.append(starts[-1] + item.num_new_tokens)
    t = StepTransforms()
    grammar = [j for j in chosen if verifies[j].request.grammar is not None]
    if grammar:
        mask = new_bitmask(sum(verifies[j].num_new_tokens for j in grammar), vocab_size)
        rows, at = [], 0
        for j in grammar:
            item = verifies[j]
            item.request.grammar.fill_drafts(mask, at, item.draft_token_ids, item.draft_parents)
            rows.extend(range(starts[j], starts[j] + item.num_new_tokens))
            at += item.num_new_tokens
        t.grammar_rows = to_device(rows, torch.int64, device)
        t.grammar_mask = mask.to(device, non_blocking=True)
    ban, bias, penalty_rows, prefix, penalized = [], [], [], [], []
    for j in chosen:
        item, start = verifies[j], starts[j]
        request, params = item.request, item.request.sampling_params
        paths = _paths(item.draft_token_ids, item.draft_parents)
        if params.min_tokens > 0:
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(request.eos_token_ids))
            ban += [(start + r, s) for r, path in enumerate(paths)
                    if request.num_output_tokens + len(path) < params.min_tokens for s in stops if s < vocab_size]
        if params.logit_bias:
            bias += [(start + r, tok, b) for r in range(len(paths)) for tok, b in params.logit_bias.items()
                     if tok < vocab_size]
        if params.has_penalties:
            penalized.append(j)
            for r, path in enumerate(paths):
                prefix += [(len(penalty_rows), tok) for tok in path]   # this row's counts gain its drafts
                penalty_rows.append((start + r, j))
    if ban:
        t.ban_rows = to_device([r for r, _ in ban], torch.int64, device)
        t.ban_tokens = to_device([s for _, s in ban], torch.int64, device)
        t.ban_left = torch.ones(len(ban), dtype=torch.int64, device=device)   # banned at model step 0
    if bias:
        t.bias_rows = to_device([r for r, _, _ in bias], torch.int64, device)
        t.bias_tokens = to_device([tok for _, tok, _ in bias], torch.int64, device)
        t.bias_values = to_device([b for _, _, b in bias], torch.float32, device)
    slots = []
    if penalized:
        slots = penalties.slots_for([verifies[j].request for j in penalized], vocab_size)
        slot_of = dict(zip(penalized, slots))
        params = [verifies[j].request.sampling_params for _, j in penalty_rows]
        t.state = penalties
        t.penalty_rows = to_device([r for r, _ in penalty_rows], torch.int64, device)
        t.slots = to_device([slot_of[j] for _, j in penalty_rows], torch.int64, device)
        t.repetition = to_device([p.repetition_penalty for p in params], torch.float32, device)
        t.frequency = to_device([p.frequency_penalty for p in params], torch.float32, device)
        t.presence = to_device([p.presence_penalty for p in params], torch.float32, device)
        if prefix:
            t.prefix_rows = to_device([r for r, _ in prefix], torch.int64, device)
            t.prefix_tokens = to_device([tok for _, tok in prefix], torch.int64, device)
    return VerifyTransforms(t, penalized, slots, device)
