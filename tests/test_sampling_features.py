"""The sampler's transforms (min_tokens, logit_bias, repetition / frequency / presence penalties), logprobs
and prompt_logprobs, n and best_of — against float64 references written from the documented formulas, on the
stand-in model (its dense float64 reference recomputes every sequence), through every scheduling mode:
one step at a time, overlapped, multi-step decoding, chunked prompts, preemption and prefix caching."""

import math

import pytest
import torch

from engine_models import tiny_model
from tripath.engine import LLM, FinishReason, SamplingParams
from tripath.engine.requests.request import Request, RequestStatus
from tripath.engine.sampling.logits_transforms import PenaltyState, step_transforms

PROMPTS = [[5, 9, 13, 2, 7], [11, 3, 3, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def model():
    """The stand-in model (float32) on the test device: on a GPU the engine runs the torch backend there
    (device tensors, pinned copies and events on the sampling path); the Triton backends take fp32 only on
    the CPU, so the multi-step mode runs there alone (tests/test_multi_step.py covers it on the GPU)."""
    return tiny_model(eos_token_ids=(1,)).to(DEVICE)


def _mode(mode: str) -> dict:
    if mode == "multi-step" and DEVICE.type == "cuda":
        pytest.skip("multi-step decoding needs a Triton backend, and on a GPU those refuse this float32 model "
                    "(tests/test_multi_step.py runs multi-step on the GPU in fp16)")
    return MODES[mode]


def reference_transform(logits: torch.Tensor, params: SamplingParams, prompt, outputs, eos=(1,)) -> torch.Tensor:
    """One row's transforms in float64, from the formulas of SamplingParams' doc."""
    z = logits.double().clone().cpu()
    if len(outputs) < params.min_tokens:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
        z[list(stops)] = -math.inf
    for token, bias in (params.logit_bias or {}).items():
        z[token] += bias
    counts = torch.bincount(torch.tensor(outputs, dtype=torch.int64), minlength=z.shape[0]).double() \
        if outputs else torch.zeros_like(z)
    seen = counts > 0
    seen[list(prompt)] = True
    r = params.repetition_penalty
    z = torch.where(seen, torch.where(z > 0, z / r, z * r), z)
    return z - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


PENALISED = SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.7, frequency_penalty=0.9,
                           presence_penalty=0.6, logit_bias={7: 2.5, 30: -1.0}, min_tokens=4, ignore_eos=False)

MODES = {
    "sequential": dict(backend="torch", async_scheduling=False),
    "overlapped": dict(backend="torch", async_scheduling=True),
    "multi-step": dict(backend="three_path", decode_steps=4),
    "chunked+preempted": dict(backend="torch", num_kv_blocks=9, max_num_batched_tokens=6),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_transforms_equal_the_reference_in_every_scheduling_mode(model, mode):
    options = dict(num_kv_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    llm = LLM(model, **{**options, **_mode(mode)})
    outputs = llm.generate(PROMPTS, PENALISED, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        expected = model.reference_greedy(
            prompt, len(out.output_token_ids),
            lambda z, seen, prompt=prompt: reference_transform(z, PENALISED, prompt, seen))
        assert out.output_token_ids == expected, mode
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    assert [o.output_token_ids for o in plain] != [o.output_token_ids for o in outputs]  # they do change it
    if mode == "chunked+preempted":
        assert llm.scheduler.num_preemptions > 0
    if mode == "multi-step":
        assert llm.decode_steps == 4


def test_step_transforms_match_the_reference_row_by_row_and_step_by_step():
    g = torch.Generator().manual_seed(3)
    vocab = 50
    params = [SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.4),
              SamplingParams(temperature=0.7, min_tokens=3, stop_token_ids=(4, 9), logit_bias={2: 5.0, 3: -7.5}),
              SamplingParams(temperature=0),   # no transform: its row is untouched
              SamplingParams(temperature=1.0, presence_penalty=-1.2, repetition_penalty=0.8, min_tokens=1,
                             ignore_eos=True, stop_token_ids=(12,))]
    requests = []
    for i, p in enumerate(params):
        r = Request([3 + i, 17, 17, 20], p, request_id=f"r{i}", eos_token_ids=(1,), status=RequestStatus.RUNNING)
        r.output_token_ids = [5, 5, 6][:i + 1]
        r.num_inflight_tokens = 2           # a launch of two model steps
        requests.append(r)
    state = PenaltyState(4, torch.device("cpu"))
    t = step_transforms(requests, state, vocab, torch.device("cpu"), num_steps=2)
    outputs = [list(r.output_token_ids) for r in requests]
    for step in range(2):
        logits = torch.randn(4, vocab, generator=g)
        out = t.apply(logits, step)
        for i, r in enumerate(requests):
            expected = reference_transform(logits[i], r.sampling_params, r.prompt_token_ids, outputs[i])
            torch.testing.assert_close(out[i].double(), expected, rtol=1e-6, atol=1e-5)
        tokens = torch.tensor([17, 6, 0, 12])
        t.record(tokens)
        for i in range(4):
            outputs[i].append(int(tokens[i]))


def test_logit_bias_forces_and_forbids_sampled_tokens(model):
    llm = LLM(model, backend="torch", num_kv_blocks=64, block_size=4)
    forced = llm.generate([PROMPTS[0]] * 3, SamplingParams(max_tokens=8, temperature=1.0, seed=5,
                                                           logit_bias={23: 100.0}), use_tqdm=False)
    assert all(o.output_token_ids == [23] * 8 for o in forced)
    free = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=30, temperature=0.8, seed=9), use_tqdm=False)[0]
    banned = set(free.output_token_ids)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=30, temperature=0.8, seed=9,
                                                    logit_bias={t: -100.0 for t in banned}), use_tqdm=False)[0]
    assert not banned & set(out.output_token_ids)


def test_min_tokens_holds_back_stop_tokens_then_lets_them_stop(model):
    llm = LLM(model, backend="torch", num_kv_blocks=64, block_size=4)
    first = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    stop = first.output_token_ids[0]
    early = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=6, temperature=0, stop_token_ids=(stop,)),
                         use_tqdm=False)[0]
    assert early.output_token_ids == [stop] and early.finish_reason is FinishReason.STOP
    held = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=40, temperature=0, stop_token_ids=(stop,),
                                                     min_tokens=5), use_tqdm=False)[0]
    assert stop not in held.output_token_ids[:5] and len(held.output_token_ids) >= 5
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)


@pytest.mark.parametrize("mode", ["sequential", "overlapped", "multi-step"])
def test_logprobs_of_outputs_and_prompts_equal_the_float64_reference(model, mode):
    llm = LLM(model, num_kv_blocks=64, block_size=4, max_num_batched_tokens=5,  # prompts chunked
              **_mode(mode))
    params = SamplingParams(max_tokens=7, temperature=0.9, seed=4, logprobs=3, prompt_logprobs=2)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
        full = prompt + out.output_token_ids
        lp = model.reference_logits(full).log_softmax(-1).cpu()
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for p in range(1, len(prompt)):
            _check_position(out.prompt_logprobs[p], prompt[p], lp[p - 1], 2)
        completion = out.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids)
        for j, token in enumerate(completion.token_ids):
            _check_position(completion.logprobs[j], token, lp[len(prompt) - 1 + j], 3)
        expected = sum(float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(completion.token_ids))
        assert completion.cumulative_logprob == pytest.approx(expected, abs=1e-3)


def _check_position(entry, chosen, reference_lp, k):
    """The chosen token's log-probability and rank, and the top ``k`` tokens, against ``reference_lp [V]``."""
    assert chosen in entry
    assert entry[chosen].logprob == pytest.approx(float(reference_lp[chosen]), abs=1e-3)
    assert entry[chosen].rank == 1 + int((reference_lp > reference_lp[chosen] + 1e-6).sum())
    top = reference_lp.topk(k)
    for rank, (value, token) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
        assert token in entry and entry[token].logprob == pytest.approx(value, abs=1e-3)
        if token != chosen:
            assert entry[token].rank == rank
    assert len(entry) in (k, k + 1)


def test_prompt_logprobs_are_whole_with_prefix_hits_and_preemption(model):
    llm = LLM(model, backend="torch", num_kv_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    prompt = list(range(10, 30))
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0)
    plain = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # fills the cache
    assert plain[0].prompt_logprobs is None
    outs = llm.generate([prompt] * 3, params, use_tqdm=False)
    lp = model.reference_logits(prompt).log_softmax(-1).cpu()
    for out in outs:
        assert len(out.prompt_logprobs) == len(prompt)
        for p in range(1, len(prompt)):
            assert out.prompt_logprobs[p][prompt[p]].logprob == pytest.approx(float(lp[p - 1, prompt[p]]), abs=1e-3)
    assert llm.scheduler.num_preemptions > 0


def test_n_and_best_of(model):
    llm = LLM(model, backend="torch", num_kv_blocks=64, block_size=4)
    out = llm.generate([PROMPTS[0]], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=11), use_tqdm=False)
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1, 2]
    alone = [llm.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=1.0, seed=11 + i), use_tqdm=False)[0]
             for i in range(3)]
    assert [c.token_ids for c in out[0].outputs] == [a.output_token_ids for a in alone]
    best = llm.generate([PROMPTS[0]], SamplingParams(n=2, best_of=4, max_tokens=6, temperature=1.0, seed=3),
                        use_tqdm=False)[0]
    runs = [llm.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=1.0, seed=3 + i, logprobs=0),
                         use_tqdm=False)[0].outputs[0] for i in range(4)]
    ranked = sorted(runs, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]
    assert all(c.logprobs is None and c.cumulative_logprob is None for c in best.outputs)  # not asked for
    with pytest.raises(ValueError, match="one request per completion"):
        llm.add_request(PROMPTS[0], SamplingParams(n=2))
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)


def test_the_flat_fields_are_shortcuts_to_the_first_output(model):
    llm = LLM(model, backend="torch", num_kv_blocks=64, block_size=4)
    out = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
    assert out.output_token_ids is out.outputs[0].token_ids and out.finish_reason is out.outputs[0].finish_reason
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


@pytest.mark.parametrize("field,value,message", [
    ("repetition_penalty", 0.0, "repetition_penalty"), ("presence_penalty", 2.5, "presence_penalty"),
    ("frequency_penalty", float("nan"), "frequency_penalty"), ("logit_bias", {-1: 1.0}, "logit_bias"),
    ("logit_bias", {3: float("inf")}, "logit_bias"), ("logprobs", 21, "logprobs"),
    ("prompt_logprobs", -1, "prompt_logprobs"), ("n", 0, "n must"), ("min_tokens", -1, "min_tokens")])
def test_bad_sampling_parameters_name_themselves(field, value, message):
    with pytest.raises((ValueError, TypeError), match=message):
        SamplingParams(**{field: value})
