"""MLA decoder models: DeepSeek V2/V3/R1 and Kimi K2 (V3 layout), with or without ``q_lora_rank``, yarn RoPE,
MoE with shared experts after ``first_k_dense_replace`` dense layers, and a NoPE option (Kimi-style, no
rotary embedding: the backend gets ``rotary=None`` and applies the identity rotation).

Dims: heads ``H``, latent ``L = kv_lora_rank``, rotary ``R``, no-position ``P``, value ``V``. Per layer::

    q            = x·Wqᵀ   or  q_b(norm(q_a(x)))              [T, H, P + R]  → q_nope [T,H,P], q_pe [T,H,R]
    [kv_c|k_pe]  = x·W_kv_aᵀ                                  [T, L + R];     kv_c ← RMSNorm(kv_c)
    out          = ctx.attend_mla(layer, q_nope, q_pe, kv_c, k_pe, positions, weights)          [T, H, V]
    y            = out·Woᵀ

With ``q_lora_rank``, once the weights are loaded (:meth:`MLAAttention.fuse_weights`) ``W_q_a`` and ``W_kv_a``
(both read ``x``) are stacked into one ``[q_lora_rank + L + R, hidden]`` weight, so a step runs one GEMM for the
two and ``q_a``, ``kv_c`` and ``k_pe`` are views of its output; on a GPU one launch normalises ``q_a`` and
``kv_c`` (:func:`tripath.ops.norm.rms_norm_pair`).

``kv_b_proj`` ``[H·(P+V), L]`` is split once into ``W_UK [H, P, L]`` (``k_nope_h = W_UK[h]·kv_c``) and
``W_UV [H, L, V]`` (``v_h = kv_c·W_UV[h]``). ``q_pe``/``k_pe`` go to the backend UNROTATED with the rotary
tables (GPT-J pairs unless ``rope_interleave`` is false); the score is
``sm_scale · (q_nope·k_nope + rope(q_pe)·rope(k_pe))`` with ``sm_scale = mscale² / sqrt(P + R)``.

Under tensor parallelism (:mod:`tripath.models.parallel`) ``H`` is the rank's share of the heads
(``q_proj``/``q_b_proj`` and ``kv_b_proj`` split by head, ``o_proj`` all-reduces); the latent projections are
replicated, so every rank caches the full latent rows.

A model loaded with its multi-token-prediction layer (``load_model(..., mtp=True)``) holds it as ``mtp``
(:class:`~tripath.models.deepseek_mtp.DeepseekMTP`); :meth:`DeepseekForCausalLM.mtp_forward` and
:meth:`~DeepseekForCausalLM.mtp_logits` run it with this model's embedding and LM head.
"""

from __future__ import annotations

import torch
from torch import nn

from tripath.attention.spec import MLALayerWeights
from tripath.models.base import CausalLM, decoder_layers
from tripath.models.config import DEEPSEEK_ARCHITECTURES, ModelConfig
from tripath.models.layers import RMSNorm, rotary_tables, stack_linears
from tripath.models.parallel import SINGLE, ColumnParallelLinear, HeadSplit, ParallelState, RowParallelLinear
from tripath.ops.linear import linear
from tripath.ops.norm import rms_norm_pair, rms_norm_pair_ref


class MLAAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype, parallel: ParallelState = SINGLE):
        super().__init__()
        mla, hidden, heads = config.mla, config.hidden_size, config.num_heads
        split = HeadSplit.of(parallel, heads, 1)
        self.layer_idx, self.num_heads, self.mla = layer_idx, split.num_heads, mla
        qk_size, kv_b_size = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.qk_nope_head_dim + mla.v_head_dim
        if config.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=config.qkv_bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps, dtype=dtype)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, heads * qk_size, bias=False, dtype=dtype,
                                                 rows=split.q_rows(qk_size))
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_size, bias=False, dtype=dtype,
                                               rows=split.q_rows(qk_size))
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.cache_width, bias=config.qkv_bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, config.rms_norm_eps, dtype=dtype)
        self.kv_b_proj = ColumnParallelLinear(mla.kv_lora_rank, heads * kv_b_size, bias=False, dtype=dtype,
                                              rows=split.q_rows(kv_b_size))
        self.o_proj = RowParallelLinear(heads * mla.v_head_dim, hidden, bias=config.o_bias, dtype=dtype,
                                        parallel=parallel, what="num_attention_heads * v_head_dim")
        self.weights: MLALayerWeights | None = None  # built by build_weights() once kv_b_proj is loaded
        self.register_buffer("qkv_a_weight", None, persistent=False)  # set by fuse_weights
        self.register_buffer("qkv_a_bias", None, persistent=False)

    def fuse_weights(self) -> None:
        """With ``q_lora_rank``: one weight (and bias) ``[q_lora_rank + L + R, hidden]`` for ``q_a_proj`` and
        ``kv_a_proj_with_mqa``, whose parameters become views of its row blocks."""
        if hasattr(self, "q_a_proj"):
            weight, bias = stack_linears((self.q_a_proj, self.kv_a_proj_with_mqa))
            self.register_buffer("qkv_a_weight", weight, persistent=False)
            self.register_buffer("qkv_a_bias", bias, persistent=False)

    def build_weights(self, rotary) -> None:
        """``W_UK [H, P, L]`` and ``W_UV [H, L, V]`` as views of ``kv_b_proj``'s weight."""
        self.weights = MLALayerWeights.from_kv_b_proj(self.kv_b_proj.weight.detach(), self.num_heads,
                                                      self.mla.qk_nope_head_dim, rotary=rotary)

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q [T, H·(P + R)]``, the normalised ``kv_c [T, L]`` and ``k_pe [T, R]``; with fused weights one GEMM
        makes ``q_a``, ``kv_c`` and ``k_pe``, and one launch normalises ``q_a`` and ``kv_c``."""
        mla = self.mla
        if self.qkv_a_weight is None:
            kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
            return self.project_q(x), self.kv_a_layernorm(kv_c), k_pe
        q_a, kv_c, k_pe = linear(x, self.qkv_a_weight, self.qkv_a_bias).split(
            [self.q_a_proj.out_features, mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        q_norm, kv_norm = self.q_a_layernorm, self.kv_a_layernorm
        q_a, kv_c = (rms_norm_pair if x.is_cuda else rms_norm_pair_ref)(q_a, q_norm.weight, q_norm.eps, kv_c,
                                                                        kv_norm.weight, kv_norm.eps)
        return self.q_b_proj(q_a), kv_c, k_pe

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        mla, num_tokens = self.mla, x.shape[0]
        q, kv_c, k_pe = self._project(x)
        q = q.view(num_tokens, self.num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        out = ctx.attend_mla(self.layer_idx, q_nope, q_pe, kv_c, k_pe, positions, self.weights)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * mla.v_head_dim))


class DeepseekForCausalLM(CausalLM):
    """DeepSeek V2 / V3 / R1, Kimi K2 and NoPE-MLA variants (selected by the config)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16, parallel: ParallelState = SINGLE):
        if config.family != "deepseek":
            raise ValueError(f"DeepseekForCausalLM serves {', '.join(DEEPSEEK_ARCHITECTURES)}, "
                             f"not {config.architecture}")
        super().__init__(config, decoder_layers(config, MLAAttention, dtype, parallel), dtype, parallel)
        self.mtp = None   # the DeepseekMTP layer, when loaded (load_model(..., mtp=True))

    def post_load(self) -> None:
        super().post_load()
        config = self.config
        tables = None
        if config.rope is not None:
            tables = rotary_tables(config.rope, config.mla.qk_rope_head_dim, config.max_position, self.device)
        for layer in self.model.layers:
            layer.self_attn.build_weights(tables)
        if self.mtp is not None:
            self.mtp.build_weights(tables)

    def mtp_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, previous_hidden: torch.Tensor,
                    ctx) -> torch.Tensor:
        """The MTP layer's ``g [T, H]`` (before its ``shared_head.norm``) for the tokens ``t_{p+1} =
        input_ids [T]`` after the hidden states ``h_p = previous_hidden [T, H]`` (this model's, before the final
        norm, or the MTP's own ``g`` of the row before) at ``positions = p [T]``; ``ctx`` holds the MTP's own
        cache as layer 0."""
        return self.mtp.layer.predict(self.model.embed_tokens(input_ids), previous_hidden, positions, ctx)

    def mtp_logits(self, g: torch.Tensor, *, upcast: bool = True) -> torch.Tensor:
        """``[N, vocab]`` logits of the token after next from the MTP's ``g [N, H]``: this model's LM head after
        the MTP's ``shared_head.norm``."""
        return self.compute_logits(self.mtp.layer.shared_head.norm(g), upcast=upcast)

    def mtp_greedy(self, g: torch.Tensor, *, fused: bool = False) -> torch.Tensor:
        """``[N]`` greedy tokens of :meth:`mtp_logits`: their argmax, or with ``fused`` drawn by the LM head
        without writing the logits (:meth:`sample_tokens`; a near tie may resolve the other way)."""
        if fused:
            return self.sample_tokens(self.mtp.layer.shared_head.norm(g)).tokens
        return self.mtp_logits(g, upcast=False).argmax(dim=-1)
