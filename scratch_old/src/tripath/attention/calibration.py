"""fp8 KV-cache scales from the data: per layer, per tensor, ``scale = amax / fp8_max``.

A cache stores ``quant(x / scale)`` with e4m3's range ``[-fp8_max, fp8_max]``, so values beyond
``scale · fp8_max`` saturate. With the default scale 1.0 that is ±448: keys or values larger than that
(common in some models' layers) are clipped. Calibration sets each layer's scales from the amax of the
keys and values of one step, on the device (no host sync), in place, so CUDA graphs captured earlier
read the new scales. Values of later steps beyond the calibrated range still saturate.
"""

from __future__ import annotations

import math

import torch

from tripath.attention.spec import KVCache, MLACache
from tripath.platform import FP8_DTYPES, fp8_max

MIN_SCALE = 1e-6  # an all-zero step must not leave a zero scale (it divides)


def _set_from_amax(scale: torch.Tensor, amax: torch.Tensor, cache_dtype: torch.dtype) -> None:
    scale.copy_((amax.float() / fp8_max(cache_dtype)).clamp_min(MIN_SCALE).reshape(scale.shape))


def calibrate_kv_scales(cache: KVCache, k: torch.Tensor, v: torch.Tensor) -> None:
    """Set an fp8 MHA cache's ``k_scale``/``v_scale`` from the amax of ``k [T, Hkv, D]`` and ``v``; a
    cache of any other dtype is left alone."""
    if cache.k_cache.dtype not in FP8_DTYPES or k.numel() == 0:
        return
    _set_from_amax(cache.k_scale, k.abs().amax(), cache.k_cache.dtype)
    _set_from_amax(cache.v_scale, v.abs().amax(), cache.v_cache.dtype)


def calibrate_mla_scale(cache: MLACache, kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
    """Set an fp8 MLA cache's ``kv_scale`` from the rows it will store: ``kv_c [T, L]`` and the
    unrotated ``k_pe [T, R]``. Rotation keeps each pair's norm, so a rotated entry is at most √2 times
    the pair's larger entry: the rotary part counts with that margin."""
    if cache.kv_cache.dtype not in FP8_DTYPES or kv_c.numel() == 0:
        return
    amax = torch.maximum(kv_c.abs().amax().float(), k_pe.abs().amax().float() * math.sqrt(2.0))
    _set_from_amax(cache.kv_scale, amax, cache.kv_cache.dtype)
