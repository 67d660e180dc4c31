"""CUDA graphs for steps with prompt tokens: the model's layers between its attention calls captured per
padded token count (*piecewise* graphs), with attention run eagerly between the replays on the step's own
metadata, since its launches depend on the step's requests (grid sizes, context chunks, side streams).
A model that keeps its hidden states before the final norm (``keep_prenorm_hidden``: speculative decoding's
``mtp`` method reads them) has them in each bucket's last graph too (:meth:`MixedStepGraphs.prenorm`).

For a bucket of ``N`` tokens the capture runs the model once on static ``input_ids [N]`` / ``positions [N]``
under a stand-in context whose attention calls cut the capture: each call's tensor arguments are copied
(inside the graph being captured) into static buffers, that graph ends, and the call returns a static
output buffer which the next graph reads. A step of ``T <= N`` tokens writes its ids and positions into the
first ``T`` rows and replays the first graph; then, for each attention call, it runs the call on the
first ``T`` rows of the static inputs with the step's :class:`~tripath.attention.ForwardContext`, writing
into the first ``T`` rows of the static output (MLA calls: copying their result there), and replays the
next graph. Every MHA call of a step thus sees the same memory, so the context replays the first layer's
launches for the others (:class:`~tripath.attention.ForwardContext`, ``replay_launches``). The hidden states are the first ``T`` rows
of the last graph's output. Rows past ``T`` carry stale values through the row-wise layers and are never
read.

Every bucket shares one memory pool (the decode graphs' too) and one set of static buffers, sized for the
largest bucket: a step replays one bucket's graphs in order and reads nothing a graph leaves behind after
the step, so the buckets may reuse each other's memory. Layers that synchronise with the host cannot be
captured: models with mixture-of-experts layers (their grouped path reads the expert sizes on the host)
keep eager steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class _Call:
    """One attention call of a captured bucket: ``run(ctx, T, out)`` makes it on the first ``T`` static rows,
    into ``out`` where the call takes one (MHA), returning the result."""

    run: Callable[[object, int, torch.Tensor | None], torch.Tensor]
    out: torch.Tensor  # the static output buffer (all rows), which the next graph reads


@dataclass
class _Bucket:
    graphs: list
    calls: list[_Call]
    hidden: torch.Tensor  # the last graph's output [N, hidden]
    prenorm: torch.Tensor | None = None  # the last graph's hidden states before the final norm, where kept


class MixedStepGraphs:
    """Piecewise CUDA graphs of ``model`` for padded token counts ``sizes`` on ``device``; ``pool``: a graph
    memory pool to share (e.g. the decode graphs')."""

    def __init__(self, model, sizes: list[int], device: torch.device, pool=None):
        if not sizes or min(sizes) < 1:
            raise ValueError(f"mixed-step graph sizes must be positive token counts, got {sizes}")
        self.model = model
        self.sizes = sorted(set(int(s) for s in sizes))
        self.device = device
        self.pool = pool
        top = self.sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self._static: dict[tuple, torch.Tensor] = {}
        self.buckets: dict[int, _Bucket] = {}
        self._last: _Bucket | None = None   # the bucket run() replayed last

    def bucket(self, num_tokens: int) -> int | None:
        """The captured size a step of ``num_tokens`` tokens replays (the smallest that holds it), or None."""
        return next((n for n in self.sizes if n >= num_tokens and n in self.buckets), None)

    def static_buffer(self, role: str, index: int, like: torch.Tensor) -> torch.Tensor:
        """The shared static buffer ``[largest size, *like.shape[1:]]`` for argument ``index`` of an
        attention call (``role`` "in") or its output ("out")."""
        key = (role, index, tuple(like.shape[1:]), like.dtype)
        buf = self._static.get(key)
        if buf is None:
            buf = self._static[key] = torch.empty((self.sizes[-1], *like.shape[1:]), dtype=like.dtype,
                                                  device=self.device)
        return buf

    def capture(self, make_context: Callable[[int], object]) -> None:
        """Capture every size, largest first. ``make_context(n)``: a context for a step of ``n`` prompt tokens
        that writes nothing (slots −1), used for a warm-up run before each capture and for the attention
        calls made while capturing."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        for n in reversed(self.sizes):
            ctx = make_context(n)
            self.model(self.input_ids[:n], self.positions[:n], ctx)  # compiles and plans outside the capture
            torch.cuda.synchronize(self.device)
            self.buckets[n] = self._capture(n, ctx)
        torch.cuda.synchronize(self.device)

    def _capture(self, n: int, ctx) -> _Bucket:
        cutter = _CapturingContext(self, n, ctx)
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            try:
                cutter.begin()
                hidden = self.model(self.input_ids[:n], self.positions[:n], cutter)
            finally:
                cutter.end()  # a failed capture is ended too, so the device is left usable
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        for graph in cutter.graphs:  # a graph's first launch uploads it: not on a request's time
            graph.replay()
        prenorm = self.model.prenorm_hidden if getattr(self.model, "keep_prenorm_hidden", False) else None
        return _Bucket(cutter.graphs, cutter.calls, hidden, prenorm)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """The model's hidden states ``[T, hidden]`` for a step's ``input_ids [T]`` / ``positions [T]`` with
        its context ``ctx``, by the graphs of the smallest size that holds ``T`` (which must exist)."""
        t = input_ids.shape[0]
        n = self.bucket(t)
        if n is None:
            raise ValueError(f"no mixed-step graph holds {t} tokens (sizes {self.sizes})")
        bucket = self.buckets[n]
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        bucket.graphs[0].replay()
        for call, graph in zip(bucket.calls, bucket.graphs[1:]):
            out = call.out[:t]
            result = call.run(ctx, t, out)
            if result.data_ptr() != out.data_ptr():
                out.copy_(result)
            graph.replay()
        self._last = bucket
        return bucket.hidden[:t]

    def prenorm(self, t: int) -> torch.Tensor:
        """The hidden states before the final norm of the step :meth:`run` last replayed, ``[t, hidden]``
        (for a model that keeps them: ``keep_prenorm_hidden`` set before the capture)."""
        if self._last is None or self._last.prenorm is None:
            raise RuntimeError("the mixed-step graphs were captured without the hidden states before the final "
                               "norm (set the model's keep_prenorm_hidden before capturing)")
        return self._last.prenorm[:t]


class _CapturingContext:
    """Stands in for the step's context while a bucket of ``n`` tokens is captured: each attention call
    stages its tensors in static buffers, ends the graph being captured, runs once eagerly on ``ctx`` (for
    its output's shape), and begins the next graph, returning the static output."""

    def __init__(self, owner: MixedStepGraphs, n: int, ctx):
        self.owner, self.n, self.ctx = owner, n, ctx
        self.graphs: list = []
        self.calls: list[_Call] = []
        self._capturing = False

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.owner.pool)
        self._capturing = True
        self.graphs.append(graph)

    def end(self) -> None:
        if self._capturing:
            self._capturing = False
            self.graphs[-1].capture_end()

    def _stage(self, tensors) -> list[torch.Tensor]:
        staged = []
        for index, t in enumerate(tensors):
            view = self.owner.static_buffer("in", index, t)[:self.n]
            view.copy_(t)
            staged.append(view)
        return staged

    def _cut(self, run: Callable[[object, int, torch.Tensor | None], torch.Tensor]) -> torch.Tensor:
        self.end()
        result = run(self.ctx, self.n, None)
        out = self.owner.static_buffer("out", 0, result)
        self.calls.append(_Call(run, out))
        self.begin()
        return out[:self.n]

    def attend(self, layer_idx: int, q, k, v, **options) -> torch.Tensor:
        sq, sk, sv = self._stage((q, k, v))
        return self._cut(lambda ctx, t, out: ctx.attend(layer_idx, sq[:t], sk[:t], sv[:t], out=out, **options))

    def attend_mla(self, layer_idx: int, q_nope, q_pe, kv_c, k_pe, positions, weights) -> torch.Tensor:
        staged = self._stage((q_nope, q_pe, kv_c, k_pe, positions))
        return self._cut(lambda ctx, t, out: ctx.attend_mla(layer_idx, *(s[:t] for s in staged), weights))
