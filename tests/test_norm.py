"""rms_norm (the fused RMSNorm / residual-add kernel), rms_norm_pair (two norms in one launch) and
rms_norm_rope_heads (per-head norms of a packed QKV view, two weights, and RoPE in one launch) against float64
math; strided rows; bad input."""

import pytest
import torch

from conftest import DEVICE
from tripath.ops.norm import MAX_NORM_SIZE, norm_config, rms_norm, rms_norm_pair, rms_norm_rope_heads
from tripath.ops.rotary import rope_cos_sin


def norm_f64(x, weight, eps):
    """Independent reference in float64, rounded once to ``x``'s dtype."""
    xd = x.double()
    return (weight.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def tolerance(dtype):
    # the kernel rounds the normalised value to the activation dtype before the weight (as the models do),
    # so fp16 results sit up to about two of its ulps from the single-rounded float64 value
    return dict(atol=4e-3, rtol=4e-3) if dtype == torch.float16 else dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(7, 128), (1, 96), (5, 3, 64), (33, 300), (2, 4096)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_float64(dtype, shape, with_residual):
    x = torch.randn(shape, dtype=dtype, device=DEVICE) * 3
    weight = (1 + 0.3 * torch.randn(shape[-1])).to(dtype).to(DEVICE)
    eps = 1e-5
    if not with_residual:
        out = rms_norm(x, weight, eps)
        torch.testing.assert_close(out, norm_f64(x, weight, eps), **tolerance(dtype))
        return
    residual = torch.randn(shape, dtype=dtype, device=DEVICE)
    total, out = rms_norm(x, weight, eps, residual=residual)
    assert total.shape == out.shape == x.shape and total.dtype == out.dtype == dtype
    torch.testing.assert_close(total, (x.double() + residual.double()).to(dtype), atol=0, rtol=0)
    torch.testing.assert_close(out, norm_f64(total, weight, eps), **tolerance(dtype))


def test_rows_of_a_strided_view():
    """The latent rows of MLA are a slice ``[:, :L]`` of a wider projection: each row read at its stride."""
    wide = torch.randn(6, 80, device=DEVICE)
    x = wide[:, :64]
    weight = torch.rand(64, device=DEVICE) + 0.5
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), norm_f64(x, weight, 1e-6), **tolerance(torch.float32))


def test_several_rows_a_program_cover_every_row():
    """Narrow rows share a program: row counts that are not a multiple of BLOCK_M."""
    assert norm_config(64)["BLOCK_M"] > 1
    x = torch.randn(3 * norm_config(64)["BLOCK_M"] + 5, 64, device=DEVICE)
    weight = torch.rand(64, device=DEVICE) + 0.5
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), norm_f64(x, weight, 1e-6), **tolerance(torch.float32))


def test_zero_rows():
    x = torch.empty(0, 64, device=DEVICE)
    assert rms_norm(x, torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)


def test_bad_input():
    x, w = torch.randn(4, 64, device=DEVICE), torch.ones(64, device=DEVICE)
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(x, torch.ones(32, device=DEVICE), 1e-6)
    with pytest.raises(TypeError, match="residual has dtype"):
        rms_norm(x, w, 1e-6, residual=x.half())
    with pytest.raises(ValueError, match="residual has shape"):
        rms_norm(x, w, 1e-6, residual=torch.randn(3, 64, device=DEVICE))
    with pytest.raises(ValueError, match="eps must be positive"):
        rms_norm(x, w, 0.0)
    with pytest.raises(TypeError, match="x has dtype"):
        rms_norm(x.long(), w, 1e-6)
    with pytest.raises(ValueError, match="at most"):
        rms_norm(torch.randn(1, MAX_NORM_SIZE + 1, device=DEVICE), torch.ones(MAX_NORM_SIZE + 1, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        rms_norm(torch.randn(64, 4, device=DEVICE).t(), w, 1e-6)


def rope_f64(x, positions, cos, sin, is_neox):
    """Independent float64 rotation of the first ``2 · cos.shape[1]`` dims of each head of ``x [T, H, D]``."""
    half = cos.shape[1]
    xd = x.double().clone()
    c, s = cos.double()[positions][:, None, :], sin.double()[positions][:, None, :]
    if is_neox:
        x1, x2 = xd[..., :half].clone(), xd[..., half:2 * half].clone()
        xd[..., :half], xd[..., half:2 * half] = x1 * c - x2 * s, x2 * c + x1 * s
    else:
        x1, x2 = xd[..., 0:2 * half:2].clone(), xd[..., 1:2 * half:2].clone()
        xd[..., 0:2 * half:2], xd[..., 1:2 * half:2] = x1 * c - x2 * s, x2 * c + x1 * s
    return xd



@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,width_a,width_b", [(5, 96, 32), (33, 1536, 512), (1, 40, 200)])
def test_rms_norm_pair_matches_float64_and_the_two_norms(dtype, tokens, width_a, width_b):
    """Two column ranges of one projection's output (MLA's q_a and kv_c, the rotary columns after them left
    alone), each with its weight and eps: float64 math, and two rms_norm calls (whose sums of squares may run in
    another order: within the dtype's tolerance)."""
    packed = torch.randn(tokens, width_a + width_b + 16, dtype=dtype, device=DEVICE) * 3
    a, b = packed[:, :width_a], packed[:, width_a:width_a + width_b]
    weight_a = (1 + 0.3 * torch.randn(width_a)).to(dtype).to(DEVICE)
    weight_b = (1 + 0.3 * torch.randn(width_b)).to(dtype).to(DEVICE)
    out_a, out_b = rms_norm_pair(a, weight_a, 1e-6, b, weight_b, 1e-5)
    assert out_a.is_contiguous() and out_b.is_contiguous() and out_a.dtype == out_b.dtype == dtype
    torch.testing.assert_close(out_a, norm_f64(a, weight_a, 1e-6), **tolerance(dtype))
    torch.testing.assert_close(out_b, norm_f64(b, weight_b, 1e-5), **tolerance(dtype))
    torch.testing.assert_close(out_a, rms_norm(a, weight_a, 1e-6), **tolerance(dtype))
    torch.testing.assert_close(out_b, rms_norm(b, weight_b, 1e-5), **tolerance(dtype))


def test_rms_norm_pair_bad_input():
    a, b, wa, wb = torch.randn(4, 64), torch.randn(4, 32), torch.ones(64), torch.ones(32)
    with pytest.raises(ValueError, match="same rows"):
        rms_norm_pair(a, wa, 1e-6, torch.randn(3, 32), wb, 1e-6)
    with pytest.raises(ValueError, match="weight_b"):
        rms_norm_pair(a, wa, 1e-6, b, torch.ones(31), 1e-6)
    with pytest.raises(ValueError, match="eps_a must be positive"):
        rms_norm_pair(a, wa, 0.0, b, wb, 1e-6)
    with pytest.raises(ValueError, match="b must be contiguous in its last dimension"):
        rms_norm_pair(a, wa, 1e-6, torch.randn(32, 4).t(), wb, 1e-6)
    with pytest.raises(TypeError, match="b has dtype"):
        rms_norm_pair(a, wa, 1e-6, b.half(), wb, 1e-6)

@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_size,rotary_dim,is_neox",
                         [(7, 8, 1, 128, 128, True), (5, 4, 2, 64, 32, True), (3, 2, 2, 64, 64, False),
                          (6, 3, 1, 96, 32, False)])
def test_rms_norm_rope_heads_match_float64(dtype, tokens, q_heads, kv_heads, head_size, rotary_dim, is_neox):
    """Qwen3's q and k norms and the rotary embedding in one launch on the q and k heads of a packed QKV
    projection: the float64 norm (each head's own weight), then the float64 rotation at each token's
    position (partial rotary dims kept as normalised); positions past the table are clamped to its end;
    without a second weight, the first one for every head."""
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_size, dtype=dtype, device=DEVICE) * 3
    qk = qkv[:, :(q_heads + kv_heads) * head_size].view(tokens, -1, head_size)
    wq, wk = ((1 + 0.3 * torch.randn(head_size)).to(dtype).to(DEVICE) for _ in range(2))
    cos, sin = rope_cos_sin(64, rotary_dim, device=DEVICE)
    positions = torch.randint(0, 64, (tokens,), device=DEVICE)
    positions[0] = 90  # clamped to row 63
    out = rms_norm_rope_heads(qk, wq, 1e-6, positions, (cos, sin), is_neox=is_neox, second_weight=wk,
                              second_from=q_heads)
    assert out.shape == qk.shape and out.is_contiguous() and out.dtype == dtype
    normed = torch.cat([norm_f64(qk[:, :q_heads], wq, 1e-6), norm_f64(qk[:, q_heads:], wk, 1e-6)], dim=1)
    want = rope_f64(normed.cpu(), positions.clamp(max=63).cpu(), cos.cpu(), sin.cpu(), is_neox)
    tol = dict(atol=1.5e-2, rtol=1e-2) if dtype == torch.float16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double().cpu(), want, **tol)
    one = rms_norm_rope_heads(qk, wq, 1e-6, positions, (cos, sin), is_neox=is_neox)
    want = rope_f64(norm_f64(qk, wq, 1e-6).cpu(), positions.clamp(max=63).cpu(), cos.cpu(), sin.cpu(), is_neox)
    torch.testing.assert_close(one.double().cpu(), want, **tol)


def test_rms_norm_rope_heads_bad_input():
    x, w = torch.randn(3, 4, 64, device=DEVICE), torch.ones(64, device=DEVICE)
    pos, tables = torch.arange(3, device=DEVICE), rope_cos_sin(16, 64, device=DEVICE)
    with pytest.raises(ValueError, match="positions has shape"):
        rms_norm_rope_heads(x, w, 1e-6, pos[:2], tables, is_neox=True)
    with pytest.raises(TypeError, match="weight has dtype torch.float16; supported: float32"):
        rms_norm_rope_heads(x, w.half(), 1e-6, pos, tables, is_neox=True)
    with pytest.raises(ValueError, match="rotary dims \\(128\\) exceed the head size 64"):
        rms_norm_rope_heads(x, w, 1e-6, pos, rope_cos_sin(16, 128, device=DEVICE), is_neox=True)
    with pytest.raises(ValueError, match="cos_sin must be the pair"):
        rms_norm_rope_heads(x, w, 1e-6, pos, tables[0], is_neox=True)
    with pytest.raises(TypeError, match="is_neox must be a bool"):
        rms_norm_rope_heads(x, w, 1e-6, pos, tables, is_neox=1)
    with pytest.raises(ValueError, match="x must have 3 dimensions"):
        rms_norm_rope_heads(x[0], w, 1e-6, pos, tables, is_neox=True)
    with pytest.raises(ValueError, match="second_weight has shape"):
        rms_norm_rope_heads(x, w, 1e-6, pos, tables, is_neox=True, second_weight=w[:32], second_from=2)
    with pytest.raises(ValueError, match="second_from must be a head index in \\[0, 4\\]"):
        rms_norm_rope_heads(x, w, 1e-6, pos, tables, is_neox=True, second_weight=w, second_from=9)
    with pytest.raises(ValueError, match="without second_weight"):
        rms_norm_rope_heads(x, w, 1e-6, pos, tables, is_neox=True, second_from=2)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        rms_norm_rope_heads(torch.randn(3, 64, 4, device=DEVICE).transpose(1, 2), w, 1e-6, pos, tables,
                            is_neox=True)
    with pytest.raises(ValueError, match="eps must be positive"):
        rms_norm_rope_heads(x, w, -1.0, pos, tables, is_neox=True)
