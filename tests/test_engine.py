"""The engine end to end. Greedy outputs of the model presets (Llama/Qwen3 GQA, DeepSeek/Kimi MLA) equal a
no-cache reference (the whole sequence recomputed for every token, no scheduler, block manager or runner),
and stay identical across backends, prefix caching on/off, chunked prefill on/off, tight KV memory
(preemption) vs ample, CUDA graphs on/off (GPU). A stand-in model with a float64 dense reference that shares
no tripath code covers the rest cheaply: seeded sampling, the step API, text prompts, stop tokens, metrics.

Tests on the ``torch`` backend switch the Triton interpreter off (every op then takes its PyTorch path), so
only the tests of the Triton backends pay for the interpreter.
"""

import gc
import random

import pytest
import torch

from engine_models import CharTokenizer, tiny_model
from model_steps import ReplayRecorder, assert_same_or_near_tie, record_graph_captures
from tripath.attention import ForwardContext, default_block_size, plan_batch, select_backend
from tripath.cli.generate import main_generate
from tripath.engine import LLM, EngineConfig, FinishReason, SamplingParams
from tripath.engine.runner import startup
from tripath.models import load_model


@pytest.fixture(autouse=True)
def _validate_every_step(monkeypatch):
    """TRIPATH_VALIDATE=1: every step's metadata goes through tripath.attention.validate (and the ops check
    their index values), so each engine step here also proves the engine builds valid indices."""
    monkeypatch.setenv("TRIPATH_VALIDATE", "1")


GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture
def pure_torch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module")
def model():
    return tiny_model()


_presets = {}


def preset(name):
    if name not in _presets:
        _presets[name] = load_model(name, dtype=torch.float32).eval()
    return _presets[name]


@torch.inference_mode()
def no_cache_greedy(model, prompt, max_tokens, block_size=16):
    """Recompute the whole sequence as one prefill for every token, on the torch backend."""
    backend = select_backend(model.attention_spec(block_size=block_size, dtype=torch.float32), "torch", "cpu")
    tokens = list(prompt)
    for _ in range(max_tokens):
        n = len(tokens)
        num_blocks = -(-n // block_size)
        caches = [backend.allocate_cache(num_blocks + 1) for _ in range(model.num_attention_layers)]
        table = torch.arange(1, num_blocks + 1, dtype=torch.int32)[None]
        meta = backend.build_metadata(plan_batch([n], [0]), table, torch.arange(n) + block_size)
        hidden = model(torch.tensor(tokens), torch.arange(n), ForwardContext(backend, meta, caches))
        tokens.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return tokens[len(prompt):]


def prompts_with_shared_prefix(n=6, seed=0, shared=20, lo=3, hi=30, vocab=61):
    rng = random.Random(seed)
    common = [rng.randrange(1, vocab) for _ in range(shared)]
    out = []
    for i in range(n):
        head = common if i % 2 == 0 else []
        out.append(head + [rng.randrange(1, vocab) for _ in range(rng.randrange(lo, hi))])
    return out


def greedy_outputs(llm, prompts, params=GREEDY):
    return [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_matches_a_dense_reference(pure_torch, model):
    prompts = prompts_with_shared_prefix(n=4, shared=16, hi=20)
    llm = LLM(model, backend="torch", num_kv_blocks=128, block_size=4, max_num_batched_tokens=24)
    got = greedy_outputs(llm, prompts[:1]) + greedy_outputs(llm, prompts[1:])
    assert got == [model.reference_greedy(p, GREEDY.max_tokens) for p in prompts]
    assert llm.block_manager.num_hit_tokens > 0  # the shared prefix was reused (extends)
    assert llm.backend_name == "torch"


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-deepseek", "tiny-kimi-nope"])
def test_presets_match_a_no_cache_reference(pure_torch, name):
    model = preset(name)
    prompts = prompts_with_shared_prefix(n=4, seed=7, shared=10, lo=2, hi=20, vocab=256)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    llm = LLM(model, backend="torch", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    got = greedy_outputs(llm, prompts[:1], params) + greedy_outputs(llm, prompts[1:], params)
    assert got == [no_cache_greedy(model, p, params.max_tokens) for p in prompts]
    assert llm.block_manager.num_hit_tokens > 0


@pytest.mark.parametrize("backend", ["three_path", "unified", "two_path", "mixed"])
def test_triton_backends_give_the_reference_tokens(monkeypatch, backend):
    model = preset("tiny-llama")
    prompts = prompts_with_shared_prefix(n=3, seed=1, shared=9, lo=2, hi=12, vocab=256)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    expected = [no_cache_greedy(model, p, params.max_tokens) for p in prompts]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    llm = LLM(model, backend=backend, num_kv_blocks=32, block_size=8, max_num_batched_tokens=16)
    got = greedy_outputs(llm, prompts[:1], params) + greedy_outputs(llm, prompts[1:], params)
    assert got == expected
    assert llm.backend_name == backend and llm.block_manager.num_hit_tokens > 0


_baselines = {}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek"])
@pytest.mark.parametrize("variant", ["no_prefix_cache", "no_chunked_prefill", "tight_memory", "all"])
def test_scheduling_choices_do_not_change_greedy_outputs(pure_torch, name, variant):
    model = preset(name)
    prompts = prompts_with_shared_prefix(n=6, seed=2, shared=12, lo=4, hi=24, vocab=256)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    base = dict(backend="torch", block_size=4, num_kv_blocks=200, max_num_batched_tokens=20, max_num_seqs=6)
    if name not in _baselines:
        _baselines[name] = greedy_outputs(LLM(model, **base), prompts, params)
    changes = {"no_prefix_cache": dict(enable_prefix_caching=False),
               "no_chunked_prefill": dict(enable_chunked_prefill=False, max_num_batched_tokens=64),
               "tight_memory": dict(num_kv_blocks=13),
               "all": dict(enable_prefix_caching=False, enable_chunked_prefill=False,
                           max_num_batched_tokens=48, num_kv_blocks=13)}[variant]
    llm = LLM(model, **{**base, **changes})
    assert greedy_outputs(llm, prompts, params) == _baselines[name]
    if "num_kv_blocks" in changes:
        assert llm.last_metrics.num_preemptions > 0, "memory was not tight enough to preempt"


def test_decode_graph_path_pads_and_copies_metadata(monkeypatch):
    """The CUDA-graph path without a GPU: padded decode batches, metadata copied into the captured one."""
    record_graph_captures(monkeypatch)
    model = preset("tiny-llama")
    prompts = prompts_with_shared_prefix(n=3, seed=8, shared=0, lo=3, hi=14, vocab=256)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    expected = [no_cache_greedy(model, p, params.max_tokens) for p in prompts]
    assert LLM(model, backend="torch", num_kv_blocks=8).runner.capabilities.multi_step is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    llm = LLM(model, backend="three_path", num_kv_blocks=32, block_size=8, max_num_seqs=4, max_model_len=64)
    llm.runner.capture_decode_graphs()
    assert sorted(llm.runner.decode_graphs.graphs) == [1, 2, 4]
    ReplayRecorder.replays = 0
    assert greedy_outputs(llm, prompts, params) == expected
    assert ReplayRecorder.replays == params.max_tokens - 1  # every decode step of 3 requests, padded to 4


@pytest.mark.parametrize("backend", ["torch", "three_path", "mla"])
def test_start_step_reserving_memory_writes_nothing(backend, monkeypatch):
    """The largest eager step that runs at start on a GPU (so the allocator holds a step's memory) reads
    block 0 and writes no slot: every cache is bit-identical afterwards, poisoned values included."""
    if backend == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = preset("tiny-deepseek" if backend == "mla" else "tiny-llama")
    llm = LLM(model, backend=backend, num_kv_blocks=8, max_num_seqs=3, max_num_batched_tokens=40, max_model_len=16)
    runner = llm.runner

    def tensors():
        return [t for c in runner.caches for t in ((c.kv_cache,) if backend == "mla" else (c.k_cache, c.v_cache))]

    for t in tensors():
        t.copy_(torch.randn(t.shape).to(t.dtype))
    before = [t.clone() for t in tensors()]
    assert startup.largest_prompt_step(runner) == [16, 16, 8]
    startup.time_largest_step(runner)
    assert all(torch.equal(a, b) for a, b in zip(before, tensors()))


def test_generate_command_line(pure_torch, capsys):
    status = main_generate(["--model", "tiny-llama", "--prompt", "Hi", "--prompt-ids", "5,6,7", "--max-tokens",
                            "4", "--ignore-eos", "--num-kv-blocks", "32", "--device", "cpu"])
    out = capsys.readouterr().out
    assert status == 0
    expected = no_cache_greedy(preset("tiny-llama"), [5, 6, 7], 4)
    assert f"[1] tokens: {expected} (length)" in out
    assert "[0] prompt: 'Hi'" in out and "backend sdpa" in out and "output tok/s" in out
    assert main_generate(["--model", "no-such-model", "--prompt", "x", "--device", "cpu"]) == 2
    assert "neither a local model directory nor a preset" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main_generate(["--model", "tiny-llama", "--prompt-ids", "1,x"])


def test_runner_inputs_follow_the_plan_order(pure_torch, model):
    from tripath.engine.requests.request import Request
    from tripath.engine.scheduling.scheduler import ScheduledRequest

    llm = LLM(model, backend="torch", num_kv_blocks=32, block_size=4)
    params = SamplingParams(max_tokens=4, temperature=0)
    prefill = Request([11, 12, 13], params, block_ids=[7])
    decode = Request([21, 22, 23, 24, 25], params, block_ids=[3, 9], num_computed_tokens=4)
    extend = Request(list(range(30, 40)), params, block_ids=[5, 2, 8], num_computed_tokens=4)
    scheduled = [ScheduledRequest(prefill, 3, 0, True), ScheduledRequest(decode, 1, 4, True),
                     ScheduledRequest(extend, 4, 4, False)]
    inputs = llm.runner.prepare(scheduled)
    assert inputs.plan.order == [1, 2, 0]  # [decode | extend | prefill]
    assert inputs.input_ids.tolist() == [25, 34, 35, 36, 37, 11, 12, 13]
    assert inputs.positions.tolist() == [4, 4, 5, 6, 7, 0, 1, 2]
    assert inputs.slot_mapping.tolist() == [9 * 4, 2 * 4, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 28, 29, 30]
    assert inputs.block_table.tolist() == [[3, 9, 0], [5, 2, 8], [7, 0, 0]]
    assert inputs.block_table.dtype == torch.int32 and inputs.slot_mapping.dtype == torch.int64
    # The extend stops mid-prompt (no token sampled); logits rows are the decode's and the prefill's last.
    assert inputs.logit_indices.tolist() == [0, 7] and inputs.sample_rows == [1, 0]
    padded = llm.runner.prepare(scheduled[1:2], pad_to=4)
    assert padded.positions.tolist() == [4, 1, 1, 1] and padded.slot_mapping.tolist() == [36, -1, -1, -1]
    # As wide as the step's longest row (a replay copies those columns into the captured table).
    assert padded.block_table.tolist() == [[3, 9], [0, 0], [0, 0], [0, 0]]


def test_seeded_sampling_is_reproducible_and_survives_preemption(pure_torch, model):
    prompts = prompts_with_shared_prefix(n=6, seed=3, shared=4, lo=5, hi=20)
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_k=20, top_p=0.95, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    ample = greedy_outputs(LLM(model, backend="torch", num_kv_blocks=200, block_size=4), prompts, params)
    tight_llm = LLM(model, backend="torch", num_kv_blocks=12, block_size=4, max_num_batched_tokens=16)
    assert greedy_outputs(tight_llm, prompts, params) == ample
    assert tight_llm.last_metrics.num_preemptions > 0
    reseeded = [SamplingParams(max_tokens=10, temperature=0.9, top_k=20, top_p=0.95, seed=7, ignore_eos=True)] * 6
    assert greedy_outputs(LLM(model, backend="torch", num_kv_blocks=200), prompts, reseeded) != ample

    # Without per-request seeds the engine seed decides.
    unseeded = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    a = greedy_outputs(LLM(model, backend="torch", num_kv_blocks=200, seed=5), prompts, unseeded)
    b = greedy_outputs(LLM(model, backend="torch", num_kv_blocks=200, seed=5), prompts, unseeded)
    c = greedy_outputs(LLM(model, backend="torch", num_kv_blocks=200, seed=6), prompts, unseeded)
    assert a == b and a != c


@pytest.mark.parametrize("overlap", [True, False])
def test_step_api_streams_deltas_and_aborts(pure_torch, model, overlap):
    llm = LLM(model, backend="torch", num_kv_blocks=64, block_size=4, async_scheduling=overlap)
    first = llm.add_request([5, 6, 7, 8, 9], GREEDY, request_id="a")
    second = llm.add_request([10, 11, 12], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    streamed, finished = {first: [], second: []}, []
    for _ in range(3):
        for out in llm.step():
            streamed[out.request_id] += out.new_token_ids
    assert llm.abort_request(second) and not llm.abort_request("missing")
    while llm.has_unfinished_requests():
        for out in llm.step():
            streamed[out.request_id] += out.new_token_ids
            assert out.output_token_ids == streamed[out.request_id]
            if out.finished:
                finished.append(out)
    assert [o.request_id for o in finished] == ["a"] and finished[0].finish_reason is FinishReason.LENGTH
    assert streamed["a"] == model.reference_greedy([5, 6, 7, 8, 9], GREEDY.max_tokens)
    assert len(streamed[second]) == (2 if overlap else 3)  # overlapped: a call returns the step before it
    assert llm.block_manager.num_free_blocks == 63
    outs = list(llm.stream([[1, 2, 3]], GREEDY))
    assert sum(len(o.new_token_ids) for o in outs) == GREEDY.max_tokens and outs[-1].finished


def test_text_prompts_use_the_tokenizer(pure_torch, model):
    tok = CharTokenizer()
    llm = LLM(model, tokenizer=tok, backend="torch", num_kv_blocks=64)
    (out,) = llm.generate("hello world", GREEDY, use_tqdm=False)
    assert out.prompt == "hello world" and out.prompt_token_ids == tok.encode("hello world")
    assert out.output_token_ids == model.reference_greedy(tok.encode("hello world"), GREEDY.max_tokens)
    assert out.text == tok.decode(out.output_token_ids)
    with pytest.raises(TypeError, match="a text prompt needs a tokenizer"):
        LLM(model, backend="torch", num_kv_blocks=64).generate("hi", use_tqdm=False)


def test_eos_and_stop_tokens_end_generation(pure_torch):
    plain = tiny_model()
    first = plain.reference_greedy([3, 4, 5], 1)[0]
    with_eos = tiny_model(eos_token_ids=[first])
    llm = LLM(with_eos, backend="torch", num_kv_blocks=64)
    (out,) = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert out.output_token_ids == [first] and out.finish_reason is FinishReason.STOP
    (out,) = llm.generate([[3, 4, 5]], GREEDY, use_tqdm=False)
    assert len(out.output_token_ids) == 8 and out.finish_reason is FinishReason.LENGTH
    second = plain.reference_greedy([3, 4, 5], 2)[1]
    stop = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[second])
    (out,) = llm.generate([[3, 4, 5]], stop, use_tqdm=False)
    assert out.output_token_ids[-1] == second and out.finish_reason is FinishReason.STOP


def test_metrics_of_a_run(pure_torch, model):
    llm = LLM(model, backend="torch", num_kv_blocks=64)
    prompts = prompts_with_shared_prefix(n=4, seed=4)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    m = llm.last_metrics
    assert m.num_requests == 4 and m.num_prompt_tokens == sum(map(len, prompts))
    assert m.num_output_tokens == 4 * GREEDY.max_tokens and m.num_steps >= GREEDY.max_tokens
    assert m.elapsed_s > 0 and m.output_throughput > 0 and 0 < m.mean_ttft_s <= m.elapsed_s
    assert 0 < m.mean_tpot_s < m.elapsed_s and all(o.ttft > 0 and o.tpot > 0 for o in outs)
    assert "output tok/s" in m.summary()


def test_bad_settings_and_requests_are_refused(pure_torch, model):
    with pytest.raises(ValueError, match="kv_cache_dtype='int4' is not supported; supported: auto, fp8"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="max_num_batched_tokens must be a positive int"):
        EngineConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="num_kv_blocks must be an int >= 2"):
        EngineConfig(num_kv_blocks=1)
    with pytest.raises(ValueError, match="dtype='float8' is not supported"):
        EngineConfig(dtype="float8")
    with pytest.raises(ValueError, match="device=mps is not supported"):
        EngineConfig(device="mps")
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        LLM(model, backend="nope", num_kv_blocks=8)
    llm = LLM(model, backend="torch", num_kv_blocks=8, block_size=4, max_model_len=40)
    with pytest.raises(ValueError, match=r"exceeds max_model_len \(40\)"):
        llm.add_request(list(range(1, 40)), GREEDY)
    with pytest.raises(ValueError, match="needs more KV blocks than the cache holds"):
        llm.add_request(list(range(1, 30)), GREEDY)
    with pytest.raises(ValueError, match="sampling_params has 1 entries for 2 prompts"):
        llm.generate([[1], [2]], [GREEDY], use_tqdm=False)
    assert not llm.has_unfinished_requests()
    assert LLM(model, backend="torch").runner.num_blocks == 1024  # CPU default
    assert LLM(model, backend="torch", num_kv_blocks=8).runner.block_size == 16


def test_default_block_size(pure_torch):
    """64 rows for MLA models on a GPU (the Gluon MLA decode kernels' block size), else 16."""
    assert default_block_size("auto", True, torch.device("cuda")) == 64
    assert default_block_size("auto", True, torch.device("cpu")) == 16
    assert default_block_size("auto", False, torch.device("cuda")) == 16
    mla = preset("tiny-deepseek")
    llm = LLM(mla, backend="torch", num_kv_blocks=8)
    assert llm.runner.block_size == 16 and llm.runner.spec.block_size == 16
    assert llm.config.block_size is None  # the runner chose it; the config the caller gave is left as it was
    assert LLM(mla, backend="torch", num_kv_blocks=8, block_size=32).runner.spec.block_size == 32
    assert EngineConfig().cuda_graph_batch_sizes()[:5] == [1, 2, 4, 8, 16]


@pytest.mark.gpu
@pytest.mark.parametrize("name,backend", [("tiny-llama", "three_path"), ("tiny-llama", "unified"),
                                          ("tiny-llama", "two_path"), ("tiny-llama", "mixed"), ("tiny-qwen3", "auto"),
                                          ("tiny-deepseek", "auto"), ("tiny-kimi-nope", "auto")])
def test_cuda_graphs_memory_and_fp8_on_gpu(name, backend):
    # float16: graph replays use the padded batch and a fixed decode split count, so their rounding differs
    # from eager steps'; that may flip near-tied argmaxes (checked by assert_same_or_near_tie).
    gc.collect()  # the previous case's engines (one sized to 30% of the GPU) must not count as in use here
    torch.cuda.empty_cache()
    model = load_model(name, dtype=torch.float16, device="cuda")
    prompts = prompts_with_shared_prefix(n=12, seed=5, shared=40, lo=10, hi=300, vocab=256)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    block_size = default_block_size(backend, model.config.mla is not None, torch.device("cuda"))
    blocks = 16384 // block_size  # 16384 cache rows, whatever the block size
    common = dict(backend=backend, max_num_batched_tokens=512, max_num_seqs=12, device="cuda")
    eager = LLM(model, enforce_eager=True, num_kv_blocks=blocks, **common)
    graphs = LLM(model, num_kv_blocks=blocks, **common)
    assert eager.runner.block_size == block_size == (64 if model.config.mla is not None else 16)
    assert eager.runner.decode_graphs is None
    if graphs.runner.captures_decode_graphs:
        assert sorted(graphs.runner.decode_graphs.graphs) == [1, 2, 4, 8, 12]
    expected = greedy_outputs(eager, prompts, params)
    assert_same_or_near_tie(model, prompts, expected, greedy_outputs(graphs, prompts, params))
    tight = LLM(model, num_kv_blocks=60, block_size=16, **common)  # 960 rows: preemptions
    assert_same_or_near_tie(model, prompts, expected, greedy_outputs(tight, prompts, params))
    assert tight.last_metrics.num_preemptions > 0
    no_prefix = LLM(model, num_kv_blocks=blocks, enable_prefix_caching=False, **common)
    assert_same_or_near_tie(model, prompts, expected, greedy_outputs(no_prefix, prompts, params))
    measured = LLM(model, gpu_memory_utilization=0.3, **common)
    assert measured.runner.num_blocks * measured.runner.block_size > 16000  # rows, whatever the block size
    fp8 = LLM(model, kv_cache_dtype="fp8", num_kv_blocks=blocks, **common)
    assert all(len(o) == params.max_tokens for o in greedy_outputs(fp8, prompts, params))
    # Calibrated scales are set in place after the graphs were captured: replays must read them.
    calibrated = LLM(model, kv_cache_dtype="fp8", calculate_kv_scales=True, num_kv_blocks=blocks, **common)
    eager_calibrated = LLM(model, kv_cache_dtype="fp8", calculate_kv_scales=True, num_kv_blocks=blocks,
                           enforce_eager=True, **common)
    assert_same_or_near_tie(model, prompts, greedy_outputs(eager_calibrated, prompts, params),
                            greedy_outputs(calibrated, prompts, params), max_gap=0.1)
    print(name, graphs.backend_name, graphs.last_metrics.summary())


def test_start_warms_the_lm_head_and_sampling_for_every_row_count():
    """``warm_sampling`` (run at start on a GPU) computes the logits of every row count from 1 to the rows it
    is given, samples each greedily, samples with a temperature at powers of two and the largest count (with
    top-k / top-p, and plain: the Gumbel-max draw with noise keys), and runs the multi-step advance once, so
    none of these is a first use while requests wait."""
    from tripath.attention.metadata import AttentionMetadata

    llm = LLM(preset("tiny-llama"), backend="three_path", num_kv_blocks=8, max_num_seqs=6,
              max_num_batched_tokens=40, max_model_len=16)
    runner, rows, sampled, advanced = llm.runner, [], [], []
    real_logits, real_advance = runner.model.compute_logits, AttentionMetadata.advance_decodes_
    runner.model.compute_logits = lambda hidden: rows.append(hidden.shape[0]) or real_logits(hidden)
    import tripath.engine.runner.startup as model_runner
    real_sample = model_runner.sample

    def sample(logits, params, generators, noise=None):
        sampled.append((logits.shape[0], params[0].greedy, noise is not None))
        return real_sample(logits, params, generators, noise=noise)

    def advance(meta, positions, block_size):
        advanced.append(positions.shape[0])
        return real_advance(meta, positions, block_size)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_runner, "sample", sample)
        patch.setattr(AttentionMetadata, "advance_decodes_", advance)
        model_runner.warm_sampling(runner, torch.zeros(6, llm.model.config.hidden_size, dtype=llm.config.dtype))
    assert rows == [1, 2, 3, 4, 5, 6]
    assert [n for n, greedy, _ in sampled if greedy] == [1, 2, 3, 4, 5, 6]
    assert [n for n, greedy, keyed in sampled if not greedy and not keyed] == [1, 2, 4, 6]
    assert [n for n, greedy, keyed in sampled if not greedy and keyed] == [1, 2, 4, 6]
    assert advanced == [1]


def test_the_start_ends_with_a_full_garbage_collection(pure_torch):
    """The collector's first full pass over the start's objects runs inside ``LLM(...)``, not in a step."""
    collections = []

    def record(phase, info):
        if phase == "stop":
            collections.append(info["generation"])

    gc.callbacks.append(record)
    try:
        LLM(preset("tiny-llama"), backend="torch", num_kv_blocks=8, max_model_len=16)
    finally:
        gc.callbacks.remove(record)
    assert collections and collections[-1] == 2
