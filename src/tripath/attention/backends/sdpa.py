"""``sdpa``: PyTorch's ``scaled_dot_product_attention``, request by request — the CPU path.

The reference backend (:mod:`~tripath.attention.backends.torch_ref`) spells attention out in fp32 and holds
each request's whole score matrix ``[H, Sq, Sk]`` (a 2K-token prompt of a 9-head model: 150 MB, and most of a
CPU prefill's time). This backend reads the cache and writes it as the reference does, and hands each request
to ``F.scaled_dot_product_attention`` in the model's dtype: query ``i`` at position ``q_start + i`` sees the
keys at positions ``<= q_start + i`` (bottom-right causal; a plain causal mask when there is no context), and
within ``window_left`` of it; GQA by ``enable_gqa``. PyTorch's fused CPU kernel walks the keys in blocks
with an online softmax, so no score matrix is held. Requests of a layer with softcap, ALiBi or sinks, which
the fused kernel does not take, go through the reference's math. MHA and MLA (non-absorbed, as the
reference); any device, no Triton, no CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tripath.attention.backends.base import Capabilities, GraphSupport
from tripath.attention.backends.torch_ref import TorchBackend


class SdpaBackend(TorchBackend):
    name = "sdpa"
    capabilities = Capabilities(mla=True, needs_triton=False, graphs=GraphSupport.NONE)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, q_start: int, sm_scale: float,
                window_left: int = -1, softcap: float = 0.0, alibi_slopes=None, sinks=None) -> torch.Tensor:
        if softcap > 0 or alibi_slopes is not None or sinks is not None:
            return super()._attend(q, keys, values, q_start=q_start, sm_scale=sm_scale, window_left=window_left,
                                   softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
        num_queries, num_keys = q.shape[0], keys.shape[0]
        dtype = q.dtype
        mask, causal = None, q_start == 0 and num_keys == num_queries and window_left < 0
        if not causal:
            query_pos = torch.arange(q_start, q_start + num_queries, device=q.device)[:, None]
            key_pos = torch.arange(num_keys, device=q.device)[None, :]
            mask = key_pos <= query_pos
            if window_left >= 0:
                mask &= query_pos - key_pos <= window_left
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.to(dtype).transpose(0, 1)[None], values.to(dtype).transpose(0, 1)[None],
            attn_mask=mask, is_causal=causal, scale=sm_scale, enable_gqa=keys.shape[1] != q.shape[1])
        return out[0].transpose(0, 1)
