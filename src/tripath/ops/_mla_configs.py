"""Launch configurations of the MLA kernels per platform (same style as :mod:`tripath.ops._configs`).

The absorbed decode kernel packs ``BLOCK_H`` query heads into one tile: 16 when a request has few heads
(memory-bound: reading the cache sets the time), up to 64 with many heads (compute-bound: the
``[BLOCK_H, 576] x [576, BLOCK_N]`` and ``[BLOCK_H, BLOCK_N] x [BLOCK_N, 512]`` products run on the tensor
cores / matrix cores). The per-target table below was chosen by compiling for sm_90, gfx942 and gfx950
(no spills, within shared memory, every product on the matrix units); the NVIDIA rows are the fastest
measured on sm_90 (``docs/BENCHMARKS.md``). CPU (the interpreter) gets small tiles so tests run multi-tile
loops.
"""

from __future__ import annotations

from tripath.ops._checks import next_pow2
from tripath.platform import Platform
from tripath.triton_internals import versions

FEW_HEADS = 32  # up to this many heads a request's heads fit in 16-row tiles cheaply


def _amd(num_warps: int, num_stages: int = 2, waves_per_eu: int = 2) -> dict:
    return {"num_warps": num_warps, "num_stages": num_stages, "waves_per_eu": waves_per_eu,
            "matrix_instr_nonkdim": 16}


# (BLOCK_H, BLOCK_N, num_warps, num_stages[, waves_per_eu]) per target, head count (few / many) and operand
# kind: "bf16" (16-bit query and cache), "fp8_kv" (16-bit query, fp8 cache: tiles converted in registers),
# "fp8_q" (fp8 query and cache: fp8 products), for cache tiles read through pointers. Picked from compiles
# of the check's scenarios (a cache in a > 2 GiB allocation, so AMD has no 32-bit buffer addressing): no
# spills, within shared memory / LDS, every product on the matrix units. Converting fp8 tiles spills at 64
# heads on sm_90, so that case packs 32. AMD: 8 waves cap a thread at 256 VGPRs, so wide accumulators take
# 4 waves with waves_per_eu=1; fp8 MFMA needs K >= 32, so fp8 queries take 32-row tiles. The few-heads rows
# are also the plain baseline's tiles (``grouped``).
_DECODE_TABLE = {
    ("sm90", True): {"bf16": (16, 32, 4, 2), "fp8_kv": (16, 32, 4, 3), "fp8_q": (16, 32, 8, 3)},
    ("sm90", False): {"bf16": (128, 64, 8, 1), "fp8_kv": (32, 32, 8, 3), "fp8_q": (64, 32, 8, 2)},
    ("gfx942", True): {"bf16": (16, 32, 4, 1, 1), "fp8_kv": (16, 16, 4, 2, 1), "fp8_q": (16, 32, 4, 1, 1)},
    ("gfx942", False): {"bf16": (32, 16, 4, 2, 1), "fp8_kv": (32, 16, 4, 2, 1), "fp8_q": (32, 32, 4, 2, 1)},
    ("gfx950", True): {"bf16": (16, 16, 8, 2, 2), "fp8_kv": (16, 16, 4, 2, 1), "fp8_q": (16, 32, 8, 2, 2)},
    ("gfx950", False): {"bf16": (32, 16, 4, 2, 1), "fp8_kv": (32, 16, 4, 2, 1), "fp8_q": (64, 32, 8, 2, 1)},
}
# Triton 3.8 and newer spill the two-stage fp8-query rows on gfx950 (51-195 VGPRs, up to 672 B of scratch);
# one stage compiles clean with the same tiles and occupancy (chosen as the other AMD rows: compiled, not timed).
if (versions.installed() or (0, 0)) >= (3, 8):
    _DECODE_TABLE[("gfx950", True)]["fp8_q"] = (16, 32, 8, 1, 2)
    _DECODE_TABLE[("gfx950", False)]["fp8_q"] = (64, 32, 8, 1, 1)
# (target, few heads, kind) whose pointer-load programs each produce half of the latent output columns.
_VALUE_SPLIT = {("sm90", False, "bf16")}

# Hopper with pages holding whole tiles (block_size % BLOCK_N == 0): tiles through tensor descriptors.
# - 16 heads: 64-row tiles with the products transposed (cache rows as the warpgroup MMA's M, SWAP_AB),
#   2 buffers (183 KiB of shared memory: one program per SM), each step asking L2 for the tile two steps
#   ahead (PREFETCH): faster than the pointer-load row above; prefetching 1 or 3-4 steps ahead was
#   slower, and untransposed 32-row tiles get only one descriptor buffer from Triton's pipeliner.
# - many heads: 64 heads x 64 rows, 8 warps (two warpgroups, each with half of the 512 value columns, the
#   row softmax shared through shared memory), 2 buffers, one program per SM: faster than the 128 x 32 row
#   with the value columns in two programs (V_PARTS 2, which recomputes the scores), kept for 32-row pages.
# The figures: docs/BENCHMARKS.md, "Launch configurations".
# One buffer with transposed products (16 heads, 64 rows, 4 warps) returns wrong results on Triton 3.6
# (sm_90); such a configuration is never used (see _packed_tiles).
# Rows in order of preference; the first whose BLOCK_N divides the page size applies (32-row pages keep
# the previous many-heads row).
_TMA_TABLE = {
    ("sm90", True, "bf16"): (((16, 64, 4, 2), {"SWAP_AB": True, "PREFETCH": 2, "PROGRAMS_PER_SM": 1}),),
    ("sm90", False, "bf16"): (((64, 64, 8, 2), {"PROGRAMS_PER_SM": 1}),
                              ((128, 32, 8, 2), {"V_PARTS": 2, "PROGRAMS_PER_SM": 1})),
}


def mla_decode_config(platform: Platform, num_heads: int, kv_lora_rank: int, kv_elem_bytes: int,
                      q_fp8: bool = False, grouped: bool = False, block_size: int | None = None) -> dict:
    """Head-packed absorbed decode: ``BLOCK_H`` heads x ``BLOCK_N`` cache rows per step (see the tables).
    Other NVIDIA GPUs use the sm_90 rows, other AMD GPUs the gfx942 rows (the smaller LDS). ``grouped``: the
    plain baseline's choice, the few-heads pointer row (16-head tiles over the whole latent) for every head
    count, as in SGLang's and vLLM's Triton MLA decode. ``block_size``: the cache's page size; the
    descriptor rows (``TMA``) apply only when pages hold whole tiles (None: pointer rows)."""
    if platform.backend == "cpu":
        return {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    kind = "fp8_q" if q_fp8 else ("fp8_kv" if kv_elem_bytes == 1 else "bf16")
    arch = ("gfx950" if platform.arch == "gfx950" else "gfx942") if platform.is_hip else "sm90"
    few = grouped or num_heads <= FEW_HEADS
    tma_rows = () if grouped or block_size is None else _TMA_TABLE.get((arch, few, kind), ())
    for (block_h, block_n, warps, stages), extra in tma_rows:
        if block_size % block_n == 0:
            return {"BLOCK_H": block_h, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages,
                    "TMA": True, **extra}
    block_h, block_n, warps, stages, *wpe = _DECODE_TABLE[(arch, few)][kind]
    cfg = {"BLOCK_H": block_h, "BLOCK_N": block_n}
    if (arch, few, kind) in _VALUE_SPLIT:
        # Half the latent columns per program; one such program fills a multiprocessor's shared memory.
        cfg.update(V_PARTS=2, PROGRAMS_PER_SM=1)
    if platform.is_hip:
        return {**cfg, **_amd(warps, stages, wpe[0])}
    return {**cfg, "num_warps": warps, "num_stages": stages}


def mla_decode_num_splits(platform: Platform, num_programs: int, max_seq_len: int, block_n: int,
                          programs_per_sm: int = 2) -> int:
    """KV splits per (request, head block): about ``programs_per_sm`` programs per SM, rounded down to a
    power of two (rounding up was slower), never below ~4 tiles a split, at most 64."""
    if platform.backend == "cpu":
        return max(1, min(4, -(-max_seq_len // (4 * block_n))))
    target = max(1, (programs_per_sm * platform.num_sms) // max(1, num_programs))
    target = 1 << (target.bit_length() - 1)
    target = min(target, max(1, max_seq_len // (4 * block_n)))
    return int(max(1, min(target, 64)))


def mla_prep_config(platform: Platform, num_heads: int) -> dict:
    """Fused preparation (and the query concat): ``BLOCK_H`` heads of one token per program: 4 heads x 4
    warps up to 32 heads, 8 heads x 4 warps beyond (the fastest of 1-16 heads x 1-8 warps at 16 and 128
    heads)."""
    block_h = min(16, next_pow2(num_heads))
    if platform.backend == "cpu":
        return {"BLOCK_H": block_h, "num_warps": 4}
    if platform.is_hip:
        return {"BLOCK_H": block_h, "num_warps": 4, "waves_per_eu": 2}
    return {"BLOCK_H": 4 if num_heads <= FEW_HEADS else 8, "num_warps": 4}


def gather_config(platform: Platform) -> dict:
    """Latent row gather: ``BLOCK_ROWS`` rows of ``L + R`` values per program."""
    if platform.backend == "cpu":
        return {"BLOCK_ROWS": 32, "num_warps": 4}
    return {"BLOCK_ROWS": 4, "num_warps": 4}


def elementwise_config(platform: Platform) -> dict:
    """Row copies (cache write, gather)."""
    return {"num_warps": 4}


def rotary_config(platform: Platform, num_heads: int) -> dict:
    """In-place rotary embedding: ``BLOCK_H`` heads of one token per program, 16 heads x 2 warps on NVIDIA
    (fewer heads a program left the GPU underfilled at 128 heads)."""
    block_h = min(16, next_pow2(num_heads))
    if platform.backend == "cpu" or platform.is_hip:
        return {"BLOCK_H": block_h, "num_warps": 4}
    return {"BLOCK_H": block_h, "num_warps": 2}
