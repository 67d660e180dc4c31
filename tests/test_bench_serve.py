"""`tripath bench serve` (offline): the workload generator, the per-request records of a pass, the
roofline floor, the step breakdown, and the command's JSON / CSV / plot output."""

import json

import pytest
import torch

from tripath.bench import serve, serve_rounds
from tripath.bench.serve_engine import run_pass
from tripath.bench.serve_floor import model_costs, roofline_floor_s
from tripath.bench.serve_workloads import WORKLOADS, Workload, make_prompts
from tripath.bench.gc_pauses import GarbageCollections, format_collections
from tripath.bench.step_breakdown import StepBreakdown, format_breakdown
from tripath.engine import LLM


def test_workload_prompts_are_seeded_spread_and_share_their_prefix():
    workload = Workload("tiny-llama", ("torch",), 50, 40, 0.5, 4, 8, prefix_share=0.25)
    prompts = make_prompts(workload, 256, seed=3)
    assert prompts == make_prompts(workload, 256, seed=3) and prompts != make_prompts(workload, 256, seed=4)
    assert len(prompts) == 50 and all(20 <= len(p) <= 60 for p in prompts)
    assert len({len(p) for p in prompts}) > 5  # lengths spread
    assert len({tuple(p[:10]) for p in prompts}) == 1 and len({tuple(p[10:]) for p in prompts}) == 50
    assert all(2 <= t < 256 for p in prompts for t in p)
    with pytest.raises(ValueError, match="input_len_spread"):
        Workload("tiny-llama", ("torch",), 1, 8, 1.5, 1, 1)
    assert WORKLOADS["mha-tp8"].max_model_len == 3072 + 512


@pytest.mark.parametrize("backend,decode_steps", [("torch", 1), ("three_path", 4)])
def test_a_pass_records_every_request(backend, decode_steps, monkeypatch):
    """Also with multi-step decoding (three_path, under the interpreter): one step() call then brings
    several tokens per request, and the floor's decode steps are still counted one per model step."""
    monkeypatch.setenv("TRITON_INTERPRET", "1" if backend == "three_path" else "0")
    llm = LLM("tiny-llama", backend=backend, max_num_seqs=3, max_num_batched_tokens=32, num_kv_blocks=64,
              dtype=torch.float32, decode_steps=decode_steps)
    prompts = make_prompts(Workload("tiny-llama", ("torch",), 7, 24, 0.5, 5, 3), 256, seed=0)
    outcome = run_pass(llm, prompts, output_len=5, max_concurrency=3, progress=False)
    assert len(outcome.records) == 7 and outcome.compiled == 0 and outcome.num_steps > 0
    for record, prompt in zip(outcome.records, prompts):
        assert record.prompt_tokens == len(prompt) and record.output_tokens == 5
        assert 0 < record.ttft_s <= record.e2e_s and len(record.itl_s) == 4
    assert all(0 < n <= 3 for n, _ in outcome.decode_steps)  # never more than max_concurrency in flight
    # decodes read their whole context: prompt + outputs so far, summed over the step's requests
    assert sum(kv for _, kv in outcome.decode_steps) == sum(len(p) * 4 + 1 + 2 + 3 + 4 for p in prompts)
    assert sum(n for n, _ in outcome.decode_steps) == 7 * 4  # one decode per output token after the first
    assert (outcome.num_steps < len(outcome.decode_steps)) == (decode_steps > 1)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_step_breakdown_counts_every_launch_by_kind(overlap):
    llm = LLM("tiny-llama", backend="torch", max_num_seqs=3, max_num_batched_tokens=32, num_kv_blocks=64,
              async_scheduling=overlap)
    prompts = make_prompts(Workload("tiny-llama", ("torch",), 6, 40, 0.5, 4, 3), 256, seed=1)
    timer = StepBreakdown(llm).attach()
    outcome = run_pass(llm, prompts, output_len=4, max_concurrency=3, progress=False)
    timer.detach()
    summary = timer.summary()
    assert sum(s["steps"] for s in summary.values()) == outcome.num_steps
    launched_tokens = sum(s["steps"] * s["tokens"] for s in summary.values())
    assert launched_tokens == pytest.approx(sum(len(p) + 3 for p in prompts))  # every prompt token, 3 decodes
    assert {"prompt", "decode (eager)"} <= set(summary) <= {"prompt", "mixed", "decode (eager)"}  # CPU: no graphs
    assert summary["decode (eager)"]["tokens"] <= 3
    assert all(s["host_ms"] > 0 and s["gpu_span_ms"] is None for s in summary.values())
    for s in summary.values():   # the host time's phases: each measured, together the whole
        assert s["inputs_ms"] > 0 and s["sample_ms"] > 0 and s["forward_ms"] > 0
        assert s["inputs_ms"] + s["sample_ms"] + s["forward_ms"] == pytest.approx(s["host_ms"])
    runner = type(llm.runner)
    assert (llm.runner.launch.__func__, llm.runner.prepare.__func__, llm.runner._sample.__func__) == \
        (runner.launch, runner.prepare, runner._sample)  # detached
    assert "decode (eager)" in format_breakdown("torch", summary)


def test_roofline_floor_counts_prefill_flops_and_decode_bytes():
    costs = {"active_params": 1000, "head_params": 500, "weight_bytes": 4000, "kv_bytes_per_token": 8,
             "attention_flops_per_pair": 3}
    prompts = [[1] * 4, [1] * 2]
    flops = 2 * 1000 * 6 + 2 * 500 * 2 + 3 * (4 * 5 / 2 + 2 * 3 / 2)  # the LM head once per prompt
    decode_bytes = (4000 + 8 * 10) + (4000 + 8 * 6)
    floor = roofline_floor_s(costs, prompts, [(2, 10), (1, 6)], matmul_flops=1e6, copy_bytes_per_s=1e5)
    assert floor == pytest.approx(flops / 1e6 + decode_bytes / 1e5)


def test_the_warm_pass_is_the_median_of_the_passes_after_the_first():
    def pass_of(elapsed):
        return {"elapsed_s": elapsed, "output_throughput": 1 / elapsed, "total_throughput": 2 / elapsed,
                "ttft_s": {}, "tpot_s": {}, "itl_s": {}, "e2e_s": {}, "compiled_after_start": 0}
    result = {"backend": "b", "start_s": 1.0, "passes": [pass_of(9.0), pass_of(3.0), pass_of(1.0), pass_of(2.0)]}
    row, = serve_rounds.rows_of([result], "w")
    assert row["first_pass_s"] == 9.0 and row["warm_pass_s"] == 2.0 and row["output_throughput"] == 0.5
    assert row["warm_passes_s"] == [3.0, 1.0, 2.0]
    row, = serve_rounds.rows_of([{**result, "passes": result["passes"][:2]}], "w")
    assert row["warm_pass_s"] == 3.0 and row["warm_passes_s"] == [3.0]
    row, = serve_rounds.rows_of([{**result, "passes": result["passes"][:1]}], "w")  # one pass: it is both
    assert row["first_pass_s"] == row["warm_pass_s"] == 9.0 and row["warm_passes_s"] == []


def test_rounds_report_the_median_round_with_the_first_rounds_starts():
    def result_of(warm, start, compiled=0):
        passes = [{"elapsed_s": 9.0, "compiled_after_start": compiled}, {"elapsed_s": warm, "compiled_after_start": 0}]
        return {"backend": "b", "start_s": start, "warm_start_s": start / 2, "passes": passes, "round": warm}
    merged = serve_rounds.merge_rounds([result_of(3.0, 20.0), result_of(1.0, 6.0, compiled=2), result_of(2.0, 5.0)])
    assert merged["round"] == 2.0 and merged["round_warm_passes_s"] == [3.0, 1.0, 2.0]
    assert (merged["start_s"], merged["warm_start_s"]) == (20.0, 10.0) and merged["compiled_in_rounds"] == 2
    assert serve_rounds.merge_rounds([result_of(3.0, 20.0), result_of(1.0, 6.0)])["round"] == 3.0  # the slower middle
    single = result_of(3.0, 20.0)
    assert serve_rounds.merge_rounds([single]) is single
    failed = {"backend": "b", "error": "the benchmark process exited with 1"}
    assert serve_rounds.merge_rounds([single, failed]) is failed
    line = serve_rounds.round_line({**result_of(3.0, 20.0, compiled=1), "passes": [
        {"elapsed_s": 9.0, "compiled_after_start": 1}, {"elapsed_s": 3.0, "compiled_after_start": 0, "floor_fraction": 0.5}]})
    assert line == "   b: start 20.0 s (10.0 s on the warm cache); passes 9.000 / 3.000 s; warm pass 50.0% of the floor; " \
                   "1 compiled after start"   # printed as each round ends
    assert serve_rounds.round_line(failed) == "   b: the benchmark process exited with 1"
    phases = {"plan_memory": 1.04, "warm_up": 15.0}
    assert serve_rounds.round_line({**result_of(3.0, 20.0), "passes": [], "start_phases": phases}) == \
        "   b: start 20.0 s (plan_memory 1.0 s, warm_up 15.0 s; 10.0 s on the warm cache)"
    assert serve_rounds.merge_rounds([{**result_of(3.0, 20.0), "start_phases": phases}, result_of(1.0, 6.0),
                                      result_of(2.0, 5.0)])["start_phases"] == phases   # the first round's
    row = {"backend": "b", "first_pass_s": 0.7, "warm_passes_s": [0.5], "round_warm_passes_s": [0.5, 0.55]}
    assert serve_rounds.format_passes(row).endswith("; warm pass of each round 0.500 / 0.550 s (within 10.0%; "
                                             "reported: the median round)")


def test_model_costs_leave_out_the_embedding_and_count_active_experts():
    llm = LLM("tiny-qwen3-moe", backend="torch", num_kv_blocks=16)
    model, config = llm.model, llm.model.config
    costs = model_costs(model, llm.runner.backend)
    embed = model.model.embed_tokens.weight.numel()
    head = model.lm_head.weight.numel()
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts > 0 and costs["params"] == params - embed - head and costs["head_params"] == head
    assert costs["active_params"] == pytest.approx(params - embed - head
                                                   - experts * (1 - config.moe.top_k / config.moe.num_experts))
    assert costs["weight_bytes"] == (params - embed) * 4  # float32 on the CPU; the untied LM head included
    spec = llm.runner.spec
    assert costs["kv_bytes_per_token"] == config.num_layers * spec.num_kv_heads * 2 * spec.head_size * 4
    assert costs["attention_flops_per_pair"] == 2 * spec.num_heads * 2 * spec.head_size * config.num_layers


def test_model_costs_of_a_tied_head():
    llm = LLM("tiny-qwen2", backend="torch", num_kv_blocks=16)
    model = llm.model
    assert model.lm_head is None
    costs = model_costs(model, llm.runner.backend)
    embed = model.model.embed_tokens.weight.numel()
    params = sum(p.numel() for p in model.parameters())
    assert costs["head_params"] == embed and costs["params"] == params - embed
    assert costs["weight_bytes"] == params * 4  # the tied table is read once per step, as the LM head


def test_the_command_writes_json_csv_and_a_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "r.json"
    code = serve.main_serve(["--workload", "tiny", "--backends", "torch", "--num-requests", "2", "--output-len",
                             "3", "--no-progress", "--json", str(out), "--csv", str(tmp_path / "r.csv"),
                             "--plot", str(tmp_path / "r.png"), "--no-async-scheduling", "--step-breakdown",
                             "--rounds", "2", "--skinny-gemms", "off"])
    assert code == 0
    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert result["skinny_gemms"] == "off" and result["gemm_routes"] == 0
    assert result["backend"] == "torch" and len(result["passes"]) == 2 and result["warm_start_s"] > 0
    assert list(result["start_phases"]) == ["plan_memory", "allocate_kv_cache", "warm_up", "capture_graphs"]
    assert len(result["round_warm_passes_s"]) == 2 and result["compiled_in_rounds"] == 0
    assert result["async_scheduling"] is False and report["rows"][0]["backend"] == "torch (sequential)"
    assert sum(s["steps"] for s in result["step_breakdown"].values()) == result["passes"][-1]["num_steps"]
    for p in result["passes"]:
        assert p["num_requests"] == 2 and p["total_output_tokens"] == 6 and p["compiled_after_start"] == 0
        assert set(p["ttft_s"]) == {"mean", "p50", "p90", "p99"} and p["ttft_s"]["p50"] > 0
        assert set(p["gc"]) == {"collections", "pause_s", "max_pause_s", "oldest_collections", "oldest_pause_s"}
    header = (tmp_path / "r.csv").read_text().splitlines()[0]
    assert "ttft_s.p99" in header and "warm_pass_gc.oldest_pause_s" in header
    assert (tmp_path / "r.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "torch" in printed and "garbage collection, first pass" in printed
    assert "torch (sequential): passes " in printed and ", then " in printed and "warm pass of each round" in printed


def test_the_passes_line_shows_every_pass_and_the_warm_spread():
    row = {"backend": "b", "first_pass_s": 0.7, "warm_passes_s": [0.5, 0.55, 0.52]}
    assert serve_rounds.format_passes(row) == ("b: passes 0.700 s, then 0.500 / 0.550 / 0.520 s "
                                        "(warm passes within 10.0% of each other)")
    assert serve_rounds.format_passes({"backend": "b", "first_pass_s": 0.7, "warm_passes_s": []}) == "b: passes 0.700 s"


def test_garbage_collections_are_counted_and_timed_by_generation():
    import gc

    with GarbageCollections() as collections:
        gc.collect(0)
        gc.collect()  # the oldest generation
    after = len(collections.pauses)
    gc.collect()  # outside the context: not counted
    summary = collections.summary()
    assert len(collections.pauses) == after and [g for g, _ in collections.pauses][-2:] == [0, 2]
    assert summary["collections"] >= 2 and summary["oldest_collections"] >= 1
    assert 0 < summary["oldest_pause_s"] <= summary["pause_s"] and summary["max_pause_s"] > 0
    line = format_collections("b", summary, GarbageCollections().summary())
    assert line.startswith("b: garbage collection, first pass") and "warm pass 0 collections, 0.0 ms" in line


@pytest.mark.parametrize("flag", ["--passes", "--rounds"])
def test_counts_below_one_are_refused_by_name(flag):
    with pytest.raises(SystemExit, match=f"{flag} must be >= 1"):
        serve.main_serve(["--workload", "tiny", flag, "0"])


def test_logprobs_fraction_marks_requests_evenly_and_reaches_the_engine():
    import dataclasses

    from tripath.bench.serve import build_parser
    from tripath.bench.serve_workloads import workload_from_args
    from tripath.bench.serve_engine import run_pass
    from tripath.bench.serve_workloads import WORKLOADS, make_prompts
    from tripath.engine import LLM

    w = dataclasses.replace(WORKLOADS["tiny"], logprobs=2, logprobs_fraction=0.25)
    assert [i for i in range(8) if w.asks_logprobs(i)] == [3, 7]
    args = build_parser().parse_args(["--workload", "tiny", "--logprobs", "3"])
    assert workload_from_args(args).logprobs_fraction == 1.0
    with pytest.raises(ValueError, match="logprobs"):
        dataclasses.replace(WORKLOADS["tiny"], logprobs_fraction=0.5)
    llm = LLM("tiny-llama", backend="torch", num_kv_blocks=64)
    seen = []
    real = llm.add_request
    llm.add_request = lambda prompt, params: seen.append(params.logprobs) or real(prompt, params)
    run_pass(llm, make_prompts(w, llm.model.config.vocab_size, 0), 4, 4, progress=False, workload=w)
    assert sorted(seen, key=lambda x: x is None) == [2, 2] + [None] * 6
