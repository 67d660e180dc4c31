"""Which projections run the split-K GEMM for few rows (:mod:`tripath.models.linear`), measured at start.

With ``skinny_gemm="auto"`` (the default) the start times, on a GPU and before any graph is captured, each
distinct projection weight of the model (its ``(N, K, dtype)``) at each bucket of row counts (powers of two up
to :data:`tripath.ops.skinny_gemm.MAX_ROWS`) both ways, ``F.linear`` and
:func:`~tripath.ops.skinny_gemm.skinny_gemm`, each as a CUDA graph of :data:`TIMED_REPS` calls (the decode
graphs replay them so), and keeps the split-K kernel where it takes at most 97% of the library's time
(:data:`MIN_GAIN`) in :data:`~tripath.models.linear.GEMM_CHOICES`. Every kernel variant a bucket's row counts
take is compiled there. ``"on"`` runs the split-K kernel at every bucket without
measuring (tests); ``"off"`` keeps ``F.linear`` everywhere, and so does ``"auto"`` on the CPU.
The table is the process's: an engine started later in the same process measures the shapes again.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from tripath.models.linear import GEMM_CHOICES
from tripath.models.parallel import ColumnParallelLinear, RowParallelLinear
from tripath.ops.skinny_gemm import MAX_ROWS, skinny_gemm

logger = logging.getLogger(__name__)

SKINNY_GEMM_MODES = ("auto", "on", "off")
TIMED_REPS = 20   # calls in the timed graph of each path
MIN_GAIN = 0.03   # the split-K kernel is kept where it takes at most 97% of the library's time
FUSED_WEIGHTS = ("qkv_weight", "gate_up_weight")   # stacked weights the layers multiply by through linear()


def row_buckets(max_rows: int) -> list[int]:
    """Powers of two below ``min(max_rows, MAX_ROWS)``, and that bound."""
    top = max(1, min(max_rows, MAX_ROWS))
    return sorted({1 << i for i in range(top.bit_length()) if 1 << i < top} | {top})


def projection_weights(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """``(weight, bias)`` of one projection per distinct ``(N, K, dtype)`` that the model multiplies through
    :func:`tripath.models.linear.linear`: its parallel linears (not the LM head, whose logits take their own
    path, nor a linear whose weight became a view of a stacked one) and the layers' stacked weights."""
    found: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}
    lm_head = getattr(model, "lm_head", None)
    for module in model.modules():
        pairs = []
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module is not lm_head \
                and not _part_of_stacked(module.weight):
            pairs.append((module.weight, module.bias))
        for name in FUSED_WEIGHTS:
            weight = getattr(module, name, None)
            if isinstance(weight, torch.Tensor):
                pairs.append((weight, getattr(module, name.replace("weight", "bias"), None)))
        for weight, bias in pairs:
            if weight.dim() == 2:
                found.setdefault((*weight.shape, weight.dtype, bias is not None), (weight.detach(), bias))
    return list(found.values())


def _part_of_stacked(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is rows of a larger stacked weight (its storage holds more than it)."""
    return weight.untyped_storage().nbytes() > weight.numel() * weight.element_size()


def _graph_us(fn) -> float:
    """GPU µs a call of ``fn``: a CUDA graph of :data:`TIMED_REPS` calls, replayed once untimed and once timed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(TIMED_REPS):
            fn()
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1e3 / TIMED_REPS


@torch.inference_mode()
def measure(runner) -> list[str]:
    """Fill :data:`GEMM_CHOICES` for ``runner.model``'s projections as ``runner.config.skinny_gemm`` says and
    return the start log's lines (one per weight shape: per bucket, the split-K and the library's µs)."""
    mode, on_gpu = runner.config.skinny_gemm, runner.device.type == "cuda"
    buckets = row_buckets(runner.config.max_num_batched_tokens)
    lines = []
    for weight, bias in projection_weights(runner.model):
        if mode == "off" or (mode == "auto" and not on_gpu):
            GEMM_CHOICES.set(weight, {})
            continue
        choice, times = {}, []
        for low, b in zip([0] + buckets, buckets):
            choice[b] = True
            if not on_gpu:
                continue
            x = torch.randn(b, weight.shape[1], dtype=weight.dtype, device=weight.device)
            skinny_gemm(x[:low + 1], weight, bias)   # the bucket's smallest row count: its kernel variant
            skinny_gemm(x, weight, bias)
            if mode == "auto":
                library = _graph_us(lambda: F.linear(x, weight, bias))
                split_k = _graph_us(lambda: skinny_gemm(x, weight, bias))
                choice[b] = split_k < (1 - MIN_GAIN) * library
                times.append(f"{b}: {split_k:.1f}/{library:.1f}")
        GEMM_CHOICES.set(weight, choice)
        if times:
            lines.append(f"{weight.shape[0]}x{weight.shape[1]}: split-K / library µs at rows " + ", ".join(times))
    if not on_gpu:
        return lines
    torch.cuda.synchronize(runner.device)
    for line in lines:
        logger.info("GEMMs for few rows: %s", line)
    return lines
