"""``mixed``: a step's attention in one persistent launch a layer (:func:`tripath.ops.mixed_attention`): its
decodes, extends and prefills walk one work list that a planning launch builds on the device from the step's
lengths, so the host does the same few calls for any mix, and every step reads device tensors only.

The work list is planned once a forward pass (:meth:`MixedBackend.begin_pass`, one small launch before the
first layer, with the spec's window) and every layer attends on it (one launch); a layer whose window differs
from the last plan's plans again, and a caller that runs the forward without a
:class:`~tripath.attention.ForwardContext` gets a plan for each new metadata or new contents of one
(``AttentionMetadata.version``).

The backend keeps one workspace (:func:`tripath.ops.mixed_attention_workspace`: work list, merge counters, split
partials), made for the first step and grown to the next powers of two of tokens and requests when a step does
not fit it. A grown workspace shares the partials and counters of the one before, and the backend keeps every
outgrown work list: a CUDA graph captured on a smaller step (a decode graph captured before the engine's first
large step) replays on the buffers it captured. Its forward reads only the metadata's common tensors, so the
engine captures whole steps with prompt tokens in CUDA graphs too (:mod:`tripath.engine.runner.whole_step_graphs`).
A step of one-token decodes only takes :func:`tripath.ops.paged_decode` instead (as ``three_path``'s decodes do):
on 48 decodes of 4096 tokens the one-launch kernel took 1.23× its GPU time, and engine decode steps of the TP-8
shard 1.07×. A whole-step graph's bucket is captured on prompts (no cached context, so no decodes in its plan)
and keeps the one-launch kernel for every step it replays.
Not among ``auto``'s choices: opt in with ``backend="mixed"``
(``tripath bench`` compares it with the others).
"""

from __future__ import annotations

from tripath.attention.backends.base import Capabilities, GraphSupport, MHAAttentionBackend
from tripath.ops import (MixedAttentionWorkspace, mixed_attention, mixed_attention_workspace, paged_decode,
                         plan_mixed_attention)

MIN_WORKSPACE_TOKENS = 256   # the first workspace's tokens at least (the requests: 16)


class MixedBackend(MHAAttentionBackend):
    name = "mixed"
    capabilities = Capabilities(graphs=GraphSupport.ALL, verify_graphs=True)   # device tensors alone, any step

    def __init__(self, spec, device="cpu"):
        super().__init__(spec, device)
        self._workspace: MixedAttentionWorkspace | None = None
        self._outgrown: list[MixedAttentionWorkspace] = []   # their work lists, which captured graphs may hold
        self._planned_for = (None, 0)   # the metadata (and its version) whose work list the workspace holds

    def workspace(self, num_tokens: int, num_seqs: int, device) -> MixedAttentionWorkspace:
        """The backend's workspace, grown (to powers of two) when a step of ``num_tokens`` new tokens and
        ``num_seqs`` requests does not fit it."""
        ws = self._workspace
        if ws is not None and num_tokens <= ws.max_num_tokens and num_seqs <= ws.max_num_seqs:
            return ws
        tokens = max(num_tokens, MIN_WORKSPACE_TOKENS, ws.max_num_tokens if ws else 0)
        seqs = max(num_seqs, 16, ws.max_num_seqs if ws else 0)
        spec = self.spec
        self._workspace = mixed_attention_workspace(spec.num_heads, spec.num_kv_heads, spec.head_size,
                                                    head_size_v=spec.head_size_v or spec.head_size,
                                                    max_num_tokens=_pow2(tokens), max_num_seqs=_pow2(seqs),
                                                    device=device, share=ws, kv_fp8=spec.kv_cache_dtype == "fp8")
        if ws is not None:
            self._outgrown.append(ws)
        return self._workspace

    def begin_pass(self, meta) -> None:
        """Plan the pass's work list (the spec's window) into the workspace, for every layer to attend on (none
        for a step of one-token decodes, which paged decode serves)."""
        if not decodes_only(meta):
            self._plan(meta, meta.plan.num_tokens, self.spec.window_left, meta.block_table.device)

    def _plan(self, meta, num_tokens: int, window_left: int, device) -> MixedAttentionWorkspace:
        ws = self.workspace(num_tokens, meta.plan.num_requests, device)
        plan_mixed_attention(ws, meta.cu_seqlens_q, meta.seq_lens, window_left=window_left)
        self._planned_for = (meta, meta.version)
        return ws

    def forward(self, q, k, v, cache, meta, *, alibi_slopes=None, sinks=None, out=None, window_left=None):
        opts = self._options(alibi_slopes, sinks, window_left)
        self._write(k, v, cache, meta)
        k_scale, v_scale = self._scales(cache)
        if decodes_only(meta):
            d, out = meta.decode, self._out(q, out)
            paged_decode(q[:d.num_tokens], cache.k_cache, cache.v_cache, d.block_table, d.seq_lens, layout=cache.layout,
                         k_scale=k_scale, v_scale=v_scale, num_splits=d.num_splits, out=out[:d.num_tokens], **opts)
            return out
        ws = self.workspace(q.shape[0], meta.plan.num_requests, q.device)
        planned_meta, planned_version = self._planned_for
        if planned_meta is not meta or planned_version != meta.version or ws.window_left != opts["window_left"]:
            ws = self._plan(meta, q.shape[0], opts["window_left"], q.device)
        return mixed_attention(q, cache.k_cache, cache.v_cache, meta.block_table, meta.seq_lens, meta.cu_seqlens_q,
                               layout=cache.layout, k_scale=k_scale, v_scale=v_scale, workspace=ws, planned=True,
                               out=self._out(q, out), **opts)


def decodes_only(meta) -> bool:
    """Whether ``meta``'s step is one-token decodes only."""
    d = meta.decode
    return d is not None and d.single_token and d.num_reqs == meta.plan.num_requests


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
