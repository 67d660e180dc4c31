"""Synthetic mixed steps for tests and benchmarks: random cached contexts in a paged cache with a random
block order (block 0 reserved), and the step's new tokens in plan order."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from tripath.attention.planner import BatchPlan, plan_batch
from tripath.attention.spec import AttentionSpec, KVCache, MLACache, MLALayerWeights, RotaryTables
from tripath.ops.kv_cache import write_kv_cache, write_kv_cache_ref
from tripath.ops.rotary import rope_cos_sin
from tripath.platform import FP8_DTYPES


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


@dataclass
class MLAStep:
    """An MLA step for ``backend.forward_mla``: inputs in plan order (``q_nope``/``q_pe`` views of one
    ``[T, H, P + R]`` projection, ``kv_c``/``k_pe`` of one ``[T, L + R]``, as models give them)."""

    plan: BatchPlan
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    weights: MLALayerWeights
    cache: MLACache

    def fresh_cache(self) -> MLACache:
        return MLACache(self.cache.kv_cache.clone(), self.cache.kv_scale.clone())


def make_mla_step(spec: AttentionSpec, requests: list[tuple[int, int]], backend, *, device="cpu", seed: int = 0,
                  rope: str | None = "gptj", q_scale: torch.Tensor | None = None) -> MLAStep:
    """Random latent context in a paged cache allocated by ``backend`` (random block order, block 0
    reserved), the step's new tokens with positions ``context_len + i``, random ``W_UK``/``W_UV`` and RoPE
    tables (``rope``: ``"gptj"``, ``"neox"`` or None for NoPE). fp8 caches get the scale 0.05."""
    mla, gen = spec.mla, torch.Generator().manual_seed(seed)
    plan = plan_batch([q for _, q in requests], [c for c, _ in requests], decode_threshold=spec.decode_threshold,
                      chunk_budget=spec.extend_chunk_budget, block_size=spec.block_size)
    bs = spec.block_size
    need = [-(-s // bs) for s in plan.seq_lens]
    num_blocks = sum(need) + 1
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(need), max(need), dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        at += n
    cache = backend.allocate_cache(num_blocks, device)
    fp8 = cache.kv_cache.dtype in FP8_DTYPES
    if fp8:
        cache.kv_scale.fill_(0.05)
    ctx_rows = torch.randn(num_blocks * bs, mla.cache_width, generator=gen) / (0.05 if fp8 else 1.0)
    cache.kv_cache.view(-1, mla.cache_width).copy_(ctx_rows.to(cache.kv_cache.dtype).to(device))

    def slots(lo, hi):
        return torch.cat([table[i, torch.arange(lo[i], hi[i]) // bs].long() * bs + torch.arange(lo[i], hi[i]) % bs
                          for i in range(len(lo))])

    t, h = plan.num_tokens, spec.num_heads
    positions = torch.cat([torch.arange(c, s) for c, s in zip(plan.context_lens, plan.seq_lens)])

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(spec.dtype).to(device)

    rotary = None
    if rope is not None:
        cos, sin = rope_cos_sin(max(plan.seq_lens) + 1, mla.qk_rope_head_dim, base=1000.0, device=device)
        rotary = RotaryTables(cos, sin, is_neox=rope == "neox")
    weights = MLALayerWeights(w_uk=rand(h, mla.qk_nope_head_dim, mla.kv_lora_rank, scale=mla.kv_lora_rank ** -0.5),
                              w_uv=rand(h, mla.kv_lora_rank, mla.v_head_dim, scale=mla.kv_lora_rank ** -0.5),
                              rotary=rotary, q_scale=q_scale)
    q = rand(t, h, mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    kv = rand(t, mla.cache_width)
    return MLAStep(plan, table.to(device), slots(plan.context_lens, plan.seq_lens).to(device), positions.to(device),
                   q[..., :mla.qk_nope_head_dim], q[..., mla.qk_nope_head_dim:], kv[:, :mla.kv_lora_rank],
                   kv[:, mla.kv_lora_rank:], weights, cache)
