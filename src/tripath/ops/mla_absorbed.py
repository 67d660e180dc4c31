"""The absorbed MLA decode: ``mla_decode(q [B, H, L + R], kv_cache, block_table, seq_lens, ...)`` → the latent
output ``o_lat [B, H, L]`` of each head against its request's paged latent cache (the dims and the math:
:mod:`tripath.ops.mla`). Variants: the Gluon kernels on sm_90 (:mod:`tripath.ops._mla_decode_sm90`), else the
packed-heads Triton kernel (:mod:`tripath.kernels.mla_decode`); split-KV partials merged by
:func:`tripath.kernels.paged_decode.reduce_splits_kernel`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tripath import _env
from tripath.kernels.mla_decode import mla_decode_kernel
from tripath.kernels.paged_decode import reduce_splits_kernel
from tripath.ops import _mla_configs, reference_mla
from tripath.ops._checks import (FLOAT_DTYPES, check_block_table, check_out, check_scale, check_seq_lens_values,
                                 check_sm_scale, check_tensor, check_written, contiguous_last, dot_width, next_pow2,
                                 values_checked)
from tripath.ops._mla_decode_sm90 import block_n as gluon_block_n
from tripath.ops._mla_decode_sm90 import gluon_unsupported, launch_mla_decode_sm90
from tripath.ops.mla import CACHE_DTYPES, check_mla_cache
from tripath.platform import FP8_DTYPES, current_platform, fp8_max
from tripath.triton_internals import launch, use_triton

DECODE_VARIANTS = ("auto", "gluon", "packed", "grouped")


def check_mla_query(q, kv_cache, kv_lora_rank, kv_scale, q_scale, sm_scale) -> tuple:
    """The checks an absorbed MLA query ``q [*, H, L + R]`` and its cache share (dtypes, widths, scales);
    ``(device, block_size, num_blocks)``."""
    check_tensor("q", q, ndim=3, dtypes=CACHE_DTYPES)
    device = q.device
    width = q.shape[2]
    num_blocks, block_size, _ = check_mla_cache(kv_cache, device, width)
    q_fp8 = q.dtype in FP8_DTYPES
    if q_fp8 and kv_cache.dtype != q.dtype:
        raise TypeError(f"an fp8 q ({q.dtype}) needs an fp8 kv_cache of the same dtype, got {kv_cache.dtype}")
    if not q_fp8 and kv_cache.dtype not in FP8_DTYPES and kv_cache.dtype != q.dtype:
        raise TypeError(f"kv_cache dtype {kv_cache.dtype} must equal q's ({q.dtype}) or be fp8 (e4m3)")
    if not 0 < kv_lora_rank < width:
        raise ValueError(f"kv_lora_rank={kv_lora_rank} must be between 1 and q.shape[-1] - 1 ({width - 1})")
    check_sm_scale(sm_scale)
    check_scale("kv_scale", kv_scale, kv_cache.dtype, device)
    if q_fp8 and q_scale is None:
        raise ValueError("q_scale is required for an fp8 q (a one-element float32 tensor)")
    check_scale("q_scale", q_scale, q.dtype, device)
    return device, block_size, num_blocks


def _check_decode(q, kv_cache, block_table, seq_lens, kv_lora_rank, kv_scale, q_scale, variant, num_splits,
                  sm_scale, validate):
    device, block_size, num_blocks = check_mla_query(q, kv_cache, kv_lora_rank, kv_scale, q_scale, sm_scale)
    batch = q.shape[0]
    check_block_table(block_table, device)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=device)
    if block_table.shape[0] < batch or seq_lens.shape[0] != batch:
        raise ValueError(f"block_table ({block_table.shape[0]} rows) and seq_lens ({seq_lens.shape[0]}) must "
                         f"have one row per request of q ({batch})")
    if values_checked(validate, block_table, seq_lens):
        check_seq_lens_values(seq_lens, block_table, block_size, num_blocks)
    if variant not in DECODE_VARIANTS:
        raise ValueError(f"variant={variant!r} is not supported; supported: {', '.join(DECODE_VARIANTS)}")
    if num_splits is not None and not 1 <= int(num_splits) <= 256:
        raise ValueError(f"num_splits must be between 1 and 256, got {num_splits}")
    return device, block_size


@dataclass
class _PackedTiles:
    """How the head-packed decode kernel runs: its launch options (``BLOCK_N``, warps, stages) and the
    choices the launcher passes as constexprs."""

    launch_options: dict
    block_h: int
    v_parts: int
    programs_per_sm: int
    swap_ab: bool
    prefetch: int
    row_lines: int
    descriptors: tuple | None


def _packed_tiles(platform, kv_cache, num_heads, kv_lora_rank, block_l, block_r, q_fp8, grouped) -> _PackedTiles:
    """The configuration for this cache; a descriptor configuration whose descriptors the cache's geometry
    rules out falls back to the pointer-load one."""
    block_size = kv_cache.shape[1]
    config_args = (platform, num_heads, kv_lora_rank, kv_cache.element_size(), q_fp8)
    cfg = dict(_mla_configs.mla_decode_config(*config_args, grouped=grouped, block_size=block_size))
    descriptors = None
    if cfg.get("TMA"):
        v_parts = cfg.get("V_PARTS", 1) if block_l >= 32 else 1
        descriptors = _cache_descriptors(kv_cache, kv_lora_rank, block_l, block_r, block_l // v_parts,
                                         cfg["BLOCK_N"])
        if descriptors is None:
            cfg = dict(_mla_configs.mla_decode_config(*config_args, grouped=grouped))
    cfg.pop("TMA", None)
    block_h = cfg.pop("BLOCK_H")
    v_parts = cfg.pop("V_PARTS", 1) if block_l >= 32 else 1  # halves >= 16 wide for tl.dot
    programs_per_sm = cfg.pop("PROGRAMS_PER_SM", 2)
    swap_ab = bool(cfg.pop("SWAP_AB", False))
    prefetch = int(cfg.pop("PREFETCH", 0))
    row_bytes = kv_cache.stride(1) * kv_cache.element_size()
    # L2 prefetch (inline PTX): NVIDIA GPUs only, with the descriptor path, rows of whole 128-byte lines.
    if descriptors is None or row_bytes % 128 or not platform.is_cuda:
        prefetch = 0
    if platform.is_cuda and descriptors is not None and swap_ab and cfg.get("num_stages", 2) < 2:
        raise ValueError("mla_decode: descriptor tiles with transposed products need num_stages >= 2 (one "
                         "buffer returned wrong results on triton 3.6, sm_90)")
    return _PackedTiles(cfg, block_h, v_parts, programs_per_sm, swap_ab, prefetch, max(1, row_bytes // 128),
                        descriptors)


def _cache_descriptors(kv_cache: torch.Tensor, kv_lora_rank: int, block_l: int, block_r: int, block_v: int,
                       block_n: int):
    """Tensor descriptors over the cache as a ``[num_blocks · block_size, L + R]`` matrix: latent tiles
    ``[block_n, block_v]`` and rotary tiles ``[block_n, R]``; None when the geometry rules them out (a
    latent or rotary width that is not a power of two, tiles that would cross a page, pages not packed
    row after row, rows or base not 16-byte aligned): the kernel then reads through pointers.

    The answer is kept on the cache tensor (a layer's cache is the same tensor every step), so eager steps
    do not rebuild descriptors per layer (Python on every layer's launch)."""
    key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.stride(), kv_lora_rank, block_v, block_r, block_n)
    memo = kv_cache.__dict__.setdefault("_tripath_descriptors", {})
    if key not in memo:
        memo[key] = _build_cache_descriptors(kv_cache, kv_lora_rank, block_l, block_r, block_v, block_n)
    return memo[key]


def _build_cache_descriptors(kv_cache, kv_lora_rank, block_l, block_r, block_v, block_n):
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_blocks, block_size, width = kv_cache.shape
    row_stride = kv_cache.stride(1)
    if (kv_lora_rank != block_l or width - kv_lora_rank != block_r or block_size % block_n
            or kv_cache.stride(2) != 1 or kv_cache.stride(0) != block_size * row_stride
            or (row_stride * kv_cache.element_size()) % 16 or kv_cache.data_ptr() % 16 or num_blocks == 0):
        return None
    rows = num_blocks * block_size
    return tuple(TensorDescriptor(kv_cache, shape=[rows, width], strides=[row_stride, 1],
                                  block_shape=[block_n, cols]) for cols in (block_v, block_r))


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, *,
               kv_lora_rank: int = 512, sm_scale: float, kv_scale: torch.Tensor | None = None,
               q_scale: torch.Tensor | None = None, num_splits: int | None = None, variant: str = "auto",
               out: torch.Tensor | None = None, return_lse: bool = False, validate: bool | None = None):
    """Absorbed MLA decode: every query head of a request against its latent cache rows.

    Parameters
    ----------
    q : ``[B, H, L + R]`` = ``[ql_nope | rope(q_pe)]``, fp16/bf16/fp32, or fp8 with ``q_scale`` (then the
        cache must be fp8 too and both products run on fp8 operands).
    kv_cache : ``[num_blocks, block_size, L + R]``, q's dtype or fp8 e4m3 with ``kv_scale``.
    block_table : ``[B, max_blocks]`` int32; seq_lens : ``[B]`` int32, rows to attend (the new one included).
    sm_scale : required; ``1/sqrt(qk_nope + qk_rope)`` (times the yarn mscale²) for DeepSeek.
    num_splits : KV splits per request; None picks one from the batch, the heads and the GPU.
    variant : ``"auto"`` (``"gluon"`` where it applies, else ``"packed"``), ``"gluon"`` (sm_90, 16-bit, L 512
        and R 64; a multiple of 64 heads and a block size that is a multiple of 32: the warp-specialised
        kernel of :mod:`tripath.kernels.mla_decode_sm90`, which computes each score once; 8, 16 or 32 heads
        and a block size that is a multiple of 64: the transposed-product kernel of
        :mod:`tripath.kernels.mla_decode_few_heads_sm90`), ``"packed"`` (heads packed
        into tensor-core tiles, each row read once per head block; tiles tuned per head count),
        or ``"grouped"`` (the same kernel with the plain 16-head tiles for every head count: the baseline
        backend's choice).
    validate : check ``seq_lens`` (>= 0, within the block table) and the block ids read (``[0, num_blocks)``):
        always for host tensors; for device tensors when True or, with None, under ``TRIPATH_VALIDATE=1``.

    Returns ``out [B, H, L]`` (q's dtype; bf16 for an fp8 q unless ``out`` says otherwise), and
    ``lse [B, H]`` fp32 (natural log; −inf for empty requests, whose output is 0) when ``return_lse``.
    """
    device, block_size = _check_decode(q, kv_cache, block_table, seq_lens, kv_lora_rank, kv_scale, q_scale,
                                       variant, num_splits, sm_scale, validate)
    batch, num_heads, width = q.shape
    q_fp8 = q.dtype in FP8_DTYPES
    out_shape = (batch, num_heads, kv_lora_rank)
    if out is not None:
        check_tensor("out", out, dtypes=FLOAT_DTYPES, device=device)
        check_out("out", out, out_shape, out.dtype, device)
        check_written("out", out)
    if not use_triton(device):
        return reference_mla.mla_decode_ref(q, kv_cache, block_table, seq_lens, kv_lora_rank=kv_lora_rank,
                                            sm_scale=sm_scale, kv_scale=kv_scale, q_scale=q_scale, out=out,
                                            return_lse=return_lse)
    out = out if out is not None else torch.empty(out_shape, dtype=torch.bfloat16 if q_fp8 else q.dtype,
                                                  device=device)
    platform = current_platform(device)
    block_l, block_r = dot_width(kv_lora_rank, q_fp8), dot_width(width - kv_lora_rank, q_fp8)
    if variant in ("auto", "gluon"):
        reason = gluon_unsupported(platform, q, kv_cache, kv_lora_rank)
        if variant == "gluon" and reason is not None:
            raise ValueError(f"variant='gluon' {reason}")
        variant = "packed" if reason is not None else "gluon"
    if variant == "gluon":
        cfg, grid_h, tiles = {"BLOCK_N": gluon_block_n(num_heads)}, max(1, num_heads // 64), None
    else:
        tiles = _packed_tiles(platform, kv_cache, num_heads, kv_lora_rank, block_l, block_r, q_fp8,
                              variant == "grouped")
        cfg, grid_h = tiles.launch_options, -(-num_heads // tiles.block_h) * tiles.v_parts
    if num_splits is None:
        num_splits = _mla_configs.mla_decode_num_splits(platform, batch * grid_h,
                                                        block_table.shape[1] * block_size, cfg["BLOCK_N"],
                                                        1 if variant == "gluon" else tiles.programs_per_sm)
    num_splits = int(num_splits)
    lse = torch.empty((batch, num_heads) if return_lse else (1, 1), dtype=torch.float32, device=device)
    if num_splits > 1:
        part_out = torch.empty(batch, num_heads, num_splits, block_l, dtype=torch.float32, device=device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=device)
    else:
        part_out = part_lse = lse
    q = contiguous_last(q)
    kv_fp8 = kv_cache.dtype in FP8_DTYPES
    dummy = seq_lens
    args = (q, kv_cache, block_table, seq_lens, out, lse, part_out, part_lse,
            q_scale if q_fp8 else dummy, kv_scale if kv_fp8 else dummy, float(sm_scale),
            q.stride(0), q.stride(1), block_table.stride(0), kv_cache.stride(0), kv_cache.stride(1),
            out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
            num_heads, kv_lora_rank, width - kv_lora_rank, block_size)
    flags = dict(num_splits=num_splits, SPLIT=num_splits > 1, BLOCK_L=block_l, BLOCK_R=block_r, KV_FP8=kv_fp8, Q_FP8=q_fp8,
                 RETURN_LSE=return_lse)
    if variant == "gluon":
        launch_mla_decode_sm90(launch, q, kv_cache, block_table, seq_lens, out, lse, part_out, part_lse, sm_scale,
                               num_splits, return_lse, kv_lora_rank)
    else:
        lat_desc, pe_desc = tiles.descriptors or (kv_cache, kv_cache)
        emulate_rne = q_fp8 and _env.triton_interpret()  # fp8 probabilities: see tripath.kernels.quant
        launch(mla_decode_kernel, (batch, grid_h, num_splits), q, kv_cache, lat_desc, pe_desc, *args[2:],
               BLOCK_H=tiles.block_h, V_PARTS=tiles.v_parts, USE_TMA=tiles.descriptors is not None,
               SWAP_AB=tiles.swap_ab, PREFETCH=tiles.prefetch, ROW_LINES=tiles.row_lines,
               FP8_MAX=fp8_max(q.dtype) if q_fp8 else 0.0, EMULATE_RNE=emulate_rne, **flags, **cfg)
    if num_splits > 1:
        launch(
            reduce_splits_kernel, (batch, num_heads),
            part_out, part_lse, out, lse, dummy, dummy,
            out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), num_heads, kv_lora_rank,
            num_splits=num_splits, BLOCK_S=next_pow2(num_splits), BLOCK_DV=block_l,
            HAS_SINKS=False, RETURN_LSE=return_lse, SPLITS_USED=False, num_warps=4,
        )
    return (out, lse) if return_lse else out

