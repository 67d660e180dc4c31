"""The verify op: a few new tokens per request against the paged cache, split-KV (speculative decoding).

:func:`paged_verify` is paged decode (:func:`tripath.ops.attention.paged_decode`) for requests of up to
:data:`MAX_VERIFY_TOKENS` new tokens each: the kernel (:mod:`tripath.kernels.paged_verify`) packs a request's
tokens and a KV head's query heads into one tile, so the context is read once for all of them, and splits
long contexts over programs as paged decode does. Options as in :mod:`tripath.ops.attention`.
"""

from __future__ import annotations

import math

import torch

from tripath.kernels.paged_verify import paged_verify_kernel
from tripath.ops import _configs, reference
from tripath.ops._attention_checks import (check_attention_options, check_cu_seqlens, check_paged, lse_out,
                                           num_cache_blocks)
from tripath.ops._split_kv import merge_splits, split_buffers
from tripath.ops._checks import check_cu_seqlens_values, check_out, check_seq_lens_values, next_pow2, values_checked
from tripath.ops.kv_cache import cache_strides, shuffle_width
from tripath.platform import FP8_DTYPES, current_platform
from tripath.triton_internals import launch, use_triton

MAX_VERIFY_TOKENS = 16   # new tokens a request may bring (1 + the most drafts a speculative step verifies)
MAX_TILE_ROWS = 64       # query rows (tokens x heads of a KV head) a program packs, unless one KV head has more


def verify_tile_rows(group: int, max_query_len: int) -> int:
    """``BLOCK_M``: the rows of one program's query tile, a power of two >= 16 holding at least the GQA
    group (``group`` query heads a KV head) and, within :data:`MAX_TILE_ROWS`, all of a request's tokens."""
    return max(16, next_pow2(group), min(next_pow2(max_query_len * group), MAX_TILE_ROWS))


def paged_verify(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, max_query_len: int, *, layout: str = "nhd",
                 sm_scale: float | None = None, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, window_left: int = -1, softcap: float = 0.0,
                 alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                 num_splits: int | None = None, out: torch.Tensor | None = None, return_lse: bool = False,
                 validate: bool | None = None, tree_mask: torch.Tensor | None = None):
    """Each request's new tokens against its paged context, causally, or along a draft tree.

    Parameters
    ----------
    q : ``[T, Hq, D]``, request ``b``'s tokens at rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1``
        (``cu_seqlens_q [B + 1]`` int32), at positions ``seq_lens[b] - n_b .. seq_lens[b] - 1``, their K/V
        already in the cache; ``n_b <= max_query_len <= MAX_VERIFY_TOKENS`` (``max_query_len``: a host int).
    k_cache, v_cache, block_table ``[B, max_blocks]`` int32, seq_lens ``[B]`` int32 (context + new tokens),
    layout, k_scale, v_scale : as for :func:`~tripath.ops.attention.paged_decode`.
    num_splits : KV splits per request; ``None``: an upper bound from the batch, the GPU and the table's
        width, each request using what its length calls for.
    validate : check the offsets, ``seq_lens`` and block ids (see :func:`~tripath.ops.attention.paged_decode`).
    tree_mask : ``[T]`` int32, a draft tree (EAGLE-style verification): bit ``j`` of new token ``t``'s entry
        is set when new token ``j`` of its request is ``t`` itself or an ancestor of it (so bit ``t`` is set
        and none above it: parents come first); token ``t`` then attends to the whole context and to those
        new tokens only. None: a chain (causal). Not with ``window_left`` or ``alibi_slopes``, whose
        distances a tree's slots do not give.

    Rows past ``cu_seqlens_q[-1]`` are not written. Returns ``out [T, Hq, Dv]`` (and ``lse [T, Hq]``).
    """
    device, block_size, num_kv_heads, head_size, head_size_v = check_paged(
        q, k_cache, v_cache, block_table, seq_lens, layout, k_scale, v_scale)
    group = check_attention_options(q, num_kv_heads, head_size, head_size_v, window_left, softcap, alibi_slopes,
                                    sinks, sm_scale)
    batch = check_verify_requests(q.shape[0], block_table, seq_lens, cu_seqlens_q, max_query_len, block_size,
                                  num_cache_blocks(k_cache), validate)
    if tree_mask is not None:
        check_tree_mask(tree_mask, cu_seqlens_q, q.shape[0], device, window_left, alibi_slopes, validate)
    if num_splits is not None and not 1 <= int(num_splits) <= 256:
        raise ValueError(f"num_splits must be between 1 and 256, got {num_splits}")
    out_shape = (q.shape[0], q.shape[1], head_size_v)
    check_out("out", out, out_shape, q.dtype, device)
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_size)
    if not use_triton(device):
        return reference.unified_attention_ref(
            q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_query_len, layout=layout,
            sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale, window_left=window_left, softcap=softcap,
            alibi_slopes=alibi_slopes, sinks=sinks, out=out, return_lse=return_lse, tree_mask=tree_mask)
    platform = current_platform(device)
    block_m = verify_tile_rows(group, max_query_len)
    tokens_per_block = max(1, block_m // group)
    num_q_blocks = -(-max_query_len // tokens_per_block)
    programs = batch * num_q_blocks
    cfg = dict(_configs.decode_config(platform, head_size, k_cache.element_size()))
    max_len = block_table.shape[1] * block_size   # an upper bound from the host: no device sync
    if num_splits is None:
        num_splits = _configs.verify_num_splits(platform, programs, num_kv_heads, max_len, cfg["BLOCK_N"])
        fill_splits, min_split_tiles = _configs.device_split_bounds(platform, programs, num_kv_heads, False)
    else:
        fill_splits, min_split_tiles = int(num_splits), 1
    num_splits = int(num_splits)
    out = out if out is not None else torch.empty(out_shape, dtype=q.dtype, device=device)
    lse = lse_out(q.shape[0], q.shape[1], device, return_lse)
    block_dv = next_pow2(head_size_v)
    num_tokens = q.shape[0]
    part_out, part_lse, splits_used = split_buffers(num_tokens, q.shape[1], num_splits, block_dv, lse, seq_lens,
                                                    device, fill_used=True)   # padding rows: nothing to merge
    q = q if q.stride(2) == 1 else q.contiguous()
    kv_fp8 = k_cache.dtype in FP8_DTYPES
    dummy = seq_lens
    launch(
        paged_verify_kernel, (programs, num_kv_heads, num_splits),
        q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, tree_mask if tree_mask is not None else dummy,
        out, lse, part_out, part_lse,
        alibi_slopes if alibi_slopes is not None else dummy, sinks if sinks is not None else dummy,
        k_scale if kv_fp8 else dummy, v_scale if kv_fp8 else dummy,
        float(sm_scale), float(softcap), int(window_left),
        q.stride(0), q.stride(1), block_table.stride(0), *cache_strides(k_cache, v_cache),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        q.shape[1], group, head_size, head_size_v, block_size,
        num_q_blocks, num_splits=num_splits, fill_splits=fill_splits, min_split_tiles=min_split_tiles,
        splits_used_ptr=splits_used, SPLIT=num_splits > 1, BLOCK_M=block_m, BLOCK_DK=next_pow2(head_size),
        BLOCK_DV=block_dv, SHUFFLED=layout == "shuffled", X=shuffle_width(k_cache.dtype), KV_FP8=kv_fp8,
        HAS_WINDOW=window_left >= 0, HAS_SOFTCAP=softcap > 0, HAS_ALIBI=alibi_slopes is not None,
        HAS_SINKS=sinks is not None, RETURN_LSE=return_lse, TREE=tree_mask is not None, **cfg,
    )
    merge_splits(part_out, part_lse, splits_used, out, lse, sinks, num_splits, block_dv, return_lse)
    return (out, lse) if return_lse else out


def check_verify_requests(num_tokens: int, block_table: torch.Tensor, seq_lens: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, max_query_len: int, block_size: int, num_blocks: int,
                          validate: bool | None) -> int:
    """The checks a verify's requests share (``cu_seqlens_q`` over ``num_tokens`` query rows, one
    ``seq_lens`` entry and block-table row a request, ``max_query_len`` a host int in ``[1,
    MAX_VERIFY_TOKENS]`` bounding every request's new tokens, the lengths within the table); the batch."""
    device = block_table.device
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, device)
    batch = cu_seqlens_q.shape[0] - 1
    if seq_lens.shape[0] != batch or block_table.shape[0] < batch:
        raise ValueError(f"seq_lens ({seq_lens.shape[0]}) and block_table ({block_table.shape[0]} rows) must "
                         f"have one entry per request of cu_seqlens_q ({batch})")
    if not isinstance(max_query_len, int) or not 1 <= max_query_len <= MAX_VERIFY_TOKENS:
        raise ValueError(f"max_query_len must be an int in [1, {MAX_VERIFY_TOKENS}], got {max_query_len!r}")
    if values_checked(validate, cu_seqlens_q, block_table, seq_lens):
        check_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, num_tokens)
        lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        if batch and int(lens.max()) > max_query_len:
            raise ValueError(f"a request brings {int(lens.max())} new tokens, more than max_query_len "
                             f"({max_query_len})")
        check_seq_lens_values(seq_lens, block_table, block_size, num_blocks, min_lens=lens)
    return batch


def check_tree_mask(tree_mask: torch.Tensor, cu_seqlens_q: torch.Tensor, num_tokens: int, device,
                    window_left: int, alibi_slopes, validate: bool | None) -> None:
    """``tree_mask``'s shape and dtype and, where ``validate`` asks (see :func:`~tripath.ops._checks.values_checked`),
    its bits: each token sets its own bit and none above it."""
    if not isinstance(tree_mask, torch.Tensor) or tree_mask.dtype != torch.int32 or tree_mask.dim() != 1 or \
            tree_mask.shape[0] < num_tokens or tree_mask.device != device:
        raise ValueError(f"tree_mask must be a [T] int32 tensor on {device} (one entry per new token), got "
                         f"{getattr(tree_mask, 'dtype', type(tree_mask).__name__)} of shape "
                         f"{tuple(getattr(tree_mask, 'shape', ()))}")
    if window_left >= 0 or alibi_slopes is not None:
        raise ValueError("tree_mask does not combine with window_left or alibi_slopes: a tree's slots are not "
                         "its tokens' positions")
    if values_checked(validate, tree_mask, cu_seqlens_q):
        cu, masks = cu_seqlens_q.tolist(), tree_mask.tolist()
        for b in range(len(cu) - 1):
            for t in range(cu[b + 1] - cu[b]):
                bits = masks[cu[b] + t]
                if not bits >> t & 1 or bits >> (t + 1):
                    raise ValueError(f"tree_mask[{cu[b] + t}] (token {t} of request {b}) must set its own bit {t} "
                                     f"and none above it (parents come first), got {bits:#x}")

