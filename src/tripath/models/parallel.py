"""Tensor parallelism: each rank's share of every layer, and the collectives between the ranks.

A model built with ``ParallelState(rank=r, world_size=W, group=g)`` holds rank ``r``'s shard of each weight:

- **column-parallel** linear ``y_r = x · W_rᵀ (+ b_r)``: the rank's rows of the output (q/k/v, gate/up, MLA
  ``q_b_proj``/``kv_b_proj``); no communication;
- **row-parallel** linear ``y = Σ_r x_r · W_rᵀ + b``: the rank's columns of the input (``o_proj``,
  ``down_proj``); one all-reduce, the bias added once after it;
- **attention**: query heads split evenly (rank ``r``: heads ``[r·Hq/W, (r+1)·Hq/W)``); KV heads split the same
  way when ``Hkv >= W``, else replicated (rank ``r`` keeps KV head ``r·Hkv // W``, the one its query heads
  read); MLA: query heads split, the latent projections replicated, so each rank caches the full latent;
- **MoE**: routed experts split (rank ``r``: experts ``[r·E/W, (r+1)·E/W)``), the router replicated, shared
  experts split as an MLP; the routed and shared partial sums share one all-reduce;
- **vocabulary-parallel** embedding and LM head: rank ``r`` holds vocabulary rows ``[r·s, min((r+1)·s, V))``
  with ``s = ceil(V / W)`` (zero padding rows at the end); the embedding looks up its own rows (0 for the
  others) and all-reduces, the LM head's per-rank logits ``[N, s]`` are all-gathered and cut to ``[N, V]``;
  a draw straight from the LM head (:func:`gather_draws`) gathers each rank's draw over its rows instead,
  ``[N, 4]`` values (token, key, logit, LSE), and keeps the largest key.

World size 1 builds exactly the plain layers (``nn.Linear``/``nn.Embedding`` semantics, no shard records) and
never communicates. :func:`model_shards` lists where each sharded parameter sits in its full tensor
(:class:`Shard`), which the loader uses to read only the rank's slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tripath.ops.linear import linear
from tripath.ops.lm_head_sample import SampleDraw, merge_packed


@dataclass(frozen=True)
class Shard:
    """A parameter holds ``full[start:stop]`` along ``dim`` of the full tensor (``full`` long there); a local
    size larger than ``stop - start`` is zero padding."""

    dim: int
    start: int
    stop: int
    full: int

    def full_shape(self, local_shape) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = self.full
        return tuple(shape)

    def index(self, ndim: int) -> tuple[slice, ...]:
        """The slice of the full tensor (for ``tensor[...]`` or safetensors' ``get_slice(name)[...]``)."""
        return tuple(slice(self.start, self.stop) if d == self.dim else slice(None) for d in range(ndim))

    def copy_into(self, target: torch.Tensor, values: torch.Tensor) -> None:
        """Write the rank's ``values`` (already sliced) into ``target``, zeroing its padding."""
        count = self.stop - self.start
        target.narrow(self.dim, 0, count).copy_(values)
        if target.shape[self.dim] > count:
            target.narrow(self.dim, count, target.shape[self.dim] - count).zero_()


@dataclass(frozen=True)
class ParallelState:
    """Rank ``rank`` of ``world_size`` tensor-parallel ranks communicating over ``group`` (a
    ``torch.distributed`` process group; None: the default group)."""

    rank: int = 0
    world_size: int = 1
    group: Any = None

    def __post_init__(self):
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size (tensor_parallel_size) must be an int >= 1, got {self.world_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be an int in 0..{self.world_size - 1}, got {self.rank!r}")

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def split(self, size: int, what: str) -> tuple[int, int]:
        """``(start, stop)`` of this rank's equal share of ``size`` items (``what`` names them in the error)."""
        if size % self.world_size:
            raise ValueError(f"tensor_parallel_size={self.world_size} must divide {what} ({size})")
        share = size // self.world_size
        return self.rank * share, (self.rank + 1) * share

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place."""
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' ``x`` concatenated along ``dim`` in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE = ParallelState()


@dataclass(frozen=True)
class HeadSplit:
    """A rank's attention heads: ``num_heads`` query heads from ``first_head``, ``num_kv_heads`` KV heads from
    ``first_kv_head`` (of ``total_kv_heads``)."""

    num_heads: int
    first_head: int
    num_kv_heads: int
    first_kv_head: int
    sharded: bool

    @classmethod
    def of(cls, parallel: ParallelState, num_heads: int, num_kv_heads: int) -> "HeadSplit":
        if not parallel.is_parallel:
            return cls(num_heads, 0, num_kv_heads, 0, False)
        world = parallel.world_size
        first, stop = parallel.split(num_heads, "num_attention_heads")
        if num_kv_heads >= world:
            kv_first, kv_stop = parallel.split(num_kv_heads, "num_key_value_heads")
            return cls(stop - first, first, kv_stop - kv_first, kv_first, True)
        if world % num_kv_heads:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) is below tensor_parallel_size={world}, so KV "
                             "heads are replicated; that needs tensor_parallel_size to be a multiple of it")
        return cls(stop - first, first, 1, parallel.rank * num_kv_heads // world, True)

    def q_rows(self, per_head: int) -> tuple[int, int] | None:
        """The rank's output rows of a head-major ``[heads · per_head, in]`` query projection."""
        if not self.sharded:
            return None
        return self.first_head * per_head, (self.first_head + self.num_heads) * per_head

    def kv_rows(self, per_head: int) -> tuple[int, int] | None:
        if not self.sharded:
            return None
        return self.first_kv_head * per_head, (self.first_kv_head + self.num_kv_heads) * per_head


def equal_rows(parallel: ParallelState, size: int, what: str) -> tuple[int, int] | None:
    """This rank's share of ``size`` output rows (None when not parallel)."""
    return parallel.split(size, what) if parallel.is_parallel else None


def vocab_rows(parallel: ParallelState, vocab_size: int) -> tuple[int, int, int] | None:
    """``(start, stop, local_size)`` of this rank's vocabulary rows (None when not parallel)."""
    if not parallel.is_parallel:
        return None
    share = -(-vocab_size // parallel.world_size)
    start = min(parallel.rank * share, vocab_size)
    return start, min(start + share, vocab_size), share


class ColumnParallelLinear(nn.Linear):
    """Rows ``rows = (start, stop)`` of an ``[out_features, in_features]`` linear (None: all of them), in a
    parameter of ``size`` rows (default ``stop - start``; more is zero padding)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype=None,
                 rows: tuple[int, int] | None = None, size: int | None = None):
        local = out_features if rows is None else (size or rows[1] - rows[0])
        super().__init__(in_features, local, bias=bias, dtype=dtype)
        self.tp_shards = {} if rows is None else {
            name: Shard(0, rows[0], rows[1], out_features) for name in ("weight", "bias")[:1 + bias]}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """The rank's share of the input columns of an ``[out_features, in_features]`` linear; the partial
    products are summed over the ranks (all-reduce) unless ``reduce`` is False (the caller reduces, and the
    bias is then added by rank 0 only)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype=None,
                 parallel: ParallelState = SINGLE, reduce: bool = True, what: str = "in_features"):
        cols = equal_rows(parallel, in_features, what)
        super().__init__(in_features if cols is None else cols[1] - cols[0], out_features, bias=bias, dtype=dtype)
        self.parallel, self.reduce = parallel, reduce
        self.tp_shards = {} if cols is None else {"weight": Shard(1, cols[0], cols[1], in_features)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp_shards:
            return linear(x, self.weight, self.bias)
        y = linear(x, self.weight)
        if self.reduce:
            self.parallel.all_reduce(y)
        elif self.parallel.rank != 0:
            return y
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """``nn.Embedding(vocab_size, hidden)``, or, in parallel, the rank's vocabulary rows (see the module doc):
    tokens outside them embed to 0 and the ranks' embeddings are summed."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype=None, parallel: ParallelState = SINGLE):
        rows = vocab_rows(parallel, vocab_size)
        super().__init__(vocab_size if rows is None else rows[2], hidden_size, dtype=dtype)
        self.parallel = parallel
        self.tp_shards = {} if rows is None else {"weight": Shard(0, rows[0], rows[1], vocab_size)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp_shards:
            return super().forward(input_ids)
        shard = self.tp_shards["weight"]
        local = input_ids - shard.start
        outside = (local < 0) | (local >= shard.stop - shard.start)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.parallel.all_reduce(out.masked_fill(outside[:, None], 0))


def lm_head(hidden_size: int, vocab_size: int, *, dtype, parallel: ParallelState) -> ColumnParallelLinear:
    """The LM head ``[vocab, hidden]``: in parallel the rank's vocabulary rows (as the embedding's)."""
    rows = vocab_rows(parallel, vocab_size)
    return ColumnParallelLinear(hidden_size, vocab_size, bias=False, dtype=dtype,
                                rows=None if rows is None else rows[:2], size=None if rows is None else rows[2])


def gather_logits(logits: torch.Tensor, parallel: ParallelState, vocab_size: int) -> torch.Tensor:
    """``[N, V]`` from each rank's ``[N, ceil(V / W)]`` logits (identity when not parallel)."""
    if not parallel.is_parallel:
        return logits
    return parallel.all_gather(logits, dim=-1)[:, :vocab_size]


def gather_draws(draw: SampleDraw, parallel: ParallelState) -> SampleDraw:
    """The draw over the whole vocabulary from each rank's ``draw`` over its rows (identity when not parallel):
    an all-gather of ``[N, 4]`` values, merged by :func:`tripath.ops.lm_head_sample.merge_packed`."""
    if not parallel.is_parallel:
        return draw
    return merge_packed(parallel.all_gather(draw.packed()[None], dim=0))


def model_shards(model: nn.Module) -> dict[str, Shard]:
    """``{parameter name: Shard}`` of every sharded parameter (empty for a world-size-1 model)."""
    shards = {}
    for prefix, module in model.named_modules():
        for name, shard in getattr(module, "tp_shards", {}).items():
            shards[f"{prefix}.{name}" if prefix else name] = shard
    return shards
