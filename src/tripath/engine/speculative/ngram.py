"""Prompt-lookup drafts (the ``ngram`` method): no weights, only the request's own tokens.

For a request whose tokens (prompt and outputs) are ``x[0 .. L-1]``: for ``n`` from ``prompt_lookup_max`` down
to ``prompt_lookup_min``, find the starts ``i < L - n`` with ``x[i .. i+n-1] == x[L-n .. L-1]``; take the latest
that ``k`` tokens follow (else the earliest: the most tokens follow it); the drafts are ``x[i+n .. i+n+k-1]``
(as many of the ``k`` as exist). No match for any ``n``: no drafts. Repetitive text
(code edits, quoting, extraction, lists) drafts well; other text drafts little and then costs nothing.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

LOOKUP_WINDOW = 4096   # the latest tokens searched: bounds the host's time per request and step


class NgramProposer:
    """Drafts by prompt lookup (module doc). A proposer's ``propose(request, k)`` is called once per request
    and verify step, with ``k >= 1`` the most drafts the request can take."""

    def __init__(self, lookup_min: int, lookup_max: int):
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose(self, request, k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow a running request's tokens (prompt and outputs)."""
        return self.lookup(request.token_ids(0, request.num_tokens), k)

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``token_ids``."""
        if k < 1 or len(token_ids) <= self.lookup_min:
            return []
        tokens = np.asarray(token_ids[-LOOKUP_WINDOW:], dtype=np.int64)
        length = tokens.shape[0]
        for n in range(min(self.lookup_max, length - 1), self.lookup_min - 1, -1):
            windows = sliding_window_view(tokens[:length - 1], n)   # starts i <= L - 1 - n: a token follows
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                full = hits[hits + n + k <= length]
                start = int(full[-1] if full.size else hits[0]) + n
                return tokens[start:start + k].tolist()
        return []
