"""CUDA graphs of decode-only steps: the whole model's forward captured once per padded batch size.

A decode-only step of ``n`` requests replays the graph of the smallest captured size ``b >= n``: its ids
and positions are copied into the graphs' static ``input_ids`` / ``positions`` rows, its metadata into the
graph's captured metadata (:meth:`AttentionMetadata.copy_`), and the padding rows ``n .. b - 1`` keep the
capture's inputs (one query token at position 1 reading block 0, slot −1: nothing is written). Every graph
shares one memory pool (the largest is captured first) and is replayed once at capture, so the upload of
its work to the device is not on a request's time. The backend must declare
:attr:`~tripath.attention.backends.base.GraphSupport.DECODE` or ``ALL`` (its decode forward reads only device tensors).
"""

from __future__ import annotations

import functools

import torch

from tripath.attention import ForwardContext
from tripath.engine.runner.step_inputs import StepInputs
from tripath.ops.attention import tables_span_max_len


def capture_graph(run, pool, device: torch.device):
    """``(graph, static output, pool)`` of ``run`` captured after one eager call (kernels compile outside).
    Both run with :func:`~tripath.ops.attention.tables_span_max_len`: the captured block table is as wide
    as the longest context served, and paged decode picks its tiles for any length."""
    with tables_span_max_len():
        run()
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = run()
    torch.cuda.synchronize(device)
    return graph, hidden, graph.pool()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DecodeGraphs:
    """The decode graphs of one engine (``sizes``: the padded batch sizes captured). ``query_len``: the query
    tokens of every captured request (1; speculative decoding's verify graphs capture ``1 + k``,
    :mod:`tripath.engine.runner.verify_graphs`), so a graph of size ``bs`` takes ``bs * query_len`` token rows."""

    def __init__(self, model, backend, caches: list, sizes: list[int], max_blocks_per_seq: int,
                 device: torch.device, query_len: int = 1, prepare_metadata=None):
        self.model, self.backend, self.caches = model, backend, caches
        self.sizes = sorted(sizes)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self.query_len = query_len
        self.prepare_metadata = prepare_metadata   # (meta, bs) -> None: completes a size's captured metadata
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, object, torch.Tensor]] = {}
        # each graph's hidden states before the final norm (where the model keeps them: keep_prenorm_hidden)
        self.prenorm: dict[int, torch.Tensor | None] = {}
        self.input_ids = torch.zeros(max(sizes) * query_len, dtype=torch.int64, device=device)
        self.positions = torch.ones(max(sizes) * query_len, dtype=torch.int64, device=device)
        self.pool = None

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Capture every size (largest first, in one pool: ``pool``, or a new one), then replay each once on
        its padding metadata."""
        q = self.query_len
        for bs in sorted(self.sizes, reverse=True):
            plan = self.backend.plan([q] * bs, [1] * bs)
            block_table = torch.zeros(bs, self.max_blocks_per_seq, dtype=torch.int32, device=self.device)
            slots = torch.full((bs * q,), -1, dtype=torch.int64, device=self.device)
            meta = self.backend.build_metadata(plan, block_table, slots)
            if self.prepare_metadata is not None:
                self.prepare_metadata(meta, bs)
            ctx = ForwardContext(self.backend, meta, self.caches)
            run = functools.partial(self.model, self.input_ids[:bs * q], self.positions[:bs * q], ctx)
            graph, hidden, pool = capture_graph(run, pool, self.device)
            self.graphs[bs] = (graph, meta, hidden)
            self.prenorm[bs] = getattr(self.model, "prenorm_hidden", None) if \
                getattr(self.model, "keep_prenorm_hidden", False) else None   # the captured graph's tensor
        self.pool = pool
        for graph, _, _ in self.graphs.values():  # a graph's first launch uploads it: not on a request's time
            graph.replay()
        _synchronize(self.device)

    def batch_size(self, num_requests: int) -> int | None:
        """The captured size a decode-only step of ``num_requests`` replays, or None (larger than all)."""
        return next((b for b in self.sizes if b >= num_requests and b in self.graphs), None)

    def load(self, bs: int, inputs: StepInputs):
        """``(graph, meta, hidden)`` of size ``bs`` with its captured metadata and input rows holding the
        step's."""
        graph, meta, hidden = self.graphs[bs]
        meta.copy_(inputs.metadata(self.backend))
        self.input_ids[:bs].copy_(inputs.input_ids)
        self.positions[:bs].copy_(inputs.positions)
        return graph, meta, hidden

    def replay(self, bs: int, inputs: StepInputs) -> torch.Tensor:
        graph, _, hidden = self.load(bs, inputs)
        graph.replay()
        return hidden
