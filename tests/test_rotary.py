"""rotary_embedding against complex-number rotation in float64; tables; identity rotation; bad input."""

import pytest
import torch

from conftest import DEVICE
from helpers import TOL
from tripath.ops import identity_rope_tables, rope_cos_sin, rotary_embedding


def rotate_f64(x, positions, cos, sin, is_neox):
    """Independent reference: pairs as complex numbers times e^{iθ}, float64; dims past R unchanged."""
    rot = 2 * cos.shape[1]
    pos = positions.long().clamp(0, cos.shape[0] - 1)
    e = torch.complex(cos[pos].double(), sin[pos].double())  # [T, R/2]
    xd = x.double()
    if is_neox:
        z = torch.complex(xd[..., : rot // 2], xd[..., rot // 2: rot])
    else:
        z = torch.view_as_complex(xd[..., :rot].reshape(*x.shape[:-1], rot // 2, 2).contiguous())
    z = z * e.reshape(e.shape[0], *([1] * (x.dim() - 2)), rot // 2)
    out = xd.clone()
    if is_neox:
        out[..., : rot // 2], out[..., rot // 2: rot] = z.real, z.imag
    else:
        out[..., :rot] = torch.view_as_real(z).reshape(*x.shape[:-1], rot)
    return out


def cos_sin_cache(cos, sin):
    return torch.cat([cos, sin], dim=-1)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("heads,head_size,rot", [((4, 2), 64, 64), ((3, 1), 96, 32), ((16, 16), 192, 64),
                                                 ((40, 1), 64, 64), ((4, 20), 32, 32)])  # several head blocks
def test_rotary_matches_complex_rotation(is_neox, dtype, heads, head_size, rot):
    num_tokens = 9
    cos, sin = rope_cos_sin(50, rot, base=500.0, device=DEVICE)
    positions = torch.randint(0, 50, (num_tokens,), device=DEVICE)
    q = torch.randn(num_tokens, heads[0], head_size, dtype=dtype, device=DEVICE)
    k = torch.randn(num_tokens, heads[1], head_size, dtype=dtype, device=DEVICE)
    want_q = rotate_f64(q, positions, cos, sin, is_neox)
    want_k = rotate_f64(k, positions, cos, sin, is_neox)
    q_ret, k_ret = rotary_embedding(positions, q, k, cos_sin_cache(cos, sin), is_neox=is_neox)
    assert q_ret is q and k_ret is k
    torch.testing.assert_close(q.double(), want_q, **TOL[dtype])
    torch.testing.assert_close(k.double(), want_k, **TOL[dtype])


def test_rotary_styles_differ_and_only_the_first_r_dims_move():
    positions = torch.arange(1, 6, device=DEVICE)
    cos, sin = rope_cos_sin(8, 16, device=DEVICE)
    x = torch.randn(5, 2, 48, device=DEVICE)
    neox, gptj = x.clone(), x.clone()
    rotary_embedding(positions, neox, None, cos_sin_cache(cos, sin), is_neox=True)
    rotary_embedding(positions, gptj, None, cos_sin_cache(cos, sin), is_neox=False)
    assert not torch.allclose(neox, gptj, atol=1e-3)
    assert torch.equal(neox[..., 16:], x[..., 16:]) and torch.equal(gptj[..., 16:], x[..., 16:])
    torch.testing.assert_close(gptj.double(), rotate_f64(x, positions, cos, sin, False), atol=1e-5, rtol=1e-5)


def test_rotary_two_dim_inputs_and_int32_positions():
    positions = torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE)
    cos, sin = rope_cos_sin(8, 64, device=DEVICE)
    q = torch.randn(3, 64, device=DEVICE)
    k = torch.randn(3, 64, device=DEVICE)
    want_q, want_k = (rotate_f64(t[:, None], positions, cos, sin, False)[:, 0] for t in (q, k))
    rotary_embedding(positions, q, k, cos_sin_cache(cos, sin), is_neox=False)
    torch.testing.assert_close(q.double(), want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k.double(), want_k, atol=1e-5, rtol=1e-5)


def test_rotary_separate_tables_equal_the_concatenated_cache():
    positions = torch.randint(0, 32, (7,), device=DEVICE)
    cos, sin = rope_cos_sin(32, 64, device=DEVICE)
    x = torch.randn(7, 3, 64, dtype=torch.float16, device=DEVICE)
    a, b = x.clone(), x.clone()
    rotary_embedding(positions, a, None, cos_sin_cache(cos, sin), is_neox=False)
    rotary_embedding(positions, b, None, (cos, sin), is_neox=False)
    assert torch.equal(a, b) and not torch.equal(a, x)
    with pytest.raises(ValueError, match=r"sin must have 32 columns, got shape \(32, 16\)"):
        rotary_embedding(positions, b, None, (cos, sin[:, :16].contiguous()), is_neox=False)


def test_rotary_strided_heads_rotate_in_place():
    """q_pe as a view of a wider [T, H, P + R] tensor (its last dim contiguous) is rotated where it lies."""
    positions = torch.tensor([2, 5], device=DEVICE)
    cos, sin = rope_cos_sin(8, 64, device=DEVICE)
    full = torch.randn(2, 4, 192, device=DEVICE)
    before = full.clone()
    rotary_embedding(positions, full[..., 128:], None, cos_sin_cache(cos, sin), is_neox=False)
    assert torch.equal(full[..., :128], before[..., :128])
    torch.testing.assert_close(full[..., 128:].double(), rotate_f64(before[..., 128:], positions, cos, sin, False),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("is_neox", [True, False])
def test_identity_table_leaves_values_exactly(is_neox):
    cos, sin = identity_rope_tables(64, device=DEVICE)
    assert cos.shape == (1, 32) and torch.equal(cos, torch.ones_like(cos)) and torch.equal(sin, torch.zeros_like(sin))
    positions = torch.tensor([0, 5, 4096, 123456], device=DEVICE)  # clamped into the one-row table
    q = torch.randn(4, 8, 64, dtype=torch.float16, device=DEVICE)
    k = torch.randn(4, 1, 64, dtype=torch.float16, device=DEVICE)
    q0, k0 = q.clone(), k.clone()
    rotary_embedding(positions, q, k, cos_sin_cache(cos, sin), is_neox=is_neox)
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_positions_past_the_table_use_its_last_row():
    cos, sin = rope_cos_sin(4, 16, device=DEVICE)
    x = torch.randn(2, 1, 16, device=DEVICE)
    clamped, last = x.clone(), x.clone()
    rotary_embedding(torch.tensor([100, 3], device=DEVICE), clamped, None, cos_sin_cache(cos, sin), is_neox=True)
    rotary_embedding(torch.tensor([3, 3], device=DEVICE), last, None, cos_sin_cache(cos, sin), is_neox=True)
    assert torch.equal(clamped, last)


def test_rope_tables_match_the_formula():
    cos, sin = rope_cos_sin(10, 8, base=100.0)
    pos = torch.arange(10, dtype=torch.float64)[:, None]
    inv = 100.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    torch.testing.assert_close(cos.double(), torch.cos(pos * inv), atol=1e-6, rtol=0)
    torch.testing.assert_close(sin.double(), torch.sin(pos * inv), atol=1e-6, rtol=0)
    assert cos.dtype == torch.float32 and cos.shape == (10, 4)


def test_rotary_bad_input():
    positions = torch.arange(3, device=DEVICE)
    q = torch.randn(3, 2, 64, device=DEVICE)
    table = torch.randn(8, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"cos_sin_cache must have an even number of columns \(cos \| sin\), got 63"):
        rotary_embedding(positions, q, None, table[:, :63].contiguous(), is_neox=True)
    with pytest.raises(ValueError, match="q's head size 32 is smaller than the rotary dim 64"):
        rotary_embedding(positions, q[..., :32].contiguous(), None, table, is_neox=True)
    with pytest.raises(ValueError, match=r"k has 2 tokens but positions has 3"):
        rotary_embedding(positions, q, q[:2].clone(), table, is_neox=True)
    with pytest.raises(ValueError, match="q must be contiguous in its last dimension"):
        rotary_embedding(positions, q.transpose(1, 2), None, table, is_neox=True)
    with pytest.raises(TypeError, match="positions has dtype torch.float32; supported: int32, int64"):
        rotary_embedding(positions.float(), q, None, table, is_neox=True)
    with pytest.raises(TypeError, match="is_neox must be a bool, got int"):
        rotary_embedding(positions, q, None, table, is_neox=1)
    with pytest.raises(TypeError, match="q has dtype torch.int32; supported: float16, bfloat16, float32"):
        rotary_embedding(positions, q.int(), None, table, is_neox=True)
    with pytest.raises(ValueError, match="rotary_dim must be a positive even number, got 7"):
        rope_cos_sin(4, 7)


@pytest.mark.gpu
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_bf16_large_gpu(is_neox):
    cos, sin = rope_cos_sin(8192, 64, device=DEVICE)
    positions = torch.randint(0, 8192, (4096,), device=DEVICE)
    q = torch.randn(4096, 128, 64, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(4096, 1, 64, dtype=torch.bfloat16, device=DEVICE)
    want_q = rotate_f64(q, positions, cos, sin, is_neox)
    want_k = rotate_f64(k, positions, cos, sin, is_neox)
    rotary_embedding(positions, q, k, cos_sin_cache(cos, sin), is_neox=is_neox)
    torch.testing.assert_close(q.double(), want_q, **TOL[torch.bfloat16])
    torch.testing.assert_close(k.double(), want_k, **TOL[torch.bfloat16])
