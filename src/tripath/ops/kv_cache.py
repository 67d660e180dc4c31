"""Paged KV cache: layouts, allocation, writing the step's K/V, gathering rows back to contiguous.

Layouts (``x = 16 // element_size``: 8 for 16-bit caches, 16 for fp8):

- ``"nhd"``: K and V ``[num_blocks, block_size, num_kv_heads, head_size]``.
- ``"shuffled"``: K ``[num_blocks, num_kv_heads, head_size // x, block_size, x]`` and
  V ``[num_blocks, num_kv_heads, block_size // x, head_size, x]``; element ``(b, h, s, d)`` of K is
  ``K[b, h, d // x, s, d % x]`` and of V ``V[b, h, s // x, d, s % x]``. Needs ``block_size % x == 0``.

A token's slot is ``block_id * block_size + offset``; block 0 is reserved by the engine, so a zero in a
padded block table reads harmless data. fp8 caches store ``sat(x / scale)`` and read ``x * scale``.
"""

from __future__ import annotations

import torch

from tripath import _env
from tripath.kernels.decode_advance import advance_decodes_kernel
from tripath.kernels.kv_cache import gather_kv_cache_kernel, write_kv_cache_kernel
from tripath.constants import KV_LAYOUTS
from tripath.ops import _configs
from tripath.ops._checks import (FLOAT_DTYPES, check_block_table, check_gather_values, check_index, check_scale,
                                 check_slot_values, check_tensor, next_pow2, values_checked)
from tripath.triton_internals import launch, use_triton
from tripath.platform import FP8_DTYPES, fp8_max

LAYOUTS = KV_LAYOUTS
CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES


def shuffle_width(dtype: torch.dtype) -> int:
    """``x``: elements per 16-byte vector of the shuffled layout."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def check_layout(layout: str, block_size: int, dtype: torch.dtype) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; supported: {', '.join(LAYOUTS)}")
    if layout == "shuffled" and block_size % shuffle_width(dtype) != 0:
        raise ValueError(
            f"block_size={block_size} is not supported by the shuffled layout with {dtype}: "
            f"it must be a multiple of {shuffle_width(dtype)}"
        )


def kv_cache_shapes(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                    dtype: torch.dtype, layout: str = "nhd") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the K and V caches of a layout."""
    check_layout(layout, block_size, dtype)
    if layout == "nhd":
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        return shape, shape
    x = shuffle_width(dtype)
    if head_size % x != 0:
        raise ValueError(f"head_size={head_size} must be a multiple of {x} for the shuffled layout")
    return ((num_blocks, num_kv_heads, head_size // x, block_size, x),
            (num_blocks, num_kv_heads, block_size // x, head_size, x))


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, *,
                      dtype: torch.dtype = torch.bfloat16, layout: str = "nhd",
                      device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate ``(k_cache, v_cache)`` of ``layout`` (zero-filled, so block 0 holds harmless values)."""
    if dtype not in CACHE_DTYPES:
        raise TypeError(f"dtype={dtype} is not a supported KV cache dtype; supported: {CACHE_DTYPES}")
    for name, n in (("num_blocks", num_blocks), ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                    ("head_size", head_size)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    k_shape, v_shape = kv_cache_shapes(num_blocks, block_size, num_kv_heads, head_size, dtype, layout)
    return (torch.zeros(k_shape, dtype=dtype, device=device),
            torch.zeros(v_shape, dtype=dtype, device=device))


def cache_geometry(k_cache: torch.Tensor, v_cache: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """``(num_blocks, block_size, num_kv_heads, head_size)`` of a cache pair, validating the shapes."""
    check_tensor("k_cache", k_cache, dtypes=CACHE_DTYPES)
    check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), device=k_cache.device)
    if layout == "nhd":
        check_tensor("k_cache", k_cache, ndim=4)
        num_blocks, block_size, num_kv_heads, head_size = k_cache.shape
        check_tensor("v_cache", v_cache, ndim=4, shape=(num_blocks, block_size, num_kv_heads, None))
    elif layout == "shuffled":
        check_tensor("k_cache", k_cache, ndim=5)
        num_blocks, num_kv_heads, d_over_x, block_size, x = k_cache.shape
        if x != shuffle_width(k_cache.dtype):
            raise ValueError(f"k_cache's last dimension must be {shuffle_width(k_cache.dtype)} for "
                             f"{k_cache.dtype} in the shuffled layout, got {x}")
        head_size = d_over_x * x
        check_tensor("v_cache", v_cache, ndim=5, shape=(num_blocks, num_kv_heads, block_size // x, None, x))
    else:
        check_layout(layout, 16, k_cache.dtype)
        raise AssertionError
    check_layout(layout, block_size, k_cache.dtype)
    head_size_v = v_cache.shape[3]
    for name, n in (("num_blocks", num_blocks), ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                    ("head_size", head_size), ("value head_size", head_size_v)):
        if n < 1:
            raise ValueError(f"k_cache/v_cache: {name} must be positive, got a cache of shape "
                             f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    return num_blocks, block_size, num_kv_heads, head_size


def cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    """The first four strides of K then V (the fifth, x, is contiguous in the shuffled layout)."""
    return tuple(k_cache.stride()[:4]) + tuple(v_cache.stride()[:4])


def as_nhd(k_cache: torch.Tensor, v_cache: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """NHD views/copies ``[num_blocks, block_size, H, D]`` of a cache pair of either layout."""
    if layout == "nhd":
        return k_cache, v_cache
    nb, h, dx, bs, x = k_cache.shape
    k = k_cache.permute(0, 3, 1, 2, 4).reshape(nb, bs, h, dx * x)
    v = v_cache.permute(0, 2, 4, 1, 3).reshape(nb, bs, h, v_cache.shape[3])
    return k, v


def dequantize(t: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """float32 copy of cache values, times ``scale`` for fp8."""
    t = t.float()
    return t * scale.float() if scale is not None and scale.numel() > 0 else t


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, *, layout: str = "nhd", k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None, validate: bool | None = None) -> None:
    """Write the step's keys/values ``[T, H, D]`` into the paged cache at ``slot_mapping [T]``.

    Negative slots are skipped (padding), and so are slots past the cache's ``num_blocks * block_size`` (the
    kernel masks them). ``validate``: raise on such slots instead — always for a host ``slot_mapping``; on a
    device when True or, with None, under ``TRIPATH_VALIDATE=1`` (a host sync). fp8 caches store
    ``sat(x / scale)`` (NaN stays NaN).
    """
    num_blocks, block_size, num_kv_heads, head_size = cache_geometry(k_cache, v_cache, layout)
    device = k_cache.device
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES, device=device, shape=(None, num_kv_heads, head_size))
    check_tensor("value", value, ndim=3, dtypes=FLOAT_DTYPES, device=device,
                 shape=(key.shape[0], num_kv_heads, None))
    if value.shape[2] != (v_cache.shape[3] if layout == "nhd" else v_cache.shape[3]):
        raise ValueError(f"value's head size {value.shape[2]} does not match v_cache")
    check_index("slot_mapping", slot_mapping, device)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    quant = k_cache.dtype in FP8_DTYPES
    check_scale("k_scale", k_scale, k_cache.dtype, device)
    check_scale("v_scale", v_scale, k_cache.dtype, device)
    num_slots = num_blocks * block_size
    if values_checked(validate, slot_mapping):
        check_slot_values(slot_mapping, num_slots)
    if not use_triton(device):
        return write_kv_cache_ref(key, value, k_cache, v_cache, slot_mapping, layout=layout,
                                  k_scale=k_scale, v_scale=v_scale)
    key = key if key.stride(2) == 1 else key.contiguous()
    value = value if value.stride(2) == 1 else value.contiguous()
    dummy = slot_mapping
    launch(
        write_kv_cache_kernel, (key.shape[0],),
        key, value, k_cache, v_cache, slot_mapping,
        k_scale if quant else dummy, v_scale if quant else dummy,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *cache_strides(k_cache, v_cache),
        num_kv_heads, head_size, block_size, num_slots,
        BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_size),
        SHUFFLED=layout == "shuffled", X=shuffle_width(k_cache.dtype),
        QUANT=quant, **fp8_store_constexprs(k_cache.dtype),
        num_warps=4,
    )


def fp8_store_constexprs(dtype: torch.dtype) -> dict:
    """Constexprs of :func:`tripath.kernels.quant.fp8_round` for a cache dtype (any dtype; unused if not fp8)."""
    is_fp8 = dtype in FP8_DTYPES
    return {"FP8_MAX": fp8_max(dtype) if is_fp8 else 0.0,
            "EMULATE_RNE": is_fp8 and _env.triton_interpret()}


def write_kv_cache_ref(key, value, k_cache, v_cache, slot_mapping, *, layout="nhd", k_scale=None,
                       v_scale=None) -> None:
    """PyTorch reference of :func:`write_kv_cache` (also the CPU path)."""
    block_size = k_cache.shape[1] if layout == "nhd" else k_cache.shape[3]
    keep = (slot_mapping >= 0) & (slot_mapping < k_cache.shape[0] * block_size)
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k, v = key[keep].float(), value[keep].float()
    if k_cache.dtype in FP8_DTYPES:
        limit = fp8_max(k_cache.dtype)
        k = (k / k_scale.float()).clamp(-limit, limit)
        v = (v / v_scale.float()).clamp(-limit, limit)
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    if layout == "nhd":
        k_cache[blocks, offsets] = k
        v_cache[blocks, offsets] = v
        return
    x = k_cache.shape[-1]
    t, h, d = k.shape
    heads = torch.arange(h, device=k.device)
    dims = torch.arange(d, device=k.device)
    b = blocks[:, None, None]
    o = offsets[:, None, None]
    hh = heads[None, :, None]
    dd = dims[None, None, :]
    k_cache[b, hh, dd // x, o, dd % x] = k
    dv = torch.arange(v.shape[2], device=v.device)[None, None, :]
    v_cache[b, hh, o // x, dv, o % x] = v


def gather_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, seq_starts: torch.Tensor, *, layout: str = "nhd",
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    out_k: torch.Tensor | None = None, out_v: torch.Tensor | None = None,
                    dtype: torch.dtype | None = None,
                    validate: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy paged rows to contiguous ``[T, H, D]`` tensors, dequantising fp8.

    Request ``i`` contributes its cached tokens ``seq_starts[i] .. seq_starts[i] + n_i`` with
    ``n_i = cu_seqlens_k[i+1] - cu_seqlens_k[i]``, written to rows ``cu_seqlens_k[i] ..``. Rows of ``out_k``
    past ``cu_seqlens_k[-1]`` are left untouched (workspaces may be larger than the chunk). Without
    ``out_k``/``out_v`` the total is read from the device (one host sync). ``validate``: check the offsets
    (from 0, non-decreasing, within ``out_k``), the positions (inside each row of the block table) and the
    block ids read (``[0, num_blocks)``) — always for host tensors; on a device when True or, with None,
    under ``TRIPATH_VALIDATE=1`` (a host sync).
    """
    num_blocks, block_size, num_kv_heads, head_size = cache_geometry(k_cache, v_cache, layout)
    device = k_cache.device
    check_block_table(block_table, device)
    check_index("cu_seqlens_k", cu_seqlens_k, device)
    check_index("seq_starts", seq_starts, device)
    num_seqs = cu_seqlens_k.shape[0] - 1
    if block_table.shape[0] != num_seqs or seq_starts.shape[0] != num_seqs:
        raise ValueError(f"block_table ({block_table.shape[0]} rows) and seq_starts ({seq_starts.shape[0]}) "
                         f"must have one entry per request of cu_seqlens_k ({num_seqs})")
    quant = k_cache.dtype in FP8_DTYPES
    check_scale("k_scale", k_scale, k_cache.dtype, device)
    check_scale("v_scale", v_scale, k_cache.dtype, device)
    head_size_v = v_cache.shape[3] if layout == "nhd" else v_cache.shape[3]
    dtype = dtype or (out_k.dtype if out_k is not None else (torch.bfloat16 if quant else k_cache.dtype))
    if out_k is None or out_v is None:
        total = int(cu_seqlens_k[-1].item())
        out_k = out_k if out_k is not None else torch.empty(total, num_kv_heads, head_size, dtype=dtype, device=device)
        out_v = out_v if out_v is not None else torch.empty(total, num_kv_heads, head_size_v, dtype=dtype, device=device)
    check_tensor("out_k", out_k, ndim=3, dtypes=FLOAT_DTYPES, device=device, shape=(None, num_kv_heads, head_size))
    check_tensor("out_v", out_v, ndim=3, dtypes=FLOAT_DTYPES, device=device,
                 shape=(out_k.shape[0], num_kv_heads, head_size_v))
    if values_checked(validate, block_table, cu_seqlens_k, seq_starts):
        check_gather_values(block_table, cu_seqlens_k, seq_starts, block_size, num_blocks, out_k.shape[0],
                            "cu_seqlens_k")
    if not use_triton(device):
        return gather_kv_cache_ref(k_cache, v_cache, block_table, cu_seqlens_k, seq_starts, layout=layout,
                                   k_scale=k_scale, v_scale=v_scale, out_k=out_k, out_v=out_v)
    dummy = cu_seqlens_k
    launch(
        gather_kv_cache_kernel, (out_k.shape[0],),
        k_cache, v_cache, block_table, cu_seqlens_k, seq_starts, out_k, out_v,
        k_scale if quant else dummy, v_scale if quant else dummy,
        block_table.stride(0), *cache_strides(k_cache, v_cache),
        out_k.stride(0), out_k.stride(1), out_v.stride(0), out_v.stride(1),
        num_seqs, num_kv_heads, head_size, block_size,
        BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(max(head_size, head_size_v)),
        BINARY_STEPS=_configs.binary_steps(num_seqs),
        SHUFFLED=layout == "shuffled", X=shuffle_width(k_cache.dtype), DEQUANT=quant,
        num_warps=4,
    )
    return out_k, out_v


def gather_kv_cache_ref(k_cache, v_cache, block_table, cu_seqlens_k, seq_starts, *, layout="nhd",
                        k_scale=None, v_scale=None, out_k=None, out_v=None):
    """PyTorch reference of :func:`gather_kv_cache` (also the CPU path; syncs with the host)."""
    k_nhd, v_nhd = as_nhd(k_cache, v_cache, layout)
    block_size = k_nhd.shape[1]
    cu = cu_seqlens_k.tolist()
    starts = seq_starts.tolist()
    ks, vs = [], []
    for i in range(len(cu) - 1):
        pos = torch.arange(starts[i], starts[i] + cu[i + 1] - cu[i], device=k_cache.device)
        blocks = block_table[i, pos // block_size].long()
        ks.append(dequantize(k_nhd[blocks, pos % block_size], k_scale))
        vs.append(dequantize(v_nhd[blocks, pos % block_size], v_scale))
    k, v = torch.cat(ks), torch.cat(vs)
    if out_k is None:
        return k, v
    out_k[: k.shape[0]] = k.to(out_k.dtype)
    out_v[: v.shape[0]] = v.to(out_v.dtype)
    return out_k, out_v


ADVANCE_BLOCK = 128  # rows a program of advance_decodes moves on


def advance_decodes_ref(positions: torch.Tensor, seq_lens: torch.Tensor, context_lens: torch.Tensor,
                        block_table: torch.Tensor, slot_mapping: torch.Tensor, block_size: int) -> None:
    """PyTorch reference of :func:`advance_decodes` (same arguments and effect)."""
    n = positions.shape[0]
    positions += 1
    seq_lens[:n] += 1
    context_lens[:n] += 1
    blocks = block_table[:n].gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
    torch.add(positions % block_size, blocks.long(), alpha=block_size, out=slot_mapping[:n])


def advance_decodes(positions: torch.Tensor, seq_lens: torch.Tensor, context_lens: torch.Tensor,
                    block_table: torch.Tensor, slot_mapping: torch.Tensor, block_size: int) -> None:
    """Move the first ``n = positions.shape[0]`` decode rows on by one token, in place: ``positions [n]``
    int64 and ``seq_lens`` / ``context_lens [>= n]`` int32 grow by one, ``slot_mapping [>= n]`` int64 takes
    the slot of the new position from ``block_table [>= n, W]`` int32 (which must hold its block). One
    launch (:mod:`tripath.kernels.decode_advance`)."""
    n = positions.shape[0]
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int64,))
    device = positions.device
    for name, t, dtype in (("seq_lens", seq_lens, torch.int32), ("context_lens", context_lens, torch.int32),
                           ("slot_mapping", slot_mapping, torch.int64)):
        check_tensor(name, t, ndim=1, dtypes=(dtype,), device=device)
        if t.shape[0] < n or t.stride(0) != 1:
            raise ValueError(f"{name} must be a contiguous vector of at least {n} rows, got shape {tuple(t.shape)}")
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), device=device)
    if block_table.shape[0] < n or block_table.stride(1) != 1:
        raise ValueError(f"block_table must have at least {n} rows, contiguous, got shape {tuple(block_table.shape)}")
    if positions.stride(0) != 1:
        raise ValueError("positions must be contiguous")
    if not use_triton(device):
        advance_decodes_ref(positions, seq_lens, context_lens, block_table, slot_mapping, block_size)
        return
    launch(advance_decodes_kernel, (-(-n // ADVANCE_BLOCK),), positions, seq_lens, context_lens, block_table,
           slot_mapping, n, block_table.stride(0), block_size, BLOCK=ADVANCE_BLOCK)


def copy_cache_slots(k_cache: torch.Tensor, v_cache: torch.Tensor | None, sources: torch.Tensor,
                     targets: torch.Tensor, *, layout: str = "nhd") -> None:
    """Copy the K/V rows of slots ``sources [N]`` to slots ``targets [N]`` (int64, on the cache's device), in
    place, for every KV head; all rows are read before any is written. The bytes are copied as they are
    (fp8 included: the per-tensor scales stay). ``v_cache`` None: ``k_cache`` is an MLA cache
    ``[num_blocks, block_size, L + R]`` (``layout`` ``nhd``). Speculative decoding's draft trees move an
    accepted path's rows to its positions with it."""
    if sources.shape != targets.shape or sources.dim() != 1:
        raise ValueError(f"sources and targets must be [N] slot tensors of one shape, got {tuple(sources.shape)} "
                         f"and {tuple(targets.shape)}")
    if v_cache is None and layout != "nhd":
        raise ValueError(f"an MLA cache (v_cache None) has the nhd layout, got layout={layout!r}")
    k_raw, v_raw = (None if t is None else t.view(_RAW[t.element_size()]) for t in (k_cache, v_cache))
    if layout == "nhd":
        block_size = k_cache.shape[1]
        for raw in (k_raw, v_raw):
            if raw is not None:
                raw[targets // block_size, targets % block_size] = raw[sources // block_size, sources % block_size]
        return
    check_layout(layout, k_cache.shape[3], k_cache.dtype)
    block_size, x = k_cache.shape[3], k_cache.shape[4]
    # K [blocks, H, D // x, block_size, x]: a slot's row is K[b, :, :, s, :]
    k_raw[targets // block_size, :, :, targets % block_size] = k_raw[sources // block_size, :, :, sources % block_size]
    # V [blocks, H, block_size // x, D, x]: a slot's row is V[b, :, s // x, :, s % x]
    src, dst = sources % block_size, targets % block_size
    v_raw[targets // block_size, :, dst // x, :, dst % x] = v_raw[sources // block_size, :, src // x, :, src % x]


_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}   # element size -> the integer dtype copied as bytes
