"""CUDA graphs of whole steps with prompt tokens, attention included, for backends whose every forward reads
only device tensors (:attr:`~tripath.attention.backends.base.GraphSupport.ALL`: ``mixed``).

One graph per bucket of ``N`` tokens: the whole model captured on a bucket's metadata of
``R = min(max_num_seqs, N)`` prompts sharing the ``N`` tokens (block tables as wide as ``max_model_len`` needs,
nothing written); a bucket whose prompts would pass ``max_model_len`` holds no step and is not captured.
A step of ``t <= N`` tokens and ``b <= R`` requests copies its ids and positions into the first ``t`` rows and
its metadata into the bucket's (:meth:`~tripath.attention.metadata.AttentionMetadata.copy_padded_`: requests
``b ..`` become padding of no tokens and no keys, tokens ``t ..`` write nothing), then replays the one graph:
the host's work for a step is the same few copies whatever its mix, against a piecewise step's
(:mod:`tripath.engine.runner.mixed_graphs`) attention calls between graph pieces. Rows past ``t`` carry stale
values through the row-wise layers and are never read; the hidden states are the first ``t`` rows of the
graph's output. Buckets share one memory pool (the decode graphs'), captured largest first, so the backend's
buffers (the ``mixed`` workspace) are sized by the largest bucket's eager run before any capture.
"""

from __future__ import annotations

import functools

import torch

from tripath.attention import ForwardContext
from tripath.engine.runner import decode_graphs


class WholeStepGraphs:
    """Whole-step graphs of ``model`` on ``backend`` / ``caches`` for token counts ``sizes``; the same face as
    :class:`~tripath.engine.runner.mixed_graphs.MixedStepGraphs` (``bucket``, ``run``, ``prenorm``)."""

    def __init__(self, model, backend, caches: list, sizes: list[int], max_num_seqs: int, max_model_len: int,
                 max_blocks_per_seq: int, device: torch.device, pool=None):
        if not sizes or min(sizes) < 1:
            raise ValueError(f"whole-step graph sizes must be positive token counts, got {sizes}")
        self.model, self.backend, self.caches = model, backend, caches
        self.sizes = sorted(set(int(s) for s in sizes))
        self.max_num_seqs, self.max_model_len, self.max_blocks_per_seq = max_num_seqs, max_model_len, max_blocks_per_seq
        self.device = device
        self.pool = pool
        top = self.sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, object, torch.Tensor]] = {}
        self.prenorms: dict[int, torch.Tensor | None] = {}
        self._last: int | None = None   # the bucket run() replayed last

    def bucket(self, num_tokens: int) -> int | None:
        """The captured size a step of ``num_tokens`` tokens replays (the smallest that holds it), or None."""
        return next((n for n in self.sizes if n >= num_tokens and n in self.graphs), None)

    def bucket_metadata(self, n: int):
        """The metadata a bucket of ``n`` tokens is captured on: ``r = min(max_num_seqs, n)`` prompts of
        ``n / r`` tokens (the first ``n mod r`` one more), every block id 0 and every slot −1; None when they
        would pass ``max_model_len`` (no step has that many tokens)."""
        r = min(self.max_num_seqs, n)
        if -(-n // r) > self.max_model_len:
            return None
        lens = [n // r + (i < n % r) for i in range(r)]
        plan = self.backend.plan(lens, [0] * r)
        block_table = torch.zeros(r, self.max_blocks_per_seq, dtype=torch.int32, device=self.device)
        slots = torch.full((n,), -1, dtype=torch.int64, device=self.device)
        return self.backend.build_metadata(plan, block_table, slots)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (each after one eager run: kernels compile and buffers grow
        outside the capture), then replay each once so its upload is not on a request's time."""
        for n in reversed(self.sizes):
            meta = self.bucket_metadata(n)
            if meta is None:
                continue
            ctx = ForwardContext(self.backend, meta, self.caches, replay_launches=False)
            run = functools.partial(self.model, self.input_ids[:n], self.positions[:n], ctx)
            graph, hidden, self.pool = decode_graphs.capture_graph(run, self.pool, self.device)
            self.graphs[n] = (graph, meta, hidden)
            self.prenorms[n] = getattr(self.model, "prenorm_hidden", None) if \
                getattr(self.model, "keep_prenorm_hidden", False) else None   # the captured graph's tensor
        for graph, _, _ in self.graphs.values():
            graph.replay()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """The model's hidden states ``[t, hidden]`` for a step's ``input_ids [t]`` / ``positions [t]`` and its
        context ``ctx`` (whose metadata the bucket's takes), by the graph of the smallest size holding ``t``."""
        t = input_ids.shape[0]
        n = self.bucket(t)
        if n is None:
            raise ValueError(f"no whole-step graph holds {t} tokens (sizes {self.sizes})")
        graph, meta, hidden = self.graphs[n]
        meta.copy_padded_(ctx.metadata)
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        graph.replay()
        self._last = n
        return hidden[:t]

    def prenorm(self, t: int) -> torch.Tensor:
        """The hidden states before the final norm of the step :meth:`run` last replayed, ``[t, hidden]``."""
        prenorm = None if self._last is None else self.prenorms[self._last]
        if prenorm is None:
            raise RuntimeError("the whole-step graphs were captured without the hidden states before the final "
                               "norm (set the model's keep_prenorm_hidden before capturing)")
        return prenorm[:t]
