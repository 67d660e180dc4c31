"""Engine settings, validated on construction (each error names the setting and what is allowed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tripath.constants import KV_CACHE_DTYPES, KV_LAYOUTS
from tripath.engine.config.speculative import SpeculativeConfig
from tripath.engine.requests.structured_output import DEFAULT_CACHE_MB as DEFAULT_GRAMMAR_CACHE_MB
from tripath.engine.requests.structured_output import DEFAULT_COMPILE_TIMEOUT_S as DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S

DTYPES = {"float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float32": torch.float32, "float": torch.float32, "fp32": torch.float32}   # vLLM's names and short ones
CPU_DEFAULT_KV_BLOCKS = 1024  # without a GPU to measure, the cache size when num_kv_blocks is not given
DEFAULT_CPU_TARGET_S = 0.5    # the CPU's default step time: long prompts are chunked to about this


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """``None``/``"auto"``: bfloat16 on a GPU, float32 on the CPU; names such as ``"float16"`` accepted."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; supported: auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype={dtype} is not supported; supported: float16, bfloat16, float32")
    return dtype


def resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device={device} is not supported; supported: cuda (NVIDIA or ROCm), cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device} was asked for but torch sees no GPU")
    return device


@dataclass
class EngineConfig:
    """How the engine batches, caches and runs.

    ``max_num_batched_tokens``: new tokens per step (the scheduler's budget). ``max_num_seqs``: requests
    running at once. ``max_model_len``: longest prompt + output (None: the model's ``max_position``).
    ``block_size``: KV cache rows per block, one the backend takes (``Capabilities.block_sizes``: powers of
    two up to 256); None: the backend's preference (:func:`tripath.attention.default_block_size`: 64 for
    MLA models on a GPU, else 16). KV cache: ``num_kv_blocks`` blocks (block 0 reserved) if given, else as
    many as fit in ``gpu_memory_utilization`` of the GPU after the weights and a warm-up step (on the CPU,
    ``CPU_DEFAULT_KV_BLOCKS``). ``enforce_eager`` turns CUDA graphs off; graphs are captured for decode-only
    steps of padded batch sizes up to ``max_cuda_graph_batch_size`` and, with ``mixed_cuda_graphs``, for
    the other steps too, per padded token count (:meth:`mixed_cuda_graph_sizes`): the layers between
    attention calls, attention eager between the replays (:mod:`tripath.engine.runner.mixed_graphs`, where the
    largest eager step measures host-bound at start), or the whole step for the ``mixed`` backend
    (:mod:`tripath.engine.runner.whole_step_graphs`); one rank, not for models with mixture-of-experts layers. ``calculate_kv_scales`` (fp8 KV
    cache only): the first step's keys and values set each layer's cache scales (amax / fp8 max) instead
    of 1.0, so layers whose keys or values exceed e4m3's ±448 are not clipped. ``warmup`` (GPU): compile
    every kernel variant the limits allow before the engine serves (:mod:`tripath.engine.runner.warmup`), so no
    request waits for a compilation; ``compile_workers``: child processes that compile those variants in
    parallel when the Triton cache is empty (:mod:`tripath.triton_internals.compile_pool`; None: one per CPU
    core less one, at most 16; 1: one after the other in the engine's process). ``async_scheduling``:
    schedule and launch each step before reading the previous step's tokens, so the host's work overlaps the
    device's (one rank; a tensor-parallel engine runs its steps one after the other). Outputs are the same either way; a
    request that stops on a stop token costs one extra step of compute. ``decode_steps``: when a step would
    hold decodes alone and no waiting request could be admitted, it runs up to this many model steps back to
    back on the device, each step's sampled tokens feeding the next (multi-step decoding: the host schedules,
    builds inputs and reads tokens once per ``decode_steps`` tokens; one rank, a backend whose forward reads
    only device tensors). Outputs are the same; a request arriving meanwhile waits for the run to end, tokens
    reach the caller ``decode_steps`` at a time, and a request that stops early in the run computes the rest
    of it for nothing. 1 turns it off. ``generation_config``: where the defaults of unset sampling fields come
    from — ``"auto"``, the model's ``generation_config.json``; ``"vllm"``, none (``SamplingParams``' own); or a
    folder holding a ``generation_config.json`` (:mod:`tripath.engine.sampling.generation_defaults`).
    ``grammar_cache_mb``: the structured outputs' compiled grammars kept for reuse (least recently used
    evicted; 0: none kept); ``grammar_compile_timeout_s``: how long a server lets a request wait for its
    grammar to compile before refusing it (:class:`tripath.engine.requests.structured_output.GrammarCompiler`).
    ``step_time_target_s``: the step time the token budget follows (:mod:`tripath.engine.scheduling.step_pacing`: it
    starts at 256 tokens and long prompts are chunked so that one step takes about this long, never more
    tokens than ``max_num_batched_tokens``); None: 0.5 s on the CPU, off on a GPU; 0: off.
    ``speculative_config``: speculative decoding (:mod:`tripath.engine.speculative`), a
    :class:`~tripath.engine.config.speculative.SpeculativeConfig`, its dict or the dict's JSON text; None: off.
    With it on, steps run one after the other (no ``async_scheduling``, ``decode_steps`` 1).
    ``fused_sampling``: whether steps whose requests allow it draw their tokens straight from the LM head,
    without writing logits (:mod:`tripath.engine.sampling.fused_sampling`): ``"auto"`` where a measurement at start on
    the GPU found it faster, per bucket of row counts (never on the CPU); ``"on"`` wherever the requests
    allow; ``"off"`` never. ``skinny_gemms``: which GEMM runs the layers' projections of at most 256 rows
    (decode steps): ``"off"`` (the default), cuBLAS (``F.linear``) everywhere; ``"auto"``, on a GPU, times
    cuBLAS and tripath's split-K Triton GEMM on the model's weights at start and takes the faster per weight
    shape and class of row counts (:mod:`tripath.ops.linear_routes`; the routes hold for the process).
    """

    backend: str = "auto"
    dtype: torch.dtype | str | None = None
    device: torch.device | str | None = None
    block_size: int | None = None
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    kv_layout: str = "nhd"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False
    max_cuda_graph_batch_size: int = 128
    mixed_cuda_graphs: bool = True
    warmup: bool = True
    compile_workers: int | None = None
    async_scheduling: bool = True
    decode_steps: int = 8
    seed: int = 0
    generation_config: str = "auto"
    grammar_cache_mb: int = DEFAULT_GRAMMAR_CACHE_MB
    grammar_compile_timeout_s: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S
    step_time_target_s: float | None = None
    speculative_config: SpeculativeConfig | dict | str | None = None
    fused_sampling: str = "auto"
    skinny_gemms: str = "off"

    def __post_init__(self):
        self.device = resolve_device(self.device)
        self.dtype = resolve_dtype(self.dtype, self.device)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_cuda_graph_batch_size",
                     "decode_steps"):
            value = getattr(self, name)
            if name == "block_size" and value is None:
                continue  # the runner takes the backend's preference (tripath.attention.default_block_size)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.compile_workers is not None and (not isinstance(self.compile_workers, int)
                                                 or isinstance(self.compile_workers, bool)
                                                 or self.compile_workers < 1):
            raise ValueError(f"compile_workers must be a positive int or None, got {self.compile_workers!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an int >= 2 or None, got {self.max_model_len!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; supported: "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if not isinstance(self.calculate_kv_scales, bool):
            raise TypeError(f"calculate_kv_scales must be a bool, got {type(self.calculate_kv_scales).__name__}")
        if self.calculate_kv_scales and self.kv_cache_dtype != "fp8":
            raise ValueError("calculate_kv_scales=True needs kv_cache_dtype='fp8' (only fp8 caches have scales)")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout={self.kv_layout!r} is not supported; supported: {', '.join(KV_LAYOUTS)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2):
            raise ValueError(f"num_kv_blocks must be an int >= 2 (block 0 is reserved) or None, "
                             f"got {self.num_kv_blocks!r}")
        for name in ("warmup", "async_scheduling", "mixed_cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        if isinstance(self.grammar_cache_mb, bool) or not isinstance(self.grammar_cache_mb, int) or \
                self.grammar_cache_mb < 0:
            raise ValueError(f"grammar_cache_mb must be an int >= 0, got {self.grammar_cache_mb!r}")
        if isinstance(self.grammar_compile_timeout_s, bool) or \
                not isinstance(self.grammar_compile_timeout_s, (int, float)) or \
                not 0 < self.grammar_compile_timeout_s < float("inf"):
            raise ValueError(f"grammar_compile_timeout_s must be a finite number of seconds > 0, got "
                             f"{self.grammar_compile_timeout_s!r}")
        target = self.step_time_target_s
        if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))
                                   or not 0 <= target < float("inf")):
            raise ValueError(f"step_time_target_s must be a finite number of seconds >= 0 (0: off) or None, got "
                             f"{target!r}")
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        if self.fused_sampling not in ("auto", "on", "off"):
            raise ValueError(f"fused_sampling must be 'auto', 'on' or 'off', got {self.fused_sampling!r}")
        if self.skinny_gemms not in ("auto", "off"):
            raise ValueError(f"skinny_gemms must be 'auto' or 'off', got {self.skinny_gemms!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise TypeError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")

    @property
    def step_pacing_s(self) -> float:
        """The step time the token budget follows (0: none): ``step_time_target_s``, by default
        :data:`DEFAULT_CPU_TARGET_S` on the CPU."""
        if self.step_time_target_s is not None:
            return float(self.step_time_target_s)
        return DEFAULT_CPU_TARGET_S if self.device.type == "cpu" else 0.0

    @property
    def use_cuda_graphs(self) -> bool:
        return self.device.type == "cuda" and not self.enforce_eager

    def mixed_cuda_graph_sizes(self) -> list[int]:
        """Padded token counts of steps with prompt tokens that get piecewise graphs: powers of two from 16
        to 1024, then multiples of 1024, up to ``max_num_batched_tokens`` (included)."""
        top = self.max_num_batched_tokens
        sizes = [n for n in (16, 32, 64, 128, 256, 512) if n < top] + list(range(1024, top, 1024))
        return sorted(set(sizes + [top]))

    def cuda_graph_batch_sizes(self) -> list[int]:
        """Padded decode batch sizes that get a graph: 1, 2, 4, 8, then multiples of 16."""
        top = min(self.max_num_seqs, self.max_cuda_graph_batch_size)
        sizes = [b for b in (1, 2, 4, 8) if b < top] + list(range(16, top, 16))
        return sorted(set(sizes + [top]))
