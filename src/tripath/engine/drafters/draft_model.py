"""Drafts from a smaller model (the ``draft_model`` method): any model with the target's vocabulary, run by a
:class:`~tripath.engine.runner.model_runner.ModelRunner` of its own beside the target's.

The draft's KV cache has the target's block count and block size and is indexed by the target requests' own
block tables: a request's blocks hold the target's rows in the target's cache and the draft's rows in the
draft's, so the draft needs no block manager. On a GPU the engine loads the draft before it sizes the target's
cache and the memory plan counts the draft's bytes in every block (:func:`draft_cache_bytes`). The scheduler
makes room for a verify's drafts before it asks (:mod:`tripath.engine.scheduling.scheduler`), so the blocks cover every
position the draft writes.

For the requests of one step, :meth:`DraftModelProposer.propose` runs the draft

1. over each request's tokens it has not seen (its whole sequence the first time, after a preemption or once
   its blocks changed; else the tokens gained since the last call), in steps of at most
   ``max_num_batched_tokens`` new tokens, the last of which samples the first draft greedily;
2. then ``k - 1`` single-token decode steps, each feeding the draft it just sampled.

Draft rows written past the request's tokens are recomputed the next time (the request resumes from its
own tokens), so rejected drafts leave nothing behind.
"""

from __future__ import annotations

import dataclasses
import weakref

from tripath.engine.runner.step_request import StepRequest
from tripath.engine.scheduling.scheduler import ScheduledRequest


def load_draft_model(name: str, config):
    """The draft model of ``speculative_config.model`` (a preset, model directory or hub id), on the engine's
    device and in its dtype: loaded before the target's KV cache is sized, so its weights count as in use."""
    from tripath.models import load_model
    from tripath.models.hub import resolve_model_path
    return load_model(resolve_model_path(name), dtype=config.dtype, device=config.device).eval()


def draft_cache_bytes(model, config):
    """``block_size -> bytes`` of the draft model's KV cache for one block (all its layers), for the target's
    memory plan, which sizes both caches to the same number of blocks."""
    from tripath.attention import select_backend

    def bytes_per_block(block_size: int) -> int:
        spec = model.attention_spec(block_size=block_size, kv_cache_dtype=config.kv_cache_dtype, dtype=config.dtype)
        return select_backend(spec, device=config.device).cache_bytes_per_block() * model.num_attention_layers

    return bytes_per_block


class DraftModelProposer:
    """``model``: a preset, a model directory or hub id, or a built model; ``config``: the target engine's
    :class:`~tripath.engine.config.EngineConfig`; ``num_blocks`` / ``block_size`` / ``max_model_len``: the
    target runner's; ``vocab_size``: the target's vocabulary (the draft's must be the same)."""

    def __init__(self, model, config, *, num_blocks: int, block_size: int, max_model_len: int, vocab_size: int):
        from tripath.engine.runner.model_runner import ModelRunner
        from tripath.engine.runner.startup import start

        if isinstance(model, str):
            model = load_draft_model(model, config)
        draft_vocab = int(model.config.vocab_size)
        if draft_vocab != vocab_size:
            raise ValueError(f"speculative_config model has a vocabulary of {draft_vocab} tokens, the target "
                             f"{vocab_size}: a draft model must share the target's tokenizer and vocabulary")
        if int(model.config.max_position) < max_model_len:
            raise ValueError(f"speculative_config model reaches position {int(model.config.max_position)}, short "
                             f"of the target's max_model_len ({max_model_len}): pass max_model_len <= that")
        draft_config = dataclasses.replace(config, num_kv_blocks=num_blocks, block_size=block_size,
                                           max_model_len=max_model_len, speculative_config=None,
                                           async_scheduling=False, decode_steps=1, backend="auto")
        self.model = model.eval()
        self.runner = ModelRunner(model, draft_config)
        start(self.runner)   # the target's cache size: no memory plan
        self.budget = config.max_num_batched_tokens
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # request -> (its blocks, tokens seen)

    def propose(self, items) -> list[list[int]]:
        """For each ``(request, k)``: ``k`` greedy draft tokens of the draft model after the request's tokens."""
        drafts = self._catch_up([request for request, _ in items])
        most = max(k for _, k in items)
        for j in range(1, most):
            active = [i for i, (_, k) in enumerate(items) if k > j]
            scheduled = []
            for i in active:
                request = items[i][0]
                position = request.num_tokens + j - 1   # the draft sampled last, fed at its own position
                scheduled.append(ScheduledRequest(StepRequest(position + 1, request.block_ids, position,
                                                              [drafts[i][-1]]), 1, position, True))
            for i, tokens in zip(active, self.runner.execute(scheduled).tokens):
                drafts[i].append(tokens[0])
        return drafts

    def _catch_up(self, requests) -> list[list[int]]:
        """Run the draft over each request's unseen tokens; each request's first draft token."""
        starts = []
        for request in requests:
            seen = self._seen.get(request)
            start = seen[1] if seen is not None and seen[0] is request.block_ids else 0
            starts.append(min(start, request.num_tokens - 1))   # at least the last token: it samples
            self._seen[request] = (request.block_ids, request.num_tokens)
        firsts: list[list[int]] = [[] for _ in requests]
        pending = list(range(len(requests)))
        while pending:
            budget, scheduled, rows = self.budget, [], []
            for i in pending:
                if budget == 0:
                    break
                request, start = requests[i], starts[i]
                n = min(request.num_tokens - start, budget)
                reaches_end = start + n == request.num_tokens
                scheduled.append(ScheduledRequest(StepRequest(request.num_tokens, request.block_ids, start,
                                                              request.token_ids(start, start + n)),
                                                  n, start, reaches_end))
                rows.append(i)
                starts[i] += n
                budget -= n
            for i, tokens in zip(rows, self.runner.execute(scheduled).tokens):
                if tokens:
                    firsts[i] = [tokens[0]]
            pending = [i for i in pending if not firsts[i]]
        return firsts
