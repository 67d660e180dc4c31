"""The fused LM head and draw (ops/lm_head_sample.py, kernels/lm_head_sample.py) against float64 references: greedy
tokens (ties to the lowest id, as torch.argmax), the LSE and the token's log-probability, the Gumbel draw's law
(chi-square against softmax), its noise (Philox as tl.philox and Random123 compute it), the merge of vocabulary
shards, and bad input."""

import math

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE

from tripath.kernels.lm_head_sample import gumbel_noise, round_to
from tripath.ops.lm_head_sample import (SampleDraw, draw_ref, gumbel_noise_ref, lm_head_sample, lm_head_sample_ref,
                                        logits_sample, merge_draws, philox_ref)

HIDDEN = 80        # not a multiple of the interpreter's 32-wide K steps: the masked K tail runs
VOCAB = 300        # not a multiple of the 64-token tiles


def _rows(m: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(m, generator=g) + 0.3, torch.randint(-2 ** 62, 2 ** 62, (m,), generator=g),
            torch.randint(0, 100_000, (m,), generator=g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_rows", [1, 3, 17])
def test_greedy_tokens_and_lse_match_float64(dtype, num_rows):
    hidden = torch.randn(num_rows, HIDDEN).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN) * HIDDEN ** -0.5).to(dtype)
    draw = lm_head_sample(hidden, weight)
    z64 = hidden.double() @ weight.double().t()
    z = z64.to(dtype).double()   # the logits in the LM head's dtype, exactly rounded
    assert torch.equal(draw.tokens, z.argmax(dim=1))
    lse = torch.logsumexp(z, dim=1)
    tol = 1e-5 if dtype is torch.float32 else 2e-3
    torch.testing.assert_close(draw.lse.double(), lse, atol=tol, rtol=tol)
    torch.testing.assert_close(draw.logprobs.double(), (z - lse[:, None]).gather(1, draw.tokens[:, None])[:, 0],
                               atol=tol, rtol=tol)
    assert torch.equal(draw.tokens, lm_head_sample_ref(hidden, weight).tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ties_go_to_the_lowest_id_across_tiles(dtype):
    """Rows 10, 70 (another tile) and 250 have the same weights and the largest logit: token 10, as torch.argmax."""
    hidden = torch.randint(1, 4, (3, HIDDEN)).to(dtype)
    weight = (torch.rand(VOCAB, HIDDEN) * 0.01).to(dtype)
    weight[[250, 70, 10]] = 1.0
    assert torch.equal(lm_head_sample(hidden, weight).tokens, torch.full((3,), 10))
    logits = torch.nn.functional.linear(hidden, weight)
    assert torch.equal(logits_sample(logits).tokens, logits.argmax(dim=1))
    assert torch.equal(logits.argmax(dim=1), torch.full((3,), 10))


def test_philox_is_random123s_and_triton_s():
    assert int(philox_ref(torch.tensor(0), torch.tensor(0), torch.tensor(0))) == 0x6627E8D5   # the zero KAT

    @triton.jit
    def noise(seed_ptr, pos_ptr, x_ptr, g_ptr, V: tl.constexpr, M: tl.constexpr):
        v, m = tl.arange(0, V), tl.arange(0, M)
        seed, pos = tl.load(seed_ptr + m), tl.load(pos_ptr + m)
        zero = (v[:, None] * 0).to(tl.uint32) + (pos[None, :] * 0).to(tl.uint32)
        x, _, _, _ = tl.philox(seed[None, :], v[:, None].to(tl.uint32) + zero, pos[None, :].to(tl.uint32) + zero,
                               zero, zero)
        tl.store(x_ptr + v[:, None] * M + m[None, :], x.to(tl.int64))
        tl.store(g_ptr + v[:, None] * M + m[None, :], gumbel_noise(seed[None, :], pos[None, :], v[:, None]))

    seeds = torch.tensor([0, -1, 2 ** 40 + 7, -(2 ** 62)])
    positions = torch.tensor([0, 5, 2 ** 31, 123456])
    x, g = torch.empty(64, 4, dtype=torch.int64, device=DEVICE), torch.empty(64, 4, device=DEVICE)
    noise[(1,)](seeds.to(DEVICE), positions.to(DEVICE), x, g, V=64, M=4)
    x, g = x.cpu(), g.cpu()
    assert torch.equal(philox_ref(seeds[:, None], torch.arange(64)[None, :], positions[:, None]).t(), x & 0xFFFFFFFF)
    torch.testing.assert_close(gumbel_noise_ref(seeds, positions, torch.arange(64)).t(), g, atol=1e-6, rtol=1e-6)


def test_the_kernels_float16_rounding_is_torch_s():
    """The accumulator is rounded to float16 on its bits (sm_90's wgmma pipeline): the same value as a
    conversion, normal, subnormal, tied, overflowing and infinite inputs alike."""
    @triton.jit
    def rounded(x_ptr, y_ptr, N: tl.constexpr):
        at = tl.arange(0, N)
        tl.store(y_ptr + at, round_to(tl.load(x_ptr + at), tl.float16))

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(512, generator=g) * s for s in (1e-7, 1e-5, 1e-3, 1.0, 100.0, 3e4, 7e4)]
                  + [torch.tensor([65504.0, 65519.0, 65520.0, -65520.0, 2.0 ** -14, 2.0 ** -25, 3 * 2.0 ** -25,
                                   1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, float("inf"), -float("inf"), 0.0])])
    x = torch.cat([x, torch.zeros(4096 - x.numel())])
    x = x.to(DEVICE)
    y = torch.full_like(x, float("nan"))
    rounded[(1,)](x, y, N=4096)
    assert torch.equal(y, x.half().float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_rows", [1, 3, 17])
def test_sampled_rows_draw_the_reference_s_tokens(dtype, num_rows):
    hidden = torch.randn(num_rows, HIDDEN).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN) * HIDDEN ** -0.5).to(dtype)
    temperature, seeds, positions = _rows(num_rows)
    temperature[0] = 0.0   # a greedy row in a sampled launch keeps its argmax
    draw = lm_head_sample(hidden, weight, temperature, seeds, positions)
    ref = lm_head_sample_ref(hidden, weight, temperature, seeds, positions)
    assert torch.equal(draw.tokens, ref.tokens)
    assert draw.tokens[0] == torch.nn.functional.linear(hidden, weight)[0].float().argmax()
    torch.testing.assert_close(draw.lse, ref.lse, atol=1e-4, rtol=1e-4)
    logits = torch.nn.functional.linear(hidden, weight)
    assert torch.equal(logits_sample(logits, temperature, seeds, positions).tokens, ref.tokens)


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_999 = {5: 20.52}   # chi-square quantile 0.999 for 5 degrees of freedom


def test_the_draw_follows_softmax_of_logits_over_temperature():
    """Six tokens, 20000 draws at consecutive positions (and at one position over 20000 seeds): chi-square
    against softmax(z / t) below its 0.999 quantile; and greedy's token for a shifted law is rejected."""
    z = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0])
    t = 0.7
    n = 20000
    probs = torch.softmax(z / t, dim=0)
    logits = z.expand(n, -1)
    temperature = torch.full((n,), t)
    by_position = draw_ref(logits, temperature, torch.full((n,), 1234), torch.arange(n)).tokens
    by_seed = draw_ref(logits, temperature, torch.arange(n) * 7919 - 2 ** 40, torch.full((n,), 99)).tokens
    assert _chi_square(by_position, probs) < CHI2_999[5]
    assert _chi_square(by_seed, probs) < CHI2_999[5]
    assert _chi_square(by_position, torch.softmax(z / 1.0, dim=0)) > 100   # the test can tell temperatures apart
    # the kernels draw the same tokens from the same noise (a slice, the interpreter being slow)
    kernel = logits_sample(logits[:200].contiguous(), temperature[:200], torch.full((200,), 1234), torch.arange(200))
    assert torch.equal(kernel.tokens, by_position[:200])


def test_a_row_s_token_depends_only_on_its_seed_and_position():
    hidden = torch.randn(5, HIDDEN)
    weight = torch.randn(VOCAB, HIDDEN) * HIDDEN ** -0.5
    temperature, seeds, positions = _rows(5, seed=3)
    temperature.fill_(5.0)   # a flat law: the noise decides
    alone = torch.cat([lm_head_sample(hidden[i:i + 1], weight, temperature[i:i + 1], seeds[i:i + 1],
                                      positions[i:i + 1]).tokens for i in range(5)])
    order = torch.tensor([3, 0, 4, 1, 2])
    batch = lm_head_sample(hidden[order], weight, temperature[order], seeds[order], positions[order]).tokens
    assert torch.equal(batch, alone[order])
    moved = lm_head_sample(hidden, weight, temperature, seeds, positions + 1).tokens
    assert not torch.equal(moved, alone)


@pytest.mark.parametrize("sampled", [False, True])
def test_vocabulary_shards_merge_into_the_whole_draw(sampled):
    """Tensor parallelism: three ranks' shards of ceil(300 / 3) = 100 rows (the last one with zero padding
    and a shorter vocabulary) drawn apart and merged equal the draw over the whole vocabulary."""
    vocab = 290
    hidden = torch.randn(4, HIDDEN)
    weight = torch.randn(vocab, HIDDEN) * HIDDEN ** -0.5
    rows = _rows(4, seed=5) if sampled else (None, None, None)
    whole = lm_head_sample(hidden, weight, *rows)
    draws = []
    for rank in range(3):
        start, stop = min(rank * 100, vocab), min((rank + 1) * 100, vocab)
        shard = torch.zeros(100, HIDDEN)
        shard[:stop - start] = weight[start:stop]
        draws.append(lm_head_sample(hidden, shard, *rows, vocab_valid=stop - start, vocab_offset=start))
    merged = merge_draws(draws)
    assert torch.equal(merged.tokens, whole.tokens)
    torch.testing.assert_close(merged.lse, whole.lse)
    torch.testing.assert_close(merged.logprobs, whole.logprobs)
    empty = draw_ref(torch.empty(4, 0), vocab_offset=vocab)   # a rank past the vocabulary's end
    assert torch.equal(merge_draws(draws + [empty]).tokens, whole.tokens)


def test_bad_input_names_the_argument():
    hidden, weight = torch.randn(2, HIDDEN), torch.randn(VOCAB, HIDDEN)
    with pytest.raises(TypeError, match="hidden has dtype torch.int64"):
        lm_head_sample(hidden.long(), weight)
    with pytest.raises(TypeError, match="weight has dtype torch.float16"):
        lm_head_sample(hidden, weight.half())
    with pytest.raises(ValueError, match="weight has shape .* dimension 1 must be 80"):
        lm_head_sample(hidden, weight[:, :64])
    with pytest.raises(ValueError, match="hidden must have 2 dimensions"):
        lm_head_sample(hidden[0], weight)
    with pytest.raises(ValueError, match="temperature needs seeds and positions"):
        lm_head_sample(hidden, weight, torch.ones(2))
    with pytest.raises(ValueError, match="positions has shape"):
        lm_head_sample(hidden, weight, torch.ones(2), torch.zeros(2, dtype=torch.int64),
                       torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="seeds has dtype torch.int32"):
        lm_head_sample(hidden, weight, torch.ones(2), torch.zeros(2, dtype=torch.int32),
                       torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="vocab_valid=301"):
        lm_head_sample(hidden, weight, vocab_valid=VOCAB + 1)
    with pytest.raises(ValueError, match="contiguous"):
        lm_head_sample(hidden, weight.t().contiguous().t())
    with pytest.raises(TypeError, match="logits has dtype"):
        logits_sample(torch.zeros(2, 4, dtype=torch.int32))
    assert isinstance(lm_head_sample(hidden[:0], weight), SampleDraw)
    assert math.isinf(float(draw_ref(torch.empty(1, 0)).lse[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("vocab, hidden", [(128256, 4096), (18992, 4096), (16160, 7168)])
@pytest.mark.parametrize("num_rows", [1, 8, 64, 256])
def test_bf16_on_the_gpu_matches_the_unfused_lm_head(vocab, hidden, num_rows):
    """The presets' LM-head shapes in bf16: greedy tokens equal the argmax of cuBLAS's logits but for near ties
    (two logits within a bf16 ulp of each other may come out of the two fp32 sums in either order), the LSE
    within bf16 tolerance, and the draw equal to the draw from the written logits (the same noise)."""
    dev = torch.device("cuda")
    weight = torch.randn(vocab, hidden, dtype=torch.bfloat16, device=dev) * hidden ** -0.5
    hidden_rows = torch.randn(num_rows, hidden, dtype=torch.bfloat16, device=dev)
    logits = torch.nn.functional.linear(hidden_rows, weight)
    draw = lm_head_sample(hidden_rows, weight)
    want = logits.argmax(dim=1)
    differ = draw.tokens != want
    if differ.any():   # only where the two tokens' logits are within an ulp
        gap = (logits.float().gather(1, want[:, None]) - logits.float().gather(1, draw.tokens[:, None]))[:, 0]
        assert (gap[differ].abs() <= logits.float().amax(dim=1)[differ].abs() * 2 ** -7).all()
    torch.testing.assert_close(draw.lse, torch.logsumexp(logits.float(), dim=1), atol=1.5e-2, rtol=1e-2)
    temperature = torch.full((num_rows,), 0.8, device=dev)
    seeds, positions = torch.arange(num_rows, device=dev) * 7 + 1, torch.arange(num_rows, device=dev) + 100
    fused = lm_head_sample(hidden_rows, weight, temperature, seeds, positions).tokens
    written = logits_sample(logits, temperature, seeds, positions).tokens
    allowed = max(1, num_rows // 20)   # draws whose two best keys are within the logits' last-ulp difference
    assert int((fused != written).sum()) <= allowed
    on_cpu = draw_ref(logits.float().cpu(), temperature.cpu(), seeds.cpu(), positions.cpu()).tokens
    assert int((written.cpu() != on_cpu).sum()) <= allowed   # the GPU's log against PyTorch's


@pytest.mark.gpu
def test_the_draw_on_the_gpu_follows_softmax():
    z = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0], device="cuda")
    n = 20000
    tokens = logits_sample(z.expand(n, -1).contiguous(), torch.full((n,), 0.7, device="cuda"),
                           torch.full((n,), 1234, device="cuda"), torch.arange(n, device="cuda")).tokens
    assert _chi_square(tokens.cpu(), torch.softmax(z.cpu() / 0.7, dim=0)) < CHI2_999[5]
