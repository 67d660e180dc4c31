"""Speculative decoding's verify graphs (:mod:`tripath.engine.runner.verify_graphs`): steps of decodes and verifies alone
replay a captured forward of their padded batch size, every request padded to ``1 + k`` tokens. On the CPU the
graphs are emulated (a replay re-runs the captured forward into the captured tensors, as a CUDA graph replay
rewrites its memory): the steps take the verify-graph route, and greedy outputs are those without speculation
and those of the eager route, with requests of fewer drafts than ``k`` and batches between the captured sizes,
for three_path (ngram, draft_model on tiny llama) and the MLA backend (mtp on tiny deepseek), in the
interpreter. The declarations per backend, the memory plan's and warm-up's verify-graph steps; on a GPU, real
captures."""

import pytest
import torch

from tripath.attention import ForwardContext, select_backend
from tripath.engine import LLM, SamplingParams
from tripath.engine.runner.memory_plan import VERIFY_GRAPHS, worst_steps
from tripath.engine.runner.model_runner import Route
from tripath.engine.runner.warmup import WarmupLimits, warmup_shapes
from tripath.models import load_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
DRAFT = {"method": "draft_model", "model": "tiny-llama", "num_speculative_tokens": 3}
MTP = {"method": "mtp", "num_speculative_tokens": 3}
TREES = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "tree_width": 2}
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

_models = {}


@pytest.fixture(autouse=True)
def _validated(monkeypatch):
    monkeypatch.setenv("TRIPATH_VALIDATE", "1")


def model_of(name: str):
    if name not in _models:
        _models[name] = load_model(name, dtype=torch.float32, **({"mtp": True} if name == "tiny-deepseek" else {}))
    return _models[name]


def repetitive_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    motif = torch.randint(2, vocab, (5,), generator=g).tolist()
    shared = torch.randint(2, vocab, (18,), generator=g).tolist()
    return [motif * 4, shared + motif * 2, torch.randint(2, vocab, (11,), generator=g).tolist()]


def outputs(llm, batch, params=PARAMS):
    return [o.output_token_ids for o in llm.generate(batch, params, use_tqdm=False)]


def emulate_graphs(monkeypatch, model) -> None:
    """Decode and verify graphs without a GPU: a replay re-runs the captured forward and writes the captured
    hidden states (and those before the final norm, where the model keeps them)."""

    def capture(run, pool, device):
        hidden = run()
        prenorm = getattr(model, "prenorm_hidden", None) if getattr(model, "keep_prenorm_hidden", False) else None

        class Replay:
            def replay(self):   # no Python runs in a real replay: the model's attribute stays as it was
                before = getattr(model, "prenorm_hidden", None)
                hidden.copy_(run())
                if prenorm is not None:
                    prenorm.copy_(model.prenorm_hidden)
                    model.prenorm_hidden = before

        return Replay(), hidden, None

    monkeypatch.setattr("tripath.engine.runner.decode_graphs.capture_graph", capture)


def count_routes(llm) -> dict:
    """Count the routes the runner's steps take, and the verify-graph steps that were padded (a request with
    fewer drafts than k, or a batch between the captured sizes)."""
    runner, counts = llm.runner, {"padded_tokens": 0, "padded_batch": 0}
    route = runner.route

    def counted(scheduled):
        which, bs = route(scheduled)
        counts[which] = counts.get(which, 0) + 1
        if which is Route.VERIFY_GRAPH:
            q = runner.spec.decode_threshold
            counts["padded_tokens"] += any(s.num_new_tokens < q for s in scheduled)
            counts["padded_batch"] += bs > len(scheduled)
        return which, bs

    runner.route = counted
    return counts


def varied_drafts(llm) -> LLM:
    """Every third step drafts nothing, the step after it one token a request (as near ``max_tokens``): steps
    of plain decodes, of verifies with fewer drafts than k beside decodes, and of full verifies."""
    scheduler = llm.scheduler
    draft_room, schedule, steps = scheduler._draft_room, scheduler.schedule, [0]

    def counted_schedule(*args, **kwargs):
        steps[0] += 1
        return schedule(*args, **kwargs)

    scheduler.schedule = counted_schedule
    scheduler._draft_room = lambda request: min((0, 1, 3)[steps[0] % 3], draft_room(request))
    return llm


def graph_engine(monkeypatch, model, backend, spec, **options) -> LLM:
    """An engine whose decode and verify graphs are captured (emulated on the CPU)."""
    emulate_graphs(monkeypatch, model)
    llm = LLM(model, backend=backend, speculative_config=spec, **options)
    llm.runner.capture_verify_graphs()
    llm.runner.capture_decode_graphs()
    return varied_drafts(llm)


@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft_model"])
def test_three_path_verify_steps_replay_graphs_with_the_outputs_of_no_speculation(monkeypatch, spec):
    model = model_of("tiny-llama")
    batch = repetitive_prompts(model.config.vocab_size)
    options = dict(num_kv_blocks=96, block_size=8, max_num_seqs=4)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    want = outputs(LLM(model, backend="torch", **options), batch)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    eager = LLM(model, backend="three_path", speculative_config=spec, **options)
    assert outputs(eager, batch) == want
    llm = graph_engine(monkeypatch, model, "three_path", spec, **options)
    assert llm.runner.verify_graphs.graphs.sizes == [1, 2, 4]
    counts = count_routes(llm)
    assert outputs(llm, batch) == want
    assert counts.get(Route.VERIFY_GRAPH, 0) > 0 and counts["padded_batch"] > 0   # 3 requests in the graph of 4
    assert counts["padded_tokens"] > 0
    assert llm.stats().spec_num_accepted_tokens > 0


def test_tree_steps_replay_verify_graphs_with_their_masks(monkeypatch):
    """An engine drafting trees captures its verify graphs with draft-tree masks: steps with trees (and steps of
    chains, with a chain's masks) take the verify-graph route, and greedy outputs stay those without
    speculation (three_path, the verify kernel's tree variant). The drafts' right token is always the second
    child, so a row that saw its wrong sibling (a chain's mask) would change the tokens."""
    from test_speculative_trees import _SecondSiblings, branching_prompts, spec

    model = model_of("tiny-llama")
    prompts = branching_prompts()[:3]
    options = dict(num_kv_blocks=96, block_size=8, max_num_seqs=4)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    want = outputs(LLM(model, backend="torch", **options), prompts)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    llm = graph_engine(monkeypatch, model, "three_path", spec(2, k=4), **options)
    llm.scheduler.proposer = _SecondSiblings({tuple(p): w for p, w in zip(prompts, want)}, model.config.vocab_size)
    assert llm.runner.verify_graphs.trees
    assert llm.runner.verify_graphs.graphs.graphs[4][1].decode.verify.tree_mask is not None
    runner, checked = llm.runner, []
    route, replay = runner.route, runner.verify_graphs.replay

    def routed(scheduled):
        which = route(scheduled)
        assert which[0] is Route.VERIFY_GRAPH or not any(s.draft_parents is not None for s in scheduled)
        return which

    def replayed(bs, inputs):   # a tree step's rows against the eager forward of the step (same K/V rewritten)
        hidden, prenorm = replay(bs, inputs)
        if inputs.tree_mask is not None:
            ctx = ForwardContext(runner.backend, inputs.metadata(runner.backend), runner.caches)
            torch.testing.assert_close(hidden, runner.model(inputs.input_ids, inputs.positions, ctx),
                                       atol=1e-4, rtol=1e-4)
            checked.append(bs)
        return hidden, prenorm

    runner.route, runner.verify_graphs.replay = routed, replayed
    assert outputs(llm, prompts) == want
    assert checked
    assert llm.stats().spec_num_accepted_tokens > 0


def test_mla_verify_steps_replay_graphs_and_hand_the_mtp_layer_their_hidden_states(monkeypatch):
    """mtp on tiny deepseek, the MLA backend: the MTP proposer reads the verify graph's hidden states before the
    final norm, gathered back into the step's rows; outputs as without speculation and as the eager route."""
    model = model_of("tiny-deepseek")
    batch = [p[:14] for p in repetitive_prompts(model.config.vocab_size)]
    options = dict(num_kv_blocks=64, block_size=16, max_num_seqs=4)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    want = outputs(LLM(model, backend="torch", **options), batch)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    eager = varied_drafts(LLM(model, backend="mla", speculative_config=MTP, **options))
    assert outputs(eager, batch) == want
    eager_stats = eager.stats()
    llm = graph_engine(monkeypatch, model, "mla", MTP, **options)
    counts = count_routes(llm)
    assert outputs(llm, batch) == want
    assert counts.get(Route.VERIFY_GRAPH, 0) > 0 and counts["padded_batch"] > 0
    stats = llm.stats()
    # the same drafts as the eager route: the MTP layer saw the same hidden states
    assert (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == \
        (eager_stats.spec_num_draft_tokens, eager_stats.spec_num_accepted_tokens)


def test_backends_declare_which_verify_steps_they_let_the_engine_capture():
    declared = {}
    for name in ("three_path", "unified", "two_path", "torch", "sdpa"):
        declared[name] = select_backend_class(name, mla=False).capabilities.verify_graphs
    for name in ("mla", "mla_triton"):
        declared[name] = select_backend_class(name, mla=True).capabilities.verify_graphs
    assert declared == {"three_path": True, "unified": True, "mla": True, "mla_triton": True,
                        "two_path": False, "torch": False, "sdpa": False}


def select_backend_class(name: str, mla: bool):
    model = model_of("tiny-deepseek" if mla else "tiny-llama")
    return type(select_backend(model.attention_spec(block_size=16, dtype=torch.float32), name=name, device="cpu"))


def test_two_path_keeps_its_verifies_off_the_verify_graphs(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    llm = LLM(model_of("tiny-llama"), backend="two_path", num_kv_blocks=32, block_size=8, speculative_config=NGRAM)
    assert not llm.runner.captures_verify_graphs   # its verifies are extends (decode_threshold 1)


def test_memory_plan_and_warm_up_cover_the_largest_verify_graph():
    limits = WarmupLimits(8, 16, 256, decode_threshold=4, verify_graph_sizes=(1, 2, 4, 8))
    steps = worst_steps(limits, 4096)
    assert steps[VERIFY_GRAPHS] == ([4] * 8, [252] * 8)   # 32 tokens: past the token budget of 16
    assert steps["verify"] == ([4] * 4, [252] * 4)
    probed = warmup_shapes(limits)
    for b in (1, 2, 4, 8):
        assert ([4] * b, [252] * b) in probed
    assert VERIFY_GRAPHS not in worst_steps(WarmupLimits(8, 16, 256, decode_threshold=4), 4096)


@pytest.mark.gpu
@pytest.mark.parametrize("name,backend,spec", [("tiny-llama", "three_path", NGRAM), ("tiny-llama", "unified", NGRAM),
                                               ("tiny-llama", "three_path", DRAFT),
                                               ("tiny-deepseek", "mla", MTP), ("tiny-llama", "three_path", TREES),
                                               ("tiny-deepseek", "mla", TREES)])
def test_verify_graphs_on_the_gpu(name, backend, spec):
    """Real captures with the engine's GPU defaults (warm-up, memory plan, graphs): verify steps replay graphs,
    greedy outputs are those without speculation (up to near ties), nothing compiles after start."""
    from model_steps import assert_same_or_near_tie

    model = load_model(name, dtype=torch.float16, device="cuda", **({"mtp": True} if spec is MTP else {}))
    batch = repetitive_prompts(model.config.vocab_size) * 3
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    common = dict(backend=backend, max_num_seqs=12, max_num_batched_tokens=512, device="cuda", block_size=16)
    expected = outputs(LLM(model, enforce_eager=True, num_kv_blocks=256, **common), batch, params)
    llm = LLM(model, speculative_config=spec, gpu_memory_utilization=0.3, **common)
    assert llm.runner.verify_graphs is not None
    counts = count_routes(llm)
    assert_same_or_near_tie(model, batch, expected, outputs(llm, batch, params))
    assert counts.get(Route.VERIFY_GRAPH, 0) > 0
    assert llm.num_compiled_since_start == 0
    assert "verify graphs" in llm.runner.memory_plan.step_peaks
