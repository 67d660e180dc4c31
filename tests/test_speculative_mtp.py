"""Speculative decoding's ``mtp`` method (DeepSeek-V3's multi-token-prediction layer): the layer's logits against a
float64 reference written here from the formula; greedy outputs identical with and without speculation (MoE
MTP layer; preemption, prefix hits, small budgets; the Triton MLA backends); acceptance where the MTP layer
predicts what the target does; the MTP cache holding the right rows for the kept tokens after partial
acceptance; loading the layer from a checkpoint; bad configurations refused."""

import json
import math

import pytest
import torch
from torch.nn import functional as F

from model_steps import PagedRunner
from tripath.attention.spec import MLASpec
from tripath.engine import LLM, EngineConfig, SamplingParams
from tripath.engine.speculative import SpeculativeConfig
from tripath.models import ModelConfig, RopeConfig, build_model, load_model
from tripath.models.deepseek_mtp import NoMTPLayer
from tripath.models.loader import build_mtp

MTP = {"method": "mtp", "num_speculative_tokens": 3}
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(autouse=True)
def _pure_torch_validated(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("TRIPATH_VALIDATE", "1")


def small_config(eps: float = 1e-6, vocab: int = 128) -> ModelConfig:
    """One dense MLA layer, GPT-J rope without scaling, and one MTP layer."""
    mla = MLASpec(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
    return ModelConfig(architecture="DeepseekV3ForCausalLM", vocab_size=vocab, hidden_size=64, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_size=mla.cache_width, max_position=512,
                       intermediate_size=96, mla=mla, rope=RopeConfig(theta=10000.0, is_neox=False), q_lora_rank=32,
                       rms_norm_eps=eps, num_nextn_predict_layers=1, eos_token_ids=[1], bos_token_id=0)


def randomize(module, seed: int) -> None:
    """Weights that show in the outputs: linears ``N(0, 1/fan_in)``, embeddings ``N(0, 1)``, norms
    ``1 + N(0, 0.1²)``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def small_model(eps: float = 1e-6, seed: int = 0):
    config = small_config(eps)
    model = build_model(config, dtype=torch.float32)
    randomize(model, seed)
    model.mtp = build_mtp(config, dtype=torch.float32)
    randomize(model.mtp, seed + 1)
    return model


# -- the layer's math ---------------------------------------------------------------------------------------

def rms(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def gptj_rope(x, positions, theta, dim):
    """GPT-J pairs ``(2i, 2i + 1)`` turned by ``p · theta^(-2i/dim)``; ``x [n, ..., dim]``."""
    inv = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angle = positions.double()[:, None] * inv[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (dim // 2,)
    cos, sin = angle.cos().view(shape), angle.sin().view(shape)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


def mtp_reference(model, hidden, next_tokens):
    """Float64 logits ``[n, V]`` of the MTP layer over rows ``0 .. n-1`` of one sequence from the formula:
    ``x = eh_proj([enorm(E(t_{p+1})) | hnorm(h_p)])``, a pre-norm MLA + MLP block at positions ``p`` (causal
    over the rows), ``lm_head(shared_head.norm(.))``."""
    c = model.config
    mla, eps, heads = c.mla, c.rms_norm_eps, c.num_heads
    w = {k: v.double() for k, v in model.mtp.state_dict().items()}
    w = {k.split(f"model.layers.{c.num_layers}.", 1)[1]: v for k, v in w.items()}
    n = hidden.shape[0]
    embed = model.model.embed_tokens.weight.double()[torch.tensor(next_tokens)]
    x = torch.cat([rms(embed, w["enorm.weight"], eps), rms(hidden.double(), w["hnorm.weight"], eps)], -1)
    x = x @ w["eh_proj.weight"].T
    a = rms(x, w["input_layernorm.weight"], eps)
    q = rms(a @ w["self_attn.q_a_proj.weight"].T, w["self_attn.q_a_layernorm.weight"], eps)
    q = (q @ w["self_attn.q_b_proj.weight"].T).view(n, heads, -1)
    q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], -1)
    kv_a = a @ w["self_attn.kv_a_proj_with_mqa.weight"].T
    latent, k_pe = kv_a.split([mla.kv_lora_rank, mla.qk_rope_head_dim], -1)
    latent = rms(latent, w["self_attn.kv_a_layernorm.weight"], eps)
    kv = (latent @ w["self_attn.kv_b_proj.weight"].T).view(n, heads, -1)
    k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], -1)
    positions = torch.arange(n)
    q_pe = gptj_rope(q_pe, positions, c.rope.theta, mla.qk_rope_head_dim)
    k_pe = gptj_rope(k_pe, positions, c.rope.theta, mla.qk_rope_head_dim)
    scores = (torch.einsum("qhd,khd->hqk", q_nope, k_nope) + torch.einsum("qhd,kd->hqk", q_pe, k_pe))
    scores = scores / math.sqrt(mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1) @ w["self_attn.o_proj.weight"].T
    x = x + out
    m = rms(x, w["post_attention_layernorm.weight"], eps)
    x = x + (F.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    head = model.lm_head.weight.double()
    return rms(x, w["shared_head.norm.weight"], eps) @ head.T


def test_mtp_logits_match_the_formula_over_steps_of_its_own_cache():
    """The MTP layer over one sequence in three steps (a prefill of 6 rows, an extend of 3, a decode), its
    K/V in its own paged cache: each row's logits are the float64 reference's."""
    model = small_model()
    model.post_load()
    n = 10
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(n, model.config.hidden_size, generator=g)
    next_tokens = torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
    want = mtp_reference(model, hidden, next_tokens)
    runner = PagedRunner(model, backend="torch", block_size=4, num_blocks=16)
    got = []
    for start, stop in ((0, 6), (6, 9), (9, 10)):
        ids, positions, ctx, _ = runner.prepare({0: next_tokens[start:stop]})
        with torch.inference_mode():
            out = model.mtp_forward(ids, positions, hidden[start:stop], ctx)
            got.append(model.mtp_logits(out))
    torch.testing.assert_close(torch.cat(got).double(), want, atol=2e-4, rtol=2e-4)


def save_deepseek_with_mtp(path, seed: int = 7):
    """A small DeepSeek-V3 checkpoint (transformers' config: ``num_nextn_predict_layers`` 1) with its MTP layer
    ``L`` (weights that show in the outputs, the layer's copies of the embedding and the LM head zero) in
    ``mtp.safetensors``; returns the layer as tripath builds it."""
    from safetensors.torch import save_file

    from test_model_loading import save_deepseek

    save_deepseek(path)
    raw = json.loads((path / "config.json").read_text())
    reference = build_mtp(load_model(str(path), dtype=torch.float32).config, dtype=torch.float32)
    randomize(reference, seed)
    tensors = {k: v.contiguous() for k, v in reference.state_dict().items() if ".experts." not in k}
    layer = f"model.layers.{reference.index}"
    for e in range(reference.config.moe.num_experts):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            tensors[f"{layer}.mlp.experts.{e}.{proj}.weight"] = getattr(reference.layer.mlp.experts, proj)[e].clone()
    tensors[f"{layer}.embed_tokens.weight"] = torch.zeros(raw["vocab_size"], raw["hidden_size"])
    tensors[f"{layer}.shared_head.head.weight"] = torch.zeros(raw["vocab_size"], raw["hidden_size"])
    save_file(tensors, str(path / "mtp.safetensors"), metadata={"format": "pt"})
    return reference


def test_the_layer_loads_from_a_checkpoint_by_its_names(tmp_path):
    """Layer ``L`` of a checkpoint (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, the decoder layer)
    loads into ``model.mtp``; its copies of the embedding and the LM head are left to the target's; the
    target alone loads as before."""
    reference = save_deepseek_with_mtp(tmp_path)
    config_path = tmp_path / "config.json"
    raw = json.loads(config_path.read_text())
    assert raw["num_nextn_predict_layers"] == 1
    model = load_model(str(tmp_path), dtype=torch.float32, mtp=True)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(dict(model.mtp.named_parameters())[name], param, msg=name)
    assert load_model(str(tmp_path), dtype=torch.float32).mtp is None
    raw["num_nextn_predict_layers"] = 0
    config_path.write_text(json.dumps(raw))
    with pytest.raises(NoMTPLayer, match="num_nextn_predict_layers=0"):
        load_model(str(tmp_path), dtype=torch.float32, mtp=True)


# -- the engine -----------------------------------------------------------------------------------------------

_models = {}


def tiny_deepseek():
    if "tiny" not in _models:
        _models["tiny"] = load_model("tiny-deepseek", dtype=torch.float32, mtp=True)
    return _models["tiny"]


def follower(steer: float):
    """A target whose next token depends on its current token alone (attention's output projection 0) and an
    MTP layer that computes that same function of its input token (the target's layer, the embedding half of
    ``eh_proj`` the identity, embeddings of RMS 1, the target's final norm), so it drafts what the target will
    decode; ``steer`` mixes ``steer · R · hnorm(h)`` into ``eh_proj`` (its drafts then follow the target's
    less often, and its cache rows depend on the hidden states)."""
    key = ("follower", steer)
    if key in _models:
        return _models[key]
    config = small_config(eps=1e-12)
    model = small_model(eps=1e-12, seed=3)
    layer, mtp = model.model.layers[0], model.mtp.layer
    with torch.no_grad():
        layer.self_attn.o_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        embed.div_(embed.pow(2).mean(-1, keepdim=True).sqrt())
        mtp.load_state_dict({**layer.state_dict(), **{k: v for k, v in mtp.state_dict().items()
                                                      if k.split(".")[0] in ("enorm", "hnorm", "eh_proj",
                                                                             "shared_head")}})
        mtp.enorm.weight.fill_(1.0)
        size = config.hidden_size
        g = torch.Generator().manual_seed(11)
        mtp.eh_proj.weight.copy_(torch.cat([torch.eye(size), steer * torch.randn(size, size, generator=g) / size ** 0.5],
                                           dim=1))
        mtp.shared_head.norm.weight.copy_(model.model.norm.weight)
    model.post_load()
    _models[key] = model
    return model


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(2, vocab, (13,), generator=g).tolist()
    return [shared + torch.randint(2, vocab, (3,), generator=g).tolist(), shared[:9],
            torch.randint(2, vocab, (7,), generator=g).tolist(), shared[:12] + [5, 6]]   # differs at a block's end


def outputs(llm, batch, params=GREEDY):
    return [o.output_token_ids for o in llm.generate(batch, params, use_tqdm=False)]


VARIANTS = {
    "ample": dict(num_kv_blocks=128, block_size=4),
    "tight_memory": dict(num_kv_blocks=12, block_size=4, max_num_batched_tokens=24),   # preemption
    "small_budget": dict(num_kv_blocks=128, block_size=4, max_num_batched_tokens=5),   # drafts cut to the budget
    "no_prefix_cache": dict(num_kv_blocks=128, block_size=4, enable_prefix_caching=False),
}


def run_both(model, options, backend="torch", spec=MTP):
    """Outputs without and with speculation (two waves: the second one hits the prefix cache), and the
    speculating engine, whose proposer must have drafted all it was asked for every time (the kept hidden
    state of each request's last row was there)."""
    batch = prompts(model.config.vocab_size)
    base = LLM(model, backend=backend, **options)
    want = outputs(base, batch[:2]) + outputs(base, batch[2:])
    llm = LLM(model, backend=backend, speculative_config=spec, **options)
    proposer = llm.scheduler.proposer
    propose, short = proposer.propose, []

    def checked(items):
        drafts = propose(items)
        short.extend((k, len(d)) for (_, k), d in zip(items, drafts) if len(d) != k)
        return drafts

    proposer.propose = checked
    got = outputs(llm, batch[:2]) + outputs(llm, batch[2:])
    assert not short, short
    return want, got, llm


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_outputs_are_those_without_speculation(variant):
    """tiny-deepseek's random MTP layer (MoE, like DeepSeek-V3's): its drafts are rarely kept, every verify
    rejects and redoes rows; the outputs are the target's."""
    want, got, llm = run_both(tiny_deepseek(), VARIANTS[variant])
    assert got == want
    stats = llm.stats()
    assert type(llm.scheduler.proposer).__name__ == "MTPProposer"
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens > 2 * stats.spec_num_drafts
    assert stats.num_kv_blocks_used == 0
    if variant == "tight_memory":
        assert stats.num_preemptions > 0
    if variant == "ample":
        assert stats.prefix_cache_hit_tokens > 0


@pytest.mark.parametrize("variant", ["ample", "tight_memory"])
def test_an_mtp_layer_that_predicts_the_target_has_every_draft_kept(variant):
    want, got, llm = run_both(follower(0.0), VARIANTS[variant], spec={"method": "deepseek_mtp",
                                                                    "num_speculative_tokens": 3})
    assert got == want
    stats = llm.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens, stats


def no_drafts_every_third_step(scheduler) -> None:
    """Every third step takes no drafts (as decodes whose ``max_tokens`` leave no room): a decode then
    follows a verify and its step redoes the row the verify left."""
    draft_room, schedule, steps = scheduler._draft_room, scheduler.schedule, [0]

    def counted_schedule(*args, **kwargs):
        steps[0] += 1
        return schedule(*args, **kwargs)

    scheduler.schedule = counted_schedule
    scheduler._draft_room = lambda request: 0 if steps[0] % 3 == 0 else draft_room(request)


def record_mtp_rows(llm) -> dict:
    """``request id -> (its tokens, its MTP cache rows 0 .. n - 2)`` read as each request finishes (rows whose
    token and next token it kept; ``n`` the tokens the target computed or kept, the fewer)."""
    block_manager, cache = llm.scheduler.block_manager, llm.scheduler.proposer.cache.kv_cache
    bs, seen, release = block_manager.block_size, {}, block_manager.release

    def recording_release(request):
        if request.is_finished:
            rows = min(request.num_computed_tokens, request.num_tokens) - 1
            slots = [request.block_ids[p // bs] * bs + p % bs for p in range(rows)]
            seen[request.request_id] = (request.all_token_ids, cache.view(-1, cache.shape[-1])[slots].clone())
        release(request)

    block_manager.release = recording_release
    return seen


def check_mtp_rows(model, seen: dict) -> None:
    """Each request's recorded MTP rows equal those of one non-speculative pass of the target and the MTP
    layer over its final tokens (the torch backend)."""
    keep, model.keep_prenorm_hidden = model.keep_prenorm_hidden, True
    for tokens, rows in seen.values():
        ids, positions, ctx, _ = PagedRunner(model, backend="torch", block_size=4, num_blocks=64).prepare(
            {0: tokens[:-1]})
        with torch.inference_mode():
            model(ids, positions, ctx)
            hidden = model.prenorm_hidden.clone()
            ids, positions, ctx, _ = PagedRunner(model, backend="torch", block_size=4, num_blocks=64).prepare(
                {0: tokens[1:]})
            model.mtp_forward(ids, positions, hidden, ctx)
        cache = ctx.caches[0].kv_cache
        want = cache.view(-1, cache.shape[-1])[ctx.metadata.slot_mapping[:rows.shape[0]]]
        torch.testing.assert_close(rows.float(), want, atol=2e-4, rtol=2e-4)
    model.keep_prenorm_hidden = keep


@pytest.mark.parametrize("variant", ["ample", "small_budget", "tight_memory"])
def test_the_mtp_cache_holds_the_right_rows_for_the_kept_tokens(variant):
    """A steered MTP layer keeps some drafts and rejects others; when each request ends, its MTP rows ``0 ..
    n - 2`` (those of its tokens whose next token it kept) equal those of one non-speculative pass of the
    target and the MTP layer over its final tokens. Every third step takes no drafts; a small budget makes
    decodes follow prompt chunks; tight memory preempts; the last prompt differs from the first at a block's
    end (a prefix hit whose last block the MTP row depends on the next token of)."""
    model = follower(0.6)
    llm = LLM(model, backend="torch", speculative_config=MTP, **VARIANTS[variant])
    no_drafts_every_third_step(llm.scheduler)
    seen = record_mtp_rows(llm)
    batch = prompts(model.config.vocab_size)
    outputs(llm, batch[:2])
    outputs(llm, batch[2:])
    stats = llm.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens, stats
    assert stats.prefix_cache_hit_tokens > 0 and (variant != "tight_memory" or stats.num_preemptions > 0)
    assert len(seen) == len(batch)
    check_mtp_rows(model, seen)


def emulate_decode_graphs(monkeypatch, model) -> list:
    """Decode graphs without a GPU: a replay re-runs the captured forward and writes the captured outputs (and,
    for the target's graphs, the hidden states before the final norm), as a CUDA graph replay rewrites its
    own memory. Returns the replay counts: ``[target's, MTP layer's]``."""
    replays = [0, 0]

    def capture(run, pool, device):
        target = run.func is model   # else the MTP layer's graphs (MTPStep): no prenorm of their own
        out = run()
        prenorm = model.prenorm_hidden if target else None

        class Replay:
            def replay(self):   # no Python runs in a real replay: the model's attribute stays as it was
                replays[0 if target else 1] += 1
                before = model.prenorm_hidden
                fresh = run()
                for static, value in zip(*((out, fresh) if isinstance(out, tuple) else ((out,), (fresh,)))):
                    static.copy_(value)
                if target:
                    prenorm.copy_(model.prenorm_hidden)
                model.prenorm_hidden = before

        return Replay(), out, None

    monkeypatch.setattr("tripath.engine.runner.decode_graphs.capture_graph", capture)
    return replays


def graph_case(monkeypatch):
    """A steered model, three short prompts and the torch backend's greedy outputs of them; emulated graphs
    and the interpreter from here on. Returns ``(model, batch, params, want, replays)``."""
    model = follower(0.6)
    batch = [p[:6] for p in prompts(model.config.vocab_size)[:3]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = outputs(LLM(model, backend="torch", num_kv_blocks=64, block_size=4), batch, params)
    replays = emulate_decode_graphs(monkeypatch, model)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return model, batch, params, want, replays


def mla_triton_with_graphs(model, **options):
    """An mla_triton engine drafting with the MTP layer, the target's decode graphs captured."""
    llm = LLM(model, backend="mla_triton", num_kv_blocks=64, block_size=4, max_num_seqs=4, speculative_config=MTP,
              **options)
    llm.runner.capture_decode_graphs()
    return llm


def test_decode_graph_steps_hand_their_hidden_states_on(monkeypatch):
    """Steps of decodes alone replay the decode graphs (mla_triton, in the interpreter), whose own tensors hold
    the hidden states before the final norm: the MTP rows are still right, the outputs the target's."""
    model, batch, params, want, replays = graph_case(monkeypatch)
    llm = mla_triton_with_graphs(model)
    no_drafts_every_third_step(llm.scheduler)
    seen = record_mtp_rows(llm)
    replays[0] = 0
    assert outputs(llm, batch, params) == want
    assert replays[0] > 0 and llm.stats().spec_num_accepted_tokens > 0
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    check_mtp_rows(model, seen)


@pytest.mark.parametrize("fused_sampling", ["off", "on"])
def test_the_mtp_layers_graphs_draft_what_its_eager_runs_draft(monkeypatch, fused_sampling):
    """The MTP layer's own graphs (drafting one row a request with the draw inside — from the logits, or
    without them as the target's fused sampling does —, observing a verify's rows; emulated replays,
    mla_triton in the interpreter): they replay, every draft is the eager layer's (the same tokens kept), the
    MTP rows right, the outputs the target's."""
    model, batch, params, want, replays = graph_case(monkeypatch)
    results = []
    for graphs in (False, True):
        llm = mla_triton_with_graphs(model, fused_sampling=fused_sampling if graphs else "off")
        layer = llm.scheduler.proposer.layer
        if graphs:
            layer.capture_graphs()
        else:
            assert layer.graphs is None
        seen = record_mtp_rows(llm)
        replays[:] = [0, 0]
        results.append((outputs(llm, batch, params), llm.stats().spec_num_accepted_tokens, replays[1]))
    (eager, eager_kept, eager_replays), (graphed, graphed_kept, graphed_replays) = results
    assert eager == graphed == want
    assert eager_replays == 0 and graphed_replays > 0
    assert graphed_kept == eager_kept > 0
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    check_mtp_rows(model, seen)


def test_the_triton_mla_backends_draft_as_the_reference(monkeypatch):
    model, batch = tiny_deepseek(), prompts(256)[:2]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = outputs(LLM(model, backend="torch", num_kv_blocks=64, block_size=16), batch, params)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for backend in ("mla", "mla_triton"):
        llm = LLM(model, backend=backend, num_kv_blocks=64, block_size=16, speculative_config=MTP)
        assert outputs(llm, batch, params) == want, backend
        assert llm.stats().spec_num_drafts > 0


@pytest.mark.gpu
def test_mtp_on_the_gpu_with_the_engine_defaults():
    """The engine's GPU defaults (CUDA graphs, warm-up, the MLA backends, fp16; the memory plan sizing the
    target's and the MTP layer's caches): greedy outputs as without speculation (up to near ties), through
    preemptions too; verifies were taken with the MTP layer's drafts."""
    from model_steps import assert_same_or_near_tie

    model = load_model("tiny-deepseek", dtype=torch.float16, device="cuda", mtp=True)
    batch = prompts(256) * 3
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    common = dict(max_num_batched_tokens=512, max_num_seqs=12, device="cuda", num_kv_blocks=256, block_size=16)
    expected = outputs(LLM(model, enforce_eager=True, **common), batch, params)
    planned = {k: v for k, v in common.items() if k != "num_kv_blocks"}
    for options in (common, dict(common, num_kv_blocks=40), dict(planned, gpu_memory_utilization=0.3)):
        llm = LLM(model, speculative_config=MTP, **options)
        assert_same_or_near_tie(model, batch, expected, outputs(llm, batch, params))
        assert llm.stats().spec_num_drafts > 0


# -- refusals -------------------------------------------------------------------------------------------------

def test_bad_mtp_configs_are_refused():
    with pytest.raises(ValueError, match="the mtp method takes no model"):
        EngineConfig(device="cpu", speculative_config={"method": "mtp", "model": "tiny-deepseek",
                                                       "num_speculative_tokens": 2})
    assert SpeculativeConfig.of({"method": "deepseek_mtp", "num_speculative_tokens": 2}).method == "mtp"
    with pytest.raises(ValueError, match="speculative_config method 'mtp' .* LlamaForCausalLM config has none"):
        LLM("tiny-llama", speculative_config=MTP)
    with pytest.raises(ValueError, match="DeepseekV2ForCausalLM config has none"):
        LLM("tiny-deepseek-v2", speculative_config=MTP)
    with pytest.raises(ValueError, match=r"built without it: load it with .*load_model\(\.\.\., mtp=True\)"):
        LLM(load_model("tiny-deepseek", dtype=torch.float32), speculative_config=MTP)
    with pytest.raises(ValueError, match="speculative_config method 'mtp' .* LlamaForCausalLM config has none"):
        LLM("tiny-llama", tensor_parallel_size=2, speculative_config=MTP)   # before any rank starts



def test_the_memory_plan_counts_the_mtp_cache_as_allocated():
    """The target's GPU memory plan sizes the MTP layer's cache to the same blocks with ``mtp_cache_bytes``: the
    bytes the proposer's cache takes, per block."""
    from tripath.engine.runner.mtp_layer import mtp_cache_bytes

    llm = LLM(tiny_deepseek(), backend="torch", num_kv_blocks=24, block_size=8, speculative_config=MTP)
    cache = llm.scheduler.proposer.cache.kv_cache
    assert cache.shape[:2] == (24, 8)
    assert mtp_cache_bytes(llm.model, llm.config)(8) * 24 == cache.numel() * cache.element_size()
