"""A proposer whose acceptance is set, for benchmarks that have no trained draft model (random weights).

:class:`OracleProposer` replays a recorded greedy run: for a request whose prompt it knows, the drafts are the
next ``k`` tokens of that run after the outputs so far, each replaced by another token with probability
``1 - p``. Under greedy verification the ``j``-th draft is then kept with probability ``p ** j`` (while the
run's tokens are the recorded ones), so a benchmark sweeps the speed-up against acceptance.
Draft trees (``propose_trees(items, width)``): the recorded continuation (corrupted as above) is one branch
of ``k // width`` tokens; each of its nodes has ``width - 1`` siblings before it, tokens other than the
recorded one, so acceptance stays ``p ** j`` and every accepted node is a later sibling (its cache rows move).
:class:`SteeredProposer` runs another proposer's drafting (its cost) and returns the oracle's drafts instead.
"""

from __future__ import annotations

import random
from typing import Mapping, Sequence


class OracleProposer:
    """``recorded``: prompt token ids (a tuple) -> the greedy output token ids of that prompt; ``p``: the
    chance that a draft is the recorded token; ``vocab_size``: where replacement tokens are drawn from."""

    def __init__(self, recorded: Mapping[tuple[int, ...], Sequence[int]], p: float, vocab_size: int, seed: int = 0):
        if not 0 <= p <= 1:
            raise ValueError(f"p must be in [0, 1], got {p}")
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
        self.recorded = {tuple(prompt): list(tokens) for prompt, tokens in recorded.items()}
        self.p, self.vocab_size = p, vocab_size
        self._random = random.Random(seed)

    def propose(self, items) -> list[list[int]]:
        return [self.propose_one(request, k) for request, k in items]

    def propose_one(self, request, k: int) -> list[int]:
        run = self.recorded.get(tuple(request.prompt_token_ids))
        if run is None:
            return []
        at = request.num_output_tokens
        drafts = []
        for token in run[at:at + k]:
            if self._random.random() >= self.p:
                token = (token + 1 + self._random.randrange(self.vocab_size - 1)) % self.vocab_size
            drafts.append(token)
        return drafts


    def propose_trees(self, items, width: int) -> list[tuple[list[int], list[int]]]:
        return [self.propose_tree(request, k, width) for request, k in items]

    def propose_tree(self, request, k: int, width: int) -> tuple[list[int], list[int]]:
        """The tree of the module doc: ``(tokens, parents)``, at most ``k`` nodes."""
        run = self.recorded.get(tuple(request.prompt_token_ids))
        if run is None:
            return [], []
        width = min(width, self.vocab_size)
        at = request.num_output_tokens
        tokens: list[int] = []
        parents: list[int] = []
        parent = -1
        for recorded in run[at:at + max(1, k // width)]:
            drafted = recorded
            if self._random.random() >= self.p:
                drafted = (recorded + 1 + self._random.randrange(self.vocab_size - 1)) % self.vocab_size
            taken = {recorded, drafted}
            for _ in range(width - 1):
                if len(tokens) + 1 >= k:
                    break
                other = self._random.randrange(self.vocab_size)
                while other in taken:
                    other = (other + 1) % self.vocab_size
                taken.add(other)
                tokens.append(other)
                parents.append(parent)
            tokens.append(drafted)
            parents.append(parent)
            parent = len(tokens) - 1   # the next depth's nodes are children of this recorded-branch node
        return tokens, parents


class SteeredProposer:
    """Drafting by ``drafter`` (which runs, so its time counts: the ``mtp`` method's MTP layer) with the
    drafts of ``oracle`` proposed instead of its own, so the acceptance is the oracle's."""

    def __init__(self, drafter, oracle: OracleProposer):
        self.drafter, self.oracle = drafter, oracle

    def propose(self, items) -> list[list[int]]:
        self.drafter.propose(items)
        return self.oracle.propose(items)

    def propose_trees(self, items, width: int) -> list[tuple[list[int], list[int]]]:
        if hasattr(self.drafter, "propose_trees"):
            self.drafter.propose_trees(items, width)
        else:
            self.drafter.propose(items)
        return self.oracle.propose_trees(items, width)
