"""Launchers of the warp-specialised Gluon MLA decode kernels (``mla_decode(..., variant="gluon")``, sm_90, and
``variant="auto"`` wherever :func:`gluon_unsupported` finds nothing against it), and of the many-heads kernel
as a verify (``mla_verify(..., variant="gluon")``, and ``"auto"`` where :func:`gluon_verify_unsupported` finds
nothing against it)."""

from __future__ import annotations

import torch

from tripath import _env
from tripath.ops._descriptors import gluon_descriptor
from tripath.ops._varlen_sm90 import gluon_available
from tripath.platform import Platform

BLOCK_N = 32  # cache rows per tile (a stage: 32 x 576 x 2 B = 36 KiB)
NUM_STAGES = 5  # 5 x 36 KiB + the query's second latent half (32 KiB) + p: 221 KiB of the 227; the ring depth
# sets much of the speed (fewer stages, or 4 with the whole query in smem, were slower)
P_STAGES = 2  # p buffers: the score warpgroup writes tile i + 1's while the value warpgroups read tile i's
RESCALE_SLACK = 8.0  # log2 units a row's maximum may grow before the value warpgroups rescale (p ≤ 2^8 in bf16)
MAXNREG = 168  # 3 warpgroups x 128 threads x 168 = the register file
# Few heads (kernels/mla_decode_few_heads_sm90.py): transposed products with 64 cache rows as the wgmma rows,
# a two-stage ring of 72 KiB tiles and a loader warp (about 155 / 165 / 185 KiB of shared memory at 8 / 16 / 32
# heads; faster than the packed Triton kernel at 16 heads).
FEW_HEADS = (8, 16, 32)
FEW_BLOCK_N = 64  # cache rows per tile = the M of the transposed wgmma (cache rows as its rows)
FEW_PAGE_SIZES = (16, 32)  # smaller blocks: a tile gathers 64 / block_size pages, one TMA copy each
FEW_STAGES = 2  # two 72 KiB tiles beside the query: within the 227 KiB of shared memory
VERIFY_MIN_SPLIT_TILES = 4  # a verify's request splits its rows no finer than 4 tiles a split (as the decode's
# host choice does with the table's width; a verify decides on the device, from its own length), in 2 splits at
# least where the launch has several (every program then has the decode's epilogue: under Triton 3.9 a runtime
# choice between writing out and partials spilled 264 B)


def is_few_heads(num_heads: int) -> bool:
    return num_heads in FEW_HEADS


def block_n(num_heads: int) -> int:
    """Cache rows per tile of the kernel that serves ``num_heads``."""
    return FEW_BLOCK_N if is_few_heads(num_heads) else BLOCK_N


def gluon_unsupported(platform: Platform, q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int) -> str | None:
    """Why ``variant="gluon"`` cannot run this call (None when it can)."""
    reason = _target_unsupported(platform, q, kv_cache, kv_lora_rank)
    if reason is not None:
        return reason
    num_heads = q.shape[1]
    if num_heads % 64 and not is_few_heads(num_heads):
        return f"needs 8, 16, 32 or a multiple of 64 heads, got {num_heads}"
    block_size = kv_cache.shape[1]
    if is_few_heads(num_heads) and not (block_size % FEW_BLOCK_N == 0 or block_size in FEW_PAGE_SIZES):
        return f"needs a block size of 16, 32 or a multiple of {FEW_BLOCK_N} for {num_heads} heads, got {block_size}"
    if not is_few_heads(num_heads) and block_size % BLOCK_N:
        return f"needs a block size that is a multiple of {BLOCK_N}, got {block_size}"
    return _layout_unsupported(q, kv_cache)


def _target_unsupported(platform: Platform, q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int) -> str | None:
    """What both Gluon kernels need of the GPU, the dtypes and the latent geometry."""
    width = q.shape[2]
    if not platform.is_hopper:
        return f"needs sm_90, got {platform.backend} {platform.arch}"
    if _env.gluon_disabled():
        return "is off: TRIPATH_DISABLE_GLUON is set"
    if not gluon_available():
        return "needs triton.experimental.gluon with its Hopper module (Triton 3.6 or newer)"
    if q.dtype not in (torch.float16, torch.bfloat16) or kv_cache.dtype != q.dtype:
        return f"needs a 16-bit query and cache of one dtype, got {q.dtype} / {kv_cache.dtype}"
    if kv_lora_rank != 512 or width - kv_lora_rank != 64:
        return f"needs kv_lora_rank 512 and a 64-wide rotary part, got {kv_lora_rank} + {width - kv_lora_rank}"
    return None


def _layout_unsupported(q: torch.Tensor, kv_cache: torch.Tensor) -> str | None:
    """What both Gluon kernels need of the layouts: a contiguous query and cache."""
    num_heads, width = q.shape[1], q.shape[2]
    if q.stride(2) != 1 or q.stride(1) != width or q.stride(0) != num_heads * width:
        return "needs a contiguous query"
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != width or kv_cache.stride(0) != kv_cache.shape[1] * width:
        return "needs a contiguous cache"
    return None


def _descriptor(t2d: torch.Tensor, block: list[int]):
    return gluon_descriptor(t2d, list(t2d.shape), list(t2d.stride()), block)


def launch_mla_decode_sm90(launch, q, kv_cache, block_table, seq_lens, out, lse, part_out, part_lse, sm_scale,
                           num_splits: int, return_lse: bool, kv_lora_rank: int) -> None:
    batch, num_heads, width = q.shape
    half = kv_lora_rank // 2
    q2 = q.reshape(batch * num_heads, width)
    c2 = kv_cache.reshape(kv_cache.shape[0] * kv_cache.shape[1], width)
    if is_few_heads(num_heads):
        from tripath.kernels.mla_decode_few_heads_sm90 import mla_decode_few_heads_sm90_kernel
        page_rows = min(kv_cache.shape[1], FEW_BLOCK_N)
        launch(
            mla_decode_few_heads_sm90_kernel, (batch, num_splits),
            _descriptor(q2, [num_heads, half]), _descriptor(q2, [num_heads, width - kv_lora_rank]),
            _descriptor(c2, [page_rows, half]), _descriptor(c2, [page_rows, width - kv_lora_rank]),
            block_table, seq_lens, out, lse, part_out, part_lse, float(sm_scale) * 1.4426950408889634,
            block_table.stride(0), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), num_heads,
            kv_cache.shape[1],
            BLOCK_N=FEW_BLOCK_N, NUM_STAGES=FEW_STAGES, num_splits=num_splits, SPLIT=num_splits > 1, RETURN_LSE=bool(return_lse),
            num_warps=4,
        )
        return
    q_desc = _descriptor(q2, [64, half])
    # One split writing a contiguous, 16-byte aligned out [B, H, L] of q's dtype: each value warpgroup stores
    # its output tile by TMA; otherwise by pointer stores.
    tma_out = num_splits == 1 and out.is_contiguous() and out.dtype == q.dtype and out.data_ptr() % 16 == 0
    out_desc = _descriptor(out.view(batch * num_heads, kv_lora_rank), [64, half]) if tma_out else q_desc
    _launch_many_heads(launch, (num_heads // 64, batch, num_splits), q2, q_desc, c2, block_table, seq_lens, out,
                       out_desc, lse, part_out, part_lse, sm_scale, num_heads, kv_cache.shape[1], kv_lora_rank,
                       num_splits, return_lse, TMA_OUT=tma_out, cu_seqlens_q_ptr=seq_lens, tree_mask_ptr=seq_lens,
                       splits_used_ptr=seq_lens, num_q_rows=0, min_split_tiles=1, VERIFY=False, TREE=False)


def _launch_many_heads(launch, grid, q2, q_desc, c2, block_table, seq_lens, out, out_desc, lse, part_out, part_lse,
                       sm_scale, num_heads: int, block_size: int, kv_lora_rank: int, num_splits: int, return_lse: bool,
                       **mode) -> None:
    """One launch of the many-heads kernel on the rows ``q2 [rows, L + R]`` and the cache rows ``c2``; ``mode``:
    the decode's or the verify's own arguments (``TMA_OUT`` and the ``VERIFY`` ones)."""
    from tripath.kernels.mla_decode_sm90 import mla_decode_sm90_kernel

    half, rope = kv_lora_rank // 2, q2.shape[1] - kv_lora_rank
    launch(
        mla_decode_sm90_kernel, grid, q2, q_desc, _descriptor(c2, [BLOCK_N, half]), _descriptor(c2, [BLOCK_N, rope]),
        block_table, seq_lens, out, out_desc, lse, part_out, part_lse, float(sm_scale) * 1.4426950408889634,
        block_table.stride(0), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), num_heads, block_size,
        BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES, P_STAGES=P_STAGES, num_splits=num_splits, SPLIT=num_splits > 1,
        RETURN_LSE=bool(return_lse), RESCALE_SLACK=RESCALE_SLACK, num_warps=4, maxnreg=MAXNREG, **mode,
    )


def gluon_verify_unsupported(platform: Platform, q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int,
                             out: torch.Tensor | None) -> str | None:
    """Why :func:`launch_mla_verify_sm90` cannot run this verify (None when it can): the many-heads kernel's
    conditions on the query, the cache and its block size; any head count (a verify's rows are its tokens'
    heads); ``out`` contiguous."""
    reason = _target_unsupported(platform, q, kv_cache, kv_lora_rank)
    if reason is None and kv_cache.shape[1] % BLOCK_N:
        reason = f"needs a block size that is a multiple of {BLOCK_N}, got {kv_cache.shape[1]}"
    reason = reason or _layout_unsupported(q, kv_cache)
    if reason is None and out is not None and not out.is_contiguous():
        reason = "needs a contiguous out"
    return reason


def verify_row_blocks(max_query_len: int, num_heads: int) -> int:
    """The verify grid's first dimension: 64-row tiles of the longest request's (token, head) rows."""
    return -(-max_query_len * num_heads // 64)


def launch_mla_verify_sm90(launch, q, kv_cache, block_table, seq_lens, cu_seqlens_q, max_query_len: int, tree_mask,
                           out, lse, part_out, part_lse, splits_used, sm_scale, num_splits: int, return_lse: bool,
                           kv_lora_rank: int) -> None:
    """The verify of :func:`tripath.ops.mla_verify` on the many-heads kernel (``VERIFY``): ``q [T, H, L + R]``,
    ``out [T, H, L]`` and ``lse [T, H]`` contiguous, partials ``[T, H, S, L]`` for ``S = num_splits > 1``."""
    num_tokens, num_heads, width = q.shape
    q2 = q.reshape(num_tokens * num_heads, width)
    c2 = kv_cache.reshape(kv_cache.shape[0] * kv_cache.shape[1], width)
    q_desc = _descriptor(q2, [64, kv_lora_rank // 2])
    grid = (verify_row_blocks(max_query_len, num_heads), cu_seqlens_q.shape[0] - 1, num_splits)
    _launch_many_heads(launch, grid, q2, q_desc, c2, block_table, seq_lens, out, q_desc, lse, part_out, part_lse,
                       sm_scale, num_heads, kv_cache.shape[1], kv_lora_rank, num_splits, return_lse, TMA_OUT=False,
                       cu_seqlens_q_ptr=cu_seqlens_q, tree_mask_ptr=tree_mask if tree_mask is not None else seq_lens,
                       splits_used_ptr=splits_used, num_q_rows=num_tokens * num_heads,
                       min_split_tiles=VERIFY_MIN_SPLIT_TILES, VERIFY=True, TREE=tree_mask is not None)
