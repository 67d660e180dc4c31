"""The engine's command-line options, shared by ``tripath generate`` and ``tripath serve``.

:func:`add_engine_arguments` adds them to a parser; :func:`engine_options` turns the parsed values into the
keyword arguments of :class:`tripath.engine.LLM` (its :class:`~tripath.engine.config.EngineConfig` fields
and ``tensor_parallel_size``).
"""

from __future__ import annotations

import argparse

from tripath.constants import KV_CACHE_DTYPES


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--backend", default="auto",
                       help="attention backend: auto, three_path, unified, two_path, torch, mla, mla_triton")
    group.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPU, float32 on CPU), float16, ...")
    group.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    group.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    group.add_argument("--calculate-kv-scales", action="store_true",
                       help="fp8 KV cache: set each layer's scales from the first step (default: 1.0)")
    group.add_argument("--block-size", type=int, default=None,
                       help="KV cache rows per block, a power of two up to 256 (default: the backend's "
                            "preference, 64 for MLA models on a GPU, else 16)")
    group.add_argument("--num-kv-blocks", type=int, default=None)
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-num-batched-tokens", type=int, default=8192)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--no-prefix-caching", action="store_true")
    group.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    group.add_argument("--no-mixed-cuda-graphs", action="store_true",
                       help="run steps with prompt tokens eagerly (default: piecewise CUDA graphs around attention)")
    group.add_argument("--no-async-scheduling", action="store_true",
                       help="read each step's tokens before scheduling the next (default: overlap them)")
    group.add_argument("--decode-steps", type=int, default=8,
                       help="model steps a step of decodes alone runs back to back on the device (multi-step "
                            "decoding; 1: off)")
    group.add_argument("--compile-workers", type=int, default=None,
                       help="processes that compile the warm-up's kernels with an empty Triton cache (default: "
                            "one per CPU core less one, at most 16; 1: in the engine's process)")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="shard the model over N ranks (GPUs 0..N-1, or N CPU processes); workers are spawned")


def engine_options(args: argparse.Namespace) -> dict:
    """``LLM(model, **engine_options(args))``."""
    return dict(backend=args.backend, dtype=args.dtype, device=args.device, kv_cache_dtype=args.kv_cache_dtype,
                calculate_kv_scales=args.calculate_kv_scales, block_size=args.block_size,
                num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
                enforce_eager=args.enforce_eager, mixed_cuda_graphs=not args.no_mixed_cuda_graphs,
                async_scheduling=not args.no_async_scheduling,
                decode_steps=args.decode_steps, compile_workers=args.compile_workers, seed=args.seed,
                tensor_parallel_size=args.tensor_parallel_size)
