"""Piecewise CUDA graphs for steps with prompt tokens (:mod:`tripath.engine.runner.mixed_graphs`): the layers
between attention calls replayed per padded token count, attention eager between them. On a GPU the
replayed hidden states equal the eager model's, and an engine with them gives the tokens of one without
them (prefix hits, chunked prefill with extends beside decodes, tight memory, MHA and MLA backends), with
nothing compiled after start. Whole-step graphs (:mod:`tripath.engine.runner.whole_step_graphs`, the ``mixed``
backend): the same on a GPU, with no attention call left outside the graph. On the CPU: the sizes, when the
graphs apply, bad sizes."""

import dataclasses
import random

import pytest
import torch

from tripath.attention import ForwardContext
from tripath.attention.layer_replay import MIN_LAYERS_TO_REPLAY
from tripath.engine import LLM, EngineConfig, SamplingParams
from tripath.engine.runner.mixed_graphs import MixedStepGraphs
from tripath.engine.runner.model_runner import Route
from tripath.engine.runner.startup import nothing_written_context
from tripath.engine.runner.whole_step_graphs import WholeStepGraphs
from tripath.models import load_model
from tripath.models.loader import build_model, init_random_weights
from tripath.models.parallel import ParallelState
from tripath.models.presets import tiny_deepseek, tiny_qwen3


def test_sizes_cover_the_token_budget():
    assert EngineConfig(max_num_batched_tokens=8192).mixed_cuda_graph_sizes() == \
        [16, 32, 64, 128, 256, 512] + list(range(1024, 8193, 1024))
    assert EngineConfig(max_num_batched_tokens=3000).mixed_cuda_graph_sizes() == \
        [16, 32, 64, 128, 256, 512, 1024, 2048, 3000]
    assert EngineConfig(max_num_batched_tokens=20).mixed_cuda_graph_sizes() == [16, 20]
    with pytest.raises(TypeError, match="mixed_cuda_graphs must be a bool"):
        EngineConfig(mixed_cuda_graphs=1)


def test_bucket_is_the_smallest_captured_size_that_holds_the_step():
    graphs = MixedStepGraphs(torch.nn.Identity(), [64, 16, 256], torch.device("cpu"))
    assert graphs.sizes == [16, 64, 256] and graphs.input_ids.shape == (256,)
    assert graphs.bucket(1) is None  # nothing captured yet
    graphs.buckets = dict.fromkeys([16, 64, 256])
    assert [graphs.bucket(t) for t in (1, 16, 17, 64, 200, 256, 257)] == [16, 16, 64, 64, 256, 256, None]
    with pytest.raises(ValueError, match="positive token counts"):
        MixedStepGraphs(torch.nn.Identity(), [0, 16], torch.device("cpu"))
    with pytest.raises(ValueError, match="no mixed-step graph holds 300 tokens"):
        graphs.run(torch.zeros(300, dtype=torch.int64), torch.zeros(300, dtype=torch.int64), None)


def test_not_on_the_cpu_nor_for_mixture_of_experts_models_nor_tensor_parallel_ranks():
    llm = LLM("tiny-llama", backend="torch", num_kv_blocks=16, device="cpu")
    assert llm.runner.mixed_graphs is None and not llm.runner.uses_mixed_graphs
    moe = LLM("tiny-qwen3-moe", backend="torch", num_kv_blocks=16, device="cpu")
    moe.runner.config.device = torch.device("cuda")  # only the model decides now
    assert not moe.runner.uses_mixed_graphs
    dense = LLM("tiny-qwen3", backend="torch", num_kv_blocks=16, device="cpu")
    dense.runner.config.device = torch.device("cuda")
    assert dense.runner.uses_mixed_graphs
    dense.runner.model.parallel = ParallelState(rank=0, world_size=2)  # a tensor-parallel rank: never
    assert not dense.runner.uses_mixed_graphs


def three_layer_qwen3(device, dtype):
    """tiny-qwen3 with a third layer: enough layers for a step to replay its first layer's launches."""
    model = build_model(dataclasses.replace(tiny_qwen3(), num_layers=MIN_LAYERS_TO_REPLAY), dtype=dtype,
                        device=device)
    init_random_weights(model, 0)
    model.post_load()
    return model


def _model(name, device, dtype):
    if name == "dense-mla":
        return dense_mla_model(device, dtype)
    if name == "qwen3-3-layers":
        return three_layer_qwen3(device, dtype)
    return load_model(name, dtype=dtype, device=device)


def dense_mla_model(device, dtype):
    """tiny-deepseek without its mixture of experts (the MLA TP-8 presets are dense too)."""
    model = build_model(dataclasses.replace(tiny_deepseek(), moe=None), dtype=dtype, device=device)
    init_random_weights(model, 0)
    model.post_load()
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("name,backend", [("qwen3-3-layers", "three_path"), ("tiny-qwen3", "two_path"),
                                          ("tiny-llama", "unified"), ("dense-mla", "mla")])
def test_replayed_hidden_states_equal_the_eager_model_on_gpu(name, backend):
    model = _model(name, "cuda", torch.float16)
    llm = LLM(model, backend=backend, num_kv_blocks=64, max_num_batched_tokens=300, max_num_seqs=8, device="cuda")
    runner = llm.runner
    assert runner.largest_step_host_share >= 0.5  # tiny models: host-bound steps
    assert runner.mixed_graphs is not None and sorted(runner.mixed_graphs.buckets) == [16, 32, 64, 128, 256, 300]
    vocab = model.config.vocab_size
    for tokens in (5, 100, 300):
        ctx = nothing_written_context(runner, tokens)
        ids = torch.randint(0, vocab, (tokens,), device="cuda")
        positions = torch.randint(0, 200, (tokens,), device="cuda")
        with torch.inference_mode():
            eager = model(ids, positions, ctx).clone()
            replayed = runner.mixed_graphs.run(ids, positions, ctx).clone()
        torch.testing.assert_close(replayed, eager, atol=3e-2, rtol=2e-2)  # fp16; padded GEMMs may round apart


@pytest.mark.gpu
@pytest.mark.parametrize("name,backend", [("qwen3-3-layers", "three_path"), ("qwen3-3-layers", "two_path"),
                                          ("tiny-llama", "unified"), ("dense-mla", "mla"),
                                          ("dense-mla", "mla_triton")])
def test_engine_tokens_equal_eager_prompt_steps_on_gpu(name, backend, monkeypatch):
    from model_steps import assert_same_or_near_tie

    model = _model(name, "cuda", torch.float16)
    rng = random.Random(4)
    shared = [rng.randrange(1, 256) for _ in range(40)]
    prompts = [shared * (i % 2) + [rng.randrange(1, 256) for _ in range(rng.randrange(10, 300))] for i in range(14)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    common = dict(backend=backend, max_num_batched_tokens=256, max_num_seqs=8, device="cuda")
    eager = LLM(model, num_kv_blocks=8192 // 16, mixed_cuda_graphs=False, **common)
    assert eager.runner.mixed_graphs is None
    expected = [o.output_token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    runs = []
    real_run = MixedStepGraphs.run
    monkeypatch.setattr(MixedStepGraphs, "run", lambda self, *a: runs.append(a[0].shape[0]) or real_run(self, *a))
    block_size = eager.runner.block_size
    real_attend = ForwardContext.attend
    from tripath.triton_internals import replay
    real_record, watches = replay.record_launches, []
    monkeypatch.setattr(replay, "record_launches",
                        lambda *a, **kw: watches.append(kw.get("watch", True)) or real_record(*a, **kw))
    for rows in (8192, 640):  # 640 cache rows: tight, with preemptions (recomputed prompts)
        llm = LLM(model, num_kv_blocks=rows // block_size, **common)
        attends, forwards, runs_before = [], [], len(runs)  # counted from here, not in the start's steps
        monkeypatch.setattr(ForwardContext, "attend",
                            lambda self, *a, **kw: attends.append(1) or real_attend(self, *a, **kw))
        if model.config.mla is None:
            backend_forward = llm.runner.backend.forward
            monkeypatch.setattr(llm.runner.backend, "forward",
                                lambda *a, **kw: forwards.append(1) or backend_forward(*a, **kw))
        got = [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_same_or_near_tie(model, prompts, expected, got)
        assert llm.num_compiled_since_start == 0
        if rows == 640:
            assert llm.last_metrics.num_preemptions > 0
        assert len(runs) > runs_before
        if model.config.mla is None and model.config.num_layers >= MIN_LAYERS_TO_REPLAY:
            # the layers after the first of a step through the graphs replay its launches; a step's
            # recording watches its PyTorch work only on a code path the engine has not watched before
            assert 0 < len(forwards) < len(attends)
            assert llm.runner.watched_paths and watches.count(False) > watches.count(True) > 0
        elif model.config.mla is None:  # tiny-llama's 2 layers: every layer runs its forward
            assert len(forwards) == len(attends) > 0
    monkeypatch.setattr(ForwardContext, "attend", real_attend)
    assert runs and max(runs) == 256 and llm.block_manager.num_hit_tokens > 0


def test_whole_step_graphs_replay_steps_of_any_mix_on_their_bucket(monkeypatch):
    """Whole-step graphs emulated on the CPU (a replay re-runs the captured forward on the bucket's inputs and
    metadata, as a CUDA graph rewrites its memory): steps of different mixes and sizes, one after the other,
    replay the smallest bucket holding them and give the eager model's hidden states on their rows. The
    ``mixed`` backend keeps multi-step decoding."""
    from model_steps import record_graph_captures

    record_graph_captures(monkeypatch)
    model = load_model("tiny-llama", dtype=torch.float32)
    llm = LLM(model, backend="mixed", num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4, device="cpu")
    runner = llm.runner
    assert runner.capabilities.multi_step
    graphs = WholeStepGraphs(model, runner.backend, runner.caches, [16, 64, 16384], max_num_seqs=4,
                             max_model_len=runner.max_model_len, max_blocks_per_seq=runner.max_blocks_per_seq,
                             device=torch.device("cpu"))
    graphs.capture()
    assert sorted(graphs.graphs) == [16, 64] and graphs.bucket(100) is None   # 4 x 4096 pass max_model_len
    g = torch.Generator().manual_seed(0)
    for query_lens, context_lens, bucket in (([1, 1, 7], [20, 9, 0], 16), ([1, 30, 20], [40, 12, 0], 64),
                                             ([5], [0], 16), ([1, 1, 1, 13], [3, 50, 7, 0], 16)):
        plan = runner.backend.plan(query_lens, context_lens)
        blocks = -(-max(c + q for c, q in zip(plan.context_lens, plan.query_lens)) // runner.block_size)
        table = torch.randint(1, 64, (len(query_lens), blocks), generator=g, dtype=torch.int32)
        meta = runner.backend.build_metadata(plan, table, torch.full((plan.num_tokens,), -1, dtype=torch.int64))
        ctx = ForwardContext(runner.backend, meta, runner.caches)
        ids = torch.randint(0, model.config.vocab_size, (plan.num_tokens,), generator=g)
        positions = torch.cat([torch.arange(c, c + q) for q, c in zip(plan.query_lens, plan.context_lens)])
        with torch.inference_mode():
            eager = model(ids, positions, ctx).clone()
            replayed = graphs.run(ids, positions, ctx).clone()
        assert graphs.bucket(plan.num_tokens) == bucket
        torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_whole_step_graphs_of_the_mixed_backend_on_gpu(monkeypatch):
    """``mixed`` reads only device tensors in every step, so the engine captures whole steps with prompt tokens:
    replayed hidden states equal the eager model's, and the engine's tokens equal an engine's without them
    (prefix hits, chunked prefill beside decodes), no layer attends outside the graph, nothing compiles."""
    from model_steps import assert_same_or_near_tie

    model = three_layer_qwen3("cuda", torch.float16)
    common = dict(backend="mixed", max_num_batched_tokens=256, max_num_seqs=8, device="cuda")
    llm = LLM(model, num_kv_blocks=8192 // 16, **common)
    graphs = llm.runner.mixed_graphs
    assert isinstance(graphs, WholeStepGraphs) and sorted(graphs.graphs) == [16, 32, 64, 128, 256]
    vocab = model.config.vocab_size
    for tokens in (5, 100, 256):
        ctx = nothing_written_context(llm.runner, tokens)
        ids = torch.randint(0, vocab, (tokens,), device="cuda")
        positions = torch.randint(0, 200, (tokens,), device="cuda")
        with torch.inference_mode():
            eager = model(ids, positions, ctx).clone()
            replayed = graphs.run(ids, positions, ctx).clone()
        torch.testing.assert_close(replayed, eager, atol=3e-2, rtol=2e-2)  # fp16; padded GEMMs may round apart
    rng = random.Random(4)
    shared = [rng.randrange(1, 256) for _ in range(40)]
    prompts = [shared * (i % 2) + [rng.randrange(1, 256) for _ in range(rng.randrange(10, 300))] for i in range(14)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    eager_llm = LLM(model, num_kv_blocks=8192 // 16, mixed_cuda_graphs=False, **common)
    assert eager_llm.runner.mixed_graphs is None
    expected = [o.output_token_ids for o in eager_llm.generate(prompts, params, use_tqdm=False)]
    runs, attends = [], []
    real_run, real_attend = WholeStepGraphs.run, ForwardContext.attend
    monkeypatch.setattr(WholeStepGraphs, "run", lambda self, *a: runs.append(a[0].shape[0]) or real_run(self, *a))
    monkeypatch.setattr(ForwardContext, "attend", lambda self, *a, **kw: attends.append(1) or real_attend(self, *a, **kw))
    got = [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert_same_or_near_tie(model, prompts, expected, got)
    assert runs and max(runs) == 256 and llm.block_manager.num_hit_tokens > 0
    assert not attends   # every step replayed a graph: decode graphs or whole-step graphs
    assert llm.num_compiled_since_start == 0


class _EmulatedPiecewise(MixedStepGraphs):
    """Piecewise graphs without a GPU: a replay computes what the captured layers compute, with every attention
    call on the step's own context (as :meth:`MixedStepGraphs.run` makes them between the pieces). Counts the
    steps it ran that verified draft trees."""

    def __init__(self, model, sizes):
        super().__init__(model, sizes, torch.device("cpu"))
        self.buckets = dict.fromkeys(self.sizes)
        self.tree_steps = 0

    def run(self, input_ids, positions, ctx):
        verify = ctx.metadata.decode.verify if ctx.metadata.decode is not None else None
        self.tree_steps += verify is not None and verify.tree_mask is not None
        return self.model(input_ids, positions, ctx)


@pytest.mark.parametrize("backend", ["three_path", "torch"])
def test_tree_steps_beside_prompt_tokens_take_the_piecewise_graphs(monkeypatch, backend):
    """Draft trees verified beside a chunked prompt replay the piecewise graphs (their attention reads the
    step's tree masks), and the greedy tokens stay those without speculation; whole-step graphs take no tree
    step (their captured metadata has no mask)."""
    from test_speculative_trees import _SecondSiblings, branching_prompts, spec

    model = load_model("tiny-llama", dtype=torch.float32)
    prompts = branching_prompts()[:3]   # the third waits for a seat, then its prompt runs beside trees
    options = dict(num_kv_blocks=64, block_size=8, max_num_seqs=2, max_num_batched_tokens=16, device="cpu")
    monkeypatch.setenv("TRIPATH_VALIDATE", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = [o.output_token_ids for o in LLM(model, backend="torch", **options).generate(prompts, params,
                                                                                        use_tqdm=False)]
    monkeypatch.setenv("TRITON_INTERPRET", "0" if backend == "torch" else "1")
    llm = LLM(model, backend=backend, speculative_config=spec(2, k=4), **options)
    llm.scheduler.proposer = _SecondSiblings({tuple(p): w for p, w in zip(prompts, want)}, 256)
    graphs = llm.runner.mixed_graphs = _EmulatedPiecewise(model, [16])
    route, beside_prompts = llm.runner.route, []

    def routed(scheduled):
        which = route(scheduled)
        if any(s.draft_parents is not None for s in scheduled):
            assert which[0] is Route.MIXED_GRAPHS   # no verify graphs here: every tree step replays these
            if any(not s.draft_token_ids and s.num_new_tokens > 1 for s in scheduled):
                beside_prompts.append(list(scheduled))
        return which

    llm.runner.route = routed
    got = [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert beside_prompts and graphs.tree_steps >= len(beside_prompts)
    assert llm.stats().spec_num_accepted_tokens > 0
    whole = WholeStepGraphs.__new__(WholeStepGraphs)   # only its type and buckets matter to the route
    whole.bucket = lambda num_tokens: 16
    llm.runner.mixed_graphs = whole
    assert route(beside_prompts[0]) == (Route.EAGER, None)


@pytest.mark.gpu
def test_tree_steps_beside_prompt_tokens_replay_the_piecewise_graphs_on_gpu(monkeypatch):
    """Real piecewise graphs: an engine drafting n-gram trees gives the greedy tokens of one without speculation
    while its tree steps beside prompt chunks replay the prompt-step graphs, nothing compiled after start."""
    from model_steps import assert_same_or_near_tie
    from test_speculative_trees import branching_prompts, spec

    model = three_layer_qwen3("cuda", torch.float16)
    prompts = [p[:200] for p in branching_prompts()] * 3
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    common = dict(backend="three_path", max_num_batched_tokens=64, max_num_seqs=4, num_kv_blocks=4096 // 16,
                  device="cuda")
    expected = [o.output_token_ids for o in LLM(model, mixed_cuda_graphs=False, **common).generate(
        prompts, params, use_tqdm=False)]
    llm = LLM(model, speculative_config=spec(2, k=4), **common)
    assert isinstance(llm.runner.mixed_graphs, MixedStepGraphs)
    tree_runs, real_run = [], MixedStepGraphs.run

    def run(self, ids, positions, ctx):
        verify = ctx.metadata.decode.verify if ctx.metadata.decode is not None else None
        tree_runs.append(verify is not None and verify.tree_mask is not None)
        return real_run(self, ids, positions, ctx)

    monkeypatch.setattr(MixedStepGraphs, "run", run)
    got = [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert_same_or_near_tie(model, prompts, expected, got)
    assert any(tree_runs) and llm.num_compiled_since_start == 0
