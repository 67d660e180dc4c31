"""The causal-LM shell every model shares: ``embed → layers → norm`` and the LM head.

Parameter names follow Hugging Face (``model.embed_tokens``, ``model.layers.{i}...``, ``model.norm``,
``lm_head``) so checkpoints load by name. Tokens arrive flat in plan order (``[decode | extend | prefill]``)
with absolute ``positions``; the layers reach the attention backend through the step's
:class:`~tripath.attention.ForwardContext` and own no scheduling.

Shapes: ``input_ids [T]`` int64, ``positions [T]`` int64 → hidden ``[T, hidden_size]`` (after the final
norm); ``compute_logits(hidden [N, hidden_size]) → [N, vocab_size]`` float32 (``upcast=False``: the LM
head's dtype). A model built with a
:class:`~tripath.models.parallel.ParallelState` of several ranks holds one rank's shard (vocabulary-parallel
embedding and LM head, heads split; see :mod:`tripath.models.parallel`); its attention spec has the rank's
heads and ``compute_logits`` gathers the whole vocabulary. ``sample_tokens(hidden, ...)`` draws each row's next
token straight from the LM head without writing its logits (:mod:`tripath.ops.lm_head_sample`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tripath.attention.spec import AttentionSpec
from tripath.models.config import ModelConfig
from tripath.models.layers import MLP, MoE, RMSNorm
from tripath.models.parallel import (SINGLE, ColumnParallelLinear, HeadSplit, ParallelState, RowParallelLinear,
                                     VocabParallelEmbedding, gather_draws, gather_logits, lm_head)
from tripath.ops.lm_head_sample import SampleDraw, lm_head_sample


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x += attn(norm(x))``, ``x += mlp(norm(x))``.

    The residual stream travels as ``(x, delta)``, its value ``x + delta``: each add is done by the norm
    that reads its result (one fused kernel on a GPU), and the block returns its MLP output as the next
    ``delta`` (None: nothing pending, as after the embedding)."""

    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module, dtype):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor,
                ctx) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm(x, delta)
        x, h = self.post_attention_layernorm(x, self.self_attn(h, positions, ctx))
        return x, self.mlp(h)


def feed_forward(config: ModelConfig, layer_idx: int, dtype, parallel: ParallelState = SINGLE) -> nn.Module:
    """Layer ``layer_idx``'s MLP: :class:`~tripath.models.layers.MoE` (routed experts, shared experts of
    ``moe.intermediate_size · num_shared_experts``) where ``config.moe`` makes it an MoE layer, else a dense
    :class:`~tripath.models.layers.MLP` of ``config.intermediate_size``. ``config.mlp_bias`` gives the dense
    MLPs (the shared experts too) their biases; routed experts have none."""
    if config.moe is not None and config.moe.is_moe_layer(layer_idx):
        return MoE(config.hidden_size, config.moe, bias=config.mlp_bias, dtype=dtype, parallel=parallel)
    return MLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias, dtype=dtype, parallel=parallel)


AttentionFactory = Callable[[ModelConfig, int, torch.dtype, ParallelState], nn.Module]


def decoder_layers(config: ModelConfig, attention: AttentionFactory, dtype,
                   parallel: ParallelState = SINGLE) -> list[DecoderLayer]:
    """The ``config.num_layers`` blocks of a model: ``attention(config, i, dtype, parallel)`` and
    :func:`feed_forward` for layer ``i`` (the MLP built first, so a shape that neither can shard is reported
    by its MLP's dimension)."""
    layers = []
    for i in range(config.num_layers):
        mlp = feed_forward(config, i, dtype, parallel)
        layers.append(DecoderLayer(config, attention(config, i, dtype, parallel), mlp, dtype))
    return layers


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig, layers: list[nn.Module], dtype, parallel: ParallelState = SINGLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype=dtype,
                                                   parallel=parallel)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)


class CausalLM(nn.Module):
    """Base of every model. Subclasses build ``layers`` and may override :meth:`post_load` (derived tensors
    that must be rebuilt once the weights are in place)."""

    def __init__(self, config: ModelConfig, layers: list[nn.Module], dtype: torch.dtype,
                 parallel: ParallelState = SINGLE):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.parallel = parallel
        self.heads = HeadSplit.of(parallel, config.num_heads, config.num_kv_heads)
        self.model = Backbone(config, layers, dtype, parallel)
        self.lm_head = None if config.tie_word_embeddings else lm_head(config.hidden_size, config.vocab_size,
                                                                       dtype=dtype, parallel=parallel)
        self.keep_prenorm_hidden = False   # forward keeps the last layer's output before the final norm
        self.prenorm_hidden: torch.Tensor | None = None

    @property
    def num_attention_layers(self) -> int:
        return self.config.num_layers

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def post_load(self) -> None:
        """Called by the loader once every parameter holds its final value: modules that stack weights do so
        (the MLPs' gate and up, :meth:`~tripath.models.layers.MLP.fuse_weights`; the GQA attention's q, k
        and v, :meth:`~tripath.models.llama.GQAAttention.fuse_weights`). Subclasses extend it (and call it)."""
        for module in self.modules():
            if callable(getattr(module, "fuse_weights", None)):
                module.fuse_weights()

    def projections(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """``(weight [N, K], bias or None)`` of each projection of the decoder layers as their forward runs it
        through :func:`tripath.ops.linear.linear`: the column- and row-parallel linears (a row-parallel one's
        bias is added after its all-reduce, so its GEMM has none) and the stacked weights (``*_weight`` buffers,
        with their ``*_bias``). The engine times the skinny GEMM on these at start
        (:func:`tripath.ops.linear_routes.choose_routes`)."""
        found = []
        for module in self.model.layers.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                sharded_rows = isinstance(module, RowParallelLinear) and module.tp_shards
                found.append((module.weight, None if sharded_rows else module.bias))
            for name, buffer in module.named_buffers(recurse=False):
                if name.endswith("_weight") and buffer is not None and buffer.dim() == 2:
                    found.append((buffer, getattr(module, name[:-len("weight")] + "bias", None)))
        return found

    def attention_spec(self, *, block_size: int = 16, kv_cache_dtype: str = "auto", kv_layout: str = "nhd",
                       dtype: torch.dtype | None = None, **options) -> AttentionSpec:
        """The :class:`AttentionSpec` of this model's attention layers (``options``: ``decode_threshold``,
        ``extend_chunk_budget``); under tensor parallelism, the rank's heads."""
        config = self.config
        return AttentionSpec(num_heads=self.heads.num_heads, num_kv_heads=self.heads.num_kv_heads,
                             head_size=config.head_size, dtype=dtype or self.dtype, kv_cache_dtype=kv_cache_dtype,
                             block_size=block_size, kv_layout=kv_layout, sm_scale=config.sm_scale,
                             window_left=config.window_left, mla=config.mla, **options)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """Hidden states ``[T, hidden_size]`` after the final norm. With :attr:`keep_prenorm_hidden` set, the
        last layer's output before that norm is kept as :attr:`prenorm_hidden` (``[T, hidden_size]``, the
        tensor the norm read: inside a CUDA graph capture, the graph's own memory)."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must both be [T]; got {tuple(input_ids.shape)} and "
                             f"{tuple(positions.shape)}")
        x, delta = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            x, delta = layer(x, delta, positions, ctx)
        if delta is None:
            hidden = self.model.norm(x)
        else:
            x, hidden = self.model.norm(x, delta)
        if self.keep_prenorm_hidden:
            self.prenorm_hidden = x
        return hidden

    def compute_logits(self, hidden: torch.Tensor, *, upcast: bool = True) -> torch.Tensor:
        """``[N, vocab_size]`` logits of ``hidden [N, hidden_size]``: float32, or with ``upcast=False`` in the
        LM head's dtype. The engine samples from the latter (:func:`tripath.engine.sampling.sampler.sample`: a greedy
        row's argmax is the same in either, and the rows it filters are converted there), which saves
        writing and reading a float32 copy of ``[N, V]`` every step."""
        logits = torch.nn.functional.linear(hidden, self.lm_head_weight)
        return gather_logits(logits.float() if upcast else logits, self.parallel, self.config.vocab_size)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The LM head's ``[vocab rows, hidden_size]`` (the embedding's when they are tied; a rank's rows in
        parallel)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def sample_tokens(self, hidden: torch.Tensor, temperature: torch.Tensor | None = None,
                      seeds: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> SampleDraw:
        """Each row's next token from ``hidden [N, hidden_size]`` without its logits: greedy, or drawn from
        ``softmax(z / temperature)`` with the rows' ``seeds`` and ``positions``
        (:func:`tripath.ops.lm_head_sample.lm_head_sample`: the token, its log-probability and the row's LSE).
        In parallel each rank draws from its vocabulary rows and the ranks merge their draws."""
        weight = self.lm_head_weight
        shard = (self.model.embed_tokens if self.lm_head is None else self.lm_head).tp_shards.get("weight")
        start, valid = (0, weight.shape[0]) if shard is None else (shard.start, shard.stop - shard.start)
        draw = lm_head_sample(hidden, weight, temperature, seeds, positions, vocab_valid=valid, vocab_offset=start)
        return gather_draws(draw, self.parallel)
