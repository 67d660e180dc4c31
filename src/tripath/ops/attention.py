"""MHA/GQA attention ops: validate, choose a launch configuration, launch (PyTorch reference on CPU).

Shapes: ``T`` flat tokens, ``B`` requests, ``Hq`` query heads, ``Hkv`` KV heads (``Hq % Hkv == 0``; query
head ``h`` reads KV head ``h // (Hq / Hkv)``), head sizes ``Dqk``/``Dv`` from 32 to 256. Options shared by
every op: ``sm_scale`` (default ``1/sqrt(Dqk)``), ``window_left`` (−1 off), ``softcap`` (0 off, at most 1e30),
``alibi_slopes [Hq]``, ``sinks [Hq]`` (counted once per row), ``out`` (preallocated output),
``return_lse`` (also return the natural-log LSE ``[T, Hq]`` fp32; −inf for rows that see nothing).
"""

from __future__ import annotations

import math

import torch

from tripath.kernels.merge_states import merge_states_kernel
from tripath.kernels.paged_decode import paged_decode_kernel
from tripath.kernels.unified_attention import unified_attention_kernel
from tripath.kernels.varlen_attention import varlen_attention_kernel
from tripath.ops import _configs, reference
from tripath.ops._attention_checks import (
    check_attention_options,
    check_cu_seqlens,
    check_new_tokens_out,
    check_paged,
    lse_out,
    num_cache_blocks,
)
from tripath.ops._checks import (
    FLOAT_DTYPES,
    check_cu_seqlens_values,
    check_out,
    check_seq_lens_values,
    check_tensor,
    next_pow2,
    values_checked,
)
from tripath.ops._configs import tables_span_max_len  # noqa: F401 - the engine's decode graphs set it here
from tripath.ops._descriptors import row_matrix, row_strides
from tripath.ops._split_kv import merge_splits, split_buffers
from tripath.ops._varlen_sm90 import launch_varlen_sm90, sm90_unsupported
from tripath.ops.kv_cache import cache_strides, shuffle_width
from tripath.platform import FP8_DTYPES, current_platform
from tripath.triton_internals import launch, use_triton

LOG2E = 1.4426950408889634


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = True,
                     sm_scale: float | None = None, window_left: int = -1, softcap: float = 0.0,
                     alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                     q_positions_start: torch.Tensor | None = None, q_rope: torch.Tensor | None = None,
                     k_rope: torch.Tensor | None = None, out: torch.Tensor | None = None,
                     return_lse: bool = False, concurrent: bool = False, validate: bool | None = None):
    """Attention of variable-length requests over contiguous keys.

    Parameters
    ----------
    q : ``[Tq, Hq, Dqk]``; k : ``[Tk, Hkv, Dqk]``; v : ``[Tk, Hkv, Dv]`` (Dv may differ from Dqk).
    cu_seqlens_q, cu_seqlens_k : ``[B + 1]`` int32 offsets of each request's queries and keys.
    max_seqlen_q, max_seqlen_k : host ints, the longest request (they size the grid).
    causal : bottom-right causal mask (query ``i`` sees keys ``<= q_start + i``).
    q_positions_start : optional ``[B]`` int32, the position of each request's first query in its key
        coordinates (default ``seqlen_k - seqlen_q``); chunked context uses it so windows and ALiBi see
        true distances.
    q_rope, k_rope : optional second parts of the queries and keys, ``[Tq, Hq, R]`` and ``[Tk, Hr, R]`` with
        ``Hr`` = ``Hkv`` or 1 (one rotary key shared by every head, as MLA's): the scores are
        ``q · k + q_rope · k_rope``, the attention of the concatenations ``[q | q_rope]``, ``[k | k_rope]``
        without building them; ``sm_scale`` then defaults to ``1/sqrt(Dqk + R)``. ``R`` from 16 to 256.
    concurrent : a scheduling hint: another compute-bound launch runs beside this one (on another stream),
        so the tiles are chosen for throughput even where this launch alone would leave its last waves
        ragged (a causal launch of few tiles), and the Hopper kernel launches one program per work item
        instead of a persistent grid.
    validate : check the offsets' values (start at 0, non-decreasing, within ``q``/``k``, no request longer
        than ``max_seqlen_q``/``max_seqlen_k``): always for host tensors; for device tensors when True or,
        with None, under ``TRIPATH_VALIDATE=1`` (a host sync).

    On sm_90 the warp-specialised Gluon kernel (:mod:`tripath.kernels.varlen_attention_sm90`) runs where
    :func:`tripath.ops._varlen_sm90.sm90_unsupported` allows it (16-bit heads of 64/128, an optional rotary
    part of 32/64, no window/softcap/ALiBi/sinks; requests of at most 1024 keys as head-pair items for an
    even number of query heads per KV head, as 128-row items on 64-key tiles otherwise); the portable kernel
    otherwise.
    Both ignore rows of ``k``/``v`` outside the requests, whatever they hold (NaN included). Rows of ``q``
    past ``cu_seqlens_q[-1]`` (padding) are not written, on every path: an ``out=`` keeps its contents
    there; a fresh ``out`` (and ``lse``) holds unspecified values there.

    Returns
    -------
    ``out [Tq, Hq, Dv]`` (q's dtype), and ``lse [Tq, Hq]`` fp32 when ``return_lse``.
    """
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    device = q.device
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=device, shape=(None, None, q.shape[2]))
    check_tensor("v", v, ndim=3, dtypes=(q.dtype,), device=device, shape=(k.shape[0], k.shape[1], None))
    group = check_attention_options(q, k.shape[1], q.shape[2], v.shape[2], window_left, softcap, alibi_slopes, sinks,
                           sm_scale)
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, device)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, device)
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(f"cu_seqlens_q ({cu_seqlens_q.shape[0]}) and cu_seqlens_k ({cu_seqlens_k.shape[0]}) "
                         "must have the same length (num_requests + 1)")
    num_seqs = cu_seqlens_q.shape[0] - 1
    if q_positions_start is not None:
        check_tensor("q_positions_start", q_positions_start, ndim=1, dtypes=(torch.int32,), device=device,
                     shape=(num_seqs,))
    if int(max_seqlen_q) < 0 or int(max_seqlen_k) < 0:
        raise ValueError("max_seqlen_q and max_seqlen_k must be >= 0")
    if values_checked(validate, cu_seqlens_q, cu_seqlens_k):
        check_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q")
        check_cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k")
    rope_size = _check_rope(q, k, q_rope, k_rope)
    out_shape = (q.shape[0], q.shape[1], v.shape[2])
    check_out("out", out, out_shape, q.dtype, device)
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[2] + rope_size)
    if not use_triton(device):
        if rope_size:
            q = torch.cat([q, q_rope], dim=-1)
            k = torch.cat([k, k_rope.expand(-1, k.shape[1], -1)], dim=-1)
        return reference.varlen_attention_ref(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, sm_scale=sm_scale,
            window_left=window_left, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
            q_positions_start=q_positions_start, out=out, return_lse=return_lse)
    out = out if out is not None else torch.empty(out_shape, dtype=q.dtype, device=device)
    lse = lse_out(q.shape[0], q.shape[1], device, return_lse)
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    if rope_size:
        q_rope, k_rope = (t if t.stride(2) == 1 else t.contiguous() for t in (q_rope, k_rope))
    else:
        q_rope, k_rope = q, k  # unused by the kernel
    platform = current_platform(device)
    rope = (q_rope, k_rope) if rope_size else (None, None)
    if sm90_unsupported(platform, q, k, v, max_seqlen_k=int(max_seqlen_k), q_rope=rope[0], k_rope=rope[1],
                        window_left=window_left, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks) is None:
        launch_varlen_sm90(launch, q, k, v, *rope, out, lse, cu_seqlens_q, cu_seqlens_k, q_positions_start,
                           max_seqlen_q, int(max_seqlen_k), sm_scale * LOG2E, causal, return_lse, platform.num_sms,
                           concurrent)
        return (out, lse) if return_lse else out
    config_args = (platform, max(q.shape[2] + rope_size, v.shape[2]), q.element_size(), int(max_seqlen_k))
    causal_tiles = None if concurrent else _causal_tiles(causal, num_seqs, int(max_seqlen_q), int(max_seqlen_k),
                                                         q.shape[1])
    cfg = dict(_configs.varlen_config(*config_args, causal_tiles=causal_tiles, head_size_v=v.shape[2]))
    even_d = all(d == next_pow2(d) for d in (q.shape[2], v.shape[2], rope_size or 16))
    use_tma = cfg.pop("TMA", False)
    k_desc, v_desc, kr_desc = k, v, k_rope
    if use_tma and even_d:
        k_desc, v_desc, kr_desc = _kv_descriptors(k, v, k_rope if rope_size else None, cfg["BLOCK_N"])
    if use_tma and k_desc is k:  # descriptors ruled out: the pointer-load configuration
        cfg = dict(_configs.varlen_config(*config_args, tma=False, causal_tiles=causal_tiles,
                                          head_size_v=v.shape[2]))
        cfg.pop("TMA", None)
    block_m = cfg.pop("BLOCK_M")
    dummy = cu_seqlens_q
    launch(
        varlen_attention_kernel, (triton_cdiv(max(int(max_seqlen_q), 1), block_m), q.shape[1], num_seqs),
        q, k, v, k_desc, v_desc, q_rope, k_rope, kr_desc, out, lse, cu_seqlens_q, cu_seqlens_k,
        q_positions_start if q_positions_start is not None else dummy,
        alibi_slopes if alibi_slopes is not None else dummy, sinks if sinks is not None else dummy,
        sm_scale * LOG2E, float(softcap), int(window_left),
        q.stride(0), q.stride(1), *row_strides(k), *row_strides(v),
        q_rope.stride(0), q_rope.stride(1), *row_strides(k_rope),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        group, q.shape[2], v.shape[2], rope_size,
        BLOCK_M=block_m, BLOCK_DK=next_pow2(q.shape[2]), BLOCK_DV=next_pow2(v.shape[2]),
        BLOCK_DR=next_pow2(max(rope_size, 16)), HAS_ROPE=rope_size > 0,
        CAUSAL=bool(causal), HAS_WINDOW=window_left >= 0, HAS_SOFTCAP=softcap > 0,
        HAS_ALIBI=alibi_slopes is not None, HAS_SINKS=sinks is not None,
        HAS_Q_START=q_positions_start is not None, RETURN_LSE=return_lse,
        EVEN_D=even_d, USE_TMA=k_desc is not k, **cfg,
    )
    return (out, lse) if return_lse else out


def _causal_tiles(causal: bool, num_seqs: int, max_seqlen_q: int, max_seqlen_k: int, num_heads: int) -> int | None:
    """128-row query tiles of a causal launch whose keys are mostly the queries' own (fewer than twice as
    many): there the programs' lengths differ by up to the whole request and the launch's last waves run
    ragged (:func:`tripath.ops._configs.varlen_config`). None otherwise: with a long cached context before
    the queries (an extend's last chunk joined with its new tokens) every program walks about the same
    number of keys."""
    if not causal or max_seqlen_k >= 2 * max_seqlen_q:
        return None
    return num_seqs * triton_cdiv(max_seqlen_q, 128) * num_heads


def _kv_descriptors(k: torch.Tensor, v: torch.Tensor, k_rope: torch.Tensor | None, block_n: int):
    """Tensor descriptors over the rows of keys, values (and rotary keys) as ``[Tk, (H − 1) · stride_h + D]``
    matrices with ``[block_n, D]`` tiles (:func:`tripath.ops._descriptors.row_matrix`), or the tensors
    unchanged when their strides do not allow it: the kernel then reads through pointers."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    tensors = (k, v, k_rope) if k_rope is not None else (k, v)
    descs = []
    for t in tensors:
        matrix = row_matrix(t)
        if matrix is None:
            return k, v, k_rope if k_rope is not None else k
        rows, cols, row_stride = matrix
        descs.append(TensorDescriptor(t, shape=[rows, cols], strides=[row_stride, 1],
                                      block_shape=[block_n, t.shape[2]]))
    return descs[0], descs[1], descs[2] if k_rope is not None else k


def _check_rope(q, k, q_rope, k_rope) -> int:
    """The rotary part's width ``R`` (0 without one) after checking ``q_rope``/``k_rope`` against q and k."""
    if q_rope is None and k_rope is None:
        return 0
    if q_rope is None or k_rope is None:
        raise ValueError("q_rope and k_rope must be given together")
    check_tensor("q_rope", q_rope, ndim=3, dtypes=(q.dtype,), device=q.device, shape=(q.shape[0], q.shape[1], None))
    check_tensor("k_rope", k_rope, ndim=3, dtypes=(q.dtype,), device=q.device,
                 shape=(k.shape[0], None, q_rope.shape[2]))
    if k_rope.shape[1] not in (1, k.shape[1]):
        raise ValueError(f"k_rope must have 1 head (shared) or k's {k.shape[1]}, got {k_rope.shape[1]}")
    rope_size = q_rope.shape[2]
    if not 16 <= rope_size <= 256:
        raise ValueError(f"the rotary part's width (q_rope.shape[-1]={rope_size}) is not supported: 16 to 256")
    return rope_size


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, *, layout: str = "nhd", sm_scale: float | None = None,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 window_left: int = -1, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                 sinks: torch.Tensor | None = None, num_splits: int | None = None,
                 out: torch.Tensor | None = None, return_lse: bool = False, concurrent: bool = False,
                 validate: bool | None = None):
    """One new token per request against its paged context (split-KV flash-decoding).

    Parameters
    ----------
    q : ``[B, Hq, D]``, the token at position ``seq_lens[b] - 1`` (its K/V already in the cache).
    k_cache, v_cache : paged cache of ``layout`` (``"nhd"`` or ``"shuffled"``), fp16/bf16 or fp8 e4m3 with
        ``k_scale``/``v_scale`` one-element fp32 tensors.
    block_table : ``[B, max_blocks]`` int32; seq_lens : ``[B]`` int32 (context + 1).
    num_splits : KV splits per request; ``None``: an upper bound from the batch, the GPU and the table's width,
        each request using what its length calls for (in the kernel; see :func:`tables_span_max_len`).
    concurrent : a scheduling hint: compute-bound launches run beside this one (on other streams), so the
        64-token tiles are kept (a 128-token tile program takes 73 KiB of shared memory against 39 and
        leaves less room for the other launch's programs).
    validate : check ``seq_lens`` (>= 0, within the block table) and the block ids each request reads
        (``[0, num_blocks)``): always for host tensors; for device tensors when True or, with None, under
        ``TRIPATH_VALIDATE=1`` (a host sync).

    Returns ``out [B, Hq, D]`` (and ``lse [B, Hq]``).
    """
    device, block_size, num_kv_heads, head_size, head_size_v = check_paged(
        q, k_cache, v_cache, block_table, seq_lens, layout, k_scale, v_scale)
    group = check_attention_options(q, num_kv_heads, head_size, head_size_v, window_left, softcap, alibi_slopes, sinks,
                           sm_scale)
    batch = q.shape[0]
    if block_table.shape[0] < batch or seq_lens.shape[0] != batch:
        raise ValueError(f"block_table ({block_table.shape[0]} rows) and seq_lens ({seq_lens.shape[0]}) must "
                         f"have one row per request of q ({batch})")
    if values_checked(validate, block_table, seq_lens):
        check_seq_lens_values(seq_lens, block_table, block_size, num_cache_blocks(k_cache))
    if num_splits is not None and not 1 <= int(num_splits) <= 256:
        raise ValueError(f"num_splits must be between 1 and 256, got {num_splits}")
    out_shape = (batch, q.shape[1], head_size_v)
    check_out("out", out, out_shape, q.dtype, device)
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_size)
    if not use_triton(device):
        return reference.paged_decode_ref(
            q, k_cache, v_cache, block_table, seq_lens, layout=layout, sm_scale=sm_scale, k_scale=k_scale,
            v_scale=v_scale, window_left=window_left, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
            out=out, return_lse=return_lse)
    platform = current_platform(device)
    max_len = block_table.shape[1] * block_size  # an upper bound from the host: no device sync
    long_splits = None if concurrent or _configs.tables_span_max_len_set() else _configs.long_tile_splits(
        platform, batch, num_kv_heads, max_len, num_splits, head_size=head_size,
        kv_elem_bytes=k_cache.element_size(), layout=layout)
    cfg = dict(_configs.decode_config(platform, head_size, k_cache.element_size(), long_tiles=long_splits is not None))
    if num_splits is None:
        num_splits = long_splits or _configs.default_num_splits(platform, batch, num_kv_heads, max_len,
                                                                cfg["BLOCK_N"])
        fill_splits, min_split_tiles = _configs.device_split_bounds(platform, batch, num_kv_heads,
                                                                    long_splits is not None)
    else:  # the caller's count, for every request
        fill_splits, min_split_tiles = int(num_splits), 1
    num_splits = int(num_splits)
    out = out if out is not None else torch.empty(out_shape, dtype=q.dtype, device=device)
    lse = lse_out(batch, q.shape[1], device, return_lse)
    block_dv = next_pow2(head_size_v)
    part_out, part_lse, splits_used = split_buffers(batch, q.shape[1], num_splits, block_dv, lse, seq_lens, device)
    q = q if q.stride(2) == 1 else q.contiguous()
    kv_fp8 = k_cache.dtype in FP8_DTYPES
    dummy = seq_lens
    launch(
        paged_decode_kernel, (num_kv_heads, batch, num_splits),  # a request's KV heads side by side
        q, k_cache, v_cache, block_table, seq_lens, out, lse, part_out, part_lse,
        alibi_slopes if alibi_slopes is not None else dummy, sinks if sinks is not None else dummy,
        k_scale if kv_fp8 else dummy, v_scale if kv_fp8 else dummy,
        float(sm_scale), float(softcap), int(window_left),
        q.stride(0), q.stride(1), block_table.stride(0), *cache_strides(k_cache, v_cache),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        q.shape[1], group, head_size, head_size_v, block_size,
        num_splits=num_splits, fill_splits=fill_splits, min_split_tiles=min_split_tiles, splits_used_ptr=splits_used,
        SPLIT=num_splits > 1, BLOCK_G=max(16, next_pow2(group)), BLOCK_DK=next_pow2(head_size),
        BLOCK_DV=block_dv, SHUFFLED=layout == "shuffled", X=shuffle_width(k_cache.dtype), KV_FP8=kv_fp8,
        HAS_WINDOW=window_left >= 0, HAS_SOFTCAP=softcap > 0, HAS_ALIBI=alibi_slopes is not None,
        HAS_SINKS=sinks is not None, RETURN_LSE=return_lse, **cfg,
    )
    merge_splits(part_out, part_lse, splits_used, out, lse, sinks, num_splits, block_dv, return_lse)
    return (out, lse) if return_lse else out


def unified_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int, *,
                      layout: str = "nhd", sm_scale: float | None = None, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None, window_left: int = -1, softcap: float = 0.0,
                      alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, return_lse: bool = False, validate: bool | None = None):
    """One launch for a mixed batch (decode, extend and prefill alike) whose new K/V are in the cache.

    Parameters
    ----------
    q : ``[T, Hq, D]`` new tokens, request by request (``cu_seqlens_q [B + 1]`` int32 offsets).
    seq_lens : ``[B]`` int32, context + new tokens; new token ``t`` of a request sits at
        ``seq_len - query_len + t`` and attends causally to the cached keys.
    max_seqlen_q : host int, the longest request's new tokens (kept for API symmetry; the grid uses ``T``).
    validate : check ``cu_seqlens_q`` (from 0, non-decreasing, within ``q``), ``seq_lens`` (each covering its
        request's new tokens, within the block table) and the block ids read (``[0, num_blocks)``): always
        for host tensors; for device tensors when True or, with None, under ``TRIPATH_VALIDATE=1``.

    Rows of ``q`` past ``cu_seqlens_q[-1]`` (padding) are not written, on every path: an ``out=`` keeps its
    contents there; a fresh ``out`` (and ``lse``) holds unspecified values there.

    Returns ``out [T, Hq, D]`` (and ``lse [T, Hq]``).
    """
    device, block_size, num_kv_heads, head_size, head_size_v = check_paged(
        q, k_cache, v_cache, block_table, seq_lens, layout, k_scale, v_scale)
    group = check_attention_options(q, num_kv_heads, head_size, head_size_v, window_left, softcap, alibi_slopes, sinks,
                           sm_scale)
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if seq_lens.shape[0] != num_seqs or block_table.shape[0] < num_seqs:
        raise ValueError(f"seq_lens ({seq_lens.shape[0]}) and block_table ({block_table.shape[0]} rows) must "
                         f"have one entry per request of cu_seqlens_q ({num_seqs})")
    check_new_tokens_out(q, k_cache, block_table, seq_lens, cu_seqlens_q, block_size, head_size_v, out, validate)
    out_shape = (q.shape[0], q.shape[1], head_size_v)
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_size)
    if not use_triton(device):
        return reference.unified_attention_ref(
            q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, layout=layout,
            sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale, window_left=window_left, softcap=softcap,
            alibi_slopes=alibi_slopes, sinks=sinks, out=out, return_lse=return_lse)
    out = out if out is not None else torch.empty(out_shape, dtype=q.dtype, device=device)
    lse = lse_out(q.shape[0], q.shape[1], device, return_lse)
    block_g = next_pow2(group)
    cfg = dict(_configs.unified_config(current_platform(device), head_size, block_g))
    block_m = max(cfg.pop("BLOCK_M"), 16, block_g)
    block_q = block_m // block_g
    q = q if q.stride(2) == 1 else q.contiguous()
    kv_fp8 = k_cache.dtype in FP8_DTYPES
    dummy = seq_lens
    launch(
        unified_attention_kernel, (q.shape[0] // block_q + num_seqs, num_kv_heads),
        q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, out, lse,
        alibi_slopes if alibi_slopes is not None else dummy, sinks if sinks is not None else dummy,
        k_scale if kv_fp8 else dummy, v_scale if kv_fp8 else dummy,
        float(sm_scale), float(softcap), int(window_left),
        q.stride(0), q.stride(1), block_table.stride(0), *cache_strides(k_cache, v_cache),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        num_seqs, group, head_size, head_size_v, block_size,
        BLOCK_Q=block_q, BLOCK_G=block_g, BLOCK_DK=next_pow2(head_size), BLOCK_DV=next_pow2(head_size_v),
        BINARY_STEPS=_configs.binary_steps(num_seqs), SHUFFLED=layout == "shuffled",
        X=shuffle_width(k_cache.dtype), KV_FP8=kv_fp8, HAS_WINDOW=window_left >= 0,
        HAS_SOFTCAP=softcap > 0, HAS_ALIBI=alibi_slopes is not None, HAS_SINKS=sinks is not None,
        RETURN_LSE=return_lse, **cfg,
    )
    return (out, lse) if return_lse else out


def merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor, *,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial results over disjoint key sets: ``out_* [T, H, D]``, ``lse_* [T, H]`` fp32.

    Returns ``(out [T, H, D], lse [T, H])``. A side with LSE −inf is empty and contributes nothing (its
    output is ignored even if it holds NaN); both empty gives 0 and −inf. ``out`` may alias ``out_a``.
    """
    check_tensor("out_a", out_a, ndim=3, dtypes=FLOAT_DTYPES)
    device = out_a.device
    check_tensor("out_b", out_b, ndim=3, dtypes=FLOAT_DTYPES, device=device, shape=tuple(out_a.shape))
    check_tensor("lse_a", lse_a, ndim=2, dtypes=(torch.float32,), device=device, shape=tuple(out_a.shape[:2]))
    check_tensor("lse_b", lse_b, ndim=2, dtypes=(torch.float32,), device=device, shape=tuple(out_a.shape[:2]))
    check_out("out", out, tuple(out_a.shape), out_a.dtype, device)
    if not use_triton(device):
        return reference.merge_states_ref(out_a, lse_a, out_b, lse_b, out=out)
    out = out if out is not None else torch.empty_like(out_a)
    lse = torch.empty_like(lse_a)
    t, h, d = out_a.shape
    launch(
        merge_states_kernel, (t,),
        out_a, lse_a, out_b, lse_b, out, lse,
        out_a.stride(0), out_a.stride(1), out_b.stride(0), out_b.stride(1), out.stride(0), out.stride(1),
        lse_a.stride(0), lse_a.stride(1), lse_b.stride(0), lse_b.stride(1), lse.stride(0), lse.stride(1),
        h, d, BLOCK_H=next_pow2(h), BLOCK_D=next_pow2(d), num_warps=4,
    )
    return out, lse
