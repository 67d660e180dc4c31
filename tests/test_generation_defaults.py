"""Sampling defaults from ``generation_config.json`` (vLLM's ``--generation-config``): which fields count, the
``auto`` / ``vllm`` / folder sources, bad files named, and the engine's use of them."""

import dataclasses
import json

import pytest

from tripath.engine import LLM, SamplingParams
from tripath.engine.sampling.generation_defaults import load_generation_defaults, usable_defaults


def _write(folder, config) -> str:
    (folder / "generation_config.json").write_text(json.dumps(config))
    return str(folder)


def test_sampling_fields_are_taken_and_transformers_defaults_skipped(tmp_path):
    folder = _write(tmp_path, {"temperature": 0.6, "top_p": 0.95, "top_k": 50, "repetition_penalty": 1.0,
                               "min_p": 0.0, "max_new_tokens": 512, "do_sample": False, "eos_token_id": [1, 2]})
    assert load_generation_defaults(folder) == {"temperature": 0.6, "top_p": 0.95, "min_p": 0.0, "max_tokens": 512}
    assert load_generation_defaults(folder, "vllm") == {}
    assert load_generation_defaults(None) == {} and load_generation_defaults(str(tmp_path / "none")) == {}
    other = tmp_path / "other"
    other.mkdir()
    assert load_generation_defaults(folder, _write(other, {"top_k": 20})) == {"top_k": 20}
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    defaults = {"temperature": 0.6, "min_p": 0.1, "repetition_penalty": 1.2}
    assert usable_defaults(defaults) == {k: v for k, v in defaults.items() if k in fields}
    assert usable_defaults(defaults)["min_p"] == 0.1
    assert "no_such_field" not in usable_defaults({**defaults, "no_such_field": 1})


def test_bad_sources_and_values_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="generation_config '.*missing' is not a folder"):
        load_generation_defaults(None, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="holds no generation_config.json"):
        load_generation_defaults(None, str(tmp_path))
    with pytest.raises(ValueError, match="generation_config.json: top_k must be an integer, got 2.5"):
        load_generation_defaults(_write(tmp_path, {"top_k": 2.5}))
    with pytest.raises(ValueError, match="temperature must be a number, got 'hot'"):
        load_generation_defaults(_write(tmp_path, {"temperature": "hot"}))
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid JSON file"):
        load_generation_defaults(str(tmp_path))
    with pytest.raises(TypeError, match="generation_config must be 'auto', 'vllm' or a folder"):
        LLM("tiny-llama", backend="torch", num_kv_blocks=8, generation_config="")


def test_the_engine_uses_them_for_requests_without_parameters(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    folder = _write(tmp_path, {"temperature": 0, "max_new_tokens": 3})
    llm = LLM("tiny-llama", backend="torch", num_kv_blocks=16, generation_config=folder)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0, max_tokens=3)
    out = llm.generate([[5, 6, 7]], use_tqdm=False)[0]
    assert out.output_token_ids == llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3),
                                                use_tqdm=False)[0].output_token_ids
    assert len(out.output_token_ids) <= 3
    plain = LLM("tiny-llama", backend="torch", num_kv_blocks=16, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams() and plain.generation_defaults == {}
    with pytest.raises(ValueError, match="top_p must be in"):
        LLM("tiny-llama", backend="torch", num_kv_blocks=16, generation_config=_write(tmp_path, {"top_p": 0}))
