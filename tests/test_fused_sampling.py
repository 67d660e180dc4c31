"""The engine's fused LM head and draw (engine/sampling/fused_sampling.py): which requests force the unfused path, the
choice per bucket of row counts, and the engine's outputs with the fused path forced on equal to the unfused
path's on the tiny architectures (greedy, seeded plain temperature, a greedy token's log-probability;
multi-step decoding), with its steps counted and the choice in the engine's info."""

from types import SimpleNamespace

import pytest
import torch

from tripath.engine import LLM, SamplingParams
from tripath.engine.requests.structured_output import StructuredOutput
from tripath.engine.sampling.fused_sampling import FusedSampling, choose, full_logits_reason, measure, row_buckets
from tripath.engine.sampling.sampler import sample
from tripath.models import load_model
from tripath.ops.lm_head_sample import logits_sample


@pytest.mark.parametrize("params, reason", [
    (SamplingParams(temperature=0.0), None),
    (SamplingParams(temperature=0.7, seed=3), None),
    (SamplingParams(temperature=0.0, logprobs=0), None),
    (SamplingParams(temperature=0.0, prompt_logprobs=2), None),   # prompt positions are scored apart
    (SamplingParams(temperature=0.7, top_k=-1, top_p=1.0, min_p=0.0), None),
    (SamplingParams(temperature=0.7, top_k=5), "top-k, top-p or min-p"),
    (SamplingParams(temperature=0.7, top_p=0.9), "top-k, top-p or min-p"),
    (SamplingParams(temperature=0.7, min_p=0.1), "top-k, top-p or min-p"),
    (SamplingParams(temperature=0.0, repetition_penalty=1.2), "penalties, logit_bias or min_tokens"),
    (SamplingParams(temperature=0.0, presence_penalty=0.5), "penalties, logit_bias or min_tokens"),
    (SamplingParams(temperature=0.0, frequency_penalty=0.5), "penalties, logit_bias or min_tokens"),
    (SamplingParams(temperature=0.0, logit_bias={3: 1.0}), "penalties, logit_bias or min_tokens"),
    (SamplingParams(temperature=0.0, min_tokens=2), "penalties, logit_bias or min_tokens"),
    (SamplingParams(temperature=0.0, structured_output=StructuredOutput(choice=["a", "b"])), "structured output"),
    (SamplingParams(temperature=0.0, logprobs=1), "log-probabilities beyond a greedy token's own"),
    (SamplingParams(temperature=0.7, logprobs=0), "log-probabilities beyond a greedy token's own"),
])
def test_which_requests_need_their_whole_logits(params, reason):
    assert full_logits_reason(params) == reason


def test_the_choice_per_bucket_of_row_counts():
    assert row_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert row_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert row_buckets(1) == [1]
    choice = FusedSampling("test", [1, 2, 4, 8], {1: True, 2: True, 4: False, 8: False},
                           {1: True, 2: False, 4: False, 8: False})
    assert choice.use(1, sampled=False) and choice.use(2, sampled=False) and not choice.use(3, sampled=False)
    assert choice.use(1, sampled=True) and not choice.use(2, sampled=True)
    assert not choice.use(9, sampled=False)   # beyond the last bucket (more rows than max_num_seqs)
    assert choice.facts() == ((1, True, True), (2, True, False), (4, False, False), (8, False, False))


def _runner(mode: str, device: str = "cpu", world_size: int = 1, model=None):
    model = model or SimpleNamespace(sample_tokens=lambda *a: None, parallel=SimpleNamespace(world_size=world_size))
    return SimpleNamespace(config=SimpleNamespace(fused_sampling=mode, max_num_seqs=8), model=model,
                           device=torch.device(device))


def test_the_setting_and_what_takes_the_fused_path_off():
    assert choose(_runner("off")) is None
    assert choose(_runner("on", model=SimpleNamespace())) is None   # a model without sample_tokens
    on = choose(_runner("on"))
    assert on.how == "on" and all(on.greedy.values()) and all(on.sampled.values())
    auto = choose(_runner("auto"))
    assert auto.how == "auto: no GPU to measure" and not auto.any   # the CPU keeps the unfused path


def test_auto_keeps_the_faster_path_per_bucket_and_kind():
    """The start's measurement (a stand-in timer: fused faster for greedy up to 4 rows and sampled at 1 row)."""
    model = load_model("tiny-llama", dtype=torch.float32)
    runner = _runner("auto", model=model)
    runner.compute_logits = lambda h: model.compute_logits(h, upcast=False)
    runner.fused_sampling = choose(runner)
    calls = []

    def timer(fn):
        calls.append(fn)
        fused = len(calls) % 2 == 1
        at = len(calls) - 1   # per bucket: greedy fused, greedy unfused, sampled fused, sampled unfused
        bucket, kind = runner.fused_sampling.buckets[at // 4], ("greedy", "sampled")[at // 2 % 2]
        wins = bucket <= 4 if kind == "greedy" else bucket == 1
        return 1.0 if fused == wins else 2.0

    measure(runner, torch.randn(8, model.config.hidden_size), timer=timer)
    choice = runner.fused_sampling
    assert choice.greedy == {1: True, 2: True, 4: True, 8: False}
    assert choice.sampled == {1: True, 2: False, 4: False, 8: False}
    assert choice.how == "auto: measured at start" and "≤8 rows: greedy unfused 2/1 µs" in choice.summary()


def test_plain_temperature_rows_draw_with_their_noise_keys():
    """The sampler draws plain-temperature rows as the fused path does (same noise, same tokens); filtered rows
    keep the exponential race."""
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0.9), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.9, top_k=5)]
    seeds, positions = torch.tensor([11, 12, 13]), torch.tensor([40, 41, 42])
    gens = [None, None, torch.Generator().manual_seed(1)]
    tokens = sample(logits, params, gens, noise=(seeds, positions))
    assert tokens[0] == logits_sample(logits[:1], torch.tensor([0.9]), seeds[:1], positions[:1]).tokens[0]
    assert tokens[1] == logits[1].argmax()
    assert int(tokens[2]) in logits[2].topk(5).indices.tolist()


PROMPTS = [[1, 5, 9, 13, 2], [2, 3], [7, 8, 9, 10, 11, 12, 4], [40, 41, 42]]


def _generate(model, mode: str, params, **options):
    llm = LLM(model, backend="torch", num_kv_blocks=64, block_size=16, max_num_seqs=4, fused_sampling=mode,
              **options)
    outputs = [r.outputs[0] for r in llm.generate(PROMPTS, params, use_tqdm=False)]
    return outputs, llm.stats().fused_sampling_steps, llm.core.info()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-deepseek"])
def test_greedy_outputs_equal_the_unfused_path(name):
    """The fused path forced on (the Triton kernel under the interpreter) gives the unfused path's greedy tokens
    and a greedy token's log-probability; tiny-qwen2 ties its LM head to the embedding, tiny-deepseek is MLA."""
    model = load_model(name, dtype=torch.float32)
    params = [SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)] * 2 + \
        [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)] * 2
    unfused, none, _ = _generate(model, "off", params)
    fused, steps, info = _generate(model, "on", params)
    assert [o.token_ids for o in fused] == [o.token_ids for o in unfused]
    assert none == 0 and steps >= 5   # every step that samples: the prompts' and the decodes'
    for a, b in zip(fused[:2], unfused[:2]):
        assert [list(d) for d in a.logprobs] == [list(d) for d in b.logprobs]
        for da, db in zip(a.logprobs, b.logprobs):
            (ta, la), = da.items()
            assert la.rank == 1 and la.logprob == pytest.approx(db[ta].logprob, abs=1e-4)
    assert info.fused_sampling == "on" and info.fused_sampling_buckets[-1] == (4, True, True)


def test_seeded_samples_and_multi_step_runs_equal_the_unfused_path():
    model = load_model("tiny-qwen3", dtype=torch.float32)
    params = [SamplingParams(temperature=0.8, seed=7 + i, max_tokens=8, ignore_eos=True) for i in range(3)] + \
        [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)]
    unfused, _, _ = _generate(model, "off", params, decode_steps=4)
    fused, steps, _ = _generate(model, "on", params, decode_steps=4)
    assert [o.token_ids for o in fused] == [o.token_ids for o in unfused]
    assert steps >= 7


def test_a_request_that_needs_its_logits_keeps_the_step_unfused():
    model = load_model("tiny-llama", dtype=torch.float32)
    params = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * 3 + \
        [SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=4, ignore_eos=True)]
    _, steps, _ = _generate(model, "on", params, decode_steps=1)
    assert steps == 0
    _, steps, info = _generate(model, "off", params[:2] * 2, decode_steps=1)
    assert steps == 0 and info.fused_sampling == "off" and info.fused_sampling_buckets == ()
    with pytest.raises(ValueError, match="fused_sampling must be 'auto', 'on' or 'off'"):
        LLM(model, fused_sampling="yes")


@pytest.mark.gpu
def test_the_start_measures_both_paths_on_the_gpu_and_greedy_outputs_do_not_change():
    """``auto`` on a GPU: the start times both paths per bucket (the choice logged and in the engine's info), and
    greedy outputs with the fused path forced on equal the unfused path's on a bf16 preset."""
    model = load_model("tiny-qwen3", dtype=torch.bfloat16, device="cuda")
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 4
    auto = LLM(model, max_num_seqs=8, num_kv_blocks=64)
    info = auto.core.info()
    assert info.fused_sampling == "auto: measured at start"
    assert [b for b, _, _ in info.fused_sampling_buckets] == [1, 2, 4, 8]
    assert auto.runner.fused_sampling.timings and all(t > 0 for pair in auto.runner.fused_sampling.timings.values()
                                                     for t in pair)
    off = [o.outputs[0].token_ids for o in LLM(model, fused_sampling="off", num_kv_blocks=64).generate(
        PROMPTS, params, use_tqdm=False)]
    on_llm = LLM(model, fused_sampling="on", num_kv_blocks=64)
    on = [o.outputs[0].token_ids for o in on_llm.generate(PROMPTS, params, use_tqdm=False)]
    assert on == off and on_llm.stats().fused_sampling_steps > 0
