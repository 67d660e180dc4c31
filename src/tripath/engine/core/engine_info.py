"""What a built engine is (:class:`EngineInfo`, from :meth:`tripath.engine.core.engine_core.EngineCore.info`): its limits,
sampling defaults, attention backend and why it was chosen, KV cache, CUDA graphs and start timings. Plain
values only (picklable, comparable), so a server reads them, sends them to another process and logs them
without touching the engine's parts."""

from __future__ import annotations

from dataclasses import dataclass, field

from tripath import _env


@dataclass(frozen=True)
class EngineInfo:
    """A built engine's facts (they do not change while it runs).

    Model: ``model`` (the local directory or preset it was loaded from; None for a model object),
    ``vocab_size``, ``dtype`` (``"bfloat16"``), ``device`` (``"cuda:0"``, ``"cpu"``), ``tensor_parallel_size``.
    Limits: ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``; ``decode_steps``: the model steps
    a step of decodes alone may take (multi-step decoding; 1: off). Sampling: ``generation_defaults`` (the
    model's ``generation_config.json`` values, all of them) and ``generation_config`` (the setting that chose
    them: ``auto``, ``vllm`` or a folder). Backend: ``backend`` (its name) and ``backend_choice`` (why:
    ``asked for``, ``TRIPATH_ATTENTION_BACKEND``, or ``auto`` with the candidates it passed over). KV cache: ``num_kv_blocks`` blocks allocated (block 0, reserved, included) of ``block_size``
    tokens, ``kv_cache_dtype``, and the settings it was sized with (``num_kv_blocks_override``,
    ``gpu_memory_utilization``, ``enable_prefix_caching``, ``calculate_kv_scales``). CUDA graphs:
    ``decode_graph_sizes`` (batch sizes), ``mixed_graph_sizes`` (token counts; None: not captured),
    ``largest_step_host_share`` (the host's share of the largest eager step, timed at start; None: not timed),
    ``enforce_eager``. Sampling straight from the LM head (:mod:`tripath.engine.sampling.fused_sampling`):
    ``fused_sampling`` (the setting and how it was decided; ``"off"`` where the fused path is never taken) and
    ``fused_sampling_buckets`` (``(rows up to, greedy steps fused, sampled steps fused)`` per bucket of row
    counts). The projections' GEMMs (:mod:`tripath.ops.linear_routes`): ``gemm_routes``, ``(N, K, rows up to,
    cuBLAS µs, Triton split-K µs, Triton taken)`` per weight shape and row class as timed at start (empty
    with ``skinny_gemms="off"`` or on the CPU). Start: ``warmup_seconds`` (None: no warm-up ran), ``start_seconds``
    and ``start_phases`` (``(phase, seconds)`` of :data:`tripath.engine.runner.startup.PHASES`, in order).
    """

    model: str | None
    vocab_size: int
    dtype: str
    device: str
    tensor_parallel_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    decode_steps: int
    backend: str
    backend_choice: str
    num_kv_blocks: int
    block_size: int
    kv_cache_dtype: str
    num_kv_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.0
    enable_prefix_caching: bool = True
    calculate_kv_scales: bool = False
    decode_graph_sizes: tuple[int, ...] = ()
    mixed_graph_sizes: tuple[int, ...] | None = None
    largest_step_host_share: float | None = None
    enforce_eager: bool = False
    warmup_seconds: float | None = None
    start_seconds: float = 0.0
    start_phases: tuple[tuple[str, float], ...] = ()
    generation_defaults: dict = field(default_factory=dict)
    generation_config: str = "auto"
    fused_sampling: str = "off"
    fused_sampling_buckets: tuple[tuple[int, bool, bool], ...] = ()
    gemm_routes: tuple[tuple[int, int, int, float, float, bool], ...] = ()

    @property
    def num_usable_kv_blocks(self) -> int:
        """The blocks requests may hold (block 0 is reserved)."""
        return self.num_kv_blocks - 1

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")


def backend_choice(backend, asked: str) -> str:
    """Why ``backend`` runs the engine: the environment's override, the configuration's ``asked`` name, or
    ``auto`` (naming the candidates it rejected before it, with their reasons)."""
    if _env.attention_backend_override():
        return "TRIPATH_ATTENTION_BACKEND"
    if asked != "auto":
        return "asked for"
    rejected = getattr(backend, "rejected", None) or {}
    if not rejected:
        return "auto: the first candidate"
    return "auto; " + "; ".join(f"{other} not: {', '.join(reasons)}" for other, reasons in rejected.items())


def describe_engine(runner, config, *, model: str | None, vocab_size: int, decode_steps: int,
                    start_seconds: float, generation_defaults: dict) -> EngineInfo:
    """The :class:`EngineInfo` of an engine whose executor is ``runner`` (a ``ModelRunner`` or a
    ``ParallelExecutor``) built with ``config`` (an :class:`~tripath.engine.config.EngineConfig`)."""
    decode = getattr(runner, "decode_graphs", None)
    mixed = getattr(runner, "mixed_graphs", None)
    warmup = getattr(runner, "warmup_report", None)
    fused = getattr(runner, "fused_sampling", None)
    return EngineInfo(
        model=model, vocab_size=int(vocab_size), dtype=str(config.dtype).removeprefix("torch."),
        device=str(config.device), tensor_parallel_size=int(getattr(runner, "tensor_parallel_size", 1)),
        max_model_len=int(runner.max_model_len), max_num_seqs=int(config.max_num_seqs),
        max_num_batched_tokens=int(config.max_num_batched_tokens), decode_steps=int(decode_steps),
        backend=runner.backend.name, backend_choice=backend_choice(runner.backend, config.backend),
        num_kv_blocks=int(runner.num_blocks), block_size=int(runner.block_size),
        kv_cache_dtype=str(config.kv_cache_dtype), num_kv_blocks_override=config.num_kv_blocks,
        gpu_memory_utilization=config.gpu_memory_utilization, enable_prefix_caching=config.enable_prefix_caching,
        calculate_kv_scales=config.calculate_kv_scales,
        decode_graph_sizes=tuple(sorted(decode.graphs)) if decode is not None else (),
        mixed_graph_sizes=tuple(mixed.sizes) if mixed is not None else None,
        largest_step_host_share=getattr(runner, "largest_step_host_share", None),
        enforce_eager=bool(config.enforce_eager), warmup_seconds=None if warmup is None else warmup.seconds,
        start_seconds=start_seconds, generation_defaults=dict(generation_defaults),
        start_phases=tuple((phase, round(s, 3)) for phase, s in getattr(runner, "start_phase_seconds", {}).items()),
        generation_config=str(config.generation_config),
        fused_sampling="off" if fused is None else fused.how,
        fused_sampling_buckets=() if fused is None else fused.facts(),
        gemm_routes=tuple((t.n, t.k, t.rows, round(t.cublas_us, 2), round(t.triton_us, 2), t.triton)
                          for t in getattr(runner, "gemm_routes", ())))
