"""Which drafts a verify step keeps, and the token after them, decided on the device.

A verify of request ``b`` feeds its pending token and drafts ``d_1 .. d_k``; its ``k + 1`` logit rows
``z_0 .. z_k`` are the target model's next-token logits after each of them. Row ``j < k`` decides draft
``d_{j+1}``, row ``k`` gives the token after the last draft. With ``p_j`` the request's sampling distribution
of row ``j`` (temperature, min-p, top-k, top-p: :func:`tripath.engine.sampling.sampler.filtered_probs`):

- greedy: draft ``d_{j+1}`` is kept when ``argmax z_j == d_{j+1}``; the outcome of row ``j`` is ``argmax z_j``;
- sampled (the drafts are proposed deterministically, a point mass ``q = δ_d``): the draft is kept with
  probability ``min(1, p_j(d) / q(d)) = p_j(d)`` (a uniform draw ``u < p_j(d)``); a row that rejects its draft
  draws its outcome from the residual ``max(0, p_j - q) ∝ p_j`` without ``d``; the last row draws from
  ``p_k``. So each token's law is the target's ``p_j`` (the rejection sampling of Leviathan et al. 2023 and
  Chen et al. 2023).

Draft trees (:func:`accept_tree`, :mod:`tripath.engine.speculative.trees`): row 0 is the pending token's, row
``1 + t`` node ``t``'s; a node's row predicts its children. Greedy: from the root, follow the child whose
token is the row's argmax, as far as one matches; the outcome is the argmax of the last node reached.
Sampled: at each node reached, its children are tried in order with the residual ``r`` (first ``p`` of the
node's row): child ``c`` drafting ``x`` is kept with probability ``r(x)`` (its ``q`` is a point mass),
else ``r(x)`` is set to 0 and ``r`` renormalised; a kept child is the next node; when every child is
rejected, the outcome is drawn from ``r``, and at a leaf from its row's ``p`` (the recursive rejection
sampling of SpecInfer, Miao et al. 2024): each token's law is the target's. The walk runs on the host (the
rows' argmax, or the sampled requests' ``p``, are read back once per step).

The step yields the kept drafts up to the first rejected one, then that row's outcome (or, all kept, the
last row's): ``1 .. k + 1`` tokens. Draws use the request's own generator (uniforms, then an exponential
race as in :mod:`tripath.engine.sampling.sampler`), so a request's tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from typing import Sequence

import torch

from tripath.attention.step_ints import to_device
from tripath.engine.requests.sampling_params import SamplingParams
from tripath.engine.sampling.sampler import filtered_probs

TINY = torch.finfo(torch.float32).tiny


def accept_drafts(logits: torch.Tensor, drafts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """``[B, K + 1]`` int64 (``K`` the most drafts of any verify): each verify's kept drafts and the token
    after them, then -1. ``logits [R, V]``: the verifies' rows, request after request (``len(drafts[b]) + 1``
    each, ``R`` in all); ``params[b]`` / ``generators[b]``: request ``b``'s sampling (no logit transforms)."""
    counts = [len(d) + 1 for d in drafts]
    if logits.dim() != 2 or logits.shape[0] != sum(counts):
        raise ValueError(f"logits must be [{sum(counts)}, vocab] (one row per verified token), got "
                         f"{tuple(logits.shape)}")
    device, num, width = logits.device, len(drafts), max(counts)
    drafted = to_device([t for d in drafts for t in (*d, -1)], torch.int64, device)   # row j decides draft j+1
    outcome = logits.argmax(dim=-1)
    kept = outcome == drafted
    sampled = [b for b, p in enumerate(params) if not p.greedy]
    if sampled:
        starts = [0]
        for c in counts[:-1]:
            starts.append(starts[-1] + c)
        rows = to_device([r for b in sampled for r in range(starts[b], starts[b] + counts[b])], torch.int64, device)
        outcome[rows], kept[rows] = _sample_rows(logits.index_select(0, rows), drafted.index_select(0, rows),
                                                 [counts[b] for b in sampled], [params[b] for b in sampled],
                                                 [generators[b] for b in sampled])
    # each row's column and request (pinned copies: nothing here waits for the device)
    column = to_device([c for count in counts for c in range(count)], torch.int64, device)
    request = to_device([b for b, count in enumerate(counts) for _ in range(count)], torch.int64, device)
    grid = torch.full((num, width), -1, dtype=torch.int64, device=device)
    grid[request, column] = outcome
    kept_grid = torch.zeros(num, width, dtype=torch.int32, device=device)
    kept_grid[request, column] = kept.int()
    num_kept = kept_grid.cumprod(dim=1).sum(dim=1)
    return grid.masked_fill(torch.arange(width, device=device)[None, :] > num_kept[:, None], -1)


def _sample_rows(logits: torch.Tensor, drafted: torch.Tensor, counts: list[int], params: list[SamplingParams],
                 generators: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of the sampled requests' rows (module doc): ``(outcome [R'], kept [R'])``."""
    device = logits.device
    per_row = [(p, c) for p, c in zip(params, counts)]
    temperature = to_device([p.temperature for p, c in per_row for _ in range(c)], torch.float32, device)
    top_k = to_device([p.top_k for p, c in per_row for _ in range(c)], torch.int64, device)
    top_p = to_device([p.top_p for p, c in per_row for _ in range(c)], torch.float32, device)
    min_p = None
    if any(p.min_p > 0 for p in params):
        min_p = to_device([p.min_p for p, c in per_row for _ in range(c)], torch.float32, device)
    probs = filtered_probs(logits, temperature, top_k, top_p, min_p)
    has_draft = drafted >= 0
    index = drafted.clamp(min=0)[:, None]
    p_draft = probs.gather(1, index).squeeze(1)
    uniform = torch.empty(probs.shape[0], dtype=torch.float32, device=device)
    noise = torch.empty_like(probs)
    at = 0
    for count, generator in zip(counts, generators):
        uniform[at:at + count].uniform_(generator=generator)
        noise[at:at + count].exponential_(generator=generator)
        at += count
    kept = has_draft & (uniform < p_draft)
    residual = torch.where(has_draft[:, None], probs.scatter(1, index, 0.0), probs)
    residual = residual / residual.sum(dim=-1, keepdim=True).clamp(min=TINY)
    drawn = (residual / noise.clamp(min=TINY)).argmax(dim=-1)
    return torch.where(kept, drafted, drawn), kept


def accept_tree(logits: torch.Tensor, drafts: Sequence[Sequence[int]], parents: Sequence[Sequence[int]],
                params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
                ) -> tuple[torch.Tensor, list[list[int]]]:
    """Draft trees' acceptance (module doc): ``([B, K + 1]`` int64 on the logits' device — each verify's
    accepted path's tokens and the token after them, then -1 — ``, paths)``, ``paths[b]`` the accepted nodes
    of verify ``b`` by depth. ``logits [R, V]``: each verify's rows (root, then its nodes), request after
    request; ``parents[b]``: the nodes' parents (-1: the root)."""
    counts = [len(d) + 1 for d in drafts]
    if logits.dim() != 2 or logits.shape[0] != sum(counts):
        raise ValueError(f"logits must be [{sum(counts)}, vocab] (one row per verified token), got "
                         f"{tuple(logits.shape)}")
    starts = [0]
    for c in counts[:-1]:
        starts.append(starts[-1] + c)
    argmax = logits.argmax(dim=-1).tolist()
    sampled = [b for b, p in enumerate(params) if not p.greedy]
    probs = {}
    if sampled:
        rows = [r for b in sampled for r in range(starts[b], starts[b] + counts[b])]
        per_row = [params[b] for b in sampled for _ in range(counts[b])]
        device = logits.device
        temperature = to_device([p.temperature for p in per_row], torch.float32, device)
        top_k = to_device([p.top_k for p in per_row], torch.int64, device)
        top_p = to_device([p.top_p for p in per_row], torch.float32, device)
        min_p = to_device([p.min_p for p in per_row], torch.float32, device) if any(p.min_p > 0 for p in per_row) \
            else None
        filtered = filtered_probs(logits.index_select(0, to_device(rows, torch.int64, device)), temperature, top_k,
                                  top_p, min_p).double().cpu()
        probs = dict(zip(rows, filtered))
    paths, outs = [], []
    for b, (tokens, up) in enumerate(zip(drafts, parents)):
        children: dict[int, list[int]] = {}
        for t, p in enumerate(up):
            children.setdefault(p, []).append(t)
        row_of = lambda node: starts[b] + 1 + node   # noqa: E731  (node -1: the root's row)
        path, node = [], -1
        if params[b].greedy:
            while True:
                want = argmax[row_of(node)]
                nxt = next((c for c in children.get(node, ()) if tokens[c] == want), None)
                if nxt is None:
                    out = want
                    break
                path.append(nxt)
                node = nxt
        else:
            out, path = _sample_path(tokens, children, lambda node: probs[row_of(node)], generators[b])
        paths.append(path)
        outs.append([tokens[c] for c in path] + [out])
    width = max(counts)
    grid = [row + [-1] * (width - len(row)) for row in outs]
    return to_device([t for row in grid for t in row], torch.int64, logits.device).view(len(drafts), width), paths


def _sample_path(tokens, children: dict, row_probs, generator) -> tuple[int, list[int]]:
    """One sampled verify's walk down its tree (module doc): ``(the outcome token, the accepted nodes)``."""
    def uniform() -> float:
        device = generator.device if generator is not None else "cpu"
        return float(torch.rand(1, generator=generator, device=device))

    path, node = [], -1
    while True:
        residual = row_probs(node).clone()
        kept = None
        for c in children.get(node, ()):
            total = float(residual.sum())
            x = tokens[c]
            if total > 0 and uniform() < float(residual[x]) / total:
                kept = c
                break
            residual[x] = 0.0
        if kept is None:
            if float(residual.sum()) <= 0:   # every token of p drafted and rejected: only by rounding
                residual = row_probs(node).clone()
            cdf = torch.cumsum(residual / residual.sum(), 0)
            out = int(torch.searchsorted(cdf, torch.tensor([uniform()], dtype=cdf.dtype)).clamp(max=cdf.shape[0] - 1))
            while float(residual[out]) <= 0:   # a zero-width step of the CDF (rounding): the next token with mass
                out = (out + 1) % residual.shape[0]
            return out, path
        path.append(kept)
        node = kept
