"""The portability check's calls of the absorbed MLA verify (:mod:`tripath.ops.mla_verify`): DeepSeek's latent
geometry at 16 heads (TP 8) and 128, 4 new tokens a request, chains and draft trees, bf16 and fp8 caches and
queries, one split and several; the portable kernel everywhere and, on sm_90, the Gluon kernel's verify. :func:`tripath.portability.compile_scenarios.all_scenarios` adds :func:`rows`,
handing over its latent-cache maker."""

from __future__ import annotations

from typing import Callable

import torch

from tripath.ops.mla_verify import mla_verify
from tripath.platform import Platform, fp8_dtype

MLA_L, MLA_R = 512, 64
TOKENS = 4   # new tokens a request: a pending token and 3 drafts


def build_mla_verify(platform: Platform, *, make_cache: Callable, num_heads: int, fp8_cache: bool,
                     fp8_query: bool, tree: bool, num_splits: int, variant: str = "triton") -> None:
    kv_cache, scale = make_cache(platform, fp8_cache, block_size=64)
    batch, context_blocks = 4, 64
    q = torch.randn(batch * TOKENS, num_heads, MLA_L + MLA_R).to(torch.bfloat16)
    if fp8_query:
        q = q.to(fp8_dtype(platform))
        scale["q_scale"] = torch.tensor([0.25])
    cu = torch.arange(0, batch * TOKENS + 1, TOKENS, dtype=torch.int32)
    tree_mask = torch.tensor([1, 3, 5, 11] * batch, dtype=torch.int32) if tree else None   # two branches
    mla_verify(q, kv_cache, torch.zeros(batch, context_blocks, dtype=torch.int32),
               torch.full((batch,), context_blocks * 64, dtype=torch.int32), cu, TOKENS, kv_lora_rank=MLA_L,
               sm_scale=1.0 / (128 + 64) ** 0.5, tree_mask=tree_mask, num_splits=num_splits, variant=variant, **scale)


def rows(make_cache: Callable) -> list[tuple[str, object, bool, dict]]:
    """``(name, build, ci, kwargs)`` of each call; ``make_cache(platform, fp8, block_size=)`` is the scenario
    module's latent cache."""
    out = []
    for heads in (16, 128):
        for fp8_cache, fp8_query in ((False, False), (True, False), (True, True)):
            for tree in (False, True):
                kv = "fp8 q+kv" if fp8_query else ("kv=fp8" if fp8_cache else "bf16")
                name = f"MLA verify H={heads} {kv}{' tree' if tree else ''}"
                ci = heads == 16 and fp8_cache and not fp8_query and tree
                out.append((name, build_mla_verify, ci, dict(make_cache=make_cache, num_heads=heads,
                                                            fp8_cache=fp8_cache, fp8_query=fp8_query, tree=tree,
                                                            num_splits=4)))
    out.append(("MLA verify H=16 bf16 one split", build_mla_verify, False,
                dict(make_cache=make_cache, num_heads=16, fp8_cache=False, fp8_query=False, tree=False,
                     num_splits=1)))
    for heads, tree, splits in ((16, False, 4), (16, True, 4), (16, False, 1), (128, True, 4)):
        name = f"MLA verify gluon H={heads} bf16{' tree' if tree else ''}{' one split' if splits == 1 else ''} (sm_90)"
        out.append((name, build_mla_verify, heads == 16 and splits == 4,
                    dict(make_cache=make_cache, num_heads=heads, fp8_cache=False, fp8_query=False, tree=tree,
                         num_splits=splits, variant="gluon", targets=("sm90",))))
    return out
