"""Models that use the attention layer: Llama/Mistral/Qwen2/Qwen3/Qwen3-MoE (GQA) and DeepSeek V2/V3/Kimi
(MLA), loaded from local Hugging Face directories or built from presets with random weights.

>>> model = load_model("tiny-llama", dtype=torch.float32)
>>> spec = model.attention_spec(block_size=16)
>>> hidden = model(input_ids, positions, ctx)          # ctx: tripath.attention.ForwardContext
>>> logits = model.compute_logits(hidden[last_token_rows])
>>> shard = load_model(path, parallel=ParallelState(rank, world_size, group))   # tensor parallelism
"""

from tripath.models.base import CausalLM
from tripath.models.config import ARCHITECTURES, ModelConfig, MoEConfig, RopeConfig, config_from_hf
from tripath.models.deepseek import DeepseekForCausalLM
from tripath.models.llama import LlamaForCausalLM
from tripath.models.loader import (build_model, init_random_weights, load_config, load_model, load_tokenizer,
                                   load_weights)
from tripath.models.parallel import ParallelState
from tripath.models.presets import PRESETS

__all__ = [
    "CausalLM", "LlamaForCausalLM", "DeepseekForCausalLM", "ModelConfig", "MoEConfig", "RopeConfig",
    "ARCHITECTURES", "PRESETS", "config_from_hf", "load_config", "build_model", "load_weights",
    "init_random_weights", "load_model", "load_tokenizer", "ParallelState",
]
