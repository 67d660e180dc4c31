"""Where a decode step's GPU time goes: ``tripath bench decode-step``.

The engine (its defaults: CUDA graphs, multi-step decoding) serves ``--batch`` requests of ``--context``
random prompt tokens; once every request decodes, the bench

- times the decode launches' GPU span (CUDA events around each launch, :mod:`tripath.bench.step_breakdown`)
  and divides it by the model steps they ran: the *GPU time of a decode step*;
- compares it with the step's *floor*: the weights a step reads (the LM head included) and the KV cache of
  every decoding request, at the copy bandwidth measured in the same process
  (:func:`tripath.bench.serve_floor.measure_ceilings`). The requests grow a token a model step (by 100 or
  more over the run), so the KV counted is the mean over the timed steps of the tokens each request holds
  (:func:`context_tokens` before and after them), not the prompt's;
- profiles the same steps' kernels (``torch.profiler``; kernels replayed from CUDA graphs included) and
  lists them by GPU time per model step;
- times each distinct projection weight of the first layer and the LM head as ``F.linear`` (cuBLAS) at
  ``M`` = 1, 8, 64, 256 rows, GPU time of graph replays, against the copy bandwidth: the skinny GEMMs a
  decode step runs. Each weight is read from memory, as in the model: the graph multiplies by enough copies
  of it in turn to overflow L2 twice (back-to-back calls of one weight that fits in L2 would read it there).

``--fused-sampling on|off`` forces the LM head with the draw on or off (default ``auto``: the engine's choice
at start; the result says which and how many model steps took it). ``--json`` writes everything as one
object. GPU only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

GEMM_ROWS = (1, 8, 64, 256)
MAX_WEIGHT_COPIES = 32   # of a projection weight, so that the GEMM table's calls read it from memory


def _decode_ready(llm, batch: int, context: int, seed: int) -> list[str]:
    """Adds ``batch`` greedy requests of ``context`` random tokens that never stop, and steps until each has
    its first output token (every request decodes from then on). Returns their ids."""
    import torch

    from tripath.engine import SamplingParams

    vocab = llm.model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=llm.runner.max_model_len - context, temperature=0.0, ignore_eos=True)
    ids = [llm.add_request(torch.randint(10, vocab, (context,), generator=gen).tolist(), params)
           for _ in range(batch)]
    started: set[str] = set()
    while len(started) < batch:
        for out in llm.step():
            if out.output_token_ids:
                started.add(out.request_id)
    return ids


def context_tokens(llm) -> int:
    """The tokens the running requests hold in the KV cache (computed so far), summed: what a decode step
    reads, less one token a request."""
    return sum(r.num_computed_tokens for r in llm.scheduler.running)


def _decode_spans(records) -> tuple[float, int]:
    """(GPU ms, model steps) of the decode launches among ``records``."""
    ms = steps = 0
    for r in records:
        if r.kind.startswith("decode") and r.events:
            ms += r.events[0].elapsed_time(r.events[1])
            steps += int(r.kind.split(" x ")[1]) if " x " in r.kind else 1
    return ms, steps


def kernel_profile(llm, num_calls: int) -> tuple[list[dict], int]:
    """GPU time per kernel name over ``num_calls`` engine steps of decodes, and the model steps they ran."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tripath.bench.step_breakdown import StepBreakdown

    timer = StepBreakdown(llm).attach()
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(num_calls):
                llm.step()
            torch.cuda.synchronize()
    finally:
        timer.detach()
    _, steps = _decode_spans(timer.records)
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            entry = totals[event.name]
            entry[0] += event.device_time_total
            entry[1] += 1
    rows = [{"kernel": name, "us_per_step": us / max(steps, 1), "launches_per_step": n / max(steps, 1)}
            for name, (us, n) in totals.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"]), steps


def projection_weights(model) -> list[tuple[str, object]]:
    """The distinct 2-D weights of the first decoder layer that a GEMM reads (a stacked weight once, not its
    row views) and the LM head's."""
    layer = model.model.layers[0]
    tensors = [(n, t) for n, t in list(layer.named_parameters()) + list(layer.named_buffers())
               if t is not None and t.dim() == 2 and min(t.shape) > 1]
    by_storage: dict[int, tuple[str, object]] = {}
    for name, t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in by_storage or t.numel() > by_storage[key][1].numel():
            by_storage[key] = (name, t)
    head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return sorted(by_storage.values(), key=lambda nt: nt[0]) + [("lm_head", head)]


def weight_copies(w, l2_bytes: int, most: int = MAX_WEIGHT_COPIES) -> list:
    """``w`` and clones of it, as many as make at least twice ``l2_bytes`` together (at most ``most``): a GEMM
    called on each in turn finds its weight out of L2, as a model's layers do."""
    count = min(most, max(1, -(-2 * l2_bytes // (w.numel() * w.element_size()))))
    return [w] + [w.clone() for _ in range(count - 1)]


def gemm_table(model, copy_bytes_per_s: float, rows=GEMM_ROWS) -> list[dict]:
    """``F.linear(x [M, K], w [N, K])`` per weight and ``M``: GPU µs (median of graph replays), GB/s of the
    bytes it must move (weight + input + output) and that as a share of the copy bandwidth. Each replay
    multiplies by every copy of :func:`weight_copies` in turn (the µs are per call), so no call reads its
    weight from L2."""
    import torch
    import torch.nn.functional as F
    import triton.testing

    out = []
    l2_bytes = torch.cuda.get_device_properties(next(model.parameters()).device).L2_cache_size
    for name, w in projection_weights(model):
        n, k = w.shape
        copies = weight_copies(w, l2_bytes)
        for m in rows:
            x = torch.randn(m, k, device=w.device, dtype=w.dtype)
            ms = triton.testing.do_bench_cudagraph(lambda: [F.linear(x, c) for c in copies], rep=100,
                                                   return_mode="median") / len(copies)
            moved = (n * k + m * k + m * n) * w.element_size()
            out.append({"weight": name, "N": n, "K": k, "M": m, "us": 1e3 * ms,
                        "GB/s": moved / (ms * 1e-3) / 1e9, "of_copy": moved / (ms * 1e-3) / copy_bytes_per_s})
    return out


def run(model: str, batch: int, context: int, calls: int, seed: int, gemms: bool,
        fused_sampling: str = "auto", skinny_gemms: str = "off") -> dict:
    import torch

    from tripath.engine import LLM
    from tripath.bench.serve_floor import measure_ceilings, model_costs
    from tripath.bench.step_breakdown import StepBreakdown

    llm = LLM(model, max_num_seqs=batch, fused_sampling=fused_sampling, skinny_gemms=skinny_gemms)
    try:
        _decode_ready(llm, batch, context, seed)
        for _ in range(4):
            llm.step()
        timer = StepBreakdown(llm).attach()
        held_before = context_tokens(llm)
        for _ in range(calls):
            llm.step()
        torch.cuda.synchronize()
        timer.detach()
        held_after = context_tokens(llm)
        span_ms, steps = _decode_spans(timer.records)
        kernels, profiled_steps = kernel_profile(llm, calls)
        held_profiled = context_tokens(llm)
        matmul, copy = measure_ceilings(llm.config.device)
        costs = model_costs(llm.model, llm.runner.backend)
        kv_tokens = (held_before + held_after) / 2 + batch   # a step reads each request's context and new token
        floor_bytes = costs["weight_bytes"] + costs["kv_bytes_per_token"] * kv_tokens
        result = {
            "model": model, "backend": llm.backend_name, "batch": batch, "context": context,
            "device": torch.cuda.get_device_name(), "copy_GB/s": copy / 1e9, "matmul_TFLOP/s": matmul / 1e12,
            "step_gpu_ms": span_ms / max(steps, 1), "steps_timed": steps,
            "floor_ms": 1e3 * floor_bytes / copy, "weight_bytes": costs["weight_bytes"],
            "kv_bytes": costs["kv_bytes_per_token"] * kv_tokens,
            "tokens_timed": kv_tokens / batch, "tokens_profiled": (held_after + held_profiled) / 2 / batch + 1,
            "kernels": kernels, "profiled_steps": profiled_steps,
            "fused_sampling": llm.core.info().fused_sampling,
            "fused_sampling_steps": llm.stats().fused_sampling_steps,
            "gemm_routes": [list(r) for r in llm.core.info().gemm_routes],
        }
        if gemms:
            result["gemms"] = gemm_table(llm.model, copy)
        return result
    finally:
        llm.close()


def format_result(r: dict) -> str:
    lines = [f"{r['model']} ({r['backend']}), {r['batch']} decoding from {r['context']} prompt tokens, {r['device']}",
             f"decode step: {r['step_gpu_ms']:.3f} ms GPU ({r['steps_timed']} steps timed at "
             f"{r['tokens_timed']:.0f} tokens a request on average), floor "
             f"{r['floor_ms']:.3f} ms ({r['weight_bytes'] / 1e9:.3f} GB weights + {r['kv_bytes'] / 1e9:.3f} GB KV at "
             f"{r['copy_GB/s']:.0f} GB/s): {r['step_gpu_ms'] / r['floor_ms']:.2f}x the floor",
             f"LM head with the draw: {r.get('fused_sampling', 'off')} "
             f"({r.get('fused_sampling_steps', 0)} model steps drew without logits)",
             "", f"kernels per model step ({r['profiled_steps']} steps profiled, after the timed ones: "
             f"{r['tokens_profiled']:.0f} tokens a request on average):",
             "| kernel | µs / step | launches / step |", "|---|---|---|"]
    total = 0.0
    for k in r["kernels"]:
        total += k["us_per_step"]
        lines.append(f"| {k['kernel'][:90]} | {k['us_per_step']:.1f} | {k['launches_per_step']:.1f} |")
    lines.append(f"| total kernel time | {total:.1f} | {sum(k['launches_per_step'] for k in r['kernels']):.1f} |")
    if r.get("gemm_routes"):
        lines += ["", "the projections' GEMM per weight shape and row class, timed at start (graph replays, weights "
                  "read from memory):", "| N × K | rows up to | cuBLAS µs | Triton split-K µs | runs |",
                  "|---|---|---|---|---|"]
        lines += [f"| {n} × {k} | {rows} | {cub:.1f} | {tri:.1f} | {'Triton' if taken else 'cuBLAS'} |"
                  for n, k, rows, cub, tri, taken in r["gemm_routes"]]
    if "gemms" in r:
        lines += ["", "F.linear (cuBLAS), GPU time of graph replays, weights read from memory:",
                  "| weight | N × K | M | µs | GB/s | of copy |", "|---|---|---|---|---|---|"]
        lines += [f"| {g['weight']} | {g['N']} × {g['K']} | {g['M']} | {g['us']:.1f} | {g['GB/s']:.0f} | "
                  f"{100 * g['of_copy']:.0f} % |" for g in r["gemms"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tripath bench decode-step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-235b-attn-tp8", help="a preset or model path")
    parser.add_argument("--batch", type=int, default=64, help="requests decoding at once (default 64)")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens of each request (default 2048)")
    parser.add_argument("--calls", type=int, default=12, help="engine steps timed and profiled (default 12)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-gemms", action="store_true", help="skip the F.linear table")
    parser.add_argument("--fused-sampling", default="auto", choices=["auto", "on", "off"],
                        help="the LM head with the draw: the start's choice (auto), forced on or off")
    parser.add_argument("--skinny-gemms", default="off", choices=["auto", "off"],
                        help="the projections' GEMM: cuBLAS (off, the engine's default) or the start's choice "
                             "per shape (auto)")
    parser.add_argument("--json", help="write the result here as JSON")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        parser.error("the decode-step bench needs a GPU")
    result = run(args.model, args.batch, args.context, args.calls, args.seed, not args.no_gemms,
                 args.fused_sampling, args.skinny_gemms)
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
