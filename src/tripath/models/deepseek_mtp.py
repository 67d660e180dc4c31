"""DeepSeek-V3's multi-token-prediction (MTP) layer: from the target's last hidden state at position ``p`` and
the token after it, the logits of the token after that (speculative decoding's ``mtp`` method drafts with it).

A checkpoint with ``num_nextn_predict_layers = K >= 1`` stores MTP layer ``k`` as layer ``L + k`` (``L =
num_hidden_layers``): ``model.layers.{L+k}.enorm``, ``.hnorm``, ``.eh_proj``, ``.shared_head.norm`` and one full
decoder layer (``self_attn.*``, ``mlp.*`` — MoE where ``L + k`` is an MoE layer —, ``input_layernorm``,
``post_attention_layernorm``); its copies of the embedding (``embed_tokens``) and of the LM head
(``shared_head.head``) are the target's and are not loaded: the target's own serve. Only layer ``L`` (``k =
0``) is built; drafts after the first reuse it (below). With ``h_p`` the target's last hidden state at
position ``p`` *before* its final norm, ``E`` the embedding, ``t`` the tokens::

    x_p  = eh_proj([enorm(E(t_{p+1})) | hnorm(h_p)])          [T, 2H] → [T, H]   (embedding first, as stored)
    g_p  = DecoderLayer(x_p) at position p                    attention over the MTP rows 0 .. p of its own
                                                               KV cache, then the MoE / MLP; g_p before a norm
    logits(t_{p+2}) = lm_head(shared_head.norm(g_p))          the target's LM head

(The technical report writes ``[RMSNorm(h); RMSNorm(E)]``; the released weights' ``eh_proj`` takes the
embedding half first, as vLLM and SGLang read it.) The layer sits at the position of ``h_p``: its K/V row for
``(h_p, t_{p+1})`` goes to the slot of position ``p``, so it shares the target's block tables row for row.
Rotary scores depend only on position differences, so placing every row at ``p + 1`` (the position of
``t_{p+1}``) would give the same logits; ``p`` is vLLM's and SGLang's choice. (vLLM also zeroes the embedding
of the row at position 0; here that row is computed like the others.)
Drafting ``d_1 .. d_k`` after the last token ``t_n``: ``d_1`` from row ``n - 1`` (``h_{n-1}``, ``t_n``);
``d_{j+1}`` from row ``n - 1 + j`` fed ``d_j`` and, in place of the target's hidden state, the MTP's own
``g`` of the row before (one layer reused autoregressively, as vLLM does with one MTP layer).
"""

from __future__ import annotations

import torch
from torch import nn

from tripath.models.base import DecoderLayer, feed_forward
from tripath.models.config import ModelConfig
from tripath.models.deepseek import MLAAttention
from tripath.models.layers import RMSNorm
from tripath.models.parallel import SINGLE, ParallelState


class NoMTPLayer(ValueError):
    """The model has no multi-token-prediction layer (not a DeepSeek model, or ``num_nextn_predict_layers``
    0)."""


def check_has_mtp(config: ModelConfig) -> None:
    """:class:`NoMTPLayer` when ``config`` has no multi-token-prediction layer."""
    if config.family != "deepseek" or config.num_nextn_predict_layers < 1:
        raise NoMTPLayer(f"the {config.architecture} config has none (num_nextn_predict_layers="
                         f"{config.num_nextn_predict_layers}; DeepSeek-V3/R1 checkpoints have 1)")


class MTPLayer(DecoderLayer):
    """One MTP layer: the decoder layer's weights plus ``enorm``, ``hnorm``, ``eh_proj`` and
    ``shared_head.norm``. Its attention calls the step's context as layer 0 (the MTP's own cache list). Under
    ``parallel`` the decoder layer is the rank's shard, as the target's layers are; ``eh_proj`` and the norms
    are whole on every rank (their inputs and output are the replicated hidden states)."""

    def __init__(self, config: ModelConfig, layer_idx: int, dtype, parallel: ParallelState = SINGLE):
        hidden = config.hidden_size
        super().__init__(config, MLAAttention(config, 0, dtype, parallel),
                         feed_forward(config, layer_idx, dtype, parallel), dtype)
        self.enorm = RMSNorm(hidden, config.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps, dtype=dtype)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False, dtype=dtype)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, config.rms_norm_eps, dtype=dtype)

    def predict(self, embeds: torch.Tensor, previous_hidden: torch.Tensor, positions: torch.Tensor,
                ctx) -> torch.Tensor:
        """``g [T, H]`` (before ``shared_head.norm``) of ``embeds = E(t_{p+1}) [T, H]`` and ``previous_hidden
        = h_p [T, H]`` at ``positions = p [T]``."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(previous_hidden)], dim=-1))
        x, delta = self(x, None, positions, ctx)
        return x + delta


class DeepseekMTP(nn.Module):
    """The MTP layer of a DeepSeek model (``model.layers.{L}``, parameters named as in the checkpoint; under
    ``parallel``, the rank's shard).
    Attached to its target as ``target.mtp`` (:func:`tripath.models.load_model` with ``mtp=True``), which
    supplies the embedding and the LM head: :meth:`DeepseekForCausalLM.mtp_forward` / ``mtp_logits``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16, parallel: ParallelState = SINGLE):
        super().__init__()
        check_has_mtp(config)
        self.config = config
        self.parallel = parallel
        self.index = config.num_layers
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(self.index): MTPLayer(config, self.index, dtype, parallel)})

    @property
    def layer(self) -> MTPLayer:
        return self.model.layers[str(self.index)]

    @property
    def device(self) -> torch.device:
        return self.layer.eh_proj.weight.device

    def checkpoint_skips(self, name: str) -> bool:
        """Whether the checkpoint tensor ``name`` is none of this layer's (the target's tensors, later MTP
        layers, the layer's copies of the embedding and the LM head)."""
        prefix = f"model.layers.{self.index}."
        return (not name.startswith(prefix) or name.endswith("rotary_emb.inv_freq")
                or name[len(prefix):] in ("embed_tokens.weight", "shared_head.head.weight"))

    def build_weights(self, rotary) -> None:
        self.layer.self_attn.build_weights(rotary)
