"""Triton kernels that move K/V rows between the step's tensors and the paged cache.

NHD cache: K, V ``[num_blocks, block_size, H, D]``. Shuffled cache (x = 16 bytes / element size):
K ``[num_blocks, H, D // x, block_size, x]``, V ``[num_blocks, H, block_size // x, D, x]``. A kernel addresses
both through one helper, :func:`kv_offsets`, that turns (slot offset, head, dim) into element offsets.
"""

import triton
import triton.language as tl

from tripath.kernels.quant import fp8_round
from tripath.triton_internals.specialize import STEP_INVARIANT


@triton.jit
def kv_offsets(
    block_ids,  # physical block of each row (any shape broadcastable with the others)
    slot_offsets,  # offset inside the block
    heads,
    dims,
    stride_k0,
    stride_k1,
    stride_k2,
    stride_k3,
    stride_v0,
    stride_v1,
    stride_v2,
    stride_v3,
    SHUFFLED: tl.constexpr,
    X: tl.constexpr,
):
    """Element offsets of (block, slot, head, dim) in the K and V caches of either layout."""
    if SHUFFLED:
        k_off = (block_ids * stride_k0 + heads * stride_k1 + (dims // X) * stride_k2
                 + slot_offsets * stride_k3 + dims % X)
        v_off = (block_ids * stride_v0 + heads * stride_v1 + (slot_offsets // X) * stride_v2
                 + dims * stride_v3 + slot_offsets % X)
    else:
        k_off = block_ids * stride_k0 + slot_offsets * stride_k1 + heads * stride_k2 + dims * stride_k3
        v_off = block_ids * stride_v0 + slot_offsets * stride_v1 + heads * stride_v2 + dims * stride_v3
    return k_off, v_off


@triton.jit
def quantize_keep_nan(x, FP8_MAX: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """:func:`fp8_round` of fp32 ``x`` with NaN kept NaN, as the reference stores it (the saturating clamp
    alone may make it finite). The NaN is re-made as ``0x7FF00000`` (with its sign), so that a conversion that
    converts bit by bit (Triton's interpreter: the top three mantissa bits, rounded by the next) still lands
    on e4m3's NaN (all exponent and mantissa bits set)."""
    nan = ((x.to(tl.int32, bitcast=True) & -2147483648) | 0x7FF00000).to(tl.float32, bitcast=True)
    return tl.where(x == x, fp8_round(x, FP8_MAX, EMULATE_RNE), nan)


@triton.jit(**STEP_INVARIANT)
def write_kv_cache_kernel(
    key_ptr, value_ptr,  # [T, H, D]
    k_cache_ptr, v_cache_ptr,
    slot_mapping_ptr,  # [T] int64, negative or >= num_slots = skip
    k_scale_ptr, v_scale_ptr,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_k0, stride_k1, stride_k2, stride_k3,
    stride_v0, stride_v1, stride_v2, stride_v3,
    num_kv_heads, head_size, block_size, num_slots,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    SHUFFLED: tl.constexpr, X: tl.constexpr,
    QUANT: tl.constexpr, FP8_MAX: tl.constexpr, EMULATE_RNE: tl.constexpr,
):
    """Program ``t``: token ``t``'s K and V rows into their cache slot (skipped for a negative slot);
    fp8 caches store ``sat(x / scale)``. Layout (NHD or shuffled) as in the module docstring."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_size)
    k = tl.load(key_ptr + token * stride_key_t + heads * stride_key_h + dims, mask=mask).to(tl.float32)
    v = tl.load(value_ptr + token * stride_value_t + heads * stride_value_h + dims, mask=mask).to(tl.float32)
    if QUANT:
        k = quantize_keep_nan(k / tl.load(k_scale_ptr), FP8_MAX, EMULATE_RNE)
        v = quantize_keep_nan(v / tl.load(v_scale_ptr), FP8_MAX, EMULATE_RNE)
    k_off, v_off = kv_offsets(block, offset, heads, dims,
                              stride_k0, stride_k1, stride_k2, stride_k3,
                              stride_v0, stride_v1, stride_v2, stride_v3, SHUFFLED, X)
    tl.store(k_cache_ptr + k_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + v_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def find_sequence(cu_seqlens_ptr, num_seqs, row, BINARY_STEPS: tl.constexpr):
    """Index ``i`` with ``cu_seqlens[i] <= row < cu_seqlens[i + 1]`` (binary search, ``num_seqs`` requests).
    ``row`` may be a scalar or a tensor of rows; the search carries values of the same shape."""
    lo = row * 0
    hi = row * 0 + num_seqs
    for _ in range(BINARY_STEPS):
        mid = (lo + hi) // 2
        go_right = tl.load(cu_seqlens_ptr + mid) <= row
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit(**STEP_INVARIANT)
def gather_kv_cache_kernel(
    k_cache_ptr, v_cache_ptr,
    block_table_ptr, cu_seqlens_ptr, seq_starts_ptr,
    out_k_ptr, out_v_ptr,  # [T, H, D]
    k_scale_ptr, v_scale_ptr,
    stride_bt,
    stride_k0, stride_k1, stride_k2, stride_k3,
    stride_v0, stride_v1, stride_v2, stride_v3,
    stride_ok_t, stride_ok_h, stride_ov_t, stride_ov_h,
    num_seqs, num_kv_heads, head_size, block_size,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BINARY_STEPS: tl.constexpr,
    SHUFFLED: tl.constexpr, X: tl.constexpr, DEQUANT: tl.constexpr,
):
    """Program ``r``: one gathered row of the contiguous output, i.e. context token ``seq_starts[b] + i`` of
    request ``b`` read through its block-table row (fp8 caches dequantised by ``x * scale``)."""
    row = tl.program_id(0)
    if row >= tl.load(cu_seqlens_ptr + num_seqs):
        return
    seq = find_sequence(cu_seqlens_ptr, num_seqs, row, BINARY_STEPS)
    pos = row - tl.load(cu_seqlens_ptr + seq) + tl.load(seq_starts_ptr + seq)
    block = tl.load(block_table_ptr + seq * stride_bt + pos // block_size).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_size)
    k_off, v_off = kv_offsets(block, pos % block_size, heads, dims,
                              stride_k0, stride_k1, stride_k2, stride_k3,
                              stride_v0, stride_v1, stride_v2, stride_v3, SHUFFLED, X)
    k = tl.load(k_cache_ptr + k_off, mask=mask)
    v = tl.load(v_cache_ptr + v_off, mask=mask)
    if DEQUANT:
        k = k.to(tl.float32) * tl.load(k_scale_ptr)
        v = v.to(tl.float32) * tl.load(v_scale_ptr)
    row64 = row.to(tl.int64)
    tl.store(out_k_ptr + row64 * stride_ok_t + heads * stride_ok_h + dims,
             k.to(out_k_ptr.dtype.element_ty), mask=mask)
    tl.store(out_v_ptr + row64 * stride_ov_t + heads * stride_ov_h + dims,
             v.to(out_v_ptr.dtype.element_ty), mask=mask)
