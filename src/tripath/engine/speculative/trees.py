"""Draft trees (speculative decoding with ``tree_width > 1``): a request's drafts as the nodes of a tree.

A tree of ``n`` drafted tokens is ``(tokens [n], parents [n])``: node ``t`` drafts ``tokens[t]`` to follow its
parent, node ``parents[t] < t`` (parents come first: a topological order), or the request's pending token
(the root) when ``parents[t] == -1``. Siblings draft distinct tokens. A verify feeds the root and the nodes
in that order: row 0 is the pending token, row ``1 + t`` node ``t``, at position ``context_len + depth``
(the root's depth 0, a child of the root's 1), written to the cache at the slot of position
``context_len + row``. Row ``r`` attends to the context and to the rows of its ancestors and itself (bit
``r'`` of its mask: :func:`tree_mask_bits`), so its logits are the target's after its own path. A chain is
the tree whose parents are ``-1, 0, 1, ...`` (:func:`chain_parents`).

After acceptance, the accepted path's nodes ``t_1 .. t_a`` (depth ``1 .. a``) hold their K/V at rows
``1 + t_i``; the runner moves each to row ``i``, the slot of its position (:func:`path_moves`), so the
request's cache is a sequence again; the rows past the path are rolled back as a chain's rejected drafts.
"""

from __future__ import annotations

from typing import Sequence


def chain_parents(n: int) -> list[int]:
    """The parents of a chain of ``n`` drafts."""
    return list(range(-1, n - 1))


def merge_branches(branches: Sequence[Sequence[int]], budget: int) -> tuple[list[int], list[int]]:
    """The tree of ``branches`` (token sequences that each follow the root) merged by common prefix, with at
    most ``budget`` nodes: ``(tokens, parents)`` in breadth-first order (depth, then the order of the
    branches), so a smaller budget keeps the shallow nodes of every branch. A branch that shares a prefix
    with an earlier one reuses its nodes; a branch whose next node does not fit ends there."""
    children: dict[tuple[int, int], int] = {}   # (parent node, token) -> node
    tokens: list[int] = []
    parents: list[int] = []
    at = [-1] * len(branches)   # each branch's node at the current depth
    depth = 0
    while len(tokens) < budget:
        grew = False
        for b, branch in enumerate(branches):
            if at[b] is None or depth >= len(branch):
                at[b] = None
                continue
            key = (at[b], int(branch[depth]))
            node = children.get(key)
            if node is None:
                if len(tokens) >= budget:
                    at[b] = None
                    continue
                node = children[key] = len(tokens)
                tokens.append(key[1])
                parents.append(key[0])
            at[b] = node
            grew = True
        if not grew:
            break
        depth += 1
    return tokens, parents


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth (a child of the root: 1)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def tree_mask_bits(parents: Sequence[int]) -> list[int]:
    """The verify rows' masks (root first): bit ``r'`` of row ``r``'s entry is set when row ``r'`` is ``r`` or
    an ancestor of it; the root (row 0) is every row's ancestor."""
    bits = [1]
    for t, p in enumerate(parents):
        bits.append(bits[p + 1] | (1 << (t + 1)))
    return bits


def is_chain(parents: Sequence[int]) -> bool:
    return all(p == t - 1 for t, p in enumerate(parents))


def path_moves(path: Sequence[int]) -> list[tuple[int, int]]:
    """``(from row, to row)`` of the accepted path's nodes ``path`` (node indices, by depth from 1) whose K/V
    is not at its position's row yet."""
    return [(1 + t, i) for i, t in enumerate(path, start=1) if 1 + t != i]
