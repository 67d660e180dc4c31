"""Launch configurations per platform: tile sizes, warps, pipeline stages, and AMD's knobs.

Each function returns the constexprs and launch options of one kernel family for a target; the launchers
call them with :func:`tripath.platform.current_platform`, and the compile check calls them under
``override_platform`` so it compiles exactly what would run on MI300/MI355/H200. CPU (the interpreter)
gets small tiles so tests exercise multi-tile loops on small shapes.
"""

from __future__ import annotations

import contextlib
import contextvars

from tripath.platform import Platform


def _amd(num_warps: int, num_stages: int = 2, waves_per_eu: int = 2) -> dict:
    return {"num_warps": num_warps, "num_stages": num_stages, "waves_per_eu": waves_per_eu,
            "matrix_instr_nonkdim": 16}


def varlen_config(platform: Platform, head_size: int, elem_bytes: int, max_seqlen_k: int = 8192,
                  tma: bool = True, causal_tiles: int | None = None, head_size_v: int | None = None) -> dict:
    """Tiles of the portable varlen (prefill / extend) kernel: ``BLOCK_M`` query rows x ``BLOCK_N`` keys.

    ``head_size`` is the larger of the query/key and value head sizes, ``head_size_v`` the value's
    (default: the same); ``causal_tiles`` = requests x 128-row query tiles x heads of a causal launch.
    ``tma=False`` gives the pointer-load configuration (the keys' strides rule descriptors out). Why:

    - 128x128, 8 warps, 3 stages with descriptor loads on Hopper: the fastest where each query tile sees
      many keys (128-wide key tiles spill with pointer loads, hence 128x64 there);
    - 64x64 (Hopper) / 64x32, 4 warps: requests of at most 1024 keys, and causal launches of fewer than 12
      waves of 128-row tiles, whose uneven programs would leave the last waves ragged;
    - heads over 128 (MLA's non-absorbed 192 / 128): 128x64, 8 warps, 3 stages on Hopper for 16-bit inputs
      (far faster than the 64x32 tiles that 256-wide heads need); 64x32 elsewhere;
    - AMD: 128x64 (64x32 over 128 dims), 4 warps, one wave per SIMD, so every feature fits the register
      file without spills (``tripath check-compile``).
    Measured choices: ``docs/BENCHMARKS.md``, "Launch configurations"."""
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
LONG_TILE_MIN_SPLIT_TILES = 16  # a split of 128-token tiles keeps at least this many (long_tile_splits)
LONG_TILE_FILL = 2.5  # programs per SM a launch of 128-token tiles has at least (long_tile_splits)
MIN_SPLIT_TILES = 4  # a split of 64-token tiles keeps at least about this many (default_num_splits)


def decode_config(platform: Platform, head_size: int, kv_elem_bytes: int, long_tiles: bool = False) -> dict:
    """Tiles of the paged-decode kernel: ``BLOCK_N`` context tokens a tile.

    64-token tiles, 4 warps, 2 stages by default (on sm_90 39 KiB of shared memory and 84 registers a
    program: up to five programs an SM hide the scattered row loads); ``long_tiles`` (where
    :func:`long_tile_splits` applies): 128-token tiles (73 KiB, 161 registers: three programs an SM, fewer
    split partials); heads over 128 dims: 16-token tiles (registers); AMD: 64 (32 over 128 dims)."""
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

    Why: over a sweep of batch 2-128 x context 2048-65536 on sm_90 this rule came close to the best split
    count and tile size everywhere, where the 64-token tiles alone did not; 128-token tiles at power-of-two
    program counts ran below the counts either side (an observation of that GPU, not a derived rule);
    below 2048 tokens a split, the 64-token tiles were as fast or faster. The figures: docs/BENCHMARKS.md,
    "Launch configurations"."""
    if (platform.backend == "cpu" or platform.is_hip or max_seq_len is None or layout != "nhd"
            or kv_elem_bytes != 2 or not 64 < head_size <= 128):
        return None
    programs = num_seqs * num_kv_heads

    def qualifies(splits: int) -> bool:
        launched = programs * splits
        return (max_seq_len // splits >= LONG_TILE_MIN_SPLIT_TILES * LONG_TILE
                and launched >= LONG_TILE_FILL * platform.num_sms
                and launched & (launched - 1) != 0)

    if num_splits is not None:
        return num_splits if qualifies(num_splits) else None
    for splits in range(1, min(256, max_seq_len // (LONG_TILE_MIN_SPLIT_TILES * LONG_TILE)) + 1):
        if qualifies(splits):
            return splits
    return None


_TABLES_SPAN_MAX_LEN = contextvars.ContextVar("tables_span_max_len", default=False)


@contextlib.contextmanager
def tables_span_max_len():
    """Within this scope, the block tables :func:`tripath.ops.paged_decode` gets span the longest context the
    engine serves rather than the step's (a CUDA graph's captured table): it takes the 64-token tiles, whose split
    count each request fits to its own length in the kernel, instead of tiles chosen for the width. The
    engine's decode graphs run their eager first call and their capture inside it, so both pick the same
    kernel variant."""
    token = _TABLES_SPAN_MAX_LEN.set(True)
    try:
        yield
    finally:
        _TABLES_SPAN_MAX_LEN.reset(token)


def tables_span_max_len_set() -> bool:
    """Whether the caller is inside :func:`tables_span_max_len`."""
    return _TABLES_SPAN_MAX_LEN.get()


def device_split_bounds(platform: Platform, num_seqs: int, num_kv_heads: int, long_tiles: bool) -> tuple[int, int]:
    """``(fill_splits, min_split_tiles)`` for the paged-decode kernel's own choice of splits per request
    (:mod:`tripath.kernels.paged_decode`: ``used = min(num_splits, max(fill_splits, T // min_split_tiles))``
    for a request of ``T`` tiles). With the 128-token tiles, ``fill_splits`` is the fewest splits that give
    the launch ``2.5 · SMs`` programs (:func:`long_tile_splits`'s bound) and a split keeps 16 tiles; with the
    64-token tiles, 1 and 4 (:func:`default_num_splits` with the request's own length). So a request whose
    context is far shorter than the block table's width (a CUDA graph's table spans the longest context the
    engine serves) uses the splits its length calls for, not the width's."""
    if long_tiles:
        programs = max(1, num_seqs * num_kv_heads)
        return max(1, -(-int(LONG_TILE_FILL * platform.num_sms) // programs)), LONG_TILE_MIN_SPLIT_TILES
    return 1, MIN_SPLIT_TILES


def unified_config(platform: Platform, head_size: int, group_pad: int) -> dict:
    """Unified: ``BLOCK_M = BLOCK_Q · BLOCK_G`` rows of (token, head) pairs."""
    if platform.backend == "cpu":
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if platform.is_hip:
        return {"BLOCK_M": 64, "BLOCK_N": 32 if head_size <= 128 else 16, **_amd(4, 2, 1)}
    if head_size > 128:
        return {"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2}
    return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


def mixed_config(platform: Platform, head_size: int, group_pad: int, kv_fp8: bool = False) -> dict:
    """The one-launch mixed attention (:mod:`tripath.kernels.mixed_attention`): the prompt tile of
    :func:`unified_config` (``BLOCK_M = BLOCK_Q · BLOCK_G`` rows, ``BLOCK_N`` keys), the decode tile's key tiles
    (``DECODE_BLOCK_N``: :func:`decode_config`'s short tiles), one set of warps and stages for both (they share a
    kernel). Heads over 128 dims: 32-row prompt tiles, since the persistent loop keeps more values live than
    unified's one tile a program and 64 rows spilled up to 144 B on sm_90 (8 warps) and VGPRs on gfx950
    (``tripath check-compile --only mixed``). NVIDIA, 128 dims: 64-key prompt tiles took 14–16% less GPU time
    than 32-key ones on an H100 (docs/BENCHMARKS.md, "The mixed step"), but on an fp8 cache (``kv_fp8``) with
    the shuffled layout and the LSE output they spill 16 bytes on sm_90, so fp8 caches keep 32-key tiles."""
    if platform.backend == "cpu":
        return {"BLOCK_M": 16, "BLOCK_N": 16, "DECODE_BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if platform.is_hip:
        if head_size > 128:
            return {"BLOCK_M": 32, "BLOCK_N": 16, "DECODE_BLOCK_N": 32, **_amd(4, 2, 1)}
        return {"BLOCK_M": 64, "BLOCK_N": 32, "DECODE_BLOCK_N": 64, **_amd(4, 2, 1)}
    if head_size > 128:
        return {"BLOCK_M": 32, "BLOCK_N": 16, "DECODE_BLOCK_N": 16, "num_warps": 8, "num_stages": 2}
    return {"BLOCK_M": 64, "BLOCK_N": 32 if kv_fp8 else 64, "DECODE_BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


MIXED_PROGRAMS_PER_SM = 2  # the persistent grid of the mixed attention: programs an SM (mixed_schedule)
MIXED_WAVES = 2  # items a program takes on average, the cost model's target (mixed_schedule)
MIXED_MIN_SPLIT = 256  # keys a piece has at least (mixed_schedule): four 64-token decode tiles


def mixed_schedule(platform: Platform, num_kv_heads: int) -> tuple[int, int, int, int]:
    """``(programs, target_items, split_budget, min_split)`` of the one-launch mixed attention (the cost model
    of :mod:`tripath.kernels.mixed_plan`): a persistent grid of ``MIXED_PROGRAMS_PER_SM`` programs an SM (what
    fits: on sm_90 the 128-dim kernel takes 252 registers a thread at 4 warps and 41 KiB of shared memory, so
    two programs an SM; to be measured against more, queued, programs), about
    ``MIXED_WAVES`` items a program (``target_items`` items of ``Hkv`` works each), pieces of at least
    ``MIXED_MIN_SPLIT`` keys (as paged decode's splits keep four 64-token tiles), and a list that may grow to
    twice the target before the pieces lengthen (``split_budget``; it sizes the partial buffers). The
    interpreter: three programs (the persistent loop strides), pieces of at least 32 keys."""
    if platform.backend == "cpu":
        programs, min_split = 3, 32
    else:
        programs, min_split = MIXED_PROGRAMS_PER_SM * platform.num_sms, MIXED_MIN_SPLIT
    target = max(1, -(-MIXED_WAVES * programs // max(1, num_kv_heads)))
    return programs, target, max(2 * target, 16), min_split


def default_num_splits(platform: Platform, num_seqs: int, num_kv_heads: int, max_seq_len: int | None,
                       block_n: int, programs_per_sm: int = 4) -> int:
    """Split count for paged decode with the 64-token tiles (where :func:`long_tile_splits` gives None):
    about ``programs_per_sm`` programs per SM (four), never below ~4 tiles per split, at most 64. Why: few
    long requests want several splits, many requests none; filling the last wave exactly did not pay
    (docs/BENCHMARKS.md, "Launch configurations")."""
    if platform.backend == "cpu":
        return 1 if max_seq_len is None else max(1, min(4, -(-max_seq_len // (4 * block_n))))
    programs = max(1, num_seqs * num_kv_heads)
    target = max(1, (programs_per_sm * platform.num_sms) // programs)
    if max_seq_len is not None:
        target = min(target, max(1, max_seq_len // (4 * block_n)))
    return int(min(target, 64))


VERIFY_PROGRAMS_PER_SM = 2  # paged verify's split target (verify_num_splits)


def verify_num_splits(platform: Platform, num_programs: int, num_kv_heads: int, max_seq_len: int | None,
                      block_n: int) -> int:
    """Split count for paged verify (``num_programs`` query tiles of ``num_kv_heads`` heads each): as paged
    decode's :func:`default_num_splits` but about ``VERIFY_PROGRAMS_PER_SM`` (two) programs per SM, since a
    verify's tile carries several tokens' rows. Why: on an H100, 8 new tokens a request (32/8/128) ran 1.27 /
    1.16 / 1.11 / 1.17 / 1.11× a one-token decode at 8 × 4096 / 16 × 4096 / 32 × 4096 / 4 × 16384 / 8 × 32768
    with it, 1.36 / 1.28 / 1.16 / 1.23 / 1.11× at decode's four programs an SM (docs/BENCHMARKS.md, "Launch
    configurations")."""
    return default_num_splits(platform, num_programs, num_kv_heads, max_seq_len, block_n, VERIFY_PROGRAMS_PER_SM)


def binary_steps(num_seqs: int) -> int:
    """Iterations of the kernels' binary search over ``num_seqs + 1`` offsets, rounded up to a multiple of 4
    (a search converged early stays put), so the constexpr changes only at 16, 256 and 4096 requests
    instead of at every power of two: fewer kernel variants to compile before serving."""
    return 4 * -(-max(1, int(num_seqs).bit_length()) // 4)


def lm_head_sample_config(platform: Platform, num_rows: int, elem_bytes: int, sample: bool) -> dict:
    """The fused LM head and draw (:mod:`tripath.kernels.lm_head_sample`): ``BLOCK_V`` tokens (the matrix
    unit's long side) × ``BLOCK_M`` rows per program, ``BLOCK_K`` of the hidden size per step. Why (not yet
    measured on a GPU: ``tripath bench kernels --only lm_head`` and ``tripath bench tune --only lm_head`` time
    them against torch.matmul + argmax):

    - ``BLOCK_M`` the rows rounded up to 16, at most 64 (32 with the draw's noise, whose Philox state per
      logit needs the registers; 8 warps then): a weight tile is multiplied by every row block while it sits
      in L2;
    - 128 tokens × 128 of the hidden size in 4 stages on NVIDIA (145–193 KB of shared memory for 16-bit
      weights; 64-token tiles made ptxas serialise the wgmma at 8 warps). A TP-8 shard's 19K tokens are
      149 tiles on 132 SMs: the tail wave is the first thing to measure (``tripath check-compile``:
      no spills, wgmma in every configuration);
    - AMD: 128 × 64, 2 stages, one wave per SIMD (24 KB of LDS, 204 VGPRs, no spills);
    - the interpreter: small tiles, so tests cross tile boundaries."""
    block_m = 16 if num_rows <= 16 else 32 if (num_rows <= 32 or sample) else 64
    if platform.backend == "cpu":
        return {"BLOCK_M": 16, "BLOCK_V": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}
    if platform.is_hip:
        return {"BLOCK_M": block_m, "BLOCK_V": 128, "BLOCK_K": 64, **_amd(4, 2, 1)}
    block_k = 128 if elem_bytes == 2 else 64
    return {"BLOCK_M": block_m, "BLOCK_V": 128, "BLOCK_K": block_k, "num_warps": 8 if sample else 4,
            "num_stages": 4 if elem_bytes == 2 else 3}


def logits_sample_config(platform: Platform) -> dict:
    """The draw from written logits: ``BLOCK_V`` tokens of one row per program."""
    if platform.backend == "cpu":
        return {"BLOCK_V": 64, "num_warps": 4}
    return {"BLOCK_V": 1024, "num_warps": 4}
