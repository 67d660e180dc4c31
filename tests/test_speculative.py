"""Speculative decoding: settings refused with a clear error, the n-gram proposer, the acceptance rule (greedy
against a hand computation, sampled against the target distribution with a chi-square test), and the engine:
greedy outputs identical with and without speculation for every backend, MHA and MLA, under preemption, prefix
hits and small token budgets; requests whose sampling needs each token before the next decode without drafts."""

import random

import pytest
import torch

from chi_square import chi_square

from tripath.engine import LLM, EngineConfig, SamplingParams
from tripath.engine.requests.request import Request
from tripath.engine.requests.structured_output import StructuredOutput
from tripath.engine.sampling.sampler import filtered_probs, make_generator
from tripath.engine.speculative import NgramProposer, SpeculativeConfig
from tripath.engine.speculative.acceptance import accept_drafts
from tripath.models import load_model

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(autouse=True)
def _validate_every_step(monkeypatch):
    monkeypatch.setenv("TRIPATH_VALIDATE", "1")


@pytest.fixture
def pure_torch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


# -- settings -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is not available"),
    ({"method": "lookahead", "num_speculative_tokens": 2}, "method 'lookahead' is unknown"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"num_speculative_tokens": 16}, r"num_speculative_tokens must be in \[1, 15\]"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens must be an int"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size must be an int >= 1"),
    ({"num_speculative_tokens": 2, "acceptance_threshold": 1.0}, r"acceptance_threshold must be a number in \[0, 1\)"),
    ({"num_speculative_tokens": 2, "acceptance_threshold": "0.5"}, "acceptance_threshold must be a number"),
    ({"num_speculative_tokens": 2, "min_acceptance": 0.5}, "unknown key.*min_acceptance"),
    ("{not json", "not valid JSON"),
])
def test_bad_settings_name_what_is_wrong(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(device="cpu", speculative_config=config)


def test_settings_from_json_text_and_dict_agree():
    text = EngineConfig(device="cpu", speculative_config='{"num_speculative_tokens": 4}').speculative_config
    assert text == SpeculativeConfig.of({"num_speculative_tokens": 4}) == SpeculativeConfig(num_speculative_tokens=4)
    with pytest.raises(TypeError, match="speculative_config must be a dict"):
        SpeculativeConfig.of(4)


# -- the n-gram proposer --------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens, k, want", [
    ([1, 2, 3, 4, 5, 1, 2, 3], 3, [4, 5, 1]),           # the 3-gram [1, 2, 3] occurred: what followed it
    ([9, 1, 2, 7, 1, 2, 8, 5, 1, 2], 2, [8, 5]),         # the latest occurrence that k tokens follow
    ([1, 2, 7, 7, 1, 2], 5, [7, 7, 1, 2]),               # fewer than k follow any occurrence
    ([4, 5, 6, 7], 3, []),                               # no earlier occurrence of any suffix
    ([3, 8, 3], 2, [8, 3]),                              # a 1-gram
    ([5, 5], 0, []),
])
def test_ngram_proposer_drafts_what_followed_the_suffix(tokens, k, want):
    assert NgramProposer(1, 3).lookup(tokens, k) == want


def _brute_force_lookup(tokens, k, lo, hi):
    length = len(tokens)
    for n in range(min(hi, length - 1), lo - 1, -1):
        starts = [i for i in range(length - n) if tokens[i:i + n] == tokens[length - n:]]
        if starts:
            full = [i for i in starts if i + n + k <= length]
            start = (full[-1] if full else starts[0]) + n
            return tokens[start:start + k]
    return []


def test_ngram_proposer_matches_a_brute_force_search():
    rng = random.Random(0)
    for _ in range(2000):
        vocab, lo = rng.choice([2, 3, 5, 20]), rng.randrange(1, 3)
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 50))]
        k = rng.randrange(1, 6)
        want = _brute_force_lookup(tokens, k, lo, 4) if len(tokens) > lo else []
        assert NgramProposer(lo, 4).lookup(tokens, k) == want, (tokens, k, lo)


def test_ngram_proposer_follows_a_growing_request():
    """The proposer keeps each request's tokens and appends its new outputs: drafts follow the latest tokens."""
    request = Request([7, 8, 9, 7, 8], SamplingParams(max_tokens=10))
    proposer = NgramProposer(1, 3)
    assert proposer.propose_one(request, 2) == [9, 7]
    request.output_token_ids += [9, 1]
    assert proposer.propose_one(request, 2) == []   # 1 occurred nowhere before
    request.output_token_ids += [7, 8, 9]
    assert proposer.propose_one(request, 2) == [1, 7]


def test_ngram_proposer_prefers_the_longest_suffix():
    tokens = [1, 2, 3, 9, 0, 3, 4, 1, 2, 3]   # 1-gram [3] last followed 4; the 3-gram [1, 2, 3] followed by 9
    assert NgramProposer(1, 3).lookup(tokens, 2) == [9, 0]
    assert NgramProposer(1, 1).lookup(tokens, 2) == [4, 1]
    assert NgramProposer(4, 4).lookup(tokens, 2) == []


# -- the acceptance rule --------------------------------------------------------------------------------------

def test_greedy_acceptance_keeps_the_matching_drafts_and_the_next_argmax():
    vocab = 7
    argmaxes = [[3, 5, 1, 6], [2, 4], [0, 0, 0]]   # per verify: the target's argmax after each fed token
    drafts = [[3, 5, 2], [4], [0, 0]]               # all but the last kept / the first rejected / all kept
    logits = torch.randn(sum(len(a) for a in argmaxes), vocab)
    for row, token in enumerate(t for a in argmaxes for t in a):
        logits[row, token] = 10.0
    params = [SamplingParams(temperature=0)] * 3
    got = accept_drafts(logits, drafts, params, [None] * 3)
    assert got.tolist() == [[3, 5, 1, -1], [2, -1, -1, -1], [0, 0, 0, -1]]


@pytest.mark.parametrize("top_k", [0, 4])
def test_sampled_acceptance_follows_the_target_distribution(top_k):
    """Two drafts per request, 6000 requests with their own generators: the first token's law is ``p_0`` and,
    given that the first draft was kept, the second token's law is ``p_1`` (chi-square at p = 0.001)."""
    vocab, n = 6, 6000
    rows = torch.tensor([[0.3, 1.2, 0.9, -0.5, 0.1, 0.6], [1.0, -0.2, 0.4, 0.8, 1.1, 0.0], [0.0] * vocab])
    drafts = [2, 4]
    params = SamplingParams(temperature=0.8, top_k=top_k, seed=0)
    logits = rows.repeat(n, 1)
    got = accept_drafts(logits, [drafts] * n, [params] * n,
                        [make_generator(i, torch.device("cpu")) for i in range(n)])
    p = filtered_probs(rows[:2], torch.full((2,), 0.8), torch.full((2,), top_k), torch.ones(2))
    first = torch.bincount(got[:, 0], minlength=vocab).double()
    kept = got[:, 0] == drafts[0]
    second = torch.bincount(got[kept, 1], minlength=vocab).double()
    critical = {5: 20.52, 3: 16.27}   # chi-square quantiles at 0.999 for the degrees of freedom
    for observed, probs in ((first, p[0].double()), (second, p[1].double())):
        dof = int((probs > 0).sum()) - 1
        assert chi_square(observed, probs) < critical[dof]
    assert abs(kept.double().mean() - p[0, drafts[0]]) < 0.03   # the first draft kept with probability p_0(d)


def test_acceptance_checks_the_rows():
    with pytest.raises(ValueError, match=r"logits must be \[5, vocab\]"):
        accept_drafts(torch.zeros(4, 3), [[1, 2], [0]], [SamplingParams(temperature=0)] * 2, [None] * 2)


# -- the engine -----------------------------------------------------------------------------------------------

_models = {}


def preset(name):
    if name not in _models:
        _models[name] = load_model(name, dtype=torch.float32).eval()
    return _models[name]


def repetitive_prompts(vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    motif = torch.randint(2, vocab, (5,), generator=g).tolist()
    shared = torch.randint(2, vocab, (18,), generator=g).tolist()
    return [motif * 4, shared + motif * 2, shared + torch.randint(2, vocab, (7,), generator=g).tolist(),
            torch.randint(2, vocab, (11,), generator=g).tolist()]


def outputs(llm, prompts, params=GREEDY):
    return [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


VARIANTS = {
    "ample": dict(num_kv_blocks=128, block_size=4),
    "tight_memory": dict(num_kv_blocks=14, block_size=4, max_num_batched_tokens=24),   # preemption
    "small_budget": dict(num_kv_blocks=128, block_size=4, max_num_batched_tokens=6),   # drafts cut to the budget
    "no_prefix_cache": dict(num_kv_blocks=128, block_size=4, enable_prefix_caching=False),
}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_outputs_are_those_without_speculation(pure_torch, name, variant):
    model, prompts = preset(name), repetitive_prompts()
    base = LLM(model, backend="torch", **VARIANTS[variant])
    want = outputs(base, prompts[:2]) + outputs(base, prompts[2:])   # the second run hits the prefix cache
    llm = LLM(model, backend="torch", speculative_config=SPEC, **VARIANTS[variant])
    got = outputs(llm, prompts[:2]) + outputs(llm, prompts[2:])
    assert got == want
    stats = llm.stats()
    assert stats.spec_num_drafts > 0 and 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens
    assert stats.num_kv_blocks_used == 0   # every block back: the rejected drafts' rows held none for good
    if variant == "tight_memory":
        assert stats.num_preemptions > 0
    if variant == "ample":
        assert stats.prefix_cache_hit_tokens > 0


@pytest.mark.parametrize("backend", ["three_path", "two_path", "unified", "mixed"])
def test_triton_backends_verify_as_the_reference(monkeypatch, backend):
    model, prompts = preset("tiny-llama"), repetitive_prompts()[:2]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    want = outputs(LLM(model, backend="torch", num_kv_blocks=64, block_size=8), prompts, params)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    llm = LLM(model, backend=backend, num_kv_blocks=64, block_size=8, speculative_config=SPEC)
    assert outputs(llm, prompts, params) == want
    assert llm.stats().spec_num_accepted_tokens > 0
    # verifies take the decode path (paged_verify on three_path), except on two_path (decodes of one token)
    assert llm.runner.spec.decode_threshold == (1 if backend == "two_path" else 1 + SPEC["num_speculative_tokens"])


# -- how many tokens a request drafts ------------------------------------------------------------------------

class _Request:   # what DraftLengths keys on: any object a weak reference can hold
    pass


def test_draft_lengths_follow_each_requests_acceptance():
    """A new request drafts k; rejected drafts shorten its length to the largest j with a^j >= θ, down to none,
    with a probe of one draft every PROBE_EVERY steps; kept drafts bring it back. Requests seen are apart:
    another's verifies do not move their estimates."""
    from tripath.engine.speculative.draft_length import PROBE_EVERY, DraftLengths

    lengths, request, other = DraftLengths(0.3), _Request(), _Request()
    assert lengths.length(request, 4) == 4 and lengths.length(request, 2) == 2 and lengths.length(request, 0) == 0
    assert lengths.length(other, 4) == 4
    seen = []
    for _ in range(6):
        lengths.observe(request, 4, 0)
        a = lengths.acceptance(request)
        seen.append(lengths.length(request, 4))
        assert seen[-1] == 0 or (a ** seen[-1] >= 0.3 and (seen[-1] == 4 or a ** (seen[-1] + 1) < 0.3))
    assert seen[0] == 2 and seen[-1] == 0 and seen == sorted(seen, reverse=True)
    calls = [lengths.length(request, 4) for _ in range(2 * PROBE_EVERY)]
    probes = [i for i, n in enumerate(calls) if n]
    assert set(calls) == {0, 1} and len(probes) == 2 and probes[1] - probes[0] == PROBE_EVERY
    for _ in range(12):
        lengths.observe(request, 1, 1)
    assert lengths.length(request, 4) == 4 and lengths.length(other, 4) == 4
    with pytest.raises(ValueError, match=r"acceptance_threshold must be in \(0, 1\)"):
        DraftLengths(0.0)


def test_a_new_request_starts_from_the_engines_recent_acceptance():
    """Before any verify a new request drafts k; after many rejected verifies (of other requests) a new one
    drafts nothing until its first probe, PROBE_EVERY steps on, and the steps before it are known ahead; after
    many kept ones a new request drafts k again."""
    from tripath.engine.speculative.draft_length import PROBE_EVERY, DraftLengths

    lengths = DraftLengths(0.3)
    assert lengths.length(_Request(), 4) == 4
    for _ in range(40):
        lengths.observe(_Request(), 4, 0)
    late = _Request()
    assert lengths.acceptance(late) < 0.3 and lengths.steps_without_draft(late, 64) == PROBE_EVERY - 1
    calls = [lengths.length(late, 4) for _ in range(PROBE_EVERY)]
    assert calls == [0] * (PROBE_EVERY - 1) + [1]
    for _ in range(200):
        lengths.observe(_Request(), 4, 4)
    assert lengths.length(_Request(), 4) == 4


def oracle_engine(model, prompts, want, p: float, **spec) -> LLM:
    from tripath.engine.speculative.oracle import OracleProposer

    llm = LLM(model, backend="torch", num_kv_blocks=128, block_size=4,
              speculative_config={"num_speculative_tokens": 4, **spec})
    llm.scheduler.proposer = OracleProposer({tuple(q): w for q, w in zip(prompts, want)}, p, 256)
    return llm


def test_an_acceptance_threshold_stops_drafting_what_is_rejected(pure_torch):
    """Oracle drafts that are always wrong (p = 0): with ``acceptance_threshold`` each request soon drafts only
    its probes, a fraction of the draft tokens of fixed-length speculation; always right (p = 1): every draft,
    as without it. Greedy outputs are those without speculation either way."""
    model, prompts = preset("tiny-llama"), repetitive_prompts()
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = outputs(LLM(model, backend="torch", num_kv_blocks=128, block_size=4), prompts, params)
    drafted = {}
    for p in (0.0, 1.0):
        for threshold in (0.0, 0.4):
            llm = oracle_engine(model, prompts, want, p, acceptance_threshold=threshold)
            assert outputs(llm, prompts, params) == want
            stats = llm.stats()
            drafted[p, threshold] = stats.spec_num_draft_tokens
            assert stats.spec_num_accepted_tokens == (stats.spec_num_draft_tokens if p else 0)
    assert drafted[0.0, 0.4] < 0.3 * drafted[0.0, 0.0]
    assert drafted[1.0, 0.4] == drafted[1.0, 0.0] > 0


def test_requests_that_draft_nothing_still_probe_and_new_ones_start_there(pure_torch):
    """Every draft wrong, ``acceptance_threshold`` 0.4, steps overlapping (a decode's token in flight when it is
    scheduled): each request still probes, its steps without drafts counting toward the probe; a second pass
    on the same engine starts its new requests from the engine's acceptance, so all it drafts are one-token
    probes. Greedy outputs are those without speculation."""
    model, prompts = preset("tiny-llama"), repetitive_prompts()
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = outputs(LLM(model, backend="torch", num_kv_blocks=128, block_size=4), prompts, params)
    llm = oracle_engine(model, prompts, want, 0.0, acceptance_threshold=0.4)
    assert llm.overlap
    assert outputs(llm, prompts, params) == want
    first = llm.stats()
    assert outputs(llm, prompts, params) == want
    second = llm.stats()
    probes = second.spec_num_drafts - first.spec_num_drafts
    assert probes >= len(prompts) and second.spec_num_draft_tokens - first.spec_num_draft_tokens == probes
    assert second.spec_num_accepted_tokens == 0


def test_no_drafts_while_more_requests_run_than_disable_by_batch_size(pure_torch):
    """``disable_by_batch_size`` 1 (vLLM's key): nothing is drafted while two or three requests run; the one left
    running drafts; greedy outputs are those without speculation."""
    model, prompts = preset("tiny-llama"), repetitive_prompts()[:3]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (4, 8, 30)]
    want = outputs(LLM(model, backend="torch", num_kv_blocks=128, block_size=4), prompts, params)
    llm = oracle_engine(model, prompts, want, 1.0, disable_by_batch_size=1)
    proposer, running = llm.scheduler.proposer, []
    propose = proposer.propose
    proposer.propose = lambda items: running.append(len(llm.scheduler.running)) or propose(items)
    assert outputs(llm, prompts, params) == want
    assert running and max(running) == 1 and llm.stats().spec_num_accepted_tokens > 0


def test_sampled_requests_are_seeded(pure_torch):
    model, prompts = preset("tiny-llama"), repetitive_prompts()
    params = SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, seed=11, ignore_eos=True)
    llm = LLM(model, backend="torch", num_kv_blocks=128, block_size=4, speculative_config=SPEC)
    first, again = outputs(llm, prompts, params), outputs(llm, prompts, params)
    assert first == again and all(len(o) == 16 for o in first)
    assert llm.stats().spec_num_drafts > 0


def test_rejected_probes_space_out_and_a_kept_one_brings_them_back():
    """A request that drafts nothing probes after PROBE_EVERY idle steps; each probe rejected doubles the gap, up
    to MOST_PROBE_GAP; a probe kept brings it back to PROBE_EVERY."""
    from tripath.engine.speculative.draft_length import MOST_PROBE_GAP, PROBE_EVERY, DraftLengths

    lengths, request = DraftLengths(0.5), _Request()
    for _ in range(4):
        lengths.observe(request, 4, 0)

    def gap_to_next_probe() -> int:
        ahead = lengths.steps_without_draft(request, 10_000)
        calls = [lengths.length(request, 4) for _ in range(ahead + 1)]
        assert calls == [0] * ahead + [1]
        return ahead + 1

    gaps = []
    for _ in range(6):
        gaps.append(gap_to_next_probe())
        lengths.observe(request, 1, 0)
    want = [min(PROBE_EVERY * 2 ** n, MOST_PROBE_GAP) for n in range(6)]
    assert gaps == want and want[-1] == MOST_PROBE_GAP
    gap_to_next_probe()
    lengths.observe(request, 1, 1)   # kept: the estimate may now allow drafts; once it does not, probes come sooner
    while lengths.length(request, 4):
        lengths.observe(request, 1, 0)
    assert lengths.steps_without_draft(request, 10_000) < PROBE_EVERY


def test_a_new_request_probes_at_the_gap_the_engines_latest_probe_left():
    """Where the engine's probes keep being rejected, a new request whose prior allows no draft waits the gap
    the latest probe left (MOST_PROBE_GAP once they reached it) before its first probe, not PROBE_EVERY; once a
    probe of any request is kept, new requests probe after PROBE_EVERY again."""
    from tripath.engine.speculative.draft_length import MOST_PROBE_GAP, PROBE_EVERY, DraftLengths

    lengths, old = DraftLengths(0.3), _Request()
    for _ in range(40):
        lengths.observe(old, 4, 0)
    gaps = []
    while not gaps or gaps[-1] < MOST_PROBE_GAP:   # the old request's probes, each rejected
        ahead = lengths.steps_without_draft(old, 10_000)
        assert [lengths.length(old, 4) for _ in range(ahead + 1)] == [0] * ahead + [1]
        gaps.append(ahead + 1)
        lengths.observe(old, 1, 0)
    new = _Request()
    assert lengths.steps_without_draft(new, 10_000) == MOST_PROBE_GAP - 1
    assert [lengths.length(new, 4) for _ in range(MOST_PROBE_GAP)] == [0] * (MOST_PROBE_GAP - 1) + [1]
    lengths.observe(new, 1, 1)   # a probe kept
    assert lengths.steps_without_draft(_Request(), 10_000) == PROBE_EVERY - 1


def test_draft_lengths_tell_the_steps_before_a_probe():
    """``steps_without_draft`` counts the calls of ``length`` that would give no draft (0 once the estimate
    allows one, or a probe is due), and ``skip`` counts steps as those calls do."""
    from tripath.engine.speculative.draft_length import PROBE_EVERY, DraftLengths

    request = _Request()
    assert DraftLengths(0.5).steps_without_draft(request, 8) == 0   # new: drafts k
    for skipped in range(PROBE_EVERY):
        lengths = DraftLengths(0.5)
        for _ in range(4):
            lengths.observe(request, 4, 0)
        if skipped:
            lengths.skip(request, skipped)
        ahead = lengths.steps_without_draft(request, 100)
        assert ahead == max(0, PROBE_EVERY - 1 - skipped) and lengths.steps_without_draft(request, 2) == min(2, ahead)
        calls = [lengths.length(request, 4) for _ in range(ahead + 1)]
        assert calls == [0] * ahead + [1], (skipped, calls)


def test_steps_between_probes_run_several_model_steps(monkeypatch):
    """Adaptive draft lengths with every draft wrong: once the requests draft only their probes, the steps
    between the probes run as one launch of ``decode_steps`` model steps (a graph backend, here under the
    interpreter) with nothing drafted. Greedy outputs are those without speculation."""
    from tripath.engine.speculative.draft_length import PROBE_EVERY
    from tripath.engine.speculative.oracle import OracleProposer

    model, prompts = preset("tiny-llama"), repetitive_prompts()[:2]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = outputs(LLM(model, backend="torch", num_kv_blocks=128, block_size=4), prompts, params)
    llm = LLM(model, backend="three_path", num_kv_blocks=128, block_size=4,
              speculative_config={"num_speculative_tokens": 4, "acceptance_threshold": 0.4})
    llm.scheduler.proposer = OracleProposer({tuple(q): w for q, w in zip(prompts, want)}, 0.0, 256)
    assert llm.decode_steps > 1
    launches, launch = [], llm.runner.launch

    def launched(scheduled, previous=None, num_steps=1):
        launches.append((num_steps, any(s.draft_token_ids for s in scheduled)))
        return launch(scheduled, previous, num_steps)

    monkeypatch.setattr(llm.runner, "launch", launched)
    assert outputs(llm, prompts, params) == want
    multi = [n for n, drafted in launches if n > 1]
    assert multi[0] == PROBE_EVERY - 1 and len(multi) >= 2, launches
    assert not any(drafted for n, drafted in launches if n > 1), launches


def test_penalties_min_tokens_and_logit_bias_apply_to_every_verify_row(pure_torch):
    """Requests with penalties, ``min_tokens`` or ``logit_bias`` take drafts: each verify row's logits are
    transformed as a non-speculative step at its place would (the penalties counting the drafts before the
    row, ``min_tokens`` counting them too), so greedy outputs are those without speculation with n-gram drafts
    and with an oracle's (every draft right: all kept; half corrupted), and the penalties' counts gain the
    tokens each verify yields. ``logit_bias`` pushes the end-of-sequence token, which ``min_tokens`` holds off
    for exactly its count."""
    from tripath.engine.speculative.oracle import OracleProposer

    model, prompts = preset("tiny-llama"), repetitive_prompts()
    eos = int(model.config.eos_token_ids[0])
    kinds = [dict(repetition_penalty=1.6, ignore_eos=True), dict(frequency_penalty=0.8, presence_penalty=0.5,
                                                                 ignore_eos=True),
             dict(min_tokens=6, logit_bias={eos: 30.0, 7: 1.5})]
    base = LLM(model, backend="torch", num_kv_blocks=128, block_size=4)
    for kind in kinds:
        params = SamplingParams(max_tokens=16, temperature=0, **kind)
        want = outputs(base, prompts, params)
        if "min_tokens" in kind:
            assert all(len(w) == 7 and w[-1] == eos for w in want)
        llm = LLM(model, backend="torch", num_kv_blocks=128, block_size=4, speculative_config=SPEC)
        assert outputs(llm, prompts, params) == want, kind
        for p in (1.0, 0.5):
            llm = LLM(model, backend="torch", num_kv_blocks=128, block_size=4,
                      speculative_config={"num_speculative_tokens": 4})
            llm.scheduler.proposer = OracleProposer({tuple(q): w for q, w in zip(prompts, want)}, p, 256, seed=2)
            assert outputs(llm, prompts, params) == want, (kind, p)
            stats = llm.stats()
            assert stats.spec_num_accepted_tokens > 0
            if p == 1.0:
                assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens, (kind, stats)


def test_verify_rows_transform_as_their_paths_do():
    """``verify_transforms`` against the formulas: each row of a verify (chains and trees) gets ``min_tokens``,
    ``logit_bias`` and the penalties over the request's prompt, outputs and its path's drafts (a tree node's
    path skips its earlier siblings); ``record`` adds the tokens each verify yielded to its counts."""
    from tripath.engine.sampling.logits_transforms import PenaltyState
    from tripath.engine.scheduling.scheduler import ScheduledRequest
    from tripath.engine.speculative.verify_transforms import verify_transforms

    def paths(drafts, parents):   # row 0: none; row 1 + i: draft i's ancestors, then itself
        out = [[]]
        for i in range(len(drafts)):
            node, path = i, []
            while node >= 0:
                path.append(drafts[node])
                node = node - 1 if parents is None else parents[node]
            out.append(path[::-1])
        return out

    g = torch.Generator().manual_seed(0)
    vocab = 40
    cases = [  # sampling params, drafts, parents
        (SamplingParams(repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=0.3), [3, 5, 3], None),
        (SamplingParams(min_tokens=5, logit_bias={4: 2.5}, stop_token_ids=[9]), [9, 2, 9], None),
        (SamplingParams(repetition_penalty=1.3, frequency_penalty=0.9), [7, 8, 8, 7], [-1, -1, 1, 1]),
        (SamplingParams(), [1], None),   # no transforms: its rows stay as they are
    ]
    verifies = []
    for params, drafts, parents in cases:
        prompt = torch.randint(0, vocab, (6,), generator=g).tolist()
        request = Request(prompt, params, eos_token_ids=[1])
        for token in torch.randint(0, vocab, (3,), generator=g).tolist():
            request.append_token(token)
        verifies.append(ScheduledRequest(request, 1 + len(drafts), len(prompt) + 2, True, drafts, parents))
    logits = torch.randn(sum(v.num_new_tokens for v in verifies), vocab, generator=g)
    state = PenaltyState(4, torch.device("cpu"))
    transforms = verify_transforms(verifies, state, vocab, torch.device("cpu"))
    got = transforms.apply(logits)
    row = 0
    for item in verifies:
        request, params = item.request, item.request.sampling_params
        for path in paths(item.draft_token_ids, item.draft_parents):
            z = logits[row].clone()
            if len(request.output_token_ids) + len(path) < params.min_tokens:
                z[[9, 1]] = float("-inf")
            for token, bias in (params.logit_bias or {}).items():
                z[token] += bias
            if params.has_penalties:
                counts = torch.bincount(torch.tensor(request.output_token_ids + path), minlength=vocab)
                seen = (counts > 0) | torch.isin(torch.arange(vocab), torch.tensor(request.prompt_token_ids))
                r = params.repetition_penalty
                z = torch.where(seen, torch.where(z > 0, z / r, z * r), z)
                z = z - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
            torch.testing.assert_close(got[row], z, msg=lambda m: f"row {row}: {m}")
            row += 1
    yielded = torch.tensor([[3, 5, -1, -1], [2, -1, -1, -1], [8, 7, 11, -1], [1, 2, -1, -1]])
    transforms.record(yielded)
    for j in (0, 2):
        slot = state.slots_for([verifies[j].request], vocab)[0]
        kept = [t for t in yielded[j].tolist() if t >= 0]
        want = torch.bincount(torch.tensor(verifies[j].request.output_token_ids + kept), minlength=vocab)
        assert torch.equal(state.counts[slot].long(), want)


def test_structured_outputs_verify_drafts_under_their_grammar(pure_torch, tiny_hf_dir):
    """A grammar-constrained request takes drafts: each verify row is masked by its grammar's state after the
    drafts before it, and drafts the grammar refuses are cut before the step. Greedy outputs are those without
    speculation with n-gram drafts and with an oracle's half-corrupted ones (each corruption the grammar
    refuses cuts the drafts there); sampled outputs (drafts: a sampled run's tokens) match the grammar."""
    pytest.importorskip("xgrammar")
    import re

    from tripath.engine.speculative.oracle import OracleProposer

    regex = r"(ab){2,6}"
    greedy = SamplingParams(max_tokens=14, temperature=0, structured_output=StructuredOutput(regex=regex))
    sampled = SamplingParams(max_tokens=14, temperature=1.0, seed=5, structured_output=StructuredOutput(regex=regex))
    prompts = ["abababab", "ab ab ab", "abc"]
    base = LLM(tiny_hf_dir, backend="torch", num_kv_blocks=64)
    want = base.generate(prompts, greedy, use_tqdm=False)
    want_sampled = base.generate(prompts, sampled, use_tqdm=False)
    recorded = {tuple(o.prompt_token_ids): o.output_token_ids for o in want}
    recorded_sampled = {tuple(o.prompt_token_ids): o.output_token_ids for o in want_sampled}
    ngram = LLM(tiny_hf_dir, backend="torch", num_kv_blocks=64, speculative_config=SPEC)
    assert [o.output_token_ids for o in ngram.generate(prompts, greedy, use_tqdm=False)] == \
        [o.output_token_ids for o in want]
    assert ngram.stats().spec_num_drafts > 0
    vocab = int(ngram.model.config.vocab_size)
    for p, params, runs in ((0.5, greedy, recorded), (1.0, greedy, recorded), (1.0, sampled, recorded_sampled)):
        llm = LLM(tiny_hf_dir, backend="torch", num_kv_blocks=64, speculative_config={"num_speculative_tokens": 4})
        llm.scheduler.proposer = OracleProposer(runs, p, vocab, seed=1)
        got = llm.generate(prompts, params, use_tqdm=False)
        assert all(re.fullmatch(regex, o.text) for o in got)
        stats = llm.stats()
        assert stats.spec_num_accepted_tokens > 0
        if params is sampled:   # rejection sampling: the same distribution, not the same draws
            continue
        assert [o.output_token_ids for o in got] == list(runs.values())
        if p == 1.0:
            assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
        else:   # corrupted drafts the grammar refuses were cut before the step
            assert stats.spec_num_draft_tokens < 4 * stats.spec_num_drafts


def test_a_grammars_draft_masks_are_those_of_its_state_after_each_draft(tiny_hf_dir):
    """``GrammarState.fill_drafts``: row j of a chain (a tree's node: its path) is the mask a fresh matcher gives
    after the same tokens; a row past a refused draft allows everything; the matcher is left as it was."""
    pytest.importorskip("xgrammar")
    from tripath.engine.requests.structured_output import GrammarCompiler, new_bitmask
    from tripath.models import load_tokenizer

    tokenizer = load_tokenizer(tiny_hf_dir)
    vocab = len(tokenizer)
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    spec = StructuredOutput(regex=r"(ab|ac){1,4}")
    a, b, c = (tokenizer.convert_tokens_to_ids(t) for t in ("a", "b", "c"))
    state = compiler.state(spec)
    assert state.accept(a)

    def mask_after(tokens):
        fresh = compiler.state(spec)
        assert all(fresh.accept(t) for t in [a] + tokens)
        mask = new_bitmask(1, vocab)
        fresh.fill(mask, 0)
        return mask[0]

    everything = new_bitmask(1, vocab)[0]
    chain = [b, a, c, c]   # the last one refused: after "abac" only "a" or the end may come
    mask = new_bitmask(5, vocab)
    state.fill_drafts(mask, 0, chain)
    assert state.valid_drafts(chain) == 3
    for j in range(4):
        assert torch.equal(mask[j], mask_after(chain[:j]))
    assert torch.equal(mask[4], everything)
    tree, parents = [b, c, a, a], [-1, -1, 0, 1]   # "b", "c", "b"+"a", "c"+"a"
    mask = new_bitmask(5, vocab)
    state.fill_drafts(mask, 0, tree, parents)
    for row, path in enumerate([[], [b], [c], [b, a], [c, a]]):
        assert torch.equal(mask[row], mask_after(path))
    fresh = new_bitmask(1, vocab)
    state.fill(fresh, 0)
    assert torch.equal(fresh[0], mask_after([]))   # left after "a"


def test_log_probabilities_of_verified_tokens_are_those_without_speculation(pure_torch):
    """Requests asking for log-probabilities take drafts: every output token's entry (chosen token, rank, the
    top k) and the cumulative log-probability are those of the run without speculation."""
    model, prompts = preset("tiny-llama"), repetitive_prompts()
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=3)
    base = LLM(model, backend="torch", num_kv_blocks=128, block_size=4).generate(prompts, params, use_tqdm=False)
    llm = LLM(model, backend="torch", num_kv_blocks=128, block_size=4, speculative_config=SPEC)
    got = llm.generate(prompts, [params, SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)] * 2,
                       use_tqdm=False)
    assert llm.stats().spec_num_accepted_tokens > 0
    for i, (want, out) in enumerate(zip(base, got)):
        assert out.output_token_ids == want.output_token_ids
        if i % 2:
            assert out.outputs[0].logprobs is None
            continue
        assert len(out.outputs[0].logprobs) == len(want.outputs[0].logprobs) == 14
        for a, b in zip(out.outputs[0].logprobs, want.outputs[0].logprobs):
            assert a.keys() == b.keys()
            for token in a:
                assert a[token].rank == b[token].rank
                assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)
        assert out.outputs[0].cumulative_logprob == pytest.approx(want.outputs[0].cumulative_logprob, abs=1e-3)


@pytest.mark.parametrize("draft, variant", [("tiny-llama", "ample"), ("tiny-llama", "tight_memory"),
                                            ("tiny-qwen3", "small_budget")])
def test_draft_model_greedy_outputs_are_those_without_speculation(pure_torch, draft, variant):
    """A draft model beside the target: the target itself (every greedy draft is the target's own next token,
    so each verify keeps them all, through preemptions too) or another model of the same vocabulary."""
    model, prompts = preset("tiny-llama"), repetitive_prompts()
    want = outputs(LLM(model, backend="torch", **VARIANTS[variant]), prompts)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    llm = LLM(model, backend="torch", speculative_config=spec, **VARIANTS[variant])
    assert type(llm.scheduler.proposer).__name__ == "DraftModelProposer"
    assert outputs(llm, prompts) == want
    stats = llm.stats()
    assert stats.spec_num_drafts > 0
    if draft == "tiny-llama":
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    if variant == "tight_memory":
        assert stats.num_preemptions > 0


def test_the_draft_caches_bytes_per_block_are_what_its_runner_allocates(pure_torch):
    """The target's GPU memory plan sizes the draft's cache to the same blocks with ``draft_cache_bytes``:
    the bytes the draft runner's caches take, per block."""
    from tripath.engine.drafters.draft_model import draft_cache_bytes

    llm = LLM(preset("tiny-llama"), backend="torch", num_kv_blocks=24, block_size=8,
              speculative_config={"model": "tiny-qwen3", "num_speculative_tokens": 2})
    draft = llm.scheduler.proposer
    held = sum(t.numel() * t.element_size() for cache in draft.runner.caches
               for t in (cache.k_cache, cache.v_cache))
    assert draft.runner.num_blocks == 24 and draft.runner.block_size == 8
    assert draft_cache_bytes(draft.model, llm.config)(8) * 24 == held


def test_draft_model_refusals():
    with pytest.raises(ValueError, match="'draft_model' needs model"):
        EngineConfig(device="cpu", speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="draft_tensor_parallel_size must be 1"):
        EngineConfig(device="cpu", speculative_config={"model": "tiny-llama", "num_speculative_tokens": 2,
                                                       "draft_tensor_parallel_size": 2})
    from engine_models import tiny_model

    with pytest.raises(ValueError, match="vocabulary of 256 tokens, the target 61"):
        LLM(tiny_model(), backend="torch", num_kv_blocks=16,
            speculative_config={"model": "tiny-llama", "num_speculative_tokens": 2})


def test_real_model_drafts_from_a_repetitive_prompt(pure_torch, smollm2):
    """SmolLM2-135M-Instruct asked to repeat a list: n-gram drafts are accepted and the tokens are those of the
    run without speculation."""
    prompt = ("Repeat this list exactly three times, one item per line:\napple\nbanana\ncherry\ndate\n"
              "apple\nbanana\ncherry\ndate\n")
    params = SamplingParams(max_tokens=40, temperature=0)
    base = LLM(smollm2, num_kv_blocks=64)
    llm = LLM(smollm2, num_kv_blocks=64, speculative_config={"num_speculative_tokens": 4})
    assert outputs(llm, [prompt], params) == outputs(base, [prompt], params)
    stats = llm.stats()
    assert stats.spec_num_accepted_tokens > 0, stats


@pytest.mark.gpu
@pytest.mark.parametrize("name,backend", [("tiny-llama", "three_path"), ("tiny-llama", "unified"),
                                          ("tiny-llama", "two_path"), ("tiny-deepseek", "auto")])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_on_the_gpu_with_the_engine_defaults(name, backend, method):
    """The engine's GPU defaults (CUDA graphs, warm-up, the verify route, fp16; the memory plan sizing the
    target's and the draft's caches): greedy outputs as without speculation (up to near ties), through
    preemptions too; verifies were taken and drafts accepted."""
    from model_steps import assert_same_or_near_tie

    model = load_model(name, dtype=torch.float16, device="cuda")
    prompts = repetitive_prompts() * 3
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    common = dict(backend=backend, max_num_batched_tokens=512, max_num_seqs=12, device="cuda", num_kv_blocks=256,
                  block_size=16)
    expected = outputs(LLM(model, enforce_eager=True, **common), prompts, params)
    spec = {"method": method, "num_speculative_tokens": 4, **({"model": name} if method == "draft_model" else {})}
    planned = {k: v for k, v in common.items() if k != "num_kv_blocks"}   # the memory plan sizes the caches
    for options in (common, dict(common, num_kv_blocks=40), dict(planned, gpu_memory_utilization=0.3)):
        llm = LLM(model, speculative_config=spec, **options)
        assert_same_or_near_tie(model, prompts, expected, outputs(llm, prompts, params))
        stats = llm.stats()
        assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0, stats
        assert llm.num_compiled_since_start == 0
