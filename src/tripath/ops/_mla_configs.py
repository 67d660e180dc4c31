"""Launch configurations of the MLA kernels per platform (same style as :mod:`tripath.ops._configs`).

The absorbed decode kernel packs ``BLOCK_H`` query heads into one tile: 16 when a request has few heads
(memory-bound: the tile count, not the math, sets the time), 64 with many heads (compute-bound: the
``[64, 576] x [576, BLOCK_N]`` and ``[64, BLOCK_N] x [BLOCK_N, 512]`` products run on the tensor cores /
matrix cores). On AMD the K tile and the packed query share 64 KB of LDS on gfx942 (160 KB on gfx950), so
tiles are smaller there. CPU (the interpreter) gets small tiles so tests run multi-tile loops.
"""

from __future__ import annotations

from tripath.platform import Platform

FEW_HEADS = 32  # up to this many heads a request's heads fit in 16-row tiles cheaply


def _amd(num_warps: int, num_stages: int = 2, waves_per_eu: int = 2) -> dict:
    return {"num_warps": num_warps, "num_stages": num_stages, "waves_per_eu": waves_per_eu,
            "matrix_instr_nonkdim": 16}


def mla_decode_config(platform: Platform, num_heads: int, kv_lora_rank: int, kv_elem_bytes: int,
                      q_fp8: bool = False) -> dict:
    """Head-packed absorbed decode: ``BLOCK_H`` heads x ``BLOCK_N`` cache rows per step.

    Chosen from compiles for sm_90 / gfx942 / gfx950 (no spills, within shared memory / LDS, every product
    on the matrix units). H200: a 64-head tile runs as wgmma with a ``[64, 512]`` fp32 accumulator over 8
    warps; an fp8 cache read by a 16-bit query converts each tile in registers, which spills at 64 heads,
    so that case packs 32 (an fp8 query multiplies the fp8 tiles directly and keeps 64). AMD: 8 waves cap
    a thread at 256 VGPRs, so the wide accumulators use 4 waves and ``waves_per_eu=1`` (up to 512); fp8
    MFMA needs ``K >= 32``, so an fp8 query takes 32-row tiles.
    """
    if platform.backend == "cpu":
        return {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    kv_fp8 = kv_elem_bytes == 1
    converts = kv_fp8 and not q_fp8
    few = num_heads <= FEW_HEADS
    if platform.is_hip:
        gfx950 = platform.arch == "gfx950"
        if few:
            if kv_fp8:
                return {"BLOCK_H": 16, "BLOCK_N": 32, **_amd(4, 2, 1)}
            return {"BLOCK_H": 16, "BLOCK_N": 32, **_amd(8, 2, 2)}
        if q_fp8:
            return {"BLOCK_H": 64, "BLOCK_N": 32, **_amd(8, 2, 1)} if gfx950 else \
                {"BLOCK_H": 32, "BLOCK_N": 32, **_amd(4, 2, 1)}
        if gfx950 and not converts:
            return {"BLOCK_H": 64, "BLOCK_N": 16, **_amd(8, 2, 1)}
        return {"BLOCK_H": 32, "BLOCK_N": 16, **_amd(4, 2, 1)}
    if few:
        return {"BLOCK_H": 16, "BLOCK_N": 32 if kv_lora_rank > 256 else 64, "num_warps": 4, "num_stages": 3}
    if converts:
        return {"BLOCK_H": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_H": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}


def mla_decode_per_head_config(platform: Platform, kv_lora_rank: int) -> dict:
    """The plain baseline: one head per program, CUDA-core dot products."""
    if platform.backend == "cpu":
        return {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if platform.is_hip:
        return {"BLOCK_N": 16, **_amd(4, 1, 2)}
    return {"BLOCK_N": 16 if kv_lora_rank > 256 else 32, "num_warps": 4, "num_stages": 2}


def mla_decode_num_splits(platform: Platform, num_programs: int, max_seq_len: int, block_n: int) -> int:
    """KV splits per (request, head block): fill the GPU about twice over, never below ~4 tiles a split."""
    if platform.backend == "cpu":
        return max(1, min(4, -(-max_seq_len // (4 * block_n))))
    target = -(-2 * platform.num_sms // max(1, num_programs))
    target = min(target, max(1, max_seq_len // (4 * block_n)))
    return int(max(1, min(target, 64)))


def mla_prep_config(platform: Platform, num_heads: int) -> dict:
    """Fused preparation (and the query concat): ``BLOCK_H`` heads of one token per program."""
    block_h = 16 if num_heads >= 16 else max(1, 1 << (num_heads - 1).bit_length())
    if platform.backend == "cpu":
        return {"BLOCK_H": block_h, "num_warps": 4}
    if platform.is_hip:
        return {"BLOCK_H": block_h, "num_warps": 4, "waves_per_eu": 2}
    return {"BLOCK_H": block_h, "num_warps": 4}


def elementwise_config(platform: Platform) -> dict:
    """Row copies (cache write, gather) and the in-place rotary embedding."""
    return {"num_warps": 4}
