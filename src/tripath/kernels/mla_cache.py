"""Triton kernels that move MLA latent rows between the step's tensors and the paged cache.

The MLA cache is ``[num_blocks, block_size, L + R]``: each row is ``[kv_c (L) | k_pe (R)]`` (k_pe already
rotated). A token's slot is ``block_id * block_size + offset``. fp8 caches store ``sat(x / scale)`` and
read ``x * scale`` with one per-tensor scale.
"""

import triton
import triton.language as tl

from tripath.kernels.kv_cache import find_sequence, quantize_keep_nan
from tripath.triton_internals.specialize import STEP_INVARIANT


@triton.jit
def quantize(x, scale_ptr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """``sat(x / scale)`` (fp32) when ``QUANT``, else ``x`` as fp32; the caller casts. ``EMULATE_RNE`` (the
    interpreter only, see :mod:`tripath.kernels.quant`) rounds onto the e4m3 grid first; on GPUs the
    conversion rounds by itself, and the emulation's ~15 integer operations a value made the fused decode
    preparation at 128 heads issue-bound. NaN stays NaN."""
    x = x.to(tl.float32)
    if QUANT:
        x = quantize_keep_nan(x / tl.load(scale_ptr), FP8_MAX, EMULATE_RNE)
    return x


@triton.jit(**STEP_INVARIANT)
def concat_and_cache_mla_kernel(
    kv_c_ptr, k_pe_ptr, kv_cache_ptr, slot_mapping_ptr, scale_ptr,
    stride_kv_c_t, stride_k_pe_t, stride_c_block, stride_c_slot,
    kv_lora_rank, rope_dim, block_size, num_slots,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    """Program ``t`` writes the row ``[kv_c[t] | k_pe[t]]`` at ``slot_mapping[t]`` (skipped when negative or
    past the cache's ``num_slots``)."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    row = kv_cache_ptr + (slot // block_size) * stride_c_block + (slot % block_size) * stride_c_slot
    dims_l = tl.arange(0, BLOCK_L)
    dims_r = tl.arange(0, BLOCK_R)
    kv_c = tl.load(kv_c_ptr + token * stride_kv_c_t + dims_l, mask=dims_l < kv_lora_rank)
    k_pe = tl.load(k_pe_ptr + token * stride_k_pe_t + dims_r, mask=dims_r < rope_dim)
    out_ty = kv_cache_ptr.dtype.element_ty
    tl.store(row + dims_l, quantize(kv_c, scale_ptr, QUANT, FP8_MAX, EMULATE_RNE).to(out_ty),
             mask=dims_l < kv_lora_rank)
    tl.store(row + kv_lora_rank + dims_r, quantize(k_pe, scale_ptr, QUANT, FP8_MAX, EMULATE_RNE).to(out_ty),
             mask=dims_r < rope_dim)


@triton.jit(**STEP_INVARIANT)
def gather_mla_cache_kernel(
    kv_cache_ptr, block_table_ptr, cu_seqlens_ptr, seq_starts_ptr, out_ptr, scale_ptr,
    stride_bt, stride_c_block, stride_c_slot, stride_out_t,
    num_seqs, first_width, second_width, block_size,
    BLOCK_ROWS: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BINARY_STEPS: tl.constexpr,
    DEQUANT: tl.constexpr,
):
    """Program ``p`` copies output rows ``p·BLOCK_ROWS ..``: row ``r`` belongs to request ``i`` with
    ``cu[i] <= r < cu[i+1]`` and holds its cached position ``seq_starts[i] + r - cu[i]``; fp8 is
    dequantised. Rows past ``cu[num_seqs]`` are left alone. A row is copied as two power-of-two tiles of
    ``first_width`` and ``second_width`` values (the latent and rotary parts for DeepSeek)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < tl.load(cu_seqlens_ptr + num_seqs)
    seq = find_sequence(cu_seqlens_ptr, num_seqs, rows, BINARY_STEPS)
    pos = rows - tl.load(cu_seqlens_ptr + seq) + tl.load(seq_starts_ptr + seq)
    block = tl.load(block_table_ptr + seq.to(tl.int64) * stride_bt + pos // block_size, mask=row_ok,
                    other=0).to(tl.int64)
    src = (kv_cache_ptr + block * stride_c_block + (pos % block_size) * stride_c_slot)[:, None]
    dst = (out_ptr + rows.to(tl.int64) * stride_out_t)[:, None]
    dims_l = tl.arange(0, BLOCK_L)[None, :]
    dims_r = tl.arange(0, BLOCK_R)[None, :]
    lat_ok = row_ok[:, None] & (dims_l < first_width)
    pe_ok = row_ok[:, None] & (dims_r < second_width)
    lat = tl.load(src + dims_l, mask=lat_ok)
    pe = tl.load(src + first_width + dims_r, mask=pe_ok)
    if DEQUANT:
        scale = tl.load(scale_ptr)
        lat = lat.to(tl.float32) * scale
        pe = pe.to(tl.float32) * scale
    out_ty = out_ptr.dtype.element_ty
    tl.store(dst + dims_l, lat.to(out_ty), mask=lat_ok)
    tl.store(dst + first_width + dims_r, pe.to(out_ty), mask=pe_ok)
