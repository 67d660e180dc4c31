"""Sampler: greedy, temperature, top-k, top-p against an independent float64 reference, seeded draws."""

import math

import pytest
import torch

from tripath.engine.requests.sampling_params import SamplingParams
from tripath.engine.sampling.sampler import filtered_probs, make_generator, sample


def reference_probs(logits_row, temperature, top_k, top_p, min_p=0.0):
    """float64, token by token: the kept set and the renormalised distribution."""
    z = [float(x) / temperature for x in logits_row]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    if min_p > 0:   # p_i >= min_p * p_max
        top = z[order[0]]
        order = [i for i in order if math.exp(z[i] - top) >= min_p]
    if top_k >= 1:
        kth = z[order[min(top_k, len(order)) - 1]]
        order = [i for i in order if z[i] >= kth]
    m = max(z[i] for i in order)
    w = {i: math.exp(z[i] - m) for i in order}
    total = sum(w.values())
    kept, mass = [], 0.0
    for i in order:
        if kept and mass >= top_p:
            break
        kept.append(i)
        mass += w[i] / total
    norm = sum(w[i] for i in kept)
    out = [0.0] * len(z)
    for i in kept:
        out[i] = w[i] / norm
    return out


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, -1, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, -1, 0.6, 0.0), (0.9, 8, 0.8, 0.0), (2.0, 1, 1.0, 0.0),
    (1.0, 0, 0.05, 0.0), (1.0, -1, 1.0, 0.1), (0.8, 6, 0.9, 0.05)])
def test_filtered_probs_match_the_reference(temperature, top_k, top_p, min_p):
    logits = torch.randn(4, 37) * 3
    n = logits.shape[0]
    probs = filtered_probs(logits, torch.full((n,), temperature), torch.full((n,), top_k, dtype=torch.int64),
                           torch.full((n,), top_p), torch.full((n,), min_p) if min_p else None)
    for row in range(n):
        ref = torch.tensor(reference_probs(logits[row].tolist(), temperature, top_k, top_p, min_p),
                           dtype=torch.float64)
        torch.testing.assert_close(probs[row].double(), ref, atol=1e-5, rtol=1e-5)


def test_greedy_is_argmax_and_ignores_generators():
    logits = torch.randn(5, 50)
    params = [SamplingParams(temperature=0)] * 5
    assert torch.equal(sample(logits, params, [None] * 5), logits.argmax(-1))


def test_sampling_follows_the_distribution():
    torch.manual_seed(3)
    logits = torch.randn(1, 6) * 1.5
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    gen = make_generator(11, torch.device("cpu"))
    draws = torch.stack([sample(logits, [params], [gen]) for _ in range(6000)]).flatten()
    freq = torch.bincount(draws, minlength=6).double() / draws.numel()
    ref = torch.tensor(reference_probs(logits[0].tolist(), 0.8, 4, 0.9), dtype=torch.float64)
    assert torch.all(freq[ref == 0] == 0), "a filtered-out token was sampled"
    torch.testing.assert_close(freq, ref, atol=0.025, rtol=0)


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(3, 40)
    p = SamplingParams(temperature=1.0, seed=5)

    gens = [make_generator(s, torch.device("cpu")) for s in (1, 2, 3)]
    together = [sample(logits, [p, SamplingParams(temperature=0), p], [gens[0], None, gens[2]]).tolist()
                for _ in range(5)]
    g0, g2 = make_generator(1, torch.device("cpu")), make_generator(3, torch.device("cpu"))
    alone0 = [sample(logits[0:1], [p], [g0]).item() for _ in range(5)]
    alone2 = [sample(logits[2:3], [p], [g2]).item() for _ in range(5)]
    assert [t[0] for t in together] == alone0
    assert [t[2] for t in together] == alone2
    assert [t[1] for t in together] == [logits[1].argmax().item()] * 5
    assert len(set(alone0)) > 1  # really random, not stuck


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logits_of_the_lm_heads_dtype_sample_as_their_float32_copy(dtype):
    """The engine samples from the LM head's logits as they are (no float32 copy of ``[N, V]``): greedy
    rows (ties included) and seeded sampled rows give the tokens of the float32 upcast."""
    logits = (torch.randn(6, 300) * 4).to(dtype)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie at the max: the first index, as in float32
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=20, top_p=0.9),
              SamplingParams(temperature=0), SamplingParams(temperature=1.3),
              SamplingParams(temperature=0.5, top_p=0.5), SamplingParams(temperature=0)]
    def draw(x):
        gens = [make_generator(s, torch.device("cpu")) for s in range(6)]
        return sample(x, params, gens)
    got = draw(logits)
    assert torch.equal(got, draw(logits.float())) and got[2] == 7


def test_the_engine_samples_the_lm_heads_dtype(monkeypatch):
    """The runner asks the model for logits in the LM head's dtype and hands them to the sampler."""
    import tripath.engine.sampling.step_sampling as sampling_module
    from tripath.engine import LLM

    seen = []
    real = sampling_module.sample
    monkeypatch.setattr(sampling_module, "sample", lambda logits, *a: seen.append(logits.dtype) or real(logits, *a))
    llm = LLM("tiny-llama", backend="torch", dtype="bfloat16", num_kv_blocks=32)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert seen and set(seen) == {torch.bfloat16}


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="params \\(1\\) and generators \\(2\\) must have one entry per row"):
        sample(torch.randn(2, 5), [SamplingParams()], [None, None])
    with pytest.raises(ValueError, match=r"logits must be \[num_requests, vocab\]"):
        sample(torch.randn(5), [SamplingParams()], [None])
    with pytest.raises(ValueError, match=r"temperature must be finite and in \[0, 1e\+30\]"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, 2\*\*63 - 1\], or -1 / 0 for no limit"):
        SamplingParams(top_k=-2)
    with pytest.raises(ValueError, match=r"max_tokens must be an int in \[1, 2\*\*63 - 1\]"):
        SamplingParams(max_tokens=0)
    with pytest.raises(TypeError, match="seed must be an int or None"):
        SamplingParams(seed=1.5)
