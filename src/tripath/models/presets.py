"""Built-in model presets (random weights, see ``loader.init_random_weights``): tiny ones that run anywhere
(laptop, CI, the CPU test suite), and attention layers of real models at tensor-parallel 8 (one GPU's
share of heads, a few layers, a dense MLP) for GPU benchmarks. Presets with an MTP layer build it (random
weights too) when loaded with ``load_model(..., mtp=True)`` (speculative decoding's ``mtp`` method).

========================  ==================  ==================================================================
name                      architecture        what it exercises
========================  ==================  ==================================================================
tiny-llama                Llama 3             GQA 4/2, head 32, llama3 rope scaling
tiny-mistral              Mistral             GQA 4/1, head 32, sliding window 64
tiny-qwen2                Qwen2               q/k/v biases, tied embeddings
tiny-qwen3                Qwen3               q/k RMSNorm, head 64 (> hidden / heads)
tiny-qwen3-moe            Qwen3-MoE           Qwen3 attention, top-2 of 8 experts (layer 1 dense)
tiny-deepseek             DeepSeek V3         MLA 64+32 with q_lora, yarn, MoE (sigmoid, groups), an MTP layer
tiny-deepseek-v2          DeepSeek V2         MLA without q_lora, softmax group-limited MoE
tiny-kimi-nope            DeepSeek V3 (Kimi)  NoPE MLA (identity rotation), MoE
llama-3.1-8b              Llama 3.1           Llama-3.1-8B's full shape: 32 layers, GQA 32/8, head 128
qwen3-235b-attn-tp8       Qwen3               Qwen3-235B-A22B attention at TP 8: 8 q / 1 kv heads
deepseek-r1-attn-tp8      DeepSeek V3         DeepSeek-R1 MLA at TP 8: 16 heads, 512+64, yarn 40, an MTP layer
kimi-nope-attn-tp8        DeepSeek V3 (Kimi)  Kimi K2 MLA shapes at TP 8 (8 heads), NoPE
========================  ==================  ==================================================================
"""

from __future__ import annotations

from tripath.attention.spec import MLASpec
from tripath.models.config import ModelConfig, MoEConfig, RopeConfig

_TINY = dict(vocab_size=256, hidden_size=128, num_layers=2, max_position=2048, intermediate_size=256,
             eos_token_ids=[1], bos_token_id=0)
_TINY_MOE = MoEConfig(num_experts=8, top_k=2, intermediate_size=64, num_shared_experts=1, scoring_func="sigmoid",
                      topk_method="noaux_tc", n_group=2, topk_group=1, norm_topk_prob=True,
                      routed_scaling_factor=2.5, first_k_dense_replace=1)
_DEEPSEEK_YARN = RopeConfig(theta=10000.0, rope_type="yarn", factor=40.0, original_max_position=4096,
                            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, is_neox=False)


def tiny_llama() -> ModelConfig:
    rope = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position=256)
    return ModelConfig(architecture="LlamaForCausalLM", num_heads=4, num_kv_heads=2, head_size=32, rope=rope, **_TINY)


def tiny_mistral() -> ModelConfig:
    return ModelConfig(architecture="MistralForCausalLM", num_heads=4, num_kv_heads=1, head_size=32,
                       rope=RopeConfig(theta=1e6), sliding_window=64, **_TINY)


def tiny_qwen2() -> ModelConfig:
    return ModelConfig(architecture="Qwen2ForCausalLM", num_heads=4, num_kv_heads=2, head_size=32,
                       rope=RopeConfig(theta=1e6), qkv_bias=True, tie_word_embeddings=True, **_TINY)


def tiny_qwen3() -> ModelConfig:
    return ModelConfig(architecture="Qwen3ForCausalLM", num_heads=4, num_kv_heads=2, head_size=64,
                       rope=RopeConfig(theta=1e6), qk_norm=True, **_TINY)


def tiny_qwen3_moe() -> ModelConfig:
    moe = MoEConfig(num_experts=8, top_k=2, intermediate_size=64, norm_topk_prob=True, moe_layers=(0, 2))
    return ModelConfig(architecture="Qwen3MoeForCausalLM", num_heads=4, num_kv_heads=2, head_size=32,
                       rope=RopeConfig(theta=1e6), qk_norm=True, moe=moe, **{**_TINY, "num_layers": 3})


def tiny_deepseek() -> ModelConfig:
    mla = MLASpec(kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32)
    rope = RopeConfig(theta=10000.0, rope_type="yarn", factor=4.0, original_max_position=512, mscale=1.0,
                      mscale_all_dim=1.0, is_neox=False)
    return ModelConfig(architecture="DeepseekV3ForCausalLM", num_heads=4, num_kv_heads=1, head_size=mla.cache_width,
                       mla=mla, rope=rope, q_lora_rank=64, moe=_TINY_MOE, num_nextn_predict_layers=1,
                       **{**_TINY, "num_layers": 3})


def tiny_deepseek_v2() -> ModelConfig:
    mla = MLASpec(kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32)
    moe = MoEConfig(num_experts=8, top_k=3, intermediate_size=64, num_shared_experts=2, scoring_func="softmax",
                    topk_method="group_limited_greedy", n_group=4, topk_group=2, first_k_dense_replace=1)
    return ModelConfig(architecture="DeepseekV2ForCausalLM", num_heads=4, num_kv_heads=1,
                       head_size=mla.cache_width, mla=mla, rope=RopeConfig(theta=10000.0, is_neox=False), moe=moe,
                       **{**_TINY, "num_layers": 3})


def tiny_kimi_nope() -> ModelConfig:
    mla = MLASpec(kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, rope=False)
    moe = MoEConfig(num_experts=8, top_k=2, intermediate_size=64, num_shared_experts=1, scoring_func="sigmoid",
                    topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=2.827, first_k_dense_replace=1)
    return ModelConfig(architecture="DeepseekV3ForCausalLM", num_heads=4, num_kv_heads=1, head_size=mla.cache_width,
                       mla=mla, rope=None, q_lora_rank=64, moe=moe, **{**_TINY, "num_layers": 3})


def llama_31_8b() -> ModelConfig:
    rope = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position=8192)
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, num_layers=32,
                       num_heads=32, num_kv_heads=8, head_size=128, max_position=131072, intermediate_size=14336,
                       rope=rope, rms_norm_eps=1e-5, eos_token_ids=[128001, 128008, 128009], bos_token_id=128000)


def qwen3_235b_attn_tp8() -> ModelConfig:
    return ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=4096, num_layers=4,
                       num_heads=8, num_kv_heads=1, head_size=128, max_position=40960, intermediate_size=1536,
                       rope=RopeConfig(theta=1e6), qk_norm=True, eos_token_ids=[151645], bos_token_id=None)


def _mla_tp8(heads: int, rope: RopeConfig | None, **extra) -> ModelConfig:
    mla = MLASpec(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, rope=rope is not None)
    return ModelConfig(architecture="DeepseekV3ForCausalLM", hidden_size=7168, num_layers=4, num_heads=heads,
                       num_kv_heads=1, head_size=mla.cache_width, intermediate_size=2304, mla=mla, rope=rope,
                       q_lora_rank=1536, **extra)


def deepseek_r1_attn_tp8() -> ModelConfig:
    return _mla_tp8(16, _DEEPSEEK_YARN, vocab_size=129280, max_position=163840, eos_token_ids=[1], bos_token_id=0,
                    num_nextn_predict_layers=1)


def kimi_nope_attn_tp8() -> ModelConfig:
    return _mla_tp8(8, None, vocab_size=163840, max_position=131072, eos_token_ids=[163585], bos_token_id=163584)


PRESETS = {
    "tiny-llama": tiny_llama, "tiny-mistral": tiny_mistral, "tiny-qwen2": tiny_qwen2, "tiny-qwen3": tiny_qwen3,
    "tiny-qwen3-moe": tiny_qwen3_moe,
    "tiny-deepseek": tiny_deepseek, "tiny-deepseek-v2": tiny_deepseek_v2, "tiny-kimi-nope": tiny_kimi_nope,
    "llama-3.1-8b": llama_31_8b, "qwen3-235b-attn-tp8": qwen3_235b_attn_tp8, "deepseek-r1-attn-tp8": deepseek_r1_attn_tp8,
    "kimi-nope-attn-tp8": kimi_nope_attn_tp8,
}
