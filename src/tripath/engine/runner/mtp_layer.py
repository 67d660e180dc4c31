"""Runs the target's multi-token-prediction layer (speculative decoding's ``mtp`` method) over rows of its own
KV cache, on every tensor-parallel rank.

A run (:class:`MTPRun`) is a list of segments, each the MTP rows ``start .. start + len(tokens) - 1`` of one
request: fed those next tokens, written to the slots of those positions in the request's blocks. With it
come the hidden states the rows read, ``[N, H]`` segment after segment (``N = Σ len(tokens)``). Rank 0's
proposer (:mod:`tripath.engine.drafters.mtp`) decides the runs and :class:`MTPLayerRunner` makes them: the
layer over the rows, and with ``samples`` each segment's last row's ``g`` and greedy token.

Under tensor parallelism rank 0 first hands each run to the workers (``share``): the run as a control message,
then the hidden states the workers lack broadcast over the model's process group. A run says where each piece
of its hidden states comes from (:attr:`MTPRun.pieces`): rows of the launch just made, which every rank holds
alike (its hidden states before the final norm, replicated after the last all-reduce; a worker keeps them,
:class:`LaunchHidden`), or rows kept from earlier steps or made by the layer itself, which rank 0 sends — a
row per drafting request and step, and the rows a verify redoes. Every rank then runs its shard of the layer,
meeting the others in the layer's all-reduces and the LM head's gather; the workers' tokens are not used.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from tripath.attention import ForwardContext, select_backend
from tripath.attention.step_ints import to_device
from tripath.engine.runner.mtp_graphs import MTPGraphs, graphs_fit
from tripath.engine.runner.step_inputs import StepInputBuilder
from tripath.engine.runner.step_request import StepRequest
from tripath.engine.scheduling.scheduler import ScheduledRequest


@dataclass(frozen=True)
class MTPSegment:
    """MTP rows ``start .. start + len(tokens) - 1`` of a request whose KV blocks are ``block_ids``, fed
    ``tokens`` (row ``p`` the token at ``p + 1``)."""

    start: int
    tokens: list[int]
    block_ids: list[int]


@dataclass(frozen=True)
class MTPRun:
    """One run of the MTP layer over ``segments``; ``samples``: each segment's last row's greedy token too;
    ``pieces``: where the hidden states come from, piece after piece, ``(first row, rows)``: rows of the
    launch just made from that row on, or ``-1`` for rows sent with the run (empty: all sent); ``fed_by``: a
    drafting chain's next run, whose segments are one row each fed the token the run before drew for its
    segment ``fed_by[m]`` (on the device: ``tokens`` is a placeholder of one token); ``steps``: a drafting
    run of one-row segments made that many times, each time a position on, fed the draws and ``g`` of the
    time before (a whole draft chain)."""

    segments: list[MTPSegment]
    samples: bool = False
    pieces: list[tuple[int, int]] = field(default_factory=list)
    fed_by: list[int] | None = None
    steps: int = 1

    @property
    def num_rows(self) -> int:
        return sum(len(segment.tokens) for segment in self.segments)

    def sent_pieces(self) -> list[tuple[int, int]]:
        """``(offset in the run's hidden states, rows)`` of each piece rank 0 sends."""
        pieces, out, at = self.pieces or [(-1, self.num_rows)], [], 0
        for row, count in pieces:
            if row < 0:
                out.append((at, count))
            at += count
        return out


class LaunchHidden:
    """A worker's ``hidden_observer`` under the ``mtp`` method: keeps the hidden states before the final norm of
    the launch just made, which rank 0's MTP runs refer to by row."""

    def __init__(self):
        self.prenorm: torch.Tensor | None = None

    def observe(self, scheduled, inputs, prenorm: torch.Tensor) -> None:
        self.prenorm = prenorm


def mtp_cache_bytes(model, config):
    """``block_size -> bytes`` of the MTP layer's cache for one block, for the target's memory plan."""
    def bytes_per_block(block_size: int) -> int:
        spec = model.attention_spec(block_size=block_size, kv_cache_dtype=config.kv_cache_dtype,
                                    kv_layout=config.kv_layout, dtype=config.dtype)
        return select_backend(spec, name=config.backend, device=config.device).cache_bytes_per_block()

    return bytes_per_block


def _draws_fused(runner, rows: int) -> bool:
    """Whether the target draws ``rows`` greedy rows without logits (its start's choice; the MTP layer drafts
    with the same LM head)."""
    choice = getattr(runner, "fused_sampling", None)
    return choice is not None and choice.use(rows, sampled=False)


class MTPLayerRunner:
    """The MTP layer of ``model`` (loaded with ``mtp=True``; a rank's shard under tensor parallelism) on a cache
    of ``runner.num_blocks`` blocks (``runner``: the rank's :class:`~tripath.engine.runner.model_runner.ModelRunner`,
    started). ``share(run, hidden)``: rank 0's hand-over of each run to the workers (None on one rank)."""

    def __init__(self, model, runner, config, share=None):
        self.model, self.backend, self.device = model, runner.backend, runner.device
        self.dtype, self.hidden_size = config.dtype, int(model.config.hidden_size)
        self.cache = runner.backend.allocate_cache(runner.num_blocks, runner.device)
        most = 1 + config.speculative_config.num_speculative_tokens   # rows a request may add to a step
        self.inputs = StepInputBuilder(runner.device, runner.block_size,
                                       config.max_num_batched_tokens + config.max_num_seqs * most,
                                       config.max_num_seqs, runner.max_blocks_per_seq)
        self._calibrate = config.calculate_kv_scales   # fp8: the cache's scale from the first run's rows
        self.share = share
        self.last_tokens: torch.Tensor | None = None   # the last drafting run's draws (segment order)
        self.graphs: MTPGraphs | None = None
        self._graph_sizes = config.cuda_graph_batch_sizes()
        self._max_blocks, self._block_size, self._k = runner.max_blocks_per_seq, runner.block_size, most - 1
        self._fused = functools.partial(_draws_fused, runner)
        if graphs_fit(runner, share):
            self.capture_graphs(runner.decode_graphs.pool)

    def capture_graphs(self, pool=None) -> None:
        """Capture the layer's drafting and observing graphs (:mod:`tripath.engine.runner.mtp_graphs`) in
        ``pool`` (the target's graphs' pool)."""
        self.graphs = MTPGraphs(self.model, self.backend, self.cache, self._graph_sizes, self._max_blocks,
                                self._block_size, self._k, self.device, self.hidden_size, self.dtype, self._fused)
        self.graphs.capture(pool)

    @torch.inference_mode()
    def run(self, run: MTPRun, hidden: torch.Tensor):
        """Run the layer over ``run``'s rows with ``hidden [run.num_rows, H]`` (segment after segment), writing
        their cache rows. With ``run.samples``: ``(g [S, H], greedy tokens [S, run.steps] on the device)`` of
        each segment's last row (the last step's ``g``), in segment order (the last step's tokens are kept
        for the next run's ``fed_by``); else None."""
        if self.share is not None:
            self.share(run, hidden)
        return self._run(run, hidden)

    def _run(self, run: MTPRun, hidden: torch.Tensor):
        segments, fed = run.segments, run.fed_by
        graphs, bs = self.graphs, None
        if graphs is not None and not self._calibrate:
            bs = graphs.draft_size(segments) if run.samples else graphs.rows_size(segments)
        if run.steps > 1 and bs is None:   # the chain run by run, each fed the draws of the one before
            g, tokens = self._run(replace(run, steps=1), hidden)
            drawn = [tokens]
            for step in range(1, run.steps):
                chained = [MTPSegment(seg.start + len(seg.tokens) - 1 + step, [0], seg.block_ids) for seg in segments]
                g, tokens = self._run(MTPRun(chained, True, [], list(range(len(segments)))), g)
                drawn.append(tokens)
            return g, torch.cat(drawn, dim=1)
        pad = bs - len(segments) if bs is not None and run.samples else 0   # drafting graphs take whole batches
        steps = [StepRequest(seg.start + (0 if fed is not None else len(seg.tokens)), seg.block_ids, seg.start,
                             seg.tokens) for seg in segments]   # fed: the token is the last run's draw
        scheduled = [ScheduledRequest(step, len(seg.tokens), seg.start, run.samples)
                     for step, seg in zip(steps, segments)]
        plan = self.backend.plan([len(seg.tokens) for seg in segments] + [1] * pad,
                                 [seg.start for seg in segments] + [1] * pad)
        inflight = None if fed is None else {id(step): source for step, source in zip(steps, fed)}
        inputs = self.inputs.build(plan, scheduled, pad, inflight, ints=self.backend.step_ints(plan))
        if inputs.deferred is not None:
            rows, sources = inputs.deferred
            inputs.input_ids.index_copy_(0, rows, self.last_tokens.index_select(0, sources))
        bounds = [0]
        for seg in segments:
            bounds.append(bounds[-1] + len(seg.tokens))
        order = [i for i in plan.order if i < len(segments)]
        hidden = hidden if order == list(range(len(segments))) else \
            torch.cat([hidden[bounds[i]:bounds[i + 1]] for i in order])
        if bs is not None and not run.samples:
            graphs.replay_rows(bs, inputs, hidden)
            return None
        if bs is not None:
            g, tokens = graphs.replay_draft(bs, inputs, hidden, run.steps)
            owners = order   # row r: segments[order[r]]
        else:
            ctx = ForwardContext(self.backend, inputs.metadata(self.backend), [self.cache],
                                 calibrate_kv_scales=self._calibrate)
            self._calibrate = False
            g = self.model.mtp_forward(inputs.input_ids, inputs.positions, hidden, ctx)
            if not run.samples:
                return None
            g = g.index_select(0, inputs.logit_indices)
            tokens = self.model.mtp_greedy(g)[:, None]
            owners = inputs.sample_rows   # row r: segments[sample_rows[r]]
        rows = [0] * len(segments)   # each segment's row
        for r, i in enumerate(owners):
            rows[i] = r
        index = to_device(rows, torch.int64, self.device)
        tokens = tokens.index_select(0, index)
        self.last_tokens = tokens[:, -1]
        return g.index_select(0, index), tokens

    def run_shared(self, run: MTPRun, launch: LaunchHidden):
        """A worker's side of :meth:`run`: the rows rank 0 sends (broadcast) beside those of ``launch``'s
        hidden states, then the run."""
        sent = run.sent_pieces()
        received = torch.empty(sum(count for _, count in sent), self.hidden_size, dtype=self.dtype,
                               device=self.device)
        if received.shape[0]:
            dist.broadcast(received, src=0)
        parts, at = [], 0
        for row, count in run.pieces or [(-1, run.num_rows)]:
            if row < 0:
                parts.append(received[at:at + count])
                at += count
            else:
                parts.append(launch.prenorm[row:row + count])
        return self.run(run, torch.cat(parts))


def share_over(control):
    """Rank 0's ``share`` for :class:`MTPLayerRunner` under tensor parallelism: ``run`` over the ``control``
    group (the workers' loop takes it as a message), then the rows of ``hidden`` the workers lack over the
    default group."""
    def share(run: MTPRun, hidden: torch.Tensor) -> None:
        dist.broadcast_object_list([run], src=0, group=control)
        sent = run.sent_pieces()
        if sent:
            dist.broadcast(torch.cat([hidden[at:at + count] for at, count in sent]).contiguous(), src=0)

    return share
