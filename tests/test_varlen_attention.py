"""varlen_attention (Triton, interpreter on CPU) against its reference."""

import pytest
import torch

from conftest import DEVICE
from helpers import TOL, cu_seqlens, poison
from tripath.ops import reference as R
from tripath.ops import varlen_attention

# (num_heads, num_kv_heads, head_size, head_size_v, query lens, key lens, options)
CASES = [
    (4, 4, 64, 64, [5, 1, 33], [18, 1, 33], {}),
    (4, 1, 80, 80, [7, 20], [7, 31], {}),
    (8, 1, 128, 128, [3], [3], {"causal": False}),
    (5, 1, 96, 96, [9, 4], [12, 4], {"window_left": 4}),
    (2, 2, 192, 128, [17], [40], {}),  # MLA prefill shapes: qk 192, v 128
    (4, 2, 256, 256, [6], [10], {"softcap": 3.0}),
    (4, 2, 112, 112, [8, 2], [8, 9], {"alibi": True}),
    (4, 4, 64, 64, [5, 3], [9, 3], {"sinks": True}),
    (4, 2, 32, 32, [6, 6], [6, 20], {"causal": False, "window_left": 2, "alibi": True, "sinks": True}),
    (4, 2, 64, 64, [129], [463], {}),
]


def _options(opts: dict, hq: int) -> dict:
    """A case's option names → ``varlen_attention`` keyword arguments (fresh random ALiBi slopes/sinks)."""
    return dict(causal=opts.get("causal", True), window_left=opts.get("window_left", -1),
                softcap=opts.get("softcap", 0.0),
                alibi_slopes=torch.rand(hq, device=DEVICE) if opts.get("alibi") else None,
                sinks=torch.randn(hq, device=DEVICE) if opts.get("sinks") else None)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[0]}/{c[1]}-d{c[2]}-{'-'.join(c[6]) or 'plain'}")
def test_varlen_attention(case):
    hq, hkv, d, dv, lq, lk, opts = case
    dtype = torch.float16
    q = torch.randn(sum(lq), hq, d, dtype=dtype, device=DEVICE)
    k = torch.randn(sum(lk), hkv, d, dtype=dtype, device=DEVICE)
    v = torch.randn(sum(lk), hkv, dv, dtype=dtype, device=DEVICE)
    kw = _options(opts, hq)
    cq, ck = cu_seqlens(lq, DEVICE), cu_seqlens(lk, DEVICE)
    out = poison((sum(lq), hq, dv), dtype, DEVICE)
    got, lse = varlen_attention(q, k, v, cq, ck, max(lq), max(lk), out=out, return_lse=True, **kw)
    want, want_lse = R.varlen_attention_ref(q, k, v, cq, ck, return_lse=True, **kw)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)


def test_rows_that_see_nothing_give_zero_and_neg_inf():
    # 4 queries over 2 keys, bottom-right causal: queries 0 and 1 see no key.
    q = torch.randn(4, 2, 32, dtype=torch.float16, device=DEVICE)
    k = torch.randn(2, 2, 32, dtype=torch.float16, device=DEVICE)
    out, lse = varlen_attention(q, k, k.clone(), cu_seqlens([4], DEVICE), cu_seqlens([2], DEVICE), 4, 2,
                                return_lse=True)
    assert torch.all(out[:2] == 0) and torch.all(torch.isneginf(lse[:2]))
    assert torch.isfinite(lse[2:]).all()


def test_q_positions_start_shifts_the_mask():
    q = torch.randn(3, 2, 32, dtype=torch.float16, device=DEVICE)
    k = torch.randn(8, 2, 32, dtype=torch.float16, device=DEVICE)
    v = torch.randn(8, 2, 32, dtype=torch.float16, device=DEVICE)
    start = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    kw = dict(causal=True, window_left=1, alibi_slopes=torch.rand(2, device=DEVICE))
    got = varlen_attention(q, k, v, cu_seqlens([3], DEVICE), cu_seqlens([8], DEVICE), 3, 8,
                           q_positions_start=start, **kw)
    want = R.varlen_attention_ref(q, k, v, cu_seqlens([3], DEVICE), cu_seqlens([8], DEVICE),
                                  q_positions_start=start, **kw)
    default = varlen_attention(q, k, v, cu_seqlens([3], DEVICE), cu_seqlens([8], DEVICE), 3, 8, **kw)
    torch.testing.assert_close(got.float(), want.float(), **TOL[torch.float16])
    assert not torch.allclose(got.float(), default.float(), atol=1e-2)


def test_float32_inputs():
    q = torch.randn(6, 2, 48, device=DEVICE)
    k = torch.randn(9, 1, 48, device=DEVICE)
    v = torch.randn(9, 1, 48, device=DEVICE)
    cq, ck = cu_seqlens([6], DEVICE), cu_seqlens([9], DEVICE)
    got = varlen_attention(q, k, v, cq, ck, 6, 9)
    want = R.varlen_attention_ref(q, k, v, cq, ck)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("opts", [{}, {"causal": False}, {"window_left": 5, "sinks": True}],
                         ids=["causal", "non-causal", "window+sinks"])
def test_tensor_descriptor_path(monkeypatch, opts):
    """The Hopper path (keys and values through tensor descriptors) on K/V that are column slices of one
    packed QKV buffer, with NaN rows beyond the last request that edge tiles must not let through."""
    from tripath.ops import _configs
    from tripath.triton_internals import capture_launches

    monkeypatch.setenv("TRIPATH_DISABLE_GLUON", "1")   # the portable kernel's path (sm_90 takes Gluon's)
    base = _configs.varlen_config
    monkeypatch.setattr(_configs, "varlen_config", lambda *a, **kw: {**base(*a, **kw), "TMA": True})
    hq, hkv, d, lq, lk = 4, 2, 64, [7, 16, 3], [23, 16, 37]
    tk = sum(lk)
    qkv = torch.randn(tk + 5, (hq + 2 * hkv) * d, dtype=torch.float16, device=DEVICE)
    qkv[tk:] = float("nan")
    q = torch.randn(sum(lq), hq, d, dtype=torch.float16, device=DEVICE)
    k = qkv[:, hq * d:(hq + hkv) * d].view(-1, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(-1, hkv, d)
    kw = dict(causal=opts.get("causal", True), window_left=opts.get("window_left", -1),
              sinks=torch.randn(hq, device=DEVICE) if opts.get("sinks") else None)
    cq, ck = cu_seqlens(lq, DEVICE), cu_seqlens(lk, DEVICE)
    with capture_launches() as records:
        varlen_attention(q, k, v, cq, ck, max(lq), max(lk), **kw)
    assert records[0].kwargs["USE_TMA"] is True
    got, lse = varlen_attention(q, k, v, cq, ck, max(lq), max(lk), return_lse=True, **kw)
    want, want_lse = R.varlen_attention_ref(q, k[:tk], v[:tk], cq, ck, return_lse=True, **kw)
    torch.testing.assert_close(got.float(), want.float(), **TOL[torch.float16])
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("misaligned", [False, True], ids=["strided-heads", "misaligned-fallback"])
def test_tensor_descriptor_strided_heads_and_fallback(monkeypatch, misaligned):
    """Heads strided in their rows (keys and values interleaved per head, as MLA's up-projection
    ``[k_nope | v]`` leaves them) go through descriptors; a base off the 16-byte grid falls back to pointer
    loads. Both agree with the reference."""
    from tripath.ops import _configs
    from tripath.triton_internals import capture_launches

    base = _configs.varlen_config
    monkeypatch.setattr(_configs, "varlen_config", lambda *a, **kw: {**base(*a, **kw), "TMA": True})
    q = torch.randn(9, 2, 32, dtype=torch.float16, device=DEVICE)
    rows = torch.randn(9, 2 * 2 * 32 + 8, dtype=torch.float16, device=DEVICE)
    kv = rows[:, int(misaligned):int(misaligned) + 128].view(9, 2, 2, 32)  # [T, H, (k|v), D]
    k, v = kv[:, :, 0], kv[:, :, 1]  # head stride 64 != 32
    cq = cu_seqlens([4, 5], DEVICE)
    with capture_launches() as records:
        varlen_attention(q, k, v, cq, cq, 5, 5)
    assert records[0].kwargs["USE_TMA"] is not misaligned
    got = varlen_attention(q, k, v, cq, cq, 5, 5)
    want = R.varlen_attention_ref(q, k, v, cq, cq)
    torch.testing.assert_close(got.float(), want.float(), **TOL[torch.float16])


def test_tile_choice_counts_causal_tiles_only_where_they_decide_it(monkeypatch):
    """The launcher passes the causal tile count (the rule for ragged last waves) only for causal launches
    whose keys are mostly the queries' own and that run alone: not for an extend's last chunk joined with
    its new tokens (many more keys than queries), nor for a ``concurrent`` launch."""
    from tripath.ops import _configs
    from tripath.triton_internals import capture_launches

    monkeypatch.setenv("TRIPATH_DISABLE_GLUON", "1")   # the portable kernel's launcher (sm_90 takes Gluon's)
    seen, base = [], _configs.varlen_config
    monkeypatch.setattr(_configs, "varlen_config",
                        lambda *a, **kw: (seen.append(kw.get("causal_tiles")), base(*a, **kw))[1])
    q = torch.randn(2 * 300, 4, 64, dtype=torch.float16, device=DEVICE)
    kv = torch.randn(2 * 700, 2, 64, dtype=torch.float16, device=DEVICE)
    cq, c_self, c_long = cu_seqlens([300, 300], DEVICE), cu_seqlens([300, 300], DEVICE), cu_seqlens([700, 700], DEVICE)
    with capture_launches():
        varlen_attention(q, kv[:600], kv[:600], cq, c_self, 300, 300)  # a prefill
        varlen_attention(q, kv, kv, cq, c_long, 300, 700)  # keys > 2x the queries
        varlen_attention(q, kv[:600], kv[:600], cq, c_self, 300, 300, concurrent=True)
        varlen_attention(q, kv[:600], kv[:600], cq, c_self, 300, 300, causal=False)
    assert seen == [2 * 3 * 4, None, None, None]  # 2 requests x 3 tiles of 128 rows x 4 heads


# (num_heads, num_kv_heads, head_size, rope width, rotary key heads, query lens, key lens, options, TMA)
ROPE_CASES = [
    (4, 4, 64, 32, 1, [5, 17], [5, 40], {}, False),  # MLA: one rotary key shared by every head
    (4, 2, 32, 16, 2, [9], [9], {"window_left": 3, "alibi": True}, False),  # a rotary key per KV head
    (2, 2, 64, 32, 1, [6, 1], [30, 13], {"causal": False, "softcap": 2.0, "sinks": True}, False),
    (4, 4, 64, 32, 1, [7, 16, 3], [23, 16, 37], {}, True),  # descriptors; k_rope a column slice
    (4, 2, 32, 16, 2, [6, 9], [10, 9], {"sinks": True}, True),  # descriptors, a rotary key per KV head
]


@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: f"h{c[0]}/{c[1]}-r{c[3]}x{c[4]}{'-tma' if c[8] else ''}")
def test_rotary_part_scores_as_the_concatenation(monkeypatch, case):
    """``q_rope``/``k_rope`` add ``q_rope · k_rope`` to the scores: the same attention as the concatenated
    ``[q | q_rope]`` and ``[k | k_rope]`` (broadcast over heads when shared), default scale included; the
    rotary keys are a column slice of a latent-style workspace row, as the MLA backends pass them."""
    from tripath.ops import _configs
    from tripath.triton_internals import capture_launches

    hq, hkv, d, r, hr, lq, lk, opts, tma = case
    monkeypatch.setenv("TRIPATH_DISABLE_GLUON", "1")   # the portable kernel (sm_90 takes Gluon's where it can)
    base = _configs.varlen_config
    monkeypatch.setattr(_configs, "varlen_config", lambda *a, **kw: {**base(*a, **kw), "TMA": tma})
    dtype = torch.float16
    tk = sum(lk)
    q = torch.randn(sum(lq), hq, d, dtype=dtype, device=DEVICE)
    q_rope = torch.randn(sum(lq), hq, r, dtype=dtype, device=DEVICE)
    k = torch.randn(tk, hkv, d, dtype=dtype, device=DEVICE)
    v = torch.randn(tk, hkv, d, dtype=dtype, device=DEVICE)
    workspace = torch.randn(tk + 4, 64 + hr * r, dtype=dtype, device=DEVICE)
    workspace[tk:] = float("nan")
    k_rope = workspace[:, 64:].view(-1, hr, r)
    kw = _options(opts, hq)
    cq, ck = cu_seqlens(lq, DEVICE), cu_seqlens(lk, DEVICE)
    out = poison((sum(lq), hq, d), dtype, DEVICE)
    with capture_launches() as records:
        varlen_attention(q, k, v, cq, ck, max(lq), max(lk), q_rope=q_rope, k_rope=k_rope[:tk], **kw)
    assert records[0].kwargs["HAS_ROPE"] is True and records[0].kwargs["USE_TMA"] is tma
    got, lse = varlen_attention(q, k, v, cq, ck, max(lq), max(lk), q_rope=q_rope, k_rope=k_rope[:tk], out=out,
                                return_lse=True, **kw)
    q_cat = torch.cat([q, q_rope], dim=-1)
    k_cat = torch.cat([k, k_rope[:tk].expand(-1, hkv, -1)], dim=-1)
    want, want_lse = R.varlen_attention_ref(q_cat, k_cat, v, cq, ck, return_lse=True, **kw)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)


def test_rotary_part_errors():
    q = torch.randn(4, 2, 32, dtype=torch.float16, device=DEVICE)
    k = torch.randn(4, 2, 32, dtype=torch.float16, device=DEVICE)
    cq = cu_seqlens([4], DEVICE)
    args = (q, k, k, cq, cq, 4, 4)
    with pytest.raises(ValueError, match="q_rope and k_rope must be given together"):
        varlen_attention(*args, q_rope=torch.randn(4, 2, 16, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="k_rope must have 1 head"):
        varlen_attention(*args, q_rope=torch.randn(4, 2, 16, dtype=torch.float16, device=DEVICE),
                         k_rope=torch.randn(4, 3, 16, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="rotary part's width"):
        varlen_attention(*args, q_rope=torch.randn(4, 2, 8, dtype=torch.float16, device=DEVICE),
                         k_rope=torch.randn(4, 1, 8, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="k_rope"):
        varlen_attention(*args, q_rope=torch.randn(4, 2, 16, dtype=torch.float16, device=DEVICE),
                         k_rope=torch.randn(4, 1, 32, dtype=torch.float16, device=DEVICE))


@pytest.mark.cpu  # CPU tensors under an overridden platform: what a launch would be, not a launch
def test_hopper_fast_path_dispatch(monkeypatch):
    """On an H200 the plain 16-bit prefill (heads 64/128, causal or not, LSE, per-request query starts,
    strided heads, MLA's 64-wide rotary part) takes the warp-specialised Gluon kernel, short requests of an
    even GQA group as head-pair items and those of other groups as 128-row items on 64-key tiles; every
    score modifier, other head and rotary sizes, fp32 and ``TRIPATH_DISABLE_GLUON`` keep the portable kernel
    (launches recorded, and the descriptors and arguments checked)."""
    from tripath.triton_internals import capture_launches
    from tripath.ops._varlen_sm90 import (BLOCK_N, PAIR_LAG_TILES, PAIR_SMALL_KEYS, SHORT_BLOCK_N, SHORT_KEYS,
                                          SHORT_LONG_BLOCK_N, SHORT_LONG_STAGES, SHORT_STAGES,
                                          SINGLE_SHORT_BLOCK_N, SINGLE_SHORT_STAGES, WG_ROWS)
    from tripath.platform import H200, MI300X, override_platform
    lengths = [48, SHORT_KEYS + 76]
    bf16 = torch.bfloat16

    def qkv(hq=8, hkv=2, d=128, dtype=bf16):
        return (torch.zeros(sum(lengths), hq, d, dtype=dtype), torch.zeros(sum(lengths), hkv, d, dtype=dtype),
                torch.zeros(sum(lengths), hkv, d, dtype=dtype))

    def kernels(max_len=max(lengths), **kw):
        q, k, v = kw.pop("qkv", None) or qkv()
        offsets = cu_seqlens([min(n, max_len) for n in lengths], DEVICE)  # requests no longer than max_len
        with capture_launches() as records:
            varlen_attention(q, k, v, offsets, offsets, max_len, max_len, **kw)
        return [(r.name, r) for r in records]

    with override_platform(H200):
        [(name, rec)] = kernels(return_lse=True)
        assert name == "varlen_attention_sm90_kernel"
        q_desc, k_desc, v_desc = rec.args[:3]
        assert q_desc.block_shape == [WG_ROWS, 128] and k_desc.block_shape == [BLOCK_N, 128]
        assert q_desc.shape == [sum(lengths), 8 * 128] and k_desc.shape == [sum(lengths), 2 * 128]
        items = 9 * 8 * 2  # 128-row query blocks of the longest request x heads x requests
        assert rec.grid == (min(items, H200.num_sms),) and rec.kwargs["RETURN_LSE"] and rec.kwargs["CAUSAL"]
        assert not rec.kwargs["PAIR_HEADS"] and rec.kwargs["BLOCK_N"] == BLOCK_N and rec.kwargs["LAG_TILES"] == 0
        assert not rec.kwargs["TMA_STORE"] and rec.args[5] is None
        [(name, rec)] = kernels(max_len=SHORT_KEYS, concurrent=True)  # short, 4 query heads a KV head: pairs
        assert name == "varlen_attention_sm90_kernel" and rec.kwargs["PAIR_HEADS"]
        assert rec.args[1].block_shape == [SHORT_LONG_BLOCK_N, 128] and rec.args[0].block_shape == [WG_ROWS, 128]
        assert rec.kwargs["BLOCK_N"] == SHORT_LONG_BLOCK_N and rec.kwargs["NUM_STAGES"] == SHORT_LONG_STAGES
        assert 0 < rec.kwargs["LAG_TILES"] == PAIR_LAG_TILES <= rec.kwargs["NUM_STAGES"]  # warpgroups offset
        assert rec.grid == ((SHORT_KEYS // WG_ROWS) * (8 // 2) * 2,)  # 64-row blocks x head pairs x requests
        [(name, rec)] = kernels(max_len=PAIR_SMALL_KEYS)  # at most 512 keys: 64-key tiles, four stages
        assert rec.kwargs["PAIR_HEADS"] and rec.args[1].block_shape == [SHORT_BLOCK_N, 128]
        assert rec.kwargs["BLOCK_N"] == SHORT_BLOCK_N and rec.kwargs["NUM_STAGES"] == SHORT_STAGES
        assert rec.kwargs["TMA_STORE"] and rec.args[5].block_shape == [WG_ROWS, 128]  # output tiles by TMA
        assert kernels(concurrent=True)[0][1].grid == (items,)  # beside another launch: one program per item
        assert kernels(causal=False, qkv=qkv(4, 4, 64, torch.float16))[0][0] == "varlen_attention_sm90_kernel"
        assert kernels(q_positions_start=torch.zeros(2, dtype=torch.int32))[0][1].kwargs["HAS_Q_START"]
        packed = torch.zeros(sum(lengths), 12, 128, dtype=bf16)  # [q heads | k heads | v heads] of one buffer
        [(name, rec)] = kernels(qkv=(packed[:, :8], packed[:, 8:10], packed[:, 10:]))
        assert name == "varlen_attention_sm90_kernel" and rec.args[-5:] == (128, 128, 128, 0, 0)
        assert rec.args[3] is None and rec.args[4] is None  # no rotary part: no descriptors for it
        assert rec.args[1].shape == [sum(lengths), 2 * 128]  # KV heads 8, 9 of the 12 packed
        [(name, rec)] = kernels(q_rope=torch.zeros(sum(lengths), 8, 64, dtype=bf16),  # MLA's rotary part
                                k_rope=torch.zeros(sum(lengths), 1, 64, dtype=bf16))
        assert name == "varlen_attention_sm90_kernel" and rec.kwargs["HAS_ROPE"]
        assert rec.args[3].block_shape == [WG_ROWS, 64] and rec.args[4].shape == [sum(lengths), 64]
        assert rec.args[-2:] == (64, 0)  # rotary head strides: per query head, one key shared (column 0)
        for hq, hkv in ((4, 4), (6, 2)):  # short requests of MHA / an odd group: 128-row items, 64-key tiles
            [(name, rec)] = kernels(max_len=SHORT_KEYS, qkv=qkv(hq, hkv))
            assert name == "varlen_attention_sm90_kernel" and not rec.kwargs["PAIR_HEADS"]
            assert rec.kwargs["BLOCK_N"] == SINGLE_SHORT_BLOCK_N and rec.kwargs["NUM_STAGES"] == SINGLE_SHORT_STAGES
            assert rec.args[1].block_shape == [SINGLE_SHORT_BLOCK_N, 128] and rec.kwargs["LAG_TILES"] == 0
            assert not rec.kwargs["TMA_STORE"] and rec.grid == (min((SHORT_KEYS // 128) * hq * 2, H200.num_sms),)
        portable = [dict(window_left=64), dict(softcap=30.0),
                    dict(alibi_slopes=torch.ones(8)), dict(sinks=torch.ones(8)), dict(qkv=qkv(d=256)),
                    dict(qkv=qkv(d=80)), dict(qkv=qkv(dtype=torch.float32)),
                    dict(q_rope=torch.zeros(sum(lengths), 8, 16, dtype=bf16),
                         k_rope=torch.zeros(sum(lengths), 1, 16, dtype=bf16))]
        for kw in portable:
            assert [n for n, _ in kernels(**kw)] == ["varlen_attention_kernel"], kw
        monkeypatch.setenv("TRIPATH_DISABLE_GLUON", "1")
        assert [n for n, _ in kernels()] == ["varlen_attention_kernel"]
        monkeypatch.delenv("TRIPATH_DISABLE_GLUON")
    with override_platform(MI300X):
        assert [n for n, _ in kernels()] == ["varlen_attention_kernel"]


def test_gluon_descriptors_are_cached_and_hold_no_tensor():
    """Gluon TMA descriptors are cached by what they encode (the same object for the same address, dtype,
    geometry and block) and keep only the address: dropping the tensor frees it."""
    import gc
    import weakref

    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from tripath.ops._descriptors import gluon_descriptor

    t = torch.zeros(64, 4, 128, dtype=torch.float16)
    flat = t.view(64, 512)
    first = gluon_descriptor(flat, [64, 512], [512, 1], [64, 128])
    assert gluon_descriptor(flat, [64, 512], [512, 1], [64, 128]) is first
    assert gluon_descriptor(flat, [64, 512], [512, 1], [32, 128]) is not first  # another block: another one
    assert first.base.data_ptr() == t.data_ptr() and first.base.dtype == torch.float16
    assert first.block_shape == [64, 128] and first.shape == [64, 512] and first.strides == [512, 1]
    alive = weakref.ref(t)
    del t, flat
    gc.collect()
    assert alive() is None
