"""Edge cases of the attention ops where Triton and the reference must agree: rows that see no key with a −inf
sink (0, LSE −inf, never NaN), softcaps far above the scores (no precision lost in the kernels' tanh), rows
past ``cu_seqlens_q[-1]`` (never written, on either path), and block-table errors that name the bad entry."""

import math

import pytest
import torch

from conftest import DEVICE
from helpers import TOL, cu_seqlens, filled_cache, naive_attention, poison
from tripath.ops import paged_decode, unified_attention, varlen_attention
from tripath.ops import reference as R

F16, F32 = torch.float16, torch.float32


def test_rows_without_keys_and_minus_inf_sinks_give_zero_and_minus_inf_lse():
    q = torch.randn(3, 4, 64, dtype=F16, device=DEVICE)
    kv = torch.randn(0, 2, 64, dtype=F16, device=DEVICE)
    sinks = torch.full((4,), float("-inf"), device=DEVICE)
    cu_q, cu_k = cu_seqlens([3], DEVICE), cu_seqlens([0], DEVICE)
    out = poison(q.shape, F16, DEVICE)
    got, lse = varlen_attention(q, kv, kv, cu_q, cu_k, 3, 0, causal=False, sinks=sinks, out=out, return_lse=True)
    want, want_lse = R.varlen_attention_ref(q, kv, kv, cu_q, cu_k, 3, 0, causal=False, sinks=sinks,
                                            return_lse=True)
    assert torch.equal(want.float(), torch.zeros_like(want.float())) and bool((want_lse == -math.inf).all())
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(lse, want_lse)
    # unsplit paged decode of requests of no keys (seq_len 0) beside one that has keys
    k_cache, v_cache, bt, _, _ = filled_cache([0, 5], 2, 64, device=DEVICE)
    q = torch.randn(2, 4, 64, dtype=F16, device=DEVICE)
    sl = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    for splits in (1, 2):
        out = poison(q.shape, F16, DEVICE)
        got, lse = paged_decode(q, k_cache, v_cache, bt, sl, sinks=sinks, num_splits=splits, out=out,
                                return_lse=True)
        want, want_lse = R.paged_decode_ref(q, k_cache, v_cache, bt, sl, sinks=sinks, return_lse=True)
        assert not got.isnan().any() and bool((lse[0] == -math.inf).all())
        torch.testing.assert_close(got.float(), want.float(), **TOL[F16])
        torch.testing.assert_close(lse, want_lse, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("softcap", [0.5, 30.0, 1e4, 1e8, 1e30])
def test_softcap_is_precise_at_any_size(softcap):
    """fp32 inputs: the capped scores ``c·tanh(s/c)`` keep fp32 precision, however large ``c`` (the sigmoid
    form cancels for small ``s/c``: an error of ``c·1e-7``, 2 at ``c`` = 1e8)."""
    sq, sk, hq, d = 5, 9, 2, 32
    q = torch.randn(sq, hq, d, dtype=F32, device=DEVICE) * 3
    k = torch.randn(sk, 1, d, dtype=F32, device=DEVICE) * 3
    v = torch.randn(sk, 1, d, dtype=F32, device=DEVICE)
    cu_q, cu_k = cu_seqlens([sq], DEVICE), cu_seqlens([sk], DEVICE)
    # On a GPU, tl.dot takes fp32 operands as TF32 (10-bit mantissa): scores within about 1e-3 relative. The
    # sigmoid form's cancellation at c = 1e8 is an error of about 2, far beyond either bound.
    tol = dict(atol=5e-2, rtol=5e-2) if DEVICE.type == "cuda" else dict(atol=1e-4, rtol=1e-4)
    got, lse = varlen_attention(q, k, v, cu_q, cu_k, sq, sk, softcap=softcap, return_lse=True)
    want_out, want_lse = naive_attention(q.cpu(), k.cpu(), v.cpu(), q_start=sk - sq, softcap=softcap)
    torch.testing.assert_close(got.cpu().double(), want_out, **tol)
    torch.testing.assert_close(lse.cpu().double(), want_lse, **tol)
    k_cache, v_cache, bt, keys, values = filled_cache([7, 12], 1, d, dtype=F32, device=DEVICE)
    qd = torch.randn(2, hq, d, dtype=F32, device=DEVICE) * 3
    sl = torch.tensor([7, 12], dtype=torch.int32, device=DEVICE)
    got = paged_decode(qd, k_cache, v_cache, bt, sl, softcap=softcap, num_splits=1)
    for i, n in enumerate([7, 12]):
        want_out, _ = naive_attention(qd[i:i + 1].cpu(), keys[i].cpu(), values[i].cpu(), q_start=n - 1,
                                      softcap=softcap)
        torch.testing.assert_close(got[i:i + 1].cpu().double(), want_out, **tol)


def test_softcap_beyond_the_bound_is_refused():
    q = torch.randn(4, 2, 32, dtype=F16)
    cu = cu_seqlens([4], "cpu")
    with pytest.raises(ValueError, match=r"softcap must be a finite number in \[0, 1e\+30\].*got 1e\+31"):
        varlen_attention(q, q, q, cu, cu, 4, 4, softcap=1e31)


def test_rows_past_the_last_request_are_left_untouched_on_every_path():
    sq, hq, d = [3, 4], 2, 32
    total, padded = sum(sq), sum(sq) + 5
    q = torch.randn(padded, hq, d, dtype=F16, device=DEVICE)
    k = torch.randn(padded, hq, d, dtype=F16, device=DEVICE)
    cu = cu_seqlens(sq, DEVICE)
    k_cache, v_cache, bt, _, _ = filled_cache([6, 9], hq, d, device=DEVICE)
    sl = torch.tensor([6, 9], dtype=torch.int32, device=DEVICE)
    sentinel = torch.full((padded, hq, d), 7.0, dtype=F16, device=DEVICE)
    paths = {
        "varlen": (varlen_attention, R.varlen_attention_ref, (q, k, k, cu, cu, max(sq), max(sq))),
        "unified": (unified_attention, R.unified_attention_ref, (q, k_cache, v_cache, bt, sl, cu, max(sq))),
    }
    for name, (op, ref, args) in paths.items():
        got = op(*args, out=sentinel.clone())
        want = ref(*args, out=sentinel.clone())
        assert torch.equal(got[total:], sentinel[total:]), name
        assert torch.equal(want[total:], sentinel[total:]), name
        torch.testing.assert_close(got[:total].float(), want[:total].float(), **TOL[F16])


def test_a_bad_block_id_is_named_by_its_position_and_value():
    k_cache, v_cache, _, _, _ = filled_cache([16, 16], 2, 32, block_size=16, device=DEVICE)
    num_blocks = k_cache.shape[0]
    table = torch.tensor([[1, 2], [3, num_blocks + 4]], dtype=torch.int32)
    q = torch.randn(2, 2, 32, dtype=F16)
    sl = torch.tensor([20, 30], dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"block_table: block ids must be in \[0, num_blocks={num_blocks}\) "
                                         rf"\(entry \[1, 1\] is {num_blocks + 4}\)"):
        paged_decode(q, k_cache.cpu(), v_cache.cpu(), table, sl)
