"""fp8 KV-cache scale calibration: scales from the data keep large keys and values from saturating."""

import math

import pytest
import torch

from conftest import DEVICE
from helpers import FP8_TOL
from tripath.attention import AttentionSpec, ForwardContext, MLASpec, select_backend
from tripath.attention.calibration import calibrate_kv_scales, calibrate_mla_scale
from tripath.engine import LLM, EngineConfig, SamplingParams
from tripath.models import load_model
from tripath.ops import reference as R
from tripath.platform import fp8_dtype, fp8_max


@pytest.fixture(autouse=True)
def _validate_every_step(monkeypatch):
    """TRIPATH_VALIDATE=1: every step's metadata goes through tripath.attention.validate (and the ops check
    their index values), so each engine step here also proves the engine builds valid indices."""
    monkeypatch.setenv("TRIPATH_VALIDATE", "1")


FP8 = fp8_dtype()


def _decode_after_large_prefill(calibrate: bool, magnitude: float = 3000.0):
    """A prefill of 37 tokens (calibrating or not) writes an fp8 cache with keys and values up to
    ``magnitude`` (beyond e4m3's ±448); a decode step then reads all 38 rows back. Returns the decode
    output, the float reference and the cache."""
    spec = AttentionSpec(4, 2, 64, dtype=torch.float32, kv_cache_dtype="fp8")
    backend = select_backend(spec, "torch", DEVICE)
    cache = backend.allocate_cache(8, DEVICE)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(38, 4, 64, generator=gen).to(DEVICE)
    k = (torch.rand(38, 2, 64, generator=gen) * 2 - 1).to(DEVICE) * magnitude
    v = (torch.rand(38, 2, 64, generator=gen) * 2 - 1).to(DEVICE) * magnitude
    q = q / magnitude  # keep the softmax soft, so the values' precision shows in the output
    block_table = torch.tensor([[3, 1, 5, 2]], dtype=torch.int32, device=DEVICE)
    pos = torch.arange(38, device=DEVICE)
    slots = block_table[0, pos // 16].long() * 16 + pos % 16
    for lo, hi, ctx_len, calib in ((0, 37, 0, calibrate), (37, 38, 37, False)):
        meta = backend.build_metadata(backend.plan([hi - lo], [ctx_len]), block_table, slots[lo:hi])
        out = ForwardContext(backend, meta, [cache], calibrate_kv_scales=calib).attend(0, q[lo:hi], k[lo:hi],
                                                                                        v[lo:hi])
    want = R.varlen_attention_ref(q[37:], k, v, torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
                                  torch.tensor([0, 38], dtype=torch.int32, device=DEVICE), causal=True)
    return out, want, cache


def test_calibrated_scales_keep_large_values():
    out, want, cache = _decode_after_large_prefill(calibrate=True)
    assert cache.k_scale.item() > 1.0 and cache.v_scale.item() > 1.0
    scale = want.abs().amax().item()
    torch.testing.assert_close(out / scale, want / scale, **FP8_TOL)


def test_without_calibration_large_values_saturate():
    out, want, cache = _decode_after_large_prefill(calibrate=False)
    assert cache.k_scale.item() == 1.0
    scale = want.abs().amax().item()
    assert (out - want).abs().amax().item() / scale > 0.1


def test_scales_are_amax_over_fp8_max():
    spec = AttentionSpec(4, 2, 64, dtype=torch.float32, kv_cache_dtype="fp8")
    cache = select_backend(spec, "torch", DEVICE).allocate_cache(4, DEVICE)
    k = torch.randn(9, 2, 64, device=DEVICE) * 900
    v = torch.zeros(9, 2, 64, device=DEVICE)
    calibrate_kv_scales(cache, k, v)
    assert cache.k_scale.item() == pytest.approx(k.abs().max().item() / fp8_max(FP8))
    assert cache.v_scale.item() > 0  # an all-zero step leaves a usable (tiny) scale
    plain = select_backend(AttentionSpec(4, 2, 64, dtype=torch.float32), "torch", DEVICE).allocate_cache(4, DEVICE)
    calibrate_kv_scales(plain, k, v)
    assert plain.k_scale.item() == 1.0  # not an fp8 cache: untouched


def test_mla_scale_counts_the_rotated_part_with_margin():
    spec = AttentionSpec(4, 1, 96, dtype=torch.float32, kv_cache_dtype="fp8",
                         mla=MLASpec(kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=32, v_head_dim=16))
    cache = select_backend(spec, "torch", DEVICE).allocate_cache(4, DEVICE)
    kv_c = torch.randn(5, 64, device=DEVICE)
    k_pe = torch.randn(5, 32, device=DEVICE) * 100
    calibrate_mla_scale(cache, kv_c, k_pe)
    assert cache.kv_scale.item() == pytest.approx(k_pe.abs().max().item() * math.sqrt(2) / fp8_max(FP8))


def test_engine_calibrates_once_on_its_first_step():
    model = load_model("tiny-llama", dtype=torch.float32, device="cpu")
    llm = LLM(model, backend="torch", kv_cache_dtype="fp8", calculate_kv_scales=True, num_kv_blocks=64)
    assert llm.runner.kv_scales_pending
    llm.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert not llm.runner.kv_scales_pending
    first = [(c.k_scale.item(), c.v_scale.item()) for c in llm.runner.caches]
    assert all(k != 1.0 and v != 1.0 for k, v in first)
    llm.generate([[40, 41] * 20], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert [(c.k_scale.item(), c.v_scale.item()) for c in llm.runner.caches] == first
    with pytest.raises(ValueError, match="calculate_kv_scales=True needs kv_cache_dtype='fp8'"):
        EngineConfig(calculate_kv_scales=True)
