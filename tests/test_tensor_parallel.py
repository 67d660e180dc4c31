"""Tensor parallelism on the CPU (gloo, 2 processes): TP 2 gives TP 1's logits and greedy tokens for GQA (KV
heads split and replicated), Qwen3-MoE and MLA models; sharded loading reads exactly the slices of the full
tensors; ``LLM(tensor_parallel_size=2)`` generates what ``tensor_parallel_size=1`` does and its workers go
away when it is closed, collected, or when its process dies. The GPU test (NCCL, 2 GPUs) runs the real
backends with CUDA graphs."""

import gc
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import safetensors
import torch

from model_steps import randomize_hf_weights
from tp_ranks import model_steps_cases, reference_steps, run_ranks
from tripath.engine import LLM, SamplingParams
from tripath.engine.requests.request import Request
from tripath.engine.scheduling.scheduler import ScheduledRequest
from tripath.models import load_model
from tripath.models.parallel import ParallelState, model_shards

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=256, bos_token_id=0, eos_token_id=1)
STACKED = re.compile(r"\.experts\.(gate|up|down)_proj$")
# tiny-mistral: 4 q / 1 kv head (replicated at TP 2), sliding window; tiny-qwen3-moe: 4 q / 2 kv heads (split),
# top-2 of 8 experts; tiny-deepseek: MLA with q_lora, yarn, MoE with a shared expert.
CASES = ("tiny-mistral", "tiny-qwen3-moe", "tiny-deepseek")


@pytest.fixture(autouse=True)
def _plain_cpu(monkeypatch):
    """On the CPU: the ops' PyTorch paths (no Triton interpreter) and one thread per process, in this
    process and in the ranks it spawns (they inherit the environment)."""
    if torch.cuda.is_available():
        yield
        return
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- model level: TP 2 against TP 1 ---------------------------------------------------------------------------

def test_tp2_logits_and_greedy_tokens_match_tp1():
    got = run_ranks(model_steps_cases, 2, CASES, torch.float32, "torch")
    want = reference_steps(CASES, torch.float32, "torch")
    for preset in CASES:
        torch.testing.assert_close(got[preset]["logits"], want[preset]["logits"], atol=2e-5, rtol=1e-4,
                                   msg=lambda m: f"{preset}: {m}")
        assert got[preset]["tokens"] == want[preset]["tokens"], preset
    heads = {preset: got[preset]["spec"] for preset in CASES}
    assert heads == {"tiny-mistral": (2, 1), "tiny-qwen3-moe": (2, 1), "tiny-deepseek": (2, 1)}


# -- sharded loading ------------------------------------------------------------------------------------------

def save_hf(path, kind):
    if kind == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **SMALL, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **SMALL, num_key_value_heads=2, tie_word_embeddings=True))
    else:
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **{**SMALL, "num_hidden_layers": 2}, num_key_value_heads=4, kv_lora_rank=64, qk_rope_head_dim=32,
            qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=24, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=1, n_group=1, topk_group=1))
    randomize_hf_weights(model)
    model.save_pretrained(path, max_shard_size="60KB")


def expected_shard(name: str, full: torch.Tensor, rank: int, world: int, config) -> torch.Tensor:
    """Rank ``rank``'s slice of parameter ``name``, from the layout rules (independently of the model code)."""
    chunk = lambda t, dim: t.chunk(world, dim)[rank]  # noqa: E731
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = -(-config.vocab_size // world)
        padded = torch.zeros(rows * world, full.shape[1], dtype=full.dtype)
        padded[:full.shape[0]] = full
        return chunk(padded, 0)
    if name.endswith((".k_proj.weight", ".k_proj.bias", ".v_proj.weight", ".v_proj.bias")):
        if config.num_kv_heads >= world:
            return chunk(full, 0)
        kv_head = rank * config.num_kv_heads // world
        return full.view(config.num_kv_heads, -1, *full.shape[1:])[kv_head]
    if ".experts." in name and ".shared_experts." not in name:
        return chunk(full, 0)
    if name.endswith((".q_proj.weight", ".q_proj.bias", ".q_b_proj.weight", ".kv_b_proj.weight",
                      ".gate_proj.weight", ".up_proj.weight")):
        return chunk(full, 0)
    if name.endswith((".o_proj.weight", ".down_proj.weight")):
        return chunk(full, 1)
    return full  # norms, router, q_a / kv_a latent projections, row-parallel biases


class ReadLog:
    """``safetensors.safe_open`` that records what the loader reads: whole tensors and slices."""

    def __init__(self):
        self.whole, self.sliced, self.real = [], [], safetensors.safe_open

    def __call__(self, *args, **kwargs):
        log, handle = self, self.real(*args, **kwargs)

        class Handle:
            def __enter__(self):
                handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return handle.keys()

            def get_tensor(self, name):
                log.whole.append(name)
                return handle.get_tensor(name)

            def get_slice(self, name):
                real = handle.get_slice(name)

                class Slice:
                    def get_shape(self):
                        return real.get_shape()

                    def __getitem__(self, index):
                        log.sliced.append(name)
                        return real[index]

                return Slice()

        return Handle()


@pytest.mark.parametrize("kind, world", [("qwen3_moe", 2), ("qwen3_moe", 4), ("qwen2", 2), ("deepseek", 2),
                                         ("deepseek", 4)])
def test_sharded_loading_equals_slicing(tmp_path, monkeypatch, kind, world):
    """Each rank's weights are the slices of the full ones (at TP 4 the 2 KV heads are replicated); sharded
    tensors are read as slices only, and a rank never reads another rank's experts."""
    save_hf(tmp_path, kind)
    full = dict(load_model(str(tmp_path), dtype=torch.float32).named_parameters())
    for rank in range(world):
        log = ReadLog()
        monkeypatch.setattr(safetensors, "safe_open", log)
        shard = load_model(str(tmp_path), dtype=torch.float32, parallel=ParallelState(rank, world))
        monkeypatch.undo()
        params = dict(shard.named_parameters())
        assert params.keys() == full.keys()
        for name, p in params.items():
            assert torch.equal(p, expected_shard(name, full[name], rank, world, shard.config)), (rank, name)
        shards = model_shards(shard)
        assert set(log.sliced) == {n for n in shards if not STACKED.search(n)}
        assert not set(log.whole) & set(shards), "a sharded tensor was read whole"
        if shard.config.moe is not None:
            experts = [n for n in log.whole if ".experts." in n and ".shared_experts." not in n]
            per_rank = shard.config.moe.num_experts // world
            assert experts and {int(n.split(".experts.")[1].split(".")[0]) // per_rank for n in experts} == {rank}


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-deepseek"])
def test_preset_shards_are_slices_of_the_full_random_weights(preset):
    full = dict(load_model(preset, dtype=torch.float32).named_parameters())
    for rank in range(2):
        shard = load_model(preset, dtype=torch.float32, parallel=ParallelState(rank, 2))
        for name, p in shard.named_parameters():
            assert torch.equal(p, expected_shard(name, full[name], rank, 2, shard.config)), (rank, name)


def test_world_size_one_is_the_plain_model():
    plain = load_model("tiny-deepseek", dtype=torch.float32)
    assert model_shards(plain) == {} and plain.attention_spec().num_heads == plain.config.num_heads


def test_shapes_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide intermediate_size \(256\)"):
        load_model("tiny-llama", parallel=ParallelState(0, 3))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 must divide num_attention_heads"):
        load_model("tiny-qwen3-moe", parallel=ParallelState(0, 8))
    with pytest.raises(ValueError, match="rank must be an int in 0..1"):
        ParallelState(2, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        LLM("tiny-llama", backend="torch", tensor_parallel_size=0)


def test_llm_refuses_unshardable_or_unknown_models_before_spawning(monkeypatch):
    monkeypatch.setattr("torch.multiprocessing.get_context", None)  # spawning would fail with a TypeError
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 must divide num_attention_heads \(4\)"):
        LLM("tiny-qwen3-moe", backend="torch", tensor_parallel_size=8)
    with pytest.raises(FileNotFoundError, match="neither a local model directory nor a preset"):
        LLM("no-such-model", backend="torch", tensor_parallel_size=2)
    assert not torch.distributed.is_initialized()


# -- engine -----------------------------------------------------------------------------------------------------

def test_step_messages_rebuild_what_the_runner_reads():
    """Through a real scheduler with too few blocks (preemptions, prefix hits, chunked prefill): each decoded
    step has the scheduled requests' block ids, new tokens and counts, and block ids travel once each."""
    from tripath.engine.requests.request import Request
    from tripath.engine.runner.worker import StepDecoder, StepEncoder
    from tripath.engine.scheduling.block_manager import BlockManager
    from tripath.engine.scheduling.scheduler import Scheduler

    scheduler = Scheduler(BlockManager(12, 4), max_num_seqs=4, max_num_batched_tokens=10, max_model_len=64)
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(2, 50, (8,), generator=g).tolist()
    for i in range(5):
        prompt = shared + torch.randint(2, 50, (3 + 4 * i,), generator=g).tolist()
        scheduler.add(Request(prompt, SamplingParams(max_tokens=6, ignore_eos=True)))
    encoder, decoder = StepEncoder(), StepDecoder()
    sent = total = 0
    while scheduler.has_unfinished:
        out = scheduler.schedule()
        message = encoder.encode(out.scheduled)
        decoded = decoder.decode(message)
        assert len(decoded) == len(out.scheduled)
        for want, got in zip(out.scheduled, decoded):
            start, stop = want.num_computed_tokens, want.num_computed_tokens + want.num_new_tokens
            assert (got.num_new_tokens, got.num_computed_tokens, got.samples) == \
                (want.num_new_tokens, want.num_computed_tokens, want.samples)
            assert got.request.block_ids == want.request.block_ids
            assert got.request.token_ids(start, stop) == want.request.token_ids(start, stop)
            assert (got.draft_token_ids, got.draft_parents) == (want.draft_token_ids, want.draft_parents)
        sent += sum(len(item[5]) for item in message[1])
        total += sum(len(s.request.block_ids) for s in out.scheduled)
        scheduler.update(out, [[7] if s.samples else [] for s in out.scheduled])
    assert scheduler.num_preemptions > 0 and sent < total / 2
    assert set(decoder.blocks) <= {r.index for r, _, _ in encoder.known.values()}


PROMPTS = [[5, 17, 33, 9, 2, 70, 12], [40, 41, 42] * 6, [7]]
PARAMS = [SamplingParams(max_tokens=6, temperature=0), SamplingParams(max_tokens=5, temperature=0),
          SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3)]
ENGINE = dict(backend="torch", num_kv_blocks=48, block_size=4, max_num_batched_tokens=16)


def tokens(outputs):
    return [o.output_token_ids for o in outputs]


def test_llm_tp2_generates_tp1_tokens_and_close_stops_the_workers():
    """Chunked prefill (budget 16), prefix-cache hits and a seeded sampled request, all through rank 0."""
    want = tokens(LLM("tiny-qwen3-moe", **ENGINE).generate(PROMPTS, PARAMS, use_tqdm=False))
    with LLM("tiny-qwen3-moe", tensor_parallel_size=2, **ENGINE) as llm:
        workers = list(llm.runner.processes)
        assert [p.is_alive() for p in workers] == [True]
        assert llm.runner.runner.spec.num_heads == 2 and llm.runner.tensor_parallel_size == 2
        assert tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == want
        assert tokens(llm.generate(PROMPTS[:2], PARAMS[:2], use_tqdm=False)) == want[:2]  # prefix hits
    assert [p.exitcode for p in workers] == [0]
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)


def test_llm_tp2_speculative_decoding_gives_tp1_tokens():
    """Verify steps (pending token + n-gram drafts) reach the workers with their drafts: the greedy tokens are
    those of one rank without speculation."""
    greedy = [SamplingParams(max_tokens=8, temperature=0), SamplingParams(max_tokens=10, temperature=0)]
    want = tokens(LLM("tiny-deepseek", **ENGINE).generate(PROMPTS[:2], greedy, use_tqdm=False))
    spec = {"num_speculative_tokens": 3}
    with LLM("tiny-deepseek", tensor_parallel_size=2, speculative_config=spec, **ENGINE) as llm:
        assert tokens(llm.generate(PROMPTS[:2], greedy, use_tqdm=False)) == want
        assert llm.stats().spec_num_drafts > 0


def recorded_drafts(llm) -> list:
    """The drafts rank 0's proposer returns, in order."""
    proposer, drafts = llm.scheduler.proposer, []
    propose = proposer.propose
    proposer.propose = lambda items: drafts.append(propose(items)) or drafts[-1]
    return drafts


def test_llm_tp2_mtp_drafts_what_one_rank_drafts(tmp_path):
    """``mtp`` under tensor parallelism: every rank runs its shard of the MTP layer (MoE, as DeepSeek-V3's) on
    the runs rank 0's proposer shares, the rows of the launch just made from its own hidden states, so rank 0
    drafts what one rank drafts, step after step (a run a worker made wrong would change the all-reduced rows,
    its cache rows, and the drafts), and the greedy tokens are those of one rank without speculation. Chunked
    prefill (budget 16) and a second wave of prefix hits; a checkpoint whose weights show in the outputs."""
    from test_speculative_mtp import save_deepseek_with_mtp

    save_deepseek_with_mtp(tmp_path)
    model = str(tmp_path)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    waves = [PROMPTS[:2], [PROMPTS[1], PROMPTS[0][:5] + [3]]]
    plain = LLM(model, **ENGINE)
    want = [tokens(plain.generate(wave, greedy, use_tqdm=False)) for wave in waves]
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    one = LLM(model, speculative_config=spec, **ENGINE)
    one_drafts = recorded_drafts(one)
    assert [tokens(one.generate(wave, greedy, use_tqdm=False)) for wave in waves] == want
    with LLM(model, tensor_parallel_size=2, speculative_config=spec, **ENGINE) as llm:
        drafts = recorded_drafts(llm)
        layer, rows = llm.scheduler.proposer.layer, []   # rows a run reads, and those rank 0 sent
        share = layer.share
        layer.share = lambda run, hidden: rows.append((run.num_rows, sum(n for _, n in run.sent_pieces()))) or \
            share(run, hidden)
        assert [tokens(llm.generate(wave, greedy, use_tqdm=False)) for wave in waves] == want
        stats = llm.stats()
        assert stats.spec_num_drafts > 0 and stats.prefix_cache_hit_tokens > 0
        assert type(llm.scheduler.proposer).__name__ == "MTPProposer"
    assert drafts == one_drafts and any(any(d) for d in drafts)
    assert 0 < sum(sent for _, sent in rows) < sum(n for n, _ in rows) / 2   # most rows: the workers' own


def test_llm_tp2_draft_model_runs_beside_rank_0():
    """``draft_model`` under tensor parallelism: the draft (here the target's own preset, unsharded) runs on rank
    0 beside its shard and drafts what it drafts beside one rank's target, nearly every draft is kept, and the
    greedy tokens are one rank's without speculation."""
    from tripath.engine.drafters.draft_model import draft_cache_bytes

    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = tokens(LLM("tiny-qwen3-moe", **ENGINE).generate(PROMPTS[:2], greedy, use_tqdm=False))
    spec = {"model": "tiny-qwen3-moe", "num_speculative_tokens": 3}
    one = LLM("tiny-qwen3-moe", speculative_config=spec, **ENGINE)
    one_drafts = recorded_drafts(one)
    assert tokens(one.generate(PROMPTS[:2], greedy, use_tqdm=False)) == want
    with LLM("tiny-qwen3-moe", tensor_parallel_size=2, speculative_config=spec, **ENGINE) as llm:
        drafts = recorded_drafts(llm)
        assert tokens(llm.generate(PROMPTS[:2], greedy, use_tqdm=False)) == want
        stats = llm.stats()
        assert type(llm.scheduler.proposer).__name__ == "DraftModelProposer"
        assert llm.scheduler.proposer.runner.num_blocks == llm.runner.num_blocks
        draft_bytes = draft_cache_bytes(llm.scheduler.proposer.model, llm.config)(4)   # in rank 0's memory plan
        assert draft_bytes > 0 and llm.runner.runner.extra_cache_bytes(4) == draft_bytes
    assert drafts == one_drafts
    assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens > 0


def test_llm_tp2_draft_trees_move_every_ranks_cache_rows():
    """Draft trees under tensor parallelism: the workers build each tree's mask from the step message, and move
    the cache slots rank 0 moved along the accepted paths (the right token is always a later sibling, so every
    kept draft's rows move): the greedy tokens are one rank's without speculation."""
    from test_speculative_trees import _SecondSiblings, branching_prompts, spec

    prompts = branching_prompts()[:3]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    engine = {**ENGINE, "num_kv_blocks": 128}
    want = tokens(LLM("tiny-llama", **engine).generate(prompts, greedy, use_tqdm=False))
    with LLM("tiny-llama", tensor_parallel_size=2, speculative_config=spec(2, k=4), **engine) as llm:
        llm.scheduler.proposer = _SecondSiblings({tuple(p): w for p, w in zip(prompts, want)}, 256)
        assert tokens(llm.generate(prompts, greedy, use_tqdm=False)) == want
        assert llm.stats().spec_num_accepted_tokens > 0


def test_llm_tp2_draws_without_logits_as_tp1_samples():
    """With the fused LM head and draw forced on, each rank draws from its vocabulary rows and the ranks merge
    their draws: greedy and seeded plain-temperature tokens equal one rank's unfused sampling."""
    params = PARAMS[:2] + [SamplingParams(max_tokens=6, temperature=0.8, seed=3)]
    want = tokens(LLM("tiny-qwen3-moe", fused_sampling="off", **ENGINE).generate(PROMPTS, params, use_tqdm=False))
    with LLM("tiny-qwen3-moe", tensor_parallel_size=2, fused_sampling="on", **ENGINE) as llm:
        assert tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == want
        assert llm.stats().fused_sampling_steps > 0


def test_a_worker_runner_computes_logits_and_samples_nothing(monkeypatch):
    """A worker's runner (``samples = False``) runs the LM head (its collectives) and no sampler."""
    import tripath.engine.runner.model_runner as model_runner

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    llm = LLM("tiny-llama", **ENGINE)
    runner = llm.runner
    sampled, heads = [], []
    monkeypatch.setattr(model_runner, "LaunchSampler", lambda *a, **k: sampled.append(1))
    real_head = runner.compute_logits
    monkeypatch.setattr(runner, "compute_logits", lambda hidden: heads.append(hidden.shape[0]) or real_head(hidden))
    runner.samples = False
    request = Request([5, 6, 7], SamplingParams(max_tokens=2), block_ids=[1])
    out = runner.execute([ScheduledRequest(request, 3, 0, True)])
    assert out.tokens == [[]] and heads == [1] and sampled == []


def test_llm_tp2_workers_exit_when_collected():
    llm = LLM("tiny-deepseek", tensor_parallel_size=2, **ENGINE)
    want = tokens(LLM("tiny-deepseek", **ENGINE).generate(PROMPTS[:2], PARAMS[:2], use_tqdm=False))
    assert tokens(llm.generate(PROMPTS[:2], PARAMS[:2], use_tqdm=False)) == want
    workers = list(llm.runner.processes)
    del llm
    gc.collect()
    assert [p.exitcode for p in workers] == [0]


def test_llm_tp_refuses_a_built_model():
    model = load_model("tiny-llama", dtype=torch.float32)
    with pytest.raises(TypeError, match="needs the model as a path or preset name"):
        LLM(model, backend="torch", tensor_parallel_size=2)


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


ORPHAN_SCRIPT = """
import os, sys
from tripath.engine import LLM
if __name__ == "__main__":
    llm = LLM("tiny-llama", backend="torch", num_kv_blocks=16, tensor_parallel_size=2)
    print(llm.runner.processes[0].pid, flush=True)
    os._exit(0)  # no close, no finalizers: the worker must notice on its own
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")
def test_workers_exit_when_rank_0_dies(tmp_path):
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 20
    while _state(pid) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _state(pid) in (None, "Z")


TORCHRUN_SCRIPT = """
import os
from tripath.engine import LLM, SamplingParams
llm = LLM("tiny-llama", backend="torch", num_kv_blocks=16, tensor_parallel_size=2)
assert os.environ["RANK"] == "0", "ranks other than 0 leave the constructor with SystemExit(0)"
out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
print("tokens", *out[0].output_token_ids, flush=True)
llm.close()
"""


def test_llm_under_torchrun_uses_its_process_group(tmp_path):
    script = tmp_path / "tp.py"
    script.write_text(TORCHRUN_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(port), str(script)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [s for s in done.stdout.splitlines() if s.startswith("tokens")]
    want = LLM("tiny-llama", backend="torch", num_kv_blocks=16).generate(
        [[5, 6, 7, 8]], SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)[0].output_token_ids
    assert line == ["tokens " + " ".join(map(str, want))]


def test_generate_cli_with_tensor_parallel_size(capsys):
    from tripath.cli.generate import main_generate

    args = ["--model", "tiny-llama", "--prompt-ids", "5,6,7,8", "--max-tokens", "4", "--backend", "torch",
            "--device", "cpu", "--num-kv-blocks", "16", "--num-random-prompts", "2", "--random-prompt-len", "6"]
    assert main_generate(args) == 0
    single = capsys.readouterr().out
    assert main_generate(args + ["--tensor-parallel-size", "2"]) == 0
    parallel = capsys.readouterr().out
    line = [s for s in single.splitlines() if "tokens:" in s]
    assert line and line == [s for s in parallel.splitlines() if "tokens:" in s]
    assert "tensor parallel 2" in parallel and "3 requests, 16 prompt + 12 output tokens" in parallel


# -- GPU (2 GPUs, NCCL) ---------------------------------------------------------------------------------------

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.mark.gpu
@needs_two_gpus
def test_gpu_tp2_logits_match_tp1():
    """The default backends (three_path / mla) in fp16 over NCCL."""
    cases = ("tiny-llama", "tiny-mistral", "tiny-qwen3-moe", "tiny-deepseek")
    got = run_ranks(model_steps_cases, 2, cases, torch.float16, "auto", backend="nccl")
    want = reference_steps(cases, torch.float16, "auto", device="cuda")
    for preset in cases:
        torch.testing.assert_close(got[preset]["logits"], want[preset]["logits"], atol=2e-2, rtol=1e-2,
                                   msg=lambda m: f"{preset}: {m}")


@pytest.mark.gpu
def test_gpu_tp2_on_one_gpu_over_gloo_matches_tp1():
    """Both ranks on one GPU, the collectives through gloo: the GPU backends on the sharded specs (eager)."""
    cases = ("tiny-mistral", "tiny-qwen3-moe", "tiny-deepseek")
    got = run_ranks(model_steps_cases, 2, cases, torch.float16, "auto", backend="gloo", device="cuda:0")
    want = reference_steps(cases, torch.float16, "auto", device="cuda")
    for preset in cases:
        torch.testing.assert_close(got[preset]["logits"], want[preset]["logits"], atol=2e-2, rtol=1e-2,
                                   msg=lambda m: f"{preset}: {m}")


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek"])
def test_gpu_llm_tp2_with_cuda_graphs_matches_tp1(tmp_path, kind):
    """A checkpoint with spread-out logits (no near ties), bf16, CUDA graphs on: same greedy tokens."""
    save_hf(tmp_path, kind)
    prompts = [[5, 17, 33, 9, 2, 70, 12], [40, 41, 42] * 30, [7, 8]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine = dict(device="cuda", dtype="bfloat16", num_kv_blocks=256)
    want = tokens(LLM(str(tmp_path), **engine).generate(prompts, params, use_tqdm=False))
    with LLM(str(tmp_path), tensor_parallel_size=2, **engine) as llm:
        assert llm.runner.decode_graphs.graphs, "CUDA graphs were not captured"
        got = tokens(llm.generate(prompts, params, use_tqdm=False))
    agree = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) / sum(len(w) for w in want)
    assert got[0][:4] == want[0][:4] and agree >= 0.9, (got, want)


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("model, spec", [
    ("tiny-deepseek", {"method": "mtp", "num_speculative_tokens": 2}),
    ("tiny-llama", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "tree_width": 2}),
    ("tiny-qwen3-moe", {"model": "tiny-qwen3-moe", "num_speculative_tokens": 3}),
], ids=["mtp", "ngram-trees", "draft_model"])
def test_gpu_llm_tp2_speculates_as_one_rank(model, spec):
    """Speculative decoding under tensor parallelism over NCCL with CUDA graphs (verify graphs included): the
    greedy tokens of one rank without speculation, but for near ties of fp16."""
    prompts = [[5, 17, 33, 9, 2, 70, 12] * 3, [40, 41, 42] * 30, [7, 8]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    engine = dict(device="cuda", dtype="float16", num_kv_blocks=256)
    want = tokens(LLM(model, **engine).generate(prompts, params, use_tqdm=False))
    with LLM(model, tensor_parallel_size=2, speculative_config=spec, **engine) as llm:
        got = tokens(llm.generate(prompts, params, use_tqdm=False))
        assert llm.stats().spec_num_drafts > 0
    agree = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) / sum(len(w) for w in want)
    assert got[1][:4] == want[1][:4] and agree >= 0.9, (got, want)
