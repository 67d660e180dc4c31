"""``tripath bench speculative`` on a tiny preset: the oracle's acceptance is what it is set to, greedy outputs
stay the recorded ones, and the table and the JSON carry every row."""

import json
from types import SimpleNamespace

import pytest

from tripath.bench.speculative import main
from tripath.engine.speculative.oracle import OracleProposer


def test_oracle_drafts_the_recorded_run_corrupted_at_the_set_rate():
    run = list(range(10, 40))
    request = SimpleNamespace(prompt_token_ids=[1, 2, 3], num_output_tokens=5)
    assert OracleProposer({(1, 2, 3): run}, 1.0, 50).propose_one(request, 4) == [15, 16, 17, 18]
    assert all(a != b for a, b in zip(OracleProposer({(1, 2, 3): run}, 0.0, 50).propose_one(request, 4), run[5:9]))
    half = OracleProposer({(1, 2, 3): run}, 0.5, 50, seed=1)
    kept = sum(half.propose_one(request, 4) == run[5:9] for _ in range(2000))   # all four kept: 1/16
    assert 80 < kept < 170
    assert OracleProposer({(1, 2, 3): run}, 1.0, 50).propose_one(SimpleNamespace(prompt_token_ids=[9],
                                                                             num_output_tokens=0), 4) == []
    with pytest.raises(ValueError, match="p must be in"):
        OracleProposer({}, 1.5, 50)


def test_bench_speculative_reports_acceptance_against_the_baseline(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    out = tmp_path / "spec.json"
    assert main(["--model", "tiny-llama", "--batch-sizes", "1,3", "--input-len", "12", "--output-len", "10",
                 "--acceptance", "0,1", "--num-speculative-tokens", "3", "--num-kv-blocks", "64", "--device",
                 "cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["p"]) for r in rows] == [(1, 0.0), (1, 1.0), (3, 0.0), (3, 1.0)]
    for r in rows:
        assert r["same_outputs"] == 1.0 and r["reference_same_as_baseline"] == 1.0
        assert r["acceptance"] == r["p"]
        assert r["tpot_ms"] > 0 and r["baseline_tpot_ms"] > 0
    assert all(r["tokens_per_verify"] > 3 for r in rows if r["p"] == 1.0)
    assert "tok/verify" in capsys.readouterr().out


def test_bench_speculative_runs_the_mtp_layer_under_the_oracles_drafts(monkeypatch, tmp_path):
    """``--method mtp``: the MTP layer drafts (and is timed), the oracle's tokens are proposed, so the acceptance
    is still the oracle's."""
    from tripath.engine.drafters.mtp import MTPProposer

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    drafted = []
    propose = MTPProposer.propose
    monkeypatch.setattr(MTPProposer, "propose", lambda self, items: drafted.append(len(items)) or propose(self, items))
    out = tmp_path / "mtp.json"
    assert main(["--model", "tiny-deepseek", "--method", "mtp", "--batch-sizes", "2", "--input-len", "9",
                 "--output-len", "8", "--acceptance", "0,1", "--num-speculative-tokens", "2", "--num-kv-blocks",
                 "64", "--device", "cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["acceptance"] for r in rows] == [0.0, 1.0] and all(r["same_outputs"] == 1.0 for r in rows)
    assert drafted


def test_bench_speculative_with_adaptive_draft_lengths_drafts_less_where_nothing_is_kept(monkeypatch, tmp_path):
    """``--acceptance-threshold``: at p = 0 each request soon stops drafting (the rows' ``draft_tokens``), at p = 1
    it drafts as the fixed length does; outputs stay the recorded ones."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    common = ["--model", "tiny-llama", "--batch-sizes", "2", "--input-len", "12", "--output-len", "30",
              "--acceptance", "0,1", "--num-speculative-tokens", "4", "--num-kv-blocks", "64", "--device", "cpu"]
    drafted = {}
    for threshold in ("0", "0.4"):
        out = tmp_path / f"spec-{threshold}.json"
        assert main(common + ["--acceptance-threshold", threshold, "--json", str(out)]) == 0
        rows = json.loads(out.read_text())["rows"]
        assert all(r["same_outputs"] == 1.0 for r in rows)
        drafted[threshold] = [r["draft_tokens"] for r in rows]
    assert drafted["0.4"][0] < 0.5 * drafted["0"][0] and drafted["0.4"][1] == drafted["0"][1] > 0


def test_the_oracle_replays_the_speculating_engines_own_greedy_run(monkeypatch, tmp_path):
    """Where the baseline's greedy tokens differ from the speculating engine's (a near-tie broken the other way
    by the verify's kernels; emulated by changing the baseline's record), the oracle replays the speculating
    engine's reference run: acceptance is still the set one, outputs equal the reference, and the rows tell
    that the reference differs from the baseline."""
    import tripath.bench.speculative as bench

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    run = bench._run
    calls = []

    def baseline_then_speculation(llm, prompts, output_len):
        outputs, measured = run(llm, prompts, output_len)
        calls.append(len(prompts))
        if len(calls) == 1:   # the baseline's record: request 0 turns at its third token
            outputs[0] = outputs[0][:2] + [(t + 1) % 256 for t in outputs[0][2:]]
        return outputs, measured

    monkeypatch.setattr(bench, "_run", baseline_then_speculation)
    out = tmp_path / "spec.json"
    assert main(["--model", "tiny-llama", "--batch-sizes", "2", "--input-len", "12", "--output-len", "10",
                 "--acceptance", "1", "--num-speculative-tokens", "3", "--num-kv-blocks", "64", "--device",
                 "cpu", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["same_outputs"] == 1.0 and row["acceptance"] == 1.0 and row["reference_same_as_baseline"] == 0.5


def test_counting_weights_make_the_greedy_run_count_up_from_the_prompt():
    """:func:`count_up` on a preset's random weights: every request's greedy tokens follow its last prompt token
    one by one (wrapping at the vocabulary), whatever the batch; a tied LM head is refused."""
    from tripath.bench.speculative import count_up
    from tripath.engine import LLM, SamplingParams

    with LLM("tiny-llama", device="cpu", num_kv_blocks=64) as llm:
        count_up(llm.model)
        prompts = [[5, 9, 17], [3, 254], [40, 41, 42, 43, 100]]
        outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)
        assert [o.output_token_ids for o in outputs] == [[(p[-1] + i) % 256 for i in range(1, 7)] for p in prompts]
    with LLM("tiny-qwen2", device="cpu", num_kv_blocks=16) as llm, pytest.raises(ValueError, match="ties them"):
        count_up(llm.model)


def test_bench_speculative_counts_on_presets_unless_told(monkeypatch, tmp_path, capsys):
    """The default weights of a preset count, so the baseline's outputs are its prompts' continuations; ``--weights
    random`` keeps the preset's own, and ``counting`` on a model directory is refused."""
    import tripath.bench.speculative as bench

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    recorded = []
    run = bench._run

    def record(llm, prompts, output_len):
        outputs, measured = run(llm, prompts, output_len)
        recorded.append((prompts, outputs))
        return outputs, measured

    monkeypatch.setattr(bench, "_run", record)
    common = ["--model", "tiny-llama", "--batch-sizes", "2", "--input-len", "12", "--output-len", "5",
              "--acceptance", "1", "--num-speculative-tokens", "2", "--num-kv-blocks", "64", "--device", "cpu"]
    assert main(common) == 0
    prompts, outputs = recorded[0]
    assert outputs == [[(p[-1] + i) % 256 for i in range(1, 6)] for p in prompts]
    assert "counting weights" in capsys.readouterr().out
    recorded.clear()
    assert main(common + ["--weights", "random"]) == 0
    prompts, outputs = recorded[0]
    assert outputs != [[(p[-1] + i) % 256 for i in range(1, 6)] for p in prompts]
    assert "counting" not in capsys.readouterr().out
    with pytest.raises(ValueError, match="not a preset"):
        main(common[:1] + [str(tmp_path)] + common[2:] + ["--weights", "counting"])


def test_bench_speculative_counts_the_measured_runs_drafts_only(monkeypatch, tmp_path):
    """A row's drafts, acceptance and tokens per verify are the measured run's, not the warm run's before it: with
    adaptive lengths at p = 0 the warm run starts from an all-kept prior and drafts ``k`` at first, the measured
    one starts from the engine's recent verifies (all rejected) and drafts at most its probes of one token (none
    or one a request in 30 tokens, where the warm run drafted 4 at once first)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    out = tmp_path / "spec.json"
    assert main(["--model", "tiny-llama", "--batch-sizes", "2", "--input-len", "12", "--output-len", "30",
                 "--acceptance", "0", "--num-speculative-tokens", "4", "--acceptance-threshold", "0.4",
                 "--num-kv-blocks", "64", "--device", "cpu", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["draft_tokens"] <= 4 and row["tokens_per_verify"] == 1.0 and row["acceptance"] == 0.0
