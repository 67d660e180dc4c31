"""Test harness for tensor parallelism: run a function on ``W`` spawned ranks (gloo on the CPU, NCCL on GPUs)
and bring rank 0's result back; and the model steps every rank runs (prefills, a mixed decode + extend +
prefill step, greedy decodes through a real attention backend)."""

from __future__ import annotations

import os
import socket
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

from model_steps import PagedRunner
from tripath.models import load_model
from tripath.models.parallel import SINGLE, ParallelState


def _rank_entry(rank: int, world: int, port: int, backend: str, device: str | None, out: str, fn, args) -> None:
    """One rank: join the group, run ``fn``, rank 0 saves its result; then every rank leaves through
    ``os._exit(0)`` once all have finished. Tearing a gloo group down in a spawned child at times ends in
    ``std::terminate`` inside torch (a worker thread destroyed while joinable), which is not what these tests
    check; the engine's own worker teardown is tested through ``LLM(tensor_parallel_size=2)``."""
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    if device is not None:
        device = torch.device(device)
    else:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    result = fn(ParallelState(rank=rank, world_size=world), device, *args)
    if rank == 0:
        torch.save(result, out)
    dist.barrier()  # every rank is done (and rank 0's file written) before any leaves
    if device.type == "cuda":
        torch.cuda.synchronize()
    os._exit(0)


def run_ranks(fn, world: int, *args, backend: str = "gloo", device: str | None = None):
    """``fn(parallel, device, *args)`` on ``world`` spawned ranks; returns rank 0's result. ``device``: every
    rank's (default: ``cuda:rank`` with NCCL, else the CPU; gloo also moves CUDA tensors, through the host)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        torch.multiprocessing.start_processes(_rank_entry, args=(world, port, backend, device, out, fn, args),
                                              nprocs=world, start_method="spawn")
        return torch.load(out)


def model_steps(parallel: ParallelState, device, preset: str, dtype: torch.dtype, backend: str,
                decode_steps: int = 3) -> dict:
    """Logits of every step and the greedy tokens of three requests: A and B's first 5 tokens prefilled, then
    A decodes while B extends and C prefills, then greedy decodes of all three."""
    torch.manual_seed(0)  # the runner's block permutation
    model = load_model(preset, dtype=dtype, device=device, parallel=parallel)
    runner = PagedRunner(model, backend=backend, block_size=16, num_blocks=32, device=device)
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    a, b, c = (torch.randint(2, vocab, (n,), generator=g).tolist() for n in (11, 23, 6))
    logits, tokens = [], {"A": [], "B": [], "C": []}

    def run(step):
        out = runner.step(step)
        for rid in sorted(out):
            logits.append(out[rid].float().cpu())
        return {rid: int(out[rid][-1].argmax()) for rid in out}

    first = run({"A": a, "B": b[:5]})
    tokens["A"].append(first["A"])
    nxt = run({"A": [first["A"]], "B": b[5:], "C": c})
    for _ in range(decode_steps):
        for rid, token in nxt.items():
            tokens[rid].append(token)
        nxt = run({rid: [token] for rid, token in nxt.items()})
    return {"logits": torch.cat(logits), "tokens": tokens, "spec": (runner.spec.num_heads, runner.spec.num_kv_heads)}


def model_steps_cases(parallel: ParallelState, device, cases, dtype: torch.dtype, backend: str) -> dict:
    return {preset: model_steps(parallel, device, preset, dtype, backend) for preset in cases}


def reference_steps(cases, dtype: torch.dtype, backend: str, device="cpu") -> dict:
    return model_steps_cases(SINGLE, torch.device(device), cases, dtype, backend)
