"""Fused MLA decode preparation: RoPE on ``q_pe``/``k_pe``, query concat + quantisation, cache write.

One launch replaces the cache write (``concat_and_cache_mla``) and the query preparation of an absorbed
MLA decode step. For token ``t`` and head ``h`` (``L`` latent, ``R`` rotary dims):

    q_out[t, h]   = quant([ql_nope[t, h] | rope(q_pe[t, h])] / q_scale)     ([rope | nope] if not NOPE_FIRST)
    cache[slot_t] = quant([kv_c[t]       | rope(k_pe[t])]    / k_scale)     (skipped unless 0 <= slot_t < num_slots)

``quant`` is ``sat(·)`` cast to e4m3 when the destination is fp8, a plain cast otherwise (then the scale is
not applied). Rotated values are rounded to the input dtype before quantisation, exactly as the unfused
path (in-place ``rotary_embedding``, then the concat) does, so both give the same bits. Grid
``(T, cdiv(H, BLOCK_H))``; head block 0 writes the cache row. With ``APPLY_ROPE`` off the rotation is
skipped; with ``WRITE_CACHE`` off the kernel is the unfused query concat.
"""

import triton
import triton.language as tl

from tripath.kernels.mla_cache import quantize
from tripath.kernels.rotary import load_cos_sin, rope_pair_dims, rotate_interleaved, rotate_pairs
from tripath.triton_internals.specialize import STEP_INVARIANT


@triton.jit
def _store_quantized(ptrs, x, mask, scale_ptr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
                     EMULATE_RNE: tl.constexpr):
    tl.store(ptrs, quantize(x, scale_ptr, QUANT, FP8_MAX, EMULATE_RNE).to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _rope_part(src, dst, row_ok, cos, sin, d1, d2, pair_ok, rope_dim, scale_ptr,
               BLOCK_R: tl.constexpr, APPLY_ROPE: tl.constexpr, IS_NEOX: tl.constexpr, QUANT: tl.constexpr,
               FP8_MAX: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """Rows ``src [M, 1]`` (pointers to each row's rotary part) → ``dst [M, 1]``, rotated and quantised."""
    if APPLY_ROPE and not IS_NEOX:  # interleaved pairs: one contiguous run per row (BLOCK_R = 2 · BLOCK_HALF)
        dims = tl.arange(0, BLOCK_R)
        mask = row_ok & (dims[None, :] < rope_dim)
        x = tl.load(src + dims[None, :], mask=mask, other=0.0)
        _store_quantized(dst + dims[None, :], rotate_interleaved(x, cos, sin), mask, scale_ptr, QUANT, FP8_MAX,
                         EMULATE_RNE)
    elif APPLY_ROPE:
        mask = row_ok & pair_ok[None, :]
        x1 = tl.load(src + d1[None, :], mask=mask, other=0.0)
        x2 = tl.load(src + d2[None, :], mask=mask, other=0.0)
        y1, y2 = rotate_pairs(x1.to(tl.float32), x2.to(tl.float32), cos[None, :], sin[None, :])
        _store_quantized(dst + d1[None, :], y1.to(x1.dtype), mask, scale_ptr, QUANT, FP8_MAX, EMULATE_RNE)
        _store_quantized(dst + d2[None, :], y2.to(x2.dtype), mask, scale_ptr, QUANT, FP8_MAX, EMULATE_RNE)
    else:
        dims = tl.arange(0, BLOCK_R)
        mask = row_ok & (dims[None, :] < rope_dim)
        x = tl.load(src + dims[None, :], mask=mask, other=0.0)
        _store_quantized(dst + dims[None, :], x, mask, scale_ptr, QUANT, FP8_MAX, EMULATE_RNE)


@triton.jit(**STEP_INVARIANT)
def mla_prep_kernel(
    ql_nope_ptr, q_pe_ptr, kv_c_ptr, k_pe_ptr, kv_cache_ptr, q_out_ptr, slot_mapping_ptr,
    k_scale_ptr, q_scale_ptr, positions_ptr, cos_ptr, sin_ptr,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_kv_c_t, stride_k_pe_t,
    stride_c_block, stride_c_slot, stride_qo_t, stride_qo_h, stride_cos, stride_sin,
    num_heads, kv_lora_rank, rope_dim, block_size, max_position, num_slots,
    BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
    APPLY_ROPE: tl.constexpr, IS_NEOX: tl.constexpr, NOPE_FIRST: tl.constexpr, WRITE_CACHE: tl.constexpr,
    QUANT_Q: tl.constexpr, QUANT_K: tl.constexpr, FP8_MAX_Q: tl.constexpr, FP8_MAX_K: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    """Program ``(t, head block)``: rotate token ``t``'s ``q_pe`` for ``BLOCK_H`` heads and write their
    ``q_out`` rows; the first head block also rotates ``k_pe`` and writes the cache row (module docstring)."""
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    if NOPE_FIRST:
        nope_at = 0
        rope_at = kv_lora_rank
    else:
        nope_at = rope_dim
        rope_at = 0
    # The loads that depend on nothing are issued first, so their latencies overlap: the query's latent part,
    # the slot and (head block 0) the cache row's latent part. The position -> cos/sin chain comes after.
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = (heads < num_heads)[:, None]
    dims_l = tl.arange(0, BLOCK_L)
    nope_mask = head_ok & (dims_l[None, :] < kv_lora_rank)
    ql = tl.load(ql_nope_ptr + token * stride_qn_t + heads[:, None] * stride_qn_h + dims_l[None, :],
                 mask=nope_mask, other=0.0)
    lat_ok = (dims_l < kv_lora_rank) & (head_block == 0)
    if WRITE_CACHE:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        kv_c = tl.load(kv_c_ptr + token * stride_kv_c_t + dims_l, mask=lat_ok, other=0.0)

    # The query: every head of this block.
    q_row = q_out_ptr + token * stride_qo_t + heads[:, None] * stride_qo_h
    _store_quantized(q_row + nope_at + dims_l[None, :], ql, nope_mask, q_scale_ptr, QUANT_Q, FP8_MAX_Q,
                     EMULATE_RNE)
    pair, d1, d2, pair_ok = rope_pair_dims(BLOCK_HALF, rope_dim // 2, IS_NEOX)
    if APPLY_ROPE:
        cos, sin = load_cos_sin(positions_ptr, token, max_position, cos_ptr, sin_ptr, stride_cos, stride_sin,
                                pair, pair_ok)
    else:
        cos = tl.full([BLOCK_HALF], 1.0, tl.float32)
        sin = tl.zeros([BLOCK_HALF], tl.float32)
    _rope_part(q_pe_ptr + token * stride_qp_t + heads[:, None] * stride_qp_h, q_row + rope_at, head_ok,
               cos, sin, d1, d2, pair_ok, rope_dim, q_scale_ptr, BLOCK_R, APPLY_ROPE, IS_NEOX, QUANT_Q, FP8_MAX_Q,
               EMULATE_RNE)

    # The cache row, once per token (head block 0).
    if WRITE_CACHE:
        if (head_block == 0) & (slot >= 0) & (slot < num_slots):
            row = kv_cache_ptr + (slot // block_size) * stride_c_block + (slot % block_size) * stride_c_slot
            _store_quantized(row + nope_at + dims_l, kv_c, lat_ok, k_scale_ptr, QUANT_K, FP8_MAX_K,
                             EMULATE_RNE)
            one_row = tl.zeros([1, 1], tl.int64)
            _rope_part(k_pe_ptr + token * stride_k_pe_t + one_row, row + rope_at + one_row, one_row == 0,
                       cos, sin, d1, d2, pair_ok, rope_dim, k_scale_ptr, BLOCK_R, APPLY_ROPE, IS_NEOX, QUANT_K,
                       FP8_MAX_K, EMULATE_RNE)
