"""The engine's command-line options, shared by ``tripath generate`` and ``tripath serve``.

:func:`add_engine_arguments` adds them to a parser; :func:`engine_options` turns the parsed values into the
keyword arguments of :class:`tripath.engine.LLM` (its :class:`~tripath.engine.config.EngineConfig` fields and
``tensor_parallel_size``; ``--tokenizer`` is ``args.tokenizer``, LLM's ``tokenizer=``). Token counts
(``--max-model-len``, ``--max-num-batched-tokens``) take sizes as vLLM does (:func:`token_count`).
:class:`HelpFormatter` shows every option's default in ``-h``.
"""

from __future__ import annotations

import argparse
import re

from tripath.constants import KV_CACHE_DTYPES
from tripath.engine.config import DEFAULT_GRAMMAR_CACHE_MB, DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S, DTYPES
from tripath.engine.speculative import SpeculativeConfig

FP8_KV_ALIASES = ("fp8_e4m3",)   # vLLM's name of tripath's fp8 KV cache
DECIMAL_SUFFIXES = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12}
BINARY_SUFFIXES = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)")


def token_count(text: str) -> int:
    """A token count as vLLM's command line reads one: an integer, or a number with a suffix, lowercase
    decimal (``k`` = 1000, ``m`` = 10^6, ``g``, ``t``; decimals allowed: ``25.6k`` = 25600) or uppercase binary
    (``K`` = 1024, ``M`` = 2^20, ``G``, ``T``; whole numbers only: ``32K`` = 32768). An
    ``argparse.ArgumentTypeError`` (argparse names the option) for anything else."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a token count: give an integer, or one with a suffix k/m/g/t (x 1000, 10^6, ...; "
            "4k = 4000) or K/M/G/T (x 1024, 2^20, ...; 32K = 32768)")
    number, suffix = match.groups()
    if suffix in BINARY_SUFFIXES:
        if "." in number:
            raise argparse.ArgumentTypeError(f"{text!r}: binary suffixes take whole numbers (a decimal takes "
                                             f"{suffix.lower()}: {number}{suffix.lower()})")
        return int(number) * BINARY_SUFFIXES[suffix]
    if suffix:
        return int(float(number) * DECIMAL_SUFFIXES[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
    return int(number)


def speculative_config(text: str) -> SpeculativeConfig:
    """``--speculative-config``'s JSON, checked (an ``argparse.ArgumentTypeError`` says what is wrong)."""
    try:
        return SpeculativeConfig.of(text)
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written, and ``(default: X)`` after each option's help, unless the help names its
    default already or there is none to show (None, an empty list, a flag that is off)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is False or default is argparse.SUPPRESS or \
                default == [] or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--tokenizer", default=None,
                       help="a tokenizer directory or Hugging Face hub id to use instead of the model's own")
    group.add_argument("--backend", default="auto",
                       help="attention backend: auto, three_path, unified, two_path, torch, mla, mla_triton")
    group.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                       help="weights' and activations' type: auto (bfloat16 on a GPU, float32 on the CPU), vLLM's "
                            "names (half, float16, bfloat16, float, float32) or fp16 / bf16 / fp32")
    group.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    group.add_argument("--kv-cache-dtype", default="auto", choices=(*KV_CACHE_DTYPES, *FP8_KV_ALIASES, "fp8_e5m2"),
                       help="KV cache element type: auto (the model's), fp8 (e4m3, per-tensor scales; fp8_e4m3 "
                            "is the same)")
    group.add_argument("--calculate-kv-scales", action="store_true",
                       help="fp8 KV cache: set each layer's scales from the first step (default: 1.0)")
    group.add_argument("--block-size", type=int, default=None,
                       help="KV cache rows per block, a power of two up to 256 (default: the backend's "
                            "preference, 64 for MLA models on a GPU, else 16)")
    group.add_argument("--num-kv-blocks", type=int, default=None,
                       help="KV cache blocks (default: as many as fit in --gpu-memory-utilization on a GPU, "
                            "1024 on the CPU)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="fraction of the GPU's memory the engine may hold")
    group.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once")
    group.add_argument("--max-num-batched-tokens", type=token_count, default=8192,
                       help="new tokens per step, an integer or a size (see --max-model-len)")
    group.add_argument("--max-model-len", type=token_count, default=None,
                       help="longest prompt + output, in tokens: an integer or a size, k = 1000 and K = 1024 as "
                            "in vLLM (4k = 4000, 32K = 32768, 1M = 1048576; default: the model's max position)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse the KV blocks of prompts' common prefixes (vLLM's flag; "
                            "--no-enable-prefix-caching or --no-prefix-caching turn it off)")
    group.add_argument("--no-prefix-caching", action="store_false", dest="enable_prefix_caching",
                       help="turn the prefix cache off")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                       help="split long prompts over steps within --max-num-batched-tokens (vLLM's flag; "
                            "--no-enable-chunked-prefill: a prompt runs whole in one step)")
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
    group.add_argument("--step-time-target", type=float, default=None, metavar="SECONDS",
                       help="fit the token budget of each step to about this time, chunking long prompts (default: "
                            "0.5 on the CPU, off on a GPU; 0: off)")
    group.add_argument("--seed", type=int, default=0, help="seed of requests that give none")
    group.add_argument("--grammar-cache-mb", type=int, default=DEFAULT_GRAMMAR_CACHE_MB, metavar="MB",
                       help="structured output: compiled grammars kept for reuse, least recently used evicted "
                            "(0: none)")
    group.add_argument("--grammar-compile-timeout", type=float, default=DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
                       metavar="SECONDS",
                       help="structured output: a request whose grammar has not compiled in this time is refused "
                            "(400); grammars compile on their own threads while the engine serves the others")
    group.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON",
                       help='speculative decoding, as vLLM takes it: \'{"method": "ngram", '
                            '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' (default: off)')
    group.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                       help="shard the model over N ranks (GPUs 0..N-1, or N CPU processes); workers are spawned")
    add_vllm_loading_arguments(parser)


def add_vllm_loading_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's options for where a model comes from and how it runs that tripath takes with vLLM's meaning, or
    accepts and refuses the values it cannot honour (:func:`check_engine_arguments`)."""
    group = parser.add_argument_group("model loading (vLLM's options)")
    group.add_argument("--revision", default=None,
                       help="the Hugging Face hub repository's branch, tag or commit to load (default: main)")
    group.add_argument("--download-dir", default=None,
                       help="the Hugging Face cache to read hub models from and download them into (default: "
                            "HF_HUB_CACHE)")
    group.add_argument("--load-format", default="auto", help="auto or safetensors: the weights tripath reads")
    group.add_argument("--tokenizer-mode", default="auto", help="auto (or hf): the model's Hugging Face tokenizer")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="accepted for vLLM's command lines: tripath runs its own model code, never a "
                            "repository's, so it changes nothing")
    group.add_argument("-q", "--quantization", default=None,
                       help="none only: tripath runs the weights as they are stored (an fp8 KV cache: "
                            "--kv-cache-dtype fp8)")
    group.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1,
                       help="1 only: tripath shards models by tensor parallelism (--tensor-parallel-size)")
    group.add_argument("-dp", "--data-parallel-size", type=int, default=1,
                       help="1 only: run one tripath server per replica behind a load balancer")
    group.add_argument("--swap-space", type=float, default=None, metavar="GIB",
                       help="accepted for vLLM's command lines: a preempted request is recomputed, never "
                            "swapped, so it changes nothing")
    group.add_argument("--distributed-executor-backend", default=None,
                       help="mp (tripath's own processes) or uni; ray is not supported")


LOAD_FORMATS = ("auto", "safetensors")
TOKENIZER_MODES = ("auto", "hf")
EXECUTOR_BACKENDS = ("mp", "uni")


def check_engine_arguments(args: argparse.Namespace) -> str | None:
    """Why the engine options of ``args`` cannot be honoured (a message naming the option and what tripath
    does instead), or None."""
    if args.kv_cache_dtype == "fp8_e5m2":
        return "--kv-cache-dtype fp8_e5m2 is not supported: tripath's fp8 KV cache is e4m3 (fp8, fp8_e4m3)"
    if args.load_format not in LOAD_FORMATS:
        return (f"--load-format {args.load_format} is not supported: tripath reads safetensors weights "
                f"({', '.join(LOAD_FORMATS)}); for random weights of a model's shapes, use a preset")
    if args.tokenizer_mode not in TOKENIZER_MODES:
        return (f"--tokenizer-mode {args.tokenizer_mode} is not supported: tripath uses the model's Hugging Face "
                f"tokenizer ({', '.join(TOKENIZER_MODES)})")
    if args.quantization not in (None, "none", "None"):
        return (f"--quantization {args.quantization} is not supported: tripath runs the weights as they are "
                "stored (float16, bfloat16, float32); an fp8 KV cache is --kv-cache-dtype fp8")
    if args.pipeline_parallel_size != 1:
        return (f"--pipeline-parallel-size {args.pipeline_parallel_size} is not supported: tripath shards a model "
                "by tensor parallelism (--tensor-parallel-size)")
    if args.data_parallel_size != 1:
        return (f"--data-parallel-size {args.data_parallel_size} is not supported: run one tripath server per "
                "replica behind a load balancer")
    if args.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
        return (f"--distributed-executor-backend {args.distributed_executor_backend} is not supported: tripath "
                f"starts its own rank processes ({', '.join(EXECUTOR_BACKENDS)})")
    return None


def engine_options(args: argparse.Namespace) -> dict:
    """``LLM(model, tokenizer=args.tokenizer, **engine_options(args))``."""
    kv_cache_dtype = "fp8" if args.kv_cache_dtype in FP8_KV_ALIASES else args.kv_cache_dtype
    return dict(backend=args.backend, dtype=args.dtype, device=args.device, kv_cache_dtype=kv_cache_dtype,
                calculate_kv_scales=args.calculate_kv_scales, block_size=args.block_size,
                num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
                enable_chunked_prefill=args.enable_chunked_prefill, revision=args.revision,
                download_dir=args.download_dir,
                enforce_eager=args.enforce_eager, mixed_cuda_graphs=not args.no_mixed_cuda_graphs,
                async_scheduling=not args.no_async_scheduling,
                decode_steps=args.decode_steps, compile_workers=args.compile_workers, seed=args.seed,
                grammar_cache_mb=args.grammar_cache_mb, grammar_compile_timeout_s=args.grammar_compile_timeout,
                step_time_target_s=args.step_time_target, speculative_config=args.speculative_config,
                tensor_parallel_size=args.tensor_parallel_size)
