"""CUDA graphs of the multi-token-prediction layer's runs (speculative decoding's ``mtp`` method,
:mod:`tripath.engine.runner.mtp_layer`), so that the layer's launches are one replay each, as the target's
decode and verify steps are.

Two kinds of run take nearly all of the layer's time once requests decode, and each gets graphs per padded
batch size (``config.cuda_graph_batch_sizes()``), in the target's graph memory pool:

- **drafting** (:attr:`MTPGraphs.draft`): one row per request (a decode of the MTP layer's own cache), with
  the greedy token of every row drawn inside the graph — the layer, its ``shared_head.norm``, the target's
  LM head and the argmax (or the draw without logits, where the target's fused sampling is chosen for that
  many rows). A :class:`~tripath.engine.runner.decode_graphs.DecodeGraphs` of query length 1, replayed once
  per draft of a chain;
- **observing a verify** (:attr:`MTPGraphs.rows`): up to ``k`` rows per request (a verify's tokens with its
  drafts as their next tokens), no draws. A :class:`~tripath.engine.runner.verify_graphs.VerifyGraphs` of
  query length ``k``, whose padding rows write nothing.

The rows' hidden states are an input like their token ids: a static ``[rows, H]`` buffer the graphs read,
filled before each replay (padding rows keep whatever they held; their outputs are dropped). A run with
rows of another shape (a prompt's, a redone row before a draft), with the fp8 cache scales still to
calibrate, or past the largest captured batch runs eagerly. Graphs need one rank (the workers of a
tensor-parallel engine meet rank 0 in collectives the graphs would have to capture alike) and a backend whose
decode and verify forwards read only device tensors.
"""

from __future__ import annotations

import torch

from tripath.engine.runner.decode_graphs import DecodeGraphs
from tripath.engine.runner.verify_graphs import VerifyGraphs


class MTPStep:
    """The MTP layer over a graph's rows, as the graphs call a model: ``(input_ids [T], positions [T], ctx)``
    with the rows' hidden states ``hidden[:T]`` -> ``g [T, H]``; with ``draws``, ``(g, greedy tokens [T])``,
    drawn without logits where ``fused(T)`` says so (the target's start-time choice for that many rows,
    :mod:`tripath.engine.sampling.fused_sampling`: the same LM head)."""

    def __init__(self, model, hidden: torch.Tensor, draws: bool, fused=None):
        self.model, self.hidden, self.draws = model, hidden, draws
        self.fused = fused or (lambda rows: False)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx):
        rows = input_ids.shape[0]
        g = self.model.mtp_forward(input_ids, positions, self.hidden[:rows], ctx)
        if not self.draws:
            return g
        return g, self.model.mtp_greedy(g, fused=self.fused(rows))


def graphs_fit(runner, share) -> bool:
    """Whether the MTP layer of ``runner``'s model may run from graphs: one rank, the target's decode graphs
    captured, and a backend whose verify forward is graph-safe too."""
    parallel = getattr(runner.model, "parallel", None)
    return (share is None and (parallel is None or parallel.world_size == 1)
            and getattr(runner, "decode_graphs", None) is not None and runner.backend.capabilities.verify_graphs)


class MTPGraphs:
    """The drafting and observing graphs of one MTP layer (module doc). ``model``: the target with its
    ``mtp``; ``cache``: the layer's KV cache; ``k``: the drafted tokens a verify carries (the rows an observed
    verify adds per request); ``fused(rows)``: whether a drafting graph of that many rows draws without logits."""

    def __init__(self, model, backend, cache, sizes: list[int], max_blocks_per_seq: int, block_size: int, k: int,
                 device: torch.device, hidden_size: int, dtype: torch.dtype, fused=None):
        self.k, self.block_size = k, block_size
        self.hidden = torch.zeros(max(sizes) * k, hidden_size, dtype=dtype, device=device)
        self.draft = DecodeGraphs(MTPStep(model, self.hidden, True, fused), backend, [cache], sizes, max_blocks_per_seq,
                                  device)
        self.rows = VerifyGraphs(MTPStep(model, self.hidden, False), backend, [cache], sizes, max_blocks_per_seq,
                                 block_size, k, device)

    def capture(self, pool=None) -> None:
        """Capture both kinds (in ``pool``: the target's graphs', replayed one at a time with these)."""
        self.rows.capture(pool)
        self.draft.capture(self.rows.pool)

    def draft_size(self, segments) -> int | None:
        """The draft graph size a run of ``segments`` replays: one row each, none at position 0."""
        if all(len(seg.tokens) == 1 and seg.start > 0 for seg in segments):
            return self.draft.batch_size(len(segments))
        return None

    def rows_size(self, segments) -> int | None:
        """The observing graph size a run of ``segments`` replays: 1 .. k rows each, inside the block table
        with the padding rows after them."""
        span = self.rows.max_blocks * self.rows.block_size - self.k
        if all(1 <= len(seg.tokens) <= self.k and 0 < seg.start <= span for seg in segments):
            return self.rows.batch_size(len(segments))
        return None

    def replay_draft(self, bs: int, inputs, hidden: torch.Tensor, steps: int = 1
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay drafting size ``bs`` on ``inputs`` (padded to ``bs`` rows, plan order) with ``hidden [n, H]``
        (plan order), ``steps`` times: each replay after the first is fed the draws and ``g`` of the one
        before, its metadata moved on a position on the device
        (:meth:`~tripath.attention.metadata.AttentionMetadata.advance_decodes_`). ``(g [bs, H] of the last
        replay, tokens [bs, steps])`` in the graph's rows."""
        graph, meta, (g, tokens) = self.draft.load(bs, inputs)
        n = hidden.shape[0]
        self.hidden[:n].copy_(hidden)
        drawn = torch.empty(bs, steps, dtype=torch.int64, device=self.hidden.device)
        for step in range(steps):
            if step:
                self.draft.input_ids[:n].copy_(tokens[:n])
                self.hidden[:n].copy_(g[:n])
                meta.advance_decodes_(self.draft.positions[:n], self.block_size)
            graph.replay()
            drawn[:, step] = tokens
        return g, drawn

    def replay_rows(self, bs: int, inputs, hidden: torch.Tensor) -> torch.Tensor:
        """Replay observing size ``bs`` on ``inputs`` (unpadded, plan order) with ``hidden [T, H]`` (plan
        order): ``g [T, H]`` of the run's rows."""
        g, _ = self.rows.replay(bs, inputs, row_inputs=((self.hidden, hidden),))
        return g
