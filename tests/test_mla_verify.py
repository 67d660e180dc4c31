"""The absorbed MLA verify (``tripath.ops.mla_verify``): several new tokens a request, chains and draft trees,
against float64 math written from the trees' parents (not their masks), with fresh random caches, random block
tables, poisoned outputs and rows past the last request left alone; one split and several; fp8; bad input."""

import math
import random

import pytest
import torch

from conftest import DEVICE
from helpers import FP8_TOL, TF32_TOL, cu_seqlens, kernel_tolerance, poison
from test_mla_ops import FP8, filled_mla_cache, scale_tensor
from tripath.ops import mla_verify

LAT, ROPE = 64, 16


def _tree(rng: random.Random, n: int, tree: bool) -> tuple[list[int], list[int]]:
    """``(parents, bits)`` of ``n`` new tokens: token 0 the root (the pending token), token ``t``'s parent a
    random earlier one (``tree``) or ``t - 1``; bit ``j`` of token ``t``: ``j`` is ``t`` or its ancestor."""
    parents = [-1] + [rng.randrange(t) if tree else t - 1 for t in range(1, n)]
    bits = []
    for t in range(n):
        mask, node = 0, t
        while node >= 0:
            mask |= 1 << node
            node = parents[node]
        bits.append(mask)
    return parents, bits


def _verify_f64(q, rows, ctx, parents, sm_scale, lat):
    """Token ``t`` (``q [H, W]``) against the context rows and its own ancestors' rows, in float64."""
    out, lse = [], []
    for t in range(len(parents)):
        seen, node = [], t
        while node >= 0:
            seen.append(ctx + node)
            node = parents[node]
        keys = rows[list(range(ctx)) + sorted(seen)]
        s = (q[t].double() @ keys.T) * sm_scale
        out.append(torch.softmax(s, dim=-1) @ keys[:, :lat])
        lse.append(torch.logsumexp(s, dim=-1))
    return torch.stack(out), torch.stack(lse)


CASES = [  # (heads, block size, splits, cache dtype, fp8 query)
    (16, 16, 1, torch.float16, False),
    (4, 8, 3, torch.float32, False),
    (3, 4, None, torch.float16, False),
    (8, 16, 2, FP8, False),
    (8, 16, 1, FP8, True),
]


@pytest.mark.parametrize("tree", [False, True], ids=["chains", "trees"])
@pytest.mark.parametrize("heads, block_size, num_splits, cache_dtype, q_fp8", CASES)
def test_mla_verify_matches_f64(tree, heads, block_size, num_splits, cache_dtype, q_fp8):
    check_verify(tree, heads, block_size, num_splits, cache_dtype, q_fp8, [4, 1, 6, 3, 8], [37, 5, 0, 90, 12],
                 LAT, ROPE)


@pytest.mark.gpu
@pytest.mark.parametrize("tree", [False, True], ids=["chains", "trees"])
@pytest.mark.parametrize("heads, num_splits, cache_dtype, q_fp8, variant", [
    (16, None, torch.bfloat16, False, "auto"), (16, 4, torch.bfloat16, False, "auto"),
    (16, 1, torch.bfloat16, False, "auto"), (128, None, torch.bfloat16, False, "auto"),
    (16, None, torch.bfloat16, False, "triton"), (128, None, torch.bfloat16, False, "triton"),
    (16, 4, FP8, False, "auto"), (16, None, FP8, True, "auto")])
def test_mla_verify_deepseek_dims_gpu(tree, heads, num_splits, cache_dtype, q_fp8, variant):
    """DeepSeek's latent rows (512 + 64), 64-row pages, contexts to 8K, on the GPU's launch configurations:
    ``"auto"`` takes the Gluon kernel on sm_90 for the 16-bit rows. A request of 16 tokens spans four 64-row
    tiles at 16 heads; at 4 splits the last request's last split holds only its new tokens after the first, so
    that token's rows see no key there."""
    check_verify(tree, heads, 64, num_splits, cache_dtype, q_fp8, [4, 8, 1, 16, 4], [8000, 3000, 17, 700, 127],
                 512, 64, variant)


def check_verify(tree, heads, block_size, num_splits, cache_dtype, q_fp8, query_lens, contexts, lat, rope,
                 variant="auto"):
    rng = random.Random(hash((tree, heads, block_size)) % 1000)
    seq_lens = [c + n for c, n in zip(contexts, query_lens)]
    fp8 = cache_dtype == FP8
    kv_scale = scale_tensor(0.05) if fp8 else None
    cache, block_table, rows = filled_mla_cache(seq_lens, block_size, lat + rope, cache_dtype, kv_scale)
    dtype = cache_dtype if cache_dtype in (torch.float32, torch.bfloat16) else torch.float16
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens + 2, heads, lat + rope, device=DEVICE).to(dtype)   # 2 rows past the last request
    q_scale = None
    if q_fp8:
        q_scale = scale_tensor(0.02)
        q = (q.float() / q_scale.item()).clamp(-448, 448).to(FP8)
    trees = [_tree(rng, n, tree) for n in query_lens]
    tree_mask = torch.tensor([b for _, bits in trees for b in bits] + [1, 1], dtype=torch.int32, device=DEVICE)
    sm_scale = 1.0 / math.sqrt(3 * rope)
    out = poison((num_tokens + 2, heads, lat), torch.float16 if q_fp8 else dtype, DEVICE)
    got, lse = mla_verify(q, cache, block_table, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                          cu_seqlens(query_lens, DEVICE), max(query_lens), kv_lora_rank=lat, sm_scale=sm_scale,
                          kv_scale=kv_scale, q_scale=q_scale, tree_mask=tree_mask if tree else None,
                          num_splits=num_splits, out=out, return_lse=True, variant=variant)
    assert got is out and torch.isnan(out[num_tokens:]).all()   # rows of no request: not written
    q64 = q.double() * (q_scale.item() if q_fp8 else 1.0)
    tol = FP8_TOL if fp8 else kernel_tolerance(dtype, DEVICE)   # fp32 on a GPU: TF32's, as the decode kernel's
    lse_tol = TF32_TOL if tol is TF32_TOL else dict(atol=1e-3, rtol=1e-3)
    start = 0
    for b, (n, ctx) in enumerate(zip(query_lens, contexts)):
        want_o, want_lse = _verify_f64(q64[start:start + n].cpu(), rows[b].cpu(), ctx, trees[b][0], sm_scale, lat)
        torch.testing.assert_close(got[start:start + n].double().cpu(), want_o, **tol)
        torch.testing.assert_close(lse[start:start + n].double().cpu(), want_lse, **lse_tol)
        start += n


def test_mla_verify_bad_input():
    cache, block_table, _ = filled_mla_cache([9, 6], 8, LAT + ROPE, torch.float16)
    q = torch.randn(5, 4, LAT + ROPE, dtype=torch.float16, device=DEVICE)
    seq_lens = torch.tensor([9, 6], dtype=torch.int32, device=DEVICE)
    cu = cu_seqlens([3, 2], DEVICE)
    ok = dict(kv_lora_rank=LAT, sm_scale=0.1)
    with pytest.raises(ValueError, match=r"max_query_len must be an int in \[1, 16\]"):
        mla_verify(q, cache, block_table, seq_lens, cu, 17, **ok)
    with pytest.raises(ValueError, match="a request brings 3 new tokens, more than max_query_len"):
        mla_verify(q, cache, block_table, seq_lens, cu, 2, validate=True, **ok)
    with pytest.raises(ValueError, match="one entry per request of cu_seqlens_q"):
        mla_verify(q, cache, block_table, seq_lens[:1], cu, 3, **ok)
    bad_tree = torch.tensor([1, 1, 4, 1, 3], dtype=torch.int32, device=DEVICE)   # token 1 lacks its own bit
    with pytest.raises(ValueError, match=r"tree_mask\[1\] \(token 1 of request 0\) must set its own bit"):
        mla_verify(q, cache, block_table, seq_lens, cu, 3, tree_mask=bad_tree, validate=True, **ok)
    with pytest.raises(ValueError, match="kv_lora_rank=80 must be between 1 and"):
        mla_verify(q, cache, block_table, seq_lens, cu, 3, kv_lora_rank=80, sm_scale=0.1)
    with pytest.raises(ValueError, match="variant='fast' is not supported; supported: auto, gluon, triton"):
        mla_verify(q, cache, block_table, seq_lens, cu, 3, variant="fast", **ok)


def test_gluon_verify_conditions():
    """Where the Gluon verify runs: sm_90, 16-bit query and cache of one dtype, 512 + 64 latent rows, blocks
    a multiple of 32 rows, contiguous tensors; every head count (a verify's rows are its tokens' heads)."""
    from tripath.ops._mla_decode_sm90 import gluon_verify_unsupported
    from tripath.platform import H200

    cache = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    for heads in (1, 16, 24, 128):
        assert gluon_verify_unsupported(H200, torch.zeros(8, heads, 576, dtype=torch.bfloat16), cache, 512,
                                        None) is None
    q = torch.zeros(8, 16, 576, dtype=torch.bfloat16)
    assert "multiple of 32" in gluon_verify_unsupported(H200, q, torch.zeros(4, 16, 576, dtype=torch.bfloat16),
                                                         512, None)
    assert "16-bit query and cache" in gluon_verify_unsupported(H200, q.half(), cache, 512, None)
    assert "kv_lora_rank 512" in gluon_verify_unsupported(H200, torch.zeros(8, 16, 640, dtype=torch.bfloat16),
                                                          torch.zeros(4, 64, 640, dtype=torch.bfloat16), 576, None)
    assert "contiguous out" in gluon_verify_unsupported(H200, q, cache, 512,
                                                        torch.zeros(16, 8, 512, dtype=torch.bfloat16).transpose(0, 1))


def test_fp8_query_dots_reduce_over_at_least_32_values():
    """An fp8 query's ``tl.dot`` needs K >= 32 on NVIDIA: a 16-wide rotary part is padded to a 32-wide tile in
    the verify and in the absorbed decode (a 16-wide tile does not compile there); a 16-bit query keeps 16."""
    from tripath.ops import mla_decode
    from tripath.triton_internals import capture_launches

    kv_scale, q_scale = scale_tensor(0.05), scale_tensor(0.02)
    cache, block_table, _ = filled_mla_cache([20, 9], 16, LAT + ROPE, FP8, kv_scale)
    seq_lens = torch.tensor([20, 9], dtype=torch.int32, device=DEVICE)
    for q_dtype, least in ((FP8, 32), (torch.float16, 16)):
        q = torch.randn(5, 4, LAT + ROPE, device=DEVICE).to(q_dtype)
        scales = dict(kv_scale=kv_scale, q_scale=q_scale if q_dtype == FP8 else None)
        with capture_launches() as records:
            mla_verify(q, cache, block_table, seq_lens, cu_seqlens([3, 2], DEVICE), 3, kv_lora_rank=LAT,
                       sm_scale=0.1, **scales)
            mla_decode(q[:2], cache, block_table, seq_lens, kv_lora_rank=LAT, sm_scale=0.1, **scales)
        widths = [r.kwargs["BLOCK_R"] for r in records if "BLOCK_R" in r.kwargs]
        assert len(widths) == 2 and set(widths) == {least}, (q_dtype, widths)
