"""Prompt-lookup drafts (the ``ngram`` method): no weights, only the request's own tokens.

For a request whose tokens (prompt and outputs) are ``x[0 .. L-1]``: for ``n`` from ``prompt_lookup_max`` down
to ``prompt_lookup_min``, find the starts ``i < L - n`` with ``x[i .. i+n-1] == x[L-n .. L-1]``; take the latest
that ``k`` tokens follow (else the earliest: the most tokens follow it); the drafts are ``x[i+n .. i+n+k-1]``
(as many of the ``k`` as exist). No match for any ``n``: no drafts. Repetitive text
(code edits, quoting, extraction, lists) drafts well; other text drafts little and then costs nothing.

Draft trees (``tree_width = w > 1``, :meth:`NgramProposer.lookup_tree`): for the same ``n``, up to ``w``
distinct continuations — the chain's first, then those of the other occurrences, latest first — merged by
common prefix into a tree of at most ``k`` nodes (:func:`~tripath.engine.speculative.trees.merge_branches`).

Cost per request and step: one comparison of the last token against the latest :data:`LOOKUP_WINDOW` tokens,
then a few over its occurrences only; each request's tokens are kept in a NumPy array that grows by the new
outputs (:class:`TokenHistory`), so no step converts the whole sequence.
"""

from __future__ import annotations

import weakref

import numpy as np

from tripath.engine.speculative.trees import merge_branches

LOOKUP_WINDOW = 16384   # the latest tokens searched: bounds the host's time per request and step
TREE_CANDIDATES = 64    # the latest occurrences a draft tree's branches are taken from


class TokenHistory:
    """A request's tokens as an int64 array, extended in place by the outputs it gained since the last call
    (prompt and outputs only ever grow; a preempted request keeps both)."""

    __slots__ = ("array", "count")

    def __init__(self, request):
        tokens = request.token_ids(0, request.num_tokens)
        self.array = np.empty(max(64, 2 * len(tokens)), dtype=np.int64)
        self.array[:len(tokens)] = tokens
        self.count = len(tokens)

    def sync(self, request) -> np.ndarray:
        n = request.num_tokens
        if n > self.count:
            if n > self.array.shape[0]:
                grown = np.empty(2 * n, dtype=np.int64)
                grown[:self.count] = self.array[:self.count]
                self.array = grown
            self.array[self.count:n] = request.token_ids(self.count, n)
            self.count = n
        return self.array[:n]


class NgramProposer:
    """Drafts by prompt lookup (module doc). A proposer's ``propose([(request, k), ...])`` is called once a
    step for the requests to verify, ``k >= 1`` the most drafts each can take; it returns a list of drafts
    for each (at most ``k``)."""

    def __init__(self, lookup_min: int, lookup_max: int):
        self.lookup_min, self.lookup_max = lookup_min, lookup_max
        self._histories: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def propose(self, items) -> list[list[int]]:
        """For each ``(request, k)`` of ``items``: up to ``k`` draft tokens to follow the running request's
        tokens (prompt and outputs)."""
        return [self.propose_one(request, k) for request, k in items]

    def propose_one(self, request, k: int) -> list[int]:
        history = self._histories.get(request)
        if history is None:
            history = self._histories[request] = TokenHistory(request)
        return self.lookup(history.sync(request), k)

    def propose_trees(self, items, width: int) -> list[tuple[list[int], list[int]]]:
        """For each ``(request, k)`` of ``items``: a draft tree ``(tokens, parents)`` of at most ``k`` nodes and
        ``width`` branches (:mod:`~tripath.engine.speculative.trees`)."""
        out = []
        for request, k in items:
            history = self._histories.get(request)
            if history is None:
                history = self._histories[request] = TokenHistory(request)
            out.append(self.lookup_tree(history.sync(request), k, width))
        return out

    def lookup_tree(self, token_ids, k: int, width: int) -> tuple[list[int], list[int]]:
        """A draft tree ``(tokens, parents)`` of at most ``k`` nodes to follow ``token_ids``: the continuations
        of up to ``width`` occurrences of the longest suffix that occurs (module doc); ``width = 1``: the
        chain of :meth:`lookup`."""
        tokens = np.asarray(token_ids, dtype=np.int64)[-LOOKUP_WINDOW:]
        found = self._matches(tokens, k)
        if found is None:
            return [], []
        hits, n = found
        length = tokens.shape[0]
        first = self._pick(hits, n, k, length)
        branches: list[list[int]] = []
        for start in [first] + [int(h) for h in hits[::-1][:TREE_CANDIDATES] if int(h) != first]:
            branch = tokens[start + n:start + n + k].tolist()
            if branch and not any(other[:len(branch)] == branch for other in branches):
                branches.append(branch)
                if len(branches) == width:
                    break
        return merge_branches(branches, k)

    def lookup(self, token_ids, k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``token_ids`` (a sequence of ints or a 1-D int array)."""
        tokens = np.asarray(token_ids, dtype=np.int64)[-LOOKUP_WINDOW:]
        found = self._matches(tokens, k)
        if found is None:
            return []
        hits, n = found
        start = self._pick(hits, n, k, tokens.shape[0]) + n
        return tokens[start:start + k].tolist()

    @staticmethod
    def _pick(hits, n: int, k: int, length: int) -> int:
        """The chain's occurrence: the latest that ``k`` tokens follow, else the earliest."""
        full = hits[hits + n + k <= length]
        return int(full[-1] if full.size else hits[0])

    def _matches(self, tokens: np.ndarray, k: int):
        """``(starts, n)``: the starts (ascending) of the earlier occurrences of the longest suffix ``n`` that
        occurs; None when none does."""
        length = tokens.shape[0]
        if k < 1 or length <= self.lookup_min:
            return None
        # Ends j (<= L - 2: a token follows) of matches of the last token, then how far each match extends back.
        ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
        longest = min(self.lookup_max, length - 1)
        matched = np.ones(ends.shape[0], dtype=np.int64)
        alive = np.ones(ends.shape[0], dtype=bool)
        for back in range(1, longest):
            alive &= (ends >= back) & (tokens[np.maximum(ends - back, 0)] == tokens[length - 1 - back])
            matched += alive
        for n in range(longest, self.lookup_min - 1, -1):
            hits = ends[matched >= n] + 1 - n   # starts i of the n-token matches, ascending
            if hits.size:
                return hits, n
        return None
