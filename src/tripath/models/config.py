"""Model configuration: :class:`ModelConfig` (validated on construction) and its parsing from a Hugging Face
``config.json``.

Two families:

- ``llama`` (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
  ``Qwen3MoeForCausalLM``): GQA with ``num_heads`` query heads and ``num_kv_heads`` KV heads of
  ``head_size``; RoPE on the whole head (NeoX pairs ``(i, i + D/2)``); Qwen2 adds q/k/v biases, Qwen3 a
  per-head RMSNorm on q and k before RoPE; Mistral (and Qwen with ``use_sliding_window``) a sliding window,
  on every layer or, from ``layer_types`` / ``max_window_layers``, on some (``window_layers``).
  Qwen3-MoE replaces the MLP of every ``decoder_sparse_step``-th layer (except ``mlp_only_layers``) with
  routed experts: softmax router, top-k, weights renormalised when ``norm_topk_prob``, no shared expert.
- ``deepseek`` (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``, Kimi K2 which uses the V3 class):
  MLA with ``num_heads`` heads over one latent KV head; ``head_size = kv_lora_rank + qk_rope_head_dim``
  (the cache row), ``num_kv_heads = 1``; RoPE only on the ``qk_rope_head_dim`` part (GPT-J interleaved
  pairs unless ``rope_interleave`` is false); ``"mla_use_nope": true`` in ``config.json`` turns RoPE off
  (Kimi-style NoPE MLA: identity rotation). Softmax scale ``mscale(factor, mscale_all_dim)² /
  sqrt(qk_nope + qk_rope)`` under yarn, ``1/sqrt(qk_nope + qk_rope)`` otherwise. ``num_nextn_predict_layers``
  (DeepSeek-V3/R1: 1): multi-token-prediction layers stored after the decoder layers
  (:mod:`tripath.models.deepseek_mtp`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tripath.attention.spec import MLASpec

LLAMA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                       "Qwen3MoeForCausalLM")
DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
ARCHITECTURES = LLAMA_ARCHITECTURES + DEEPSEEK_ARCHITECTURES
# Hugging Face's MLPs that take ``mlp_bias`` from the config (the dense MLP and, in V2, the shared experts);
# the other architectures' MLPs have no bias whatever the config says.
MLP_BIAS_ARCHITECTURES = ("LlamaForCausalLM", "DeepseekV2ForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """Yarn's magnitude correction ``0.1 · mscale · ln(factor) + 1`` (1 when ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base ``theta`` and scaling ``rope_type`` (``default``, ``linear``: positions / factor,
    ``llama3``: Llama 3.1 frequency smoothing, ``yarn``: DeepSeek/YaRN interpolation with an attention
    factor). ``is_neox``: pairs ``(i, i + R/2)``; otherwise GPT-J interleaved pairs ``(2i, 2i + 1)``."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True
    is_neox: bool = True

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type={self.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError(f"rope theta and factor must be positive, got {self.theta} and {self.factor}")
        if self.rope_type in ("llama3", "yarn") and not self.original_max_position:
            raise ValueError(f"rope_type={self.rope_type!r} needs original_max_position_embeddings")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 rope needs high_freq_factor > low_freq_factor")

    @property
    def softmax_mscale(self) -> float:
        """Factor on the softmax scale (DeepSeek yarn: ``mscale(factor, mscale_all_dim)²``; else 1)."""
        if self.rope_type == "yarn" and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale_all_dim) ** 2
        return 1.0


@dataclass(frozen=True)
class MoEConfig:
    """DeepSeek mixture of experts: ``num_experts`` routed experts (``top_k`` per token) of
    ``intermediate_size``, ``num_shared_experts`` always-on experts (one MLP of ``n · intermediate_size``).
    Routing: ``scoring_func`` (softmax / sigmoid) over the router logits; ``topk_method`` ``greedy`` (top-k of
    the scores), ``group_limited_greedy`` (V2: keep the ``topk_group`` groups of the highest max score) or
    ``noaux_tc`` (V3: add the correction bias for the choice only, rank groups by the sum of their top-2);
    weights renormalised when ``norm_topk_prob``, then times ``routed_scaling_factor``. Layer ``i`` is MoE when
    ``i >= first_k_dense_replace`` and ``i % layer_freq == 0``, or, when ``moe_layers`` lists them (Qwen3-MoE),
    when ``i`` is listed."""

    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared_experts: int = 0
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    layer_freq: int = 1
    moe_layers: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func={self.scoring_func!r}; supported: {', '.join(SCORING_FUNCS)}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method={self.topk_method!r}; supported: {', '.join(TOPK_METHODS)}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in 1..n_routed_experts ({self.num_experts})")
        if self.n_group < 1 or self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"n_group={self.n_group} must divide n_routed_experts={self.num_experts} and "
                             f"topk_group={self.topk_group} must be in 1..n_group")
        if self.topk_method != "greedy" and self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(f"num_experts_per_tok={self.top_k} exceeds the experts of topk_group={self.topk_group} "
                             "groups")

    def is_moe_layer(self, layer_idx: int) -> bool:
        if self.moe_layers is not None:
            return layer_idx in self.moe_layers
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.layer_freq == 0


@dataclass(frozen=True)
class ModelConfig:
    """One model's shapes and options (see the module docstring for the two families)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    max_position: int
    intermediate_size: int
    eos_token_ids: list[int] = field(default_factory=list)
    mla: MLASpec | None = None
    tokenizer_path: str | None = None
    rope: RopeConfig | None = field(default_factory=RopeConfig)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False  # the dense MLPs' (and shared experts') linears; routed experts have none
    qk_norm: bool = False
    sliding_window: int | None = None
    window_layers: tuple[int, ...] | None = None
    q_lora_rank: int | None = None
    moe: MoEConfig | None = None
    bos_token_id: int | None = None
    num_nextn_predict_layers: int = 0   # DeepSeek's multi-token-prediction layers (after the decoder layers)

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.architecture!r}; supported: {', '.join(ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_size",
                     "max_position", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.is_mla:
            if self.mla is None:
                raise ValueError(f"{self.architecture} needs an MLASpec (mla=...)")
            if self.num_kv_heads != 1 or self.head_size != self.mla.cache_width:
                raise ValueError("an MLA config has num_kv_heads=1 and head_size = kv_lora_rank + qk_rope_head_dim")
            if self.mla.rope != (self.rope is not None):
                raise ValueError("MLASpec.rope must say whether the config has a rope (None = NoPE)")
            if self.rope is not None and self.mla.is_neox_rope != self.rope.is_neox:
                raise ValueError("MLASpec.is_neox_rope and RopeConfig.is_neox disagree")
        else:
            if self.mla is not None or self.q_lora_rank is not None:
                raise ValueError(f"{self.architecture} has no MLA or q_lora_rank")
            if (self.moe is not None) != (self.architecture == "Qwen3MoeForCausalLM"):
                raise ValueError(f"{self.architecture}: routed experts (moe=...) go with Qwen3MoeForCausalLM alone")
            if self.rope is None:
                raise ValueError(f"{self.architecture} needs a rope config")
            if self.head_size % 2:
                raise ValueError(f"head_size must be even for RoPE, got {self.head_size}")
        if self.num_nextn_predict_layers < 0 or (self.num_nextn_predict_layers and not self.is_mla):
            raise ValueError(f"num_nextn_predict_layers={self.num_nextn_predict_layers}: multi-token-prediction "
                             f"layers are read for {', '.join(DEEPSEEK_ARCHITECTURES)} only (0 or more)")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")
        if self.window_layers is not None and (self.sliding_window is None or not all(
                0 <= i < self.num_layers for i in self.window_layers)):
            raise ValueError(f"window_layers={self.window_layers} needs a sliding_window and layer indices in "
                             f"0..{self.num_layers - 1}")

    @property
    def family(self) -> str:
        return "deepseek" if self.architecture in DEEPSEEK_ARCHITECTURES else "llama"

    @property
    def is_mla(self) -> bool:
        return self.family == "deepseek"

    @property
    def sm_scale(self) -> float:
        """Softmax scale of the attention scores (with DeepSeek's yarn ``mscale²``)."""
        if self.is_mla:
            base = 1.0 / math.sqrt(self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim)
        else:
            base = 1.0 / math.sqrt(self.head_size)
        return base * (self.rope.softmax_mscale if self.rope is not None else 1.0)

    @property
    def window_left(self) -> int:
        """Sliding window as the attention spec takes it (``W - 1``; −1 = off)."""
        return -1 if self.sliding_window is None else self.sliding_window - 1

    def layer_window_left(self, layer_idx: int) -> int | None:
        """Layer ``layer_idx``'s window where layers differ (``window_left`` or −1 for full attention);
        None when every layer has the spec's."""
        if self.window_layers is None:
            return None
        return self.window_left if layer_idx in self.window_layers else -1


# -- Hugging Face config.json ---------------------------------------------------------------------------------

def _get(raw: dict, key: str, default=None):
    value = raw.get(key)
    return default if value is None else value


def _eos_ids(*values) -> list[int]:
    ids: list[int] = []
    for value in values:
        for token in (value if isinstance(value, list) else [value]):
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    return ids


def rope_from_hf(raw: dict, *, is_neox: bool) -> RopeConfig:
    """RoPE settings from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (older)."""
    params = dict(raw.get("rope_parameters") or {})
    params.update(raw.get("rope_scaling") or {})
    theta = float(_get(params, "rope_theta", _get(raw, "rope_theta", 10000.0)))
    rope_type = _get(params, "rope_type", _get(params, "type", "default"))
    if rope_type == "deepseek_yarn":
        rope_type = "yarn"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r} in config.json is not supported; supported: {', '.join(ROPE_TYPES)}")
    original = _get(params, "original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    if rope_type in ("llama3", "yarn") and original is None:
        original = raw["max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = raw["max_position_embeddings"] / original if rope_type == "yarn" else 1.0
    return RopeConfig(
        theta=theta, rope_type=rope_type, factor=float(factor),
        low_freq_factor=float(_get(params, "low_freq_factor", 1.0)),
        high_freq_factor=float(_get(params, "high_freq_factor", 4.0)),
        original_max_position=int(original) if original is not None else None,
        beta_fast=float(_get(params, "beta_fast", 32.0)), beta_slow=float(_get(params, "beta_slow", 1.0)),
        mscale=float(_get(params, "mscale", 0.0)), mscale_all_dim=float(_get(params, "mscale_all_dim", 0.0)),
        attention_factor=params.get("attention_factor"), truncate=bool(_get(params, "truncate", True)),
        is_neox=is_neox)


def _sliding_window(raw: dict, architecture: str, num_layers: int) -> tuple[int | None, tuple[int, ...] | None]:
    """``(window, window_layers)``: the sliding window and, when only some layers use it, which ones (from
    ``layer_types``, or Qwen's ``use_sliding_window`` + ``max_window_layers``: layers from that index on)."""
    window = raw.get("sliding_window")
    if architecture == "MistralForCausalLM" or window is None:
        return window, None
    if architecture == "LlamaForCausalLM":
        return None, None
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if raw.get("use_sliding_window") and i >= _get(raw, "max_window_layers", 0)
        else "full_attention" for i in range(num_layers)]
    sliding = tuple(i for i, t in enumerate(layer_types[:num_layers]) if t == "sliding_attention")
    if not sliding:
        return None, None
    return window, None if len(sliding) == num_layers else sliding


def _moe_from_hf(raw: dict, architecture: str) -> MoEConfig | None:
    if not raw.get("n_routed_experts"):
        return None
    v3 = architecture == "DeepseekV3ForCausalLM"
    return MoEConfig(
        num_experts=int(raw["n_routed_experts"]), top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=int(raw["moe_intermediate_size"]), num_shared_experts=int(_get(raw, "n_shared_experts", 0)),
        scoring_func=_get(raw, "scoring_func", "sigmoid" if v3 else "softmax"),
        topk_method=_get(raw, "topk_method", "noaux_tc" if v3 else "greedy"),
        n_group=int(_get(raw, "n_group", 1)), topk_group=int(_get(raw, "topk_group", 1)),
        norm_topk_prob=bool(_get(raw, "norm_topk_prob", False)),
        routed_scaling_factor=float(_get(raw, "routed_scaling_factor", 1.0)),
        first_k_dense_replace=int(_get(raw, "first_k_dense_replace", 0)),
        layer_freq=int(_get(raw, "moe_layer_freq", 1)))


def _qwen3_moe_from_hf(raw: dict, num_layers: int) -> MoEConfig:
    """Qwen3-MoE routing: layer ``i`` has experts when ``(i + 1) % decoder_sparse_step == 0`` and it is not in
    ``mlp_only_layers`` (``num_experts``, or ``num_local_experts`` as transformers 5 writes it)."""
    num_experts = int(_get(raw, "num_experts", _get(raw, "num_local_experts", 0)))
    step = int(_get(raw, "decoder_sparse_step", 1))
    dense = set(_get(raw, "mlp_only_layers", []))
    if num_experts < 1 or step < 1:
        raise ValueError(f"Qwen3MoeForCausalLM needs num_experts >= 1 and decoder_sparse_step >= 1, got "
                         f"{num_experts} and {step}")
    layers = tuple(i for i in range(num_layers) if (i + 1) % step == 0 and i not in dense)
    return MoEConfig(num_experts=num_experts, top_k=int(raw["num_experts_per_tok"]),
                     intermediate_size=int(raw["moe_intermediate_size"]), scoring_func="softmax",
                     topk_method="greedy", norm_topk_prob=bool(_get(raw, "norm_topk_prob", False)),
                     moe_layers=layers)


def config_from_hf(raw: dict, *, generation_config: dict | None = None, tokenizer_path: str | None = None,
                   source: str = "config.json") -> ModelConfig:
    """A :class:`ModelConfig` from a parsed Hugging Face ``config.json`` (``source`` names it in errors:
    every ``ValueError`` it raises starts with ``source``, wrong-typed values included)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: expected a JSON object, got a {type(raw).__name__}")
    try:
        return _config_from_hf(raw, generation_config, tokenizer_path, source)
    except (TypeError, ValueError, AttributeError, ArithmeticError) as error:
        message = str(error)
        if message.startswith(f"{source}: "):
            raise
        raise ValueError(f"{source}: {message}") from error


def _config_from_hf(raw: dict, generation_config: dict | None, tokenizer_path: str | None,
                    source: str) -> ModelConfig:
    architectures = raw.get("architectures") or []
    known = [a for a in architectures if a in ARCHITECTURES]
    if not known:
        raise ValueError(f"{source}: unknown architecture {architectures or raw.get('model_type')!r}; "
                         f"supported: {', '.join(ARCHITECTURES)}")
    architecture = known[0]
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        raise ValueError(f"{source}: quantized checkpoints ({method}) are not supported; use bf16/fp16/fp32 weights")
    act = _get(raw, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act={act!r} is not supported; supported: silu")
    try:
        num_layers = int(raw["num_hidden_layers"])
        common = dict(
            architecture=architecture, vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
            num_layers=num_layers, num_heads=int(raw["num_attention_heads"]),
            max_position=int(raw["max_position_embeddings"]), intermediate_size=int(raw["intermediate_size"]),
            eos_token_ids=_eos_ids(raw.get("eos_token_id"), (generation_config or {}).get("eos_token_id")),
            tokenizer_path=tokenizer_path, rms_norm_eps=float(_get(raw, "rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(_get(raw, "tie_word_embeddings", False)),
            mlp_bias=architecture in MLP_BIAS_ARCHITECTURES and bool(_get(raw, "mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"))
        if architecture in DEEPSEEK_ARCHITECTURES:
            nope = bool(raw.get("mla_use_nope", False))
            is_neox = architecture == "DeepseekV3ForCausalLM" and not _get(raw, "rope_interleave", True)
            mla = MLASpec(kv_lora_rank=int(raw["kv_lora_rank"]), qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                          qk_nope_head_dim=int(raw["qk_nope_head_dim"]), v_head_dim=int(raw["v_head_dim"]),
                          rope=not nope, is_neox_rope=is_neox)
            bias = bool(_get(raw, "attention_bias", False))
            return ModelConfig(**common, num_kv_heads=1, head_size=mla.cache_width, mla=mla,
                               rope=None if nope else rope_from_hf(raw, is_neox=is_neox), qkv_bias=bias,
                               o_bias=bias, q_lora_rank=raw.get("q_lora_rank"), moe=_moe_from_hf(raw, architecture),
                               num_nextn_predict_layers=int(_get(raw, "num_nextn_predict_layers", 0)))
        num_heads = common["num_heads"]
        if num_heads <= 0:
            raise ValueError(f"{source}: num_attention_heads must be positive, got {num_heads}")
        qwen2 = architecture == "Qwen2ForCausalLM"
        bias = bool(_get(raw, "attention_bias", False))
        window, window_layers = _sliding_window(raw, architecture, num_layers)
        return ModelConfig(**common, num_kv_heads=int(_get(raw, "num_key_value_heads", num_heads)),
                           head_size=int(_get(raw, "head_dim", common["hidden_size"] // num_heads)),
                           rope=rope_from_hf(raw, is_neox=True), qkv_bias=qwen2 or bias, o_bias=bias and not qwen2,
                           qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
                           sliding_window=window, window_layers=window_layers,
                           moe=_qwen3_moe_from_hf(raw, num_layers) if architecture == "Qwen3MoeForCausalLM" else None)
    except KeyError as missing:
        raise ValueError(f"{source}: {architecture} config is missing the key {missing.args[0]!r}") from None
