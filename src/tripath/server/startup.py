"""The server's start-up log line: what was built and how (model, served names, dtype and device, the
attention backend and why ``auto`` chose it, the KV cache, the scheduler's limits, CUDA graphs, warm-up and
start times, the sampling defaults taken from the model's ``generation_config.json``)."""

from __future__ import annotations

from typing import Sequence

from tripath import _env
from tripath.engine.generation_defaults import usable_defaults


def _backend(llm) -> str:
    name = llm.backend_name
    if _env.attention_backend_override():
        return f"{name} (TRIPATH_ATTENTION_BACKEND)"
    if llm.config.backend != "auto":
        return f"{name} (asked for)"
    rejected = getattr(llm.runner.backend, "rejected", None) or {}
    if not rejected:
        return f"{name} (auto: the first candidate)"
    why = "; ".join(f"{other} not: {', '.join(reasons)}" for other, reasons in rejected.items())
    return f"{name} (auto; {why})"


def _graphs(llm) -> str:
    runner = llm.runner
    decode = sorted(runner.decode_graphs.graphs) if runner.decode_graphs is not None else []
    mixed = getattr(runner, "mixed_graphs", None)
    if not decode and mixed is None:
        reason = ("enforce_eager" if llm.config.enforce_eager else "not on a GPU" if llm.config.device.type != "cuda"
                  else f"the {llm.backend_name} backend takes none")
        return f"CUDA graphs off ({reason})"
    text = f"CUDA graphs: decode {len(decode)} batch sizes ({decode[0]}..{decode[-1]})" if decode else \
        "CUDA graphs: decode none"
    if mixed is not None:
        text += f", mixed {len(mixed.sizes)} token counts ({mixed.sizes[0]}..{mixed.sizes[-1]})"
    else:
        share = getattr(runner, "largest_step_host_share", None)
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


def startup_summary(llm, model: str, served_names: Sequence[str]) -> str:
    """One line describing the built engine ``llm`` of ``model``, served as ``served_names``."""
    runner, config = llm.runner, llm.config
    blocks, block_size = runner.num_blocks - 1, runner.block_size   # block 0 is reserved
    warmup = getattr(runner, "warmup_report", None)
    parts = [
        f"model {model}" + (f" ({llm.model_path})" if llm.model_path not in (None, model) else ""),
        f"served as {', '.join(served_names)}",
        f"{str(config.dtype).removeprefix('torch.')} on {config.device}"
        + (f", tensor parallel {runner.tensor_parallel_size}" if hasattr(runner, "tensor_parallel_size") else ""),
        f"backend {_backend(llm)}",
        f"KV cache {blocks} blocks x {block_size} tokens = {blocks * block_size} tokens"
        + (f" ({config.kv_cache_dtype})" if config.kv_cache_dtype != "auto" else ""),
        f"max_model_len {runner.max_model_len}, max_num_seqs {config.max_num_seqs}, max_num_batched_tokens "
        f"{config.max_num_batched_tokens}",
        _graphs(llm),
        f"warm-up {warmup.seconds:.1f} s" if warmup is not None else "no warm-up",
        f"start {llm.start_seconds:.1f} s",
        sampling_defaults_text(llm.generation_defaults, config.generation_config),
    ]
    return " | ".join(parts)


def cache_config(llm) -> dict[str, str]:
    """The KV cache's settings as the labels of ``vllm:cache_config_info`` (vLLM's label names; values as
    vLLM writes them: ``str()`` of each, ``None`` for unset). ``num_gpu_blocks`` counts every block allocated,
    the reserved block 0 included (vLLM's counts its null block too), on whatever device the cache lives."""
    config, runner = llm.config, llm.runner
    return {"block_size": str(runner.block_size), "cache_dtype": str(config.kv_cache_dtype),
            "calculate_kv_scales": str(config.calculate_kv_scales),
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "gpu_memory_utilization": str(config.gpu_memory_utilization), "num_gpu_blocks": str(runner.num_blocks),
            "num_gpu_blocks_override": str(config.num_kv_blocks)}
