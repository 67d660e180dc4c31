"""``tripath bench decode-step``: the weights its GEMM table times, its report, its refusal without a GPU."""

import pytest
import torch

from tripath.bench.decode_step import context_tokens, format_result, main, projection_weights, weight_copies
from tripath.models import build_model
from tripath.models.presets import PRESETS


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen2", "tiny-deepseek"])
def test_projection_weights_are_the_gemm_operands(preset):
    """Stacked weights count once (not their row views); the LM head (the tied embedding where tied) last."""
    model = build_model(PRESETS[preset]())
    model.post_load()
    weights = projection_weights(model)
    names = [n for n, _ in weights]
    assert names[-1] == "lm_head" and len(set(names)) == len(names)
    head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    assert weights[-1][1] is head
    storages = [w.untyped_storage().data_ptr() for _, w in weights[:-1]]
    assert len(set(storages)) == len(storages)
    if preset != "tiny-deepseek":
        assert {"self_attn.qkv_weight", "mlp.gate_up_weight", "self_attn.o_proj.weight",
                "mlp.down_proj.weight"} <= set(names)
        assert not any(n.endswith(("q_proj.weight", "k_proj.weight", "gate_proj.weight")) for n in names)
    else:  # the latent projections stacked: q_a and kv_a are one weight
        assert "self_attn.qkv_a_weight" in names
        assert not any(n.endswith(("q_a_proj.weight", "kv_a_proj_with_mqa.weight")) for n in names)


def test_the_gemm_table_reads_each_weight_from_memory():
    """Enough copies of a weight to overflow L2 twice (each a clone, equal to it), at most the cap; a weight
    larger than twice L2 alone."""
    w = torch.randn(256, 1024)   # 1 MiB
    copies = weight_copies(w, l2_bytes=3 << 20)
    assert len(copies) == 6 and copies[0] is w and all(torch.equal(c, w) for c in copies)
    assert len({c.data_ptr() for c in copies}) == 6
    assert len(weight_copies(w, l2_bytes=1 << 30, most=4)) == 4
    assert weight_copies(w, l2_bytes=1 << 10) == [w]


def test_report_names_the_floor_ratio_and_kernels():
    result = {"model": "m", "backend": "three_path", "batch": 64, "context": 2048, "device": "GPU",
              "step_gpu_ms": 0.6, "steps_timed": 96, "floor_ms": 0.4, "weight_bytes": 1.4e9, "kv_bytes": 2.6e8,
              "copy_GB/s": 4200.0, "profiled_steps": 96, "tokens_timed": 2100.4, "tokens_profiled": 2196.0,
              "kernels": [{"kernel": "gemm", "us_per_step": 300.0, "launches_per_step": 1.0},
                          {"kernel": "norm", "us_per_step": 20.5, "launches_per_step": 9.0}],
              "gemms": [{"weight": "lm_head", "N": 10, "K": 4, "M": 64, "us": 300.0, "GB/s": 4000.0,
                         "of_copy": 0.95}]}
    text = format_result(result)
    assert "1.50x the floor" in text and "| gemm | 300.0 | 1.0 |" in text
    assert "at 2100 tokens a request on average" in text and "2196 tokens a request on average" in text
    assert "| total kernel time | 320.5 | 10.0 |" in text and "| lm_head | 10 × 4 | 64 | 300.0 | 4000 | 95 % |" in text


def test_the_floor_counts_the_tokens_the_requests_hold():
    """The KV of the floor is what the running requests hold (they grow a token a step), not their prompts."""
    from types import SimpleNamespace

    llm = SimpleNamespace(scheduler=SimpleNamespace(running=[SimpleNamespace(num_computed_tokens=n)
                                                             for n in (1030, 1100, 7)]))
    assert context_tokens(llm) == 2137


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_refuses_without_a_gpu(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "tiny-llama"])
    assert exit_.value.code == 2 and "needs a GPU" in capsys.readouterr().err
