"""The engine's warm-up: its probes predict every kernel variant a workload launches, launch keys ignore the
step-varying arguments, the saved plan round-trips, and (GPU) nothing compiles after the engine started."""

import dataclasses
import os
import json
import random

import pytest
import torch

from tripath.attention import default_block_size
from tripath.engine import LLM, SamplingParams
from tripath.engine.runner.warmup import (WarmupLimits, levels, saved_plan_path, warm_up, warmup_shapes)
from tripath.models import PRESETS, build_model, init_random_weights
from tripath.triton_internals import capture_launches, launch_key
from tripath.platform import H200, override_platform

from conftest import DEVICE, HAS_GPU


def shrunk(preset: str, dtype=torch.bfloat16, device="cpu", num_layers: int = 1):
    """A preset's attention (heads, head sizes, MLA dims) with a small hidden size, vocabulary and depth."""
    config = PRESETS[preset]()
    config = dataclasses.replace(config, hidden_size=256, intermediate_size=64, vocab_size=512,
                                 num_layers=num_layers, **({"q_lora_rank": 64} if config.mla else {}))
    model = build_model(config, dtype=dtype, device=device)
    init_random_weights(model)
    model.post_load()
    return model


def random_workload(rng: random.Random, max_len: int, max_requests: int) -> list[list[int]]:
    """Prompts of mixed lengths; half the time they share a prefix (prefix hits make extends)."""
    prompts = [[rng.randrange(2, 500) for _ in range(rng.randrange(1, max_len // 2))]
               for _ in range(rng.randrange(1, 3 * max_requests))]
    if rng.random() < 0.5:
        prefix = [rng.randrange(2, 500) for _ in range(rng.randrange(16, max_len // 4))]
        prompts = [(prefix + p)[:max_len // 2] for p in prompts]
    return prompts


CASES = [("qwen3-235b-attn-tp8", "three_path", "auto"), ("qwen3-235b-attn-tp8", "two_path", "auto"),
         ("qwen3-235b-attn-tp8", "mixed", "auto"),
         ("qwen3-235b-attn-tp8", "unified", "fp8"), ("qwen3-235b-attn-tp8", "three_path", "fp8"),
         ("deepseek-r1-attn-tp8", "mla", "auto")]


@pytest.mark.parametrize("preset,backend,kv_cache_dtype", CASES)
def test_warmup_predicts_every_variant(preset, backend, kv_cache_dtype):
    """On the H200's launch configurations (chosen on the host, launches captured, nothing runs), the
    warm-up's probes give every variant that random workloads — decodes, chunked prefills, prefix hits —
    then launch."""
    mla = PRESETS[preset]().mla is not None
    limits = dict(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=512) if mla else \
        dict(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024)
    block_size = default_block_size(backend, mla, "cuda")  # the engine's on the GPU
    llm = LLM(shrunk(preset), backend=backend, device="cpu", block_size=block_size, num_kv_blocks=512,
              kv_cache_dtype=kv_cache_dtype, **limits)
    with override_platform(H200):
        report = warm_up(llm.runner, run_kernels=False)
    assert report.variants and report.steps_run == 0
    rng = random.Random(hash((preset, backend, kv_cache_dtype)) % 1000)
    seen = set()
    for _ in range(2):
        prompts = random_workload(rng, limits["max_model_len"], limits["max_num_seqs"])
        params = SamplingParams(max_tokens=rng.randrange(2, 8), temperature=0, ignore_eos=True)
        with override_platform(H200), capture_launches() as records:
            llm.generate(prompts, params, use_tqdm=False)
        seen |= {launch_key(r) for r in records}
    missing = seen - report.variants
    assert not missing, f"{len(missing)} variants the warm-up did not predict: {sorted(k[0] for k in missing)}"


@pytest.mark.parametrize("preset, backend, kernel, flag", [
    ("qwen3-235b-attn-tp8", "three_path", "paged_verify_kernel", "TREE"),
    ("deepseek-r1-attn-tp8", "mla", "mla_decode_sm90_kernel", "TREE"),   # the Gluon verify (sm_90, 512 + 64)
])
def test_warmup_predicts_the_draft_tree_variants(preset, backend, kernel, flag):
    """Speculative decoding with draft trees (n-gram, ``tree_width`` 2): the warm-up probes each verify step
    once more with a tree mask, so the variants a step with a tree launches (the verify kernels' tree
    variants) are among the predicted ones, beside the chains' variants."""
    mla = PRESETS[preset]().mla is not None
    limits = dict(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=512)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "tree_width": 2}
    llm = LLM(shrunk(preset, dtype=torch.float16), backend=backend, device="cpu",
              block_size=default_block_size(backend, mla, "cuda"), num_kv_blocks=256, speculative_config=spec,
              **limits)
    with override_platform(H200):
        report = warm_up(llm.runner, run_kernels=False)
    g = torch.Generator().manual_seed(5)
    a, b, c = (torch.randint(2, 500, (n,), generator=g).tolist() for n in (2, 5, 5))
    prompts = [a + b + a + c + a + b + a + c + a, torch.randint(2, 500, (9,), generator=g).tolist() * 3]
    with override_platform(H200), capture_launches() as records:
        llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    seen = {launch_key(r) for r in records}
    trees = {key for key in seen if key[0] == kernel and _constexpr(kernel, key, flag) == "True"}
    assert trees, "no step drafted a tree: the workload does not exercise the tree variant"
    missing = seen - report.variants
    assert not missing, f"{len(missing)} variants the warm-up did not predict: {sorted(k[0] for k in missing)}"


def _constexpr(kernel: str, key: tuple, name: str) -> str:
    """The value a launch ``key`` (:func:`launch_key`) of ``kernel`` gives its constexpr ``name``."""
    from tripath.kernels import mla_decode_sm90, mla_verify, paged_verify

    fn = {"paged_verify_kernel": paged_verify.paged_verify_kernel, "mla_verify_kernel": mla_verify.mla_verify_kernel,
          "mla_decode_sm90_kernel": mla_decode_sm90.mla_decode_sm90_kernel}
    return key[1][list(fn[kernel].arg_names).index(name)]


def test_launch_key_ignores_step_varying_arguments():
    """Two launches that differ only in per-step values (request count, block-table width, the offset of a
    metadata slice) share a key; a change of a constexpr or of a model constant does not."""
    from tripath.ops import gather_kv_cache

    def key(num_seqs, width, offset, head_size=64, num_kv_heads=2):
        cache = torch.randn(8, 16, num_kv_heads, head_size, dtype=torch.float16)
        packed = torch.zeros(64, dtype=torch.int32)  # cu_seqlens and seq_starts sliced out of one buffer
        packed[offset:offset + num_seqs + 1] = torch.arange(num_seqs + 1)  # one token each, from position 0
        table = torch.ones(num_seqs, width, dtype=torch.int32)
        out = torch.empty(64, num_kv_heads, head_size, dtype=torch.float16)
        with capture_launches() as records:
            gather_kv_cache(cache, cache, table, packed[offset:offset + num_seqs + 1],
                            packed[offset + 16:offset + 16 + num_seqs], out_k=out, out_v=out)
        (record,) = records
        return launch_key(record)

    base = key(1, 16, 0)
    assert key(7, 33, 3) == base
    assert key(15, 1, 5) == base
    assert key(1, 16, 0, head_size=128) != base
    assert key(1, 16, 0, num_kv_heads=1) != base  # a model constant: Triton specialises a 1


def test_warmup_shapes_stay_within_limits():
    limits = WarmupLimits(max_num_seqs=24, max_num_batched_tokens=300, max_model_len=700)
    shapes = warmup_shapes(limits)
    kinds = set()
    for query_lens, context_lens in shapes:
        assert 1 <= len(query_lens) <= limits.max_num_seqs
        assert sum(query_lens) <= limits.max_num_batched_tokens
        assert all(q >= 1 and c >= 0 and q + c <= limits.max_model_len for q, c in zip(query_lens, context_lens))
        kinds.add(frozenset("p" if c == 0 else "d" if q == 1 else "e" for q, c in zip(query_lens, context_lens)))
    assert {frozenset("d"), frozenset("p"), frozenset("e"), frozenset("dep")} <= kinds
    assert levels(100)[:8] == list(range(1, 9)) and levels(100)[-1] == 100


def test_warmup_probes_verifies_when_decodes_take_several_tokens():
    """Speculative decoding (decode_threshold 1 + drafts): decode steps of that many tokens at every batch and
    context level, alone and mixed; none without it."""
    limits = WarmupLimits(max_num_seqs=24, max_num_batched_tokens=300, max_model_len=700, decode_threshold=5)
    verifies = [(q, c) for q, c in warmup_shapes(limits) if all(x == 5 for x in q) and c[0] > 0]
    assert {len(q) for q, _ in verifies} == set(levels(24)) and {c[0] for _, c in verifies} == set(levels(695))
    assert any(5 in q and 0 in c for q, c in warmup_shapes(limits))   # a verify beside a prefill
    plain = WarmupLimits(max_num_seqs=24, max_num_batched_tokens=300, max_model_len=700)
    assert not any(all(x == 5 for x in q) and c[0] > 0 for q, c in warmup_shapes(plain))
    trees = warmup_shapes(dataclasses.replace(limits, draft_trees=True))   # each step with verifies, as trees too
    with_verifies = [(q, c) for q, c in warmup_shapes(limits) if any(1 < x <= 5 for x in q)]  # short chunks too
    assert [(q, c) for q, c, *tree in trees if tree == [True]] == with_verifies and len(trees) == \
        len(warmup_shapes(limits)) + len(with_verifies)


def test_saved_plan_is_keyed_and_reused(tmp_path, monkeypatch):
    """The plan lives under TRITON_CACHE_DIR, changes with the limits, and a second warm-up runs the saved
    steps without probing (same steps, same count of variants)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    llm = LLM("tiny-llama", device=DEVICE, backend="three_path", max_num_seqs=2, max_num_batched_tokens=16,
              max_model_len=32, num_kv_blocks=16)
    path = saved_plan_path(llm.runner)
    assert str(path).startswith(str(tmp_path))
    first = warm_up(llm.runner)
    assert path.is_file() and first.steps_run == len(json.loads(path.read_text())["steps"]) > 0
    again = warm_up(llm.runner)
    assert again.steps_run == first.steps_run and len(again.variants) == len(first.variants)
    other = LLM("tiny-llama", device=DEVICE, backend="three_path", max_num_seqs=3, max_num_batched_tokens=16,
                max_model_len=32, num_kv_blocks=16)
    assert saved_plan_path(other.runner) != path
    path.write_text("not json")
    assert warm_up(llm.runner).steps_run == first.steps_run  # an unreadable plan is probed again


@pytest.mark.gpu
@pytest.mark.parametrize("preset,backend,kv_cache_dtype", CASES + [("deepseek-r1-attn-tp8", "mla_triton", "auto")])
def test_no_compilation_after_engine_start(preset, backend, kv_cache_dtype):
    """After ``LLM(...)`` returns, pure decodes, mixed steps, long chunked prefills (extends on long contexts),
    prefix hits and fp8 caches compile nothing."""
    assert HAS_GPU
    llm = LLM(shrunk(preset, device=DEVICE, num_layers=2), backend=backend, kv_cache_dtype=kv_cache_dtype,
              max_num_seqs=32, max_num_batched_tokens=1024, max_model_len=8192)
    rng = random.Random(0)
    for max_len, requests in ((8192, 4), (2048, 32), (512, 32)):
        prompts = random_workload(rng, max_len, requests)
        llm.generate(prompts, SamplingParams(max_tokens=rng.randrange(2, 24), temperature=0, ignore_eos=True),
                     use_tqdm=False)
    long_prompt = [rng.randrange(2, 500) for _ in range(6000)]
    llm.generate([long_prompt, long_prompt[:3000] + [7] * 100], SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    assert llm.num_compiled_since_start == 0


def forget_compiled_kernels() -> None:
    """Empty the in-memory kernel caches of every tripath kernel (the disk cache stays)."""
    import sys
    from triton.runtime.jit import JITFunction

    for name, module in list(sys.modules.items()):
        if name.startswith("tripath.kernels.") and module is not None:
            for obj in vars(module).values():
                if isinstance(obj, JITFunction):
                    obj.device_caches.clear()


@pytest.mark.gpu
def test_compilations_made_ahead_are_the_ones_the_warm_up_loads(tmp_path, monkeypatch):
    """With an empty Triton cache the warm-up's compilations and their launch stubs are made by child
    processes, and its real run then finds every one of them in the cache: it adds no entry of its own."""
    assert HAS_GPU
    from tripath.triton_internals import CompilePool

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    entries = {}

    class CountingPool(CompilePool):
        def compile(self, compilations):
            report = super().compile(compilations)
            entries["after_pool"] = set(os.listdir(tmp_path))
            return report

    llm = LLM(shrunk("qwen3-235b-attn-tp8", device=DEVICE, num_layers=2), backend="three_path",
              max_num_seqs=16, max_num_batched_tokens=512, max_model_len=2048, warmup=False, enforce_eager=True)
    forget_compiled_kernels()  # as in a new process: earlier tests compiled these variants already
    with CountingPool(4) as pool:
        report = warm_up(llm.runner, pool=pool)
    assert report.pool is not None and report.pool.workers == 4 and not report.pool.failed
    assert report.pool.compiled > 0 and report.pool.launchers == report.pool.compiled
    made_here = set(os.listdir(tmp_path)) - entries["after_pool"] - {"tripath-warmup"}
    assert not made_here, [os.listdir(tmp_path / name) for name in made_here]  # kernels or launch stubs
    with CompilePool(2) as pool:
        assert warm_up(llm.runner, pool=pool).pool is None  # the saved plan: the cache is warm
