"""The server's start-up log line and ``vllm:cache_config_info``'s labels, from the engine's
:class:`~tripath.engine.core.engine_info.EngineInfo`: what was built and how (model, served names, dtype and
device, the attention backend and why ``auto`` chose it, the KV cache, the scheduler's limits, CUDA graphs,
warm-up and start times, the sampling defaults taken from the model's ``generation_config.json``)."""

from __future__ import annotations

from typing import Sequence

from tripath.engine.core.engine_info import EngineInfo
from tripath.engine.sampling.generation_defaults import usable_defaults


def _graphs(info: EngineInfo) -> str:
    decode, mixed = info.decode_graph_sizes, info.mixed_graph_sizes
    if not decode and mixed is None:
        reason = ("enforce_eager" if info.enforce_eager else "not on a GPU" if not info.on_gpu
                  else f"the {info.backend} backend takes none")
        return f"CUDA graphs off ({reason})"
    text = f"CUDA graphs: decode {len(decode)} batch sizes ({decode[0]}..{decode[-1]})" if decode else \
        "CUDA graphs: decode none"
    if mixed is not None:
        text += f", mixed {len(mixed)} token counts ({mixed[0]}..{mixed[-1]})"
    else:
        share = info.largest_step_host_share
        text += ", mixed off" + (f" (the largest step is {share:.0%} host-bound)" if share is not None else "")
    return text


def sampling_defaults_text(defaults: dict, source: str) -> str:
    """The defaults of unset request fields, as the log shows them."""
    if source == "vllm":
        return "sampling defaults: the engine's (--generation-config vllm)"
    if not defaults:
        return "sampling defaults: the engine's (the model's generation_config.json sets none)"
    usable = usable_defaults(defaults)
    text = "sampling defaults from generation_config.json: " + ", ".join(f"{k}={v}" for k, v in usable.items())
    ignored = sorted(set(defaults) - set(usable))
    if ignored:
        text += f" (not implemented by the engine, ignored: {', '.join(f'{k}={defaults[k]}' for k in ignored)})"
    return text


def startup_summary(info: EngineInfo, model: str, served_names: Sequence[str]) -> str:
    """One line describing the built engine (``info``, :meth:`EngineCore.info`) of ``model``, served as
    ``served_names``."""
    blocks, block_size = info.num_usable_kv_blocks, info.block_size
    parts = [
        f"model {model}" + (f" ({info.model})" if info.model not in (None, model) else ""),
        f"served as {', '.join(served_names)}",
        f"{info.dtype} on {info.device}"
        + (f", tensor parallel {info.tensor_parallel_size}" if info.tensor_parallel_size > 1 else ""),
        f"backend {info.backend} ({info.backend_choice})",
        f"KV cache {blocks} blocks x {block_size} tokens = {blocks * block_size} tokens"
        + (f" ({info.kv_cache_dtype})" if info.kv_cache_dtype != "auto" else ""),
        f"max_model_len {info.max_model_len}, max_num_seqs {info.max_num_seqs}, max_num_batched_tokens "
        f"{info.max_num_batched_tokens}",
        _graphs(info),
        f"warm-up {info.warmup_seconds:.1f} s" if info.warmup_seconds is not None else "no warm-up",
        f"start {info.start_seconds:.1f} s" + (" (" + ", ".join(f"{phase} {s:.1f} s" for phase, s in info.start_phases)
                                              + ")" if info.start_phases else ""),
        sampling_defaults_text(info.generation_defaults, info.generation_config),
    ]
    return " | ".join(parts)


def cache_config(info: EngineInfo) -> dict[str, str]:
    """The KV cache's settings as the labels of ``vllm:cache_config_info`` (vLLM's label names; values as
    vLLM writes them: ``str()`` of each, ``None`` for unset). ``num_gpu_blocks`` counts every block allocated,
    the reserved block 0 included (vLLM's counts its null block too), on whatever device the cache lives."""
    return {"block_size": str(info.block_size), "cache_dtype": info.kv_cache_dtype,
            "calculate_kv_scales": str(info.calculate_kv_scales),
            "enable_prefix_caching": str(info.enable_prefix_caching),
            "gpu_memory_utilization": str(info.gpu_memory_utilization), "num_gpu_blocks": str(info.num_kv_blocks),
            "num_gpu_blocks_override": str(info.num_kv_blocks_override)}
