"""Argument checks shared by the MHA/GQA attention ops (:mod:`tripath.ops.attention`,
:mod:`tripath.ops.verify`): paged-cache arguments, offsets, per-op options, and the LSE output."""

from __future__ import annotations

import torch

from tripath.ops._checks import (
    FLOAT_DTYPES,
    check_block_table,
    check_cu_seqlens_values,
    check_gqa,
    check_head_size,
    check_options,
    check_out,
    check_per_head,
    check_scale,
    check_seq_lens_values,
    check_tensor,
    values_checked,
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


def check_new_tokens_out(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, block_size: int, head_size_v: int, out: torch.Tensor | None,
                         validate: bool | None) -> None:
    """For an op over requests of several new tokens each (``cu_seqlens_q``) in a paged cache: the offsets' and
    lengths' values where ``validate`` asks (each request's ``seq_len`` holds its new tokens, its blocks are
    in the cache), and ``out`` ``[T, Hq, head_size_v]`` of ``q``'s dtype."""
    if values_checked(validate, cu_seqlens_q, block_table, seq_lens):
        check_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0])
        check_seq_lens_values(seq_lens, block_table, block_size, num_cache_blocks(k_cache),
                              min_lens=cu_seqlens_q[1:] - cu_seqlens_q[:-1])
    check_out("out", out, (q.shape[0], q.shape[1], head_size_v), q.dtype, q.device)


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
