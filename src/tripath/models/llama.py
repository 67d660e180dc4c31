"""GQA decoder models: Llama 2/3 (incl. llama3 rope scaling), Mistral, Qwen2 (q/k/v biases), Qwen3 (per-head
q/k RMSNorm), Qwen3-MoE (Qwen3 attention, routed experts in the MLP of the layers the config names).

Per layer, for ``T`` tokens, ``Hq`` query heads, ``Hkv`` KV heads of size ``D``:
``q = rope(norm_q(x·Wqᵀ))`` ``[T, Hq, D]``, ``k = rope(norm_k(x·Wkᵀ))``, ``v = x·Wvᵀ`` ``[T, Hkv, D]``
(``norm_*`` only on Qwen3; RoPE with NeoX pairs at the absolute positions, on a GPU one in-place launch
for ``q`` and ``k``, or with Qwen3's norms one launch for both norms and RoPE), then
``o = ctx.attend(layer, q, k, v)`` ``[T, Hq, D]`` (writes k/v into the layer's paged cache; causal, with the
sliding window of the spec, or the layer's own where layers differ) and ``out = o·Woᵀ``. Once the
weights are loaded (:meth:`GQAAttention.fuse_weights`) ``Wq``, ``Wk`` and ``Wv`` are stacked into one weight, so
a step runs one GEMM for the three and ``q``/``k``/``v`` are views of its output; on a GPU Qwen3's two
norms and the rotary embedding are one launch over the ``q`` and ``k`` heads of that output
(:func:`tripath.ops.norm.rms_norm_rope_heads`). Under tensor
parallelism (:mod:`tripath.models.parallel`) ``Hq``/``Hkv`` are the rank's heads and ``o_proj`` all-reduces.
"""

from __future__ import annotations

import torch
from torch import nn

from tripath.models.base import CausalLM, decoder_layers
from tripath.models.config import LLAMA_ARCHITECTURES, ModelConfig
from tripath.models.layers import RMSNorm, apply_rotary, rotary_tables, stack_linears
from tripath.models.parallel import SINGLE, ColumnParallelLinear, HeadSplit, ParallelState, RowParallelLinear
from tripath.ops.linear import linear
from tripath.ops.norm import rms_norm_rope_heads
from tripath.ops.rotary import rotary_embedding


class GQAAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype, parallel: ParallelState = SINGLE):
        super().__init__()
        self.layer_idx = layer_idx
        heads = HeadSplit.of(parallel, config.num_heads, config.num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_size = heads.num_heads, heads.num_kv_heads, config.head_size
        hidden, q_size, kv_size = config.hidden_size, config.num_heads * config.head_size, \
            config.num_kv_heads * config.head_size
        bias, d = config.qkv_bias, config.head_size
        self.q_proj = ColumnParallelLinear(hidden, q_size, bias=bias, dtype=dtype, rows=heads.q_rows(d))
        self.k_proj = ColumnParallelLinear(hidden, kv_size, bias=bias, dtype=dtype, rows=heads.kv_rows(d))
        self.v_proj = ColumnParallelLinear(hidden, kv_size, bias=bias, dtype=dtype, rows=heads.kv_rows(d))
        self.o_proj = RowParallelLinear(q_size, hidden, bias=config.o_bias, dtype=dtype, parallel=parallel,
                                        what="num_attention_heads * head_dim")
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_size, config.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(config.head_size, config.rms_norm_eps, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = None  # RotaryTables, shared by every layer (set by LlamaForCausalLM.post_load)
        self.window_left = config.layer_window_left(layer_idx)  # None: the spec's window
        self.register_buffer("qkv_weight", None, persistent=False)  # set by fuse_weights
        self.register_buffer("qkv_bias", None, persistent=False)

    def fuse_weights(self) -> None:
        """One weight (and bias) ``[q rows + 2 · kv rows, hidden]`` for the three projections; their
        parameters become views of its row blocks."""
        weight, bias = stack_linears((self.q_proj, self.k_proj, self.v_proj))
        self.register_buffer("qkv_weight", weight, persistent=False)
        self.register_buffer("qkv_bias", bias, persistent=False)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``q [T, Hq, D]``, ``k``, ``v [T, Hkv, D]`` and, with fused weights, the ``[T, Hq + Hkv, D]`` view of
        the q and k heads (None otherwise)."""
        t, d = x.shape[0], self.head_size
        if self.qkv_weight is None:
            return (self.q_proj(x).view(t, self.num_heads, d), self.k_proj(x).view(t, self.num_kv_heads, d),
                    self.v_proj(x).view(t, self.num_kv_heads, d), None)
        qkv = linear(x, self.qkv_weight, self.qkv_bias)
        nq, nk = self.num_heads * d, self.num_kv_heads * d  # the rows of q_proj and of k_proj / v_proj
        q, k, v = (qkv[:, a:b].view(t, -1, d) for a, b in ((0, nq), (nq, nq + nk), (nq + nk, nq + 2 * nk)))
        return q, k, v, qkv[:, :nq + nk].view(t, -1, d)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v, qk = self._project(x)
        tables = (self.rotary.cos, self.rotary.sin)
        if self.q_norm is not None and qk is not None and q.is_cuda:  # both norms and RoPE in one launch
            normed = rms_norm_rope_heads(qk, self.q_norm.weight, self.q_norm.eps, positions, tables,
                                         is_neox=self.rotary.is_neox, second_weight=self.k_norm.weight,
                                         second_from=self.num_heads)
            q, k = normed[:, :self.num_heads], normed[:, self.num_heads:]
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            if q.is_cuda:  # one in-place launch for both
                rotary_embedding(positions, q, k, tables, is_neox=self.rotary.is_neox)
            else:
                q, k = apply_rotary(q, positions, self.rotary), apply_rotary(k, positions, self.rotary)
        out = ctx.attend(self.layer_idx, q, k, v, window_left=self.window_left)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_size))


class LlamaForCausalLM(CausalLM):
    """Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE (selected by ``config.architecture``)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16, parallel: ParallelState = SINGLE):
        if config.family != "llama":
            raise ValueError(f"LlamaForCausalLM serves {', '.join(LLAMA_ARCHITECTURES)}, not {config.architecture}")
        super().__init__(config, decoder_layers(config, GQAAttention, dtype, parallel), dtype, parallel)

    def post_load(self) -> None:
        super().post_load()
        tables = rotary_tables(self.config.rope, self.config.head_size, self.config.max_position, self.device)
        for layer in self.model.layers:
            layer.self_attn.rotary = tables
