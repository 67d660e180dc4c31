"""Multi-step decoding (``decode_steps``): a step of decodes alone runs several model steps in one launch,
each step's tokens and metadata advanced on the device. Its outputs equal one step at a time and the
stand-in model's float64 reference (greedy), and the seeded samples of one-step scheduling; stop tokens
inside a run end the request there; graph replays (a CPU stand-in for the CUDA graph) and eager runs, an
MLA model, overlapped and sequential scheduling. The Triton backends run under the interpreter, so the
shapes are tiny."""

import random

import pytest
import torch

from engine_models import tiny_model
from model_steps import ReplayRecorder, record_graph_captures
from tripath.attention import plan_batch, select_backend
from tripath.engine import LLM, FinishReason, SamplingParams
from tripath.models import load_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def spy_launches(llm, monkeypatch) -> list[int]:
    """The ``num_steps`` of each launch of ``llm`` from now on."""
    real, seen = llm.runner.launch, []

    def launch(scheduled, previous=None, num_steps=1):
        seen.append(num_steps)
        return real(scheduled, previous, num_steps)

    monkeypatch.setattr(llm.runner, "launch", launch)
    return seen


def engine(model, **kw):
    options = dict(backend="three_path", num_kv_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    return LLM(model, **{**options, **kw})


PROMPTS = [[5, 17, 33, 9, 2, 40], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7, 3]]


@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_runs_equal_one_step_at_a_time_and_the_reference(model, monkeypatch, overlap):
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (9, 6, 11)]
    llm = engine(model, decode_steps=4, async_scheduling=overlap)
    assert llm.decode_steps == 4
    seen = spy_launches(llm, monkeypatch)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.output_token_ids for o in outs] == [model.reference_greedy(p, q.max_tokens)
                                                  for p, q in zip(PROMPTS, params)]
    assert 4 in seen and sum(seen) > len(seen)  # runs of 4 happened (and shorter ones at the ends)
    one = engine(model, decode_steps=1, async_scheduling=overlap)
    seen_one = spy_launches(one, monkeypatch)
    assert [o.output_token_ids for o in one.generate(PROMPTS, params, use_tqdm=False)] == \
        [o.output_token_ids for o in outs]
    assert set(seen_one) == {1} and len(seen_one) > len(seen)
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_seeded_samples_and_stop_tokens_match_one_step_at_a_time(model):
    def params():
        return [SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=3, ignore_eos=True),
                SamplingParams(max_tokens=12, temperature=1.0, seed=4, stop_token_ids=tuple(range(1, 61, 5)),
                               ignore_eos=True),
                SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)]

    results = {}
    for steps in (1, 5):
        outs = engine(model, decode_steps=steps).generate(PROMPTS, params(), use_tqdm=False)
        results[steps] = [(o.output_token_ids, o.finish_reason) for o in outs]
    assert results[5] == results[1]
    tokens, reason = results[5][1]
    assert reason is FinishReason.STOP and tokens[-1] % 5 == 1 and len(tokens) < 12  # stopped inside a run


def test_runs_replay_the_padded_decode_graph(model, monkeypatch):
    """Three requests replay the graph of four rows: the padding row keeps its slot −1 and position through
    the run while the real rows advance."""
    record_graph_captures(monkeypatch)
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    llm = engine(model, decode_steps=3, max_model_len=64)
    llm.runner.capture_decode_graphs()
    assert sorted(llm.runner.decode_graphs.graphs) == [1, 2, 4]
    seen = spy_launches(llm, monkeypatch)
    ReplayRecorder.replays = 0
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.output_token_ids for o in outs] == [model.reference_greedy(p, 7) for p in PROMPTS]
    assert 3 in seen and ReplayRecorder.replays == params.max_tokens - 1  # every decode step a replay
    _, meta, _ = llm.runner.decode_graphs.graphs[4]
    assert meta.slot_mapping[3].item() == -1 and llm.runner.decode_graphs.positions[3].item() == 1


def test_an_mla_model_runs_several_steps_a_launch(monkeypatch):
    name = "tiny-deepseek"
    model = load_model(name, dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[3, 90, 17, 4, 200, 11], [8, 8, 9]]
    one = LLM(model, backend="mla", num_kv_blocks=16, block_size=16, max_num_batched_tokens=16, decode_steps=1)
    expected = [o.output_token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    llm = LLM(model, backend="mla", num_kv_blocks=16, block_size=16, max_num_batched_tokens=16, decode_steps=6)
    seen = spy_launches(llm, monkeypatch)
    assert [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert max(seen) > 1


def test_advance_moves_positions_lengths_and_slots_of_the_real_rows_only():
    backend = select_backend(tiny_model().attention_spec(block_size=4), "three_path", "cpu")
    plan = plan_batch([1, 1, 1], [5, 2, 1])  # two requests at positions 5 and 2, one padding row
    table = torch.tensor([[3, 7, 9], [4, 0, 0], [0, 0, 0]], dtype=torch.int32)
    meta = backend.build_metadata(plan, table, torch.tensor([3 * 4 + 1, 4 * 4 + 2, -1]))
    positions = torch.tensor([5, 2])
    for step in range(3):
        meta.advance_decodes_(positions, block_size=4)
    assert positions.tolist() == [8, 5]
    assert meta.seq_lens.tolist() == [9, 6, 2] and meta.context_lens.tolist() == [8, 5, 1]
    assert meta.slot_mapping.tolist() == [9 * 4 + 0, 0 * 4 + 1, -1]  # position 8: block 9; position 5: table[1][1]
    with pytest.raises(ValueError, match="single-token decodes only"):
        backend.build_metadata(plan_batch([2], [3]), table[:1], torch.tensor([13, 14])).advance_decodes_(
            torch.tensor([3]), 4)


def test_where_multi_step_does_not_apply(model):
    from tripath.engine.runner.parallel_executor import ParallelExecutor

    assert engine(model, backend="torch", decode_steps=8).decode_steps == 1  # its forward reads host lists
    assert ParallelExecutor.capabilities.multi_step is False
    with pytest.raises(ValueError, match="decode_steps must be a positive int"):
        engine(model, decode_steps=0)
    llm = engine(model, decode_steps=4)
    llm.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    out = llm.scheduler.schedule()
    with pytest.raises(ValueError, match="single-token decodes only"):
        llm.runner.launch(out.scheduled, num_steps=2)  # a prefill


@pytest.mark.gpu
@pytest.mark.parametrize("name,backend", [("tiny-llama", "three_path"), ("tiny-llama", "two_path"),
                                          ("tiny-llama", "unified"), ("tiny-deepseek", "mla"),
                                          ("tiny-deepseek", "mla_triton")])
def test_runs_on_cuda_graphs_match_one_step_at_a_time_on_gpu(name, backend, monkeypatch):
    """Real CUDA graphs: runs of 8 replays with the inputs advanced on the device between them give the
    tokens of one step a launch (near ties aside: fp16, and the batches of the two schedules differ)."""
    from model_steps import assert_same_or_near_tie

    model = load_model(name, dtype=torch.float16, device="cuda")
    rng = random.Random(3)
    shared = [rng.randrange(1, 256) for _ in range(24)]
    prompts = [shared * (i % 2) + [rng.randrange(1, 256) for _ in range(rng.randrange(10, 200))] for i in range(12)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in range(20, 32)]
    common = dict(backend=backend, num_kv_blocks=256, max_num_batched_tokens=512, max_num_seqs=6, device="cuda")
    one = LLM(model, decode_steps=1, **common)
    expected = [o.output_token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    llm = LLM(model, decode_steps=8, **common)
    assert llm.runner.decode_graphs.graphs and llm.decode_steps == 8
    seen = spy_launches(llm, monkeypatch)
    got = [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert_same_or_near_tie(model, prompts, expected, got)
    assert 8 in seen and llm.num_compiled_since_start == 0


def test_the_advance_kernel_matches_its_reference():
    """One launch moves positions, lengths and slots on as the PyTorch reference does; rows past n kept."""
    from tripath.ops.kv_cache import advance_decodes, advance_decodes_ref

    gen = torch.Generator().manual_seed(5)
    n, rows, width, block_size = 150, 160, 9, 4  # more rows than one program moves
    positions = torch.randint(0, width * block_size - 1, (n,), generator=gen)
    table = torch.randperm(rows * width, generator=gen).view(rows, width).to(torch.int32)
    seq_lens = torch.randint(1, 50, (rows,), generator=gen, dtype=torch.int32)
    context_lens = seq_lens - 1
    slots = torch.full((rows,), -7, dtype=torch.int64)
    got = [t.clone() for t in (positions, seq_lens, context_lens, table, slots)]
    want = [t.clone() for t in (positions, seq_lens, context_lens, table, slots)]
    advance_decodes(*got, block_size)
    advance_decodes_ref(*want, block_size)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert (got[4][n:] == -7).all() and not torch.equal(got[0], positions)
    with pytest.raises(ValueError, match="seq_lens must be a contiguous vector of at least 150 rows"):
        advance_decodes(positions.clone(), seq_lens[:10], context_lens, table, slots, block_size)
    with pytest.raises(TypeError, match="positions has dtype"):
        advance_decodes(positions.int(), seq_lens, context_lens, table, slots, block_size)
