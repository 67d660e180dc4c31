"""Speculative decoding under random settings (hypothesis): any mix of sampling transforms (penalties, a grammar,
``min_tokens`` with ``logit_bias`` on the end-of-sequence token), drafting (chains or trees, draft lengths,
adaptive lengths, ``disable_by_batch_size``), budgets and cache sizes (chunked prefill, preemption) keeps the
greedy outputs of the engine without speculation. Drafts come from an oracle that replays those outputs with
a set share corrupted, so drafts are both kept and rejected; the reference ``torch`` backend on tiny-llama."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tripath.engine import LLM, SamplingParams
from tripath.engine.speculative.oracle import OracleProposer
from tripath.models import load_model

_model = []


def tiny_llama():
    if not _model:
        _model.append(load_model("tiny-llama", dtype=torch.float32).eval())
    return _model[0]


@st.composite
def requests(draw):
    """Per request: a prompt and greedy sampling parameters with a random set of transforms."""
    model = tiny_llama()
    eos = int(model.config.eos_token_ids[0])
    out = []
    for _ in range(draw(st.integers(1, 4))):
        motif = draw(st.lists(st.integers(2, 255), min_size=2, max_size=5))
        prompt = motif * draw(st.integers(1, 6)) + draw(st.lists(st.integers(2, 255), max_size=6))
        kind = draw(st.sampled_from(["plain", "penalties", "min_tokens"]))
        options = dict(max_tokens=draw(st.integers(1, 14)), temperature=0)
        if kind == "penalties":
            options.update(repetition_penalty=draw(st.sampled_from([1.0, 1.4])),
                           frequency_penalty=draw(st.sampled_from([0.0, 0.7])),
                           presence_penalty=draw(st.sampled_from([0.0, 0.5])), ignore_eos=True)
        elif kind == "min_tokens":
            options.update(min_tokens=draw(st.integers(1, min(6, options["max_tokens"]))), logit_bias={eos: 30.0})
        else:
            options.update(ignore_eos=True)
        out.append((prompt, SamplingParams(**options)))
    return out


@st.composite
def speculation(draw):
    k = draw(st.integers(1, 5))
    spec = {"num_speculative_tokens": k}
    if k >= 2 and draw(st.booleans()):
        spec.update(method="ngram", prompt_lookup_max=3, tree_width=draw(st.integers(2, k)))
    if draw(st.booleans()):
        spec["acceptance_threshold"] = draw(st.sampled_from([0.2, 0.5]))
    if draw(st.booleans()):
        spec["disable_by_batch_size"] = draw(st.integers(1, 3))
    return spec


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                             HealthCheck.function_scoped_fixture])
@given(batch=requests(), spec=speculation(), p=st.sampled_from([0.0, 0.6, 1.0]),
       engine=st.sampled_from([dict(num_kv_blocks=128, block_size=4),
                               dict(num_kv_blocks=16, block_size=4, max_num_batched_tokens=12),
                               dict(num_kv_blocks=128, block_size=8, max_num_batched_tokens=7)]))
def test_speculation_keeps_the_greedy_outputs(monkeypatch, batch, spec, p, engine):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = tiny_llama()
    prompts, params = [b[0] for b in batch], [b[1] for b in batch]
    base = LLM(model, backend="torch", **engine)
    want = [o.output_token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    llm = LLM(model, backend="torch", speculative_config=spec, **engine)
    recorded = {}
    for prompt, tokens in zip(prompts, want):
        recorded.setdefault(tuple(prompt), tokens)   # the same prompt twice: the same greedy run
    llm.scheduler.proposer = OracleProposer(recorded, p, 256, seed=3)   # chains, or trees (propose_trees)
    got = [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    stats = llm.stats()
    assert stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert stats.num_kv_blocks_used == 0


REGEXES = (r"(ab|ba){1,6}", r"[abc]{2,9}", r"(a|bb|ccc)+d?", r"\{\"k\": (true|false|[0-9]{1,3})\}")


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                   HealthCheck.function_scoped_fixture])
@given(regex=st.sampled_from(REGEXES), spec=speculation(), p=st.sampled_from([0.0, 0.5, 1.0]),
       prompts=st.lists(st.sampled_from(["abab", "cab", "{\"k\": 1", "ddd", "a"]), min_size=1, max_size=3))
def test_speculation_keeps_the_greedy_outputs_of_structured_requests(monkeypatch, tiny_hf_dir, regex, spec, p,
                                                                      prompts):
    """A grammar's matcher advanced and rolled back over drafts (chains or trees, cut where it refuses) and the
    verify rows masked by its states: greedy outputs stay those without speculation and match the regex."""
    import re

    import pytest

    pytest.importorskip("xgrammar")
    from tripath.engine.requests.structured_output import StructuredOutput

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    params = SamplingParams(max_tokens=10, temperature=0, structured_output=StructuredOutput(regex=regex))
    engine = dict(backend="torch", num_kv_blocks=64, block_size=4)
    base = LLM(tiny_hf_dir, **engine)
    want = base.generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_hf_dir, speculative_config=spec, **engine)
    recorded = {}
    for out in want:
        recorded.setdefault(tuple(out.prompt_token_ids), out.output_token_ids)
    llm.scheduler.proposer = OracleProposer(recorded, p, int(llm.model.config.vocab_size), seed=4)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    assert all(o.finish_reason != "error" for o in got)
    assert all(re.fullmatch(regex, o.text) for o in got if o.finish_reason == "stop")
