"""KV cache: layouts, allocation, write (kernel vs reference vs explicit indexing), gather, merge_states."""

import pytest
import torch

from conftest import DEVICE
from helpers import cu_seqlens, poison, random_block_table, slots_for
from tripath.ops import allocate_kv_cache, gather_kv_cache, kv_cache_shapes, merge_states, write_kv_cache
from tripath.ops import reference as R
from tripath.ops.kv_cache import as_nhd, gather_kv_cache_ref, write_kv_cache_ref

FP8 = torch.float8_e4m3fn


def test_shuffled_shapes_and_element_positions():
    k_shape, v_shape = kv_cache_shapes(5, 16, 2, 64, torch.bfloat16, "shuffled")
    assert k_shape == (5, 2, 8, 16, 8) and v_shape == (5, 2, 2, 64, 8)
    assert kv_cache_shapes(5, 32, 2, 64, FP8, "shuffled") == ((5, 2, 4, 32, 16), (5, 2, 2, 64, 16))
    # element (b, h, s, d) of K sits at K[b, h, d // x, s, d % x], of V at V[b, h, s // x, d, s % x]
    k_cache, v_cache = allocate_kv_cache(3, 16, 2, 32, dtype=torch.float16, layout="shuffled")
    key = torch.randn(1, 2, 32, dtype=torch.float16)
    value = torch.randn(1, 2, 32, dtype=torch.float16)
    write_kv_cache_ref(key, value, k_cache, v_cache, torch.tensor([2 * 16 + 11]), layout="shuffled")
    x = 8
    for d in (0, 7, 8, 31):
        assert k_cache[2, 1, d // x, 11, d % x] == key[0, 1, d]
        assert v_cache[2, 1, 11 // x, d, 11 % x] == value[0, 1, d]


@pytest.mark.parametrize("layout", ["nhd", "shuffled"])
@pytest.mark.parametrize("cache_dtype", [torch.float16, FP8])
@pytest.mark.parametrize("head_size", [64, 80])
def test_write_kv_cache_matches_reference(layout, cache_dtype, head_size):
    bs, hkv = 16, 2
    table, num_blocks = random_block_table([20, 9], bs, DEVICE)
    slots = slots_for(table, [torch.arange(20), torch.arange(9)], bs)
    slots[3] = -1  # padding: must not be written
    key = torch.randn(29, hkv, head_size, dtype=torch.float16, device=DEVICE)
    value = torch.randn(29, hkv, head_size, dtype=torch.float16, device=DEVICE)
    scales = dict(k_scale=torch.tensor([0.03], device=DEVICE), v_scale=torch.tensor([0.02], device=DEVICE)) \
        if cache_dtype == FP8 else {}
    got = allocate_kv_cache(num_blocks, bs, hkv, head_size, dtype=cache_dtype, layout=layout, device=DEVICE)
    want = allocate_kv_cache(num_blocks, bs, hkv, head_size, dtype=cache_dtype, layout=layout, device=DEVICE)
    write_kv_cache(key, value, *got, slots, layout=layout, **scales)
    write_kv_cache_ref(key, value, *want, slots, layout=layout, **scales)
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    k_nhd, _ = as_nhd(*got, layout)
    skipped_block, skipped_off = int(table[0, 0]), 3
    assert torch.all(k_nhd[skipped_block, skipped_off].float() == 0)  # slot -1 left untouched
    if cache_dtype == FP8:  # sat(x / scale) in e4m3
        expect = (key[0].float() / 0.03).clamp(-448, 448).to(FP8).float()
        assert torch.equal(k_nhd[int(table[0, 0]), 0].float(), expect)


@pytest.mark.parametrize("layout", ["nhd", "shuffled"])
@pytest.mark.parametrize("cache_dtype", [torch.float16, FP8])
def test_gather_kv_cache(layout, cache_dtype):
    bs, hkv, d = 16, 2, 64
    seq_lens = [40, 7, 33]
    table, num_blocks = random_block_table(seq_lens, bs, DEVICE)
    caches = allocate_kv_cache(num_blocks, bs, hkv, d, dtype=cache_dtype, layout=layout, device=DEVICE)
    keys = torch.randn(sum(seq_lens), hkv, d, dtype=torch.float16, device=DEVICE)
    values = torch.randn(sum(seq_lens), hkv, d, dtype=torch.float16, device=DEVICE)
    scales = dict(k_scale=torch.tensor([0.05], device=DEVICE), v_scale=torch.tensor([0.04], device=DEVICE)) \
        if cache_dtype == FP8 else {}
    write_kv_cache_ref(keys, values, *caches, slots_for(table, [torch.arange(s) for s in seq_lens], bs),
                       layout=layout, **scales)
    starts = torch.tensor([16, 0, 5], dtype=torch.int32, device=DEVICE)
    lens = [20, 7, 28]
    cu = cu_seqlens(lens, DEVICE)
    out_k = poison((60, hkv, d), torch.float16, DEVICE)  # workspace larger than the chunk
    out_v = poison((60, hkv, d), torch.float16, DEVICE)
    gather_kv_cache(*caches, table, cu, starts, layout=layout, out_k=out_k, out_v=out_v, **scales)
    want_k, want_v = gather_kv_cache_ref(*caches, table, cu, starts, layout=layout, **scales)
    torch.testing.assert_close(out_k[:55].float(), want_k, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(out_v[:55].float(), want_v, atol=1e-3, rtol=1e-3)
    assert torch.isnan(out_k[55:]).all()  # rows past the chunk untouched
    if cache_dtype == torch.float16:  # exact copies of what was written
        torch.testing.assert_close(out_k[:20], keys[16:36], atol=0, rtol=0)
        torch.testing.assert_close(out_k[27:55], keys[47 + 5:47 + 33], atol=0, rtol=0)


def test_merge_states_kernel():
    t, h, d = 7, 3, 80
    a, b = torch.randn(t, h, d, dtype=torch.float16, device=DEVICE), torch.randn(t, h, d, dtype=torch.float16, device=DEVICE)
    la, lb = torch.randn(t, h, device=DEVICE), torch.randn(t, h, device=DEVICE)
    la[0, 0] = float("-inf")  # empty side a
    lb[1, 1] = float("-inf")
    la[2, 2] = lb[2, 2] = float("-inf")  # both empty
    a[0, 0] = float("nan")  # garbage on an empty side must not leak
    out = poison((t, h, d), torch.float16, DEVICE)
    got, lse = merge_states(a, la, b, lb, out=out)
    want, want_lse = R.merge_states_ref(a, la, b, lb)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, want_lse)
    assert torch.all(got[2, 2] == 0) and torch.isneginf(lse[2, 2])
    torch.testing.assert_close(got[0, 0], b[0, 0])
