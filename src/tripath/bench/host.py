"""``tripath bench host``: what one step's attention costs the host, per MHA backend.

For one mixed step (decodes beside an extend and prefills, the shape of a tensor-parallel shard's step),
each backend's forward is timed on the host only (launches are queued, the GPU is not waited for), and so
are its recording (watching its PyTorch operations, and not: :mod:`tripath.triton_internals.replay`), a replay of the
recording, and ``--layers`` layers through one :class:`~tripath.attention.ForwardContext` on shared static
buffers (as the piecewise CUDA graphs give them): each layer its forward; replayed, the first layer's
recording watched; replayed as the engine's steps run once the code path was watched before (an unwatched
recording). Means over ``--reps`` calls after a warm-up.

The default step is the mha-tp8 one: 8 query / 1 KV head of 128 (Qwen3-235B's attention at TP 8), 30
decodes on 1–3K cached tokens, one extend of 400 tokens on 1500, 4 prefills of 300–1200. On a CPU the
Triton backends run in the interpreter and the step is a small one: the times are then not performance
figures, the command only shows that it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from dataclasses import asdict, dataclass

import torch

from tripath.attention import ForwardContext, WatchedPaths
from tripath.attention.layer_replay import metadata_tensors
from tripath.attention.selector import backend_class, default_block_size, explain
from tripath.attention.spec import AttentionSpec
from tripath.bench.batches import make_step
from tripath.triton_internals import record_launches

MHA_BACKENDS = ("three_path", "two_path", "unified", "mixed")


def tp8_mixed_step(seed: int = 0) -> list[tuple[int, int]]:
    """``(context_len, query_len)`` of the mha-tp8 mixed step: 30 decodes, 1 extend, 4 prefills."""
    rng = random.Random(seed)
    return ([(rng.randint(1000, 3000), 1) for _ in range(30)] + [(1500, 400)]
            + [(0, rng.randint(300, 1200)) for _ in range(4)])


CPU_STEP = [(37, 1), (20, 1), (29, 9), (0, 13)]


@dataclass
class HostTimes:
    backend: str
    launches: int | None  # in one recorded forward (None: the recording was refused)
    refused: str | None  # why the recording was refused
    forward_us: float
    record_us: float  # watching the forward's PyTorch operations
    record_unwatched_us: float
    replay_us: float | None
    layers: int
    layers_forward_us: float  # every layer runs its forward
    layers_replayed_us: float  # the first layer records (watched), the others replay
    layers_replayed_unwatched_us: float  # the same on a code path watched before, as in the engine's steps


def _host_us(fn, device: torch.device, reps: int) -> float:
    for _ in range(min(3, reps)):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    seconds = (time.perf_counter() - start) / reps
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return seconds * 1e6


def measure(spec: AttentionSpec, requests, backend_name: str, device: torch.device, *, layers: int = 4,
            reps: int = 100) -> HostTimes:
    """Host times of ``backend_name``'s attention on the step of ``requests`` (see the module doc)."""
    backend = backend_class(backend_name)(spec, device)
    step = make_step(spec, requests, backend, device=device, fill_context=False)
    meta = backend.build_metadata(step.plan, step.block_table, step.slot_mapping)
    caches = [step.fresh_cache() for _ in range(layers)]
    q, k, v = step.q, step.k, step.v
    out = torch.empty(q.shape[0], q.shape[1], spec.v_size, dtype=q.dtype, device=device)

    def swaps(cache):
        return cache.k_cache, cache.v_cache, cache.k_scale, cache.v_scale, None, None

    def forward():
        return backend.forward(q, k, v, caches[0], meta, out=out)

    _, sequence, refused = record_launches(forward, swaps(caches[0]), metadata_tensors(meta))

    def run_layers(replay: bool, watched: WatchedPaths | None = None):
        def run():
            ctx = ForwardContext(backend, meta, caches, replay_launches=replay, watched=watched)
            for layer in range(layers):
                ctx.attend(layer, q, k, v, out=out)
        return run

    return HostTimes(
        backend=backend_name, launches=len(sequence) if sequence is not None else None, refused=refused,
        forward_us=_host_us(forward, device, reps),
        record_us=_host_us(lambda: record_launches(forward, swaps(caches[0]), metadata_tensors(meta)), device, reps),
        record_unwatched_us=_host_us(lambda: record_launches(forward, swaps(caches[0]), watch=False), device, reps),
        replay_us=_host_us(lambda: sequence.replay(swaps(caches[1 % layers])), device, reps)
        if sequence is not None else None,
        layers=layers, layers_forward_us=_host_us(run_layers(False), device, reps),
        layers_replayed_us=_host_us(run_layers(True), device, reps),
        layers_replayed_unwatched_us=_host_us(run_layers(True, WatchedPaths()), device, reps))  # warm-up calls watch


def format_times(rows: list[HostTimes], where: str) -> str:
    lines = [f"tripath bench host on {where}: host time of one step's attention (µs)", "",
             f"| backend | launches | forward | recording | recording, unwatched | replay | {rows[0].layers} layers, "
             f"each its forward | replayed | replayed, unwatched |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        launches = r.launches if r.launches is not None else f"refused: {r.refused}"
        replay = f"{r.replay_us:.1f}" if r.replay_us is not None else "-"
        lines.append(f"| {r.backend} | {launches} | {r.forward_us:.1f} | {r.record_us:.1f} | "
                     f"{r.record_unwatched_us:.1f} | {replay} | {r.layers_forward_us:.1f} | "
                     f"{r.layers_replayed_us:.1f} | {r.layers_replayed_unwatched_us:.1f} |")
    return "\n".join(lines)


def main_host(argv=None) -> int:
    from tripath.bench import device_argument
    from tripath.models.presets import PRESETS

    parser = argparse.ArgumentParser(prog="tripath bench host", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-235b-attn-tp8",
                        help="preset whose attention shape the step takes (GPU; default qwen3-235b-attn-tp8)")
    parser.add_argument("--backends", default=",".join(MHA_BACKENDS), help="comma-separated MHA backends")
    parser.add_argument("--layers", type=int, default=4, help="layers of the step (default 4)")
    parser.add_argument("--reps", type=int, default=None, help="timed calls each (default 100 on a GPU, 2 on a CPU)")
    parser.add_argument("--device", type=device_argument, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, cuda or cuda:N (default: cuda when a GPU is visible)")
    parser.add_argument("--json", help="write the rows as JSON")
    args = parser.parse_args(argv)
    device = args.device
    if args.layers < 2:
        parser.error(f"--layers must be at least 2, got {args.layers}")
    on_gpu = device.type == "cuda"
    if on_gpu:
        if args.model not in PRESETS:
            parser.error(f"--model {args.model!r} is not a preset; presets: {', '.join(sorted(PRESETS))}")
        config = PRESETS[args.model]()
        if config.mla is not None:
            parser.error(f"--model {args.model!r} is an MLA model; this command times the MHA backends")
        spec = AttentionSpec(config.num_heads, config.num_kv_heads, config.head_size, dtype=torch.bfloat16)
        requests = tp8_mixed_step()
    else:
        spec, requests = AttentionSpec(4, 2, 32, dtype=torch.float16), CPU_STEP
    names = [n.strip() for n in args.backends.split(",") if n.strip()]
    unknown = [n for n in names if n not in MHA_BACKENDS]
    if unknown:
        parser.error(f"--backends: {', '.join(unknown)} not among {', '.join(MHA_BACKENDS)}")
    reasons = explain(spec, device)
    rows = []
    for name in names:
        if reasons.get(name):
            print(f"{name}: skipped ({'; '.join(reasons[name])})")
            continue
        block_spec = dataclasses.replace(spec, block_size=default_block_size(name, False, device))
        rows.append(measure(block_spec, requests, name, device, layers=args.layers,
                            reps=args.reps or (100 if on_gpu else 2)))
    if not rows:
        parser.error("no backend can run here")
    where = torch.cuda.get_device_name(device) if on_gpu else \
        "CPU (Triton backends in the interpreter: times are not performance figures)"
    print(format_times(rows, where))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0

