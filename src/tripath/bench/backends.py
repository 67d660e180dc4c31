"""``tripath bench``: every available backend on mixed steps, checked against ``torch``, timed.

On a GPU the steps have Llama-3-8B-like shapes (32/8/128 bf16; the mixed step: 48 decodes on 4096 cached
tokens, 8 extends of 512 on 4096, 2 prefills of 2048); on a CPU-only machine they are small
(4/2/64 fp16) and the Triton backends run under Triton's interpreter, so the CPU times show that the
whole path works, not how fast it is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tripath.attention import AttentionSpec, MLASpec, default_block_size, explain, select_backend
from tripath.attention.backends.torch_ref import TorchBackend
from tripath.bench.batches import make_mla_step, make_step
from tripath.triton_internals import interpreting

GPU_STEPS = {
    "mixed (48 dec + 8 ext + 2 pre)": [(4096, 1)] * 48 + [(4096, 512)] * 8 + [(0, 2048)] * 2,
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
MHA_BACKENDS = ("three_path", "unified", "two_path", "mixed", "torch")
MLA_BACKENDS = ("mla", "mla_triton", "torch")
GPU_MLA_STEPS = {"MLA decode-heavy (64 × 4096 + 2 × 512)": [(4096, 1)] * 64 + [(0, 512)] * 2,
                 "MLA mixed (16 dec + 2 ext + 1 pre)": [(4096, 1)] * 16 + [(2048, 256)] * 2 + [(0, 1024)]}
CPU_MLA_STEPS = {"MLA mixed": [(40, 1), (70, 1), (30, 8), (0, 12)]}


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


def _check_and_time(results, step_name, name, run_once, want, on_gpu):
    out = run_once()
    err = float((out.float() - want).abs().max())
    if err > 5e-2:
        raise AssertionError(f"{name} disagrees with torch on {step_name}: max error {err:.3g}")
    ms = _time(run_once, on_gpu, reps=1 if name != "torch" else 3)
    results.append(Result(step_name, name, ms, err))


def run(device: torch.device) -> list[Result]:
    """Every available MHA backend on the MHA steps and every MLA backend on the MLA steps."""
    on_gpu = device.type == "cuda"
    results: list[Result] = []
    spec = AttentionSpec(32, 8, 128, dtype=torch.bfloat16) if on_gpu else \
        AttentionSpec(4, 2, 64, dtype=torch.float16, extend_chunk_budget=32)
    available = [name for name, why in explain(spec, device).items() if not why and name in MHA_BACKENDS]
    for step_name, requests in (GPU_STEPS if on_gpu else CPU_STEPS).items():
        step = make_step(spec, requests, TorchBackend(spec, device), device=device, seed=1)
        ref = TorchBackend(spec, device)
        want = ref.forward(step.q, step.k, step.v, step.fresh_cache(),
                           ref.build_metadata(step.plan, step.block_table, step.slot_mapping)).float()
        for name in available:
            backend = select_backend(spec, name, device)
            meta = backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
            cache = step.fresh_cache()
            out = torch.empty_like(step.q)
            _check_and_time(results, step_name, name,
                            lambda: backend.forward(step.q, step.k, step.v, cache, meta, out=out), want, on_gpu)

    mla = MLASpec() if on_gpu else MLASpec(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
    mla_spec = AttentionSpec(16 if on_gpu else 4, 1, mla.cache_width, dtype=spec.dtype,
                             block_size=default_block_size("auto", True, device), mla=mla)
    available = [name for name, why in explain(mla_spec, device).items() if not why and name in MLA_BACKENDS]
    for step_name, requests in (GPU_MLA_STEPS if on_gpu else CPU_MLA_STEPS).items():
        step = make_mla_step(mla_spec, requests, TorchBackend(mla_spec, device), device=device, seed=1)
        args = (step.q_nope, step.q_pe, step.kv_c, step.k_pe, step.positions)
        ref = TorchBackend(mla_spec, device)
        want = ref.forward_mla(*args, step.fresh_cache(), ref.build_metadata(step.plan, step.block_table,
                                                                             step.slot_mapping),
                               step.weights).float()
        for name in available:
            backend = select_backend(mla_spec, name, device)
            meta = backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
            cache = step.fresh_cache()
            _check_and_time(results, step_name, name,
                            lambda: backend.forward_mla(*args, cache, meta, step.weights), want, on_gpu)
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

    from tripath.bench import device_argument
    parser = argparse.ArgumentParser(prog="tripath bench backends", description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=device_argument, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, cuda or cuda:N (default: cuda when a GPU is visible)")
    args = parser.parse_args(argv)
    device = args.device
    if device.type == "cpu" and not interpreting():
        parser.error("on a CPU, run `tripath bench` through the CLI (it enables TRITON_INTERPRET=1 before "
                     "Triton loads) or set TRITON_INTERPRET=1")
    print(format_results(run(device), device))
    return 0
