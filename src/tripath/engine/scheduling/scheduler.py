"""Continuous batching under a per-step token budget, with chunked prefill and preemption by recompute.

Each step the scheduler picks, within its token budget (``max_num_batched_tokens``, halved after a step
that ran out of device memory: :meth:`Scheduler.shrink_token_budget`; kept to a step time on the CPU:
:meth:`Scheduler.pace`) and ``max_num_seqs`` running requests:

1. every running *decode* (one pending token), oldest first;
2. running requests part-way through their prompt (chunked prefill: the next chunk, an *extend*);
3. waiting requests, first come first served: the prefix cache supplies their leading full blocks (a hit
   turns the prefill into an extend) and they get as many prompt tokens as the budget allows — the whole
   prompt without chunked prefill, or they wait.

When a running request needs a KV block and none is free, the most recently admitted running request that
is not yet scheduled this step is *preempted*: its blocks are freed (full ones stay in the prefix cache) and
it returns to the front of the waiting queue with its outputs kept, to be recomputed later. If no such
request exists the request preempts itself. Waiting requests never preempt running ones. A request that
could never fit (longer than ``max_model_len``, more blocks than the cache holds, or a prompt over the
token budget without chunked prefill) is refused when it is added, so no accepted request is dropped.

A step's bookkeeping happens when it is scheduled: each scheduled request's ``num_computed_tokens`` advances
by its new tokens, and one that samples gets an *in-flight* token (``num_inflight_tokens``). :meth:`update`
later appends the sampled tokens. So the engine may schedule step N + 1 while step N still runs on the
device (overlapped scheduling): a decode whose input is step N's in-flight token reads it on the device; a
request whose last allowed token (``max_tokens``) is in flight is not scheduled again; one that step N
finishes (a stop token) was scheduled once more for nothing, and that step's token for it is dropped. Full
blocks enter the prefix cache in :meth:`update`, after the step that computed them was launched, never in
the step that writes them.

*Multi-step decoding* (``schedule(decode_steps=K)``): when every request the step would schedule is a
decode and no waiting request could be admitted (none waits, or ``max_num_seqs`` run), the step is
scheduled as ``k = min(K, remaining tokens of its closest-to-done request)`` model steps of the same
decodes, run back to back on the device; each request gets blocks for all ``k`` tokens up front, and ``k``
tokens in flight. It needs the free blocks for them (otherwise one step is scheduled, as usual). A request
that meets a stop token inside such a step keeps its tokens up to the stop; the rest are dropped.

*Speculative decoding* (``speculation``: a :class:`~tripath.engine.speculative.SpeculativeConfig`): a decode
whose request can take drafts (see :meth:`Scheduler._draft_room`) gets budget and blocks for its pending token
and up to ``d`` drafts, as a prompt chunk would (fewer when they do not fit); then one call to the proposer
(``proposer.propose([(request, d), ...])``, with the blocks already there for a draft model to write its own
cache rows) drafts for all of them, and each is scheduled as a *verify* of ``1 + len(drafts)`` new tokens. The
step scores all of them and yields the accepted drafts and one token more; :meth:`update` moves
``num_computed_tokens`` back past the rejected drafts, whose cache rows the next tokens overwrite (a block
enters the prefix cache only once computed tokens fill it). A request with a token in flight takes no drafts:
the engine reads the step in flight first while :meth:`Scheduler.may_draft` holds or the step verified drafts
(overlapped scheduling only while nothing is drafted). Multi-step decoding takes only steps in which no
request would draft: with ``disable_by_batch_size`` exceeded, or with adaptive draft lengths
(:mod:`tripath.engine.speculative.draft_length`) between the probes of requests that draft nothing. With
draft trees (``tree_width > 1``) the proposer's ``propose_trees([(request, d), ...], width)`` gives each a
tree of at most ``d`` nodes (``ScheduledRequest.draft_parents``); the step yields its accepted path and one
token more, whose cache rows the runner has moved to the path's positions, so :meth:`update` treats it as a
chain's kept drafts.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tripath.engine.config.speculative import SpeculativeConfig
from tripath.engine.requests.request import FinishReason, Request, RequestStatus
from tripath.engine.scheduling.block_manager import BlockManager, blocks_needed
from tripath.engine.scheduling.stats import DraftCounts
from tripath.engine.speculative.draft_length import DraftLengths
from tripath.engine.speculative.ngram import NgramProposer
from tripath.engine.speculative.trees import depths

MIN_TOKEN_BUDGET = 64  # the smallest step budget an out-of-memory step shrinks it to (shrink_token_budget)
MIN_PACED_BUDGET = 16  # the smallest step budget step pacing sets (pace)


@dataclass
class ScheduledRequest:
    """A request in this step: ``num_new_tokens`` tokens after its ``num_computed_tokens`` cached ones;
    ``samples``: the step reaches the end of the request's tokens (its last logits give a new token).
    ``draft_token_ids``: a *verify* (speculative decoding): the last ``len(draft_token_ids)`` of the new
    tokens are drafts following the request's pending token; every new token's logits are scored and the
    step yields 1 to ``1 + len(draft_token_ids)`` tokens (:mod:`tripath.engine.speculative.acceptance`).
    ``draft_parents``: the drafts form a tree (``tree_width > 1``, :mod:`tripath.engine.speculative.trees`),
    draft ``t`` following draft ``draft_parents[t]`` (-1: the pending token); None: a chain."""

    request: Request
    num_new_tokens: int
    num_computed_tokens: int
    samples: bool
    draft_token_ids: list[int] = field(default_factory=list)
    draft_parents: list[int] | None = None

    def input_token_ids(self) -> list[int]:
        """The step's new input tokens: the request's own, then the drafts."""
        start, drafts = self.num_computed_tokens, self.draft_token_ids
        own = self.request.token_ids(start, start + self.num_new_tokens - len(drafts))
        return own + drafts if drafts else own


@dataclass
class SchedulerOutput:
    """The step: the scheduled requests and the ones preempted for it. ``num_steps > 1``: every scheduled
    request is a single-token decode, to be run ``num_steps`` model steps in a row (multi-step decoding;
    ``num_new_tokens`` and ``num_computed_tokens`` describe the first)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_steps: int = 1

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting and running queues and the block manager; the engine calls :meth:`schedule`, runs
    the step, then :meth:`update` with the sampled tokens."""

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True,
                 speculation: SpeculativeConfig | None = None, proposer=None):
        self.block_manager = block_manager
        self.speculation = speculation
        if proposer is None and speculation is not None:
            if speculation.method != "ngram":
                raise ValueError(f"speculative method {speculation.method!r} needs its proposer built by the engine "
                                 "(tripath.engine.drafters.proposers.make_proposer)")
            proposer = NgramProposer(speculation.prompt_lookup_min, speculation.prompt_lookup_max)
        self.proposer = proposer   # drafts for the verifies (speculative decoding: ``propose([(request, k)])``)
        self.draft_counts = DraftCounts(0 if speculation is None else speculation.num_speculative_tokens)
        threshold = 0.0 if speculation is None else speculation.acceptance_threshold
        self.draft_lengths = DraftLengths(threshold) if threshold > 0 else None   # adaptive draft lengths
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.token_budget = max_num_batched_tokens  # new tokens a step takes (pace, shrink_token_budget)
        self._budget_cap = max_num_batched_tokens   # the most pace may set: lowered after an out-of-memory step
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- queue ---------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Accept a request, or raise ``ValueError`` if it could never be served (:meth:`check`)."""
        self.check(request)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def check(self, request: Request) -> None:
        """Raise ``ValueError`` if ``request`` could never be served: longer than ``max_model_len``, more
        blocks than the cache holds, or (chunked prefill off) a prompt over the token budget."""
        longest = request.num_prompt_tokens + request.sampling_params.max_tokens
        if longest > self.max_model_len:
            raise ValueError(f"prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                             f"({request.sampling_params.max_tokens}) exceeds max_model_len ({self.max_model_len})")
        bm = self.block_manager
        if blocks_needed(longest, bm.block_size) > bm.num_usable_blocks:
            raise ValueError(f"prompt + max_tokens ({longest} tokens) needs more KV blocks than the cache holds "
                             f"({bm.num_usable_blocks} blocks of {bm.block_size}); raise num_kv_blocks or "
                             "gpu_memory_utilization")
        if not self.enable_chunked_prefill and longest - 1 > self.max_num_batched_tokens:
            raise ValueError(f"a prompt of up to {longest - 1} tokens (with outputs, after preemption) exceeds "
                             f"max_num_batched_tokens ({self.max_num_batched_tokens}) and chunked prefill is off")

    def abort(self, request_id: str) -> Request | None:
        """Finish a request wherever it is; returns it, or None when unknown."""
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self.block_manager.release(request)
                    request.finish(FinishReason.ABORTED)
                    return request
        return None

    def shrink_token_budget(self) -> int:
        """Halve the tokens a step takes (after a step ran out of device memory), down to
        ``MIN_TOKEN_BUDGET`` or ``max_num_seqs``, whichever is larger, so the running decodes still fit in
        one step; with chunked prefill off a whole prompt must fit in a step, so the budget stays. Returns
        the new budget."""
        if self.enable_chunked_prefill:
            floor = min(self.max_num_batched_tokens, max(MIN_TOKEN_BUDGET, self.max_num_seqs))
            self.token_budget = self._budget_cap = max(floor, self.token_budget // 2)
        return self.token_budget

    def pace(self, tokens: int) -> int:
        """Set the tokens a step takes to ``tokens`` (the engine's step pacing,
        :mod:`~tripath.engine.scheduling.step_pacing`), within ``max_num_batched_tokens`` or the smaller budget an
        out-of-memory step left, and never below the running requests (each decode stays in every step) or
        ``MIN_PACED_BUDGET``; with chunked prefill off a whole prompt must fit in a step, so the budget
        stays. Returns the budget."""
        if self.enable_chunked_prefill:
            floor = min(self._budget_cap, max(MIN_PACED_BUDGET, len(self.running)))
            self.token_budget = max(floor, min(tokens, self._budget_cap))
        return self.token_budget

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------------------------
    def schedule(self, decode_steps: int = 1) -> SchedulerOutput:
        """The next step. ``decode_steps``: the most model steps a step of decodes alone may take
        (multi-step decoding, see the module doc; 1: one step at a time)."""
        out = SchedulerOutput()
        budget = self.token_budget
        scheduled: set[int] = set()
        # 1. decodes, then 2. running prompt chunks; a request may be preempted by one before it.
        decodes, chunks = [], []
        for request in self.running:
            if request.num_output_tokens + request.num_inflight_tokens >= request.sampling_params.max_tokens:
                continue  # its last token is in flight
            pending = request.num_pending_tokens
            (decodes if pending == 1 else chunks).append((request, pending))
        steps = self._decode_steps([r for r, _ in decodes], decode_steps) if decodes and not chunks else 1
        if steps > 1:
            for request, _ in decodes:
                grown = self.block_manager.grow(request, steps)
                assert grown, "_decode_steps counted the free blocks"
                if self.draft_lengths is not None:
                    self.draft_lengths.skip(request, steps)
                self._add(out, request, 1, steps)
            out.num_steps = steps
            return out
        verifies: list[tuple[Request, int]] = []   # requests to draft for, with the drafts they have room for
        for request, pending in decodes + chunks:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted by a request before it
                continue
            room = self._draft_room(request) if pending == 1 and self.proposer is not None else 0
            num_new = self._make_room(request, min(pending + room, budget), scheduled, out)
            if num_new == 0:
                continue
            budget -= num_new
            scheduled.add(id(request))
            if num_new > 1 and pending == 1:
                verifies.append((request, num_new - 1))
            else:
                self._add(out, request, num_new)
        if verifies and self.speculation.uses_trees:   # draft trees: the first `room` nodes keep their parents
            for (request, room), (drafts, parents) in zip(verifies, self.proposer.propose_trees(
                    verifies, self.speculation.tree_width)):
                drafts, parents = list(drafts)[:room], list(parents)[:room]
                budget += room - len(drafts)
                self._add(out, request, 1 + len(drafts), drafts=drafts, parents=parents)
        elif verifies:   # one call drafts for every verify; the room drafts did not fill returns to the budget
            for (request, room), drafts in zip(verifies, self.proposer.propose(verifies)):
                drafts = list(drafts)[:room]
                if request.grammar is not None:   # a draft its grammar refuses, and those after it, go unscored
                    drafts = drafts[:request.grammar.valid_drafts(drafts)]
                budget += room - len(drafts)
                self._add(out, request, 1 + len(drafts), drafts=drafts)
        # 3. waiting requests, in order, while the budget, the sequence limit and the free blocks allow.
        #    Nothing is admitted in a step that had to preempt: the memory is short already.
        now = time.perf_counter()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            request = self.waiting[0]
            if request.num_inflight_tokens:
                break  # preempted while its token was in flight: it waits until the token is read
            num_new = self.block_manager.admit(request, budget, whole=not self.enable_chunked_prefill)
            if num_new is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.scheduled_time is None:   # the end of its queue time (metrics)
                request.scheduled_time = now
            self.running.append(request)
            budget -= num_new
            scheduled.add(id(request))
            self._add(out, request, num_new)
        return out

    def _decode_steps(self, decodes: list[Request], most: int) -> int:
        """Model steps for a step of ``decodes`` alone: up to ``most``, as many as the request closest to
        its ``max_tokens`` still needs; 1 when a waiting request could be admitted, when the decodes exceed
        the token budget, or when the free blocks do not cover every decode's tokens for those steps."""
        if most <= 1 or len(decodes) > self.token_budget or \
                (self.waiting and len(self.running) < self.max_num_seqs) or \
                any(r.grammar is not None for r in decodes):   # each token's mask needs the one before
            return 1
        steps = min(most, min(r.sampling_params.max_tokens - r.num_output_tokens - r.num_inflight_tokens
                              for r in decodes))
        if self._drafting():   # speculation: only steps in which no request would draft
            lengths = self.draft_lengths
            steps = 1 if lengths is None else min(steps, min(lengths.steps_without_draft(r, steps) for r in decodes))
        if steps <= 1:
            return 1
        bs = self.block_manager.block_size
        need = sum(max(0, blocks_needed(r.num_computed_tokens + steps, bs) - len(r.block_ids)) for r in decodes)
        return steps if need <= self.block_manager.num_free_blocks else 1

    def _drafting(self) -> bool:
        """Speculation is on and no more requests run than ``disable_by_batch_size``."""
        speculation = self.speculation
        return speculation is not None and self.proposer is not None and (
            speculation.disable_by_batch_size is None or len(self.running) <= speculation.disable_by_batch_size)

    def may_draft(self) -> bool:
        """Whether a decode scheduled now may take drafts: speculation is on, no more requests run than
        ``disable_by_batch_size``, and (with adaptive draft lengths) a running request's next step would
        draft. A request with a token in flight takes none: the engine reads the step in flight first while
        this holds."""
        lengths = self.draft_lengths
        return self._drafting() and (lengths is None or any(lengths.steps_without_draft(r, 1) == 0
                                                            for r in self.running))

    def _draft_room(self, request: Request) -> int:
        """How many drafts a running request's next step may verify (speculative decoding): as many as
        ``num_speculative_tokens`` and its ``max_tokens`` allow (each verify row then takes the request's logit
        transforms as of its drafts, :mod:`tripath.engine.speculative.verify_transforms`); none while a token
        of it is in flight or while more requests run than ``disable_by_batch_size``; with an
        ``acceptance_threshold``, as many as its acceptance pays for
        (:mod:`tripath.engine.speculative.draft_length`)."""
        params, speculation = request.sampling_params, self.speculation
        if request.num_inflight_tokens or (speculation.disable_by_batch_size is not None
                                           and len(self.running) > speculation.disable_by_batch_size):
            if self.draft_lengths is not None:   # a step without drafts counts toward its next probe
                self.draft_lengths.skip(request, 1)
            return 0
        room = params.max_tokens - request.num_output_tokens - 1   # the verify step yields up to 1 + drafts
        room = max(0, min(speculation.num_speculative_tokens, room))
        return room if self.draft_lengths is None else self.draft_lengths.length(request, room)

    @staticmethod
    def _add(out: SchedulerOutput, request: Request, num_new: int, num_steps: int = 1,
             drafts: list[int] | None = None, parents: list[int] | None = None) -> None:
        """Schedule ``num_new`` tokens of ``request``: they count as computed from now on, and a step that
        reaches the end of its tokens leaves one in flight (``num_steps`` decode steps: that many). A verify
        (``drafts``: the last ``len(drafts)`` of the new tokens) leaves ``1 + len(drafts)`` in flight, the
        most it can yield; :meth:`update` takes back the drafts the model rejected (``parents``: a draft tree's)."""
        computed = request.num_computed_tokens
        if drafts:
            out.scheduled.append(ScheduledRequest(request, num_new, computed, True, drafts, parents))
            request.num_computed_tokens = computed + num_new
            request.num_inflight_tokens += num_new
            return
        samples = computed + num_new == request.num_tokens + request.num_inflight_tokens
        out.scheduled.append(ScheduledRequest(request, num_new, computed, samples))
        request.num_computed_tokens = computed + num_new + num_steps - 1
        request.num_inflight_tokens += samples * num_steps

    def _make_room(self, request: Request, num_new: int, scheduled: set[int], out: SchedulerOutput) -> int:
        """Blocks for ``num_new`` tokens of a running request. A prompt chunk shrinks to what the free
        blocks hold; when not even one token fits, the youngest running request not scheduled this step is
        preempted (or, if there is none, this one). Returns the tokens granted (0: it was preempted)."""
        bm = self.block_manager
        while not bm.grow(request, num_new):
            fits = bm.max_growth(request)
            if fits > 0:
                num_new = min(num_new, fits)
                continue
            victims = [r for r in self.running if r is not request and id(r) not in scheduled]
            victim = victims[-1] if victims else request
            self._preempt(victim, out)
            if victim is request:
                return 0
        return num_new

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.block_manager.release(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    # ---- after the step ------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: list[list[int]]) -> list[Request]:
        """Append each scheduled request's sampled tokens (one per model step of ``out``; none for a
        request mid-prompt), cache its completed full blocks, and retire finished ones. Returns the
        requests this update finished.

        A request that finished or was aborted since ``out`` was scheduled is skipped (its tokens are
        dropped), as are the tokens after one that finishes it; one preempted since then keeps its tokens
        and may finish waiting."""
        finished = []
        for item, tokens in zip(out.scheduled, sampled):
            request = item.request
            if request.is_finished:
                continue
            running = request.status is RequestStatus.RUNNING
            if item.draft_token_ids:   # a verify: its accepted drafts and the token after them
                request.num_inflight_tokens -= item.num_new_tokens
                self.draft_counts.observe(len(item.draft_token_ids), len(tokens) - 1)
                if self.draft_lengths is not None:
                    parents = item.draft_parents   # a tree scores its depth
                    scored = len(item.draft_token_ids) if parents is None else max(depths(parents))
                    self.draft_lengths.observe(request, scored, len(tokens) - 1)
                if running:   # the rejected drafts' cache rows are rewritten by the tokens that follow
                    request.num_computed_tokens = item.num_computed_tokens + len(tokens)
            else:
                request.num_inflight_tokens -= len(tokens)
            for token in tokens:
                request.append_token(token)
                if request.is_finished:
                    break
            if running:
                self.block_manager.cache_computed_blocks(request)
            if request.is_finished:
                if running:
                    self.running.remove(request)
                    self.block_manager.release(request)
                else:
                    self.waiting.remove(request)  # preempted while its last token was in flight
                finished.append(request)
        return finished
