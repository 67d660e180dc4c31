"""Batch planning, on the host, once per step: classify, reorder ``[decode | verify | extend | prefill]``, chunk.

A request with ``context_len == 0`` is a **prefill**; otherwise it is a **decode** when ``query_len <=
decode_threshold`` and an **extend** when ``query_len > decode_threshold``. Decodes of several tokens
(``decode_threshold > 1``: speculative decoding's **verifies**, a pending token and its drafts) follow the
one-token decodes inside the decode slice, so a backend sends each group to its own kernel (``num_verifies``:
the slice's last rows). The order is stable inside each class. Extends whose cached context is attended in
chunks share a token budget: ``chunk_size = budget // num_extends`` (rounded down to whole blocks when it is
at least one block), and chunk ``c`` covers context tokens ``[c · chunk_size, (c + 1) · chunk_size)`` of every
extend, so each chunk's gathered workspace holds at most ``budget`` tokens.

Example: query lens ``[1, 7, 1, 3]``, context lens ``[9, 0, 4, 5]`` (threshold 1) → kinds decode, prefill,
decode, extend → order ``[0, 2, 3, 1]``.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Sequence

import torch

DECODE, EXTEND, PREFILL = "decode", "extend", "prefill"


def classify(query_len: int, context_len: int, decode_threshold: int = 1) -> str:
    """``"decode"``, ``"extend"`` or ``"prefill"`` for one request."""
    if context_len == 0:
        return PREFILL
    return DECODE if query_len <= decode_threshold else EXTEND


@dataclass(frozen=True)
class ExtendChunkPlan:
    """Chunks of the extends' cached context: ``starts[c][i]`` and ``lens[c][i]`` for chunk ``c`` and extend
    ``i`` (in plan order); ``workspace_tokens`` is the largest chunk total (the gather workspace size)."""

    chunk_size: int
    starts: list[list[int]]
    lens: list[list[int]]

    @property
    def num_chunks(self) -> int:
        return len(self.starts)

    @property
    def workspace_tokens(self) -> int:
        return max((sum(lens) for lens in self.lens), default=0)

    def cu_lens(self, chunk: int) -> list[int]:
        return list(itertools.accumulate(self.lens[chunk], initial=0))


def plan_extend_chunks(context_lens: Sequence[int], budget: int, block_size: int = 16) -> ExtendChunkPlan:
    """Split the extends' cached contexts into chunks that share ``budget`` tokens (see module doc)."""
    if not context_lens:
        return ExtendChunkPlan(0, [], [])
    if budget < 1:
        raise ValueError(f"chunk budget must be positive, got {budget}")
    chunk_size = max(1, budget // len(context_lens))
    if chunk_size >= block_size:
        chunk_size -= chunk_size % block_size
    num_chunks = -(-max(context_lens) // chunk_size)
    starts = [[c * chunk_size] * len(context_lens) for c in range(num_chunks)]
    lens = [[max(0, min(chunk_size, ctx - c * chunk_size)) for ctx in context_lens] for c in range(num_chunks)]
    return ExtendChunkPlan(chunk_size, starts, lens)


@dataclass(frozen=True)
class BatchPlan:
    """One step, reordered. Every per-request list is in plan order; ``order[j]`` is the caller's index of
    the request now at position ``j`` (the decode slice's one-token decodes first, its ``num_verifies``
    verifies after them). Token offsets of each class are ``decode_tokens``, ``extend_tokens``,
    ``prefill_tokens`` as ``(start, end)`` pairs in the flat token dimension."""

    order: list[int]
    query_lens: list[int]
    context_lens: list[int]
    num_decodes: int
    num_extends: int
    num_prefills: int
    decode_threshold: int
    extend_chunks: ExtendChunkPlan = field(repr=False)
    num_verifies: int = 0   # the decode slice's last rows, of several tokens each (``num_decodes`` counts them)

    @property
    def num_requests(self) -> int:
        return len(self.order)

    @functools.cached_property
    def seq_lens(self) -> list[int]:
        return [q + c for q, c in zip(self.query_lens, self.context_lens)]

    @functools.cached_property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def _token_range(self, first: int, count: int) -> tuple[int, int]:
        start = sum(self.query_lens[:first])
        return start, start + sum(self.query_lens[first:first + count])

    @property
    def decode_tokens(self) -> tuple[int, int]:
        return self._token_range(0, self.num_decodes)

    @property
    def extend_tokens(self) -> tuple[int, int]:
        return self._token_range(self.num_decodes, self.num_extends)

    @property
    def prefill_tokens(self) -> tuple[int, int]:
        return self._token_range(self.num_decodes + self.num_extends, self.num_prefills)

    @property
    def is_decode_only(self) -> bool:
        return self.num_decodes == self.num_requests

    def token_order(self) -> torch.Tensor:
        """Index ``idx [T]`` with ``planned_tokens = original_tokens[idx]`` (original: requests concatenated
        in the caller's order)."""
        original_query_lens = [0] * self.num_requests
        for j, i in enumerate(self.order):
            original_query_lens[i] = self.query_lens[j]
        starts = [0]
        for n in original_query_lens:
            starts.append(starts[-1] + n)
        idx = [t for i in self.order for t in range(starts[i], starts[i] + original_query_lens[i])]
        return torch.tensor(idx, dtype=torch.long)

    def apply(self, items: Sequence) -> list:
        """A per-request list in plan order."""
        return [items[i] for i in self.order]


def plan_batch(query_lens: Sequence[int], context_lens: Sequence[int], *, decode_threshold: int = 1,
               chunk_budget: int = 32768, block_size: int = 16) -> BatchPlan:
    """Classify and reorder a step's requests; plan the extends' context chunks.

    Parameters: ``query_lens[i]`` new tokens and ``context_lens[i]`` cached tokens of request ``i`` (host
    ints). Raises ``ValueError`` for mismatched lengths, ``query_len < 1`` or ``context_len < 0``.
    """
    query_lens, context_lens = list(map(int, query_lens)), list(map(int, context_lens))
    if len(query_lens) != len(context_lens):
        raise ValueError(f"query_lens ({len(query_lens)}) and context_lens ({len(context_lens)}) must have "
                         "one entry per request")
    if decode_threshold < 1:
        raise ValueError(f"decode_threshold must be >= 1, got {decode_threshold}")
    if query_lens and min(query_lens) < 1:
        i = next(i for i, q in enumerate(query_lens) if q < 1)
        raise ValueError(f"query_lens[{i}] = {query_lens[i]}: every request needs at least one new token")
    if context_lens and min(context_lens) < 0:
        i = next(i for i, c in enumerate(context_lens) if c < 0)
        raise ValueError(f"context_lens[{i}] = {context_lens[i]} must be >= 0")
    if max(query_lens, default=1) == 1 and min(context_lens, default=1) > 0:   # one-token decodes only
        order, ones, verifies, extends, prefills = list(range(len(query_lens))), query_lens, [], [], []
    else:   # one pass: decodes of one token, verifies, extends, prefills
        ones, verifies, extends, prefills = [], [], [], []
        groups = {PREFILL: prefills, EXTEND: extends}
        for i, (q, c) in enumerate(zip(query_lens, context_lens)):
            kind = classify(q, c, decode_threshold)
            (groups[kind] if kind != DECODE else ones if q == 1 else verifies).append(i)
        order = ones + verifies + extends + prefills
        query_lens = [query_lens[i] for i in order]
        context_lens = [context_lens[i] for i in order]
    n_dec, n_ext = len(ones) + len(verifies), len(extends)
    chunks = plan_extend_chunks(context_lens[n_dec:n_dec + n_ext], chunk_budget, block_size)
    return BatchPlan(order=order, query_lens=query_lens, context_lens=context_lens,
                     num_decodes=n_dec, num_extends=n_ext, num_prefills=len(prefills),
                     decode_threshold=decode_threshold, extend_chunks=chunks, num_verifies=len(verifies))
