"""Hostile and careless input to the ops: each case raises the named exception with a message that names the
argument, and nothing is read or written out of bounds (the cache-write kernels skip a slot past the cache).

Host tensors have their values checked on every call; device tensors under ``TRIPATH_VALIDATE=1`` or
``validate=True`` (the GPU half of that is in ``test_fuzz_metadata.py``). Tiny shapes, Triton's interpreter.
"""

import math

import pytest
import torch

from helpers import cu_seqlens, filled_cache
from tripath import _env
from tripath.ops import (allocate_kv_cache, allocate_mla_cache, concat_and_cache_mla,
                         fused_qk_rope_concat_and_cache_mla, gather_kv_cache, gather_mla_cache, mla_decode,
                         paged_decode, unified_attention, varlen_attention, write_kv_cache)
from tripath.ops import reference as R
from tripath.ops._checks import values_checked
from tripath.ops.kv_cache import write_kv_cache_ref
from tripath.ops.reference_mla import concat_and_cache_mla_ref

F16, FP8 = torch.float16, torch.float8_e4m3fn
L, RD = 32, 32  # MLA latent and rotary widths of these tests


def _paged(seq_lens=(5, 20), block_size=16, hkv=2, d=32):
    kc, vc, table, _, _ = filled_cache(list(seq_lens), hkv, d, block_size=block_size, dtype=F16)
    q = torch.randn(len(seq_lens), 2 * hkv, d, dtype=F16)
    return q, kc, vc, table, torch.tensor(seq_lens, dtype=torch.int32)


def _strided(table: torch.Tensor) -> torch.Tensor:
    """The same values with a column stride != 1 (rows not contiguous)."""
    strided = table.t().contiguous().t()
    assert torch.equal(strided, table) and strided.stride(1) != 1
    return strided


# -- the block table's inner stride ---------------------------------------------------------------------------

def _paged_ops_refuse(q, kc, vc, table, seq_lens, match):
    """paged_decode, unified_attention and gather_kv_cache each raise ValueError matching ``match``."""
    with pytest.raises(ValueError, match=match):
        paged_decode(q, kc, vc, table, seq_lens)
    with pytest.raises(ValueError, match=match):
        unified_attention(q, kc, vc, table, seq_lens, cu_seqlens([1, 1], "cpu"), 1)
    with pytest.raises(ValueError, match=match):
        gather_kv_cache(kc, vc, table, cu_seqlens([5, 20], "cpu"), torch.zeros(2, dtype=torch.int32))


def test_block_table_rows_must_be_contiguous():
    q, kc, vc, table, sl = _paged()
    bad = _strided(table)
    _paged_ops_refuse(q, kc, vc, bad, sl, r"block_table must be contiguous along its rows")
    cache = allocate_mla_cache(8, 16, L, RD, dtype=F16)
    with pytest.raises(ValueError, match=r"block_table must be contiguous along its rows"):
        mla_decode(torch.randn(2, 4, L + RD, dtype=F16), cache, bad, sl, kv_lora_rank=L, sm_scale=0.1)
    with pytest.raises(ValueError, match=r"block_table must be contiguous along its rows"):
        gather_mla_cache(cache, bad, cu_seqlens([5, 20], "cpu"), torch.zeros(2, dtype=torch.int32))
    # The contiguous copy gives the reference's answer.
    torch.testing.assert_close(paged_decode(q, kc, vc, bad.contiguous(), sl).float(),
                               R.paged_decode_ref(q, kc, vc, table, sl).float(), atol=1.5e-2, rtol=1e-2)


# -- varlen offsets and max_seqlen ----------------------------------------------------------------------------

def test_varlen_offsets_and_max_seqlen_are_checked():
    q = torch.randn(300, 2, 32, dtype=F16)
    k = torch.randn(300, 2, 32, dtype=F16)
    cu = cu_seqlens([300], "cpu")
    with pytest.raises(ValueError, match=r"max_seqlen_q=10 is below the longest request in cu_seqlens_q \(300\)"):
        varlen_attention(q, k, k, cu, cu, 10, 300)
    with pytest.raises(ValueError, match=r"max_seqlen_k=299 is below the longest request in cu_seqlens_k"):
        varlen_attention(q, k, k, cu, cu, 300, 299)
    shifted = torch.tensor([4, 300], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must start at 0, got 4"):
        varlen_attention(q, k, k, shifted, cu, 300, 300)
    past = torch.tensor([0, 301], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_k ends at 301, past the 300 rows"):
        varlen_attention(q, k, k, cu, past, 301, 301)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing"):
        varlen_attention(q, k, k, torch.tensor([0, 9, 3], dtype=torch.int32), cu_seqlens([3, 3], "cpu"), 9, 3)
    short = cu_seqlens([10], "cpu")  # ending before the last row is allowed: the rest is ignored
    out = varlen_attention(q, k, k, short, short, 10, 10)
    torch.testing.assert_close(out[:10].float(), R.varlen_attention_ref(q[:10], k[:10], k[:10], short, short,
                                                                        10, 10).float(), atol=1.5e-2, rtol=1e-2)


# -- scalars ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_softcap_and_sm_scale_are_refused(bad):
    q = torch.randn(4, 2, 32, dtype=F16)
    cu = cu_seqlens([4], "cpu")
    with pytest.raises(ValueError, match=r"softcap must be a finite number in \[0, 1e\+30\]"):
        varlen_attention(q, q, q, cu, cu, 4, 4, softcap=bad)
    with pytest.raises(ValueError, match=r"sm_scale must be a finite number"):
        varlen_attention(q, q, q, cu, cu, 4, 4, sm_scale=bad)
    pq, kc, vc, table, sl = _paged()
    with pytest.raises(ValueError, match=r"softcap must be a finite number in \[0, 1e\+30\]"):
        paged_decode(pq, kc, vc, table, sl, softcap=bad)
    with pytest.raises(ValueError, match=r"sm_scale must be a finite number"):
        unified_attention(pq, kc, vc, table, sl, cu_seqlens([1, 1], "cpu"), 1, sm_scale=bad)
    cache = allocate_mla_cache(8, 16, L, RD, dtype=F16)
    with pytest.raises(ValueError, match=r"sm_scale must be a finite number"):
        mla_decode(torch.randn(2, 4, L + RD, dtype=F16), cache, table, sl, kv_lora_rank=L, sm_scale=bad)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_fp8_scales_must_be_finite_and_positive(bad):
    kc, vc = allocate_kv_cache(4, 16, 2, 32, dtype=FP8)
    one, scale = torch.ones(1), torch.tensor([bad])
    key = torch.randn(2, 2, 32)
    with pytest.raises(ValueError, match=r"k_scale must be a finite positive scale"):
        write_kv_cache(key, key, kc, vc, torch.tensor([16, 17]), k_scale=scale, v_scale=one)
    q = torch.randn(1, 4, 32, dtype=F16)
    with pytest.raises(ValueError, match=r"v_scale must be a finite positive scale"):
        paged_decode(q, kc, vc, torch.ones(1, 1, dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
                     k_scale=one, v_scale=scale)
    cache = allocate_mla_cache(4, 16, L, RD, dtype=FP8)
    with pytest.raises(ValueError, match=r"kv_scale must be a finite positive scale"):
        concat_and_cache_mla(torch.randn(2, L), torch.randn(2, RD), cache, torch.tensor([16, 17]), kv_scale=scale)


def test_empty_caches_are_refused():
    with pytest.raises(ValueError, match=r"head_size must be a positive int, got 0"):
        allocate_kv_cache(4, 16, 2, 0)
    with pytest.raises(ValueError, match=r"num_kv_heads must be a positive int, got 0"):
        allocate_kv_cache(4, 16, 0, 32)
    kc, vc = torch.zeros(4, 16, 2, 0, dtype=F16), torch.zeros(4, 16, 2, 0, dtype=F16)
    with pytest.raises(ValueError, match=r"k_cache/v_cache: head_size must be positive"):
        write_kv_cache(torch.zeros(1, 2, 0, dtype=F16), torch.zeros(1, 2, 0, dtype=F16), kc, vc,
                       torch.tensor([16]))
    with pytest.raises(ValueError, match=r"kv_cache must have positive num_blocks, block_size and row width"):
        concat_and_cache_mla(torch.randn(1, L), torch.randn(1, RD), torch.zeros(0, 16, L + RD), torch.tensor([0]))


# -- index values: seq_lens, block ids, slots ------------------------------------------------------------------

def test_seq_lens_and_block_ids_are_checked():
    q, kc, vc, table, sl = _paged()
    num_blocks = kc.shape[0]
    with pytest.raises(ValueError, match=r"seq_lens: lengths must be >= 0 \(entry 1 is -3\)"):
        paged_decode(q, kc, vc, table, torch.tensor([5, -3], dtype=torch.int32))
    wide = table.shape[1] * 16
    with pytest.raises(ValueError, match=rf"seq_lens: lengths must fit in the block table .*entry 0 is {wide + 1}"):
        paged_decode(q, kc, vc, table, torch.tensor([wide + 1, 20], dtype=torch.int32))
    for bad_id in (num_blocks, -1):
        bad = table.clone()
        bad[1, 1] = bad_id
        with pytest.raises(ValueError, match=rf"block_table: block ids must be in \[0, num_blocks={num_blocks}\)"):
            paged_decode(q, kc, vc, bad, sl)
        _paged_ops_refuse(q, kc, vc, bad, sl, r"block_table: block ids must be in")
    bad = table.clone()
    bad[0, 1] = num_blocks  # past request 0's 5 tokens: never read, so allowed
    torch.testing.assert_close(paged_decode(q, kc, vc, bad, sl).float(), R.paged_decode_ref(q, kc, vc, table, sl).float(),
                               atol=1.5e-2, rtol=1e-2)
    with pytest.raises(ValueError, match=r"seq_lens: each length must cover its request's new tokens"):
        unified_attention(torch.randn(7, 4, 32, dtype=F16), kc, vc, table, torch.tensor([5, 2], dtype=torch.int32),
                          cu_seqlens([4, 3], "cpu"), 4)
    with pytest.raises(ValueError, match=r"seq_starts \+ lengths must fit in the block table"):
        gather_kv_cache(kc, vc, table, cu_seqlens([5, 20], "cpu"), torch.tensor([0, 20], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens_k ends at 25, past the 24 rows"):
        out = torch.empty(24, 2, 32, dtype=F16)
        gather_kv_cache(kc, vc, table, cu_seqlens([5, 20], "cpu"), torch.zeros(2, dtype=torch.int32),
                        out_k=out, out_v=out.clone())
    cache = allocate_mla_cache(num_blocks, 16, L, RD, dtype=F16)
    with pytest.raises(ValueError, match=r"seq_lens: lengths must be >= 0"):
        mla_decode(torch.randn(2, 4, L + RD, dtype=F16), cache, table, torch.tensor([-1, 3], dtype=torch.int32),
                   kv_lora_rank=L, sm_scale=0.1)
    bad = table.clone()
    bad[1, 0] = num_blocks + 5
    with pytest.raises(ValueError, match=r"block_table: block ids must be in"):
        mla_decode(torch.randn(2, 4, L + RD, dtype=F16), cache, bad, sl, kv_lora_rank=L, sm_scale=0.1)
    with pytest.raises(ValueError, match=r"block_table: block ids must be in"):
        gather_mla_cache(cache, bad, cu_seqlens([5, 20], "cpu"), torch.zeros(2, dtype=torch.int32))


def test_slots_past_the_cache_are_refused_or_skipped():
    """A host slot_mapping past the cache raises; with validate=False the kernels skip that row and write the
    others exactly as the reference (which skips it too)."""
    kc, vc = allocate_kv_cache(3, 16, 2, 32, dtype=F16)
    key, value = torch.randn(3, 2, 32, dtype=F16), torch.randn(3, 2, 32, dtype=F16)
    slots = torch.tensor([17, 48, 20])  # 48 = num_blocks * block_size: one past the last slot
    with pytest.raises(ValueError, match=r"slot_mapping: slots must be negative \(skip\) or below num_blocks \* "
                                         r"block_size = 48 \(entry 1 is 48\)"):
        write_kv_cache(key, value, kc, vc, slots)
    want_k, want_v = kc.clone(), vc.clone()
    write_kv_cache_ref(key, value, want_k, want_v, slots)
    write_kv_cache(key, value, kc, vc, torch.tensor([17, 1 << 40, 20]), validate=False)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v) and kc[1, 1].abs().sum() > 0

    cache = allocate_mla_cache(3, 16, L, RD, dtype=F16)
    kv_c, k_pe = torch.randn(3, L, dtype=F16), torch.randn(3, RD, dtype=F16)
    with pytest.raises(ValueError, match=r"slot_mapping: slots must be negative \(skip\) or below"):
        concat_and_cache_mla(kv_c, k_pe, cache, slots)
    want = cache.clone()
    concat_and_cache_mla_ref(kv_c, k_pe, want, slots)
    concat_and_cache_mla(kv_c, k_pe, cache, slots, validate=False)
    assert torch.equal(cache, want)

    q_out = torch.empty(3, 2, L + RD, dtype=F16)
    args = (torch.randn(3, 2, L, dtype=F16), torch.randn(3, 2, RD, dtype=F16), kv_c, k_pe)
    with pytest.raises(ValueError, match=r"slot_mapping: slots must be negative \(skip\) or below"):
        fused_qk_rope_concat_and_cache_mla(*args, cache, q_out, slots, None, None, None, None, None)
    fresh = allocate_mla_cache(3, 16, L, RD, dtype=F16)
    fused_qk_rope_concat_and_cache_mla(*args, fresh, q_out, slots, None, None, None, None, None, validate=False)
    assert torch.equal(fresh, want)  # same rows, the one past the cache skipped


def test_fp8_stores_keep_nan():
    """A NaN key stores NaN in an fp8 cache (as the reference), not the saturated finite value."""
    kc, vc = allocate_kv_cache(2, 16, 2, 32, dtype=FP8)
    key = torch.randn(2, 2, 32)
    key[0, 1, 3] = math.nan
    key[1, 0, 0] = -math.nan
    one = torch.ones(1)
    write_kv_cache(key, key.clone(), kc, vc, torch.tensor([16, 17]), k_scale=one, v_scale=one)
    ref_k, ref_v = allocate_kv_cache(2, 16, 2, 32, dtype=FP8)
    write_kv_cache_ref(key, key.clone(), ref_k, ref_v, torch.tensor([16, 17]), k_scale=one, v_scale=one)
    assert torch.equal(kc.float().isnan(), ref_k.float().isnan()) and int(kc.float().isnan().sum()) == 2
    torch.testing.assert_close(kc.float(), ref_k.float(), equal_nan=True)

    cache = allocate_mla_cache(2, 16, L, RD, dtype=FP8)
    kv_c, k_pe = torch.randn(2, L), torch.randn(2, RD)
    kv_c[1, 5] = math.nan
    k_pe[0, 2] = math.nan
    concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([16, 18]), kv_scale=one)
    ref = allocate_mla_cache(2, 16, L, RD, dtype=FP8)
    concat_and_cache_mla_ref(kv_c, k_pe, ref, torch.tensor([16, 18]), kv_scale=one)
    assert int(cache.float().isnan().sum()) == 2
    torch.testing.assert_close(cache.float(), ref.float(), equal_nan=True)

    fused = allocate_mla_cache(2, 16, L, RD, dtype=FP8)
    q_out = torch.empty(2, 2, L + RD, dtype=FP8)
    ql_nope = torch.randn(2, 2, L)
    ql_nope[0, 1, 0] = math.nan
    fused_qk_rope_concat_and_cache_mla(ql_nope, torch.randn(2, 2, RD), kv_c, k_pe, fused, q_out,
                                       torch.tensor([16, 18]), one, one, None, None, None)
    assert torch.equal(fused.float().isnan(), ref.float().isnan())
    assert bool(q_out[0, 1, 0].float().isnan()) and int(q_out.float().isnan().sum()) == 1


# -- when the device values are read ---------------------------------------------------------------------------

def test_value_checks_follow_the_setting(monkeypatch):
    host = torch.zeros(3)
    assert values_checked(None, host) and values_checked(True, host) and not values_checked(False, host)
    monkeypatch.delenv("TRIPATH_VALIDATE", raising=False)
    assert not _env.validate()
    monkeypatch.setenv("TRIPATH_VALIDATE", "1")
    assert _env.validate()
    monkeypatch.setenv("TRIPATH_VALIDATE", "0")
    assert not _env.validate()
    if torch.cuda.is_available():
        dev = host.cuda()
        assert not values_checked(None, dev) and values_checked(True, dev)
        monkeypatch.setenv("TRIPATH_VALIDATE", "1")
        assert values_checked(None, dev) and not values_checked(False, dev)

