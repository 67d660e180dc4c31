"""The PyTorch references against independent float64 math (row by row, explicit masks)."""

import pytest
import torch

from helpers import cu_seqlens, filled_cache, naive_attention
from tripath.ops import reference as R

CASES = [
    dict(),
    dict(causal=False),
    dict(window_left=5),
    dict(softcap=2.0),
    dict(alibi=True),
    dict(sinks=True),
    dict(window_left=3, alibi=True, sinks=True, softcap=4.0),
]


@pytest.mark.parametrize("opts", CASES, ids=lambda o: "-".join(o) or "plain")
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 1), (5, 1)])
def test_varlen_reference_matches_naive(opts, hq, hkv):
    lq, lk = [3, 6, 1], [7, 6, 4]
    d = 32
    q = torch.randn(sum(lq), hq, d)
    k = torch.randn(sum(lk), hkv, d)
    v = torch.randn(sum(lk), hkv, 16)
    alibi = torch.rand(hq) if opts.get("alibi") else None
    sinks = torch.randn(hq) if opts.get("sinks") else None
    kw = dict(causal=opts.get("causal", True), window_left=opts.get("window_left", -1),
              softcap=opts.get("softcap", 0.0), alibi_slopes=alibi, sinks=sinks)
    out, lse = R.varlen_attention_ref(q, k, v, cu_seqlens(lq, "cpu"), cu_seqlens(lk, "cpu"), return_lse=True, **kw)
    qo = ko = 0
    for sq, sk in zip(lq, lk):
        want, want_lse = naive_attention(q[qo:qo + sq], k[ko:ko + sk], v[ko:ko + sk], q_start=sk - sq, **kw)
        torch.testing.assert_close(out[qo:qo + sq].double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[qo:qo + sq].double(), want_lse, atol=1e-5, rtol=1e-5)
        qo, ko = qo + sq, ko + sk


@pytest.mark.parametrize("layout", ["nhd", "shuffled"])
def test_paged_references_match_naive(layout):
    seq_lens, hq, hkv, d = [1, 19, 40], 4, 2, 32
    k_cache, v_cache, bt, keys, values = filled_cache(seq_lens, hkv, d, dtype=torch.float16, layout=layout)
    q_lens = [1, 4, 7]
    q = torch.randn(sum(q_lens), hq, d, dtype=torch.float16)
    out, lse = R.unified_attention_ref(q, k_cache, v_cache, bt, torch.tensor(seq_lens, dtype=torch.int32),
                                       cu_seqlens(q_lens, "cpu"), layout=layout, return_lse=True)
    at = 0
    for i, (s, n) in enumerate(zip(seq_lens, q_lens)):
        want, want_lse = naive_attention(q[at:at + n], keys[i], values[i], q_start=s - n)
        torch.testing.assert_close(out[at:at + n].double(), want, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(lse[at:at + n].double(), want_lse, atol=1e-4, rtol=1e-4)
        at += n
    dq = torch.randn(3, hq, d, dtype=torch.float16)
    out = R.paged_decode_ref(dq, k_cache, v_cache, bt, torch.tensor(seq_lens, dtype=torch.int32), layout=layout)
    for i, s in enumerate(seq_lens):
        want, _ = naive_attention(dq[i:i + 1], keys[i], values[i], q_start=s - 1)
        torch.testing.assert_close(out[i:i + 1].double(), want, atol=2e-3, rtol=2e-3)


def test_merge_reference_matches_joint_softmax():
    q = torch.randn(4, 2, 32)
    k = torch.randn(10, 2, 32)
    v = torch.randn(10, 2, 32)
    cu4, cu = cu_seqlens([4], "cpu"), lambda n: cu_seqlens([n], "cpu")
    full, full_lse = R.varlen_attention_ref(q, k, v, cu4, cu(10), causal=False, return_lse=True)
    a, la = R.varlen_attention_ref(q, k[:6], v[:6], cu4, cu(6), causal=False, return_lse=True)
    b, lb = R.varlen_attention_ref(q, k[6:], v[6:], cu4, cu(4), causal=False, return_lse=True)
    out, lse = R.merge_states_ref(a, la, b, lb)
    torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, full_lse, atol=1e-5, rtol=1e-5)
