"""Absorbed MLA verify: a few new tokens per request (speculative decoding), chains or draft trees, against the
latent cache, every token and head of a request in one program's rows, so each cache row is read once for them:
on sm_90 the warp-specialised Gluon decode kernel with a verify's (token, head) rows as its 64-row tiles
(:mod:`tripath.kernels.mla_decode_sm90`), elsewhere the portable kernel (:mod:`tripath.kernels.mla_verify`)."""

from __future__ import annotations

import torch

from tripath import _env
from tripath.kernels.mla_verify import mla_verify_kernel
from tripath.ops import _mla_configs, reference_mla
from tripath.ops._attention_checks import lse_out
from tripath.ops._checks import check_block_table, check_out, check_tensor, contiguous_last, dot_width
from tripath.ops._mla_decode_sm90 import BLOCK_N as GLUON_BLOCK_N
from tripath.ops._mla_decode_sm90 import gluon_verify_unsupported, launch_mla_verify_sm90, verify_row_blocks
from tripath.ops._split_kv import merge_splits, split_buffers
from tripath.ops.mla_absorbed import check_mla_query
from tripath.ops.verify import check_tree_mask, check_verify_requests
from tripath.platform import FP8_DTYPES, current_platform, fp8_max
from tripath.triton_internals import launch, use_triton

VERIFY_VARIANTS = ("auto", "gluon", "triton")


def verify_launch(platform, rows: int, kv_elem_bytes: int, q_fp8: bool) -> dict:
    """``BLOCK_M`` (query rows of a program: ``max_query_len · H`` of them), ``BLOCK_N`` and the warps. The
    16-row tiles are the few-heads decode's (:func:`~tripath.ops._mla_configs.mla_decode_config`, which
    compile without spills everywhere); on sm_90, 32 rows of 8 warps where a request brings that many (a
    [32, 512] fp32 accumulator within 255 registers, every cache tile read by half as many programs); AMD
    keeps 16 (32 rows spill there)."""
    few = _mla_configs.mla_decode_config(platform, 16, 512, kv_elem_bytes, q_fp8, grouped=True)
    cfg = {k: v for k, v in few.items() if k != "BLOCK_H"}
    if platform.backend == "cuda" and rows >= 32:
        return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    return {"BLOCK_M": few["BLOCK_H"], **cfg}


def mla_verify(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               cu_seqlens_q: torch.Tensor, max_query_len: int, *, kv_lora_rank: int = 512, sm_scale: float,
               kv_scale: torch.Tensor | None = None, q_scale: torch.Tensor | None = None,
               tree_mask: torch.Tensor | None = None, num_splits: int | None = None,
               out: torch.Tensor | None = None, return_lse: bool = False, validate: bool | None = None,
               variant: str = "auto"):
    """Each request's new tokens against its latent cache rows, causally or along a draft tree, reading each
    cache row once for all of a request's tokens and heads.

    Parameters
    ----------
    q : ``[T, H, L + R]`` = ``[ql_nope | rope(q_pe)]`` (as :func:`~tripath.ops.mla_decode` takes it; fp8 with
        ``q_scale``), request ``b``'s tokens at rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1``
        (``cu_seqlens_q [B + 1]`` int32), at positions ``seq_lens[b] - n_b .. seq_lens[b] - 1``, their rows
        already in the cache; ``n_b <= max_query_len <= MAX_VERIFY_TOKENS`` (a host int).
    kv_cache : ``[num_blocks, block_size, L + R]``; block_table ``[B, max_blocks]`` int32; seq_lens ``[B]``
        int32 (context + new tokens); kv_scale, q_scale : as for :func:`~tripath.ops.mla_decode`.
    tree_mask : ``[T]`` int32, draft trees as :func:`~tripath.ops.paged_verify` takes them (bit ``j``: new
        token ``j`` of the request is the token itself or an ancestor); None: chains (causal).
    num_splits : KV splits per request; None: from the batch and the GPU.
    variant : ``"gluon"`` (sm_90, 16-bit query and cache, L 512 + R 64, blocks a multiple of 32 rows, ``out``
        contiguous: the Gluon decode kernel, the (token, head) rows in 64-row tiles), ``"triton"`` (the
        portable kernel, every GPU), ``"auto"`` (``"gluon"`` where it applies).

    Rows past ``cu_seqlens_q[-1]`` are not written. Returns ``out [T, H, L]`` (q's dtype; bf16 for an fp8 q)
    and, with ``return_lse``, ``lse [T, H]`` fp32 (natural log).
    """
    device, block_size, num_blocks = check_mla_query(q, kv_cache, kv_lora_rank, kv_scale, q_scale, sm_scale)
    check_block_table(block_table, device)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=device)
    batch = check_verify_requests(q.shape[0], block_table, seq_lens, cu_seqlens_q, max_query_len, block_size,
                                  num_blocks, validate)
    if tree_mask is not None:
        check_tree_mask(tree_mask, cu_seqlens_q, q.shape[0], device, -1, None, validate)
    if num_splits is not None and not 1 <= int(num_splits) <= 256:
        raise ValueError(f"num_splits must be between 1 and 256, got {num_splits}")
    if variant not in VERIFY_VARIANTS:
        raise ValueError(f"variant={variant!r} is not supported; supported: {', '.join(VERIFY_VARIANTS)}")
    q_fp8 = q.dtype in FP8_DTYPES
    out_shape = (q.shape[0], q.shape[1], kv_lora_rank)
    if out is not None:
        check_out("out", out, out_shape, out.dtype, device)
    if not use_triton(device):
        return reference_mla.mla_verify_ref(q, kv_cache, block_table, seq_lens, cu_seqlens_q,
                                            kv_lora_rank=kv_lora_rank, sm_scale=sm_scale, kv_scale=kv_scale,
                                            q_scale=q_scale, tree_mask=tree_mask, out=out, return_lse=return_lse)
    out = out if out is not None else torch.empty(out_shape, dtype=torch.bfloat16 if q_fp8 else q.dtype,
                                                  device=device)
    platform = current_platform(device)
    num_tokens, num_heads, width = q.shape
    if variant in ("auto", "gluon"):
        reason = gluon_verify_unsupported(platform, q, kv_cache, kv_lora_rank, out)
        if variant == "gluon" and reason is not None:
            raise ValueError(f"variant='gluon' {reason}")
        if reason is None:
            return _verify_gluon(q, kv_cache, block_table, seq_lens, cu_seqlens_q, max_query_len, tree_mask,
                                 num_splits, out, return_lse, platform, batch, kv_lora_rank, sm_scale)
    cfg = verify_launch(platform, max_query_len * num_heads, kv_cache.element_size(), q_fp8)
    row_blocks = -(-max_query_len * num_heads // cfg["BLOCK_M"])
    if num_splits is None:
        num_splits = _mla_configs.mla_decode_num_splits(platform, batch * row_blocks,
                                                        block_table.shape[1] * block_size, cfg["BLOCK_N"])
    num_splits = int(num_splits)
    block_l = dot_width(kv_lora_rank, q_fp8)
    lse = lse_out(num_tokens, num_heads, device, return_lse)
    part_out, part_lse, splits_used = split_buffers(num_tokens, num_heads, num_splits, block_l, lse, seq_lens,
                                                    device, fill_used=True)   # rows of no request: left alone
    q = contiguous_last(q)
    kv_fp8 = kv_cache.dtype in FP8_DTYPES
    dummy = seq_lens
    launch(
        mla_verify_kernel, (batch, row_blocks, num_splits),
        q, kv_cache, block_table, seq_lens, cu_seqlens_q, tree_mask if tree_mask is not None else dummy,
        out, lse, part_out, part_lse, q_scale if q_fp8 else dummy, kv_scale if kv_fp8 else dummy,
        float(sm_scale), q.stride(0), q.stride(1), block_table.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        num_heads, kv_lora_rank, width - kv_lora_rank, block_size,
        num_splits=num_splits, splits_used_ptr=splits_used, SPLIT=num_splits > 1, BLOCK_L=block_l,
        BLOCK_R=dot_width(width - kv_lora_rank, q_fp8), TREE=tree_mask is not None, KV_FP8=kv_fp8, Q_FP8=q_fp8,
        FP8_MAX=fp8_max(q.dtype) if q_fp8 else 0.0, EMULATE_RNE=q_fp8 and _env.triton_interpret(),
        RETURN_LSE=return_lse, **cfg,
    )
    merge_splits(part_out, part_lse, splits_used, out, lse, None, num_splits, block_l, return_lse)
    return (out, lse) if return_lse else out


def gluon_verify_applies(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int, out: torch.Tensor | None) -> bool:
    """Whether :func:`mla_verify` with ``variant="auto"`` runs the Gluon kernel on these tensors."""
    return use_triton(q.device) and gluon_verify_unsupported(current_platform(q.device), q, kv_cache, kv_lora_rank,
                                                             out) is None


def _verify_gluon(q, kv_cache, block_table, seq_lens, cu_seqlens_q, max_query_len: int, tree_mask, num_splits,
                  out, return_lse: bool, platform, batch: int, kv_lora_rank: int, sm_scale: float):
    """:func:`mla_verify` on the Gluon kernel (``variant="gluon"``), splits merged after it."""
    num_tokens, num_heads, _ = q.shape
    if num_splits is None:
        num_splits = _mla_configs.mla_decode_num_splits(platform, batch * verify_row_blocks(max_query_len, num_heads),
                                                        block_table.shape[1] * kv_cache.shape[1], GLUON_BLOCK_N, 1)
    num_splits = int(num_splits)
    lse = lse_out(num_tokens, num_heads, q.device, return_lse)
    part_out, part_lse, splits_used = split_buffers(num_tokens, num_heads, num_splits, kv_lora_rank, lse, seq_lens,
                                                    q.device, fill_used=True)   # rows of no request: left alone
    launch_mla_verify_sm90(launch, q, kv_cache, block_table, seq_lens, cu_seqlens_q, max_query_len, tree_mask, out,
                           lse, part_out, part_lse, splits_used, sm_scale, num_splits, return_lse, kv_lora_rank)
    merge_splits(part_out, part_lse, splits_used, out, lse, None, num_splits, kv_lora_rank, return_lse)
    return (out, lse) if return_lse else out
