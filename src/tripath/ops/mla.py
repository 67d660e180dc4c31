"""Multi-head latent attention (MLA) ops: cache write/gather, fused decode preparation (the absorbed decode:
:mod:`tripath.ops.mla_absorbed`).

Dims (DeepSeek V2/V3/R1, Kimi): latent ``L = kv_lora_rank`` (512), rotary ``R = qk_rope_head_dim`` (64),
per-head no-position ``P`` (128) and value ``V`` (128), ``H`` query heads::

    cache row  [ kv_c (L) | rope(k_pe) (R) ]           one KV head, kv_cache [num_blocks, block_size, L + R]
    query      [ ql_nope (L) | rope(q_pe) (R) ]        ql_nope = q_nope @ W_UK   ([T,H,P] x [H,P,L])
    absorbed:  o_lat[h] = softmax_j(sm_scale · q[h]·row_j) · kv_c_j   → o = o_lat @ W_UV  ([H,L] x [H,L,V])

``sm_scale`` is ``1/sqrt(P + R)`` (times the yarn mscale² where used), never ``1/sqrt(L + R)``: the caller
passes it. fp8 caches store ``sat(x / kv_scale)`` (e4m3, one per-tensor scale, a device tensor) and
read ``x · kv_scale``; an fp8 query likewise carries ``q_scale``.
"""

from __future__ import annotations

import torch

from tripath import _env
from tripath.kernels.mla_cache import concat_and_cache_mla_kernel, gather_mla_cache_kernel
from tripath.kernels.mla_prep import mla_prep_kernel
from tripath.ops import _configs, _mla_configs, reference_mla
from tripath.ops._checks import (FLOAT_DTYPES, check_block_table, check_gather_values, check_index, check_scale,
                                 check_slot_values, check_tensor, check_written, contiguous_last, next_pow2,
                                 values_checked)
from tripath.triton_internals import launch, use_triton
from tripath.ops.rotary import check_rotary_table
from tripath.platform import FP8_DTYPES, current_platform, fp8_max

CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES


def check_mla_cache(kv_cache: torch.Tensor, device: torch.device | None = None,
                    width: int | None = None) -> tuple[int, int, int]:
    """``(num_blocks, block_size, width)`` of an MLA cache ``[num_blocks, block_size, L + R]``."""
    check_tensor("kv_cache", kv_cache, ndim=3, dtypes=CACHE_DTYPES, device=device)
    if width is not None and kv_cache.shape[2] != width:
        raise ValueError(f"kv_cache rows have {kv_cache.shape[2]} values; expected {width} (kv_lora_rank + rope)")
    if kv_cache.stride(2) != 1:
        raise ValueError("kv_cache must be contiguous in its last dimension")
    if min(kv_cache.shape) < 1:
        raise ValueError(f"kv_cache must have positive num_blocks, block_size and row width, got shape "
                         f"{tuple(kv_cache.shape)}")
    return tuple(kv_cache.shape)


def allocate_mla_cache(num_blocks: int, block_size: int, kv_lora_rank: int = 512, rope_dim: int = 64, *,
                       dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zero-filled MLA cache ``[num_blocks, block_size, kv_lora_rank + rope_dim]``."""
    if dtype not in CACHE_DTYPES:
        raise TypeError(f"dtype={dtype} is not a supported MLA cache dtype; supported: {CACHE_DTYPES}")
    if num_blocks < 1 or block_size < 1 or kv_lora_rank < 1 or rope_dim < 1:
        raise ValueError(f"num_blocks ({num_blocks}), block_size ({block_size}), kv_lora_rank ({kv_lora_rank}) "
                         f"and rope_dim ({rope_dim}) must be positive")
    return torch.zeros(num_blocks, block_size, kv_lora_rank + rope_dim, dtype=dtype, device=device)


def _rope_2d(name: str, k_pe: torch.Tensor, num_tokens: int, device) -> torch.Tensor:
    """``k_pe`` as ``[T, R]`` (a ``[T, 1, R]`` view is accepted)."""
    check_tensor(name, k_pe, dtypes=FLOAT_DTYPES, device=device)
    if k_pe.dim() == 3 and k_pe.shape[1] == 1:
        k_pe = k_pe[:, 0]
    if k_pe.dim() != 2 or k_pe.shape[0] != num_tokens:
        raise ValueError(f"{name} must be [T, R] (or [T, 1, R]) with T={num_tokens}, got {tuple(k_pe.shape)}")
    return contiguous_last(k_pe)


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, *, kv_scale: torch.Tensor | None = None,
                         validate: bool | None = None) -> None:
    """Write the rows ``[kv_c | k_pe]`` of the step's tokens into the MLA cache.

    Parameters
    ----------
    kv_c : ``[T, L]`` normalised latent; k_pe : ``[T, R]`` (already rotated); fp16/bf16/fp32.
    kv_cache : ``[num_blocks, block_size, L + R]``; fp8 needs ``kv_scale`` (one-element fp32 tensor).
    slot_mapping : ``[T]`` int32/int64, ``block * block_size + offset``; negative slots are skipped, and so
        are slots past the cache (masked).
    validate : raise on slots past the cache instead: always for a host ``slot_mapping``; on a device when
        True or, with None, under ``TRIPATH_VALIDATE=1`` (a host sync).
    """
    check_tensor("kv_c", kv_c, ndim=2, dtypes=FLOAT_DTYPES)
    device = kv_c.device
    num_tokens, kv_lora_rank = kv_c.shape
    k_pe = _rope_2d("k_pe", k_pe, num_tokens, device)
    num_blocks, block_size, _ = check_mla_cache(kv_cache, device, kv_lora_rank + k_pe.shape[1])
    check_index("slot_mapping", slot_mapping, device)
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    check_scale("kv_scale", kv_scale, kv_cache.dtype, device)
    if values_checked(validate, slot_mapping):
        check_slot_values(slot_mapping, num_blocks * block_size)
    if not use_triton(device):
        return reference_mla.concat_and_cache_mla_ref(kv_c, k_pe, kv_cache, slot_mapping, kv_scale=kv_scale)
    kv_c = contiguous_last(kv_c)
    quant = kv_cache.dtype in FP8_DTYPES
    launch(
        concat_and_cache_mla_kernel, (num_tokens,),
        kv_c, k_pe, kv_cache, slot_mapping, kv_scale if quant else slot_mapping,
        kv_c.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        kv_lora_rank, k_pe.shape[1], block_size, kv_cache.shape[0] * block_size,
        BLOCK_L=next_pow2(kv_lora_rank), BLOCK_R=next_pow2(k_pe.shape[1]),
        QUANT=quant, FP8_MAX=fp8_max(kv_cache.dtype) if quant else 0.0,
        EMULATE_RNE=quant and _env.triton_interpret(),
        **_mla_configs.elementwise_config(current_platform(device)),
    )


def _row_split(width: int) -> int:
    """Where the gather cuts a row into two power-of-two tiles (512 | 64 for DeepSeek's 576)."""
    first = 1 << (width.bit_length() - 1)
    return first if first < width else max(1, width // 2)


def gather_mla_cache(kv_cache: torch.Tensor, block_table: torch.Tensor, cu_seqlens: torch.Tensor,
                     seq_starts: torch.Tensor, *, kv_scale: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                     kv_lora_rank: int | None = None, validate: bool | None = None) -> torch.Tensor:
    """Copy cached latent rows to a contiguous ``[T, L + R]`` tensor, dequantising fp8.

    Request ``i`` contributes its cached positions ``seq_starts[i] .. seq_starts[i] + n_i`` with
    ``n_i = cu_seqlens[i+1] - cu_seqlens[i]``, written to rows ``cu_seqlens[i] ..``. Rows of ``out`` past
    ``cu_seqlens[-1]`` are left untouched (workspaces may be larger than the chunk). Without ``out`` the
    total is read from the device (one host sync); its dtype is ``dtype`` or bf16 (fp8 cache) / the cache's.
    ``kv_lora_rank`` (optional) only says where the kernel cuts a row into its two tiles. ``validate``: check
    the offsets (from 0, non-decreasing, within ``out``), the positions (inside each row of the block table)
    and the block ids read — always for host tensors; on a device when True or, with None, under
    ``TRIPATH_VALIDATE=1`` (a host sync).
    """
    device = kv_cache.device
    num_blocks, block_size, width = check_mla_cache(kv_cache, device)
    if kv_lora_rank is not None and not 0 < kv_lora_rank < width:
        raise ValueError(f"kv_lora_rank={kv_lora_rank} must be between 1 and the row width - 1 ({width - 1})")
    check_block_table(block_table, device)
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=(torch.int32,), device=device)
    check_index("seq_starts", seq_starts, device)
    num_seqs = cu_seqlens.shape[0] - 1
    if num_seqs < 0 or block_table.shape[0] < num_seqs or seq_starts.shape[0] != num_seqs:
        raise ValueError(f"block_table ({block_table.shape[0]} rows) and seq_starts ({seq_starts.shape[0]}) must "
                         f"have one entry per request of cu_seqlens ({num_seqs})")
    fp8 = kv_cache.dtype in FP8_DTYPES
    check_scale("kv_scale", kv_scale, kv_cache.dtype, device)
    if out is None:
        dtype = dtype or (torch.bfloat16 if fp8 else kv_cache.dtype)
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype={dtype} is not supported for the gathered rows; supported: float16, "
                            "bfloat16, float32")
        out = torch.empty(int(cu_seqlens[-1].item()), width, dtype=dtype, device=device)
    check_tensor("out", out, ndim=2, dtypes=FLOAT_DTYPES, device=device, shape=(None, width))
    check_written("out", out)
    if values_checked(validate, block_table, cu_seqlens, seq_starts):
        check_gather_values(block_table, cu_seqlens, seq_starts, block_size, num_blocks, out.shape[0], "cu_seqlens")
    if not use_triton(device):
        return reference_mla.gather_mla_cache_ref(kv_cache, block_table, cu_seqlens, seq_starts,
                                                  kv_scale=kv_scale, out=out)
    cfg = dict(_mla_configs.gather_config(current_platform(device)))
    block_rows = cfg.pop("BLOCK_ROWS")
    first = kv_lora_rank if kv_lora_rank is not None else _row_split(width)
    launch(
        gather_mla_cache_kernel, (-(-out.shape[0] // block_rows),),
        kv_cache, block_table, cu_seqlens, seq_starts, out, kv_scale if fp8 else cu_seqlens,
        block_table.stride(0), kv_cache.stride(0), kv_cache.stride(1), out.stride(0),
        num_seqs, first, width - first, block_size,
        BLOCK_ROWS=block_rows, BLOCK_L=next_pow2(first), BLOCK_R=next_pow2(width - first),
        BINARY_STEPS=_configs.binary_steps(num_seqs), DEQUANT=fp8, **cfg,
    )
    return out


def _check_prep_query(ql_nope, q_pe, q_out):
    check_tensor("ql_nope", ql_nope, ndim=3, dtypes=FLOAT_DTYPES)
    device = ql_nope.device
    num_tokens, num_heads, kv_lora_rank = ql_nope.shape
    check_tensor("q_pe", q_pe, ndim=3, dtypes=FLOAT_DTYPES, device=device, shape=(num_tokens, num_heads, None))
    rope_dim = q_pe.shape[2]
    check_tensor("q_out", q_out, ndim=3, dtypes=CACHE_DTYPES, device=device,
                 shape=(num_tokens, num_heads, kv_lora_rank + rope_dim))
    check_written("q_out", q_out)
    return device, num_tokens, num_heads, kv_lora_rank, rope_dim


def _launch_prep(ql_nope, q_pe, kv_c, k_pe, kv_cache, q_out, slot_mapping, k_scale, q_scale, positions, cos, sin,
                 *, is_neox, is_nope_first, write_cache):
    num_tokens, num_heads, kv_lora_rank = ql_nope.shape
    rope_dim = q_pe.shape[2]
    device = ql_nope.device
    cfg = dict(_mla_configs.mla_prep_config(current_platform(device), num_heads))
    block_h = cfg.pop("BLOCK_H")
    quant_q = q_out.dtype in FP8_DTYPES
    quant_k = write_cache and kv_cache.dtype in FP8_DTYPES
    apply_rope = cos is not None
    dummy = slot_mapping if slot_mapping is not None else q_out
    ql_nope, q_pe = contiguous_last(ql_nope), contiguous_last(q_pe)
    kv_c = contiguous_last(kv_c) if write_cache else ql_nope
    k_pe = k_pe if write_cache else ql_nope
    cache = kv_cache if write_cache else q_out
    launch(
        mla_prep_kernel, (num_tokens, -(-num_heads // block_h)),
        ql_nope, q_pe, kv_c, k_pe, cache, q_out, dummy,
        k_scale if quant_k else dummy, q_scale if quant_q else dummy,
        positions if apply_rope else dummy, cos if apply_rope else dummy, sin if apply_rope else dummy,
        ql_nope.stride(0), ql_nope.stride(1), q_pe.stride(0), q_pe.stride(1), kv_c.stride(0), k_pe.stride(0),
        cache.stride(0), cache.stride(1), q_out.stride(0), q_out.stride(1),
        cos.stride(0) if apply_rope else 0, sin.stride(0) if apply_rope else 0,
        num_heads, kv_lora_rank, rope_dim, cache.shape[1], cos.shape[0] if apply_rope else 1,
        cache.shape[0] * cache.shape[1],
        BLOCK_H=block_h, BLOCK_L=next_pow2(kv_lora_rank), BLOCK_R=next_pow2(rope_dim),
        BLOCK_HALF=next_pow2(max(1, rope_dim // 2)),
        APPLY_ROPE=apply_rope, IS_NEOX=bool(is_neox), NOPE_FIRST=bool(is_nope_first), WRITE_CACHE=write_cache,
        QUANT_Q=quant_q, QUANT_K=quant_k, FP8_MAX_Q=fp8_max(q_out.dtype) if quant_q else 0.0,
        FP8_MAX_K=fp8_max(kv_cache.dtype) if quant_k else 0.0,
        EMULATE_RNE=(quant_q or quant_k) and _env.triton_interpret(), **cfg,
    )


def concat_mla_query(ql_nope: torch.Tensor, q_pe: torch.Tensor, q_out: torch.Tensor, *,
                     q_scale: torch.Tensor | None = None, is_nope_first: bool = True) -> torch.Tensor:
    """The unfused query preparation: ``q_out = quant([ql_nope | q_pe] / q_scale)`` (``[q_pe | ql_nope]``
    when not ``is_nope_first``); ``q_pe`` is used as given (rotate it first). ``q_out [T, H, L + R]`` fp8
    (needs ``q_scale``) or fp16/bf16/fp32 (no scaling). Returns ``q_out``."""
    device, *_ = _check_prep_query(ql_nope, q_pe, q_out)
    check_scale("q_scale", q_scale, q_out.dtype, device)
    if not use_triton(device):
        return reference_mla.concat_mla_query_ref(ql_nope, q_pe, q_out, q_scale=q_scale,
                                                  is_nope_first=is_nope_first)
    _launch_prep(ql_nope, q_pe, None, None, None, q_out, None, None, q_scale, None, None, None,
                 is_neox=True, is_nope_first=is_nope_first, write_cache=False)
    return q_out


def fused_qk_rope_concat_and_cache_mla(
    ql_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
    q_out: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None, q_scale: torch.Tensor | None,
    positions: torch.Tensor | None, cos_cache: torch.Tensor | None, sin_cache: torch.Tensor | None, *,
    is_neox: bool = True, is_nope_first: bool = True, validate: bool | None = None,
) -> None:
    """One launch: rotate ``q_pe``/``k_pe``, write ``q_out`` and the cache rows (the fused decode preparation of vLLM's ROCm MLA backend).

    ``q_out[t, h] = quant([ql_nope | rope(q_pe)] / q_scale)`` and, for ``slot_mapping[t] >= 0``,
    ``kv_cache[slot] = quant([kv_c | rope(k_pe)] / k_scale)``; with ``is_nope_first=False`` both the query
    and the cache row are ordered ``[rope | nope]`` (tripath's decode reads nope-first rows). ``quant`` is
    ``sat(·)`` to e4m3 for fp8 destinations (then the scale is required) and a plain cast otherwise. The
    query is written for every token, padding included.

    Parameters
    ----------
    ql_nope : ``[T, H, L]`` (``q_nope @ W_UK``); q_pe : ``[T, H, R]``; kv_c : ``[T, L]``; k_pe : ``[T, R]``.
    kv_cache : ``[num_blocks, block_size, L + R]``; q_out : ``[T, H, L + R]``.
    slot_mapping : ``[T]`` int32/int64; k_scale, q_scale : one-element fp32 tensors or None.
    positions : ``[T]`` int; cos_cache, sin_cache : ``[max_position, R / 2]``, positions clamped into them
        (a one-row identity table serves NoPE models). All three None: no rotation at all (a constexpr path).
    is_neox : NeoX pairs ``(i, i + R/2)``; False: GPT-J interleaved pairs ``(2i, 2i + 1)``.
    validate : raise on slots past the cache (otherwise masked): always for a host ``slot_mapping``; on a
        device when True or, with None, under ``TRIPATH_VALIDATE=1`` (a host sync).
    """
    device, num_tokens, num_heads, kv_lora_rank, rope_dim = _check_prep_query(ql_nope, q_pe, q_out)
    check_tensor("kv_c", kv_c, ndim=2, dtypes=FLOAT_DTYPES, device=device, shape=(num_tokens, kv_lora_rank))
    k_pe = _rope_2d("k_pe", k_pe, num_tokens, device)
    if k_pe.shape[1] != rope_dim:
        raise ValueError(f"k_pe has {k_pe.shape[1]} rotary dims but q_pe has {rope_dim}")
    num_blocks, block_size, _ = check_mla_cache(kv_cache, device, kv_lora_rank + rope_dim)
    check_index("slot_mapping", slot_mapping, device)
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    check_scale("k_scale", k_scale, kv_cache.dtype, device)
    check_scale("q_scale", q_scale, q_out.dtype, device)
    if values_checked(validate, slot_mapping):
        check_slot_values(slot_mapping, num_blocks * block_size)
    given = [x is not None for x in (positions, cos_cache, sin_cache)]
    if any(given) and not all(given):
        raise ValueError("positions, cos_cache and sin_cache must be given together (or all None: no rotation)")
    if all(given):
        check_index("positions", positions, device)
        if positions.shape[0] != num_tokens:
            raise ValueError(f"positions has {positions.shape[0]} entries for {num_tokens} tokens")
        if rope_dim % 2:
            raise ValueError(f"the rotary dim (q_pe.shape[-1] = {rope_dim}) must be even to rotate pairs")
        check_rotary_table("cos_cache", cos_cache, device, rope_dim // 2)
        check_rotary_table("sin_cache", sin_cache, device, rope_dim // 2)
        if sin_cache.shape != cos_cache.shape:
            raise ValueError(f"sin_cache {tuple(sin_cache.shape)} and cos_cache {tuple(cos_cache.shape)} differ")
    for name, flag in (("is_neox", is_neox), ("is_nope_first", is_nope_first)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if not use_triton(device):
        return reference_mla.fused_qk_rope_concat_and_cache_mla_ref(
            ql_nope, q_pe, kv_c, k_pe, kv_cache, q_out, slot_mapping, k_scale, q_scale, positions, cos_cache,
            sin_cache, is_neox=is_neox, is_nope_first=is_nope_first)
    _launch_prep(ql_nope, q_pe, kv_c, k_pe, kv_cache, q_out, slot_mapping, k_scale, q_scale, positions,
                 cos_cache, sin_cache, is_neox=is_neox, is_nope_first=is_nope_first, write_cache=True)
