"""Drafts from the target's own multi-token-prediction layer (the ``mtp`` method; DeepSeek-V3's MTP module,
:mod:`tripath.models.deepseek_mtp`): MTP row ``p`` reads the target's hidden state ``h_p`` (before its final
norm) and the token ``t_{p+1}``, attends the MTP rows ``0 .. p`` and gives logits for ``t_{p+2}``.

The MTP layer's KV cache (one MLA layer of the target's block count) is indexed by the requests' own block
tables, as the draft model's is (:mod:`tripath.engine.drafters.draft_model`): row ``p`` sits in the slot of
position ``p``. On a GPU the memory plan counts its bytes in every block
(:func:`tripath.engine.runner.mtp_layer.mtp_cache_bytes`). Rows are
computed where their inputs are known:

- **observe** (the runner hands over every launch's hidden states before the final norm, after queuing the
  step's sampling): for each scheduled request, the rows of the step's positions whose next token is known
  then — a prompt chunk's (its last row only when the prompt goes on), a verify's with its drafts as the
  next tokens (right exactly for the drafts the step accepts) — plus any earlier row still to redo. The
  hidden states of the rows drafting may start from are kept: a step's last row (its next token is being
  sampled, or it is the prompt's last but one, whose last token the scheduler may verify with drafts), all
  of a verify's rows (which one is last depends on acceptance);
- **propose** (the scheduler, before the verify step): the row of the request's last computed position ``s -
  1`` from the kept ``h_{s-1}`` and the just-sampled ``t_s``, whose logits give draft ``d_1`` greedily; then
  ``d_{j+1}`` from row ``s - 1 + j`` fed ``d_j`` and the MTP's own output of the row before (one layer reused
  autoregressively, as vLLM does). Those chained rows are overwritten by the verify step's observe.

So after each step a request's rows ``0 .. s - 2`` hold the right entries for its kept tokens (a verify's
first rejected row is redone from its kept hidden state; rejected rows past it are never read). A request
seen with a new block list (preempted, or new) trusts the rows before its first computed position: they are
its prefix-cache hit's, whose last matched block the block manager recomputes for this method
(:class:`~tripath.engine.scheduling.block_manager.BlockManager`, ``recompute_last_hit_block``). The rows steer
only which drafts are proposed; verification keeps the outputs the target's.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from tripath.attention.step_ints import to_device
from tripath.engine.runner.mtp_layer import MTPLayerRunner, MTPRun, MTPSegment
from tripath.engine.scheduling.scheduler import ScheduledRequest


def check_mtp_model(model) -> None:
    """``ValueError`` naming ``speculative_config`` when ``model`` has no MTP layer loaded."""
    if getattr(model, "mtp", None) is not None:
        return
    config = model.config
    if getattr(config, "num_nextn_predict_layers", 0) >= 1:
        raise ValueError("speculative_config method 'mtp' drafts with the model's multi-token-prediction layer, "
                         "and this model object was built without it: load it with "
                         "tripath.models.load_model(..., mtp=True), or pass the model's path or preset name")
    raise ValueError(f"speculative_config method 'mtp' drafts with the model's multi-token-prediction layer, and "
                     f"the {getattr(config, 'architecture', type(model).__name__)} config has none "
                     f"(num_nextn_predict_layers={getattr(config, 'num_nextn_predict_layers', 0)}; DeepSeek-V3/R1 "
                     "checkpoints have 1)")


@dataclass
class _Rows:
    """What the proposer knows of one request's MTP rows."""

    blocks: list                # the request's block list when seen (another list: its blocks were freed)
    done: int                   # rows 0 .. done - 1 hold their right entries
    hidden: torch.Tensor | None = None   # the target's hidden states (before its norm) of positions hidden_at ..
    hidden_at: int = 0
    tentative: list[int] = field(default_factory=list)   # rows done, done + 1, ... were fed these next tokens

    def settle(self, request) -> None:
        """Count the tentative rows whose next token the request kept (a verify's accepted drafts)."""
        if self.tentative:
            kept = request.token_ids(self.done + 1, self.done + 1 + len(self.tentative))
            for token, fed in zip(kept, self.tentative):
                if token != fed:
                    break
                self.done += 1
            self.tentative = []

    def kept_hidden(self, start: int, stop: int) -> torch.Tensor | None:
        """The kept hidden states of positions ``start .. stop - 1``, or None when not all are kept."""
        if self.hidden is None or start < self.hidden_at or stop > self.hidden_at + self.hidden.shape[0]:
            return None
        return self.hidden[start - self.hidden_at:stop - self.hidden_at]


@dataclass
class _Segment:
    """MTP rows ``start .. start + len(tokens) - 1`` of a request: their next tokens and hidden states."""

    request: object
    start: int
    tokens: list[int]
    hidden: list[tuple[torch.Tensor, int]]   # pieces, ``len(tokens)`` rows in all: (rows, first row in the
                                             # launch just made, or -1 for rows from elsewhere)


class MTPProposer:
    """Drafts with ``model.mtp`` (module doc). ``runner``: the target's
    :class:`~tripath.engine.runner.model_runner.ModelRunner` (its backend, block geometry and hidden states; the
    proposer becomes its ``hidden_observer``); ``config``: the engine's
    :class:`~tripath.engine.config.EngineConfig`; ``share``: under tensor parallelism, rank 0's hand-over of
    each MTP run to the workers (:mod:`tripath.engine.runner.mtp_layer`; ``runner`` is then rank 0's)."""

    def __init__(self, model, runner, config, share=None):
        check_mtp_model(model)
        self.layer = MTPLayerRunner(model, runner, config, share)
        self._rows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # request -> _Rows
        runner.hidden_observer = self

    @property
    def cache(self):
        """The MTP layer's KV cache (the target's block geometry)."""
        return self.layer.cache

    def _state(self, request, start: int) -> _Rows:
        """The request's rows before a step (or drafting) from position ``start``."""
        state = self._rows.get(request)
        if state is None or state.blocks is not request.block_ids:
            state = self._rows[request] = _Rows(request.block_ids, start)
        state.settle(request)
        state.done = min(state.done, start)
        return state

    # ---- the target's steps -------------------------------------------------------------------------
    @torch.inference_mode()
    def observe(self, scheduled: list[ScheduledRequest], inputs, prenorm: torch.Tensor) -> None:
        """The launch of ``scheduled`` (``inputs``: its step inputs) computed ``prenorm [T, H]`` (plan order):
        compute the MTP rows whose next tokens are known, keep the hidden states of the others."""
        offsets, at = {}, 0
        for i in inputs.plan.order:
            if i < len(scheduled):
                offsets[i] = at
            at += scheduled[i].num_new_tokens if i < len(scheduled) else 1
        segments, keep, kept_rows = [], [], []
        for i, item in enumerate(scheduled):
            request, s, q = item.request, item.num_computed_tokens, item.num_new_tokens
            state, row = self._state(request, s), offsets[i]
            verify = bool(item.draft_token_ids)
            goes_on = not verify and s + q < request.num_tokens   # the chunk's last row has its next token
            end = s + q if goes_on else s + q - 1
            redo = state.kept_hidden(state.done, s)
            start = state.done if redo is not None else s
            tokens = request.token_ids(start + 1, s + 1) + item.input_token_ids()[1:]
            if goes_on:
                tokens += request.token_ids(s + q, s + q + 1)
            pieces = ([(redo, -1)] if s > start else []) + ([(prenorm[row:row + end - s], row)] if end > s else [])
            if tokens:
                segments.append(_Segment(request, start, tokens, pieces))
            first_kept = s if verify else s + q - 1   # a prompt's last token may be drafted after: row s + q - 1
            keep.append((state, first_kept, s + q - first_kept))
            kept_rows.extend(range(row + first_kept - s, row + q))
            state.done, state.tentative = (s, list(item.draft_token_ids)) if verify else (end, [])
        if segments:
            self._run(segments)
        kept = prenorm.index_select(0, to_device(kept_rows, torch.int64, prenorm.device)) \
            if kept_rows else None
        at = 0
        for state, first, count in keep:
            state.hidden, state.hidden_at = (kept[at:at + count], first) if count else (None, first)
            at += count

    # ---- drafting -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, items) -> list[list[int]]:
        """For each ``(request, k)`` of decodes about to verify: ``k`` greedy drafts of the MTP layer (none for a
        request whose last row's hidden state is not kept). The chain stays on the device: each run after the
        first is fed the tokens the run before drew, and the drafts are read back once."""
        drafts: list[list[int]] = [[] for _ in items]
        segments, owners = [], []
        for n, (request, k) in enumerate(items):
            s = request.num_computed_tokens
            state = self._state(request, s)
            start = min(state.done, s - 1)
            hidden = state.kept_hidden(start, s) if s > 0 else None
            if hidden is None:
                continue
            segments.append(_Segment(request, start, request.token_ids(start + 1, s + 1), [(hidden, -1)]))
            owners.append(n)
            state.done, state.hidden = s, None
        if not segments:
            return drafts
        ks = {items[n][1] for n in owners}
        if len(ks) == 1:   # one draft length: the whole chain as one run (one graph replayed k times)
            _, tokens = self._run(segments, samples=True, steps=ks.pop())
            drawn = [(list(owners), tokens[:, j]) for j in range(tokens.shape[1])]
        else:
            drawn = self._chain(segments, owners, items)
        flat = torch.cat([tokens for _, tokens in drawn]).tolist()   # the chain's one read-back
        at = 0
        for who, _ in drawn:
            for n in who:
                drafts[n].append(flat[at])
                at += 1
        return drafts

    def _chain(self, segments: list[_Segment], owners: list[int], items) -> list[tuple[list[int], torch.Tensor]]:
        """Drafts of several lengths: one run per depth over the requests still drafting there. Returns, per
        depth, the items drawing and their tokens (device)."""
        g, tokens = self._run(segments, samples=True)
        drawn, active = [(list(owners), tokens[:, 0])], list(owners)
        for j in range(1, max(k for _, k in items)):   # draft j + 1 from draft j and the MTP's own g
            still = [a for a, n in enumerate(active) if items[n][1] > j]   # positions in the run before
            if not still:
                break
            active = [active[a] for a in still]
            chained = [_Segment(items[n][0], items[n][0].num_computed_tokens - 1 + j, [0], []) for n in active]
            hidden = g if len(still) == g.shape[0] else g.index_select(0, to_device(still, torch.int64, g.device))
            g, tokens = self._run(chained, samples=True, fed_by=still, hidden=hidden)
            drawn.append((active, tokens[:, 0]))
        return drawn

    # ---- one MTP step -------------------------------------------------------------------------------
    def _run(self, segments: list[_Segment], samples: bool = False, fed_by: list[int] | None = None,
             hidden: torch.Tensor | None = None, steps: int = 1):
        """Run the MTP layer over ``segments`` (writing their cache rows) on their hidden pieces, or on
        ``hidden`` (rows sent with the run). With ``samples``: ``(g [N, H], greedy tokens [N, steps] on the
        device)`` of each segment's last row, in ``segments``' order. ``fed_by`` / ``steps``:
        :attr:`MTPRun.fed_by` / :attr:`MTPRun.steps`."""
        pieces = [piece for seg in segments for piece in seg.hidden]
        run = MTPRun([MTPSegment(seg.start, seg.tokens, seg.request.block_ids) for seg in segments], samples,
                     [(row, rows.shape[0]) for rows, row in pieces], fed_by, steps)
        return self.layer.run(run, hidden if hidden is not None else torch.cat([rows for rows, _ in pieces]))
