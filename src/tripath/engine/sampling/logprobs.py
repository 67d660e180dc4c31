"""Log-probabilities of the chosen tokens and of the most likely ones, for the requests that ask for them.

For a row of logits ``z [V]``: ``lp = log_softmax(float32(z))`` — the model's distribution, before any of the
sampler's transforms — and, for a chosen token ``c`` (sampled, or the next prompt token), ``lp[c]``, its rank
``1 + #{t : lp[t] > lp[c]}`` and the ``k`` largest ``lp`` with their token ids (ranks ``1 .. k``). Rows
are computed on the device in one batch per step (:func:`position_logprobs`); the host turns them into one
``{token id: Logprob}`` dict per position (:func:`as_dicts`), only for the requests that asked.

Prompt log-probabilities (``prompt_logprobs``) score every prompt position ``p`` with the next prompt token
``prompt[p + 1]``: the step's hidden states of those positions go through the LM head in chunks of
:data:`PROMPT_CHUNK_ROWS` rows, so a long prompt never holds ``[tokens, vocab]`` logits at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from tripath.engine.requests.request import Logprob, PositionLogprobs

PROMPT_CHUNK_ROWS = 256
FIELDS = ("chosen_ids", "chosen", "ranks", "top_ids", "top_values")


@dataclass
class LogprobRows:
    """Results for ``R`` positions: ``chosen_ids [R]`` int64 and their log-probabilities ``chosen [R]``
    float32, ``ranks [R]`` int64, ``top_ids [R, k]`` int64, ``top_values [R, k]`` float32 (``k`` the most
    asked for in the batch)."""

    chosen_ids: torch.Tensor
    chosen: torch.Tensor
    ranks: torch.Tensor
    top_ids: torch.Tensor
    top_values: torch.Tensor

    @classmethod
    def cat(cls, parts: Sequence["LogprobRows"]) -> "LogprobRows":
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in FIELDS))

    def to_host(self) -> "LogprobRows":
        """The same rows copied to (pinned) host memory, asynchronously on a GPU: read after a sync."""
        def host(t: torch.Tensor) -> torch.Tensor:
            if t.device.type != "cuda":
                return t
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return out.copy_(t, non_blocking=True)
        return LogprobRows(*(host(getattr(self, f)) for f in FIELDS))

    def rows(self, start: int, stop: int) -> "LogprobRows":
        return LogprobRows(*(getattr(self, f)[start:stop] for f in FIELDS))


def position_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> LogprobRows:
    """Log-probabilities of ``chosen [R]`` under ``logits [R, V]`` (any float dtype), with ranks and the
    top ``k``."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    value = lp.gather(1, chosen[:, None])
    ranks = (lp > value).sum(dim=-1) + 1
    top_values, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], chosen[:, None][:, :0])
    return LogprobRows(chosen, value[:, 0], ranks, top_ids, top_values)


def prompt_logprobs(hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, k: int,
                    compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> LogprobRows:
    """``hidden[rows]`` through the LM head in chunks, each row scored with its ``targets`` token."""
    parts = []
    for start in range(0, rows.shape[0], PROMPT_CHUNK_ROWS):
        pick = rows[start:start + PROMPT_CHUNK_ROWS]
        parts.append(position_logprobs(compute_logits(hidden.index_select(0, pick)),
                                       targets[start:start + PROMPT_CHUNK_ROWS], k))
    return LogprobRows.cat(parts)


def as_dicts(rows: LogprobRows, ks: Sequence[int]) -> list[PositionLogprobs]:
    """Host results as one dict per position: the chosen token with its rank, then position ``i``'s top
    ``ks[i]`` tokens (the chosen one once, if among them)."""
    chosen_ids = rows.chosen_ids.tolist()
    values, ranks = rows.chosen.tolist(), rows.ranks.tolist()
    top_ids, top_values = rows.top_ids.tolist(), rows.top_values.tolist()
    out = []
    for i, k in enumerate(ks):
        entry = {chosen_ids[i]: Logprob(values[i], ranks[i])}
        for j in range(k):
            token = top_ids[i][j]
            if token not in entry:
                entry[token] = Logprob(top_values[i][j], j + 1)
        out.append(entry)
    return out
