"""Loading: sharded and single safetensors, tokenizers, generation config, config parsing (legacy and
transformers-5 formats), presets, MoE paths, and the errors for unknown architectures, missing files and
mismatched tensors."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_steps import PagedRunner, hf_logits, randomize_hf_weights
from tripath.models import PRESETS, ModelConfig, config_from_hf, load_model, load_tokenizer
from tripath.models.config import MoEConfig, RopeConfig
from tripath.models.layers import MoE


@pytest.fixture(autouse=True)
def _validate_every_step(monkeypatch):
    """TRIPATH_VALIDATE=1: every step's metadata goes through tripath.attention.validate (and the ops check
    their index values), so each engine step here also proves the engine builds valid indices."""
    monkeypatch.setenv("TRIPATH_VALIDATE", "1")


transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=1)
TINY_PRESETS = [name for name in PRESETS if name.startswith("tiny-")]


def save_llama(path, **save_options):
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    randomize_hf_weights(hf_model)
    hf_model.save_pretrained(path, **save_options)
    return hf_model.eval()


def save_deepseek(path):
    cfg = transformers.DeepseekV3Config(
        **{**SMALL, "num_hidden_layers": 2, "num_key_value_heads": 4}, kv_lora_rank=64, qk_rope_head_dim=32,
        qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=48, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
    hf_model = transformers.DeepseekV3ForCausalLM(cfg)
    randomize_hf_weights(hf_model)
    hf_model.save_pretrained(path)
    return hf_model.eval()


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def edit_weights(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


# -- checkpoints ----------------------------------------------------------------------------------------------

def test_sharded_checkpoint_matches_single_file(tmp_path):
    hf_model = save_llama(tmp_path / "single")
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    single = load_model(str(tmp_path / "single"), dtype=torch.float32)
    sharded = load_model(str(tmp_path / "sharded"), dtype=torch.float32)
    for (name, a), (_, b) in zip(single.named_parameters(), sharded.named_parameters()):
        assert torch.equal(a, b), name
    tokens = list(range(3, 15))
    torch.testing.assert_close(PagedRunner(sharded).step({"A": tokens})["A"], hf_logits(hf_model, tokens),
                               atol=2e-4, rtol=1e-4)


def test_missing_shard_is_named(tmp_path):
    save_llama(tmp_path, max_shard_size="100KB")
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=f"lists shards that are missing: {victim.name}"):
        load_model(str(tmp_path))


def test_dtype_conversion_and_mtp_layers_skipped(tmp_path):
    """bf16 model from an fp32 checkpoint; DeepSeek's extra layer (multi-token prediction) and rotary buffers
    in the checkpoint are ignored."""
    save_deepseek(tmp_path)
    edit_weights(tmp_path, lambda t: t.update({"model.layers.2.eh_proj.weight": torch.randn(4, 4),
                                                "model.rotary_emb.inv_freq": torch.randn(16)}))
    model = load_model(str(tmp_path), dtype=torch.bfloat16)
    reference = load_file(str(tmp_path / "model.safetensors"))
    assert model.model.layers[0].self_attn.q_a_proj.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32  # the router stays fp32
    torch.testing.assert_close(model.model.layers[1].mlp.experts.up_proj[3].float(),
                               reference["model.layers.1.mlp.experts.3.up_proj.weight"], atol=1e-2, rtol=1e-2)


def test_tokenizer_and_generation_config(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers

    save_llama(tmp_path)
    assert load_tokenizer(load_model(str(tmp_path))) is None
    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 5, "world": 6}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]").save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    model = load_model(str(tmp_path))
    assert model.config.tokenizer_path == str(tmp_path)
    assert model.config.eos_token_ids == [1, 7]
    tokenizer = load_tokenizer(model)
    assert tokenizer.encode("hello world", add_special_tokens=False) == [5, 6]

    def refuse(*args, **kwargs):
        raise OSError("no")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    assert load_tokenizer(model).encode("hello world").ids == [5, 6]  # tokenizers fallback
    assert load_tokenizer(load_model("tiny-llama")) is None


# -- errors ---------------------------------------------------------------------------------------------------

def test_unknown_architecture(tmp_path):
    save_llama(tmp_path)
    edit_config(tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"config.json: unknown architecture \['GPT2LMHeadModel'\]; supported: "
                                         r"LlamaForCausalLM, MistralForCausalLM"):
        load_model(str(tmp_path))


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json in"):
        load_model(str(tmp_path))
    save_llama(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors weights in .*pytorch_model.bin checkpoints "
                                                "are not supported"):
        load_model(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="is a file: pass the model directory"):
        load_model(str(tmp_path / "config.json"))
    with pytest.raises(FileNotFoundError, match="'tiny-gpt' is neither a local model directory nor a preset; "
                                                "presets: tiny-llama"):
        load_model("tiny-gpt")


def test_mismatched_shape_names_the_tensor(tmp_path):
    save_llama(tmp_path)
    edit_weights(tmp_path, lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": torch.randn(32, 128)}))
    with pytest.raises(ValueError, match=r"model.safetensors: tensor model.layers.1.self_attn.k_proj.weight has "
                                         r"shape \(32, 128\), but the config expects \(64, 128\)"):
        load_model(str(tmp_path))


def test_config_disagreeing_with_weights(tmp_path):
    save_llama(tmp_path)
    edit_config(tmp_path, intermediate_size=200)
    with pytest.raises(ValueError, match=r"tensor model.layers.0.mlp.down_proj.weight has shape \(128, 192\), "
                                         r"but the config expects \(128, 200\)"):
        load_model(str(tmp_path))


def test_missing_and_unexpected_tensors(tmp_path):
    save_deepseek(tmp_path)
    edit_weights(tmp_path, lambda t: (t.pop("model.layers.1.mlp.experts.3.up_proj.weight"), t.pop("model.norm.weight")))
    with pytest.raises(ValueError, match="lacks 2 tensors the config needs: model.layers.1.mlp.experts.3.up_proj"
                                         ".weight, model.norm.weight"):
        load_model(str(tmp_path))
    save_llama(tmp_path / "llama")
    edit_weights(tmp_path / "llama", lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(128)}))
    with pytest.raises(ValueError, match="tensors this LlamaForCausalLM config does not use: "
                                         "model.layers.0.self_attn.q_proj.bias"):
        load_model(str(tmp_path / "llama"))


@pytest.mark.parametrize("changes, message", [
    (dict(quantization_config={"quant_method": "fp8"}), r"quantized checkpoints \(fp8\) are not supported"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported; supported: silu"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
     "rope_type='dynamic' in config.json is not supported; supported: default, linear, llama3, yarn"),
    (dict(num_key_value_heads=3), r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
    (dict(architectures=["Qwen3MoeForCausalLM"], num_experts=0, num_experts_per_tok=1, moe_intermediate_size=8),
     "Qwen3MoeForCausalLM needs num_experts >= 1 and decoder_sparse_step >= 1, got 0 and 1"),
])
def test_bad_config_values(tmp_path, changes, message):
    save_llama(tmp_path)
    edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path))


def test_bad_arguments():
    with pytest.raises(TypeError, match=r"dtype=torch.int8 is not supported; supported: float16, bfloat16, float32"):
        load_model("tiny-llama", dtype=torch.int8)
    model = load_model("tiny-llama", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"input_ids and positions must both be \[T\]"):
        model(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long), None)
    with pytest.raises(ValueError, match="rope_type='ntk' is not supported"):
        RopeConfig(rope_type="ntk")
    with pytest.raises(ValueError, match="scoring_func='relu'"):
        MoEConfig(num_experts=4, top_k=2, intermediate_size=8, scoring_func="relu")


# -- config parsing -------------------------------------------------------------------------------------------

def test_legacy_and_v5_rope_formats_agree():
    base = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=64,
                num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=4096, kv_lora_rank=32,
                qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, eos_token_id=[1, 2])
    yarn = dict(factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
                mscale_all_dim=1.0)
    legacy = config_from_hf({**base, "rope_theta": 10000, "rope_scaling": {"type": "yarn", **yarn}})
    v5 = config_from_hf({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000, **yarn}})
    assert legacy == v5
    assert legacy.rope == RopeConfig(theta=10000.0, rope_type="yarn", factor=40.0, original_max_position=4096,
                                     mscale=1.0, mscale_all_dim=1.0, is_neox=False)
    assert legacy.eos_token_ids == [1, 2] and legacy.moe is None and legacy.q_lora_rank is None
    assert legacy.sm_scale == pytest.approx((0.1 * math.log(40) + 1) ** 2 / math.sqrt(64))


def test_real_shape_presets():
    r1 = PRESETS["deepseek-r1-attn-tp8"]()
    assert (r1.num_heads, r1.head_size, r1.mla.kv_lora_rank, r1.mla.qk_rope_head_dim) == (16, 576, 512, 64)
    assert r1.sm_scale == pytest.approx((0.1 * math.log(40) + 1) ** 2 / math.sqrt(192))
    qwen = PRESETS["qwen3-235b-attn-tp8"]()
    assert (qwen.num_heads, qwen.num_kv_heads, qwen.head_size, qwen.qk_norm) == (8, 1, 128, True)
    kimi = PRESETS["kimi-nope-attn-tp8"]()
    assert kimi.rope is None and not kimi.mla.rope and kimi.head_size == 576
    assert kimi.sm_scale == pytest.approx(1 / math.sqrt(192))


# -- presets and layers ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TINY_PRESETS)
def test_tiny_presets_run(name):
    """Deterministic random weights; a prefill and two decode steps through the torch backend; one
    token's logits equal the same token fed alone."""
    model = load_model(name, dtype=torch.float32, seed=5)
    again = load_model(name, dtype=torch.float32, seed=5)
    other = load_model(name, dtype=torch.float32, seed=6)
    first = next(model.parameters())
    assert torch.equal(first, next(again.parameters())) and not torch.equal(first, next(other.parameters()))
    spec = model.attention_spec(block_size=8, decode_threshold=2)
    assert spec.decode_threshold == 2 and spec.mla == model.config.mla and spec.dtype == torch.float32
    batch = PagedRunner(model, block_size=8)
    alone = PagedRunner(again, block_size=8)
    out = batch.step({"A": [3, 4, 5, 6, 7], "B": [9, 8, 7]})
    single = alone.step({"B": [9, 8, 7]})
    for _ in range(2):
        out = batch.step({rid: [int(logits[-1].argmax())] for rid, logits in out.items()})
        single = alone.step({"B": [int(single["B"][-1].argmax())]})
        assert torch.isfinite(out["A"]).all()
        torch.testing.assert_close(out["B"], single["B"], atol=1e-4, rtol=1e-4)


def test_moe_dense_path_matches_grouped():
    """The dense expert path (used while capturing CUDA graphs) equals the grouped one."""
    moe_cfg = MoEConfig(num_experts=6, top_k=2, intermediate_size=16, num_shared_experts=1, scoring_func="sigmoid",
                        topk_method="noaux_tc", n_group=3, topk_group=2, norm_topk_prob=True,
                        routed_scaling_factor=2.0)
    moe = MoE(32, moe_cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    x = torch.randn(10, 32)
    weights, ids = moe.gate(x)
    assert ids.shape == (10, 2) and len(set(ids[0].tolist())) == 2
    dense = moe.experts.forward_dense(x, weights, ids)
    grouped = moe.experts.forward_grouped(x, weights, ids)
    torch.testing.assert_close(dense, grouped, atol=1e-5, rtol=1e-5)
    manual = torch.stack([sum(weights[t, k] * moe.experts.expert(int(ids[t, k]), x[t:t + 1])[0] for k in range(2))
                          for t in range(10)])
    torch.testing.assert_close(grouped, manual, atol=1e-5, rtol=1e-5)


def test_model_config_validation():
    with pytest.raises(ValueError, match="unknown architecture 'GPTJ'"):
        ModelConfig(architecture="GPTJ", vocab_size=8, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                    head_size=8, max_position=8, intermediate_size=8)
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM needs an MLASpec"):
        ModelConfig(architecture="DeepseekV3ForCausalLM", vocab_size=8, hidden_size=8, num_layers=1, num_heads=1,
                    num_kv_heads=1, head_size=8, max_position=8, intermediate_size=8)


# -- GPU ------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3-235b-attn-tp8", "deepseek-r1-attn-tp8", "kimi-nope-attn-tp8",
                                  "tiny-deepseek", "tiny-qwen3"])
def test_presets_bf16_auto_backend_matches_torch(name):
    """bf16 on the GPU: the automatically selected backend against the torch reference backend over a prefill,
    a mixed step and a decode step."""
    model = load_model(name, dtype=torch.bfloat16, device="cuda")
    fast = PagedRunner(model, backend="auto", device="cuda", num_blocks=64)
    reference = PagedRunner(model, backend="torch", device="cuda", num_blocks=64)
    steps = [{"A": list(range(3, 40)), "B": list(range(5, 22))},
             {"A": [7], "B": list(range(30, 50)), "C": list(range(9, 30))},
             {"A": [8], "B": [9], "C": [10]}]
    for step in steps:
        got, want = fast.step(step), reference.step(step)
        for rid in step:
            assert torch.isfinite(got[rid]).all()
            relative = (got[rid] - want[rid]).norm() / want[rid].norm()
            assert relative < 2e-2, f"{name}, request {rid}: relative logit error {float(relative):.3g}"


def test_routed_experts_only_on_qwen3_moe():
    from tripath.models.presets import tiny_qwen3, tiny_qwen3_moe

    moe = tiny_qwen3_moe()
    with pytest.raises(ValueError, match="routed experts .* go with Qwen3MoeForCausalLM alone"):
        ModelConfig(**{**moe.__dict__, "architecture": "Qwen3ForCausalLM"})
    with pytest.raises(ValueError, match="routed experts .* go with Qwen3MoeForCausalLM alone"):
        ModelConfig(**{**tiny_qwen3().__dict__, "architecture": "Qwen3MoeForCausalLM"})
