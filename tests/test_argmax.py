"""argmax_rows against torch.argmax: random rows, ties, -inf rows, NaN, every split count; bad input."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import DEVICE
from tripath.ops.argmax import BLOCK, MIN_CHUNK, argmax_rows, argmax_splits


def _ties(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Copies each row's maximum to a few random later and earlier columns: the first must win."""
    n, v = x.shape
    for r in range(n):
        cols = torch.randint(0, v, (3,), generator=gen)
        x[r, cols] = x[r].max()
    return x


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), vocab=st.integers(1, 3 * MIN_CHUNK + 77), seed=st.integers(0, 2 ** 31 - 1),
       dtype=st.sampled_from([torch.float16, torch.float32]), ties=st.booleans())
def test_matches_torch_argmax(rows, vocab, seed, dtype, ties):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=gen) * 8).to(dtype)
    if ties:
        x = _ties(x, gen)
    x = x.to(DEVICE)
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert got.tolist() == x.float().argmax(dim=-1).tolist()


@pytest.mark.parametrize("rows", [1, 40])
def test_every_split_of_a_wide_row(rows):
    """A row wider than a chunk splits; its maximum in the last chunk, at a chunk border, or in the first."""
    vocab = 5 * MIN_CHUNK + 3
    chunk, splits = argmax_splits(rows, vocab, 132)
    assert splits > 1 and chunk % BLOCK == 0 and (splits - 1) * chunk < vocab <= splits * chunk
    x = torch.randn(3, vocab)
    x[0, vocab - 1], x[1, chunk], x[2, 0] = 50.0, 50.0, 50.0
    assert argmax_rows(x.to(DEVICE)).tolist() == [vocab - 1, chunk, 0]


def test_rows_of_minus_infinity_and_nan():
    x = torch.randn(3, 2 * MIN_CHUNK)
    x[0] = float("-inf")                      # every token banned: column 0, as torch.argmax
    x[1, 7000], x[1, 30] = float("nan"), 40.0  # a NaN counts as +inf
    x[2, 9], x[2, 5000] = float("inf"), float("nan")  # +inf first, then a NaN: the first of the two
    assert argmax_rows(x.to(DEVICE)).tolist() == [0, 7000, 9]


def test_strided_rows_and_empty_batch():
    x = torch.randn(4, 3000)
    view = x[:, 100:2600]
    assert argmax_rows(view.to(DEVICE)).tolist() == view.argmax(-1).tolist()
    wide = torch.randn(6, 2000)[::2]  # every other row of a larger tensor
    assert argmax_rows(wide.to(DEVICE)).tolist() == wide.argmax(-1).tolist()
    assert argmax_rows(torch.randn(0, 50, device=DEVICE)).shape == (0,)


def test_bad_input():
    with pytest.raises(ValueError, match="logits must have 2 dimensions"):
        argmax_rows(torch.randn(8, device=DEVICE))
    with pytest.raises(TypeError, match="logits has dtype torch.int64"):
        argmax_rows(torch.ones(2, 8, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        argmax_rows(torch.randn(8, 4, device=DEVICE).t())
    with pytest.raises(ValueError, match="at least one column"):
        argmax_rows(torch.randn(2, 0, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 256])
@pytest.mark.parametrize("vocab", [151936, 129280, 32000])
def test_gpu_bf16_vocabularies(rows, vocab):
    """The presets' vocabularies in bf16 (many exact ties among rounded values: the first must win)."""
    x = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
