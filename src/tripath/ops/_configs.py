"""Launch configurations per platform: tile sizes, warps, pipeline stages, and AMD's knobs.

Each function returns the constexprs and launch options of one kernel family for a target; the launchers
call them with :func:`tripath.platform.current_platform`, and the compile check calls them under
``override_platform`` so it compiles exactly what would run on MI300/MI355/H200. CPU (the interpreter)
gets small tiles so tests exercise multi-tile loops on small shapes.
"""

from __future__ import annotations

from tripath.platform import Platform


def _amd(num_warps: int, num_stages: int = 2, waves_per_eu: int = 2) -> dict:
    return {"num_warps": num_warps, "num_stages": num_stages, "waves_per_eu": waves_per_eu,
            "matrix_instr_nonkdim": 16}


def varlen_config(platform: Platform, head_size: int, elem_bytes: int, max_seqlen_k: int = 8192,
                  tma: bool = True, causal_tiles: int | None = None, head_size_v: int | None = None) -> dict:
    """Prefill tiles. H200 sweeps (2026-11-29, 32/8/128 bf16): with tensor-descriptor loads (``TMA``),
    128×128 tiles, 8 warps, 3 stages when there are many keys per query tile (causal: 554 TF/s at
    1 × 8192, 413 at 8 × 2048; non-causal 8 × (512 × 4096): 557); 64×64, 4 warps, 3 stages when requests
    have at most 1024 keys (241 TF/s at 16 × 512), and for causal launches of fewer than 12 waves of
    128-row tiles (``causal_tiles`` = requests × 128-row query tiles × heads), where the uneven causal
    programs leave the last waves ragged (2 × 2048: 178 µs against 192). ``tma=False`` gives the
    pointer-load configuration, used when the keys' strides rule descriptors out (128-wide key tiles spill
    there; 128×64, 3 stages: 458 TF/s). ``head_size`` is the larger of the query/key and value head sizes,
    ``head_size_v`` the value's (default: the same). MLA's non-absorbed prefill and extend (keys 192 wide,
    values 128, 16-bit): 128×64 tiles, 8 warps, 3 stages on Hopper (H200, 2026-11-29, 128 heads, 4 × 512
    queries on 4608 keys: 1858 µs against 7347 with the 64×32 tiles that 256-wide heads need); with the
    rotary part scored separately (128 + 64, power-of-two pieces) through descriptors: 1646 µs, against 1706
    with pointer loads and 1946 for the concatenated 192-wide heads in the same run (2 stages: 1998; 128×128
    tiles: 1701; 64×64: 1956)."""
    if platform.backend == "cpu":
        return {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if platform.is_hip:  # one wave per SIMD: the whole register file, so no spills with every feature on
        if head_size > 128:
            return {"BLOCK_M": 64, "BLOCK_N": 32, **_amd(4, 2, 1)}
        return {"BLOCK_M": 128, "BLOCK_N": 64, **_amd(4, 2, 1)}
    if head_size > 128:
        if platform.is_hopper and elem_bytes == 2 and head_size <= 256 and (head_size_v or head_size) <= 128:
            return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "TMA": tma}
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    few_causal_tiles = causal_tiles is not None and causal_tiles < 12 * platform.num_sms
    if max_seqlen_k <= 1024 or head_size <= 64 or (few_causal_tiles and platform.is_hopper):
        if tma and platform.is_hopper:
            return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "TMA": True}
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    if tma and platform.is_hopper:
        return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "TMA": True}
    return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}


LONG_TILE = 128  # context tokens per paged-decode tile where long_tile_splits applies


def decode_config(platform: Platform, head_size: int, kv_elem_bytes: int, long_tiles: bool = False) -> dict:
    """Paged decode: tiles of context tokens. H200 (2026-11-29, 32/8/128 bf16, NHD): 64-token tiles, 4 warps,
    2 stages by default (sm_90 compile: 39 KiB of shared memory and 84 registers a program, so up to five
    programs an SM); ``long_tiles`` (see :func:`long_tile_splits`): 128-token tiles, 4 warps, 2 stages
    (73 KiB and 152 registers: three programs an SM)."""
    if platform.backend == "cpu":
        return {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if platform.is_hip:
        return {"BLOCK_N": 64 if head_size <= 128 else 32, **_amd(4, 2, 1)}
    if head_size > 128:
        return {"BLOCK_N": 16, "num_warps": 4, "num_stages": 2}
    if long_tiles:
        return {"BLOCK_N": LONG_TILE, "num_warps": 4, "num_stages": 2}
    return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


def long_tile_splits(platform: Platform, num_seqs: int, num_kv_heads: int, max_seq_len: int | None,
                     num_splits: int | None = None, *, head_size: int = 128, kv_elem_bytes: int = 2,
                     layout: str = "nhd") -> int | None:
    """The split count for paged decode with 128-token tiles, or None where the 64-token tiles apply.

    Long tiles apply on NVIDIA to 16-bit NHD caches with heads of 65-128 dims (the measured family) when
    each split keeps at least 16 tiles (2048 tokens) and the launch has ``P = num_seqs · num_kv_heads ·
    splits`` programs with ``P >= 2.5 · SMs`` and ``P`` not a power of two. ``num_splits`` given: that
    count, if it qualifies; otherwise the smallest that does.

    H200 sweep (2026-11-29, 32/8/128 bf16, block 16, random block order, GPU time of graph replays; 31
    shapes, batch 2-128 × context 2048-65536, splits 1-32, 64- and 128-token tiles): this rule came within
    7% of the best of the sweep everywhere, 0.4% on average (the 64-token rule alone: 26% and 6%; at
    2 × 65536 and 4 × 32768 the rule's 21 and 11 splits were not in the sweep, 24 and 12 were),
    e.g. 48 × 4096 4305 GB/s (64-token tiles, 1 split: 3901), 96 × 4096 4408 (3298), 64 × 16384 4452 at 3
    splits (4384 with 64-token tiles). 128-token tiles at power-of-two program counts measured 10-20% below
    the counts either side (64 × 16384: 1 split 3546 GB/s, 2 splits 4250, 3 splits 4452, 4 splits 4185; the
    same with the grid's axes reordered); that is an observation of this GPU, not a derived rule. With
    fewer than 2048 tokens per split the 64-token tiles at :func:`default_num_splits` were as fast or
    faster (64 × 2048: 4074 against 3757)."""
    if (platform.backend == "cpu" or platform.is_hip or max_seq_len is None or layout != "nhd"
            or kv_elem_bytes != 2 or not 64 < head_size <= 128):
        return None
    programs = num_seqs * num_kv_heads

    def qualifies(splits: int) -> bool:
        launched = programs * splits
        return (max_seq_len // splits >= 16 * LONG_TILE and launched >= 2.5 * platform.num_sms
                and launched & (launched - 1) != 0)

    if num_splits is not None:
        return num_splits if qualifies(num_splits) else None
    for splits in range(1, min(256, max_seq_len // (16 * LONG_TILE)) + 1):
        if qualifies(splits):
            return splits
    return None


def unified_config(platform: Platform, head_size: int, group_pad: int) -> dict:
    """Unified: ``BLOCK_M = BLOCK_Q · BLOCK_G`` rows of (token, head) pairs."""
    if platform.backend == "cpu":
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if platform.is_hip:
        return {"BLOCK_M": 64, "BLOCK_N": 32 if head_size <= 128 else 16, **_amd(4, 2, 1)}
    if head_size > 128:
        return {"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2}
    return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


def default_num_splits(platform: Platform, num_seqs: int, num_kv_heads: int, max_seq_len: int | None,
                       block_n: int) -> int:
    """Split count for paged decode with the 64-token tiles (where :func:`long_tile_splits` gives None):
    about four programs per SM, never below ~4 tiles per split. H200 (2026-11-29): 8 × 32768 best at 8
    splits (16 and 32 slower); 64 × 4096 and 64 × 16384 at 1 (2: 9% slower); 48 × 4096 (384 programs)
    220 µs at 1 split, 264 at 2, 213 at 3, 232 at 4, so filling the last wave is no rule to follow here."""
    if platform.backend == "cpu":
        return 1 if max_seq_len is None else max(1, min(4, -(-max_seq_len // (4 * block_n))))
    programs = max(1, num_seqs * num_kv_heads)
    target = max(1, (4 * platform.num_sms) // programs)
    if max_seq_len is not None:
        target = min(target, max(1, max_seq_len // (4 * block_n)))
    return int(min(target, 64))


def binary_steps(num_seqs: int) -> int:
    """Iterations of the kernels' binary search over ``num_seqs + 1`` offsets, rounded up to a multiple of 4
    (a search converged early stays put), so the constexpr changes only at 16, 256 and 4096 requests
    instead of at every power of two: fewer kernel variants to compile before serving."""
    return 4 * -(-max(1, int(num_seqs).bit_length()) // 4)
