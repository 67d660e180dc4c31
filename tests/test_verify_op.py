"""paged_verify (Triton) against the PyTorch reference of paged attention for a few new tokens per request:
random block tables, caches poisoned outside what was written, outputs poisoned before the launch; every
option, fp8 and the shuffled layout, forced and per-request splits, tiles that hold part of a request's
tokens, padding rows left alone."""

import pytest
import torch

from conftest import DEVICE
from helpers import FP8_TOL, TOL, cu_seqlens, filled_cache, poison
from tripath.ops import paged_verify
from tripath.ops import reference as R
from tripath.ops.verify import MAX_VERIFY_TOKENS, verify_tile_rows

FP8 = torch.float8_e4m3fn

# (hq, hkv, head_size, block_size, seq_lens, query_lens, layout, cache dtype, options)
CASES = [
    (4, 2, 64, 16, [9, 70, 40], [5, 1, 3], "nhd", None, {}),
    (8, 1, 64, 16, [130, 21], [4, 8], "shuffled", None, {}),          # 8 heads x 8 tokens: two tiles
    (16, 1, 32, 8, [60, 17], [16, 9], "nhd", None, {}),               # 16 heads x 16 tokens: four tiles
    (4, 4, 64, 16, [45], [6], "nhd", None, {"window_left": 7}),
    (6, 2, 96, 16, [50, 3], [3, 2], "shuffled", None, {"softcap": 2.0}),
    (4, 1, 64, 16, [33, 12], [2, 5], "nhd", None, {"alibi": True}),
    (4, 2, 64, 32, [64, 31], [4, 4], "nhd", None, {"sinks": True}),
    (4, 2, 64, 16, [90, 7], [5, 2], "nhd", FP8, {}),
    (4, 2, 64, 16, [45, 100], [3, 4], "shuffled", FP8, {"sinks": True, "window_left": 20}),
]


def _cache(seq_lens, hkv, d, bs, layout, cache_dtype):
    """A filled fp16 (or fp8, with scales) cache: ``(k_cache, v_cache, block_table, (k_scale, v_scale))``."""
    scales = (torch.tensor([0.05], device=DEVICE), torch.tensor([0.04], device=DEVICE)) if cache_dtype else (None,
                                                                                                            None)
    k_cache, v_cache, bt, _, _ = filled_cache(seq_lens, hkv, d, block_size=bs, dtype=torch.float16,
                                              cache_dtype=cache_dtype, layout=layout, device=DEVICE,
                                              k_scale=scales[0], v_scale=scales[1])
    return k_cache, v_cache, bt, scales


def _opts(opts, hq):
    return dict(window_left=opts.get("window_left", -1), softcap=opts.get("softcap", 0.0),
                alibi_slopes=torch.rand(hq, device=DEVICE) if opts.get("alibi") else None,
                sinks=torch.randn(hq, device=DEVICE) if opts.get("sinks") else None)


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[0]}/{c[1]}-d{c[2]}-q{max(c[5])}-{c[6]}"
                         f"{'-fp8' if c[7] else ''}-{'-'.join(c[8]) or 'plain'}")
def test_paged_verify_matches_the_reference(case, num_splits):
    hq, hkv, d, bs, seq_lens, query_lens, layout, cache_dtype, opts = case
    dtype = torch.float16
    k_cache, v_cache, bt, scales = _cache(seq_lens, hkv, d, bs, layout, cache_dtype)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens + 2, hq, d, dtype=dtype, device=DEVICE)   # two padding rows at the end
    cu = cu_seqlens(query_lens, DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    kw = _opts(opts, hq)
    out = poison(q.shape, dtype, DEVICE)
    got, lse = paged_verify(q, k_cache, v_cache, bt, sl, cu, max(query_lens), layout=layout, k_scale=scales[0],
                            v_scale=scales[1], num_splits=num_splits, out=out, return_lse=True, **kw)
    want, want_lse = R.unified_attention_ref(q[:num_tokens], k_cache, v_cache, bt, sl, cu, layout=layout,
                                             k_scale=scales[0], v_scale=scales[1], return_lse=True, **kw)
    tol = TOL[dtype] if cache_dtype is None else FP8_TOL
    torch.testing.assert_close(got[:num_tokens].float(), want.float(), **tol)
    torch.testing.assert_close(lse[:num_tokens], want_lse, atol=2e-3, rtol=2e-3)
    assert got[num_tokens:].isnan().all(), "padding rows were written"


def random_tree_masks(query_lens, seed):
    """A random draft tree per request (token 0 the root, each later token's parent an earlier one): each
    token's bits are itself and its ancestors."""
    g = torch.Generator().manual_seed(seed)
    masks = []
    for n in query_lens:
        bits = []
        for t in range(n):
            parent = int(torch.randint(0, t, (1,), generator=g)) if t else None
            bits.append((1 << t) | (bits[parent] if parent is not None else 0))
        masks += bits
    return torch.tensor(masks, dtype=torch.int32)


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("case", [
    (4, 2, 64, 16, [9, 70, 40], [5, 1, 3], "nhd", None, {}),
    (8, 1, 64, 16, [130, 21], [8, 6], "shuffled", None, {"sinks": True}),
    (16, 1, 32, 8, [60], [16], "nhd", None, {"softcap": 2.0}),
    (4, 2, 64, 16, [45, 100], [3, 4], "shuffled", FP8, {}),
], ids=lambda c: f"h{c[0]}/{c[1]}-q{max(c[5])}-{c[6]}{'-fp8' if c[7] else ''}-{'-'.join(c[8]) or 'plain'}")
def test_paged_verify_along_random_draft_trees(case, num_splits):
    """EAGLE-style trees: each new token sees the context, itself and its ancestors only; against the
    PyTorch reference, and a chain's mask (every earlier token) gives the causal result."""
    hq, hkv, d, bs, seq_lens, query_lens, layout, cache_dtype, opts = case
    dtype = torch.float16
    k_cache, v_cache, bt, scales = _cache(seq_lens, hkv, d, bs, layout, cache_dtype)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, hq, d, dtype=dtype, device=DEVICE)
    cu, sl = cu_seqlens(query_lens, DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    kw = dict(softcap=opts.get("softcap", 0.0), sinks=torch.randn(hq, device=DEVICE) if opts.get("sinks") else None)
    tree = random_tree_masks(query_lens, seed=num_splits or 0).to(DEVICE)
    got, lse = paged_verify(q, k_cache, v_cache, bt, sl, cu, max(query_lens), layout=layout, k_scale=scales[0],
                            v_scale=scales[1], num_splits=num_splits, out=poison(q.shape, dtype, DEVICE),
                            return_lse=True, tree_mask=tree, **kw)
    want, want_lse = R.unified_attention_ref(q, k_cache, v_cache, bt, sl, cu, layout=layout, k_scale=scales[0],
                                             v_scale=scales[1], return_lse=True, tree_mask=tree, **kw)
    tol = TOL[dtype] if cache_dtype is None else FP8_TOL
    torch.testing.assert_close(got.float(), want.float(), **tol)
    torch.testing.assert_close(lse, want_lse, atol=2e-3, rtol=2e-3)
    chain = torch.tensor([(1 << (t + 1)) - 1 for n in query_lens for t in range(n)], dtype=torch.int32,
                         device=DEVICE)
    causal = R.unified_attention_ref(q, k_cache, v_cache, bt, sl, cu, layout=layout, k_scale=scales[0],
                                     v_scale=scales[1], **kw)
    torch.testing.assert_close(paged_verify(q, k_cache, v_cache, bt, sl, cu, max(query_lens), layout=layout,
                                            k_scale=scales[0], v_scale=scales[1], num_splits=num_splits,
                                            tree_mask=chain, **kw).float(), causal.float(), **tol)


def test_tiles_pack_tokens_and_heads():
    assert verify_tile_rows(4, 5) == 32 and verify_tile_rows(1, 1) == 16
    assert verify_tile_rows(8, 16) == 64 and verify_tile_rows(128, 2) == 128


def test_paged_verify_splits_follow_each_request_on_a_wide_table(monkeypatch):
    """A block table far wider than the contexts: each request takes the splits its own length calls for."""
    import tripath.ops.verify as verify_ops

    seq_lens, query_lens = [9, 300, 700], [4, 2, 5]
    k_cache, v_cache, bt, _, _ = filled_cache(seq_lens, 2, 64, device=DEVICE)
    wide = torch.zeros(len(seq_lens), 128, dtype=torch.int32, device=DEVICE)
    wide[:, :bt.shape[1]] = bt
    q = torch.randn(sum(query_lens), 4, 64, dtype=torch.float16, device=DEVICE)
    cu, sl = cu_seqlens(query_lens, DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    launched = []
    real = verify_ops.launch
    monkeypatch.setattr(verify_ops, "launch", lambda kernel, grid, *a, **k: launched.append(k) or
                        real(kernel, grid, *a, **k))
    got = paged_verify(q, k_cache, v_cache, wide, sl, cu, 5, out=poison(q.shape, q.dtype, DEVICE))
    want = R.unified_attention_ref(q, k_cache, v_cache, bt, sl, cu)
    torch.testing.assert_close(got.float(), want.float(), **TOL[torch.float16])
    used = launched[0]["splits_used_ptr"].tolist()
    assert launched[0]["num_splits"] > 1 and len(set(used)) > 1   # per request, every token of it alike
    assert used[:4] == [used[0]] * 4 and used[6:] == [used[6]] * 5


def test_paged_verify_refuses_what_it_cannot_run():
    k_cache, v_cache, bt, _, _ = filled_cache([20], 2, 64, device=DEVICE)
    q = torch.randn(3, 4, 64, dtype=torch.float16, device=DEVICE)
    sl = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="max_query_len must be an int in"):
        paged_verify(q, k_cache, v_cache, bt, sl, cu_seqlens([3], DEVICE), MAX_VERIFY_TOKENS + 1)
    with pytest.raises(ValueError, match="more than max_query_len"):
        paged_verify(q, k_cache, v_cache, bt, sl, cu_seqlens([3], DEVICE), 2, validate=True)
    with pytest.raises(ValueError, match="one entry per request"):
        paged_verify(q, k_cache, v_cache, bt, sl, cu_seqlens([1, 2], DEVICE), 2)
    cu = cu_seqlens([3], DEVICE)

    def mask(*bits, dtype=torch.int32):
        return torch.tensor(bits, dtype=dtype, device=DEVICE)

    with pytest.raises(ValueError, match=r"tree_mask\[2\] \(token 2 of request 0\) must set its own bit 2"):
        paged_verify(q, k_cache, v_cache, bt, sl, cu, 3, tree_mask=mask(1, 3, 3), validate=True)
    with pytest.raises(ValueError, match="none above it"):
        paged_verify(q, k_cache, v_cache, bt, sl, cu, 3, tree_mask=mask(3, 3, 7), validate=True)
    with pytest.raises(ValueError, match="tree_mask must be a \\[T\\] int32"):
        paged_verify(q, k_cache, v_cache, bt, sl, cu, 3, tree_mask=mask(1, 3, 7, dtype=torch.int64))
    with pytest.raises(ValueError, match="does not combine with window_left"):
        paged_verify(q, k_cache, v_cache, bt, sl, cu, 3, window_left=4, tree_mask=mask(1, 3, 7))

