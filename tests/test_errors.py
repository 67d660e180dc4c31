"""Bad input raises a clear exception that names the argument and what is supported."""

import pytest
import torch

from helpers import cu_seqlens
from tripath.attention import AttentionSpec
from tripath.ops import (allocate_kv_cache, gather_kv_cache, merge_states, paged_decode, unified_attention,
                         varlen_attention, write_kv_cache)


def _varlen_inputs(hq=4, hkv=2, d=64, dtype=torch.float16):
    q = torch.randn(6, hq, d, dtype=dtype)
    k = torch.randn(6, hkv, d, dtype=dtype)
    return q, k, k.clone(), cu_seqlens([6], "cpu"), cu_seqlens([6], "cpu")


def test_varlen_errors():
    q, k, v, cq, ck = _varlen_inputs()
    with pytest.raises(ValueError, match=r"q must have 3 dimensions"):
        varlen_attention(q[0], k, v, cq, ck, 6, 6)
    with pytest.raises(TypeError, match=r"k has dtype torch.float32; supported: float16"):
        varlen_attention(q, k.float(), v, cq, ck, 6, 6)
    with pytest.raises(TypeError, match=r"q has dtype torch.int32; supported: float16, bfloat16, float32"):
        varlen_attention(q.int(), k, v, cq, ck, 6, 6)
    with pytest.raises(ValueError, match=r"num query heads \(4\) must be a positive multiple of num kv heads \(3\)"):
        varlen_attention(q, torch.randn(6, 3, 64, dtype=torch.float16), torch.randn(6, 3, 64, dtype=torch.float16),
                         cq, ck, 6, 6)
    with pytest.raises(ValueError, match=r"head_size \(q.shape\[-1\]\)=16 is not supported: head sizes from 32 to 256"):
        varlen_attention(q[..., :16], k[..., :16], v[..., :16], cq, ck, 6, 6)
    with pytest.raises(ValueError, match=r"k has shape \(6, 2, 32\); dimension 2 must be 64"):
        varlen_attention(q, k[..., :32], v, cq, ck, 6, 6)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing, got \[0, 4, 2, 6\]"):
        varlen_attention(q, k, v, torch.tensor([0, 4, 2, 6], dtype=torch.int32), cu_seqlens([2, 2, 2], "cpu"), 6, 6)
    with pytest.raises(TypeError, match=r"cu_seqlens_k has dtype torch.int64; supported: int32"):
        varlen_attention(q, k, v, cq, ck.long(), 6, 6)
    with pytest.raises(ValueError, match=r"cu_seqlens_q \(2\) and cu_seqlens_k \(3\) must have the same length"):
        varlen_attention(q, k, v, cq, cu_seqlens([3, 3], "cpu"), 6, 6)
    with pytest.raises(ValueError, match=r"window_left must be -1 \(off\) or >= 0, got -5"):
        varlen_attention(q, k, v, cq, ck, 6, 6, window_left=-5)
    with pytest.raises(ValueError, match=r"sinks must have shape \[4\] \(one per query head\)"):
        varlen_attention(q, k, v, cq, ck, 6, 6, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match=r"out must have shape \(6, 4, 64\)"):
        varlen_attention(q, k, v, cq, ck, 6, 6, out=torch.empty(6, 4, 32, dtype=torch.float16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device type")
def test_device_mismatch_is_named():
    q, k, v, cq, ck = _varlen_inputs()
    with pytest.raises(ValueError, match=r"k is on cpu but the inputs are on cuda"):
        varlen_attention(q.cuda(), k, v, cq.cuda(), ck.cuda(), 6, 6)


def test_paged_errors():
    kc, vc = allocate_kv_cache(4, 16, 2, 64, dtype=torch.float16)
    q = torch.randn(2, 4, 64, dtype=torch.float16)
    bt = torch.ones(2, 2, dtype=torch.int32)
    sl = torch.tensor([5, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"layout='hnd' is not supported; supported: nhd, shuffled"):
        paged_decode(q, kc, vc, bt, sl, layout="hnd")
    with pytest.raises(ValueError, match=r"k_cache must have 5 dimensions"):
        paged_decode(q, kc, vc, bt, sl, layout="shuffled")
    with pytest.raises(ValueError, match=r"q's head size 32 does not match the cache's 64"):
        paged_decode(q[..., :32], kc, vc, bt, sl)
    with pytest.raises(TypeError, match=r"seq_lens has dtype torch.int64; supported: int32"):
        paged_decode(q, kc, vc, bt, sl.long())
    with pytest.raises(ValueError, match=r"k_scale is required for an fp8 KV cache"):
        k8, v8 = allocate_kv_cache(4, 16, 2, 64, dtype=torch.float8_e4m3fn)
        paged_decode(q, k8, v8, bt, sl)
    with pytest.raises(TypeError, match=r"k_cache dtype torch.bfloat16 must equal q's \(torch.float16\)"):
        paged_decode(q, kc.bfloat16(), vc.bfloat16(), bt, sl)
    with pytest.raises(ValueError, match=r"num_splits must be between 1 and 256, got 0"):
        paged_decode(q, kc, vc, bt, sl, num_splits=0)
    with pytest.raises(ValueError, match=r"seq_lens \(2\) and block_table \(2 rows\) must have one entry per request "
                                         r"of cu_seqlens_q \(1\)"):
        unified_attention(q, kc, vc, bt, sl, cu_seqlens([2], "cpu"), 2)


def test_cache_errors():
    with pytest.raises(ValueError, match=r"block_size=12 is not supported by the shuffled layout with "
                                         r"torch.float16: it must be a multiple of 8"):
        allocate_kv_cache(4, 12, 2, 64, dtype=torch.float16, layout="shuffled")
    with pytest.raises(TypeError, match=r"dtype=torch.int8 is not a supported KV cache dtype"):
        allocate_kv_cache(4, 16, 2, 64, dtype=torch.int8)
    kc, vc = allocate_kv_cache(4, 16, 2, 64, dtype=torch.float16)
    key = torch.randn(3, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"slot_mapping has 2 entries for 3 tokens"):
        write_kv_cache(key, key, kc, vc, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"key has shape \(3, 2, 64\); dimension 1 must be 4"):
        k4, v4 = allocate_kv_cache(4, 16, 4, 64, dtype=torch.float16)
        write_kv_cache(key, key, k4, v4, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"block_table \(1 rows\) and seq_starts \(2\) must have one entry per request"):
        gather_kv_cache(kc, vc, torch.ones(1, 2, dtype=torch.int32), cu_seqlens([1, 1], "cpu"),
                        torch.zeros(2, dtype=torch.int32))
    a = torch.randn(3, 2, 64)
    with pytest.raises(TypeError, match=r"lse_a has dtype torch.float16; supported: float32"):
        merge_states(a, torch.zeros(3, 2, dtype=torch.float16), a, torch.zeros(3, 2))


def test_spec_errors():
    with pytest.raises(ValueError, match=r"num_heads \(6\) must be a positive multiple of num_kv_heads \(4\)"):
        AttentionSpec(6, 4, 64)
    with pytest.raises(ValueError, match=r"head_size=300 is not supported: head sizes 32..256"):
        AttentionSpec(4, 4, 300)
    with pytest.raises(ValueError, match=r"kv_layout='hnd'; supported: nhd, shuffled"):
        AttentionSpec(4, 4, 64, kv_layout="hnd")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8'; supported: auto, fp8"):
        AttentionSpec(4, 4, 64, kv_cache_dtype="int8")
    with pytest.raises(TypeError, match=r"dtype=torch.int8 is not supported"):
        AttentionSpec(4, 4, 64, dtype=torch.int8)
