"""Argument checks shared by the MHA/GQA attention ops (:mod:`tripath.ops.attention`,
:mod:`tripath.ops.verify`): paged-cache arguments, offsets, per-op options, and the LSE output."""

from __future__ import annotations

import torch

from tripath.ops._checks import (
    FLOAT_DTYPES,
    check_block_table,
    check_gqa,
    check_head_size,
    check_options,
    check_per_head,
    check_scale,
    check_tensor,
)
from tripath.ops.kv_cache import cache_geometry
from tripath.platform import FP8_DTYPES


def check_cu_seqlens(name: str, cu: torch.Tensor, device: torch.device) -> None:
    check_tensor(name, cu, ndim=1, dtypes=(torch.int32,), device=device)
    if cu.shape[0] < 1:
        raise ValueError(f"{name} must hold num_requests + 1 offsets, got an empty tensor")
    if cu.device.type == "cpu" and cu.shape[0] > 1 and bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing, got {cu.tolist()}")


def num_cache_blocks(k_cache: torch.Tensor) -> int:
    return k_cache.shape[0]


def lse_out(num_tokens: int, num_heads: int, device, return_lse: bool) -> torch.Tensor:
    if return_lse:
        return torch.empty(num_tokens, num_heads, dtype=torch.float32, device=device)
    return torch.empty(1, 1, dtype=torch.float32, device=device)


def check_attention_options(q, num_kv_heads, head_size, head_size_v, window_left, softcap, alibi_slopes, sinks,
                   sm_scale=None):
    check_head_size("head_size (q.shape[-1])", head_size)
    check_head_size("value head size", head_size_v)
    group = check_gqa(q.shape[1], num_kv_heads)
    check_options(window_left, softcap, sm_scale)
    check_per_head("alibi_slopes", alibi_slopes, q.shape[1], q.device)
    check_per_head("sinks", sinks, q.shape[1], q.device)
    return group


def check_paged(q, k_cache, v_cache, block_table, seq_lens, layout, k_scale, v_scale):
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    device = q.device
    check_tensor("k_cache", k_cache, device=device)
    _, block_size, num_kv_heads, head_size = cache_geometry(k_cache, v_cache, layout)
    if head_size != q.shape[2]:
        raise ValueError(f"q's head size {q.shape[2]} does not match the cache's {head_size}")
    if k_cache.dtype not in FP8_DTYPES and k_cache.dtype != q.dtype:
        raise TypeError(f"k_cache dtype {k_cache.dtype} must equal q's ({q.dtype}) or be fp8 (e4m3)")
    check_block_table(block_table, device)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=device)
    check_scale("k_scale", k_scale, k_cache.dtype, device)
    check_scale("v_scale", v_scale, k_cache.dtype, device)
    head_size_v = v_cache.shape[3]
    return device, block_size, num_kv_heads, head_size, head_size_v
