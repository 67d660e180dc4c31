"""Speculative decoding with structured output: a verify's rows constrained by the request's grammar.

Row ``j`` of a verify decides the token after the request's pending token and its first ``j`` drafts (a draft
tree's node ``i``: after its path), so its logits take the mask of the grammar's state there
(:meth:`~tripath.engine.requests.structured_output.GrammarState.fill_drafts`, the matcher advanced along the
drafts and rolled back). Acceptance then compares each draft with, or samples against, the constrained
distribution, exactly as a non-speculative step would draw from it; a draft the grammar refuses is never
kept. Only acceptance reads the constrained copy: log-probabilities stay those of the raw logits, as for
sampled rows.
"""

from __future__ import annotations

from typing import Sequence

import torch

from tripath.attention.step_ints import to_device
from tripath.engine.requests.structured_output import apply_bitmask, new_bitmask


def constrained_logits(logits: torch.Tensor, verifies: Sequence) -> torch.Tensor:
    """``logits [R, V]`` of the ``verifies``' rows (scheduled requests with drafts, request after request,
    ``num_new_tokens`` rows each): a float32 copy with each grammar-constrained request's rows masked, or
    ``logits`` itself when no verify has a grammar."""
    constrained = [j for j, item in enumerate(verifies) if item.request.grammar is not None]
    if not constrained:
        return logits
    starts = [0]
    for item in verifies[:-1]:
        starts.append(starts[-1] + item.num_new_tokens)
    mask = new_bitmask(sum(verifies[j].num_new_tokens for j in constrained), logits.shape[-1])
    rows, at = [], 0
    for j in constrained:
        item = verifies[j]
        item.request.grammar.fill_drafts(mask, at, item.draft_token_ids, item.draft_parents)
        rows.extend(range(starts[j], starts[j] + item.num_new_tokens))
        at += item.num_new_tokens
    out = logits.to(torch.float32, copy=True)
    apply_bitmask(out, to_device(rows, torch.int64, logits.device), mask.to(logits.device, non_blocking=True))
    return out
