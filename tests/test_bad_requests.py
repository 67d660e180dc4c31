"""Bad requests at the engine's door, failed runs, sampling at the edges, and loader errors.

Every bad prompt raises alone (the exception type and a message naming it) and touches nothing: the engine
stays idle with every KV block free, and a good request afterwards gives the tokens of a fresh engine. The
engine runs the stand-in model on the torch backend (no interpreter), with the metadata validator on.
"""

import json
import math

import numpy as np
import pytest
import torch

from tripath.engine import LLM, SamplingParams
from tripath.engine.sampling.sampler import filtered_probs, sample
from tripath.models import load_model

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
GOOD = [[3, 14, 15, 9, 26], [5, 35, 8]]


pytestmark = pytest.mark.usefixtures("torch_paths_and_validation")


@pytest.fixture(scope="module")
def model(tiny_lm):
    return tiny_lm


def engine(model, **kw):
    return LLM(model, backend="torch", num_kv_blocks=24, block_size=8, max_num_batched_tokens=32, **kw)


def tokens(llm, prompts, params=GREEDY):
    return [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def fresh_tokens(model):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        return tokens(engine(model), GOOD)


def assert_idle_and_whole(llm):
    assert not llm.has_unfinished_requests()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_usable_blocks


BAD_PROMPTS = [
    ([[1, 2], []], ValueError, r"prompts\[1\] is empty"),
    ([[1, 2], [3, 61]], ValueError, r"prompts\[1\]\[1\] = 61 is outside the vocabulary \[0, 61\)"),
    ([[-1, 2]], ValueError, r"prompts\[0\]\[0\] = -1 is outside the vocabulary"),
    ([1, 5.7], TypeError, r"prompts\[0\]\[1\] must be an integer token id, got float 5.7"),
    ([[1, True]], TypeError, r"prompts\[0\]\[1\] must be an integer token id, got bool"),
    ([[1, 2], "text"], TypeError, r"prompts\[1\] is text: a text prompt needs a tokenizer"),
    ([[1, 2], None], TypeError, r"prompts\[1\] must be a sequence of integer token ids .* got NoneType"),
    ([torch.tensor([1.0, 2.0])], TypeError, r"prompts\[0\] as a tensor must be 1-D with an integer dtype"),
    ([np.array([[1, 2]])], TypeError, r"prompts\[0\] as a array must be 1-D with an integer dtype"),
    ([np.array([1.5, 2.0])], TypeError, r"prompts\[0\] as a array must be 1-D with an integer dtype"),
    ([[1] * 500], ValueError, r"prompt \(500 tokens\) \+ max_tokens \(6\) exceeds max_model_len \(505\)"),
    (3, TypeError, r"prompts must be a prompt or a list of prompts, got int"),
]


@pytest.mark.parametrize("prompts,error,message", BAD_PROMPTS)
def test_a_bad_prompt_fails_alone(model, fresh_tokens, prompts, error, message):
    llm = engine(model, max_model_len=505)
    with pytest.raises(error, match=message):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_idle_and_whole(llm)
    assert tokens(llm, GOOD) == fresh_tokens


def test_the_step_api_refuses_bad_prompts_and_duplicate_ids(model, fresh_tokens):
    llm = engine(model)
    first = llm.add_request(GOOD[0], GREEDY, request_id="a")
    with pytest.raises(ValueError, match=r"prompt\[2\] = 99 is outside the vocabulary"):
        llm.add_request([1, 2, 99], GREEDY)
    with pytest.raises(ValueError, match=r"request_id 'a' is already queued or running"):
        llm.add_request(GOOD[1], GREEDY, request_id="a")
    with pytest.raises(TypeError, match=r"request_id must be a non-empty str"):
        llm.add_request(GOOD[1], GREEDY, request_id=7)
    with pytest.raises(TypeError, match=r"sampling_params must be a SamplingParams, got dict"):
        llm.add_request(GOOD[1], {"max_tokens": 3})
    taken = llm.add_request(GOOD[1], GREEDY, request_id="req-2")  # the id an automatic one would get next
    auto = llm.add_request(GOOD[1], GREEDY)
    assert len({first, taken, auto}) == 3 and len(llm.scheduler.waiting) == 3
    done = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out.output_token_ids
    assert done == {"a": fresh_tokens[0], "req-2": fresh_tokens[1], auto: fresh_tokens[1]}
    assert_idle_and_whole(llm)


@pytest.mark.parametrize("field,value,bad", [("stop_token_ids", (3, 61), 61), ("stop_token_ids", [10 ** 6], 10 ** 6),
                                             ("logit_bias", {5: 1.0, 61: -100.0}, 61), ("logit_bias", {70: 2.0}, 70)])
def test_sampling_token_ids_outside_the_vocabulary_are_refused(model, fresh_tokens, field, value, bad):
    llm = engine(model)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, **{field: value})
    message = rf"sampling_params\.{field} for %s holds token id {bad}, outside the model's vocabulary \[0, 61\) of 61 "
    with pytest.raises(ValueError, match=message % r"prompt\b"):
        llm.add_request(GOOD[0], params)
    with pytest.raises(ValueError, match=message % r"prompts\[1\]"):
        llm.generate(GOOD, [GREEDY, params], use_tqdm=False)
    assert_idle_and_whole(llm)
    assert tokens(llm, GOOD) == fresh_tokens
    ok = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, stop_token_ids=[60],
                        logit_bias={0: 1.0, 60: -1.0})
    assert len(tokens(llm, GOOD, ok)) == 2   # the vocabulary's edges are in it


def test_integer_tensors_and_arrays_are_prompts(model, fresh_tokens):
    llm = engine(model)
    assert tokens(llm, [torch.tensor(GOOD[0]), np.array(GOOD[1], dtype=np.int32)]) == fresh_tokens
    assert tokens(llm, [[np.int64(t) for t in GOOD[0]], tuple(GOOD[1])]) == fresh_tokens
    assert tokens(llm, torch.tensor(GOOD[0])) == fresh_tokens[:1]  # one 1-D tensor: one prompt
    assert tokens(llm, torch.tensor([GOOD[1], GOOD[1]])) == [fresh_tokens[1]] * 2  # 2-D: its rows
    assert tokens(llm, GOOD[0]) == fresh_tokens[:1]


def test_a_failed_generate_leaves_the_engine_idle_and_its_blocks_free(model, fresh_tokens, monkeypatch):
    llm = engine(model)
    real = llm.runner.launch
    calls = []

    def failing(scheduled, previous=None, num_steps=1):
        calls.append(len(scheduled))
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return real(scheduled, previous, num_steps)

    monkeypatch.setattr(llm.runner, "launch", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(GOOD + [[7] * 40], GREEDY, use_tqdm=False)
    assert len(calls) == 3
    assert_idle_and_whole(llm)
    monkeypatch.setattr(llm.runner, "launch", real)
    assert tokens(llm, GOOD) == fresh_tokens
    assert_idle_and_whole(llm)


def test_max_model_len_beyond_the_positions_is_refused(model):
    with pytest.raises(ValueError, match=r"max_model_len=513 exceeds the model's max_position \(512\)"):
        engine(model, max_model_len=513)
    assert engine(model, max_model_len=512).runner.max_model_len == 512
    llama = load_model("tiny-llama", dtype=torch.float32)  # 2048 positions (llama3 rope scaling included)
    with pytest.raises(ValueError, match=r"max_model_len=4096 exceeds the model's max_position \(2048\)"):
        LLM(llama, backend="torch", num_kv_blocks=8, max_model_len=4096)


def test_sampling_parameters_at_the_edges():
    for bad in (math.nan, math.inf, -1.0, 1e31):
        with pytest.raises(ValueError, match=r"temperature must be finite and in \[0, 1e\+30\]"):
            SamplingParams(temperature=bad)
    with pytest.raises(TypeError, match=r"temperature must be a number, got str"):
        SamplingParams(temperature="0.5")
    with pytest.raises(TypeError, match=r"top_p must be a number, got bool"):
        SamplingParams(top_p=True)
    with pytest.raises(ValueError, match=r"max_tokens must be an int in \[1, 2\*\*63 - 1\], got True"):
        SamplingParams(max_tokens=True)
    # every integer fits the sampler's int64 tensors and 64-bit generator seeds (a 2**63 top_k failed the step)
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, 2\*\*63 - 1\].*got 9223372036854775808"):
        SamplingParams(top_k=1 << 63)
    for seed in (1 << 63, -(1 << 63) - 1, 1 << 64):
        with pytest.raises(ValueError, match=rf"seed must be in \[-2\*\*63, 2\*\*63 - 1\].*got {seed}"):
            SamplingParams(seed=seed)
    assert SamplingParams(seed=-(1 << 63), top_k=(1 << 63) - 1).top_k == (1 << 63) - 1
    with pytest.raises(ValueError, match=r"stop_token_ids must be in \[0, 2\*\*63 - 1\], got -1"):
        SamplingParams(stop_token_ids=[3, -1])
    with pytest.raises(TypeError, match=r"ignore_eos must be a bool, got int"):
        SamplingParams(ignore_eos=1)
    with pytest.raises(TypeError, match=r"stop_token_ids\[1\] must be an integer token id, got float"):
        SamplingParams(stop_token_ids=[2, 3.5])
    assert SamplingParams(stop_token_ids=4).stop_token_ids == (4,)
    # float32 holes: 1e-300 is 0 in float32 (x / 0), 1e-40 a denormal (10 / 1e-40 = inf); 1e300 is inf
    for bad in (1e-300, 1e-40, 0.0, 1e31, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"repetition_penalty must be in \[1e-30, 1e\+30\] \(1 = off"):
            SamplingParams(repetition_penalty=bad)
    assert SamplingParams(repetition_penalty=1e-30).repetition_penalty == 1e-30
    for bad in (1e300, -1e9, math.inf):
        with pytest.raises(ValueError, match=r"logit_bias\[5\] must be a number in \[-1e\+08, 1e\+08\]"):
            SamplingParams(logit_bias={5: bad})


def test_the_extreme_sampling_values_allowed_keep_the_logits_finite():
    """The bounds SamplingParams holds keep every transform finite in float32 for logits up to 1e8: a bias of
    1e8 on a logit of 1e8, divided by the smallest repetition penalty or multiplied by the largest, then the
    largest frequency and presence penalties."""
    from types import SimpleNamespace

    from tripath.engine.requests.sampling_params import (MAX_LOGIT_BIAS_VALUE, MAX_REPETITION_PENALTY,
                                                         MIN_REPETITION_PENALTY)
    from tripath.engine.sampling.logits_transforms import StepTransforms

    logits = torch.tensor([[1e8, -1e8, 3.0, 0.0, -2.0]] * 2)
    bias = SamplingParams(logit_bias={0: MAX_LOGIT_BIAS_VALUE, 1: -MAX_LOGIT_BIAS_VALUE}).logit_bias
    seen = SimpleNamespace(counts=torch.full((2, 5), 3, dtype=torch.int32),
                           in_prompt=torch.ones(2, 5, dtype=torch.bool))
    penalties = [SamplingParams(repetition_penalty=r, frequency_penalty=2, presence_penalty=-2)
                 for r in (MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)]
    transforms = StepTransforms(
        bias_rows=torch.tensor([0, 0, 1, 1]), bias_tokens=torch.tensor(list(bias) * 2),
        bias_values=torch.tensor(list(bias.values()) * 2, dtype=torch.float32), penalty_rows=torch.tensor([0, 1]),
        slots=torch.tensor([0, 1]), state=seen,
        repetition=torch.tensor([p.repetition_penalty for p in penalties], dtype=torch.float32),
        frequency=torch.tensor([2.0, 2.0]), presence=torch.tensor([-2.0, -2.0]))
    out = transforms.apply(logits)
    assert torch.isfinite(out).all(), out
    probs = filtered_probs(out, torch.ones(2), torch.full((2,), -1), torch.ones(2))
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(2))


@pytest.mark.parametrize("temperature", [1e-45, 1e-40, 1e-38, 1e-30, 1e-6])
def test_tiny_temperatures_sample_the_argmax(temperature):
    logits = torch.randn(8, 61, generator=torch.Generator().manual_seed(2)) * 5
    t = torch.full((8,), temperature)
    probs = filtered_probs(logits, t, torch.full((8,), -1), torch.ones(8))
    assert torch.isfinite(probs).all()
    if temperature < 1e-20:
        assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 61).float())
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(8)]
    gens = [torch.Generator().manual_seed(i) for i in range(8)]
    assert torch.equal(sample(logits, params, gens), logits.argmax(-1))


def test_tiny_temperature_generates_the_greedy_tokens(model, fresh_tokens):
    tiny = SamplingParams(max_tokens=6, temperature=1e-40, ignore_eos=True, seed=3)
    assert tokens(engine(model), GOOD, tiny) == fresh_tokens


# -- loader errors name the file ------------------------------------------------------------------------------

LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=96,
             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


@pytest.mark.parametrize("text,message", [
    ("{not json", r"not a valid JSON file"),
    ("[1, 2]", r"expected a JSON object, got a list"),
    (json.dumps({**LLAMA, "num_hidden_layers": "two"}), r"invalid literal for int"),
    (json.dumps({**LLAMA, "hidden_size": None}), r"int\(\) argument must be"),
    (json.dumps({**LLAMA, "num_attention_heads": 0}), r"num_attention_heads must be positive, got 0"),
    (json.dumps({**LLAMA, "num_key_value_heads": 0}), r"num_kv_heads must be positive, got 0"),
])
def test_a_corrupt_config_json_is_named(tmp_path, text, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=message) as caught:
        load_model(str(tmp_path), dtype=torch.float32)
    assert str(tmp_path / "config.json") in str(caught.value)


def test_a_corrupt_safetensors_file_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad}")
    with pytest.raises(ValueError, match=r"not a readable safetensors file") as caught:
        load_model(str(tmp_path), dtype=torch.float32)
    assert str(weights) in str(caught.value)
