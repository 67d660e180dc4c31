"""What the portability check compiles: representative calls of every public op, and what each kernel is.

A :class:`Scenario` calls one public op on small CPU tensors. The check runs it under
``override_platform(target)`` and ``capture_launches()``, so the op validates its inputs and picks the
launch configuration of that GPU exactly as it would there, and the recorded launches (kernel, argument
types, constexprs, options) are what gets compiled. Tensor sizes only matter where the launchers read them
(head sizes, heads per KV head, dtypes, layout, context length for the split count); everything else is tiny.

Representative shapes: a Llama-style GQA layer (32 query heads, 8 KV heads) with head sizes 64/128/256
(plus 80 and the MLA prefill 192/128 for the padded, uneven-head paths), fp16 and bf16 activations, fp8
e4m3 KV caches of the platform's flavour (:func:`tripath.platform.fp8_dtype`), NHD and shuffled layouts,
the score modifiers as models combine them; for MLA the DeepSeek latent (L = 512, R = 64) with 16 heads
(TP8) and 128 heads, bf16 / fp8 caches and fp8 queries. ``ci=True`` marks the subset the CPU test suite
compiles on every submission (every kernel on every target); the CLI compiles everything.

Adding an op (e.g. the MLA kernels): write a ``_build_*`` function that calls the op, append a few
``Scenario`` rows in :func:`all_scenarios`, and declare each new kernel in
:data:`tripath.portability.kernel_roles.KERNEL_ROLES`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from tripath import ops
from tripath.ops import activation, mla, mla_absorbed, norm, rotary
from tripath.portability import compile_scenarios_gemm as gemm, compile_scenarios_mixed, compile_scenarios_mla_verify
from tripath.portability import compile_scenarios_sampling as sampling
from tripath.platform import Platform, fp8_dtype


@dataclass(frozen=True)
class Scenario:
    """One representative call: ``build(platform)`` calls a public op (launches are captured, not run)."""

    name: str
    build: Callable[[Platform], None]
    ci: bool = False
    targets: tuple[str, ...] | None = None  # check-compile targets it applies to; None: every target


# Llama-3-8B-like GQA geometry; the MLA prefill uses one head per KV head in its non-absorbed form.
NUM_HEADS, NUM_KV_HEADS = 32, 8
BLOCK_SIZE = 16
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def _rand(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


# Score modifiers as real models combine them (each combination is its own compiled kernel).
FEATURE_SETS = {
    "": {},
    "window+sinks": {"window_left": 127, "sinks": True},  # gpt-oss
    "window+softcap": {"window_left": 4095, "softcap": 50.0},  # Gemma 2
    "alibi": {"alibi_slopes": True},  # BLOOM, MPT
}


def _features(num_heads: int, features: str) -> dict:
    """Keyword arguments of one :data:`FEATURE_SETS` entry (per-head tensors made here)."""
    kwargs = dict(FEATURE_SETS[features])
    if kwargs.pop("sinks", False):
        kwargs["sinks"] = torch.randn(num_heads)
    if kwargs.pop("alibi_slopes", False):
        kwargs["alibi_slopes"] = torch.rand(num_heads)
    return kwargs


def in_large_allocation(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` at the start of an allocation larger than 2 GiB, like a serving KV cache.

    Triton's AMD back end gives pointers into allocations under 2 GiB 32-bit buffer-load attributes; a
    production cache is larger, so the check must compile the cache pointers without them. The backing
    memory is never touched (``torch.empty``), so it costs address space only.
    """
    numel = math.prod(shape)
    backing = torch.empty(2**31 // torch.empty((), dtype=dtype).element_size() + numel, dtype=dtype)
    return backing[:numel].view(shape)


def _cache(head_size: int, cache_dtype: torch.dtype, layout: str, num_blocks: int = 8,
           num_kv_heads: int = NUM_KV_HEADS):
    k_shape, v_shape = ops.kv_cache_shapes(num_blocks, BLOCK_SIZE, num_kv_heads, head_size, cache_dtype, layout)
    k_cache, v_cache = in_large_allocation(k_shape, cache_dtype), in_large_allocation(v_shape, cache_dtype)
    scales = {}
    if cache_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        scales = dict(k_scale=torch.tensor([0.5]), v_scale=torch.tensor([0.25]))
    return k_cache, v_cache, scales


def _cache_dtype(platform: Platform, dtype: torch.dtype, fp8: bool) -> torch.dtype:
    return fp8_dtype(platform) if fp8 else dtype


def _build_varlen(platform: Platform, *, head_size: int, dtype: torch.dtype, causal: bool, lse: bool,
                  features: str = "", head_size_v: int | None = None, num_heads: int = NUM_HEADS,
                  num_kv_heads: int = NUM_KV_HEADS, lengths: tuple[int, ...] = (48, 80), rope: int = 0) -> None:
    """Two requests of ``lengths`` queries and keys (on sm_90 the Gluon kernel where it applies: for up to
    1024 keys as head-pair items for an even GQA group, else as 128-row items on 64-key tiles; elsewhere the
    portable one).
    ``rope``: a rotary part of that width in the scores, with one rotary key shared by the heads (MLA's)."""
    head_size_v = head_size_v or head_size
    if rope:
        rope_parts = dict(q_rope=_rand(sum(lengths), num_heads, rope, dtype=dtype),
                          k_rope=_rand(sum(lengths), 1, rope, dtype=dtype))
    else:
        rope_parts = {}
    q = _rand(sum(lengths), num_heads, head_size, dtype=dtype)
    k = _rand(sum(lengths), num_kv_heads, head_size, dtype=dtype)
    v = _rand(sum(lengths), num_kv_heads, head_size_v, dtype=dtype)
    cu = _cu(lengths)
    ops.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal, return_lse=lse,
                         **_features(num_heads, features), **rope_parts)


def _build_decode(platform: Platform, *, head_size: int, dtype: torch.dtype, layout: str, fp8: bool,
                  num_splits: int | None, features: str = "", batch: int = 4) -> None:
    k_cache, v_cache, scales = _cache(head_size, _cache_dtype(platform, dtype, fp8), layout)
    context_blocks = 256  # 4K-token contexts: the default split count is the platform's choice
    q = _rand(batch, NUM_HEADS, head_size, dtype=dtype)
    block_table = torch.zeros(batch, context_blocks, dtype=torch.int32)
    seq_lens = torch.full((batch,), context_blocks * BLOCK_SIZE, dtype=torch.int32)
    ops.paged_decode(q, k_cache, v_cache, block_table, seq_lens, layout=layout, num_splits=num_splits,
                     return_lse=True, **scales, **_features(NUM_HEADS, features))


def _build_unified(platform: Platform, *, head_size: int, dtype: torch.dtype, layout: str, fp8: bool,
                   features: str = "") -> None:
    k_cache, v_cache, scales = _cache(head_size, _cache_dtype(platform, dtype, fp8), layout)
    query_lens, seq_lens = [1, 1, 7, 40], [300, 33, 64, 40]  # decode, decode, extend, prefill
    q = _rand(sum(query_lens), NUM_HEADS, head_size, dtype=dtype)
    block_table = torch.zeros(len(seq_lens), 32, dtype=torch.int32)
    ops.unified_attention(q, k_cache, v_cache, block_table, torch.tensor(seq_lens, dtype=torch.int32),
                          _cu(query_lens), max(query_lens), layout=layout, **scales,
                          **_features(NUM_HEADS, features))


def _build_verify(platform: Platform, *, head_size: int, dtype: torch.dtype, layout: str, fp8: bool,
                  features: str = "", query_lens: tuple[int, ...] = (5, 3, 1, 5), num_kv_heads: int = NUM_KV_HEADS,
                  num_heads: int = NUM_HEADS, tree: bool = False) -> None:
    """Verify steps of four requests on 4K-token contexts (splits decided by the platform); ``tree``: each
    request's tokens a draft tree (every token a child of the first)."""
    k_cache, v_cache, scales = _cache(head_size, _cache_dtype(platform, dtype, fp8), layout,
                                      num_kv_heads=num_kv_heads)
    context_blocks = 256
    q = _rand(sum(query_lens), num_heads, head_size, dtype=dtype)
    block_table = torch.zeros(len(query_lens), context_blocks, dtype=torch.int32)
    seq_lens = torch.full((len(query_lens),), context_blocks * BLOCK_SIZE, dtype=torch.int32)
    tree_mask = torch.tensor([1 | (1 << t) for n in query_lens for t in range(n)], dtype=torch.int32) if tree \
        else None
    ops.paged_verify(q, k_cache, v_cache, block_table, seq_lens, _cu(query_lens), max(query_lens), layout=layout,
                     return_lse=True, tree_mask=tree_mask, **scales, **_features(num_heads, features))


def _build_merge(platform: Platform, *, head_size: int, dtype: torch.dtype) -> None:
    tokens = 24
    out_a, out_b = (_rand(tokens, NUM_HEADS, head_size, dtype=dtype) for _ in range(2))
    lse_a, lse_b = (torch.randn(tokens, NUM_HEADS) for _ in range(2))
    ops.merge_states(out_a, lse_a, out_b, lse_b)


def _build_write(platform: Platform, *, head_size: int, dtype: torch.dtype, layout: str, fp8: bool) -> None:
    k_cache, v_cache, scales = _cache(head_size, _cache_dtype(platform, dtype, fp8), layout)
    tokens = 24
    key = _rand(tokens, NUM_KV_HEADS, head_size, dtype=dtype)
    value = _rand(tokens, NUM_KV_HEADS, head_size, dtype=dtype)
    slots = torch.arange(BLOCK_SIZE, BLOCK_SIZE + tokens, dtype=torch.int64)
    ops.write_kv_cache(key, value, k_cache, v_cache, slots, layout=layout, **scales)


def _build_gather(platform: Platform, *, head_size: int, dtype: torch.dtype, layout: str, fp8: bool) -> None:
    k_cache, v_cache, scales = _cache(head_size, _cache_dtype(platform, dtype, fp8), layout)
    lengths = [40, 24]
    out_k = torch.empty(sum(lengths), NUM_KV_HEADS, head_size, dtype=dtype)
    out_v = torch.empty_like(out_k)
    ops.gather_kv_cache(k_cache, v_cache, torch.zeros(len(lengths), 8, dtype=torch.int32), _cu(lengths),
                        torch.zeros(len(lengths), dtype=torch.int32), layout=layout, out_k=out_k, out_v=out_v,
                        **scales)


# DeepSeek V3/R1 latent geometry: L = 512, R = 64; 16 heads per GPU at TP8, 128 without TP.
MLA_L, MLA_R = 512, 64
MLA_SCALE = 1.0 / (128 + 64) ** 0.5
MLA_BLOCK_SIZE = 64  # DeepSeek deployments' page size; whole pages per tile give the descriptor path on sm_90


def _mla_cache(platform: Platform, fp8: bool, num_blocks: int = 8, block_size: int = BLOCK_SIZE):
    dtype = fp8_dtype(platform) if fp8 else torch.bfloat16
    scale = dict(kv_scale=torch.tensor([0.5])) if fp8 else {}
    return in_large_allocation((num_blocks, block_size, MLA_L + MLA_R), dtype), scale


def _build_mla_decode(platform: Platform, *, num_heads: int, fp8_cache: bool, fp8_query: bool,
                      variant: str = "packed", block_size: int = MLA_BLOCK_SIZE) -> None:
    kv_cache, scale = _mla_cache(platform, fp8_cache, block_size=block_size)
    batch, context_blocks = 4, 256
    q = _rand(batch, num_heads, MLA_L + MLA_R, dtype=torch.bfloat16)
    if fp8_query:
        q = q.to(fp8_dtype(platform))
        scale["q_scale"] = torch.tensor([0.25])
    block_table = torch.zeros(batch, context_blocks, dtype=torch.int32)
    seq_lens = torch.full((batch,), context_blocks * block_size, dtype=torch.int32)
    mla_absorbed.mla_decode(q, kv_cache, block_table, seq_lens, kv_lora_rank=MLA_L, sm_scale=MLA_SCALE,
                   variant=variant, **scale)


def _build_mla_cache_write(platform: Platform, *, fp8: bool) -> None:
    kv_cache, scale = _mla_cache(platform, fp8)
    tokens = 24
    mla.concat_and_cache_mla(_rand(tokens, MLA_L, dtype=torch.bfloat16), _rand(tokens, MLA_R, dtype=torch.bfloat16),
                             kv_cache, torch.arange(BLOCK_SIZE, BLOCK_SIZE + tokens), **scale)


def _build_mla_gather(platform: Platform, *, fp8: bool) -> None:
    kv_cache, scale = _mla_cache(platform, fp8)
    lengths = [40, 24]
    out = torch.empty(sum(lengths), MLA_L + MLA_R, dtype=torch.bfloat16)
    mla.gather_mla_cache(kv_cache, torch.zeros(len(lengths), 8, dtype=torch.int32), _cu(lengths),
                         torch.zeros(len(lengths), dtype=torch.int32), kv_lora_rank=MLA_L, out=out, **scale)


def _build_mla_prep(platform: Platform, *, fp8: bool, rope: str, num_heads: int = 16) -> None:
    """The fused decode preparation: rotate, concat, fp8-quantise the query, write the cache row."""
    kv_cache, scale = _mla_cache(platform, fp8)
    tokens = 8
    out_dtype = fp8_dtype(platform) if fp8 else torch.bfloat16
    q_out = torch.empty(tokens, num_heads, MLA_L + MLA_R, dtype=out_dtype)
    positions, cos, sin = None, None, None
    if rope != "none":
        positions = torch.arange(tokens)
        cos, sin = (rotary.identity_rope_tables(MLA_R) if rope == "identity"
                    else rotary.rope_cos_sin(4096, MLA_R))
    mla.fused_qk_rope_concat_and_cache_mla(
        _rand(tokens, num_heads, MLA_L, dtype=torch.bfloat16), _rand(tokens, num_heads, MLA_R, dtype=torch.bfloat16),
        _rand(tokens, MLA_L, dtype=torch.bfloat16), _rand(tokens, MLA_R, dtype=torch.bfloat16), kv_cache, q_out,
        torch.arange(BLOCK_SIZE, BLOCK_SIZE + tokens), scale.get("kv_scale"),
        torch.tensor([0.25]) if fp8 else None, positions, cos, sin, is_neox=rope != "gptj")


def _build_mla_query_concat(platform: Platform, *, fp8: bool, num_heads: int = 16) -> None:
    tokens = 8
    q_out = torch.empty(tokens, num_heads, MLA_L + MLA_R, dtype=fp8_dtype(platform) if fp8 else torch.bfloat16)
    mla.concat_mla_query(_rand(tokens, num_heads, MLA_L, dtype=torch.bfloat16),
                         _rand(tokens, num_heads, MLA_R, dtype=torch.bfloat16), q_out,
                         q_scale=torch.tensor([0.25]) if fp8 else None)


def _build_rotary(platform: Platform, *, head_size: int, rotary_dim: int, is_neox: bool,
                  dtype: torch.dtype = torch.bfloat16) -> None:
    tokens = 8
    cos, sin = rotary.rope_cos_sin(4096, rotary_dim)
    rotary.rotary_embedding(torch.arange(tokens), _rand(tokens, NUM_HEADS, head_size, dtype=dtype),
                            _rand(tokens, NUM_KV_HEADS, head_size, dtype=dtype), torch.cat([cos, sin], 1),
                            is_neox=is_neox)


def _build_rms_norm(platform: Platform, *, size: int, residual: bool, dtype: torch.dtype = torch.bfloat16) -> None:
    x = _rand(8, size, dtype=dtype)
    norm.rms_norm(x, torch.ones(size, dtype=dtype), 1e-6, residual=_rand(8, size, dtype=dtype) if residual else None)


def _build_rms_norm_pair(platform: Platform, *, size_a: int, size_b: int) -> None:
    a, b = _rand(8, size_a + size_b, dtype=torch.bfloat16).split([size_a, size_b], dim=1)  # column ranges of one
    norm.rms_norm_pair(a, torch.ones(size_a, dtype=a.dtype), 1e-6, b, torch.ones(size_b, dtype=a.dtype), 1e-6)


def _build_rms_norm_rope_heads(platform: Platform, *, head_size: int, rotary_dim: int, is_neox: bool,
                               dtype: torch.dtype = torch.bfloat16) -> None:
    qkv = _rand(8, (NUM_HEADS + 2 * NUM_KV_HEADS) * head_size, dtype=dtype)
    qk = qkv[:, :(NUM_HEADS + NUM_KV_HEADS) * head_size].view(8, -1, head_size)
    weight = torch.ones(head_size, dtype=dtype)
    norm.rms_norm_rope_heads(qk, weight, 1e-6, torch.arange(8), rotary.rope_cos_sin(4096, rotary_dim),
                             is_neox=is_neox, second_weight=weight, second_from=NUM_HEADS)


def _build_advance_decodes(platform: Platform) -> None:
    from tripath.ops.kv_cache import advance_decodes

    n = 64
    advance_decodes(torch.arange(n), torch.ones(n, dtype=torch.int32), torch.ones(n, dtype=torch.int32),
                    torch.zeros(n, 8, dtype=torch.int32), torch.zeros(n, dtype=torch.int64), 16)


def _build_silu_and_mul(platform: Platform, *, inter: int, dtype: torch.dtype = torch.bfloat16) -> None:
    activation.silu_and_mul(_rand(8, 2 * inter, dtype=dtype))


def _s(name: str, build: Callable, ci: bool = False, targets: tuple[str, ...] | None = None, **kwargs) -> Scenario:
    return Scenario(name, functools.partial(build, **kwargs), ci, targets)


def _tag(dtype: torch.dtype, layout: str | None = None, fp8: bool = False) -> str:
    parts = [DTYPE_NAMES[dtype]]
    if fp8:
        parts.append("kv=fp8")
    if layout:
        parts.append(layout)
    return " ".join(parts)


def all_scenarios() -> list[Scenario]:
    """Every representative call, in report order. ``ci`` rows: each kernel in its main production
    configuration (bf16, head 128, fp8 and the shuffled layout where the kernel reads the cache, the
    MLA prefill's uneven 192/128 heads, gpt-oss-style window+sinks), so CI compiles every kernel for every
    target in a few minutes; the full set adds head sizes 64/256, fp16, both layouts x both cache dtypes,
    and the other score modifiers."""
    rows: list[Scenario] = []
    dtypes = (torch.bfloat16, torch.float16)
    heads = (64, 128, 256)
    layouts = ("nhd", "shuffled")

    for d in heads:
        for dt in dtypes:
            rows.append(_s(f"prefill hd{d} {_tag(dt)} causal", _build_varlen, ci=dt is torch.bfloat16 and d == 128,
                           head_size=d, dtype=dt, causal=True, lse=False))
            rows.append(_s(f"context chunk hd{d} {_tag(dt)} non-causal+lse", _build_varlen,
                           head_size=d, dtype=dt, causal=False, lse=True))
        for features in ("window+sinks", "window+softcap", "alibi"):
            rows.append(_s(f"prefill hd{d} bf16 causal+lse {features}", _build_varlen, head_size=d,
                           dtype=torch.bfloat16, causal=True, lse=True, features=features))
    for d in (64, 128):
        for dt in dtypes:
            rows.append(_s(f"long prefill hd{d} {_tag(dt)} causal (sm_90: Gluon)", _build_varlen,
                           ci=dt is torch.bfloat16 and d == 128, head_size=d, dtype=dt, causal=True, lse=False,
                           lengths=(48, 1100)))
        rows.append(_s(f"long context chunk hd{d} bf16 non-causal+lse (sm_90: Gluon)", _build_varlen, head_size=d,
                       dtype=torch.bfloat16, causal=False, lse=True, lengths=(48, 1100)))
    for d in (64, 128):  # 513 to 1024 keys: head-pair items against 128-key tiles
        rows.append(_s(f"prefill hd{d} bf16 causal, 1000 keys (sm_90: head pairs, 128-key tiles)", _build_varlen,
                       ci=d == 128, head_size=d, dtype=torch.bfloat16, causal=True, lse=False, lengths=(48, 1000)))
    for d in (64, 128):  # MHA, short requests: 128-row items against 64-key tiles
        rows.append(_s(f"prefill hd{d} bf16 causal, MHA (sm_90: 128-row items, 64-key tiles)", _build_varlen,
                       ci=d == 128, head_size=d, dtype=torch.bfloat16, causal=True, lse=False, num_heads=8,
                       num_kv_heads=8))
    rows.append(_s("prefill hd80 bf16 causal (padded head)", _build_varlen, head_size=80,
                   dtype=torch.bfloat16, causal=True, lse=False))
    for lengths, where in (((48, 80), ", sm_90: Gluon, 64-key tiles"), ((48, 1100), ", sm_90: Gluon")):
        rows.append(_s(f"MLA prefill 128+64/128 rotary part bf16 causal+lse{where}", _build_varlen, ci=True,
                       head_size=128, dtype=torch.bfloat16, causal=True, lse=True, num_heads=16, num_kv_heads=16,
                       lengths=lengths, rope=64))
    rows.append(_s("MLA prefill qk192/v128 bf16 causal+lse", _build_varlen, ci=True, head_size=192,
                   head_size_v=128, dtype=torch.bfloat16, causal=True, lse=True, num_heads=16, num_kv_heads=16))

    for d in heads:
        for dt in dtypes:
            for layout in layouts:
                for fp8 in (False, True):
                    ci = dt is torch.bfloat16 and d == 128 and not fp8 and layout == "nhd"
                    rows.append(_s(f"decode hd{d} {_tag(dt, layout, fp8)} splits=auto", _build_decode, ci=ci,
                                   head_size=d, dtype=dt, layout=layout, fp8=fp8, num_splits=None))
        rows.append(_s(f"decode hd{d} bf16 nhd one split", _build_decode, head_size=d, dtype=torch.bfloat16,
                       layout="nhd", fp8=False, num_splits=1))
    rows.append(_s("decode hd128 bf16 nhd 48 requests (NVIDIA: 128-token tiles)", _build_decode, head_size=128,
                   dtype=torch.bfloat16, layout="nhd", fp8=False, num_splits=None, batch=48))
    for features in ("window+sinks", "window+softcap", "alibi"):
        rows.append(_s(f"decode hd128 bf16 kv=fp8 shuffled {features}", _build_decode,
                       ci=features == "window+sinks", head_size=128, dtype=torch.bfloat16, layout="shuffled",
                       fp8=True, num_splits=None, features=features))

    for d in heads:
        for dt in dtypes:
            for layout in layouts:
                for fp8 in (False, True):
                    ci = dt is torch.bfloat16 and d == 128 and fp8 and layout == "shuffled"
                    rows.append(_s(f"unified hd{d} {_tag(dt, layout, fp8)}", _build_unified, ci=ci,
                                   head_size=d, dtype=dt, layout=layout, fp8=fp8))
    for features in ("window+sinks", "window+softcap", "alibi"):
        rows.append(_s(f"unified hd128 bf16 nhd {features}", _build_unified, head_size=128,
                       dtype=torch.bfloat16, layout="nhd", fp8=False, features=features))

    for d in heads:
        for layout, fp8 in (("nhd", False), ("shuffled", True)):
            rows.append(_s(f"verify hd{d} {_tag(torch.bfloat16, layout, fp8)}", _build_verify,
                           ci=d == 128 and not fp8, head_size=d, dtype=torch.bfloat16, layout=layout, fp8=fp8))
    for features in ("window+sinks", "window+softcap", "alibi"):
        rows.append(_s(f"verify hd128 bf16 nhd {features}", _build_verify, head_size=128, dtype=torch.bfloat16,
                       layout="nhd", fp8=False, features=features))
    rows.append(_s("verify hd128 bf16 nhd draft trees", _build_verify, head_size=128, dtype=torch.bfloat16,
                   layout="nhd", fp8=False, tree=True))
    rows.append(_s("verify hd128 fp16 nhd 16 tokens x 8 heads (two tiles a request)", _build_verify,
                   head_size=128, dtype=torch.float16, layout="nhd", fp8=False, query_lens=(16, 9),
                   num_kv_heads=1, num_heads=8))

    for d in heads:
        for dt in dtypes:
            rows.append(_s(f"merge hd{d} {_tag(dt)}", _build_merge, ci=d == 128 and dt is torch.bfloat16,
                           head_size=d, dtype=dt))

    for build, what in ((_build_write, "write"), (_build_gather, "gather")):
        for d in heads:
            for layout in layouts:
                for fp8 in (False, True):
                    ci = d == 128 and fp8 and layout == "shuffled"
                    rows.append(_s(f"kv {what} hd{d} {_tag(torch.bfloat16, layout, fp8)}", build, ci=ci,
                                   head_size=d, dtype=torch.bfloat16, layout=layout, fp8=fp8))
        rows.append(_s(f"kv {what} hd128 {_tag(torch.float16, 'nhd')}", build, head_size=128,
                       dtype=torch.float16, layout="nhd", fp8=False))

    for heads_ in (16, 128):
        for fp8_cache, fp8_query in ((False, False), (True, False), (True, True)):
            kv = "fp8 q+kv" if fp8_query else ("kv=fp8" if fp8_cache else "bf16")
            rows.append(_s(f"MLA decode packed H={heads_} {kv}", _build_mla_decode,
                           ci=(heads_, fp8_cache, fp8_query) in ((16, True, False), (128, True, True)),
                           num_heads=heads_, fp8_cache=fp8_cache, fp8_query=fp8_query))
        rows.append(_s(f"MLA decode packed H={heads_} bf16 block 16", _build_mla_decode, num_heads=heads_,
                       fp8_cache=False, fp8_query=False, block_size=16))
    rows.append(_s("MLA decode gluon H=128 bf16 (sm_90)", _build_mla_decode, ci=True,
                   targets=("sm90",), num_heads=128, fp8_cache=False, fp8_query=False, variant="gluon"))
    rows.append(_s("MLA decode gluon H=16 bf16 (sm_90, few heads)", _build_mla_decode,
                   ci=True, targets=("sm90",), num_heads=16, fp8_cache=False, fp8_query=False, variant="gluon"))
    rows.append(_s("MLA decode gluon H=16 bf16 block 16 (sm_90, few heads, 4 pages a tile)", _build_mla_decode,
                   ci=True, targets=("sm90",), num_heads=16, fp8_cache=False, fp8_query=False, variant="gluon",
                   block_size=16))
    for fp8 in (False, True):
        tag = "kv=fp8" if fp8 else "bf16"
        rows.append(_s(f"MLA cache write {tag}", _build_mla_cache_write, ci=fp8, fp8=fp8))
        rows.append(_s(f"MLA cache gather {tag}", _build_mla_gather, ci=fp8, fp8=fp8))
        rows.append(_s(f"MLA query concat {tag}", _build_mla_query_concat, fp8=fp8))
    for rope in ("neox", "gptj", "identity", "none"):
        rows.append(_s(f"MLA fused prep fp8 rope={rope}", _build_mla_prep, ci=rope == "neox", fp8=True, rope=rope))
    rows.append(_s("MLA fused prep bf16 rope=neox H=128", _build_mla_prep, fp8=False, rope="neox", num_heads=128))
    for head_size, rotary_dim, is_neox in ((128, 128, True), (128, 64, False), (64, 64, True)):
        rows.append(_s(f"rotary hd{head_size} R={rotary_dim} {'neox' if is_neox else 'gptj'}", _build_rotary,
                       ci=head_size == 128 and is_neox, head_size=head_size, rotary_dim=rotary_dim,
                       is_neox=is_neox))
    for size, residual in ((4096, True), (4096, False), (128, False), (512, False), (8192, True)):
        rows.append(_s(f"RMSNorm {size}{' + residual' if residual else ''} bf16", _build_rms_norm,
                       ci=size == 4096 and residual, size=size, residual=residual))
    rows.append(_s("RMSNorm pair 1536 + 512 bf16 (MLA)", _build_rms_norm_pair, ci=True, size_a=1536, size_b=512))
    for head_size, rotary_dim, is_neox in ((128, 128, True), (96, 32, False)):
        rows.append(_s(f"RMSNorm + rotary of q and k heads hd{head_size} R={rotary_dim} "
                       f"{'neox' if is_neox else 'gptj'} bf16", _build_rms_norm_rope_heads, ci=is_neox,
                       head_size=head_size, rotary_dim=rotary_dim, is_neox=is_neox))
    rows.append(_s("multi-step decoding: metadata advance", _build_advance_decodes, ci=True))
    rows += [_s(f"silu_and_mul I={i} bf16", _build_silu_and_mul, ci=i == 14336, inter=i) for i in (14336, 1536)]
    rows += [_s(name, build, ci, **kw) for name, build, ci, kw in compile_scenarios_mixed.rows(_cache, _features)]
    rows += [_s(name, build, ci, **kw) for name, build, ci, kw in compile_scenarios_mla_verify.rows(_mla_cache)]
    rows += [_s(name, build, ci, **kw) for module in (sampling, gemm) for name, build, ci, kw in module.rows()]
    return rows
