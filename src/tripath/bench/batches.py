"""Synthetic mixed steps for tests and benchmarks: random cached contexts in a paged cache with a random
block order (block 0 reserved), and the step's new tokens in plan order."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from tripath.attention.planner import BatchPlan, plan_batch
from tripath.attention.spec import AttentionSpec, KVCache
from tripath.ops.kv_cache import write_kv_cache, write_kv_cache_ref


@dataclass
class Step:
    """A step ready for ``backend.build_metadata(plan, block_table, slot_mapping)`` and ``forward``.

    ``q [T, Hq, D]``, ``k [T, Hkv, D]``, ``v [T, Hkv, Dv]`` are in plan order; ``cache`` holds every
    request's context (use :meth:`fresh_cache` per backend, since forward writes the new tokens)."""

    spec: AttentionSpec
    plan: BatchPlan
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cache: KVCache
    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None

    def fresh_cache(self) -> KVCache:
        c = copy.copy(self.cache)
        c.k_cache, c.v_cache = self.cache.k_cache.clone(), self.cache.v_cache.clone()
        return c


def make_step(spec: AttentionSpec, requests: list[tuple[int, int]], backend, *, device="cpu",
              seed: int = 0, fill_context: bool = True, scale: float = 1.0) -> Step:
    """``requests``: ``(context_len, query_len)`` per request, in the caller's order (the plan reorders).

    The cache is allocated by ``backend`` (so its dtype and layout are the backend's); fp8 caches get
    scales != 1. With ``fill_context=False`` the context is left zero (fast set-up for big benchmarks).
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ctx_lens = [c for c, _ in requests]
    q_lens = [q for _, q in requests]
    plan = plan_batch(q_lens, ctx_lens, decode_threshold=spec.decode_threshold,
                      chunk_budget=spec.extend_chunk_budget, block_size=spec.block_size)
    bs = spec.block_size
    need = [-(-(c + q) // bs) for c, q in zip(plan.context_lens, plan.query_lens)]
    num_blocks = sum(need) + 1
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(need), max(need + [1]), dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        at += n
    block_table = table.to(device)
    cache = backend.allocate_cache(num_blocks, device)
    if spec.kv_cache_dtype == "fp8":
        cache.k_scale.fill_(0.05 * scale)
        cache.v_scale.fill_(0.04 * scale)

    def positions(lo, hi):
        return [torch.arange(lo[i], hi[i]) for i in range(len(lo))]

    def slots(pos_list):
        out = [table[i, p // bs].long() * bs + p % bs for i, p in enumerate(pos_list)]
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)

    hkv, d, dv = spec.num_kv_heads, spec.head_size, spec.v_size
    dtype = spec.dtype
    if fill_context and sum(plan.context_lens):
        n = sum(plan.context_lens)
        ctx_k = (torch.randn(n, hkv, d, generator=gen) * scale).to(dtype).to(device)
        ctx_v = (torch.randn(n, hkv, dv, generator=gen) * scale).to(dtype).to(device)
        ctx_slots = slots(positions([0] * len(need), plan.context_lens)).to(device)
        writer = write_kv_cache if cache.k_cache.is_cuda else write_kv_cache_ref  # interpreter is slow
        writer(ctx_k, ctx_v, cache.k_cache, cache.v_cache, ctx_slots, layout=cache.layout,
                       k_scale=cache.k_scale if spec.kv_cache_dtype == "fp8" else None,
                       v_scale=cache.v_scale if spec.kv_cache_dtype == "fp8" else None)
    t = plan.num_tokens
    slot_mapping = slots(positions(plan.context_lens, plan.seq_lens)).to(device)
    q = (torch.randn(t, spec.num_heads, d, generator=gen) * scale).to(dtype).to(device)
    k = (torch.randn(t, hkv, d, generator=gen) * scale).to(dtype).to(device)
    v = (torch.randn(t, hkv, dv, generator=gen) * scale).to(dtype).to(device)
    alibi = (torch.rand(spec.num_heads, generator=gen) * 0.5).to(device) if spec.use_alibi else None
    sinks = torch.randn(spec.num_heads, generator=gen).to(device) if spec.use_sinks else None
    return Step(spec, plan, block_table, slot_mapping, q, k, v, cache, alibi, sinks)
