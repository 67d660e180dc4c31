"""A tiny stand-in causal LM for engine tests, with a dense no-cache reference generator.

``TinyAttentionLM``: token + learned position embeddings, ``num_layers`` GQA attention blocks that call
``ctx.attend`` (so the paged cache and the backend do the attention), an LM head. ``reference_greedy``
recomputes the whole sequence every token with plain causal softmax attention in float64 — it shares the
weights but no engine, planner, cache or backend code.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from tripath.attention import AttentionSpec


class TinyAttentionLM(nn.Module):
    def __init__(self, vocab_size=61, hidden=64, num_heads=4, num_kv_heads=2, head_size=32, num_layers=2,
                 max_position=512, dtype=torch.float32, eos_token_ids=()):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab_size, num_layers=num_layers, max_position=max_position,
                                      eos_token_ids=list(eos_token_ids))
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        g = torch.Generator().manual_seed(1234)

        def param(*shape, scale):
            return nn.Parameter((torch.randn(*shape, generator=g) * scale).to(dtype))

        qkv = (num_heads + 2 * num_kv_heads) * head_size
        self.embed = param(vocab_size, hidden, scale=1.0)
        self.pos = param(max_position, hidden, scale=1.0)
        self.w_qkv = nn.ParameterList([param(hidden, qkv, scale=hidden ** -0.5 * 2) for _ in range(num_layers)])
        self.w_o = nn.ParameterList([param(num_heads * head_size, hidden, scale=(num_heads * head_size) ** -0.5)
                                     for _ in range(num_layers)])
        self.w_head = param(hidden, vocab_size, scale=hidden ** -0.5 * 3)

    @property
    def num_attention_layers(self) -> int:
        return len(self.w_qkv)

    def attention_spec(self, *, block_size=16, kv_cache_dtype="auto", kv_layout="nhd", dtype=None, **options):
        return AttentionSpec(self.num_heads, self.num_kv_heads, self.head_size, dtype=dtype or self.embed.dtype,
                             kv_cache_dtype=kv_cache_dtype, block_size=block_size, kv_layout=kv_layout, **options)

    def _split(self, x, layer):
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_size
        qkv = x @ self.w_qkv[layer]
        q, k, v = qkv.split([h * d, kv * d, kv * d], dim=-1)
        return q.view(-1, h, d), k.view(-1, kv, d), v.view(-1, kv, d)

    def forward(self, input_ids, positions, ctx):
        x = self.embed[input_ids] + self.pos[positions]
        for layer in range(self.num_attention_layers):
            q, k, v = self._split(x, layer)
            attn = ctx.attend(layer, q, k, v)
            x = x + attn.reshape(x.shape[0], -1) @ self.w_o[layer]
        return x

    def compute_logits(self, hidden):
        return (hidden @ self.w_head).float()

    @torch.no_grad()
    def reference_logits(self, tokens: list[int]) -> torch.Tensor:
        """``[len(tokens), vocab]`` float64 logits of the whole sequence, recomputed densely."""
        w = {name: p.double() for name, p in self.named_parameters()}
        group = self.num_heads // self.num_kv_heads
        device = self.embed.device
        ids = torch.tensor(tokens, device=device)
        n = len(tokens)
        x = w["embed"][ids] + w["pos"][torch.arange(n, device=device)]
        for layer in range(self.num_attention_layers):
            h, kv, d = self.num_heads, self.num_kv_heads, self.head_size
            q, k, v = (x @ w[f"w_qkv.{layer}"]).split([h * d, kv * d, kv * d], dim=-1)
            q = q.view(-1, h, d)
            k = k.view(-1, kv, d).repeat_interleave(group, dim=1)
            v = v.view(-1, kv, d).repeat_interleave(group, dim=1)
            s = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=device).triu(1), float("-inf"))
            attn = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
            x = x + attn.reshape(n, -1) @ w[f"w_o.{layer}"]
        return (x @ w["w_head"]).cpu()

    def reference_greedy(self, prompt: list[int], max_tokens: int, transform=None) -> list[int]:
        """Greedy tokens recomputed densely; ``transform(logits [V] float64, outputs so far)`` changes each
        step's logits first."""
        tokens = list(prompt)
        for _ in range(max_tokens):
            logits = self.reference_logits(tokens)[-1]
            if transform is not None:
                logits = transform(logits, tokens[len(prompt):])
            tokens.append(int(logits.argmax()))
        return tokens[len(prompt):]


class CharTokenizer:
    """Characters ``a..z`` and space as ids 1..27 (0 unused); enough to test text prompts."""

    alphabet = " abcdefghijklmnopqrstuvwxyz"

    def encode(self, text: str) -> list[int]:
        return [self.alphabet.index(c) + 1 for c in text.lower() if c in self.alphabet]

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(self.alphabet[i - 1] if 1 <= i <= len(self.alphabet) else "?" for i in ids)


def tiny_model(**kw) -> TinyAttentionLM:
    return TinyAttentionLM(**kw).eval()
