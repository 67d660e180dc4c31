"""The Hopper fast path of :func:`tripath.ops.varlen_attention`: when it applies, and its launch.

:mod:`tripath.kernels.varlen_attention_sm90` is a warp-specialised Gluon kernel (TMA loader warp, two
consumer warpgroups on asynchronous ``wgmma``). It covers the common prefill case; every other case keeps
the portable Triton kernel. :func:`sm90_unsupported` names the first reason the fast path does not apply
(``None`` when it does), so callers and tests can see which kernel a call takes.
"""

from __future__ import annotations

import functools

import torch

from tripath import _env
from tripath.ops._descriptors import gluon_descriptor, row_matrix, row_strides
from tripath.platform import Platform

SM90_HEAD_SIZES = (64, 128)
SM90_ROPE_SIZES = (32, 64)  # widths of the scores' rotary part (MLA: 64)
WG_ROWS = 64  # query rows per consumer warpgroup; a program holds two
BLOCK_N = 128  # keys per tile (short requests take 64, see below)
NUM_STAGES = 2  # K and V buffers each (128 KiB at head size 128), leaving room for the queries
# 3 warpgroups × 128 threads × 168 = the register file. The kernel asks setmaxnreg for 240 per consumer and 24
# for the loader, but ptxas compiles every partition within this launch cap, so the consumers have 168.
MAXNREG = 168


@functools.lru_cache(maxsize=None)
def gluon_available() -> bool:
    """Whether this Triton ships Gluon's Hopper module (``warpgroup_mma``, TMA, mbarriers)."""
    try:
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except ImportError:
        return False
    return True


def _descriptor_matrix(t: torch.Tensor) -> tuple[int, int, int] | None:
    """:func:`tripath.ops._descriptors.row_matrix` of ``t`` where ``t`` can be read through a descriptor here,
    else None: (conservatively: only this has run on the GPU) head strides of whole 16-byte units."""
    matrix = row_matrix(t)
    if matrix is None or (row_strides(t)[1] * t.element_size()) % 16:
        return None
    return matrix


SHORT_KEYS = 1024  # at most this many keys per request: head-pair items, or 128-row items on 64-key tiles
# Short requests with an even number of query heads per KV head: items of 64 rows of two heads (one per
# consumer warpgroup), so both warpgroups see the same keys. Up to PAIR_SMALL_KEYS keys, 64-key tiles in a
# four-stage ring (a causal item wastes less of its diagonal tile); beyond, 128-key tiles in two stages
# (each the faster there: docs/BENCHMARKS.md, "Launch configurations").
PAIR_SMALL_KEYS = 512
SHORT_BLOCK_N, SHORT_STAGES = 64, 4
SHORT_LONG_BLOCK_N, SHORT_LONG_STAGES = 128, 2


# Warpgroup 1 starts each item once warpgroup 0 has the scores of this many of its key tiles (the kernel's
# LAG_TILES), so one warpgroup's per-item work outside its key loop (first scores, last value product,
# epilogue, next item's set-up: a large share of a warpgroup's time on short requests) overlaps the other's
# matrix products (faster for head pairs); lags of 2-3 were no better, and 128-row items keep none.
PAIR_LAG_TILES = 1

# Short requests of other GQA groups (MHA, odd groups): 128-row items on 64-key tiles in four stages (one
# query buffer a warpgroup: 160 KiB of shared memory at head size 128): faster than the portable kernel,
# than 128-key tiles and than two stages; a warpgroup lag did not pay here (docs/BENCHMARKS.md, "Launch
# configurations").
SINGLE_SHORT_BLOCK_N, SINGLE_SHORT_STAGES = 64, 4


def pair_heads(q: torch.Tensor, k: torch.Tensor, max_seqlen_k: int) -> bool:
    """Whether a launch takes head-pair items (short requests, an even GQA group)."""
    return max_seqlen_k <= SHORT_KEYS and (q.shape[1] // k.shape[1]) % 2 == 0


def sm90_unsupported(platform: Platform, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, max_seqlen_k: int,
                     q_rope: torch.Tensor | None, k_rope: torch.Tensor | None, window_left: int, softcap: float,
                     alibi_slopes, sinks) -> str | None:
    """Why the Gluon kernel does not apply to this call, or None when it does. Short requests (at most
    ``SHORT_KEYS`` keys) run as head-pair items where the GQA group is even (:func:`pair_heads`), else as
    128-row items on 64-key tiles (``SINGLE_SHORT_BLOCK_N``)."""
    if not platform.is_hopper:
        return f"not sm_90 ({platform.backend} {platform.arch})"
    if _env.gluon_disabled():
        return "TRIPATH_DISABLE_GLUON is set"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (fp16/bf16 only)"
    if q.shape[2] != v.shape[2] or q.shape[2] not in SM90_HEAD_SIZES:
        return f"head sizes {q.shape[2]}/{v.shape[2]} (equal, one of {SM90_HEAD_SIZES})"
    if q_rope is not None and q_rope.shape[2] not in SM90_ROPE_SIZES:
        return f"rotary part of {q_rope.shape[2]} dims (one of {SM90_ROPE_SIZES})"
    if window_left >= 0 or softcap > 0 or alibi_slopes is not None or sinks is not None:
        return "window, softcap, ALiBi or sinks"
    for t in (q, k, v, q_rope, k_rope):
        if t is not None and _descriptor_matrix(t) is None:
            return "strides or alignment rule out TMA descriptors"
    if not gluon_available():
        return "this Triton has no Gluon Hopper API"
    return None


def _descriptor(t: torch.Tensor, block_rows: int, matrix: tuple[int, int, int] | None = None):
    """The descriptor over ``t``'s row matrix (``matrix``: its :func:`row_matrix`, when already known) in
    ``[block_rows, D]`` tiles."""
    rows, cols, row_stride = matrix or row_matrix(t)
    return gluon_descriptor(t, (rows, cols), (row_stride, 1), (block_rows, t.shape[2]))


def launch_varlen_sm90(launch, q, k, v, q_rope, k_rope, out, lse, cu_seqlens_q, cu_seqlens_k, q_positions_start,
                       max_seqlen_q, max_seqlen_k: int, qk_scale: float, causal: bool, return_lse: bool,
                       num_sms: int, concurrent: bool) -> None:
    """Launch the Gluon kernel (after :func:`sm90_unsupported` returned None): a persistent grid of at most
    one program per SM (``num_sms``), or, when another launch runs ``concurrent`` on another stream, one
    program per work item, so SMs pass to the other launch as programs finish (the mixed step's GPU time
    is lower than with persistent extend and prefill launches side by side).
    ``q_rope``/``k_rope``: the scores' rotary part, or None. ``qk_scale`` is ``sm_scale · log2 e``;
    ``launch`` is :func:`tripath.triton_internals.launch`."""
    from tripath.kernels.varlen_attention_sm90 import varlen_attention_sm90_kernel

    num_seqs = cu_seqlens_q.shape[0] - 1
    pairs = pair_heads(q, k, int(max_seqlen_k))
    block_n, num_stages = BLOCK_N, NUM_STAGES
    if pairs:
        block_n, num_stages = ((SHORT_BLOCK_N, SHORT_STAGES) if max_seqlen_k <= PAIR_SMALL_KEYS
                               else (SHORT_LONG_BLOCK_N, SHORT_LONG_STAGES))
    elif max_seqlen_k <= SHORT_KEYS:
        block_n, num_stages = SINGLE_SHORT_BLOCK_N, SINGLE_SHORT_STAGES
    num_m_blocks = -(-max(int(max_seqlen_q), 1) // (WG_ROWS if pairs else 2 * WG_ROWS))
    items = num_m_blocks * (q.shape[1] // 2 if pairs else q.shape[1]) * num_seqs
    has_rope = q_rope is not None
    q_desc, k_desc = _descriptor(q, WG_ROWS), _descriptor(k, block_n)
    # Without a rotary part its descriptors are None (constexpr): nothing to specialise, encode or pass.
    qr_desc, kr_desc = (_descriptor(q_rope, WG_ROWS), _descriptor(k_rope, block_n)) if has_rope else (None, None)
    # Head strides in elements; one head has none (a single rotary key shared by all heads reads column 0).
    head_strides = [row_strides(t)[1] for t in ((q, k, v, q_rope, k_rope) if has_rope else (q, k, v))]
    head_strides += [] if has_rope else [0, 0]
    # Head-pair items without a rotary part (two query buffers a warpgroup) on 64-key tiles store whole
    # output tiles by TMA (with 128-key tiles the consumers spill 8 bytes at the 168-register cap).
    out_matrix = _descriptor_matrix(out) if pairs and block_n == SHORT_BLOCK_N and not has_rope else None
    tma_store = out_matrix is not None
    o_desc = _descriptor(out, WG_ROWS, out_matrix) if tma_store else None
    launch(
        varlen_attention_sm90_kernel, (items if concurrent else min(items, num_sms),),
        q_desc, k_desc, _descriptor(v, block_n), qr_desc, kr_desc, o_desc, out, lse,
        cu_seqlens_q, cu_seqlens_k, q_positions_start if q_positions_start is not None else cu_seqlens_q,
        qk_scale, out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), q.shape[1], num_seqs, num_m_blocks,
        q.shape[1] // k.shape[1], *head_strides,
        BLOCK_N=block_n, HEAD_D=q.shape[2], NUM_STAGES=num_stages, CAUSAL=bool(causal),
        HAS_Q_START=q_positions_start is not None, HAS_ROPE=has_rope, RETURN_LSE=bool(return_lse),
        PAIR_HEADS=pairs, LAG_TILES=PAIR_LAG_TILES if pairs else 0, TMA_STORE=tma_store, num_warps=4,
        maxnreg=MAXNREG,
    )
