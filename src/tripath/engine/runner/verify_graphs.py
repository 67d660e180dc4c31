"""CUDA graphs of speculative decoding's verify steps: the whole model's forward captured once per padded
batch size, every request padded to ``q = 1 + k`` query tokens (``k``: the drafted tokens).

A step whose requests are all decodes or verifies (no prompt tokens) of ``n`` requests replays the graph of
the smallest captured size ``b >= n``. The step's inputs (built as for an eager step, rows in plan order)
are laid out in the graph's rows: request ``p`` of the plan takes rows ``p·q .. p·q + q − 1``, its ``1 + d``
tokens first; the rest of its rows (a verify with fewer drafts than ``k``, or a decode without any) are
padding tokens, and requests ``n .. b − 1`` are padding requests as in the decode graphs (context 1, block
0). Padding tokens write nothing (slot −1) and their outputs are dropped; a real token sees only the keys
up to its own position (causal), which were written before. Each padded request is a verify of ``q`` tokens
over its context, so the captured plan (every request a verify of ``q`` tokens) is the step's own, and
:meth:`AttentionMetadata.copy_` of the padded step's metadata is all a replay needs: the backend's verify
route reads only device tensors there (:attr:`Capabilities.verify_graphs`).

The padded tokens sit at the positions after the request's last one (``context + 1 + k`` rows, entries past
the request's blocks 0: block 0 is reserved; a step with a request whose ``context + 1 + k`` passes the block
table's width, ``max_model_len`` rounded up to whole blocks, runs eagerly), and the kernels may load those
cache rows, never letting them count: a real token's score of a later key is −inf (the rows hold values
written earlier, or the cache's zeros). Their rotary position is 1 (only their dropped outputs depend on it), so no row
outgrows the model's rotary table. After the replay the real tokens' hidden states (and those before the
final norm, for the ``mtp`` proposer) are gathered back into the eager step's row order, and the logits,
acceptance and sampling run outside the graph as for the decode graphs.

When the engine drafts trees (``tree_width > 1``) the graphs are captured with draft-tree masks
(``metadata.decode.verify.tree_mask``, one int32 a row: :func:`~tripath.engine.speculative.trees.tree_mask_bits`)
and every replay carries one: a chain's rows (and padding rows) the causal chain's masks, a tree's rows its
own, so tree steps replay the graphs too; the backend's verify route then runs its tree variant always.
"""

from __future__ import annotations

import torch

from tripath import _env
from tripath.attention import ForwardContext
from tripath.attention.step_ints import to_device
from tripath.engine.runner.decode_graphs import DecodeGraphs
from tripath.engine.runner.step_inputs import StepInputs
from tripath.engine.scheduling.block_manager import blocks_needed
from tripath.engine.speculative.trees import chain_parents, tree_mask_bits


class VerifyGraphs:
    """The verify graphs of one engine: a :class:`DecodeGraphs` of ``query_len`` tokens a request
    (``query_len = 1 + k = decode_threshold``) and the padding of a step's inputs into its rows."""

    def __init__(self, model, backend, caches: list, sizes: list[int], max_blocks_per_seq: int,
                 block_size: int, query_len: int, device: torch.device, trees: bool = False):
        self.block_size, self.query_len = block_size, query_len
        self.max_blocks = max_blocks_per_seq
        self.trees = trees   # captured with draft-tree masks: tree steps replay too
        self.chain_masks = to_device(tree_mask_bits(chain_parents(query_len - 1)) * max(sizes), torch.int32,
                                     device) if trees else None   # every row of every size, as chains
        self.graphs = DecodeGraphs(model, backend, caches, sizes, self.max_blocks, device, query_len=query_len,
                                   prepare_metadata=self._chain_masks_into if trees else None)
        self.backend, self.device = backend, device
        self.slots = torch.full((max(sizes) * query_len,), -1, dtype=torch.int64, device=device)
        self.prenorm = self.graphs.prenorm

    def _chain_masks_into(self, meta, bs: int) -> None:
        """Give a size's captured metadata draft-tree masks (every request a chain), so it captures the
        verify route's tree variant."""
        meta.decode.verify.tree_mask = self.chain_masks[:bs * self.query_len].clone()

    @property
    def pool(self):
        return self.graphs.pool

    def capture(self, pool=None) -> None:
        self.graphs.capture(pool)

    def batch_size(self, num_requests: int) -> int | None:
        return self.graphs.batch_size(num_requests)

    def takes(self, scheduled) -> bool:
        """Whether the step is decodes and verifies alone, none past ``query_len`` tokens, each with its
        padded tokens inside the block table's width (near ``max_model_len`` a step runs eagerly)."""
        span = self.max_blocks * self.block_size - self.query_len
        return all(0 < s.num_computed_tokens <= span and s.num_new_tokens == 1 + len(s.draft_token_ids)
                   and s.num_new_tokens <= self.query_len for s in scheduled)

    def replay(self, bs: int, inputs: StepInputs, row_inputs=()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay size ``bs`` on the step ``inputs`` (unpadded, plan order): ``(hidden [T, H], hidden before
        the final norm [T, H] or None)`` of the step's own tokens, in its rows. ``row_inputs``: ``(static
        [rows, ...], values [T, ...])`` pairs of further inputs the captured forward reads by row (the MTP
        layer's hidden states): each token's values go to its row, as its id does."""
        plan, q = inputs.plan, self.query_len
        n = plan.num_requests
        rows = [p * q + t for p, ql in enumerate(plan.query_lens) for t in range(ql)]
        index = to_device(rows, torch.int64, self.device)
        graphs = self.graphs
        ids, positions, slots = graphs.input_ids[:bs * q], graphs.positions[:bs * q], self.slots[:bs * q]
        ids.index_copy_(0, index, inputs.input_ids)
        positions.fill_(1)
        positions.index_copy_(0, index, inputs.positions)
        slots.fill_(-1)
        slots.index_copy_(0, index, inputs.slot_mapping)
        for static, values in row_inputs:
            static.index_copy_(0, index, values)
        width = min(self.max_blocks, max(inputs.block_table.shape[1],
                                         blocks_needed(max(plan.context_lens) + q, self.block_size)))
        table = torch.zeros(bs, width, dtype=torch.int32, device=self.device)
        table[:n, :inputs.block_table.shape[1]] = inputs.block_table
        padded = self.backend.plan([q] * bs, list(plan.context_lens) + [1] * (bs - n))
        graph, meta, hidden = graphs.graphs[bs]
        step = self.backend.build_metadata(padded, table, slots)
        if self.trees:   # chains' masks, a tree's own rows replaced by its mask
            mask = self.chain_masks[:bs * q].clone()
            if inputs.tree_mask is not None:
                tree_rows = [p * q + t for p, ql in enumerate(plan.query_lens) if ql > 1 for t in range(ql)]
                mask.index_copy_(0, to_device(tree_rows, torch.int64, self.device), inputs.tree_mask)
            step.decode.verify.tree_mask = mask
        if _env.validate():   # the padded step against the caches (ForwardContext checks on construction)
            ForwardContext(self.backend, step, graphs.caches)
        meta.copy_(step)
        graph.replay()
        prenorm = graphs.prenorm[bs]
        return hidden.index_select(0, index), None if prenorm is None else prenorm.index_select(0, index)
