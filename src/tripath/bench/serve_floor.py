"""The roofline floor of a ``tripath bench serve`` pass: the least time the GPU needs for its work.

::

    floor = prefill FLOPs / matmul rate + Σ over decode steps (weight bytes + KV bytes read) / copy bandwidth

Prefill FLOPs are 2 × active parameters (embedding table and LM head excluded) per prompt token, 2 × the LM
head's parameters once per prompt (logits are computed for a prompt's last token only), plus causal
attention (``2 · heads · (d_qk + d_v)`` per query-key pair and layer); a decode step reads every weight but the
embedding table (the LM head included) and the KV cache of each decoding request. The matmul rate and copy
bandwidth are measured in the same process (:func:`measure_ceilings`: an 8192³ bf16 matmul, a 1 GiB
device-to-device copy).
"""

from __future__ import annotations

from typing import Sequence


def model_costs(model, backend) -> dict:
    """Active parameters of the layers (without the embedding table and the LM head), the LM head's
    parameters, weight bytes a decode step reads (the LM head included), KV bytes per token, and the
    attention FLOPs per causal query-key pair (all layers)."""
    config = model.config
    embed = model.model.embed_tokens.weight
    head = embed if model.lm_head is None else model.lm_head.weight
    total = active = weight_bytes = 0
    moe = getattr(config, "moe", None)
    for name, param in model.named_parameters():
        n = param.numel()
        if param is embed or param is head:
            if param is head:  # read by every decode step; multiplies one token of each prompt
                weight_bytes += n * param.element_size()
            continue
        share = 1.0
        if moe is not None and ".experts." in f".{name}." and "shared_experts" not in name:
            share = moe.top_k / moe.num_experts
        total += n
        active += n * share
        weight_bytes += n * param.element_size()
    spec = backend.spec
    if spec.is_mla:
        mla = spec.mla
        head_dims = mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim
    else:
        head_dims = spec.head_size + spec.v_size
    layers = model.num_attention_layers
    return {"active_params": active, "params": total, "head_params": head.numel(), "weight_bytes": weight_bytes,
            "kv_bytes_per_token": backend.cache_bytes_per_block() // spec.block_size * layers,
            "attention_flops_per_pair": 2 * spec.num_heads * head_dims * layers}


def roofline_floor_s(costs: dict, prompts: Sequence[Sequence[int]], decode_steps: Sequence[tuple[int, int]],
                     matmul_flops: float, copy_bytes_per_s: float) -> float:
    """Seconds the hardware needs at least for one pass (see the module doc)."""
    prefill_flops = sum(2 * costs["active_params"] * len(p) + 2 * costs["head_params"] +
                        costs["attention_flops_per_pair"] * len(p) * (len(p) + 1) / 2 for p in prompts)
    decode_bytes = sum(costs["weight_bytes"] + costs["kv_bytes_per_token"] * kv for _, kv in decode_steps)
    return prefill_flops / matmul_flops + decode_bytes / copy_bytes_per_s


def measure_ceilings(device) -> tuple[float, float]:
    """(bf16 matmul FLOP/s of an 8192³ product, device-to-device copy bytes/s counting read + write), medians."""
    import torch
    import triton.testing

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    flops = 2 * 8192 ** 3 / (ms * 1e-3)
    src = torch.empty(2 ** 30 // 2, device=device, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=20, rep=200, return_mode="median")
    return flops, 2 * src.numel() * src.element_size() / (ms * 1e-3)
