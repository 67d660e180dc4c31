"""Fuzzed index metadata (lengths, block tables, slots, offsets; valid and not) through the ops in validate
mode: each call either raises a ``ValueError`` naming an index argument — exactly when the metadata is
invalid by an independent plain-Python rule — or matches the PyTorch reference. Never a crash.

The CPU test runs a few tiny examples under Triton's interpreter (host tensors: their values are always
checked); the GPU test runs many more on device tensors with ``validate=True``, bf16, more ops.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tripath.ops import (concat_and_cache_mla, gather_kv_cache, gather_mla_cache, mla_decode, paged_decode,
                         unified_attention, varlen_attention, write_kv_cache)
from tripath.ops import reference as R
from tripath.ops import reference_mla as RM
from tripath.ops.kv_cache import gather_kv_cache_ref, write_kv_cache_ref

INDEX_NAMES = r"(seq_lens|block_table|slot_mapping|seq_starts|cu_seqlens\w*|max_seqlen_\w)"
HKV, D = 2, 32
L, RD = 32, 32


@st.composite
def paged_cases(draw, block_sizes=(16,), max_reqs=3, max_width=3, max_blocks=6):
    """A paged batch: ``block_size``, ``num_blocks``, a ``[B, W]`` block table, ``seq_lens``, per-request
    new tokens ``q_lens`` (each 0..3), gather starts, and write slots; each piece mostly valid, sometimes not."""
    bs = draw(st.sampled_from(block_sizes))
    nb = draw(st.integers(2, max_blocks))
    b = draw(st.integers(1, max_reqs))
    w = draw(st.integers(1, max_width))
    block_id = st.one_of(st.integers(0, nb - 1), st.integers(0, nb - 1), st.integers(0, nb - 1),
                         st.sampled_from([-1, nb, nb + 7]))
    table = [[draw(block_id) for _ in range(w)] for _ in range(b)]
    length = st.one_of(st.integers(0, w * bs), st.integers(0, w * bs), st.integers(-2, w * bs + 3))
    seq_lens = [draw(length) for _ in range(b)]
    q_lens = [draw(st.integers(0, 3)) for _ in range(b)]
    starts = [draw(st.integers(-1, w * bs)) for _ in range(b)]
    slots = draw(st.lists(st.one_of(st.integers(-2, nb * bs - 1), st.integers(-2, nb * bs - 1),
                                    st.integers(nb * bs, nb * bs + 40)), min_size=1, max_size=6))
    return dict(bs=bs, nb=nb, table=table, seq_lens=seq_lens, q_lens=q_lens, starts=starts, slots=slots)


def _reads_ok(case, starts, ends) -> bool:
    """Every request reads positions ``starts[i] .. ends[i] - 1``: inside its row, in-range block ids."""
    bs, nb, width = case["bs"], case["nb"], len(case["table"][0])
    for row, s, e in zip(case["table"], starts, ends):
        if s < 0 or e < s or e > width * bs:
            return False
        if e > s and any(not 0 <= row[c] < nb for c in range(s // bs, -(-e // bs))):
            return False
    return True


def _expect(valid: bool, call, reference, tol):
    if not valid:
        with pytest.raises(ValueError, match=INDEX_NAMES):
            call()
        return
    got, want = call(), reference()
    for g, r in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g.float(), r.float(), **tol)


def check_case(op: str, case: dict, device, dtype, validate):
    bs, nb = case["bs"], case["nb"]
    gen = torch.Generator().manual_seed(sum(case["seq_lens"]) + 7 * len(case["slots"]))
    tol = dict(atol=1.5e-2, rtol=1e-2) if dtype != torch.float32 else dict(atol=1e-4, rtol=1e-4)
    table = torch.tensor(case["table"], dtype=torch.int32, device=device)
    seq_lens = torch.tensor(case["seq_lens"], dtype=torch.int32, device=device)
    b = table.shape[0]
    lens = case["seq_lens"]

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    kc, vc = rand(nb, bs, HKV, D), rand(nb, bs, HKV, D)
    mla_cache = rand(nb, bs, L + RD)
    if op == "paged_decode":
        q = rand(b, 2 * HKV, D)
        valid = _reads_ok(case, [0] * b, lens)
        _expect(valid, lambda: paged_decode(q, kc, vc, table, seq_lens, validate=validate),
                lambda: R.paged_decode_ref(q, kc, vc, table, seq_lens), tol)
    elif op == "unified_attention":
        q_lens = case["q_lens"]
        q = rand(sum(q_lens), 2 * HKV, D)
        cu = torch.tensor([0] + [sum(q_lens[:i + 1]) for i in range(b)], dtype=torch.int32, device=device)
        valid = _reads_ok(case, [0] * b, lens) and all(n >= ql for n, ql in zip(lens, q_lens))
        _expect(valid, lambda: unified_attention(q, kc, vc, table, seq_lens, cu, max(q_lens), validate=validate),
                lambda: R.unified_attention_ref(q, kc, vc, table, seq_lens, cu, max(q_lens)), tol)
    elif op == "mla_decode":
        q = rand(b, 16, L + RD)
        valid = _reads_ok(case, [0] * b, lens)
        _expect(valid, lambda: mla_decode(q, mla_cache, table, seq_lens, kv_lora_rank=L, sm_scale=0.2,
                                          validate=validate),
                lambda: RM.mla_decode_ref(q, mla_cache, table, seq_lens, kv_lora_rank=L, sm_scale=0.2), tol)
    elif op in ("gather_kv_cache", "gather_mla_cache"):
        counts = [max(0, n) for n in lens]
        cu = torch.tensor([0] + [sum(counts[:i + 1]) for i in range(b)], dtype=torch.int32, device=device)
        starts = torch.tensor(case["starts"], dtype=torch.int32, device=device)
        valid = _reads_ok(case, case["starts"], [s + n for s, n in zip(case["starts"], counts)])
        if op == "gather_kv_cache":
            _expect(valid, lambda: gather_kv_cache(kc, vc, table, cu, starts, validate=validate),
                    lambda: gather_kv_cache_ref(kc, vc, table, cu, starts), tol)
        else:
            _expect(valid, lambda: gather_mla_cache(mla_cache, table, cu, starts, validate=validate),
                    lambda: RM.gather_mla_cache_ref(mla_cache, table, cu, starts), tol)
    elif op in ("write_kv_cache", "concat_and_cache_mla"):
        slots = torch.tensor(case["slots"], dtype=torch.int64, device=device)
        valid = all(s < nb * bs for s in case["slots"])
        distinct = [s for s in case["slots"] if s >= 0]
        if len(set(distinct)) != len(distinct):
            return  # two tokens to one slot: which one lands is unspecified
        t = slots.shape[0]
        if op == "write_kv_cache":
            key, value = rand(t, HKV, D), rand(t, HKV, D)
            got_k, got_v, want_k, want_v = kc.clone(), vc.clone(), kc.clone(), vc.clone()
            _expect(valid, lambda: (write_kv_cache(key, value, got_k, got_v, slots, validate=validate),
                                    got_k, got_v)[1:],
                    lambda: (write_kv_cache_ref(key, value, want_k, want_v, slots), want_k, want_v)[1:], tol)
        else:
            kv_c, k_pe = rand(t, L), rand(t, RD)
            got, want = mla_cache.clone(), mla_cache.clone()
            _expect(valid, lambda: (concat_and_cache_mla(kv_c, k_pe, got, slots, validate=validate), got)[1],
                    lambda: (RM.concat_and_cache_mla_ref(kv_c, k_pe, want, slots), want)[1], tol)
    else:
        raise AssertionError(op)


@st.composite
def varlen_cases(draw, max_reqs=3, max_len=40):
    lens = draw(st.lists(st.integers(0, max_len), min_size=1, max_size=max_reqs))
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    if draw(st.integers(0, 3)) == 0:  # a corrupt offset
        i = draw(st.integers(0, len(cu) - 1))
        cu[i] += draw(st.sampled_from([-3, -1, 1, 5]))
    rows = draw(st.sampled_from([cu[-1], cu[-1] + 2, max(0, cu[-1] - 1)]))
    longest = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    max_seqlen = draw(st.sampled_from([longest, longest + 3, max(0, longest - 1)]))
    return dict(cu=cu, rows=max(rows, 1), max_seqlen=max(0, max_seqlen))


def check_varlen(case, device, dtype, validate):
    cu_list, rows, max_seqlen = case["cu"], case["rows"], case["max_seqlen"]
    gen = torch.Generator().manual_seed(rows)
    q, k, v = (torch.randn(rows, h, D, generator=gen).to(device, dtype) for h in (4, 2, 2))
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
    lens = [b - a for a, b in zip(cu_list[:-1], cu_list[1:])]
    valid = cu_list[0] == 0 and min(lens) >= 0 and cu_list[-1] <= rows and max(lens) <= max_seqlen
    tol = dict(atol=1.5e-2, rtol=1e-2) if dtype != torch.float32 else dict(atol=1e-4, rtol=1e-4)
    _expect(valid, lambda: varlen_attention(q, k, v, cu, cu, max_seqlen, max_seqlen, validate=validate)[:cu_list[-1]],
            lambda: R.varlen_attention_ref(q, k, v, cu, cu, max_seqlen, max_seqlen)[:cu_list[-1]], tol)


CPU_OPS = ["paged_decode", "gather_kv_cache", "write_kv_cache", "concat_and_cache_mla"]
GPU_OPS = CPU_OPS + ["unified_attention", "mla_decode", "gather_mla_cache"]
FAST = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("op", CPU_OPS)
@settings(max_examples=6, **FAST)
@given(case=paged_cases(max_reqs=2, max_width=2, max_blocks=4))
def test_fuzzed_paged_metadata_raises_or_matches_cpu(op, case):
    check_case(op, case, "cpu", torch.float16, validate=None)


@settings(max_examples=6, **FAST)
@given(case=varlen_cases(max_reqs=2, max_len=12))
def test_fuzzed_varlen_offsets_raise_or_match_cpu(case):
    check_varlen(case, "cpu", torch.float16, validate=None)


@pytest.mark.gpu
@pytest.mark.parametrize("op", GPU_OPS)
@settings(max_examples=150, **FAST)
@given(case=paged_cases(block_sizes=(16, 32, 64), max_reqs=6, max_width=8, max_blocks=40))
def test_fuzzed_paged_metadata_raises_or_matches_gpu(op, case):
    check_case(op, case, "cuda", torch.bfloat16, validate=True)
    torch.cuda.synchronize()  # an illegal access would surface here


@pytest.mark.gpu
@settings(max_examples=150, **FAST)
@given(case=varlen_cases(max_reqs=6, max_len=700))
def test_fuzzed_varlen_offsets_raise_or_match_gpu(case):
    check_varlen(case, "cuda", torch.bfloat16, validate=True)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_validate_mode_reads_device_values(monkeypatch):
    """On a device the values are read only when asked: validate=True, or TRIPATH_VALIDATE=1."""
    kc = torch.randn(4, 16, HKV, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, 4, D, device="cuda", dtype=torch.bfloat16)
    table = torch.tensor([[1, 9]], dtype=torch.int32, device="cuda")  # block 9 of 4
    seq_lens = torch.tensor([20], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"block_table: block ids must be in \[0, num_blocks=4\)"):
        paged_decode(q, kc, kc, table, seq_lens, validate=True)
    monkeypatch.setenv("TRIPATH_VALIDATE", "1")
    with pytest.raises(ValueError, match=r"block_table: block ids must be in"):
        paged_decode(q, kc, kc, table, seq_lens)
    with pytest.raises(ValueError, match=r"k_scale must be a finite positive scale, got nan"):
        k8 = kc.to(torch.float8_e4m3fn)
        one = torch.ones(1, device="cuda")
        paged_decode(q, k8, k8, table[:, :1], seq_lens.clamp(max=16), k_scale=one * math.nan, v_scale=one)
