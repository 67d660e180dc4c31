"""Every architecture against Hugging Face transformers (CPU, fp32, the torch attention backend): a tiny random
HF model is saved to a temporary directory, loaded by tripath, and both are compared on a prefill, a mixed
step (decode + extend + prefill in one batch) and greedy continuations token by token."""

import json
import math

import pytest
import torch

from model_steps import PagedRunner, hf_logits, randomize_hf_weights
from tripath.models import load_model


@pytest.fixture(autouse=True)
def _validate_every_step(monkeypatch):
    """TRIPATH_VALIDATE=1: every step's metadata goes through tripath.attention.validate (and the ops check
    their index values), so each engine step here also proves the engine builds valid indices."""
    monkeypatch.setenv("TRIPATH_VALIDATE", "1")


transformers = pytest.importorskip("transformers")

TOL = dict(atol=2e-4, rtol=1e-4)
COMMON = dict(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
              max_position_embeddings=256, bos_token_id=0, eos_token_id=1)
MLA = dict(kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, num_attention_heads=4,
           n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1)


def llama():
    rope = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=32)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, mlp_bias=True, rope_parameters=rope))


def mistral(**extra):
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=1, sliding_window=8, **extra))


def qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))


def qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=64, attention_bias=True))


def qwen3_moe():
    """Experts in layers 0 and 2 (``decoder_sparse_step`` 1, layer 1 dense), renormalised top-2 of 8."""
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **{**COMMON, "num_hidden_layers": 3}, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
        mlp_only_layers=[1], norm_topk_prob=True))


def deepseek_v2(**extra):
    cfg = transformers.DeepseekV2Config(
        **{**COMMON, "num_hidden_layers": 3}, **{**MLA, "num_experts_per_tok": 3}, q_lora_rank=None,
        n_shared_experts=2, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
        **extra)
    return transformers.DeepseekV2ForCausalLM(cfg)


def deepseek_v3(rope_interleave=True, yarn=True):
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8) if yarn else None
    cfg = transformers.DeepseekV3Config(
        **{**COMMON, "num_hidden_layers": 3}, **MLA, q_lora_rank=48, n_shared_experts=1, n_group=2, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=rope_interleave, rope_parameters=rope)
    return transformers.DeepseekV3ForCausalLM(cfg)


def _save(hf_model, path, seed=0):
    randomize_hf_weights(hf_model, seed)
    hf_model.eval()
    hf_model.save_pretrained(path)
    return hf_model


def compare_steps(hf_model, model, *, block_size=4, decode_steps=3, device="cpu"):
    """Prefill (A whole, B's first 5 tokens) → mixed step (A decode, B extend, C prefill) → greedy decodes.
    ``device``: where tripath's model runs (the transformers model stays on the CPU)."""
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    seqs = {"A": torch.randint(2, vocab, (11,), generator=g).tolist(),
            "B": torch.randint(2, vocab, (9,), generator=g).tolist(),
            "C": torch.randint(2, vocab, (6,), generator=g).tolist()}
    runner = PagedRunner(model, block_size=block_size, device=device)

    def check(out, known):
        for rid, logits in out.items():
            logits = logits.cpu()
            want = hf_logits(hf_model, known[rid])[-logits.shape[0]:]
            torch.testing.assert_close(logits, want, **TOL)

    known = {"A": seqs["A"], "B": seqs["B"][:5]}
    out = runner.step({"A": seqs["A"], "B": seqs["B"][:5]})
    check(out, known)
    known["A"] = known["A"] + [int(out["A"][-1].argmax())]
    step = {"A": known["A"][-1:], "B": seqs["B"][5:], "C": seqs["C"]}
    known["B"], known["C"] = seqs["B"], seqs["C"]
    out = runner.step(step)
    plan = runner.last_plan
    assert (plan.num_decodes, plan.num_extends, plan.num_prefills) == (1, 1, 1)
    check(out, known)
    for _ in range(decode_steps):
        step = {}
        for rid in known:
            token = int(hf_logits(hf_model, known[rid])[-1].argmax())
            assert int(out[rid][-1].argmax()) == token, f"request {rid}: greedy token differs from transformers"
            known[rid] = known[rid] + [token]
            step[rid] = [token]
        out = runner.step(step)
        assert runner.last_plan.is_decode_only
        check(out, known)


@pytest.mark.parametrize("make", [llama, mistral, qwen2, qwen3, qwen3_moe, deepseek_v2, deepseek_v3,
                                  lambda: deepseek_v3(rope_interleave=False), lambda: deepseek_v2(mlp_bias=True),
                                  lambda: mistral(mlp_bias=True)],
                         ids=["llama3", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3",
                              "deepseek_v3_neox", "deepseek_v2_mlp_bias", "mistral_ignores_mlp_bias"])
def test_matches_transformers(make, tmp_path):
    """``mlp_bias``: DeepSeek V2's dense MLP and shared experts take it (as Llama's MLP does); Mistral's MLP
    has no bias whatever its config says."""
    hf_model = _save(make(), tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32)
    assert model.config.architecture == type(hf_model).__name__
    compare_steps(hf_model, model)


@pytest.mark.gpu
@pytest.mark.parametrize("make", [llama, qwen3, deepseek_v3], ids=["llama3", "qwen3", "deepseek_v3"])
def test_matches_transformers_on_gpu(make, tmp_path):
    """On a GPU the layers run their fused kernels (RMSNorm with the residual add, in-place rotary): fp32,
    the torch attention backend, against transformers on the CPU."""
    hf_model = _save(make(), tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32, device="cuda")
    compare_steps(hf_model, model, device="cuda")


def test_qwen3_moe_layers_follow_the_config(tmp_path):
    _save(qwen3_moe(), tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["MoE", "MLP", "MoE"]
    assert model.model.layers[0].mlp.shared_experts is None and model.config.moe.norm_topk_prob


def test_mistral_window_is_used(tmp_path):
    """The sliding window reaches the attention spec (a window of 8 over 11+ tokens changes the logits)."""
    hf_model = _save(mistral(), tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32)
    assert model.attention_spec().window_left == 7
    tokens = list(range(2, 16))
    windowed = PagedRunner(model).step({"A": tokens})["A"]
    torch.testing.assert_close(windowed, hf_logits(hf_model, tokens), **TOL)
    config = json.loads((tmp_path / "config.json").read_text())
    config["sliding_window"] = None
    (tmp_path / "config.json").write_text(json.dumps(config))
    unwindowed = PagedRunner(load_model(str(tmp_path), dtype=torch.float32)).step({"A": tokens})["A"]
    assert (unwindowed[-1] - windowed[-1]).abs().max() > 1e-2


def test_qwen2_window_on_some_layers(tmp_path):
    """``use_sliding_window`` with ``max_window_layers=1``: layer 0 attends to everything, layer 1 to a
    window of 8 (per-layer windows through ``ctx.attend(..., window_left=...)``), as in transformers."""
    hf_model = _save(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
        max_window_layers=1)), tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32)
    assert model.config.window_layers == (1,) and model.attention_spec().window_left == 7
    assert [layer.self_attn.window_left for layer in model.model.layers] == [-1, 7]
    compare_steps(hf_model, model)
    tokens = list(range(2, 18))
    torch.testing.assert_close(PagedRunner(model).step({"A": tokens})["A"], hf_logits(hf_model, tokens), **TOL)


def test_deepseek_yarn_scale_and_mscale(tmp_path):
    """sm_scale = mscale(factor, mscale_all_dim)² / sqrt(P + R); the rotary tables carry
    mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    _save(deepseek_v3(), tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32)
    m_all = 0.1 * 0.8 * math.log(4.0) + 1
    assert model.attention_spec().sm_scale == pytest.approx(m_all ** 2 / math.sqrt(64))
    rotary = model.model.layers[0].self_attn.weights.rotary
    radius = (rotary.cos ** 2 + rotary.sin ** 2).sqrt()
    torch.testing.assert_close(radius, torch.full_like(radius, (0.1 * math.log(4.0) + 1) / m_all))


def _kimi_nope_checkpoint(tmp_path):
    hf_model = _save(deepseek_v3(yarn=False), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["mla_use_nope"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    return hf_model


def test_kimi_nope_matches_transformers_without_rotation(tmp_path, monkeypatch):
    """Kimi-style NoPE MLA = DeepSeek V3 with the rotation removed: transformers with its rotary function
    replaced by the identity is the reference; the same weights with RoPE give different logits."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    hf_model = _kimi_nope_checkpoint(tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32)
    assert model.config.rope is None and not model.config.mla.rope
    assert model.model.layers[0].self_attn.weights.rotary is None
    tokens = list(range(5, 20))
    roped = hf_logits(hf_model, tokens)
    monkeypatch.setattr(modeling_deepseek_v3, "apply_rotary_pos_emb_interleave", lambda q, k, cos, sin, **kw: (q, k))
    compare_steps(hf_model, model, decode_steps=2)
    nope = PagedRunner(model).step({"A": tokens})["A"]
    assert (nope - roped).abs().max() > 1e-2


def _rmsnorm64(x, weight, eps):
    return weight.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _gptj_rope64(x, positions, theta):
    """GPT-J (interleaved pairs) rotation in fp64, frequencies computed here from theta."""
    dim = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angle = positions.double()[:, None] * inv_freq[None]
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)


@pytest.mark.parametrize("preset", ["tiny-kimi-nope", "tiny-deepseek-v2"])
def test_mla_layer_matches_fp64_non_absorbed(preset):
    """One MLA attention layer (through the torch backend and the paged cache, over two steps) against an
    explicit non-absorbed fp64 computation from the layer's own projection weights."""
    model = load_model(preset, dtype=torch.float32, seed=3)
    with torch.no_grad():  # make the latent and the rotary part matter
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.post_load()
    attn, cfg = model.model.layers[0].self_attn, model.config
    mla, heads = cfg.mla, cfg.num_heads
    x = torch.randn(13, cfg.hidden_size)
    runner = PagedRunner(model, block_size=4)
    outs = []
    for chunk, rid_tokens in ((x[:9], [0] * 9), (x[9:], [0] * 4)):
        _, positions, ctx, _ = runner.prepare({"A": rid_tokens})
        with torch.no_grad():
            outs.append(attn(chunk, positions, ctx))
    got = torch.cat(outs).double()

    w = {n: p.double() for n, p in attn.named_parameters()}
    xd = x.double()
    q = xd @ w["q_proj.weight"].T if "q_proj.weight" in w else \
        _rmsnorm64(xd @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"], cfg.rms_norm_eps) @ w["q_b_proj.weight"].T
    q = q.view(13, heads, -1)
    q_nope, q_pe = q[..., :mla.qk_nope_head_dim], q[..., mla.qk_nope_head_dim:]
    kv = xd @ w["kv_a_proj_with_mqa.weight"].T
    kv_c = _rmsnorm64(kv[:, :mla.kv_lora_rank], w["kv_a_layernorm.weight"], cfg.rms_norm_eps)
    k_pe = kv[:, None, mla.kv_lora_rank:]
    positions = torch.arange(13)
    if cfg.rope is not None:
        q_pe, k_pe = _gptj_rope64(q_pe, positions, cfg.rope.theta), _gptj_rope64(k_pe, positions, cfg.rope.theta)
    up = (kv_c @ w["kv_b_proj.weight"].T).view(13, heads, mla.qk_nope_head_dim + mla.v_head_dim)
    k = torch.cat([up[..., :mla.qk_nope_head_dim], k_pe.expand(-1, heads, -1)], -1)
    v = up[..., mla.qk_nope_head_dim:]
    scores = torch.einsum("qhd,khd->hqk", torch.cat([q_nope, q_pe], -1), k)
    scores = scores / math.sqrt(mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    scores = scores.masked_fill(torch.ones(13, 13, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khv->qhv", scores.softmax(-1), v).reshape(13, -1)
    want = o @ w["o_proj.weight"].T
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("preset, backend", [("tiny-llama", "three_path"), ("tiny-deepseek", "mla")])
def test_triton_backend_matches_torch_backend(preset, backend):
    """fp16 model through a Triton backend (the interpreter on CPU) against the torch backend: prefill, a mixed
    step with an extend, and a decode step."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(preset, dtype=torch.float16, device=device)
    fast, reference = PagedRunner(model, backend=backend, device=device), PagedRunner(model, device=device)
    steps = [{"A": list(range(3, 20)), "B": list(range(5, 12))},
             {"A": [7], "B": list(range(30, 40)), "C": list(range(9, 20))},
             {"A": [8], "B": [9], "C": [10]}]
    for step in steps:
        got, want = fast.step(step), reference.step(step)
        for rid in step:
            torch.testing.assert_close(got[rid], want[rid], atol=1e-2, rtol=1e-2)
