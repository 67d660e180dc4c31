"""The step metadata validator (``tripath.attention.validate``, run by ``ForwardContext`` under
``TRIPATH_VALIDATE=1``), and that a NaN in one request's K/V never reaches another request's output."""

import math

import pytest
import torch

from engine_models import tiny_model
from tripath.attention import AttentionSpec, ForwardContext, select_backend
from tripath.attention import context as context_module
from tripath.attention.validate import MetadataError
from tripath.engine import LLM, SamplingParams

BLOCK = 16


@pytest.fixture(autouse=True)
def _validate_every_step(monkeypatch):
    monkeypatch.setenv("TRIPATH_VALIDATE", "1")


def _backend(name="torch", kv_cache_dtype="auto", dtype=torch.float16):
    spec = AttentionSpec(4, 2, 32, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=BLOCK)
    return select_backend(spec, name, "cpu")


def _step(backend, query_lens, context_lens, rows):
    """Metadata of a step whose request ``i`` owns the blocks ``rows[i]`` (given in request order)."""
    plan = backend.plan(query_lens, context_lens)
    order = list(plan.order)
    width = max(len(r) for r in rows)
    table = torch.zeros(len(rows), width, dtype=torch.int32)
    slots = []
    for row, i in enumerate(order):
        table[row, :len(rows[i])] = torch.tensor(rows[i], dtype=torch.int32)
        pos = torch.arange(context_lens[i], context_lens[i] + query_lens[i])
        inside = pos // BLOCK < width  # positions past the row get no slot (-1)
        slot = table[row, (pos // BLOCK).clamp(max=width - 1)].long() * BLOCK + pos % BLOCK
        slots.append(torch.where(inside, slot, -1))
    return plan, backend.build_metadata(plan, table, torch.cat(slots)), order


def test_good_metadata_passes_and_bad_metadata_is_named():
    backend = _backend()
    caches = [backend.allocate_cache(6) for _ in range(2)]
    _, meta, _ = _step(backend, [5, 1, 20], [0, 17, 3], [[1], [2, 3], [4, 5]])
    ForwardContext(backend, meta, caches)  # the engine's way of building it: valid

    _, meta, _ = _step(backend, [5, 1, 20], [0, 17, 3], [[1], [2, 3], [4, 5]])
    meta.slot_mapping[0] += 1  # a token written where its block table does not say
    with pytest.raises(MetadataError, match=r"metadata.slot_mapping\[0\] is .* lives at slot"):
        ForwardContext(backend, meta, caches)
    _, meta, _ = _step(backend, [5, 1, 20], [0, 17, 3], [[1], [2, 6], [4, 5]])  # block 6 of a 6-block cache
    with pytest.raises(MetadataError, match=r"metadata.block_table row \d reads block \[6\] outside \[0, num_blocks=6\)"):
        ForwardContext(backend, meta, caches)
    _, meta, _ = _step(backend, [5, 1, 40], [0, 17, 3], [[1], [2, 3], [4, 5]])  # 43 tokens in two blocks
    with pytest.raises(MetadataError, match=r"metadata.seq_lens\[\d\] \(43\) needs 3 blocks; block_table rows hold 2"):
        ForwardContext(backend, meta, caches)
    _, meta, _ = _step(backend, [5, 1, 20], [0, 17, 3], [[1], [2, 3], [4, 5]])
    meta.seq_lens[0] = 99
    with pytest.raises(MetadataError, match=r"metadata.seq_lens is \[99, "):
        ForwardContext(backend, meta, caches)
    with pytest.raises(MetadataError, match=r"caches differ in \(num_blocks, block_size\)"):
        ForwardContext(backend, meta, [caches[0], backend.allocate_cache(7)])
    ForwardContext(backend, meta, caches, validate=False)  # off: nothing read back


def test_validation_is_off_by_default(monkeypatch):
    monkeypatch.delenv("TRIPATH_VALIDATE")
    backend = _backend()
    _, meta, _ = _step(backend, [5], [0], [[1]])
    meta.slot_mapping[0] += 1
    ForwardContext(backend, meta, [backend.allocate_cache(4)])
    with pytest.raises(MetadataError, match=r"metadata.slot_mapping\[0\]"):
        ForwardContext(backend, meta, [backend.allocate_cache(4)], validate=True)


@pytest.mark.cpu
def test_every_engine_step_goes_through_the_validator(monkeypatch):
    calls = []
    real = context_module.validate_metadata

    def counting(meta, num_blocks, block_size):
        calls.append((meta.num_tokens, num_blocks, block_size))
        return real(meta, num_blocks, block_size)

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch paths: this checks the wiring, not the kernels
    monkeypatch.setattr(context_module, "validate_metadata", counting)
    llm = LLM(tiny_model(), backend="torch", num_kv_blocks=12, block_size=8, max_num_batched_tokens=16)
    llm.generate([[1, 2, 3] * 7, [4, 5]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    assert len(calls) == llm.num_steps > 2 and all(c[1:] == (12, 8) for c in calls)


@pytest.mark.cpu
@pytest.mark.parametrize("name,kv_cache_dtype", [("torch", "auto"), ("three_path", "auto"), ("unified", "auto"),
                                                 ("two_path", "auto"), ("three_path", "fp8")])
def test_nan_in_one_request_stays_in_it(name, kv_cache_dtype):
    """Request 0's keys hold a NaN (so its own outputs are NaN); request 1, prefilled and decoded in the same
    steps from blocks of the same cache, gets exactly the outputs of a run where request 0 is clean."""
    gen = torch.Generator().manual_seed(7)
    lens = [9, 21]
    total = sum(lens) + 2
    q, k, v = (torch.randn(total, h, 32, generator=gen).half() for h in (4, 2, 2))

    def run(poison: bool):
        backend = _backend(name, kv_cache_dtype)
        cache = backend.allocate_cache(8)
        kk = k.clone()
        if poison:
            kk[3, 1, 5] = math.nan  # request 0's fourth key
        rows = [[5], [2, 7]]
        outs = {}
        # step 1: both prefill; step 2: both decode one token. Tokens of request i: rows of q/k/v.
        starts = {0: 0, 1: lens[0]}
        extra = {0: sum(lens), 1: sum(lens) + 1}
        for query_lens, context_lens, picks in (
                (lens, [0, 0], {i: list(range(starts[i], starts[i] + lens[i])) for i in (0, 1)}),
                ([1, 1], lens, {i: [extra[i]] for i in (0, 1)})):
            _, meta, order = _step(backend, query_lens, context_lens, rows)
            index = torch.tensor([t for i in order for t in picks[i]])
            out = ForwardContext(backend, meta, [cache]).attend(0, q[index], kk[index], v[index])
            at = 0
            for i in order:
                outs.setdefault(i, []).append(out[at:at + len(picks[i])].float())
                at += len(picks[i])
        return {i: torch.cat(o) for i, o in outs.items()}

    clean, poisoned = run(False), run(True)
    assert poisoned[0].isnan().any() and not clean[0].isnan().any()
    assert not poisoned[1].isnan().any()
    assert torch.equal(poisoned[1], clean[1])
