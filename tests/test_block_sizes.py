"""KV block sizes as a backend capability: the sizes a backend takes (``Capabilities.block_sizes``; a spec
with another is refused, naming ``block_size`` and the supported values) and the one it prefers per device,
which the engine builds its spec with when it is given none."""

import dataclasses

import pytest
import torch

from engine_models import tiny_model
from tripath.attention import AttentionSpec, MLASpec, default_block_size, explain, select_backend
from tripath.attention.backends.base import Capabilities
from tripath.attention.backends.mla_common import MLABackendBase
from tripath.attention.backends.three_path import ThreePathBackend
from tripath.attention.selector import BACKENDS, backend_class, candidates
from tripath.engine import LLM

SUPPORTED = "1, 2, 4, 8, 16, 32, 64, 128, 256"
MLA = MLASpec(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)


def _with(monkeypatch, cls, **changes):
    monkeypatch.setattr(cls, "capabilities", dataclasses.replace(cls.capabilities, **changes))


@pytest.mark.cpu
def test_the_default_comes_from_the_backends_declaration(monkeypatch):
    assert default_block_size("three_path", False, "cpu") == 16
    _with(monkeypatch, ThreePathBackend, cpu_block_size=32)
    assert default_block_size("three_path", False, "cpu") == 32
    assert default_block_size("auto", False, "cpu") == 32  # auto: its first candidate for MHA/GQA
    assert default_block_size("unified", False, "cpu") == 16
    llm = LLM(tiny_model(), backend="three_path", num_kv_blocks=8)
    assert llm.runner.block_size == llm.runner.spec.block_size == 32 and llm.runner.backend.name == "three_path"
    assert LLM(tiny_model(), backend="three_path", num_kv_blocks=8, block_size=8).runner.spec.block_size == 8


def test_mla_preference_and_the_reference_that_stands_in_for_it(monkeypatch):
    for name in ("auto", "mla", "mla_triton", "torch"):
        assert default_block_size(name, True, "cuda") == 64 and default_block_size(name, True, "cpu") == 16
    assert default_block_size("torch", False, "cuda") == 16
    _with(monkeypatch, MLABackendBase, gpu_block_size=32)
    assert default_block_size("torch", True, "cuda") == 32  # the MLA backends' preference, not a copy of it
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        default_block_size("fast", False, "cpu")
    monkeypatch.setenv("TRIPATH_ATTENTION_BACKEND", "torch")  # the override selects, so it also chooses
    _with(monkeypatch, backend_class("torch"), cpu_block_size=8)
    assert default_block_size("auto", False, "cpu") == 8


@pytest.mark.parametrize("is_mla", [False, True])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_auto_candidate_takes_the_auto_default(is_mla, device):
    size = default_block_size("auto", is_mla, device)
    for name in candidates("auto", is_mla):
        assert size in backend_class(name).capabilities.block_sizes, name


def test_a_block_size_a_backend_cannot_take_is_refused():
    mha = AttentionSpec(4, 2, 32, dtype=torch.float16, block_size=24)
    mla = AttentionSpec(4, 1, MLA.cache_width, dtype=torch.float16, block_size=24, mla=MLA)
    why = f"block_size=24 is not supported (supported: {SUPPORTED})"
    for spec in (mha, mla):
        reasons = explain(spec, "cpu")
        assert all(why in reasons[name] for name in BACKENDS), reasons
    with pytest.raises(ValueError, match=rf"three_path: block_size=24 is not supported \(supported: {SUPPORTED}\)"):
        select_backend(mha, "three_path", "cpu")
    with pytest.raises(ValueError, match=r"mla: block_size=24 is not supported[^\n]*\n  mla_triton: block_size=24"):
        select_backend(mla, "auto", "cpu")
    with pytest.raises(ValueError, match=r"torch: block_size=24 is not supported"):
        LLM(tiny_model(), backend="torch", num_kv_blocks=8, block_size=24)
    with pytest.raises(ValueError, match=r"block_size=24 is not supported"):
        LLM("tiny-deepseek", backend="auto", num_kv_blocks=8, block_size=24)


@pytest.mark.cpu
def test_the_shuffled_layout_is_refused_at_selection_where_its_vectors_do_not_fit():
    """x = 16 bytes / element: 8 for a 16-bit cache, 16 for fp8; block and head sizes must be multiples."""
    assert select_backend(AttentionSpec(4, 2, 32, dtype=torch.float16, block_size=8, kv_layout="shuffled"),
                          "three_path", "cpu").name == "three_path"
    small = AttentionSpec(4, 2, 32, dtype=torch.float16, block_size=4, kv_layout="shuffled")
    with pytest.raises(ValueError, match=r"three_path: kv_layout 'shuffled' with a float16 cache needs "
                                         r"block_size a multiple of 8, got 4"):
        select_backend(small, "three_path", "cpu")
    fp8 = AttentionSpec(4, 2, 32, dtype=torch.float16, block_size=8, kv_layout="shuffled", kv_cache_dtype="fp8")
    assert "kv_layout 'shuffled' with a fp8 cache needs block_size a multiple of 16, got 8" in \
        explain(fp8, "cpu")["unified"]
    with pytest.raises(ValueError, match="needs block_size a multiple of 8"):
        LLM(tiny_model(), backend="three_path", num_kv_blocks=8, block_size=4, kv_layout="shuffled", warmup=False,
            dtype=torch.float16)


@pytest.mark.cpu
def test_selection_follows_a_narrower_declaration(monkeypatch):
    _with(monkeypatch, ThreePathBackend, block_sizes=(16, 32))
    spec = AttentionSpec(4, 2, 32, dtype=torch.float16, block_size=64)
    backend = select_backend(spec, "auto", "cpu")
    assert backend.name == "unified"
    assert backend.rejected == {"three_path": ["block_size=64 is not supported (supported: 16, 32)"]}
    with pytest.raises(ValueError, match=r"backend 'three_path' cannot serve this spec: block_size=64 is not "
                                         r"supported \(supported: 16, 32\)"):
        ThreePathBackend(spec, "cpu")


def test_a_preference_must_be_a_supported_size():
    with pytest.raises(ValueError, match=r"Capabilities.gpu_block_size=64 is not one of block_sizes \(16, 32\)"):
        Capabilities(block_sizes=(16, 32), gpu_block_size=64)
