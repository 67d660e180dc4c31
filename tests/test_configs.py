"""Launch-configuration rules that the H200 measurements set (docs/BENCHMARKS.md): checked on the H200
platform description without a GPU, so a change to a rule is a deliberate one."""

from tripath.ops._configs import (LONG_TILE, decode_config, default_num_splits, long_tile_splits, varlen_config,
                                  verify_num_splits)
from tripath.ops._mla_configs import mla_decode_config, mla_decode_num_splits, mla_prep_config
from tripath.platform import CPU, H200, MI300X


def test_decode_splits():
    # About four programs per SM: 64 × 4096 and 64 × 16384 (512 programs) one split; 48 × 4096 one split
    # too (measured: 2 splits 20% slower); 8 × 32768: 8.
    assert default_num_splits(H200, 64, 8, 4096, 64) == 1
    assert default_num_splits(H200, 64, 8, 16384, 64) == 1
    assert default_num_splits(H200, 48, 8, 4096, 64) == 1
    assert default_num_splits(H200, 8, 8, 32768, 64) == 8
    # Short contexts never split below ~4 tiles per split.
    assert default_num_splits(H200, 1, 8, 512, 64) == 2
    assert default_num_splits(CPU, 1, 8, 512, 16) == 4


def test_verify_splits():
    # About two programs per SM, half of decode's: 8 × 4096 four splits (decode's eight ran 7% slower at 8 new
    # tokens), 16 × 4096 two, 32 × 4096 one, 8 × 32768 four; short contexts keep ~4 tiles a split.
    for batch, context, splits in ((8, 4096, 4), (16, 4096, 2), (32, 4096, 1), (8, 32768, 4), (1, 4096, 16),
                                   (1, 131072, 33)):
        assert verify_num_splits(H200, batch, 8, context, 64) == splits, (batch, context)
    assert verify_num_splits(CPU, 1, 8, 512, 16) == 4


def test_decode_long_tiles():
    # 128-token tiles at the smallest split count with >= 2.5 programs per SM, a program count that is not
    # a power of two, and >= 2048 tokens a split (H200 sweep in docs/BENCHMARKS.md).
    assert long_tile_splits(H200, 64, 8, 16384) == 3  # 1536 programs; 512 and 1024 are powers of two
    assert long_tile_splits(H200, 48, 8, 4096) == 1  # 384 programs
    assert long_tile_splits(H200, 96, 8, 4096) == 1
    assert long_tile_splits(H200, 8, 8, 32768) == 6  # 384
    assert long_tile_splits(H200, 32, 8, 8192) == 3  # 768
    # Short splits keep the 64-token tiles: 64 × 4096 would need 3 splits of 1365 tokens.
    assert long_tile_splits(H200, 64, 8, 4096) is None
    assert long_tile_splits(H200, 1, 8, 4096) is None
    # A given split count is kept only if it qualifies.
    assert long_tile_splits(H200, 64, 8, 16384, num_splits=3) == 3
    assert long_tile_splits(H200, 64, 8, 16384, num_splits=1) is None
    # Not on the CPU interpreter or AMD.
    assert long_tile_splits(CPU, 64, 8, 16384) is None and long_tile_splits(MI300X, 64, 8, 16384) is None
    assert decode_config(H200, 128, 2, long_tiles=True)["BLOCK_N"] == LONG_TILE
    assert decode_config(H200, 128, 2)["BLOCK_N"] == 64


def test_prefill_tiles():
    long_tiles = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "TMA": True}
    short_tiles = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "TMA": True}
    assert varlen_config(H200, 128, 2, 8192, causal_tiles=1 * 64 * 32) == long_tiles
    assert varlen_config(H200, 128, 2, 2048, causal_tiles=8 * 16 * 32) == long_tiles
    assert varlen_config(H200, 128, 2, 4096) == long_tiles  # non-causal context chunk
    assert varlen_config(H200, 128, 2, 2048, causal_tiles=2 * 16 * 32) == short_tiles  # < 12 waves
    assert varlen_config(H200, 128, 2, 512, causal_tiles=16 * 4 * 32) == short_tiles
    assert "TMA" not in varlen_config(H200, 128, 2, 8192, tma=False)


def test_wide_heads():
    """MLA's non-absorbed prefill (keys 192 wide, values 128, 16-bit) takes 128x64 tiles on Hopper; 256-wide
    values, fp32 and other GPUs keep the narrow tiles."""
    mla_prefill = varlen_config(H200, 192, 2, 4608, head_size_v=128)
    assert (mla_prefill["BLOCK_M"], mla_prefill["BLOCK_N"], mla_prefill["num_stages"]) == (128, 64, 3)
    for cfg in (varlen_config(H200, 256, 2, 4096), varlen_config(H200, 192, 4, 4096, head_size_v=128),
                varlen_config(MI300X, 192, 2, 4096, head_size_v=128)):
        assert cfg["BLOCK_N"] <= 32


def test_mla_many_heads_split_the_values():
    cfg = mla_decode_config(H200, 128, 512, 2)
    assert cfg["V_PARTS"] == 2 and cfg["BLOCK_H"] == 128 and cfg["PROGRAMS_PER_SM"] == 1
    assert "V_PARTS" not in mla_decode_config(H200, 16, 512, 2)
    assert "V_PARTS" not in mla_decode_config(H200, 128, 512, 2, grouped=True)
    assert mla_decode_num_splits(H200, 64 * 2, 4096, 64, programs_per_sm=1) == 1
    assert mla_decode_num_splits(H200, 64, 4096, 32) == 4


def test_mla_descriptor_rows_need_pages_of_whole_tiles():
    """Hopper bf16 with 64-row pages: descriptor tiles (16 heads: transposed products and L2 prefetch, one
    program per SM, so 2 splits for 64 requests and 16 for 8); smaller pages, fp8 and the plain baseline
    keep the pointer rows."""
    few = mla_decode_config(H200, 16, 512, 2, block_size=64)
    assert few == {"BLOCK_H": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "TMA": True, "SWAP_AB": True,
                   "PREFETCH": 2, "PROGRAMS_PER_SM": 1}
    assert mla_decode_num_splits(H200, 64, 4096, 64, programs_per_sm=1) == 2
    assert mla_decode_num_splits(H200, 8, 32768, 64, programs_per_sm=1) == 16
    many = mla_decode_config(H200, 128, 512, 2, block_size=64)
    assert many == {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "TMA": True,
                    "PROGRAMS_PER_SM": 1}
    assert mla_decode_num_splits(H200, 64 * 2, 4096, 64, programs_per_sm=1) == 1  # 128 heads, 64 requests
    assert mla_decode_num_splits(H200, 64, 4096, 64, programs_per_sm=1) == 2  # 64 heads, 64 requests
    pages_of_32 = mla_decode_config(H200, 128, 512, 2, block_size=32)  # the value-halves row
    assert pages_of_32["TMA"] and pages_of_32["BLOCK_N"] == 32 and pages_of_32["V_PARTS"] == 2
    for cfg in (mla_decode_config(H200, 16, 512, 2, block_size=16),
                mla_decode_config(H200, 128, 512, 2, block_size=16),
                mla_decode_config(H200, 16, 512, 1, block_size=64), mla_decode_config(H200, 16, 512, 2),
                mla_decode_config(H200, 128, 512, 2, grouped=True, block_size=64),
                mla_decode_config(MI300X, 16, 512, 2, block_size=64)):
        assert "TMA" not in cfg and "SWAP_AB" not in cfg and "PREFETCH" not in cfg


def test_mla_prep_small_head_blocks_on_hopper():
    """The decode preparation spreads a step's few tokens over small head blocks on the H200 (4 heads up to
    32, 8 beyond; 4 warps)."""
    assert mla_prep_config(H200, 16) == {"BLOCK_H": 4, "num_warps": 4}
    assert mla_prep_config(H200, 128) == {"BLOCK_H": 8, "num_warps": 4}
    assert mla_prep_config(MI300X, 128)["BLOCK_H"] == 16
