"""``tripath bench``: every available backend on mixed steps, checked against ``torch``, timed.

On a GPU the steps have the ANCHORS.md shapes (32/8/128 bf16); on a CPU-only machine they are small
(4/2/64 fp16) and the Triton backends run under Triton's interpreter, so the CPU times show that the
whole path works, not how fast it is.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from tripath.attention import AttentionSpec, explain, select_backend
from tripath.attention.backends.torch_ref import TorchBackend
from tripath.bench.batches import make_step

GPU_STEPS = {
    "mixed (ANCHORS)": [(4096, 1)] * 48 + [(4096, 512)] * 8 + [(0, 2048)] * 2,
    "decode 64 × 4096": [(4096, 1)] * 64,
    "extend 4 × (8192 + 1024)": [(8192, 1024)] * 4,
    "prefill 4 × 2048": [(0, 2048)] * 4,
}
CPU_STEPS = {
    "mixed": [(48, 1), (20, 1), (40, 12), (0, 24)],
    "decode": [(40, 1), (64, 1), (17, 1)],
    "extend": [(50, 8), (33, 6)],
    "prefill": [(0, 20), (0, 9)],
}
MHA_BACKENDS = ("three_path", "unified", "two_path", "torch")


@dataclass
class Result:
    step: str
    backend: str
    ms: float
    max_err: float


def _time(fn, on_gpu: bool, reps: int) -> float:
    if on_gpu:
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median"))
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def run(device: torch.device) -> list[Result]:
    on_gpu = device.type == "cuda"
    spec = AttentionSpec(32, 8, 128, dtype=torch.bfloat16) if on_gpu else \
        AttentionSpec(4, 2, 64, dtype=torch.float16, extend_chunk_budget=32)
    steps = GPU_STEPS if on_gpu else CPU_STEPS
    available = [name for name, why in explain(spec, device).items() if not why and name in MHA_BACKENDS]
    results = []
    for step_name, requests in steps.items():
        step = make_step(spec, requests, TorchBackend(spec, device), device=device, seed=1)
        ref_backend = TorchBackend(spec, device)
        meta = ref_backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
        want = ref_backend.forward(step.q, step.k, step.v, step.fresh_cache(), meta).float()
        for name in available:
            backend = select_backend(spec, name, device)
            meta = backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
            cache = step.fresh_cache()
            out = backend.forward(step.q, step.k, step.v, cache, meta)
            err = float((out.float() - want).abs().max())
            if err > 5e-2:
                raise AssertionError(f"{name} disagrees with torch on {step_name}: max error {err:.3g}")
            ms = _time(lambda: backend.forward(step.q, step.k, step.v, cache, meta, out=out), on_gpu,
                       reps=1 if name != "torch" else 3)
            results.append(Result(step_name, name, ms, err))
    return results


def format_results(results: list[Result], device: torch.device) -> str:
    where = torch.cuda.get_device_name() if device.type == "cuda" else \
        "CPU (Triton backends in the interpreter: times are not performance figures)"
    lines = [f"tripath bench on {where}", "", "| step | backend | time per step | speed-up vs torch | max |err| |",
             "|---|---|---|---|---|"]
    for r in results:
        ref = next(x.ms for x in results if x.step == r.step and x.backend == "torch")
        lines.append(f"| {r.step} | {r.backend} | {r.ms:.3f} ms | {ref / r.ms:.2f}× | {r.max_err:.1e} |")
    return "\n".join(lines)


def main_bench(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="tripath bench", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("on a CPU, run `tripath bench` through the CLI (it enables TRITON_INTERPRET=1 before "
                         "Triton loads) or set TRITON_INTERPRET=1")
    print(format_results(run(device), device))
    return 0
