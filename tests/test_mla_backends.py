"""The MLA backends (``mla``, ``mla_triton``) against ``torch`` on mixed MLA batches: decode, prefill and
extend with chunked context, fp8 caches, NoPE, NeoX/GPT-J RoPE, speculative decodes; fused vs unfused
preparation; selection."""

import math

import pytest
import torch

from conftest import DEVICE, HAS_GPU
from helpers import FP8_TOL, TOL
from tripath.attention import (AttentionSpec, ForwardContext, MLALayerWeights, MLASpec, RotaryTables, explain,
                               select_backend)
from tripath.attention.backends.base import MHAAttentionBackend, MLAAttentionBackend
from tripath.attention.backends.mla import MLABackend
from tripath.attention.backends.torch_ref import TorchBackend
from tripath.bench.batches import MLAStep
from tripath.bench.batches import make_mla_step as build_mla_step
from tripath.triton_internals import capture_launches

SMALL = MLASpec(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
DEEPSEEK = MLASpec()  # 512 / 64 / 128 / 128

# (context_len, query_len) per request, in arrival order (the plan reorders them)
BATCHES = {
    "decode_only": [(37, 1), (5, 1), (70, 1), (1, 1)],
    "prefill_only": [(0, 9), (0, 30)],
    "mixed": [(40, 1), (0, 9), (70, 12), (5, 1), (33, 5), (0, 1)],
}
CHUNKED = [(1568, 32), (520, 8), (8, 8), (80, 16), (96, 16), (8, 8), (300, 1), (0, 5)]


def make_mla_step(spec, requests, *, seed=0, rope="gptj", q_scale=None) -> MLAStep:
    """The library's step builder with a reference-allocated cache on the test device."""
    return build_mla_step(spec, requests, TorchBackend(spec, DEVICE), device=DEVICE, seed=seed, rope=rope,
                          q_scale=q_scale)


def run_mla(backend, step: MLAStep):
    meta = backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
    cache = step.fresh_cache()
    out = backend.forward_mla(step.q_nope, step.q_pe, step.kv_c, step.k_pe, step.positions, cache, meta,
                              step.weights)
    return out, cache


def mla_spec(mla=SMALL, heads=4, **kwargs):
    return AttentionSpec(heads, 1, mla.cache_width, dtype=kwargs.pop("dtype", torch.float16), mla=mla, **kwargs)


def check_against_torch(name, spec, requests, *, seed=0, rope="gptj", q_scale=None, **backend_kwargs):
    step = make_mla_step(spec, requests, seed=seed, rope=rope, q_scale=q_scale)
    backend = select_backend(spec, name, DEVICE) if not backend_kwargs else MLABackend(spec, DEVICE,
                                                                                       **backend_kwargs)
    got, got_cache = run_mla(backend, step)
    want, want_cache = run_mla(TorchBackend(spec, DEVICE), step)
    fp8 = spec.kv_cache_dtype == "fp8"
    tol = FP8_TOL if fp8 else TOL[spec.dtype]
    torch.testing.assert_close(got.float(), want.float(), **tol)
    # the step's rows landed in the cache as the reference wrote them (bit for bit on the CPU, where
    # rotation and quantisation round identically; within rounding on a GPU)
    if HAS_GPU:
        torch.testing.assert_close(got_cache.kv_cache.float(), want_cache.kv_cache.float(), **tol)
    else:
        assert torch.equal(got_cache.kv_cache.view(torch.uint8), want_cache.kv_cache.view(torch.uint8))
    return step, got


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("name", ["mla", "mla_triton", "sdpa"])
def test_mla_backend_matches_torch(name, batch, kv_cache_dtype):
    spec = mla_spec(kv_cache_dtype=kv_cache_dtype, extend_chunk_budget=48)
    check_against_torch(name, spec, BATCHES[batch], seed=len(batch))


@pytest.mark.parametrize("name", ["mla", "mla_triton"])
def test_chunked_context_with_many_chunks(name):
    """Long and short extends sharing a small chunk budget: many chunks of gathered, up-projected context
    merged by LSE with the new tokens' causal attention (and a decode and a prefill in the same step)."""
    spec = mla_spec(heads=2, extend_chunk_budget=1024)
    step = make_mla_step(spec, CHUNKED)
    assert step.plan.extend_chunks.num_chunks == 10
    check_against_torch(name, spec, CHUNKED)


@pytest.mark.parametrize("requests", [[(40, 1), (70, 12), (33, 5)], [(70, 12), (33, 5), (0, 9)]],
                         ids=["decode+extend", "extend+prefill"])
@pytest.mark.parametrize("budget", [32768, 48], ids=["one-chunk", "several-chunks"])
def test_extend_tail_joined_with_the_new_tokens(budget, requests):
    """With a cache of the model's dtype, the extends' new tokens are read back from the cache with the last
    context chunk, up-projected with it and attended in one causal launch (one chunk: no merge); the
    result matches ``torch``."""
    spec = mla_spec(extend_chunk_budget=budget)
    step, _ = check_against_torch("mla", spec, requests)
    backend = select_backend(spec, "mla", DEVICE)
    with capture_launches() as records:
        run_mla(backend, step)
    names = [r.name for r in records]
    if budget == 32768:
        assert "merge_states_kernel" not in names and names.count("gather_mla_cache_kernel") == 1


@pytest.mark.parametrize("rope", ["neox", None])
@pytest.mark.parametrize("name", ["mla", "mla_triton"])
def test_rope_styles_and_nope(name, rope):
    """NeoX pairs, and NoPE models (no tables: identity rotation, the fused kernel's no-rotation path)."""
    check_against_torch(name, mla_spec(extend_chunk_budget=32), BATCHES["mixed"], rope=rope)


@pytest.mark.parametrize("name", ["mla", "mla_triton"])
def test_yarn_scale_block_size_and_fp8_query(name):
    """A softmax scale with yarn's mscale², 64-token blocks, and an fp8 absorbed query (``q_scale``)."""
    mscale = 0.1 * math.log(40) + 1.0
    spec = mla_spec(kv_cache_dtype="fp8", block_size=64, extend_chunk_budget=128,
                    sm_scale=mscale ** 2 / math.sqrt(SMALL.qk_nope_head_dim + SMALL.qk_rope_head_dim))
    q_scale = torch.tensor([0.02], device=DEVICE)
    check_against_torch(name, spec, [(150, 1), (70, 1), (200, 20), (0, 7)], q_scale=q_scale)


@pytest.mark.parametrize("verify_kernel, gluon, min_tokens, heads, packed", [
    ("rows", True, 2, 4, False), ("packed", False, 8, 4, True), ("auto", False, 2, 4, False),
    ("auto", True, 2, 4, True), ("auto", True, 4, 4, False), ("auto", True, 2, 64, False)])
@pytest.mark.parametrize("name", ["mla", "mla_triton"])
def test_speculative_decodes(name, verify_kernel, gluon, min_tokens, heads, packed, monkeypatch):
    """Verifies of chains (3 tokens at most here): a decode row a token (the decode kernels), or every token and
    head of a request in one program (``verify_kernel = "packed"``: ``mla_verify``, which then launches instead
    of the decode kernel); ``"auto"`` packs them where ``mla_verify`` runs its Gluon kernel (here: told it does
    or not), the layer has fewer than 64 heads and the step's verifies bring ``PACKED_VERIFY_MIN_TOKENS``
    tokens or more."""
    from tripath.attention.backends import mla_common

    spec = mla_spec(heads=heads, decode_threshold=3, extend_chunk_budget=64)
    monkeypatch.setattr(type(select_backend(spec, name, DEVICE)), "verify_kernel", verify_kernel)
    monkeypatch.setattr(mla_common, "gluon_verify_applies", lambda *a: gluon)
    monkeypatch.setattr(mla_common, "PACKED_VERIFY_MIN_TOKENS", min_tokens)
    calls = []
    for op in ("mla_verify", "mla_decode"):
        real = getattr(mla_common, op)
        monkeypatch.setattr(mla_common, op, lambda *a, _op=op, _real=real, **k: calls.append(_op) or _real(*a, **k))
    step, _ = check_against_torch(name, spec, [(20, 3), (9, 2), (0, 4), (30, 6), (14, 1)])
    assert step.plan.num_decodes == 3
    assert calls == ["mla_verify" if packed else "mla_decode"]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("name", ["mla", "mla_triton"])
def test_draft_tree_verifies(name, kv_cache_dtype):
    """Verifies carrying random draft trees (``metadata.decode.verify.tree_mask``) beside one-token decodes, a
    causal chain's mask (a prompt chunk short enough for the decode slice) and a prefill: the decode kernel
    on the cached context merged with the trees' own tokens equals the reference, and differs from the same
    step without the masks (so the masks are read)."""
    import random

    from tripath.engine.speculative.trees import chain_parents, tree_mask_bits

    spec = mla_spec(decode_threshold=6, extend_chunk_budget=64, kv_cache_dtype=kv_cache_dtype)
    requests = [(20, 6), (9, 4), (30, 1), (3, 3), (14, 5), (0, 9)]
    step = make_mla_step(spec, requests, seed=7)
    rng = random.Random(3)
    plan = step.plan
    bits, branched = [], False
    for j in range(plan.num_decodes - plan.num_verifies, plan.num_decodes):
        n, ctx = plan.query_lens[j], plan.context_lens[j]
        parents = chain_parents(n - 1) if n == 3 else [rng.randrange(-1, t) for t in range(n - 1)]
        branched |= parents != chain_parents(n - 1)
        bits += tree_mask_bits(parents)
    assert plan.num_verifies == 4 and branched

    def run(backend, trees):
        meta = backend.build_metadata(plan, step.block_table, step.slot_mapping)
        if trees:
            meta.decode.verify.tree_mask = torch.tensor(bits, dtype=torch.int32, device=DEVICE)
        return backend.forward_mla(step.q_nope, step.q_pe, step.kv_c, step.k_pe, step.positions, step.fresh_cache(),
                                   meta, step.weights).float()

    got = run(select_backend(spec, name, DEVICE), True)
    want = run(TorchBackend(spec, DEVICE), True)
    torch.testing.assert_close(got, want, **(FP8_TOL if kv_cache_dtype == "fp8" else TOL[spec.dtype]))
    chains = run(TorchBackend(spec, DEVICE), False)
    assert not torch.allclose(chains, want, atol=1e-2), "the trees' masks changed nothing"


def test_deepseek_dims():
    """The real latent geometry (L 512, R 64, P 128, V 128; prefill qk 192 / v 128) on a small batch."""
    spec = mla_spec(DEEPSEEK, heads=2, extend_chunk_budget=64)
    check_against_torch("mla", spec, [(40, 1), (18, 1), (30, 4), (0, 3)])


def test_fused_and_unfused_preparation_agree_bitwise():
    """The guard only picks a path: fused or unfused, the cache and the output are the same bits."""
    spec = mla_spec(kv_cache_dtype="fp8", extend_chunk_budget=32)
    for batch in ("decode_only", "mixed"):
        step = make_mla_step(spec, BATCHES[batch], q_scale=torch.tensor([0.03], device=DEVICE))
        fused = MLABackend(spec, DEVICE)
        unfused = MLABackend(spec, DEVICE, fused_prep=False)
        assert fused.fused_prep_reasons(fused.build_metadata(step.plan, step.block_table, step.slot_mapping),
                                        step.weights) == []
        out_f, cache_f = run_mla(fused, step)
        out_u, cache_u = run_mla(unfused, step)
        assert torch.equal(cache_f.kv_cache.view(torch.uint8), cache_u.kv_cache.view(torch.uint8))
        assert torch.equal(out_f, out_u)


def _launched(backend, step) -> list[str]:
    with capture_launches() as records:
        run_mla(backend, step)
    return [r.name for r in records]


def test_decode_step_launches():
    """A decode step: ``mla`` prepares in one launch (the fused kernel) and decodes with the head-packed
    kernel; ``mla_triton`` prepares in three (rotary, cache write, query concat) and decodes with the plain
    grouped configuration of the same kernel."""
    spec = mla_spec()
    step = make_mla_step(spec, [(30, 1), (12, 1)])
    fast = _launched(select_backend(spec, "mla", DEVICE), step)
    base = _launched(select_backend(spec, "mla_triton", DEVICE), step)
    assert fast[:2] == ["mla_prep_kernel", "mla_decode_kernel"]
    assert base[:4] == ["rotary_embedding_kernel", "concat_and_cache_mla_kernel", "mla_prep_kernel",
                        "mla_decode_kernel"]


def test_the_decode_output_projection_writes_the_output_rows_itself():
    """``· W_UV`` of the absorbed decode writes its ``[H, Td, V]`` product straight into the ``[Td, H, V]``
    output (a strided batch), with no copy after it; the result is the reference's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    spec = mla_spec()
    step = make_mla_step(spec, BATCHES["decode_only"])
    backend = select_backend(spec, "mla_triton", DEVICE)
    meta = backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
    cache = step.fresh_cache()
    with Ops() as ops:
        got = backend.forward_mla(step.q_nope, step.q_pe, step.kv_c, step.k_pe, step.positions, cache, meta,
                                  step.weights)
    bmms = [i for i, name in enumerate(ops.seen) if name == "aten.bmm"]
    assert len(bmms) == 2   # q_nope · W_UK, then · W_UV into the output
    assert "aten.copy_" not in ops.seen[bmms[-1]:]
    want, _ = run_mla(TorchBackend(spec, DEVICE), step)
    torch.testing.assert_close(got.float(), want.float(), **TOL[spec.dtype])


def test_non_absorbed_attention_scores_the_rotary_part_separately():
    """Prefill and extend attention take ``[q_nope | q_pe]`` and ``[k_nope | k_pe]`` as two parts (no
    concatenated copy, no padding of 192-wide heads): every varlen launch has the rotary part, 32 + 16
    wide for the small spec."""
    spec = mla_spec()
    step = make_mla_step(spec, BATCHES["mixed"])
    with capture_launches() as records:
        run_mla(select_backend(spec, "mla", DEVICE), step)
    varlen = [r.kwargs for r in records if r.name == "varlen_attention_kernel"]
    assert varlen and all(kw["HAS_ROPE"] and kw["BLOCK_DK"] == 32 and kw["BLOCK_DR"] == 16 for kw in varlen)


@pytest.mark.parametrize("budget", [32768, 48], ids=["one-chunk", "several-chunks"])
def test_chunks_up_project_and_attend_only_their_rows(budget):
    """Each context chunk up-projects and attends only the latent rows it gathered (``num_tokens``), not the
    whole workspace: every varlen launch's keys have exactly ``cu_seqlens_k[-1]`` rows."""
    spec = mla_spec(extend_chunk_budget=budget)
    step = make_mla_step(spec, [(70, 12), (33, 5), (0, 9)])
    with capture_launches() as records:
        run_mla(select_backend(spec, "mla", DEVICE), step)
    varlen = [r.args for r in records if r.name == "varlen_attention_kernel"]
    assert varlen
    for args in varlen:  # (q, k, v, k_desc, v_desc, q_rope, k_rope, kr_desc, out, lse, cu_seqlens_q, cu_seqlens_k)
        assert args[1].shape[0] == args[2].shape[0] == args[6].shape[0] == int(args[11][-1])


def test_layer_weights_share_one_up_projection_matrix():
    """``w_uk`` and ``w_uv`` are views of one ``kv_b [H·(P+V), L]``: no copy from a ``kv_b_proj`` weight, one
    copy from separate tensors, the same values either way; bad shapes are refused."""
    heads, p_dim, v_dim, lat = 3, 4, 5, 6
    weight = torch.randn(heads * (p_dim + v_dim), lat)
    w = MLALayerWeights.from_kv_b_proj(weight, heads, p_dim)
    assert w.kv_b.data_ptr() == weight.data_ptr() and torch.equal(w.kv_b, weight)
    per_head = weight.view(heads, p_dim + v_dim, lat)
    assert torch.equal(w.w_uk, per_head[:, :p_dim]) and torch.equal(w.w_uv, per_head[:, p_dim:].transpose(1, 2))
    copied = MLALayerWeights(w.w_uk.contiguous(), w.w_uv.contiguous())
    assert copied.kv_b.data_ptr() != weight.data_ptr() and torch.equal(copied.kv_b, weight)
    assert copied.w_uk.data_ptr() == copied.kv_b.data_ptr()
    with pytest.raises(ValueError, match="w_uv must be"):
        MLALayerWeights(w.w_uk, torch.randn(heads, lat + 1, v_dim))
    with pytest.raises(ValueError, match="kv_b_proj weight"):
        MLALayerWeights.from_kv_b_proj(weight[:-1], heads, p_dim)


def test_guard_reasons():
    spec = mla_spec()
    step = make_mla_step(spec, BATCHES["prefill_only"])
    mla = select_backend(spec, "mla", DEVICE)
    meta = mla.build_metadata(step.plan, step.block_table, step.slot_mapping)
    assert mla.fused_prep_reasons(meta, step.weights) == ["no decode tokens"]
    assert "mla_prep_kernel" not in _launched(mla, step)
    bad = MLALayerWeights(step.weights.w_uk, step.weights.w_uv,
                          RotaryTables(step.weights.rotary.cos[:, :4], step.weights.rotary.sin, False))
    assert mla.fused_prep_reasons(meta, bad)[-1] == ("rotary cos table is not a [max_position, 8] float tensor "
                                                     "on the device")
    triton_base = select_backend(spec, "mla_triton", DEVICE)
    assert triton_base.fused_prep_reasons(meta, step.weights) == ["backend 'mla_triton' prepares unfused"]


def test_selection():
    spec = mla_spec()
    assert select_backend(spec, "auto", DEVICE).name == "mla"
    reasons = explain(spec, DEVICE)
    assert reasons["mla"] == [] and reasons["mla_triton"] == [] and reasons["torch"] == []
    assert reasons["three_path"] == ["does not serve MLA models"]
    assert explain(AttentionSpec(4, 1, 64), DEVICE)["mla"] == ["serves only MLA models"]
    tiny = AttentionSpec(2, 1, 24, mla=MLASpec(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                               v_head_dim=16))
    assert explain(tiny, DEVICE)["mla"] == [
        "qk_nope_head_dim + qk_rope_head_dim = 16 outside 32..256 (the prefill kernel)",
        "v_head_dim = 16 outside 32..256 (the prefill kernel)"]
    backend = select_backend(spec, "mla", DEVICE)
    assert isinstance(backend, MLAAttentionBackend) and not isinstance(backend, MHAAttentionBackend)
    with pytest.raises(TypeError, match="backend 'mla' serves MLA models only: MLA layers call attend_mla"):
        ForwardContext(backend, None, [None]).attend(0, None, None, None)
    mha = select_backend(AttentionSpec(4, 1, 64), "three_path", DEVICE)
    with pytest.raises(TypeError, match="backend 'three_path' serves MHA/GQA models only"):
        ForwardContext(mha, None, [None]).attend_mla(0, None, None, None, None, None, None)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("name", ["mla", "mla_triton"])
@pytest.mark.parametrize("heads", [16, 128])  # the two Gluon decode kernels on sm_90 (16-bit cache)
def test_deepseek_bf16_gpu(name, kv_cache_dtype, heads):
    spec = mla_spec(DEEPSEEK, heads=heads, dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype, block_size=64,
                    extend_chunk_budget=2048)
    check_against_torch(name, spec, [(4000, 1), (1500, 1), (3000, 200), (900, 64), (0, 300), (60, 1)],
                        q_scale=torch.tensor([0.05], device=DEVICE) if kv_cache_dtype == "fp8" else None)
