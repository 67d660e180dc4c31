"""The portability check's calls of the one-launch mixed attention (:mod:`tripath.ops.mixed_attention`): the
planner and the persistent attention kernel on a step of two decodes, an extend and a prefill, for the
layouts, cache dtypes, head sizes and score modifiers of :func:`tripath.portability.compile_scenarios.
all_scenarios`' unified rows. That function adds :func:`rows`, handing over its cache and feature makers."""

from __future__ import annotations

from typing import Callable

import torch

from tripath.ops.mixed_attention import mixed_attention
from tripath.platform import Platform, fp8_dtype

NUM_HEADS = 32


def build_mixed(platform: Platform, *, make_cache: Callable, features: Callable, head_size: int,
                dtype: torch.dtype, layout: str, fp8: bool, feature_set: str = "") -> None:
    k_cache, v_cache, scales = make_cache(head_size, fp8_dtype(platform) if fp8 else dtype, layout)
    query_lens, seq_lens = [1, 1, 7, 40], [300, 33, 64, 40]  # decode, decode, extend, prefill
    cu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(query_lens).cumsum(0)
    q = torch.randn(sum(query_lens), NUM_HEADS, head_size).to(dtype)
    block_table = torch.zeros(len(seq_lens), 32, dtype=torch.int32)
    mixed_attention(q, k_cache, v_cache, block_table, torch.tensor(seq_lens, dtype=torch.int32), cu,
                    layout=layout, return_lse=True, **scales, **features(NUM_HEADS, feature_set))


def rows(make_cache: Callable, features: Callable) -> list[tuple[str, object, bool, dict]]:
    """``(name, build, ci, kwargs)`` of each call; ``make_cache(head_size, cache_dtype, layout)`` and
    ``features(num_heads, name)`` are the scenario module's."""
    out = []
    common = {"make_cache": make_cache, "features": features}
    for d in (64, 128, 256):
        for dt, tag in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
            for layout in ("nhd", "shuffled"):
                for fp8 in (False, True):
                    ci = dt is torch.bfloat16 and d == 128 and fp8 and layout == "shuffled"
                    name = f"mixed one-launch hd{d} {tag}{' kv=fp8' if fp8 else ''} {layout}"
                    out.append((name, build_mixed, ci, dict(common, head_size=d, dtype=dt, layout=layout, fp8=fp8)))
    for feature_set in ("window+sinks", "window+softcap", "alibi"):
        out.append((f"mixed one-launch hd128 bf16 nhd {feature_set}", build_mixed, feature_set == "window+sinks",
                    dict(common, head_size=128, dtype=torch.bfloat16, layout="nhd", fp8=False,
                         feature_set=feature_set)))
    return out
