"""MLA ops: absorbed decode against float64 math and against non-absorbed attention, the cache write and
gather, the fused decode preparation against the unfused ops, and bad input."""

import math

import pytest
import torch

from conftest import DEVICE
from helpers import FP8_TOL, TOL, cu_seqlens, poison, random_block_table
from tripath.ops import (allocate_mla_cache, concat_and_cache_mla, concat_mla_query,
                         fused_qk_rope_concat_and_cache_mla, gather_mla_cache, identity_rope_tables, mla_decode,
                         rope_cos_sin, rotary_embedding)
from tripath.triton_internals import capture_launches
from tripath.ops.reference_mla import fused_qk_rope_concat_and_cache_mla_ref
from tripath.platform import fp8_dtype

FP8 = fp8_dtype()
L, R = 512, 64


def scale_tensor(value):
    return torch.tensor([value], dtype=torch.float32, device=DEVICE)


def quantize(x, dtype, scale):
    """Independent fp8 quantisation: saturate ``x / scale`` to the e4m3 range."""
    if dtype == FP8:
        limit = torch.finfo(FP8).max
        return (x.float() / scale.item()).clamp(-limit, limit).to(FP8)
    return x.to(dtype)


def filled_mla_cache(seq_lens, block_size, width, cache_dtype, kv_scale=None, magnitude=1.0):
    """A cache whose rows for every (request, position) hold fresh random values (quantised for fp8);
    returns ``(kv_cache, block_table, rows)`` with ``rows[i] [seq_len_i, width]`` float64 of what is stored."""
    block_table, num_blocks = random_block_table(seq_lens, block_size, DEVICE)
    cache = quantize(torch.randn(num_blocks, block_size, width, device=DEVICE) * magnitude, cache_dtype, kv_scale)
    rows = []
    for i, n in enumerate(seq_lens):
        pos = torch.arange(n, device=DEVICE)
        stored = cache[block_table[i, pos // block_size].long(), pos % block_size].double()
        rows.append(stored * (kv_scale.item() if cache_dtype == FP8 else 1.0))
    return cache, block_table, rows


def absorbed_f64(q, rows, kv_lora_rank, sm_scale):
    """Naive absorbed MLA decode in float64: ``q [H, L + R]`` against ``rows [n, L + R]``."""
    if rows.shape[0] == 0:
        return torch.zeros(q.shape[0], kv_lora_rank, dtype=torch.float64), torch.full((q.shape[0],), -math.inf,
                                                                                     dtype=torch.float64)
    s = (q.double() @ rows.T) * sm_scale
    return torch.softmax(s, dim=-1) @ rows[:, :kv_lora_rank], torch.logsumexp(s, dim=-1)


def check_decode(q, cache, block_table, seq_lens, rows, *, kv_lora_rank=L, kv_scale=None, q_scale=None, tol,
                 **kwargs):
    batch, heads, _ = q.shape
    sm_scale = 1.0 / math.sqrt(192)
    out = poison((batch, heads, kv_lora_rank), torch.float16 if q.dtype == FP8 else q.dtype, DEVICE)
    got, lse = mla_decode(q, cache, block_table, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                          kv_lora_rank=kv_lora_rank, sm_scale=sm_scale, kv_scale=kv_scale, q_scale=q_scale,
                          out=out, return_lse=True, **kwargs)
    assert got is out
    q64 = q.double() * (q_scale.item() if q_scale is not None else 1.0)
    for b in range(batch):
        want_o, want_lse = absorbed_f64(q64[b].cpu(), rows[b].cpu(), kv_lora_rank, sm_scale)
        torch.testing.assert_close(got[b].double().cpu(), want_o, **tol)
        torch.testing.assert_close(lse[b].double().cpu(), want_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("num_heads", [8, 16, 32, 128])
def test_mla_decode_matches_f64(num_heads, block_size):
    seq_lens = [1, 37, 300] if num_heads < 128 else [1, 70]
    cache, block_table, rows = filled_mla_cache(seq_lens, block_size, L + R, torch.float16)
    q = torch.randn(len(seq_lens), num_heads, L + R, dtype=torch.float16, device=DEVICE)
    check_decode(q, cache, block_table, seq_lens, rows, tol=TOL[torch.float16])


@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_mla_decode_long_context_and_splits(num_splits):
    """Contexts up to a few thousand rows; one split, several, and the automatic choice agree with float64."""
    seq_lens = [2049, 700, 0] if num_splits is None else [600, 250, 0]
    cache, block_table, rows = filled_mla_cache(seq_lens, 64, L + R, torch.float16)
    q = torch.randn(3, 16, L + R, dtype=torch.float16, device=DEVICE)
    check_decode(q, cache, block_table, seq_lens, rows, tol=TOL[torch.float16], num_splits=num_splits)


def test_mla_decode_empty_request_gives_zero_and_minus_inf():
    cache, block_table, _ = filled_mla_cache([0, 5], 16, L + R, torch.float16)
    q = torch.randn(2, 8, L + R, dtype=torch.float16, device=DEVICE)
    for splits in (1, 3):
        out, lse = mla_decode(q, cache, block_table, torch.tensor([0, 5], dtype=torch.int32, device=DEVICE),
                              sm_scale=0.1, num_splits=splits, out=poison((2, 8, L), torch.float16, DEVICE),
                              return_lse=True)
        assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
        assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()


@pytest.mark.parametrize("q_fp8", [False, True])
@pytest.mark.parametrize("variant", ["packed", "grouped"])
def test_mla_decode_fp8_cache(q_fp8, variant):
    """fp8 cache with a scale != 1 (and an fp8 query with its own scale): the scales fold into the scores
    and the output."""
    seq_lens = [90, 17]
    kv_scale = scale_tensor(0.37)
    cache, block_table, rows = filled_mla_cache(seq_lens, 16, L + R, FP8, kv_scale, magnitude=0.37)
    q = torch.randn(2, 16 if variant == "packed" else 8, L + R, dtype=torch.float16, device=DEVICE)
    q_scale = None
    if q_fp8:
        q_scale = scale_tensor(0.05)
        q = quantize(q, FP8, q_scale)
    check_decode(q, cache, block_table, seq_lens, rows, kv_scale=kv_scale, q_scale=q_scale, tol=FP8_TOL,
                 variant=variant)


@pytest.mark.parametrize("num_splits,fp8,lora,rope", [(1, False, L, R), (3, False, L, R), (2, True, L, R),
                                                     (1, False, 96, 32)])
def test_mla_decode_value_split_in_two(monkeypatch, num_splits, fp8, lora, rope):
    """``V_PARTS = 2`` (the many-heads layout): two programs per head block, each writing half of the
    latent columns, agree with float64, with splits, an fp8 cache, and a latent that is no power of two."""
    from tripath.ops import _mla_configs

    base = _mla_configs.mla_decode_config
    monkeypatch.setattr(_mla_configs, "mla_decode_config", lambda *a, **kw: {**base(*a, **kw), "V_PARTS": 2})
    seq_lens = [45, 130, 1]
    kv_scale = scale_tensor(0.5) if fp8 else None
    cache, block_table, rows = filled_mla_cache(seq_lens, 16, lora + rope, FP8 if fp8 else torch.float16,
                                                kv_scale, magnitude=0.5 if fp8 else 1.0)
    q = torch.randn(3, 16, lora + rope, dtype=torch.float16, device=DEVICE)
    with capture_launches() as records:
        mla_decode(q, cache, block_table, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                   kv_lora_rank=lora, sm_scale=0.1, kv_scale=kv_scale, num_splits=num_splits, variant="packed")
    assert records[0].kwargs["V_PARTS"] == 2 and records[0].grid[1] == 2
    check_decode(q, cache, block_table, seq_lens, rows, kv_lora_rank=lora, kv_scale=kv_scale,
                 num_splits=num_splits, tol=FP8_TOL if fp8 else TOL[torch.float16], variant="packed")


def poison_unused_rows(cache, block_table, seq_lens):
    """NaN in every cache row no request reads: rows past a request's end in its last page, free pages."""
    used = torch.zeros(cache.shape[:2], dtype=torch.bool, device=cache.device)
    for i, n in enumerate(seq_lens):
        pos = torch.arange(n, device=cache.device)
        used[block_table[i, pos // cache.shape[1]].long(), pos % cache.shape[1]] = True
    if cache.element_size() == 1:
        cache.view(torch.uint8)[~used] = 0x7F  # e4m3 NaN
    else:
        cache[~used] = float("nan")


@pytest.mark.parametrize("swap_ab", [False, True], ids=["heads-as-rows", "cache-rows-as-rows"])
@pytest.mark.parametrize("v_parts,kind,num_splits,block_size", [(1, "fp16", 1, 16), (1, "fp16", 3, 64),
                                                                (2, "fp16", 2, 16), (1, "fp8_kv", 1, 32),
                                                                (2, "fp8_q", 3, 16)])
def test_mla_decode_tensor_descriptor_path(monkeypatch, v_parts, kind, num_splits, block_size, swap_ab):
    """The Hopper path (cache tiles through tensor descriptors): unmasked whole tiles, then a ragged last
    tile whose rows past the request are NaN in the cache and must not reach the output; with the products
    in either orientation (``SWAP_AB``)."""
    from tripath.ops import _mla_configs

    base = _mla_configs.mla_decode_config
    monkeypatch.setattr(_mla_configs, "mla_decode_config",
                        lambda *a, **kw: {**base(*a, **kw), "V_PARTS": v_parts, "TMA": True, "SWAP_AB": swap_ab})
    seq_lens = [45, 130, 16, 1]
    if DEVICE.type != "cpu":   # descriptors need pages of whole tiles: the GPU's tiles are up to 64 rows
        block_size = max(block_size, 64)
    fp8 = kind != "fp16"
    kv_scale = scale_tensor(0.5) if fp8 else None
    cache, block_table, rows = filled_mla_cache(seq_lens, block_size, L + R, FP8 if fp8 else torch.float16,
                                                kv_scale, magnitude=0.5 if fp8 else 1.0)
    poison_unused_rows(cache, block_table, seq_lens)
    q = torch.randn(len(seq_lens), 16, L + R, dtype=torch.float16, device=DEVICE)
    q_scale = None
    if kind == "fp8_q":
        q_scale = scale_tensor(0.05)
        q = quantize(q, FP8, q_scale)
    with capture_launches() as records:
        mla_decode(q, cache, block_table, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                   sm_scale=0.1, kv_scale=kv_scale, q_scale=q_scale, num_splits=num_splits, variant="packed")
    assert records[0].kwargs["USE_TMA"] is True and records[0].kwargs["V_PARTS"] == v_parts
    assert records[0].kwargs["SWAP_AB"] is swap_ab
    check_decode(q, cache, block_table, seq_lens, rows, kv_scale=kv_scale, q_scale=q_scale,
                 num_splits=num_splits, tol=FP8_TOL if fp8 else TOL[torch.float16], variant="packed")


def test_mla_cache_descriptors_are_kept_on_the_cache():
    """Descriptors are built once per cache tensor and tile shape (eager steps reuse them per layer)."""
    from tripath.ops.mla_absorbed import _cache_descriptors

    cache = allocate_mla_cache(4, 64, dtype=torch.float16, device=DEVICE)
    first = _cache_descriptors(cache, L, L, R, L, 64)
    assert first is not None and _cache_descriptors(cache, L, L, R, L, 64) is first
    assert _cache_descriptors(cache, L, L, R, L // 2, 32)[0].block_shape == [32, L // 2]
    assert _cache_descriptors(allocate_mla_cache(4, 16, dtype=torch.float16, device=DEVICE), L, L, R, L, 64) is None


@pytest.mark.parametrize("block_size,lora,rope,swap_ab", [(1, L, R, False), (16, 96, 32, False), (1, L, R, True),
                                                          (16, 96, 32, True)])
def test_mla_decode_tensor_descriptor_falls_back(monkeypatch, block_size, lora, rope, swap_ab):
    """Pages smaller than a tile, or a latent that is no power of two: pointer loads, same results (with
    the products in either orientation)."""
    from tripath.ops import _mla_configs

    base = _mla_configs.mla_decode_config
    monkeypatch.setattr(_mla_configs, "mla_decode_config",
                        lambda *a, **kw: {**base(*a, **kw), "TMA": True, "SWAP_AB": swap_ab})
    seq_lens = [40, 3]
    cache, block_table, rows = filled_mla_cache(seq_lens, block_size, lora + rope, torch.float16)
    q = torch.randn(2, 16, lora + rope, dtype=torch.float16, device=DEVICE)
    with capture_launches() as records:
        mla_decode(q, cache, block_table, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                   kv_lora_rank=lora, sm_scale=0.1)
    assert records[0].kwargs["USE_TMA"] is False
    check_decode(q, cache, block_table, seq_lens, rows, kv_lora_rank=lora, tol=TOL[torch.float16])


@pytest.mark.parametrize("kv_lora_rank,rope_dim", [(64, 16), (96, 32), (48, 8)])
def test_mla_decode_small_and_odd_dims(kv_lora_rank, rope_dim):
    """Any latent/rotary split (tiles are padded and masked): the small shapes the backend tests use."""
    seq_lens = [33, 5]
    cache, block_table, rows = filled_mla_cache(seq_lens, 16, kv_lora_rank + rope_dim, torch.float32)
    q = torch.randn(2, 4, kv_lora_rank + rope_dim, dtype=torch.float32, device=DEVICE)
    check_decode(q, cache, block_table, seq_lens, rows, kv_lora_rank=kv_lora_rank, tol=dict(atol=2e-3, rtol=2e-3))


def test_absorbed_decode_equals_non_absorbed_attention():
    """Same weights and inputs: absorbed decode (latent space + W_UK / W_UV) equals attention over the
    explicitly up-projected keys ``[k_nope | k_pe]`` and values."""
    heads, p_dim, v_dim, seq_lens = 8, 128, 128, [45, 200]
    w_uk = torch.randn(heads, p_dim, L, dtype=torch.float64) / math.sqrt(L)
    w_uv = torch.randn(heads, L, v_dim, dtype=torch.float64) / math.sqrt(L)
    q_nope = torch.randn(len(seq_lens), heads, p_dim, dtype=torch.float64)
    q_pe = torch.randn(len(seq_lens), heads, R, dtype=torch.float64)
    cache, block_table, rows = filled_mla_cache(seq_lens, 16, L + R, torch.float16)
    sm_scale = 1.0 / math.sqrt(p_dim + R)
    ql_nope = torch.einsum("bhp,hpl->bhl", q_nope, w_uk)
    q = torch.cat([ql_nope, q_pe], dim=-1).to(torch.float16)
    o_lat = mla_decode(q.to(DEVICE), cache, block_table, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                       kv_lora_rank=L, sm_scale=sm_scale)
    absorbed = torch.einsum("bhl,hlv->bhv", o_lat.double().cpu(), w_uv)
    for b, rows_b in enumerate(rows):
        kv_c, k_pe = rows_b[:, :L].cpu(), rows_b[:, L:].cpu()
        k = torch.cat([torch.einsum("hpl,nl->nhp", w_uk, kv_c), k_pe[:, None, :].expand(-1, heads, -1)], dim=-1)
        v = torch.einsum("nl,hlv->nhv", kv_c, w_uv)
        qb = torch.cat([q_nope[b], q_pe[b]], dim=-1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", qb, k) * sm_scale, dim=-1)
        explicit = torch.einsum("hn,nhv->hv", p, v)
        torch.testing.assert_close(absorbed[b], explicit, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("cache_dtype", [torch.float16, FP8])
@pytest.mark.parametrize("block_size", [1, 16])
def test_concat_and_cache_mla(cache_dtype, block_size):
    num_tokens = 12
    kv_scale = scale_tensor(0.5) if cache_dtype == FP8 else None
    num_blocks = 2 + num_tokens // block_size + 3
    cache = quantize(torch.randn(num_blocks, block_size, L + R, device=DEVICE), cache_dtype, scale_tensor(1.0))
    before = cache.clone()
    slots = (torch.randperm((num_blocks - 1) * block_size, device=DEVICE)[:num_tokens] + block_size).long()
    slots[[2, 7]] = -1  # padding: writes nothing
    kv_c = torch.randn(num_tokens, L, dtype=torch.float16, device=DEVICE)
    k_pe = torch.randn(num_tokens, 1, R, dtype=torch.float16, device=DEVICE)  # [T, 1, R] views are accepted
    concat_and_cache_mla(kv_c, k_pe, cache, slots, kv_scale=kv_scale)
    expected = before.clone()
    keep = slots >= 0
    expected.view(-1, L + R)[slots[keep]] = quantize(torch.cat([kv_c, k_pe[:, 0]], -1)[keep], cache_dtype,
                                                     kv_scale if kv_scale is not None else scale_tensor(1.0))
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("width", [L + R, 80, 48])
@pytest.mark.parametrize("cache_dtype", [torch.float16, FP8])
def test_gather_mla_cache(cache_dtype, width):
    kv_scale = scale_tensor(0.8) if cache_dtype == FP8 else None
    seq_lens = [70, 3, 40]
    cache, block_table, rows = filled_mla_cache(seq_lens, 16, width, cache_dtype, kv_scale)
    starts, counts = [20, 0, 33], [50, 3, 7]
    cu = cu_seqlens(counts, DEVICE)
    seq_starts = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    out = poison((sum(counts) + 5, width), torch.float32, DEVICE)
    got = gather_mla_cache(cache, block_table, cu, seq_starts, kv_scale=kv_scale, out=out)
    assert got is out
    want = torch.cat([rows[i][s:s + n] for i, (s, n) in enumerate(zip(starts, counts))])
    torch.testing.assert_close(out[: sum(counts)].double(), want, atol=0, rtol=1e-6)  # fp32 dequantisation
    assert torch.isnan(out[sum(counts):]).all()  # workspace rows past the chunk are left alone
    auto = gather_mla_cache(cache, block_table, cu, seq_starts, kv_scale=kv_scale)
    assert auto.dtype == (torch.bfloat16 if cache_dtype == FP8 else torch.float16)
    torch.testing.assert_close(auto.double(), want, **TOL[torch.bfloat16])


def prep_inputs(num_tokens, heads, dtype=torch.float16):
    return (torch.randn(num_tokens, heads, L, dtype=dtype, device=DEVICE),
            torch.randn(num_tokens, heads, R, dtype=dtype, device=DEVICE),
            torch.randn(num_tokens, L, dtype=dtype, device=DEVICE),
            torch.randn(num_tokens, R, dtype=dtype, device=DEVICE))


def unfused_prep(ql_nope, q_pe, kv_c, k_pe, cache, q_out, slots, k_scale, q_scale, positions, cos, sin, is_neox):
    """The unfused path: in-place rotary, the cache write, then the query concat (three launches)."""
    q_pe, k_pe = q_pe.clone(), k_pe.clone()
    rotary_embedding(positions, q_pe, k_pe, torch.cat([cos, sin], -1), is_neox=is_neox)
    concat_and_cache_mla(kv_c, k_pe, cache, slots, kv_scale=k_scale)
    concat_mla_query(ql_nope, q_pe, q_out, q_scale=q_scale)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("heads", [16, 20])
def test_fused_prep_equals_unfused(is_neox, fp8, heads):
    """Cache rows bit-identical and q_out identical after quantisation; negative slots write nothing."""
    num_tokens, block_size, num_blocks = 10, 16, 6
    out_dtype = FP8 if fp8 else torch.float16
    k_scale, q_scale = (scale_tensor(0.25), scale_tensor(0.125)) if fp8 else (None, None)
    ql_nope, q_pe, kv_c, k_pe = prep_inputs(num_tokens, heads)
    slots = (torch.randperm((num_blocks - 1) * block_size, device=DEVICE)[:num_tokens] + block_size).long()
    slots[[0, 6]] = -1
    positions = torch.randint(0, 4096, (num_tokens,), device=DEVICE)
    cos, sin = rope_cos_sin(4096, R, device=DEVICE)
    sentinel = quantize(torch.randn(num_blocks, block_size, L + R, device=DEVICE), out_dtype, scale_tensor(1.0))
    cache_f, cache_u = sentinel.clone(), sentinel.clone()
    q_f = poison((num_tokens, heads, L + R), torch.float16, DEVICE).to(out_dtype)
    q_u = q_f.clone()
    with capture_launches() as launches:
        fused_qk_rope_concat_and_cache_mla(ql_nope, q_pe, kv_c, k_pe, cache_f, q_f, slots, k_scale, q_scale,
                                           positions, cos, sin, is_neox=is_neox)
    assert len(launches) == 1  # one launch per layer
    fused_qk_rope_concat_and_cache_mla(ql_nope, q_pe, kv_c, k_pe, cache_f, q_f, slots, k_scale, q_scale,
                                       positions, cos, sin, is_neox=is_neox)
    unfused_prep(ql_nope, q_pe, kv_c, k_pe, cache_u, q_u, slots, k_scale, q_scale, positions, cos, sin, is_neox)
    assert torch.equal(cache_f.view(torch.uint8), cache_u.view(torch.uint8))
    assert torch.equal(q_f.view(torch.uint8), q_u.view(torch.uint8))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(cache_f.view(-1, L + R)[untouched].view(torch.uint8),
                       sentinel.view(-1, L + R)[untouched].view(torch.uint8))
    # ... and both agree with float math: rotation of the pairs, then quantisation.
    ref_cache, ref_q = sentinel.clone(), q_u.clone()
    fused_qk_rope_concat_and_cache_mla_ref(ql_nope, q_pe, kv_c, k_pe, ref_cache, ref_q, slots, k_scale, q_scale,
                                           positions, cos, sin, is_neox=is_neox)
    tol = FP8_TOL if fp8 else TOL[torch.float16]
    torch.testing.assert_close(q_f.float(), ref_q.float(), **tol)
    torch.testing.assert_close(cache_f.float(), ref_cache.float(), **tol)


@pytest.mark.parametrize("use_tables", [True, False])
def test_fused_prep_identity_rotation_is_exact(use_tables):
    """NoPE: a one-row identity table (positions clamped into it) or no tables at all (the constexpr path
    that skips the rotation) give exactly the unrotated values."""
    num_tokens, heads = 6, 8
    ql_nope, q_pe, kv_c, k_pe = prep_inputs(num_tokens, heads, torch.bfloat16)
    cache = allocate_mla_cache(4, 16, L, R, dtype=torch.bfloat16, device=DEVICE)
    q_out = poison((num_tokens, heads, L + R), torch.bfloat16, DEVICE)
    slots = torch.arange(16, 16 + num_tokens, device=DEVICE)
    if use_tables:
        cos, sin = identity_rope_tables(R, device=DEVICE)
        positions = torch.tensor([0, 1, 77, 4095, 10**6, 3], device=DEVICE)
    else:
        cos = sin = positions = None
    fused_qk_rope_concat_and_cache_mla(ql_nope, q_pe, kv_c, k_pe, cache, q_out, slots, None, None, positions,
                                       cos, sin, is_neox=True)
    assert torch.equal(q_out, torch.cat([ql_nope, q_pe], -1))
    assert torch.equal(cache.view(-1, L + R)[slots], torch.cat([kv_c, k_pe], -1))


def test_fused_prep_rope_first_order():
    """``is_nope_first=False`` orders both the query and the cache row ``[rope | nope]``."""
    num_tokens, heads = 4, 16
    ql_nope, q_pe, kv_c, k_pe = prep_inputs(num_tokens, heads)
    cos, sin = rope_cos_sin(64, R, device=DEVICE)
    positions = torch.tensor([3, 0, 63, 9], device=DEVICE)
    slots = torch.tensor([17, 16, 40, 63], device=DEVICE)
    cache = allocate_mla_cache(4, 16, L, R, dtype=torch.float16, device=DEVICE)
    q_out = poison((num_tokens, heads, L + R), torch.float16, DEVICE)
    fused_qk_rope_concat_and_cache_mla(ql_nope, q_pe, kv_c, k_pe, cache, q_out, slots, None, None, positions,
                                       cos, sin, is_neox=False, is_nope_first=False)
    rot_q, rot_k = q_pe.clone(), k_pe.clone()
    rotary_embedding(positions, rot_q, rot_k, torch.cat([cos, sin], -1), is_neox=False)
    assert torch.equal(q_out, torch.cat([rot_q, ql_nope], -1))
    assert torch.equal(cache.view(-1, L + R)[slots], torch.cat([rot_k, kv_c], -1))


def test_fused_prep_feeds_decode():
    """Decode on what the fused kernel wrote (fp8 query and cache) equals float64 attention on the rotated
    inputs: the preparation and the decode agree on the row layout and the scales."""
    heads, seq_len, block_size = 16, 40, 16
    k_scale, q_scale = scale_tensor(0.05), scale_tensor(0.04)
    block_table, num_blocks = random_block_table([seq_len], block_size, DEVICE)
    cache = allocate_mla_cache(num_blocks, block_size, L, R, dtype=FP8, device=DEVICE)
    pos = torch.arange(seq_len, device=DEVICE)
    slots = block_table[0, pos // block_size].long() * block_size + pos % block_size
    ql_nope, q_pe, kv_c, k_pe = prep_inputs(seq_len, heads)
    cos, sin = rope_cos_sin(seq_len, R, device=DEVICE)
    q_out = torch.empty(seq_len, heads, L + R, dtype=FP8, device=DEVICE)
    fused_qk_rope_concat_and_cache_mla(ql_nope, q_pe, kv_c, k_pe, cache, q_out, slots, k_scale, q_scale, pos,
                                       cos, sin, is_neox=False)
    last = q_out[-1:]
    got = mla_decode(last, cache, block_table, torch.tensor([seq_len], dtype=torch.int32, device=DEVICE),
                     sm_scale=0.08, kv_scale=k_scale, q_scale=q_scale)
    rot_q, rot_k = q_pe.clone(), k_pe.clone()
    rotary_embedding(pos, rot_q, rot_k, torch.cat([cos, sin], -1), is_neox=False)
    q64 = last[0].double().cpu() * q_scale.item()
    rows = cache[block_table[0, pos // block_size].long(), pos % block_size].double().cpu() * k_scale.item()
    # What was written is the rotated, concatenated inputs at fp8 precision ...
    torch.testing.assert_close(q64, torch.cat([ql_nope[-1], rot_q[-1]], -1).double().cpu(), atol=0.01, rtol=0.07)
    torch.testing.assert_close(rows, torch.cat([kv_c, rot_k], -1).double().cpu(), atol=0.01, rtol=0.07)
    # ... and the decode of it (fp8 operands) matches float64 attention on those values.
    want, _ = absorbed_f64(q64, rows, L, 0.08)
    torch.testing.assert_close(got[0].double().cpu(), want, **FP8_TOL)


def test_mla_decode_bad_input():
    cache = allocate_mla_cache(4, 16, L, R, dtype=torch.float16, device=DEVICE)
    q = torch.randn(2, 8, L + R, dtype=torch.float16, device=DEVICE)
    bt = torch.ones(2, 2, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([3, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"kv_cache rows have 576 values; expected 560 \(kv_lora_rank \+ rope\)"):
        mla_decode(q[..., :560], cache, bt, lens, sm_scale=0.1)
    with pytest.raises(ValueError, match=r"kv_lora_rank=576 must be between 1 and q.shape\[-1\] - 1 \(575\)"):
        mla_decode(q, cache, bt, lens, kv_lora_rank=576, sm_scale=0.1)
    with pytest.raises(TypeError, match="kv_cache dtype torch.float32 must equal q's"):
        mla_decode(q, cache.float(), bt, lens, sm_scale=0.1)
    with pytest.raises(ValueError, match="kv_scale is required for an fp8 KV cache"):
        mla_decode(q, cache.to(FP8), bt, lens, sm_scale=0.1)
    with pytest.raises(ValueError, match="q_scale is required for an fp8 q"):
        mla_decode(q.to(FP8), cache.to(FP8), bt, lens, sm_scale=0.1, kv_scale=scale_tensor(1.0))
    with pytest.raises(TypeError, match="an fp8 q .* needs an fp8 kv_cache of the same dtype"):
        mla_decode(q.to(FP8), cache, bt, lens, sm_scale=0.1, q_scale=scale_tensor(1.0))
    with pytest.raises(ValueError,
                       match=r"variant='flash' is not supported; supported: auto, gluon, packed, grouped$"):
        mla_decode(q, cache, bt, lens, sm_scale=0.1, variant="flash")
    with pytest.raises(ValueError, match="num_splits must be between 1 and 256, got 0"):
        mla_decode(q, cache, bt, lens, sm_scale=0.1, num_splits=0)
    with pytest.raises(ValueError, match=r"block_table \(1 rows\) and seq_lens \(2\) must have one row per request"):
        mla_decode(q, cache, bt[:1], lens, sm_scale=0.1)
    with pytest.raises(TypeError, match="seq_lens has dtype torch.int64; supported: int32"):
        mla_decode(q, cache, bt, lens.long(), sm_scale=0.1)
    with pytest.raises(ValueError, match=r"out must have shape \(2, 8, 512\), got \(2, 8, 576\)"):
        mla_decode(q, cache, bt, lens, sm_scale=0.1, out=torch.empty_like(q))
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'sm_scale'"):
        mla_decode(q, cache, bt, lens)


def test_cache_and_prep_bad_input():
    cache = allocate_mla_cache(4, 16, L, R, dtype=FP8, device=DEVICE)
    ql_nope, q_pe, kv_c, k_pe = prep_inputs(3, 8)
    slots = torch.tensor([16, 17, -1], device=DEVICE)
    q_out = torch.empty(3, 8, L + R, dtype=FP8, device=DEVICE)
    cos, sin = rope_cos_sin(8, R, device=DEVICE)
    pos = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="kv_scale is required for an fp8 KV cache"):
        concat_and_cache_mla(kv_c, k_pe, cache, slots)
    with pytest.raises(ValueError, match=r"k_pe must be \[T, R\] \(or \[T, 1, R\]\) with T=3, got \(3, 2, 64\)"):
        concat_and_cache_mla(kv_c, k_pe[:, None].expand(3, 2, R), cache, slots, kv_scale=scale_tensor(1.0))
    with pytest.raises(ValueError, match=r"slot_mapping has 2 entries for 3 tokens"):
        concat_and_cache_mla(kv_c, k_pe, cache, slots[:2], kv_scale=scale_tensor(1.0))
    with pytest.raises(ValueError, match="q_scale is required for an fp8 KV cache"):
        fused_qk_rope_concat_and_cache_mla(ql_nope, q_pe, kv_c, k_pe, cache, q_out, slots, scale_tensor(1.0),
                                           None, pos, cos, sin)
    with pytest.raises(ValueError, match="positions, cos_cache and sin_cache must be given together"):
        fused_qk_rope_concat_and_cache_mla(ql_nope, q_pe, kv_c, k_pe, cache, q_out, slots, scale_tensor(1.0),
                                           scale_tensor(1.0), pos, cos, None)
    with pytest.raises(ValueError, match=r"cos_cache must have 32 columns, got shape \(8, 64\)"):
        fused_qk_rope_concat_and_cache_mla(ql_nope, q_pe, kv_c, k_pe, cache, q_out, slots, scale_tensor(1.0),
                                           scale_tensor(1.0), pos, torch.cat([cos, sin], -1), sin)
    with pytest.raises(ValueError, match=r"q_out has shape \(3, 8, 576\); dimension 1 must be 4"):
        fused_qk_rope_concat_and_cache_mla(ql_nope[:, :4], q_pe[:, :4], kv_c, k_pe, cache, q_out, slots,
                                           scale_tensor(1.0), scale_tensor(1.0), pos, cos, sin)
    with pytest.raises(TypeError, match="is_nope_first must be a bool, got str"):
        fused_qk_rope_concat_and_cache_mla(ql_nope, q_pe, kv_c, k_pe, cache, q_out, slots, scale_tensor(1.0),
                                           scale_tensor(1.0), pos, cos, sin, is_nope_first="yes")
    with pytest.raises(ValueError, match=r"block_table \(1 rows\) and seq_starts \(2\) must have one entry per "
                                         r"request of cu_seqlens \(2\)"):
        gather_mla_cache(cache, torch.ones(1, 2, dtype=torch.int32, device=DEVICE),
                         cu_seqlens([1, 2], DEVICE), torch.zeros(2, dtype=torch.int32, device=DEVICE),
                         kv_scale=scale_tensor(1.0))
    with pytest.raises(TypeError, match="dtype=torch.int8 is not a supported MLA cache dtype"):
        allocate_mla_cache(2, 16, dtype=torch.int8)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("num_heads,batch,context", [(16, 8, 4096), (128, 4, 2048), (16, 2, 32768)])
def test_mla_decode_bf16_gpu(num_heads, batch, context, block_size):
    seq_lens = [context - 3 * i for i in range(batch)]
    cache, block_table, rows = filled_mla_cache(seq_lens, block_size, L + R, torch.bfloat16)
    q = torch.randn(batch, num_heads, L + R, dtype=torch.bfloat16, device=DEVICE)
    check_decode(q, cache, block_table, seq_lens, rows, tol=TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_splits", [(16, None), (16, 3), (128, None), (128, 2)])
def test_mla_decode_descriptor_path_gpu(num_heads, num_splits):
    """The H200 configuration (64-row pages: descriptor tiles; 16 heads: transposed products and L2
    prefetch) with ragged requests whose pages hold NaN past their ends, against float64."""
    from tripath.triton_internals import capture_launches

    seq_lens = [3000, 1025, 64, 1, 777]
    cache, block_table, rows = filled_mla_cache(seq_lens, 64, L + R, torch.bfloat16)
    poison_unused_rows(cache, block_table, seq_lens)
    q = torch.randn(len(seq_lens), num_heads, L + R, dtype=torch.bfloat16, device=DEVICE)
    with capture_launches() as records:
        mla_decode(q, cache, block_table, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), sm_scale=0.1,
                   variant="packed")
    assert records[0].kwargs["USE_TMA"] is True
    assert records[0].kwargs["PREFETCH"] == (2 if num_heads == 16 else 0)
    check_decode(q, cache, block_table, seq_lens, rows, tol=TOL[torch.bfloat16], num_splits=num_splits,
                 variant="packed")


@pytest.mark.gpu
@pytest.mark.parametrize("q_fp8", [False, True])
def test_mla_decode_fp8_gpu(q_fp8):
    seq_lens = [4096, 1000, 1]
    kv_scale = scale_tensor(0.2)
    cache, block_table, rows = filled_mla_cache(seq_lens, 64, L + R, FP8, kv_scale, magnitude=0.2)
    q = torch.randn(3, 128, L + R, dtype=torch.bfloat16, device=DEVICE)
    q_scale = None
    if q_fp8:
        q_scale = scale_tensor(0.05)
        q = quantize(q, FP8, q_scale)
    check_decode(q, cache, block_table, seq_lens, rows, kv_scale=kv_scale, q_scale=q_scale, tol=FP8_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,heads", [(64, 16), (256, 128)])
@pytest.mark.parametrize("fp8", [True, False])
def test_fused_prep_equals_unfused_bf16_gpu(num_tokens, heads, fp8):
    out_dtype = FP8 if fp8 else torch.bfloat16
    k_scale, q_scale = (scale_tensor(0.3), scale_tensor(0.2)) if fp8 else (None, None)
    ql_nope, q_pe, kv_c, k_pe = prep_inputs(num_tokens, heads, torch.bfloat16)
    cache_f = allocate_mla_cache(num_tokens // 16 + 2, 64, L, R, dtype=out_dtype, device=DEVICE)
    cache_u = cache_f.clone()
    slots = torch.randperm(cache_f.shape[0] * 64 - 64, device=DEVICE)[:num_tokens] + 64
    slots[::7] = -1
    positions = torch.randint(0, 8192, (num_tokens,), device=DEVICE)
    cos, sin = rope_cos_sin(8192, R, device=DEVICE)
    q_f = torch.empty(num_tokens, heads, L + R, dtype=out_dtype, device=DEVICE)
    q_u = torch.empty_like(q_f)
    fused_qk_rope_concat_and_cache_mla(ql_nope, q_pe, kv_c, k_pe, cache_f, q_f, slots, k_scale, q_scale,
                                       positions, cos, sin, is_neox=False)
    unfused_prep(ql_nope, q_pe, kv_c, k_pe, cache_u, q_u, slots, k_scale, q_scale, positions, cos, sin, False)
    assert torch.equal(cache_f.view(torch.uint8), cache_u.view(torch.uint8))
    assert torch.equal(q_f.view(torch.uint8), q_u.view(torch.uint8))


def fp8_rounding_cases(shape, dtype):
    """Values whose e4m3 rounding is delicate: ties between normal neighbours (1 + 1/16 rounds to 1, 1 + 3/16
    to 1.25), ties in the subnormal range (odd multiples of 2^-10) and values past the saturation bound,
    spread over random inputs."""
    x = torch.randn(shape, dtype=torch.float32, device=DEVICE) * 4
    ties = torch.tensor([1.0625, 1.1875, -1.0625, 7.5, 15.0, 3 * 2.0 ** -10, -5 * 2.0 ** -10, 2.0 ** -10,
                         1000.0, -1000.0, 0.0, 2.0 ** -12], device=DEVICE)
    flat = x.view(-1)
    flat[torch.randperm(flat.numel(), device=DEVICE)[:4 * ties.numel()]] = ties.repeat(4)
    return x.to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_fp8_rounding_matches_torch_gpu(fused):
    """On a GPU the kernels leave rounding to the conversion instruction (no emulation): the cache rows and
    query rows they write must still equal torch's conversion bit for bit, ties and subnormals included."""
    tokens, heads, block = 40, 16, 16
    scale = scale_tensor(0.5)
    ql_nope = fp8_rounding_cases((tokens, heads, L), torch.bfloat16)
    q_pe = fp8_rounding_cases((tokens, heads, R), torch.bfloat16)
    kv_c, k_pe = fp8_rounding_cases((tokens, L), torch.bfloat16), fp8_rounding_cases((tokens, R), torch.bfloat16)
    cache = allocate_mla_cache(tokens // block + 2, block, L, R, dtype=FP8, device=DEVICE)
    slots = torch.randperm(cache.shape[0] * block, device=DEVICE)[:tokens]
    q_out = torch.empty(tokens, heads, L + R, dtype=FP8, device=DEVICE)
    if fused:  # identity rotation: the rows are written unrotated
        cos, sin = identity_rope_tables(R, device=DEVICE)
        fused_qk_rope_concat_and_cache_mla(ql_nope, q_pe, kv_c, k_pe, cache, q_out, slots, scale, scale,
                                           torch.zeros(tokens, dtype=torch.long, device=DEVICE), cos, sin)
    else:
        concat_and_cache_mla(kv_c, k_pe, cache, slots, kv_scale=scale)
        concat_mla_query(ql_nope, q_pe, q_out, q_scale=scale)
    expected_rows = quantize(torch.cat([kv_c, k_pe], -1), FP8, scale)
    assert torch.equal(cache.view(-1, L + R)[slots].view(torch.uint8), expected_rows.view(torch.uint8))
    expected_q = quantize(torch.cat([ql_nope, q_pe], -1), FP8, scale)
    assert torch.equal(q_out.view(torch.uint8), expected_q.view(torch.uint8))


def test_one_buffer_transposed_descriptor_tiles_are_refused(monkeypatch):
    """On an NVIDIA GPU, descriptor tiles with transposed products and a single buffer (``num_stages=1``)
    returned wrong results (triton 3.6, H200): the launcher refuses such a configuration rather than run it."""
    from tripath.ops import _mla_configs
    from tripath.ops.mla_absorbed import _packed_tiles
    from tripath.platform import H200

    cfg = {"BLOCK_H": 16, "BLOCK_N": 64, "num_warps": 4, "TMA": True, "SWAP_AB": True}
    cache = allocate_mla_cache(4, 64, dtype=torch.float16)
    monkeypatch.setattr(_mla_configs, "mla_decode_config", lambda *a, **kw: {**cfg, "num_stages": 1})
    with pytest.raises(ValueError, match="num_stages >= 2"):
        _packed_tiles(H200, cache, 16, L, L, R, False, False)
    monkeypatch.setattr(_mla_configs, "mla_decode_config", lambda *a, **kw: {**cfg, "num_stages": 2})
    assert _packed_tiles(H200, cache, 16, L, L, R, False, False).swap_ab


def test_mla_decode_gluon_variant_launch_and_errors(monkeypatch):
    """``variant="gluon"``: recorded on the H200 description with its grid and descriptors; a clear error
    elsewhere and for shapes it does not cover. ``"auto"`` (the default) takes it exactly where it applies."""
    from tripath.triton_internals import capture_launches
    from tripath.platform import H200, MI300X, override_platform
    seq_lens = torch.tensor([100, 64], dtype=torch.int32)
    table = torch.zeros(2, 8, dtype=torch.int32)  # 100 rows fit in blocks of 16 too
    cache = torch.zeros(8, 64, L + R, dtype=torch.bfloat16)
    q = torch.zeros(2, 128, L + R, dtype=torch.bfloat16)
    with override_platform(H200), capture_launches() as records:
        mla_decode(q, cache, table, seq_lens, sm_scale=0.1, num_splits=3, variant="gluon")
    assert [r.name for r in records] == ["mla_decode_sm90_kernel", "reduce_splits_kernel"]
    assert records[0].grid == (2, 2, 3) and records[0].args[2].block_shape == [32, L // 2]
    assert not records[0].kwargs["TMA_OUT"]  # several splits: fp32 partials by pointer stores

    def tma_out(out):  # the one-split epilogue: TMA for a contiguous, aligned out of q's dtype
        with override_platform(H200), capture_launches() as records:
            mla_decode(q, cache, table, seq_lens, sm_scale=0.1, num_splits=1, variant="gluon", out=out)
        return records[0].kwargs["TMA_OUT"]
    assert tma_out(torch.empty(2, 128, L, dtype=torch.bfloat16))
    assert not tma_out(torch.empty(2, 128, L + 8, dtype=torch.bfloat16)[..., :L])  # strided rows
    assert not tma_out(torch.empty(2, 128, L, dtype=torch.float32))  # another dtype
    assert not tma_out(torch.empty(2 * 128 * L + 1, dtype=torch.bfloat16)[1:].view(2, 128, L))  # misaligned
    with override_platform(H200), capture_launches(), pytest.raises(ValueError, match="multiple of 64 heads"):
        mla_decode(q[:, :24], cache, table, seq_lens, sm_scale=0.1, variant="gluon")
    q16 = torch.zeros(2, 16, L + R, dtype=torch.bfloat16)
    with override_platform(H200), capture_launches() as records:  # few heads: transposed products
        mla_decode(q16, cache, table, seq_lens, sm_scale=0.1, num_splits=2, variant="gluon")
    assert [r.name for r in records] == ["mla_decode_few_heads_sm90_kernel", "reduce_splits_kernel"]
    assert records[0].grid == (2, 2) and records[0].args[0].block_shape == [16, L // 2]
    assert records[0].args[2].block_shape == [64, L // 2]
    with override_platform(H200), capture_launches() as records:  # blocks of 16: four pages a 64-row tile
        mla_decode(q16, cache[:, :16].contiguous(), table, seq_lens, sm_scale=0.1, num_splits=1, variant="gluon")
    assert [r.name for r in records] == ["mla_decode_few_heads_sm90_kernel"]
    assert records[0].args[2].block_shape == [16, L // 2] and records[0].kwargs["BLOCK_N"] == 64
    with override_platform(H200), capture_launches(), pytest.raises(
            ValueError, match="needs a block size of 16, 32 or a multiple of 64 for 16 heads, got 48"):
        mla_decode(q16, cache[:, :48].contiguous(), table, seq_lens, sm_scale=0.1, variant="gluon")
    with override_platform(MI300X), capture_launches(), pytest.raises(ValueError, match="needs sm_90"):
        mla_decode(q, cache, table, seq_lens, sm_scale=0.1, variant="gluon")

    def first_kernel(platform, q, cache):
        with override_platform(platform), capture_launches() as records:
            mla_decode(q, cache, table, seq_lens, sm_scale=0.1, num_splits=1)
        return records[0].name
    few, q16 = "mla_decode_few_heads_sm90_kernel", q[:, :16].contiguous()
    assert first_kernel(H200, q, cache) == "mla_decode_sm90_kernel"
    assert first_kernel(H200, q16, cache) == few
    assert first_kernel(H200, q[:, :24].contiguous(), cache) == "mla_decode_kernel"  # 24 heads: packed tiles
    assert first_kernel(H200, q16, cache[:, :32].contiguous()) == few  # two pages a tile
    assert first_kernel(H200, q16, cache[:, :48].contiguous()) == "mla_decode_kernel"
    assert first_kernel(H200, q, cache[:, :16].contiguous()) == "mla_decode_kernel"  # 128 heads: blocks of 32+
    assert first_kernel(MI300X, q, cache) == "mla_decode_kernel"
    monkeypatch.setenv("TRIPATH_DISABLE_GLUON", "1")
    assert first_kernel(H200, q, cache) == "mla_decode_kernel"
    with override_platform(H200), capture_launches(), pytest.raises(ValueError, match="TRIPATH_DISABLE_GLUON"):
        mla_decode(q, cache, table, seq_lens, sm_scale=0.1, variant="gluon")


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,block_size,num_splits,dtype", [
    (128, 64, 1, torch.bfloat16), (128, 64, 3, torch.bfloat16), (64, 32, None, torch.bfloat16),
    (128, 64, None, torch.bfloat16), (64, 128, 2, torch.float16),
    (16, 64, 1, torch.bfloat16), (16, 64, None, torch.bfloat16), (32, 64, 3, torch.bfloat16),
    (8, 128, 2, torch.float16),  # 8-32 heads: the few-heads kernel
    (16, 16, None, torch.bfloat16), (32, 32, 2, torch.float16)])  # blocks of 16/32: several pages a tile
def test_mla_decode_gluon_gpu(num_heads, block_size, num_splits, dtype):
    """The Gluon kernels against float64: ragged requests (ends inside a tile, one row, no rows, a split with
    no rows, an end on a tile boundary) whose pages hold NaN past their ends, several splits, both 16-bit
    dtypes."""
    seq_lens = [3000, 1025, 33, 1, 0, 777, 64]
    cache, block_table, rows = filled_mla_cache(seq_lens, block_size, L + R, dtype)
    poison_unused_rows(cache, block_table, seq_lens)
    q = torch.randn(len(seq_lens), num_heads, L + R, dtype=dtype, device=DEVICE)
    check_decode(q, cache, block_table, seq_lens, rows, tol=TOL[dtype], num_splits=num_splits,
                 variant="gluon")


@pytest.mark.gpu
@pytest.mark.parametrize("out_kind", ["contiguous", "strided", "float32"])
def test_mla_decode_gluon_out_layouts_gpu(out_kind):
    """The 128-head kernel's two epilogues: a contiguous ``out`` of q's dtype is written by TMA from shared
    memory, a strided one (a view into wider rows) or one of another dtype by pointer stores; each against
    float64 with NaN in every element of the wide rows the view skips, which must stay NaN."""
    seq_lens = [3000, 1025, 33, 0]
    cache, block_table, rows = filled_mla_cache(seq_lens, 64, L + R, torch.bfloat16)
    poison_unused_rows(cache, block_table, seq_lens)
    q = torch.randn(len(seq_lens), 128, L + R, dtype=torch.bfloat16, device=DEVICE)
    wide = poison((len(seq_lens), 128, L + 64), torch.bfloat16, DEVICE)
    out = {"contiguous": poison((len(seq_lens), 128, L), torch.bfloat16, DEVICE), "strided": wide[..., :L],
           "float32": poison((len(seq_lens), 128, L), torch.float32, DEVICE)}[out_kind]
    got = mla_decode(q, cache, block_table, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                     kv_lora_rank=L, sm_scale=1.0 / math.sqrt(192), num_splits=1, out=out, variant="gluon")
    assert got is out
    for b in range(len(seq_lens)):
        want, _ = absorbed_f64(q[b].double().cpu(), rows[b].cpu(), L, 1.0 / math.sqrt(192))
        torch.testing.assert_close(got[b].double().cpu(), want, **TOL[torch.bfloat16])
    assert wide[..., L:].isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mla_decode_gluon_rising_scores_gpu(num_splits):
    """Scores that rise along the context (a ramp in one rotary dim, a slope per head from flat to about 5 log2
    units a 32-row tile): the 128-head kernel's lazy rescaling moves the steep heads' running maxima every few
    tiles (and skips the rescale in between) and the flat heads' never after the first tile; against float64.
    A build that skips a needed rescale fails here (checked on the H200, 2026-11-30)."""
    seq_lens, block_size = [3000, 700, 33], 64
    cache, block_table, _ = filled_mla_cache(seq_lens, block_size, L + R, torch.bfloat16)
    rows = []
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n, device=DEVICE)
        page, slot = block_table[b, pos // block_size].long(), pos % block_size
        cache[page, slot, L] = (pos * 0.25).to(cache.dtype)
        rows.append(cache[page, slot].double())
    q = torch.randn(len(seq_lens), 128, L + R, dtype=torch.bfloat16, device=DEVICE)
    q[:, :, L] = torch.linspace(0.0, 6.0, 128, device=DEVICE).to(q.dtype)
    check_decode(q, cache, block_table, seq_lens, rows, tol=TOL[torch.bfloat16], num_splits=num_splits,
                 variant="gluon")
