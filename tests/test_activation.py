"""silu_and_mul against float64 math; the stacked weights (the MLP's gate/up, GQA's q/k/v, MLA's q_a/kv_a); bad
input."""

import pytest
import torch

from conftest import DEVICE
from tripath.models.layers import MLP
from tripath.ops.activation import BLOCK, silu_and_mul


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,inter", [(5, 64), (1, BLOCK + 37), (3, 300)])
def test_silu_and_mul_matches_float64(dtype, tokens, inter):
    x = torch.randn(tokens, 2 * inter, dtype=dtype, device=DEVICE) * 4
    gate, up = x.double()[:, :inter], x.double()[:, inter:]
    want = (gate * torch.sigmoid(gate) * up).to(dtype)
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(silu_and_mul(x), want, **tol)


def test_strided_rows():
    x = torch.randn(4, 200, device=DEVICE)[:, :128]
    want = torch.nn.functional.silu(x[:, :64]) * x[:, 64:]
    torch.testing.assert_close(silu_and_mul(x), want, atol=1e-6, rtol=1e-6)


def test_bad_input():
    with pytest.raises(ValueError, match="odd width"):
        silu_and_mul(torch.randn(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="must have 2 dimensions"):
        silu_and_mul(torch.randn(2, 3, 8, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        silu_and_mul(torch.randn(8, 4, device=DEVICE).t())


@pytest.mark.parametrize("bias", [False, True])
def test_fused_mlp_weights_are_the_linears_and_match_them(bias):
    """After fuse_weights the MLP computes what its separate linears compute, and gate/up are views of the
    stacked weight (one copy in memory, the loader's parameter names unchanged)."""
    torch.manual_seed(0)
    mlp = MLP(32, 48, bias=bias)
    x = torch.randn(5, 32)
    with torch.no_grad():
        want = mlp(x)
        mlp.fuse_weights()
        got = mlp(x)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert mlp.gate_proj.weight.data_ptr() == mlp.gate_up_weight.data_ptr()
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up_weight[48:].data_ptr()
    assert "gate_up_weight" not in mlp.state_dict()


def assert_fusing_keeps_what_reaches_attention(attn, ctx, seen: list, hidden_size: int) -> None:
    """Run the attention layer ``attn`` on one input before and after its ``fuse_weights``: what reached
    attention (``seen``, which ``ctx`` appends to) and the outputs agree."""
    x, positions = torch.randn(6, hidden_size), torch.arange(3, 9)
    with torch.no_grad():
        want = attn(x, positions, ctx)
        attn.fuse_weights()
        got = attn(x, positions, ctx)
    for a, b in zip(seen[1], seen[0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qk_norm,bias", [(True, False), (False, True)])
def test_fused_qkv_weights_are_the_projections_and_match_them(qk_norm, bias):
    """After fuse_weights the GQA attention runs one GEMM for q, k and v (Qwen3: one norm launch for both
    norms) and computes what its separate projections compute; q/k/v are views of the stacked weight."""
    import dataclasses

    from tripath.models.llama import GQAAttention
    from tripath.models.presets import tiny_qwen3
    from tripath.models.layers import rotary_tables

    config = dataclasses.replace(tiny_qwen3(), qk_norm=qk_norm, qkv_bias=bias)
    torch.manual_seed(0)
    attn = GQAAttention(config, 0, torch.float32)
    attn.rotary = rotary_tables(config.rope, config.head_size, config.max_position)
    with torch.no_grad():
        for norm in (attn.q_norm, attn.k_norm) if qk_norm else ():
            norm.weight.uniform_(0.5, 1.5)
    seen = []

    class Ctx:  # records what reaches attention; returns q as the output
        def attend(self, layer, q, k, v, **options):
            seen.append((q.clone(), k.clone(), v.clone()))
            return q

    assert_fusing_keeps_what_reaches_attention(attn, Ctx(), seen, config.hidden_size)
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    assert attn.v_proj.weight.data_ptr() == attn.qkv_weight[attn.q_proj.weight.shape[0] +
                                                           attn.k_proj.weight.shape[0]:].data_ptr()
    assert "qkv_weight" not in attn.state_dict() and "q_proj.weight" in attn.state_dict()


@pytest.mark.parametrize("bias", [False, True])
def test_fused_mla_latent_projections_are_the_linears_and_match_them(bias):
    """After fuse_weights an MLA layer with ``q_lora_rank`` runs one GEMM for ``q_a`` and ``kv_a`` and hands
    attention what its separate projections give; the two linears are views of the stacked weight. Without
    ``q_lora_rank`` there is nothing to stack."""
    import dataclasses

    from tripath.models.deepseek import MLAAttention
    from tripath.models.presets import tiny_deepseek, tiny_deepseek_v2

    config = dataclasses.replace(tiny_deepseek(), qkv_bias=bias)
    torch.manual_seed(0)
    attn = MLAAttention(config, 0, torch.float32)
    with torch.no_grad():
        attn.q_a_layernorm.weight.uniform_(0.5, 1.5)
        attn.kv_a_layernorm.weight.uniform_(0.5, 1.5)
    seen = []

    class Ctx:  # records what reaches attention; returns q_nope as the output
        def attend_mla(self, layer, q_nope, q_pe, kv_c, k_pe, positions, weights):
            seen.append((q_nope.clone(), q_pe.clone(), kv_c.clone(), k_pe.clone()))
            return q_nope[..., :config.mla.v_head_dim]

    assert_fusing_keeps_what_reaches_attention(attn, Ctx(), seen, config.hidden_size)
    assert attn.qkv_a_weight.shape == (config.q_lora_rank + config.mla.cache_width, config.hidden_size)
    assert attn.q_a_proj.weight.data_ptr() == attn.qkv_a_weight.data_ptr()
    assert attn.kv_a_proj_with_mqa.weight.data_ptr() == attn.qkv_a_weight[config.q_lora_rank:].data_ptr()
    assert "qkv_a_weight" not in attn.state_dict() and "q_a_proj.weight" in attn.state_dict()
    plain = MLAAttention(tiny_deepseek_v2(), 0, torch.float32)
    plain.fuse_weights()
    assert plain.qkv_a_weight is None
