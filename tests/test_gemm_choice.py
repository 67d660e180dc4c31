"""Each projection's GEMM (models/linear.py, engine/runner/gemm_choice.py): the lookup by weight shape and
bucket of rows, the model's projections, the start's settings, and the engine's outputs with the split-K
kernel forced on equal to F.linear's on the tiny architectures (the kernel under the interpreter)."""

from types import SimpleNamespace

import pytest
import torch

from tripath.engine import LLM, SamplingParams
from tripath.engine.runner import gemm_choice
from tripath.engine.runner.gemm_choice import projection_weights, row_buckets
from tripath.models import linear as linear_module
from tripath.models import load_model
from tripath.models.linear import GEMM_CHOICES, GemmChoices, linear

PROMPTS = [[5, 9, 2, 7, 1, 3], [4, 4, 8], [11, 3, 6, 2]]


@pytest.fixture(autouse=True)
def no_choices_left():
    yield
    GEMM_CHOICES.clear()


def test_a_call_takes_the_smallest_bucket_at_least_its_rows(monkeypatch):
    w, other = torch.randn(24, 16), torch.randn(24, 17)
    choices = GemmChoices()
    choices.set(w, {4: True, 16: False, 32: True})
    assert [choices.skinny(w, m) for m in (1, 4, 5, 16, 17, 32, 33)] == [True, True, False, False, True, True, False]
    assert not choices.skinny(other, 1) and not choices.skinny(w.half(), 1)   # another shape or dtype
    assert choices.summary() == ["24x16 float32: split-K at rows <= 4, 32"]
    with pytest.raises(ValueError, match="row buckets must be 1..256"):
        choices.set(w, {512: True})
    calls = []
    monkeypatch.setattr(linear_module, "skinny_gemm", lambda x, w, b: calls.append(x.shape[0]) or x @ w.T)
    GEMM_CHOICES.set(w, {4: True})
    for rows in (3, 9):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(linear(x, w), x @ w.T)
    assert calls == [3]


def test_the_projections_are_the_stacked_weights_and_the_linears_not_the_lm_head():
    model = load_model("tiny-llama", dtype=torch.float32)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    shapes = sorted(tuple(w.shape) for w, _ in projection_weights(model))
    assert shapes == sorted({tuple(attn.qkv_weight.shape), tuple(attn.o_proj.weight.shape),
                             tuple(mlp.gate_up_weight.shape), tuple(mlp.down_proj.weight.shape)})
    assert all(w.data_ptr() != model.lm_head.weight.data_ptr() for w, _ in projection_weights(model))
    assert row_buckets(8192) == [1, 2, 4, 8, 16, 32, 64, 128, 256] and row_buckets(48) == [1, 2, 4, 8, 16, 32, 48]


def test_the_settings_fill_the_table():
    model = load_model("tiny-qwen3", dtype=torch.float32)
    runner = SimpleNamespace(model=model, device=torch.device("cpu"),
                             config=SimpleNamespace(skinny_gemm="on", max_num_batched_tokens=8))
    weights = [w for w, _ in projection_weights(model)]
    assert gemm_choice.measure(runner) == []
    assert all(GEMM_CHOICES.skinny(w, 8) and not GEMM_CHOICES.skinny(w, 9) for w in weights)
    for mode in ("off", "auto"):   # auto measures on a GPU only
        runner.config.skinny_gemm = mode
        gemm_choice.measure(runner)
        assert not any(GEMM_CHOICES.skinny(w, 1) for w in weights)
    with pytest.raises(ValueError, match="skinny_gemm must be 'auto', 'on' or 'off'"):
        LLM(model, skinny_gemm="yes")


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-deepseek"])
def test_greedy_outputs_equal_the_library_gemm(name):
    """Every projection of every step (prompts of up to 13 tokens, decodes) on the split-K kernel gives
    F.linear's greedy tokens; tiny-deepseek is MLA (its latent projections too)."""
    model = load_model(name, dtype=torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outputs = {}
    for mode in ("off", "on"):
        llm = LLM(model, skinny_gemm=mode, num_kv_blocks=32, max_num_seqs=4, fused_sampling="off")
        outputs[mode] = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params, use_tqdm=False)]
        llm.close()
    assert outputs["on"] == outputs["off"]


@pytest.mark.gpu
def test_the_start_measures_each_projection_on_the_gpu():
    """``auto`` on a GPU: every projection shape has a choice for each bucket, measured (logged lines with
    both times), and greedy outputs with the split-K kernel forced on equal the library GEMM's on a bf16
    preset."""
    model = load_model("tiny-qwen3", dtype=torch.bfloat16, device="cuda")
    llm = LLM(model, max_num_seqs=8, num_kv_blocks=64, max_num_batched_tokens=64)
    weights = [w for w, _ in projection_weights(model)]
    assert all(GEMM_CHOICES.key(w) in GEMM_CHOICES._table for w in weights)
    lines = gemm_choice.measure(llm.runner)
    assert len(lines) == len(weights) and all("64: " in line for line in lines)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = {}
    for mode in ("off", "on"):
        llm = LLM(model, skinny_gemm=mode, num_kv_blocks=64, max_num_seqs=8)
        got[mode] = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params, use_tqdm=False)]
        llm.close()
    assert got["on"] == got["off"]
