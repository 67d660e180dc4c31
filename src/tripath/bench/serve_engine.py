"""One backend of ``tripath bench serve``'s offline mode, in its own process: the engine and its passes.

The parent (:func:`spawn_backend`) starts ``python -m tripath.bench.serve --worker ...`` with the Triton
cache it chose; the process builds the engine (timed: *engine start*, warm-up included), then runs the
workload ``--passes`` times on fresh prompts of the same shapes (:func:`run_pass`: the engine's step API,
at most ``max_concurrency`` requests in flight; the *first pass*, then warm passes), and writes one JSON
result: both starts' inputs, each pass's report (:func:`tripath.bench.serve_report.summarize`: tok/s, TTFT
/ TPOT / ITL / end-to-end latency), kernel variants compiled after the engine started, each pass's garbage
collections (:mod:`tripath.bench.gc_pauses`) and, on a GPU, the pass's roofline floor
(:mod:`tripath.bench.serve_floor`). ``start_only`` times the start alone (the second, warm-cache start).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Sequence

from tripath.bench.gc_pauses import GarbageCollections
from tripath.bench.serve_floor import measure_ceilings, model_costs, roofline_floor_s
from tripath.bench.serve_report import RequestRecord, summarize
from tripath.bench.serve_workloads import Workload, make_prompts
from tripath.bench.step_breakdown import StepBreakdown
from tripath.triton_internals import child_environment


@dataclass
class PassResult:
    records: list[RequestRecord]
    elapsed_s: float
    num_steps: int
    decode_steps: list[tuple[int, int]]  # per step with decodes: (decoding requests, KV tokens they read)
    compiled: int
    gc: dict  # the pass's garbage collections (:meth:`GarbageCollections.summary`)


def run_pass(llm, prompts: Sequence[Sequence[int]], output_len: int, max_concurrency: int,
             progress: bool = True, workload: Workload | None = None) -> PassResult:
    """Feed ``prompts`` through ``llm``'s step API with at most ``max_concurrency`` in flight; one
    :class:`RequestRecord` per prompt (TTFT and end-to-end from when it was added). ``workload``: which
    requests ask for log-probabilities (:meth:`Workload.asks_logprobs`)."""
    from tqdm.auto import tqdm

    from tripath.engine import SamplingParams

    plain = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    scored = plain if workload is None or workload.logprobs is None else \
        dataclasses.replace(plain, logprobs=workload.logprobs)
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
                rid = llm.add_request(list(prompt), scored if workload is not None and
                                      workload.asks_logprobs(index) else plain)
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


def run_backend(workload: Workload, backend: str, *, device: str | None, dtype: str | None, seed: int,
                passes: int, progress: bool, start_only: bool = False, profile: str | None = None,
                tensor_parallel_size: int = 1, async_scheduling: bool = True, step_breakdown: bool = False,
                decode_steps: int = 8, mixed_cuda_graphs: bool = True, skinny_gemms: str | None = None) -> dict:
    """Build the engine and run the passes (or only time the start); the result as a JSON-able dict.
    ``skinny_gemms``: the engine's option of that name (None: its default).
    ``profile``: after the reported passes, run one more under cProfile and append its top functions here.
    ``step_breakdown``: time each launch of the warm pass by kind of step (:mod:`tripath.bench.step_breakdown`;
    two CUDA events a step are its only cost)."""
    import torch

    from tripath.engine import LLM

    start = time.perf_counter()
    llm = LLM(workload.model, backend=backend, device=device, dtype=dtype, max_num_seqs=workload.max_concurrency,
              max_num_batched_tokens=workload.max_num_batched_tokens, max_model_len=workload.max_model_len,
              seed=seed, tensor_parallel_size=tensor_parallel_size, async_scheduling=async_scheduling,
              decode_steps=decode_steps, mixed_cuda_graphs=mixed_cuda_graphs,
              **({} if skinny_gemms is None else {"skinny_gemms": skinny_gemms}))
    start_s = time.perf_counter() - start
    result = {"backend": llm.backend_name, "start_s": start_s, "start_phases": dict(llm.core.info().start_phases),
              "async_scheduling": llm.overlap,
              "decode_steps": llm.decode_steps,
              "mixed_cuda_graphs": getattr(llm.runner, "mixed_graphs", None) is not None,
              "largest_step_host_share": getattr(llm.runner, "largest_step_host_share", None),
              "skinny_gemms": llm.config.skinny_gemms,
              "gemm_routes": sum(triton for *_, triton in llm.core.info().gemm_routes)}
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
            outcome = run_pass(llm, prompts, workload.output_len, workload.max_concurrency, progress, workload)
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


def main_worker(argv: list[str]) -> int:
    """``tripath bench serve --worker ...``: one backend's run (:func:`run_backend`), its result written as JSON."""
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
    parser.add_argument("--skinny-gemms", choices=["auto", "off"])
    args = parser.parse_args(argv)
    workload = Workload(**{**json.loads(args.workload_json), "backends": (args.backend,)})
    result = run_backend(workload, args.backend, device=args.device, dtype=args.dtype, seed=args.seed,
                         passes=args.passes, progress=not args.no_progress, start_only=args.start_only,
                         profile=args.profile, tensor_parallel_size=args.tensor_parallel_size,
                         async_scheduling=not args.no_async_scheduling, step_breakdown=args.step_breakdown,
                         decode_steps=args.decode_steps, mixed_cuda_graphs=not args.no_mixed_cuda_graphs,
                         skinny_gemms=args.skinny_gemms)
    with open(args.result, "w") as f:
        json.dump(result, f)
    return 0


def spawn_backend(workload: Workload, backend: str, args, cache_dir: str, start_only: bool) -> dict:
    """Run ``backend`` on ``workload`` in a child process (:func:`main_worker`) with ``cache_dir`` as its
    Triton cache and the command's options ``args``; its result, or ``{"backend", "error"}``."""
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
    if args.skinny_gemms:
        cmd += ["--skinny-gemms", args.skinny_gemms]
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
