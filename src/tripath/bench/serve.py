"""``tripath bench serve``: whole requests through the engine, per backend, against the roofline floor.

Offline mode (default): each backend runs in its own process, with an empty Triton cache unless
``--warm-cache``; the process builds the engine (timed: *engine start*, warm-up included), then runs the
workload ``--passes`` times (default 2) on fresh prompts of the same shapes (the *first pass*, then warm
passes, of which the median is reported as *the warm pass*), keeping at most ``--max-concurrency`` requests
in flight. A second process then times the engine start again on the now warm cache. With ``--rounds R``
the backends' processes run ``R`` times in turn (A B A B …; later rounds on each backend's now warm cache)
and the round of median warm pass is reported, with every round's warm pass: a host whose speed drifts
between processes (seen on the GPU machines: the same code 10–50% slower in one process's host work than
in the next) then weighs on every backend alike. Reported per backend:
both starts, the first and the warm pass's wall time (and every warm pass's, with how far apart they are:
:func:`format_passes`), output and total tok/s, TTFT / TPOT
/ ITL / end-to-end latency (mean, p50, p90, p99, :mod:`tripath.bench.serve_report`), kernel variants
compiled after the engine started, the first and the warm pass's garbage collections (count and pause,
the oldest generation's apart: :mod:`tripath.bench.gc_pauses`), and the warm pass's fraction of the
roofline floor::

    floor = prefill FLOPs / matmul rate + Σ over decode steps (weight bytes + KV bytes read) / copy bandwidth

Prefill FLOPs are 2 × active parameters (embedding table and LM head excluded) per prompt token, 2 × the LM
head's parameters once per prompt (logits are computed for a prompt's last token only), plus causal
attention (``2 · heads · (d_qk + d_v)`` per query-key pair and layer); a decode step reads every weight but the
embedding table (the LM head included) and the KV cache of each decoding request. The matmul rate and copy
bandwidth are measured in the same process (an 8192³ bf16 matmul, a 1 GiB device-to-device copy).

``--url`` switches to the online mode against a running ``tripath serve`` (:mod:`tripath.bench.serve_online`).
Built-in workloads (``--workload``): see :data:`WORKLOADS`; explicit options override their fields.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Sequence

from tripath import _env
from tripath.bench.gc_pauses import GarbageCollections, format_collections
from tripath.bench.serve_report import RequestRecord, format_table, summarize, write_csv, write_json
from tripath.bench.step_breakdown import StepBreakdown, format_breakdown
from tripath.triton_internals import child_environment


@dataclass(frozen=True)
class Workload:
    """Requests of random tokens (``ignore_eos``): ``input_len`` ± ``input_len_spread`` (a fraction, uniform),
    ``output_len`` outputs, at most ``max_concurrency`` in flight; ``prefix_share`` of every prompt is one
    prefix common to all requests (prefix-cache hits turn their prefills into extends)."""

    model: str
    backends: tuple[str, ...]
    num_requests: int
    input_len: int
    input_len_spread: float
    output_len: int
    max_concurrency: int
    prefix_share: float = 0.0
    max_num_batched_tokens: int = 8192
    description: str = ""

    def __post_init__(self):
        if self.num_requests < 1 or self.input_len < 1 or self.output_len < 1 or self.max_concurrency < 1:
            raise ValueError("num_requests, input_len, output_len and max_concurrency must be >= 1")
        if not 0 <= self.input_len_spread < 1:
            raise ValueError(f"input_len_spread must be in [0, 1), got {self.input_len_spread}")
        if not 0 <= self.prefix_share < 1:
            raise ValueError(f"prefix_share must be in [0, 1), got {self.prefix_share}")

    @property
    def max_input_len(self) -> int:
        return int(self.input_len * (1 + self.input_len_spread))

    @property
    def max_model_len(self) -> int:
        return self.max_input_len + self.output_len


MHA = ("three_path", "unified", "two_path")
MLA = ("mla", "mla_triton")
WORKLOADS = {
    "mha-tp8": Workload("qwen3-235b-attn-tp8", MHA, 256, 2048, 0.5, 512, 64,
                        description="Qwen3-235B attention at TP 8, 64 concurrent, 1-3K in, 512 out"),
    "mla-tp8": Workload("deepseek-r1-attn-tp8", MLA, 256, 2048, 0.5, 512, 64,
                        description="DeepSeek-R1 MLA at TP 8, 64 concurrent, 1-3K in, 512 out"),
    "llama-8b": Workload("llama-3.1-8b", MHA, 128, 1024, 0.5, 256, 128,
                         description="Llama-3.1-8B, 128 requests, 0.5-1.5K in, 256 out"),
    "long": Workload("llama-3.1-8b", MHA, 16, 32768, 0.1, 128, 16,
                     description="Llama-3.1-8B, 16 requests of about 32K (chunked prefill: extends on long contexts)"),
    "tiny": Workload("tiny-llama", ("three_path", "torch"), 8, 48, 0.5, 8, 4, prefix_share=0.25,
                     max_num_batched_tokens=64, description="a CPU-sized check that the benchmark runs"),
}


def make_prompts(workload: Workload, vocab_size: int, seed: int) -> list[list[int]]:
    """``num_requests`` prompts of random token ids in ``[2, vocab_size)``, reproducible from ``seed``."""
    rng = random.Random(seed)
    low = max(1, int(workload.input_len * (1 - workload.input_len_spread)))
    high = max(low, workload.max_input_len)
    prefix = [rng.randrange(2, vocab_size) for _ in range(int(workload.input_len * workload.prefix_share))]
    prompts = []
    for _ in range(workload.num_requests):
        n = rng.randint(low, high)
        head = prefix[:max(0, n - 1)]
        prompts.append(head + [rng.randrange(2, vocab_size) for _ in range(n - len(head))])
    return prompts


@dataclass
class PassResult:
    records: list[RequestRecord]
    elapsed_s: float
    num_steps: int
    decode_steps: list[tuple[int, int]]  # per step with decodes: (decoding requests, KV tokens they read)
    compiled: int
    gc: dict  # the pass's garbage collections (:meth:`GarbageCollections.summary`)


def run_pass(llm, prompts: Sequence[Sequence[int]], output_len: int, max_concurrency: int,
             progress: bool = True) -> PassResult:
    """Feed ``prompts`` through ``llm``'s step API with at most ``max_concurrency`` in flight; one
    :class:`RequestRecord` per prompt (TTFT and end-to-end from when it was added)."""
    from tqdm.auto import tqdm

    from tripath.engine import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    compiled0, steps0 = llm.num_compiled_since_start, llm.num_steps
    pending = list(enumerate(prompts))[::-1]
    added: dict[str, tuple[int, float]] = {}
    token_times: dict[str, list[float]] = {}
    records: list[RequestRecord | None] = [None] * len(prompts)
    decode_steps: list[tuple[int, int]] = []
    start = time.perf_counter()
    with tqdm(total=len(prompts), desc="requests", disable=not progress, dynamic_ncols=True, leave=False) as bar, \
            GarbageCollections() as collections:
        while pending or llm.has_unfinished_requests():
            while pending and len(added) < max_concurrency:
                index, prompt = pending.pop()
                rid = llm.add_request(list(prompt), params)
                added[rid] = (index, time.perf_counter())
                token_times[rid] = []
            outputs = llm.step()
            now = time.perf_counter()
            model_steps: list[list[int]] = []  # per model step of this call: [decodes, KV tokens they read]
            for out in outputs:
                new = len(out.new_token_ids)
                before = len(out.output_token_ids) - new
                for j in range(new):  # several with multi-step decoding
                    if j == len(model_steps):
                        model_steps.append([0, 0])
                    if before + j > 0:  # the request had a token before this one: a decode
                        model_steps[j][0] += 1
                        model_steps[j][1] += len(out.prompt_token_ids) + before + j  # its keys, itself included
                token_times[out.request_id].extend([now] * new)
                if out.finished:
                    index, t0 = added.pop(out.request_id)
                    times = token_times.pop(out.request_id)
                    records[index] = RequestRecord(len(out.prompt_token_ids), len(out.output_token_ids),
                                                   times[0] - t0 if times else None, now - t0,
                                                   [b - a for a, b in zip(times, times[1:])])
                    bar.update(1)
            decode_steps.extend((decodes, kv) for decodes, kv in model_steps if decodes)
    elapsed = time.perf_counter() - start
    return PassResult([r for r in records if r is not None], elapsed, llm.num_steps - steps0, decode_steps,
                      llm.num_compiled_since_start - compiled0, collections.summary())


# ---- the roofline floor ---------------------------------------------------------------------------------
def model_costs(model, backend) -> dict:
    """Active parameters of the layers (without the embedding table and the LM head), the LM head's
    parameters, weight bytes a decode step reads (the LM head included), KV bytes per token, and the
    attention FLOPs per causal query-key pair (all layers)."""
    config = model.config
    embed = model.model.embed_tokens.weight
    head = embed if model.lm_head is None else model.lm_head.weight
    total = active = weight_bytes = 0
    moe = getattr(config, "moe", None)
    for name, param in model.named_parameters():
        n = param.numel()
        if param is embed or param is head:
            if param is head:  # read by every decode step; multiplies one token of each prompt
                weight_bytes += n * param.element_size()
            continue
        share = 1.0
        if moe is not None and ".experts." in f".{name}." and "shared_experts" not in name:
            share = moe.top_k / moe.num_experts
        total += n
        active += n * share
        weight_bytes += n * param.element_size()
    spec = backend.spec
    if spec.is_mla:
        mla = spec.mla
        head_dims = mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim
    else:
        head_dims = spec.head_size + spec.v_size
    layers = model.num_attention_layers
    return {"active_params": active, "params": total, "head_params": head.numel(), "weight_bytes": weight_bytes,
            "kv_bytes_per_token": backend.cache_bytes_per_block() // spec.block_size * layers,
            "attention_flops_per_pair": 2 * spec.num_heads * head_dims * layers}


def roofline_floor_s(costs: dict, prompts: Sequence[Sequence[int]], decode_steps: Sequence[tuple[int, int]],
                     matmul_flops: float, copy_bytes_per_s: float) -> float:
    """Seconds the hardware needs at least for one pass (see the module doc)."""
    prefill_flops = sum(2 * costs["active_params"] * len(p) + 2 * costs["head_params"] +
                        costs["attention_flops_per_pair"] * len(p) * (len(p) + 1) / 2 for p in prompts)
    decode_bytes = sum(costs["weight_bytes"] + costs["kv_bytes_per_token"] * kv for _, kv in decode_steps)
    return prefill_flops / matmul_flops + decode_bytes / copy_bytes_per_s


def measure_ceilings(device) -> tuple[float, float]:
    """(bf16 matmul FLOP/s of an 8192³ product, device-to-device copy bytes/s counting read + write), medians."""
    import torch
    import triton.testing

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    flops = 2 * 8192 ** 3 / (ms * 1e-3)
    src = torch.empty(2 ** 30 // 2, device=device, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=20, rep=200, return_mode="median")
    return flops, 2 * src.numel() * src.element_size() / (ms * 1e-3)


# ---- one backend, in its own process ----------------------------------------------------------------------
def run_backend(workload: Workload, backend: str, *, device: str | None, dtype: str | None, seed: int,
                passes: int, progress: bool, start_only: bool = False, profile: str | None = None,
                tensor_parallel_size: int = 1, async_scheduling: bool = True, step_breakdown: bool = False,
                decode_steps: int = 8, mixed_cuda_graphs: bool = True) -> dict:
    """Build the engine and run the passes (or only time the start); the result as a JSON-able dict.
    ``profile``: after the reported passes, run one more under cProfile and append its top functions here.
    ``step_breakdown``: time each launch of the warm pass by kind of step (:mod:`tripath.bench.step_breakdown`;
    two CUDA events a step are its only cost)."""
    import torch

    from tripath.engine import LLM

    start = time.perf_counter()
    llm = LLM(workload.model, backend=backend, device=device, dtype=dtype, max_num_seqs=workload.max_concurrency,
              max_num_batched_tokens=workload.max_num_batched_tokens, max_model_len=workload.max_model_len,
              seed=seed, tensor_parallel_size=tensor_parallel_size, async_scheduling=async_scheduling,
              decode_steps=decode_steps, mixed_cuda_graphs=mixed_cuda_graphs)
    start_s = time.perf_counter() - start
    result = {"backend": llm.backend_name, "start_s": start_s, "async_scheduling": llm.overlap,
              "decode_steps": llm.decode_steps,
              "mixed_cuda_graphs": getattr(llm.runner, "mixed_graphs", None) is not None,
              "largest_step_host_share": getattr(llm.runner, "largest_step_host_share", None)}
    warmup = llm.runner.warmup_report
    result["warmup"] = None if warmup is None else {"seconds": warmup.seconds, "steps_probed": warmup.steps_probed,
                                                    "steps_run": warmup.steps_run,
                                                    "variants": len(warmup.variants),
                                                    "compiled_ahead": warmup.pool.compiled if warmup.pool else 0,
                                                    "compile_workers": warmup.pool.workers if warmup.pool else 1}
    if start_only:
        return result
    on_gpu = llm.config.device.type == "cuda"
    vocab = llm.model.config.vocab_size
    costs = model_costs(llm.model, llm.runner.backend)
    ceilings = measure_ceilings(llm.config.device) if on_gpu else None
    result["ceilings"] = None if ceilings is None else {"matmul_tflops": ceilings[0] / 1e12,
                                                        "copy_gbps": ceilings[1] / 1e9}
    result["passes"] = []
    for index in range(passes):
        prompts = make_prompts(workload, vocab, seed + index)
        timer = StepBreakdown(llm).attach() if step_breakdown and index == passes - 1 else None
        try:
            outcome = run_pass(llm, prompts, workload.output_len, workload.max_concurrency, progress)
        finally:
            if timer is not None:
                timer.detach()
        if timer is not None:
            result["step_breakdown"] = timer.summary()
        report = summarize(outcome.records, outcome.elapsed_s)
        report.update(num_steps=outcome.num_steps, compiled_after_start=outcome.compiled,
                      num_decode_steps=len(outcome.decode_steps), gc=outcome.gc)
        if ceilings is not None:
            floor = roofline_floor_s(costs, prompts, outcome.decode_steps, *ceilings)
            report.update(floor_s=floor, floor_fraction=floor / outcome.elapsed_s)
        result["passes"].append(report)
    if profile:  # one more pass, not reported: the profiler's own overhead would distort the times
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
        outcome = run_pass(llm, make_prompts(workload, vocab, seed + passes), workload.output_len,
                           workload.max_concurrency, progress)
        profiler.disable()
        _write_profile(profiler, profile, f"{workload.model} {llm.backend_name}: a pass under the profiler, "
                                          f"{outcome.elapsed_s:.2f} s, {outcome.num_steps} steps")
    if on_gpu:
        torch.cuda.synchronize()
    return result


def _write_profile(profiler, path: str, title: str) -> None:
    import io
    import pstats

    text = io.StringIO()
    text.write(f"# {title}\n")
    for order in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(40)
    with open(path, "a") as f:
        f.write(text.getvalue())


def _worker(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tripath bench serve (worker)")
    parser.add_argument("--workload-json", required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--device")
    parser.add_argument("--dtype")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--start-only", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--profile")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--no-async-scheduling", action="store_true")
    parser.add_argument("--step-breakdown", action="store_true")
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--no-mixed-cuda-graphs", action="store_true")
    args = parser.parse_args(argv)
    workload = Workload(**{**json.loads(args.workload_json), "backends": (args.backend,)})
    result = run_backend(workload, args.backend, device=args.device, dtype=args.dtype, seed=args.seed,
                         passes=args.passes, progress=not args.no_progress, start_only=args.start_only,
                         profile=args.profile, tensor_parallel_size=args.tensor_parallel_size,
                         async_scheduling=not args.no_async_scheduling, step_breakdown=args.step_breakdown,
                         decode_steps=args.decode_steps, mixed_cuda_graphs=not args.no_mixed_cuda_graphs)
    with open(args.result, "w") as f:
        json.dump(result, f)
    return 0


def _spawn(workload: Workload, backend: str, args, cache_dir: str, start_only: bool) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        result_path = tmp.name
    fields = {k: v for k, v in dataclasses.asdict(workload).items() if k != "backends"}
    cmd = [sys.executable, "-m", "tripath.bench.serve", "--worker", "--workload-json", json.dumps(fields),
           "--backend", backend, "--result", result_path, "--seed", str(args.seed), "--passes", str(args.passes),
           "--tensor-parallel-size", str(args.tensor_parallel_size), "--decode-steps", str(args.decode_steps)]
    for flag, value in (("--device", args.device), ("--dtype", args.dtype)):
        if value:
            cmd += [flag, value]
    if start_only:
        cmd.append("--start-only")
    elif args.profile:
        cmd += ["--profile", args.profile]
    if args.no_progress:
        cmd.append("--no-progress")
    if args.no_async_scheduling:
        cmd.append("--no-async-scheduling")
    if args.no_mixed_cuda_graphs:
        cmd.append("--no-mixed-cuda-graphs")
    if args.step_breakdown and not start_only:
        cmd.append("--step-breakdown")
    # Triton backends on a CPU-only machine run in the interpreter
    env = child_environment(interpret=None if args.device_is_gpu else True, cache_dir=cache_dir)
    try:
        proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0:
            return {"backend": backend, "error": f"the benchmark process exited with {proc.returncode}"}
        with open(result_path) as f:
            return json.load(f)
    finally:
        os.unlink(result_path)


def median_pass(passes: list[dict]) -> dict:
    """The pass of median wall time (the slower middle one of an even count): with ``--passes N > 2`` the
    reported warm pass is the median of the N − 1 passes after the first, not the last one alone."""
    return sorted(passes, key=lambda p: p["elapsed_s"])[len(passes) // 2]


def merge_rounds(results: list[dict]) -> dict:
    """One backend's processes of ``--rounds`` (in round order) as one result: the round whose warm pass is
    the median over the rounds (the slower middle one of an even count) with the start times of the first
    round (the only one that can start from an empty cache), ``round_warm_passes_s`` (every round's warm
    pass, in round order) and ``compiled_in_rounds`` (kernel variants compiled after start, every pass of
    every round). A failed round is the result."""
    failed = next((r for r in results if "error" in r), None)
    if failed is not None or len(results) == 1:
        return failed or results[0]
    warm = [median_pass(r["passes"][1:] or r["passes"])["elapsed_s"] for r in results]
    median = sorted(range(len(results)), key=lambda i: warm[i])[len(results) // 2]
    return {**results[median], "start_s": results[0].get("start_s"), "warm_start_s": results[0].get("warm_start_s"),
            "round_warm_passes_s": warm,
            "compiled_in_rounds": sum(p["compiled_after_start"] for r in results for p in r.get("passes", []))}


def rows_of(results: list[dict], workload_name: str) -> list[dict]:
    """One table row per backend: starts, first and warm pass, the warm pass's throughputs and latencies
    (``warm_passes_s``: every pass after the first; with ``--rounds``, ``round_warm_passes_s``: every
    round's warm pass, :func:`merge_rounds`)."""
    rows = []
    for r in results:
        label = r["backend"] if r.get("async_scheduling", True) else f"{r['backend']} (sequential)"
        row = {"workload": workload_name, "backend": label}
        if "error" in r:
            rows.append({**row, "error": r["error"]})
            continue
        passes = r.get("passes", [])
        row.update(start_s=r.get("start_s"), warm_start_s=r.get("warm_start_s"))
        if passes:
            first, warm = passes[0], median_pass(passes[1:] or passes)
            row.update(first_pass_s=first["elapsed_s"], warm_pass_s=warm["elapsed_s"],
                       warm_passes_s=[p["elapsed_s"] for p in passes[1:]],
                       output_throughput=warm["output_throughput"], total_throughput=warm["total_throughput"],
                       ttft_s=warm["ttft_s"], tpot_s=warm["tpot_s"], itl_s=warm["itl_s"], e2e_s=warm["e2e_s"],
                       compiled_after_start=r.get("compiled_in_rounds",
                                                  sum(p["compiled_after_start"] for p in passes)),
                       floor_s=warm.get("floor_s"), floor_fraction=warm.get("floor_fraction"),
                       first_pass_gc=first.get("gc"), warm_pass_gc=warm.get("gc"))
            if r.get("round_warm_passes_s"):
                row["round_warm_passes_s"] = r["round_warm_passes_s"]
        rows.append(row)
    return rows


def format_passes(row: dict) -> str:
    """One line of a row: every pass's wall time and, with several warm passes, how far apart they are
    (the slowest over the fastest): the noise to read the backends' differences against."""
    warm = row.get("warm_passes_s") or []
    line = f"{row['backend']}: passes {row['first_pass_s']:.3f} s"
    if warm:
        line += ", then " + " / ".join(f"{t:.3f}" for t in warm) + " s"
    if len(warm) > 1:
        line += f" (warm passes within {100 * (max(warm) / min(warm) - 1):.1f}% of each other)"
    rounds = row.get("round_warm_passes_s") or []
    if len(rounds) > 1:
        line += (f"; warm pass of each round " + " / ".join(f"{t:.3f}" for t in rounds) + " s (within "
                 f"{100 * (max(rounds) / min(rounds) - 1):.1f}%; reported: the median round)")
    return line


TABLE = [("backend", "backend"), ("start_s", "start s"), ("warm_start_s", "warm start s"),
         ("first_pass_s", "1st pass s"), ("warm_pass_s", "warm pass s"), ("output_throughput", "out tok/s"),
         ("total_throughput", "total tok/s"), ("ttft_s.mean", "TTFT mean"), ("ttft_s.p50", "p50"),
         ("ttft_s.p99", "p99"), ("tpot_s.mean", "TPOT mean"), ("tpot_s.p50", "p50"), ("tpot_s.p99", "p99"),
         ("compiled_after_start", "compiled"), ("floor_fraction", "of floor")]


def plot(rows: list[dict], path: str) -> None:
    """A bar chart of the warm pass's output tok/s per backend (and workload)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in rows if "output_throughput" in r]
    labels = [f"{r['workload']}\n{r['backend']}" for r in good]
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(good)), 3.5))
    bars = ax.bar(labels, [r["output_throughput"] for r in good], color="#4c72b0")
    for bar, r in zip(bars, good):
        if r.get("floor_fraction"):
            ax.annotate(f"{r['floor_fraction']:.0%} of floor", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("output tok/s (warm pass)")
    ax.set_title("tripath bench serve")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tripath bench serve", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="mha-tp8", help=f"built-in workload: {', '.join(WORKLOADS)}")
    parser.add_argument("--model", help="preset name or Hugging Face directory (overrides the workload's)")
    parser.add_argument("--backends", help="comma-separated backends (default: the workload's)")
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--input-len", type=int)
    parser.add_argument("--input-len-spread", type=float, help="± fraction of --input-len, uniform")
    parser.add_argument("--output-len", type=int)
    parser.add_argument("--max-concurrency", type=int)
    parser.add_argument("--prefix-share", type=float, help="fraction of each prompt shared by all requests")
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--passes", type=int, default=2,
                        help="passes per backend: the first, then warm ones (reported: their median)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every backend's process this many times, in turn (A B A B …), and report the "
                             "round of median warm pass: a host whose speed drifts then weighs on every backend "
                             "alike (later rounds reuse the backend's Triton cache)")
    parser.add_argument("--warm-cache", action="store_true",
                        help="use the current Triton cache instead of an empty one per backend")
    parser.add_argument("--device")
    parser.add_argument("--dtype")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="shard the model over N GPUs (compare TP 1 and TP 2 on the same workload)")
    parser.add_argument("--json", help="write the results as JSON")
    parser.add_argument("--csv", help="write one CSV row per backend")
    parser.add_argument("--plot", help="write a PNG of output tok/s per backend")
    parser.add_argument("--no-async-scheduling", action="store_true",
                        help="read each step's tokens before scheduling the next (default: overlap them)")
    parser.add_argument("--decode-steps", type=int, default=8,
                        help="model steps a step of decodes alone runs on the device (multi-step decoding; 1: off)")
    parser.add_argument("--no-mixed-cuda-graphs", action="store_true",
                        help="run steps with prompt tokens eagerly (default: piecewise CUDA graphs around attention)")
    parser.add_argument("--step-breakdown", action="store_true",
                        help="per kind of step of the warm pass: host time inside the launch and GPU span (one rank)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--profile", help="append each backend's host profile (cProfile) of one extra, unreported "
                                              "pass here")
    return parser


def workload_from_args(args) -> Workload:
    if args.workload not in WORKLOADS:
        raise SystemExit(f"tripath bench serve: unknown --workload {args.workload!r}; built in: {', '.join(WORKLOADS)}")
    base = WORKLOADS[args.workload]
    overrides = {name: getattr(args, name) for name in ("model", "num_requests", "input_len", "input_len_spread",
                                                         "output_len", "max_concurrency", "prefix_share",
                                                         "max_num_batched_tokens") if getattr(args, name) is not None}
    if args.backends:
        overrides["backends"] = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    try:
        return dataclasses.replace(base, **overrides)
    except ValueError as err:
        raise SystemExit(f"tripath bench serve: {err}") from None


def main_serve(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    if any(a == "--url" or a.startswith("--url=") for a in argv):
        from tripath.bench.serve_online import main_online
        return main_online(argv)
    args = build_parser().parse_args(argv)
    if args.passes < 1:
        raise SystemExit("tripath bench serve: --passes must be >= 1")
    if args.rounds < 1:
        raise SystemExit("tripath bench serve: --rounds must be >= 1")
    if args.decode_steps < 1:
        raise SystemExit("tripath bench serve: --decode-steps must be >= 1")
    workload = workload_from_args(args)
    import torch

    args.device_is_gpu = args.device != "cpu" and torch.cuda.is_available()
    rounds: dict[str, list[dict]] = {backend: [] for backend in workload.backends}
    with contextlib.ExitStack() as stack:
        caches = {}
        for backend in workload.backends:
            caches[backend] = _env.triton_cache_dir() if args.warm_cache else \
                stack.enter_context(tempfile.TemporaryDirectory(prefix="tripath-triton-"))
        for index in range(args.rounds):
            for backend in workload.backends:
                if rounds[backend] and "error" in rounds[backend][-1]:
                    continue
                empty = index == 0 and not args.warm_cache
                print(f"== {args.workload}: {backend}, round {index + 1} of {args.rounds} "
                      f"({'empty' if empty else 'warm'} Triton cache)", file=sys.stderr, flush=True)
                result = _spawn(workload, backend, args, caches[backend], start_only=False)
                if index == 0 and "error" not in result:
                    again = _spawn(workload, backend, args, caches[backend], start_only=True)
                    result["warm_start_s"] = again.get("start_s")
                rounds[backend].append(result)
    results = [merge_rounds(rounds[backend]) for backend in workload.backends]
    rows = rows_of(results, args.workload)
    print(f"\n{workload.description or args.workload} ({workload.model})")
    print(format_table(rows, TABLE))
    for r in rows:
        if "error" in r:
            print(f"{r['backend']}: {r['error']}")
    for row in rows:
        if "first_pass_s" in row:
            print(format_passes(row))
    for row in rows:
        if row.get("first_pass_gc") and row.get("warm_pass_gc"):
            print(format_collections(row["backend"], row["first_pass_gc"], row["warm_pass_gc"]))
    for result, row in zip(results, rows):
        if result.get("step_breakdown"):
            print(format_breakdown(row["backend"], result["step_breakdown"]))
    if args.json:
        write_json(args.json, {"workload": {"name": args.workload, **dataclasses.asdict(workload)},
                               "results": results, "rows": rows})
    if args.csv:
        write_csv(args.csv, rows)
    if args.plot:
        plot(rows, args.plot)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main_serve())
