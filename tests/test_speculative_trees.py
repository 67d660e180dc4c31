"""Speculative decoding with draft trees (``tree_width > 1``): the settings and backends refused, the trees'
helpers and the n-gram proposer's trees, tree acceptance (greedy on hand-made trees, sampled against the target
distribution with a chi-square test), and the engine: greedy outputs identical to those without speculation with
n-gram trees, a path through later siblings whose cache rows must move (cache layouts, fp8), oracle trees."""

import random

import pytest
import torch

from chi_square import chi_square

from tripath.engine import LLM, EngineConfig, SamplingParams
from tripath.engine.runner import draft_trees
from tripath.engine.sampling.sampler import filtered_probs, make_generator
from tripath.engine.speculative import NgramProposer
from tripath.engine.speculative.acceptance import accept_tree
from tripath.engine.speculative.oracle import OracleProposer
from tripath.engine.speculative.trees import depths, merge_branches, path_moves, tree_mask_bits
from tripath.models import load_model
from tripath.ops.kv_cache import allocate_kv_cache, as_nhd, copy_cache_slots

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
_models = {}


@pytest.fixture(autouse=True)
def _validate_every_step(monkeypatch):
    monkeypatch.setenv("TRIPATH_VALIDATE", "1")


@pytest.fixture
def pure_torch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def preset(name):
    if name not in _models:
        _models[name] = load_model(name, dtype=torch.float32).eval()
    return _models[name]


def spec(width, k=5, **more):
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "tree_width": width, **more}


def branching_prompts(vocab: int = 256) -> list[list[int]]:
    """Prompts in which every token occurred at least twice with different successors (the first token the
    model appends makes n-gram trees branch), then repetitive ones (whose drafts get accepted)."""
    g = torch.Generator().manual_seed(3)

    def some(n):
        return torch.randint(2, vocab, (n,), generator=g).tolist()

    a, b, c = some(3), some(6), some(6)
    return [some(5) * 4, some(18) + a + b + a + c + a, a + b + a + c + a + b + a + c + a,
            torch.randperm(vocab, generator=g).tolist() + torch.randperm(vocab, generator=g).tolist()]


def outputs(llm, prompts, params=GREEDY):
    return [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


# -- settings -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config, message", [
    (spec(0), r"tree_width must be in \[1, num_speculative_tokens=5\]"),
    (spec(6), r"tree_width must be in \[1, num_speculative_tokens=5\]"),
    (spec("2"), "tree_width must be an int"),
    ({"method": "draft_model", "model": "tiny-llama", "num_speculative_tokens": 3, "tree_width": 2},
     "tree_width=2 .*not supported by method 'draft_model'"),
    ({"method": "mtp", "num_speculative_tokens": 3, "tree_width": 2}, "tree_width=2 .*not supported by method 'mtp'"),
])
def test_bad_tree_settings_name_the_option(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(device="cpu", speculative_config=config)


def test_tree_width_one_is_the_default_chain():
    assert EngineConfig(device="cpu", speculative_config=spec(1)).speculative_config == \
        EngineConfig(device="cpu", speculative_config={k: v for k, v in spec(1).items() if k != "tree_width"}
                     ).speculative_config


@pytest.mark.parametrize("name, backend, message", [
    ("tiny-llama", "unified", "not supported by the unified backend"),
    ("tiny-llama", "two_path", "not supported by the two_path backend"),
    ("tiny-deepseek", "sdpa", "not supported by the sdpa backend"),
])
def test_backends_without_tree_verification_are_refused(name, backend, message):
    with pytest.raises(ValueError, match=message):
        LLM(preset(name), backend=backend, num_kv_blocks=32, block_size=8, speculative_config=spec(2))


# -- trees and the n-gram proposer ----------------------------------------------------------------------------

def test_branches_merge_by_common_prefix_breadth_first_within_the_budget():
    tokens, parents = merge_branches([[5, 6, 7], [5, 8, 9], [4, 1]], budget=10)
    assert (tokens, parents) == ([5, 4, 6, 8, 1, 7, 9], [-1, -1, 0, 0, 1, 2, 3])
    assert depths(parents) == [1, 1, 2, 2, 2, 3, 3]
    assert merge_branches([[5, 6, 7], [5, 8, 9], [4, 1]], budget=4) == ([5, 4, 6, 8], [-1, -1, 0, 0])
    # rows: root, then the nodes; each sees the root, its ancestors and itself
    assert tree_mask_bits([-1, -1, 0]) == [0b1, 0b11, 0b101, 0b1011]
    assert path_moves([1, 3]) == [(2, 1), (4, 2)] and path_moves([0, 1]) == []


def test_ngram_trees_branch_over_earlier_occurrences():
    proposer = NgramProposer(1, 3)
    tokens = [1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 1, 2, 3]
    assert proposer.lookup_tree(tokens, 4, 2) == ([7, 9, 6, 8], [-1, -1, 0, 1])
    assert proposer.lookup_tree(tokens, 3, 2) == ([7, 9, 6], [-1, -1, 0])   # the budget keeps shallow nodes
    assert proposer.lookup_tree([1, 2, 5, 1, 2, 5, 1, 2], 3, 3) == ([5, 1, 2], [-1, 0, 1])   # one distinct
    assert proposer.lookup_tree([4, 5, 6], 3, 2) == ([], [])


def test_ngram_trees_of_width_one_are_the_chains():
    rng = random.Random(0)
    proposer = NgramProposer(1, 3)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(2, 30))]
        k = rng.randrange(1, 6)
        chain = proposer.lookup(tokens, k)
        assert proposer.lookup_tree(tokens, k, 1) == (chain, list(range(-1, len(chain) - 1)))
        wide, parents = proposer.lookup_tree(tokens, k, 3)
        assert len(wide) <= k and all(p < t for t, p in enumerate(parents))
        assert wide[:1] == chain[:1]   # the chain's branch comes first
        for node in set(parents):   # siblings draft distinct tokens
            siblings = [wide[t] for t, p in enumerate(parents) if p == node]
            assert len(siblings) == len(set(siblings))


@pytest.mark.parametrize("layout, dtype", [("nhd", torch.float16), ("shuffled", torch.float16),
                                           ("nhd", torch.float8_e4m3fn), ("shuffled", torch.float8_e4m3fn)])
def test_cache_slots_copy_every_head_in_either_layout(layout, dtype):
    block_size, heads, head_size = 16, 2, 16
    k_nhd = torch.randn(4, block_size, heads, head_size).to(dtype)
    v_nhd = torch.randn(4, block_size, heads, head_size).to(dtype)
    k_cache, v_cache = allocate_kv_cache(4, block_size, heads, head_size, dtype=dtype, layout=layout)
    raw = torch.uint8 if dtype.itemsize == 1 else torch.int16
    if layout == "nhd":
        k_cache.copy_(k_nhd), v_cache.copy_(v_nhd)
    else:
        x = k_cache.shape[4]
        k_cache.view(raw).copy_(k_nhd.view(raw).reshape(4, block_size, heads, head_size // x, x).permute(0, 2, 3, 1, 4))
        v_cache.view(raw).copy_(v_nhd.view(raw).reshape(4, block_size // x, x, heads, head_size).permute(0, 3, 1, 4, 2))
    sources, targets = torch.tensor([20, 35, 17, 50]), torch.tensor([18, 19, 60, 20])   # 20: read, then written
    copy_cache_slots(k_cache, v_cache, sources, targets, layout=layout)
    got_k, got_v = as_nhd(k_cache, v_cache, layout)
    for want, got in ((k_nhd, got_k), (v_nhd, got_v)):
        rows = want.view(raw).reshape(-1, heads, head_size).clone()
        rows[targets] = rows[sources]
        assert torch.equal(got.contiguous().view(raw).reshape(-1, heads, head_size), rows)


# -- tree acceptance ------------------------------------------------------------------------------------------

def _logits_with_argmax(argmaxes, vocab=9):
    logits = torch.randn(len(argmaxes), vocab)
    for row, token in enumerate(argmaxes):
        logits[row, token] = 10.0
    return logits


def test_greedy_tree_acceptance_takes_the_longest_matching_path():
    # verify 0: root children 3 (node 0), 5 (node 1); node 1's children 2 (node 2), 7 (node 3); node 3's child 1
    drafts0, parents0 = [3, 5, 2, 7, 1], [-1, -1, 1, 1, 3]
    argmax0 = [5, 0, 7, 0, 1, 4]             # root -> 5 (node 1) -> 7 (node 3) -> 1 (node 4) -> bonus 4
    # verify 1: nothing matches at the root: the root's argmax alone
    drafts1, parents1, argmax1 = [6, 8], [-1, -1], [2, 0, 0]
    # verify 2: the first child matches, its child does not
    drafts2, parents2, argmax2 = [4, 4], [-1, 0], [4, 3, 0]
    logits = _logits_with_argmax(argmax0 + argmax1 + argmax2)
    grid, paths = accept_tree(logits, [drafts0, drafts1, drafts2], [parents0, parents1, parents2],
                              [SamplingParams(temperature=0)] * 3, [None] * 3)
    assert paths == [[1, 3, 4], [], [0]]
    assert grid.tolist() == [[5, 7, 1, 4, -1, -1], [2, -1, -1, -1, -1, -1], [4, 3, -1, -1, -1, -1]]
    with pytest.raises(ValueError, match=r"logits must be \[3, vocab\]"):
        accept_tree(torch.zeros(2, 4), [[1, 2]], [[-1, -1]], [SamplingParams(temperature=0)], [None])


@pytest.mark.parametrize("top_k", [0, 5])
def test_sampled_tree_acceptance_follows_the_target_distribution(top_k):
    """Root children 2, 4, 1 (nodes 0-2), node 0's children 0, 3: over 6000 requests the first token's law is
    the root row's ``p``; given 2 (node 0 kept), the second token's is node 0's row's, given 4 node 1's
    (chi-square at p = 0.001)."""
    vocab, n = 6, 6000
    rows = torch.tensor([[0.3, 1.2, 0.9, -0.5, 0.8, 0.6], [1.0, -0.2, 0.4, 0.8, 1.1, 0.0],
                         [0.2, 0.9, -0.3, 0.5, 0.0, 1.3], [0.0] * vocab, [0.1] * vocab, [0.0] * vocab])
    drafts, parents = [2, 4, 1, 0, 3], [-1, -1, -1, 0, 0]
    params = SamplingParams(temperature=0.8, top_k=top_k, seed=0)
    grid, paths = accept_tree(rows.repeat(n, 1), [drafts] * n, [parents] * n, [params] * n,
                              [make_generator(i, torch.device("cpu")) for i in range(n)])
    p = filtered_probs(rows[:3], torch.full((3,), 0.8), torch.full((3,), top_k), torch.ones(3)).double()
    critical = {5: 20.52, 4: 18.47}   # chi-square quantiles at 0.999 for the degrees of freedom
    first = grid[:, 0]
    checks = [(torch.bincount(first, minlength=vocab).double(), p[0])]
    for token, row in ((2, 1), (4, 2)):
        given = first == token
        assert all(paths[i][:1] == [drafts.index(token)] for i in torch.nonzero(given).flatten().tolist())
        checks.append((torch.bincount(grid[given, 1], minlength=vocab).double(), p[row]))
    for observed, probs in checks:
        assert chi_square(observed, probs) < critical[int((probs > 0).sum()) - 1]


# -- the engine -----------------------------------------------------------------------------------------------

def _spy_trees(llm):
    """Record every draft tree the engine's scheduler proposes."""
    seen = []
    propose = llm.scheduler.proposer.propose_trees

    def recording(items, width):
        trees = propose(items, width)
        seen.extend(trees)
        return trees

    llm.scheduler.proposer.propose_trees = recording
    return seen


@pytest.mark.parametrize("width", [2, 3])
def test_ngram_tree_greedy_outputs_are_those_without_speculation(pure_torch, width):
    model, prompts = preset("tiny-llama"), branching_prompts()
    want = outputs(LLM(model, backend="torch", num_kv_blocks=400, block_size=4), prompts)
    llm = LLM(model, backend="torch", num_kv_blocks=400, block_size=4, speculative_config=spec(width))
    trees = _spy_trees(llm)
    assert outputs(llm, prompts) == want
    branching = [t for t in trees if t[1].count(-1) > 1 or len(set(t[1])) < len(t[1])]
    assert branching, "no proposed tree had more than one branch"
    assert max(len(set(p for p in parents if parents.count(p) > 1)) for _, parents in trees) >= 1
    stats = llm.stats()
    assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens
    assert stats.num_kv_blocks_used == 0


def test_ngram_trees_on_the_triton_verify_kernel(monkeypatch):
    model, prompts = preset("tiny-llama"), branching_prompts()[:2]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    want = outputs(LLM(model, backend="torch", num_kv_blocks=64, block_size=8), prompts, params)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    llm = LLM(model, backend="three_path", num_kv_blocks=64, block_size=8, speculative_config=spec(2, k=4))
    trees = _spy_trees(llm)
    assert outputs(llm, prompts, params) == want
    assert trees and llm.stats().spec_num_accepted_tokens > 0


class _SecondSiblings:
    """Trees whose recorded (greedy) branch is always the second child: ``[wrong, right]`` at each depth, so
    every accepted node's cache rows must move to its position."""

    def __init__(self, recorded, vocab):
        self.recorded, self.vocab = recorded, vocab

    def propose_trees(self, items, width):
        out = []
        for request, k in items:
            run = self.recorded[tuple(request.prompt_token_ids)][request.num_output_tokens:]
            tokens, parents, parent = [], [], -1
            for right in run[:k // 2]:
                tokens += [(right + 1) % self.vocab, right]
                parents += [parent, parent]
                parent = len(tokens) - 1
            out.append((tokens, parents))
        return out


@pytest.mark.parametrize("backend, options", [
    ("torch", dict(block_size=4)),
    ("torch", dict(block_size=8, kv_layout="shuffled")),
    ("torch", dict(block_size=16, kv_layout="shuffled", kv_cache_dtype="fp8")),
    ("three_path", dict(block_size=8)),
])
def test_an_accepted_later_sibling_moves_its_cache_rows(monkeypatch, backend, options):
    check_later_siblings(monkeypatch, "tiny-llama", backend, options, 12)


@pytest.mark.parametrize("kind", [dict(repetition_penalty=1.6, frequency_penalty=0.4),
                                  dict(structured_output="regex")], ids=["penalties", "grammar"])
def test_trees_verify_requests_with_penalties_or_a_grammar(pure_torch, kind, tiny_hf_dir):
    """Penalties and a grammar on draft trees, the right token always the second child: greedy outputs are
    those without speculation (each row's own path: ``test_verify_rows_transform_as_their_paths_do`` and
    ``test_a_grammars_draft_masks_are_those_of_its_state_after_each_draft``)."""
    from tripath.engine.requests.structured_output import StructuredOutput

    if kind.get("structured_output"):
        pytest.importorskip("xgrammar")
        kind = dict(structured_output=StructuredOutput(regex=r"(ab|ba|a|b){2,12}"))
        model, prompts = tiny_hf_dir, [[1, 5, 6, 7, 8] * 3, [1, 9, 10, 11] * 4]
    else:
        model, prompts = preset("tiny-llama"), branching_prompts()[:2]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **kind)
    want = outputs(LLM(model, backend="torch", num_kv_blocks=64, block_size=4), prompts, params)
    llm = LLM(model, backend="torch", num_kv_blocks=64, block_size=4, speculative_config=spec(2, k=4))
    llm.scheduler.proposer = _SecondSiblings({tuple(p): w for p, w in zip(prompts, want)}, 256)
    assert outputs(llm, prompts, params) == want
    assert llm.stats().spec_num_accepted_tokens > 0


def check_later_siblings(monkeypatch, name: str, backend: str, options: dict, max_tokens: int) -> None:
    """Trees whose accepted node is always the root's second child (:class:`_SecondSiblings`) on ``backend``
    (Triton kernels in the interpreter): the greedy tokens are those without speculation, and every accepted
    path's cache rows moved."""
    model, prompts = preset(name), branching_prompts()[:2]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    want = outputs(LLM(model, backend="torch", num_kv_blocks=64, **options), prompts, params)
    monkeypatch.setenv("TRITON_INTERPRET", "0" if backend == "torch" else "1")
    llm = LLM(model, backend=backend, num_kv_blocks=64, speculative_config=spec(2, k=4), **options)
    llm.scheduler.proposer = _SecondSiblings({tuple(p): w for p, w in zip(prompts, want)}, 256)
    moved = []
    move = draft_trees.move_tree_paths

    def spy(caches, inputs, paths, share=None):
        moved.extend(p for p in paths if p)
        move(caches, inputs, paths, share)

    monkeypatch.setattr("tripath.engine.runner.model_runner.move_tree_paths", spy)
    assert outputs(llm, prompts, params) == want
    assert moved and all(path[0] == 1 for path in moved)   # the second child of the root each time
    assert llm.stats().spec_num_accepted_tokens == sum(len(p) for p in moved)


@pytest.mark.parametrize("backend, options", [
    ("torch", dict(block_size=4)),
    ("torch", dict(block_size=8, kv_cache_dtype="fp8")),
    ("mla", dict(block_size=8)),
    ("mla_triton", dict(block_size=16)),
])
def test_mla_trees_through_later_siblings_keep_the_greedy_tokens(monkeypatch, backend, options):
    """An MLA model (tiny-deepseek) end to end: every accepted node is a later sibling, so the accepted latent
    rows must move to their positions; the tokens are those without speculation. (That the trees' masks are
    read: tests/test_mla_backends.py.)"""
    check_later_siblings(monkeypatch, "tiny-deepseek", backend, options, 10)


def test_mla_ngram_tree_greedy_outputs_are_those_without_speculation(pure_torch):
    model, prompts = preset("tiny-deepseek"), branching_prompts()
    want = outputs(LLM(model, backend="torch", num_kv_blocks=400, block_size=4), prompts)
    llm = LLM(model, backend="torch", num_kv_blocks=400, block_size=4, speculative_config=spec(2))
    trees = _spy_trees(llm)
    assert outputs(llm, prompts) == want
    assert any(t[1].count(-1) > 1 or len(set(t[1])) < len(t[1]) for t in trees), "no tree branched"
    assert 0 < llm.stats().spec_num_accepted_tokens


@pytest.mark.parametrize("backend, options", [
    ("torch", dict(num_kv_blocks=14, block_size=4, max_num_batched_tokens=24)),   # preemption
    ("torch", dict(num_kv_blocks=128, block_size=4, max_num_batched_tokens=6)),   # trees cut to the budget
    ("torch", dict(num_kv_blocks=128, block_size=8, max_num_seqs=2, max_num_batched_tokens=16)),
    ("three_path", dict(num_kv_blocks=128, block_size=8, max_num_seqs=2, max_num_batched_tokens=16)),
])
def test_trees_beside_prompt_chunks_and_preemption(monkeypatch, backend, options):
    """Short prompt chunks share the decode slice with the trees (causal masks there); preempted requests
    recompute; both with each verify's path through later siblings."""
    model, prompts = preset("tiny-llama"), branching_prompts()[:3]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    want = outputs(LLM(model, backend="torch", **options), prompts, params)
    monkeypatch.setenv("TRITON_INTERPRET", "1" if backend == "three_path" else "0")
    llm = LLM(model, backend=backend, speculative_config=spec(2, k=4), **options)
    llm.scheduler.proposer = _SecondSiblings({tuple(p): w for p, w in zip(prompts, want)}, 256)
    assert outputs(llm, prompts, params) == want
    stats = llm.stats()
    assert stats.spec_num_accepted_tokens > 0 and stats.num_kv_blocks_used == 0
    assert stats.num_preemptions > 0 or options["num_kv_blocks"] > 14


def test_oracle_trees_accept_the_whole_recorded_branch_at_p_one(pure_torch):
    model, prompts = preset("tiny-llama"), branching_prompts()
    want = outputs(LLM(model, backend="torch", num_kv_blocks=400, block_size=4), prompts)
    llm = LLM(model, backend="torch", num_kv_blocks=400, block_size=4, speculative_config=spec(2, k=6))
    llm.scheduler.proposer = OracleProposer({tuple(p): w for p, w in zip(prompts, want)}, 1.0, 256, seed=1)
    update = llm.scheduler.update
    verified = []

    def checking(out, sampled):
        for item, tokens in zip(out.scheduled, sampled):
            if item.draft_parents:   # the recorded branch: each depth's last child, all of it kept
                branch, node = 0, -1
                while node in item.draft_parents:
                    node = max(t for t, p in enumerate(item.draft_parents) if p == node)
                    branch += 1
                verified.append((len(tokens), branch + 1))
        return update(out, sampled)

    llm.scheduler.update = checking
    assert outputs(llm, prompts) == want
    assert verified and all(got == expected for got, expected in verified)
    stats = llm.stats()
    assert stats.spec_num_accepted_tokens == sum(e - 1 for _, e in verified) > 0


def test_sampled_requests_with_trees_are_seeded(pure_torch):
    model, prompts = preset("tiny-llama"), branching_prompts()
    params = SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, seed=11, ignore_eos=True)
    llm = LLM(model, backend="torch", num_kv_blocks=400, block_size=4, speculative_config=spec(3))
    first = outputs(llm, prompts, params)
    assert first == outputs(llm, prompts, params)
    assert all(len(o) == 16 for o in first) and llm.stats().spec_num_drafts > 0


def test_log_probabilities_along_an_accepted_path_are_those_without_speculation(pure_torch):
    """Each verified token's log-probabilities come from its path's row (here always a later sibling's)."""
    model, prompts = preset("tiny-llama"), branching_prompts()[:2]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    base = LLM(model, backend="torch", num_kv_blocks=64, block_size=4).generate(prompts, params, use_tqdm=False)
    llm = LLM(model, backend="torch", num_kv_blocks=64, block_size=4, speculative_config=spec(2, k=4))
    llm.scheduler.proposer = _SecondSiblings({tuple(p): w.output_token_ids for p, w in zip(prompts, base)}, 256)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats().spec_num_accepted_tokens > 0
    for want, out in zip(base, got):
        assert out.output_token_ids == want.output_token_ids
        for a, b in zip(out.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys()
            for token in a:
                assert a[token].rank == b[token].rank
                assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)
