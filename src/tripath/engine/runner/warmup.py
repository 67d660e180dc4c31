"""Warm-up at engine start: every kernel variant the engine can launch is compiled before it serves.

Triton compiles a kernel once per variant: the constexprs and launch options a launcher picks from the
step's shape (tile sizes by sequence length, split-KV on or off, which pass runs beside which) and the
specialisation of the other arguments (see :mod:`tripath.triton_internals.specialize`, which keeps the per-step
integers and index pointers out of it). Which variants occur depends on the model's attention, the
backend, the dtypes, the block size and the engine's limits (``max_num_seqs``, ``max_num_batched_tokens``,
``max_model_len``), so the warm-up derives them from those:

1. **Record** the attention calls of the model: one real forward of a short prompt under a
   :class:`ForwardContext` that remembers each layer's call (tensors, options, MLA weights); layers with
   identical calls count once.
2. **Probe** a deterministic set of synthetic steps (:func:`warmup_shapes`) spanning the limits: decode
   batches of every size class and context length, prefills, extends with one and with several context
   chunks, and mixes of the three. For each step the metadata is built as the engine builds it and the
   recorded calls are replayed with launches captured (:func:`tripath.triton_internals.capture_launches`: the
   launchers validate and choose their variants, nothing runs), which yields the step's variant keys.
3. **Compile** by running, for real, each probed step that brought a variant no earlier step had (its
   K/V writes go to slot −1, so the cache is untouched). Without a saved plan (below) the compilations
   are first made in parallel: steps 1 and 3 run once with compilations listed instead of made, child
   processes compile the list into Triton's cache (:mod:`tripath.triton_internals.compile_pool`: the runner's pool of
   ``compile_workers``), and step 3's real run then loads each variant from there.

Probing costs host time (a few thousand steps), so the steps of 3 are saved in Triton's cache directory
(:func:`tripath._env.triton_cache_dir`), keyed by everything the variants depend on (the attention spec,
backend, limits, platform, the Triton version and tripath's own launcher sources): a later start with the
same key runs those steps without probing, and an empty Triton cache means an empty warm-up plan too.

The model's own layers run too (step 1, the KV sizing prefill and the CUDA-graph captures), so what is left
on the request path is only kernels whose variant no probe predicted: :attr:`WarmupReport.variants` is the
set to compare against (``tests/test_warmup.py`` drives random workloads against it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Protocol, Sequence

from pathlib import Path

import numpy as np
import torch

from tripath import _env
from tripath.attention import ForwardContext
from tripath.engine.scheduling.block_manager import blocks_needed
from tripath.engine.speculative.trees import chain_parents, tree_mask_bits
from tripath.platform import current_platform
from tripath.triton_internals import CompilePool, PoolReport, collect_compilations
from tripath.triton_internals import capture_launches, launch_key

if TYPE_CHECKING:
    from tripath.attention import AttentionSpec
    from tripath.attention.backends.base import AttentionBackend
    from tripath.engine.config import EngineConfig

logger = logging.getLogger(__name__)

RECORD_TOKENS = 37  # the recording prompt's length: odd, so no weight dimension is mistaken for the tokens


class RunnerBasics(Protocol):
    """What every step of the start reads of a runner: the model, its settings, the attention backend, the
    device and the cache's geometry. :class:`WarmupRunner`, the memory plan's ``PlanningRunner`` and the start's
    ``StartingRunner`` add what each needs."""

    @property
    def model(self) -> torch.nn.Module: ...          # forward(input_ids, positions, ctx)

    @property
    def config(self) -> EngineConfig: ...            # the limits and the start's settings

    @property
    def backend(self) -> AttentionBackend: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def block_size(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...


class WarmupRunner(RunnerBasics, Protocol):
    """What the warm-up reads of a runner (a :class:`~tripath.engine.runner.model_runner.ModelRunner` is one): the model
    it runs, the attention it probes, the limits it spans and the caches its steps read. It assigns nothing."""

    @property
    def spec(self) -> AttentionSpec: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def caches(self) -> list: ...

    @property
    def captures_verify_graphs(self) -> bool: ...    # the verify graphs' batches are steps to reach


@dataclass
class AttentionCall:
    """One layer's call into its :class:`ForwardContext`: ``method`` (``attend`` / ``attend_mla``), its
    positional ``args`` and keyword ``kwargs`` as the model passed them for ``num_tokens`` tokens."""

    method: str
    layer_idx: int
    args: tuple
    kwargs: dict
    num_tokens: int

    def signature(self) -> tuple:
        def describe(value):
            if isinstance(value, torch.Tensor):
                return ("tensor", value.dtype, tuple(value.shape[1:]) if value.dim() else ())
            if isinstance(value, (int, float, str, bool, type(None))):
                return value
            return type(value).__name__
        return (self.method, tuple(describe(a) for a in self.args),
                tuple(sorted((k, describe(v)) for k, v in self.kwargs.items())))

    def replay(self, ctx: ForwardContext, num_tokens: int, generator: torch.Generator | None) -> None:
        """Call ``ctx`` again with every per-token tensor remade for ``num_tokens`` tokens: random values
        from ``generator``, or uninitialised ones when it is None (launches captured: nothing reads them)."""
        args = [self._resized(a, num_tokens, generator) for a in self.args]
        kwargs = {k: self._resized(v, num_tokens, generator) for k, v in self.kwargs.items()}
        getattr(ctx, self.method)(self.layer_idx, *args, **kwargs)

    def _resized(self, value, num_tokens: int, generator: torch.Generator | None):
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != self.num_tokens:
            return value
        shape = (num_tokens, *value.shape[1:])
        if not value.dtype.is_floating_point:
            return torch.zeros(shape, dtype=value.dtype, device=value.device)  # positions, token ids
        if generator is None:
            return torch.empty(shape, dtype=value.dtype, device=value.device)
        return torch.randn(shape, generator=generator, device=value.device).mul_(0.5).to(value.dtype)


@dataclass
class _RecordingContext(ForwardContext):
    calls: list = field(default_factory=list)

    def attend(self, layer_idx, q, k, v, **kwargs):
        self.calls.append(AttentionCall("attend", layer_idx, (q, k, v), dict(kwargs), q.shape[0]))
        return super().attend(layer_idx, q, k, v, **kwargs)

    def attend_mla(self, layer_idx, q_nope, q_pe, kv_c, k_pe, positions, weights):
        self.calls.append(AttentionCall("attend_mla", layer_idx, (q_nope, q_pe, kv_c, k_pe, positions, weights),
                                        {}, q_nope.shape[0]))
        return super().attend_mla(layer_idx, q_nope, q_pe, kv_c, k_pe, positions, weights)


@dataclass(frozen=True)
class WarmupLimits:
    """What bounds a step: requests, new tokens, tokens of one request, and the decode threshold;
    ``verify_graph_sizes``: the verify graphs' batch sizes (none: no verify graphs), whose padded verifies
    of ``decode_threshold`` tokens may exceed the token budget; ``draft_trees``: verifies may carry draft
    trees (the verify kernel's tree-mask variant)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    decode_threshold: int = 1
    verify_graph_sizes: tuple[int, ...] = ()
    draft_trees: bool = False


def levels(limit: int, start: int = 1) -> list[int]:
    """Sizes from ``start`` to ``limit``: every integer up to 8, then about four a doubling (×1.25),
    and ``limit`` itself — fine enough that each launch-configuration threshold between them is crossed."""
    out, x = set(), start
    while x <= limit:
        out.add(x)
        x = x + 1 if x < 8 else max(x + 1, int(x * 1.25))
    out.add(limit)
    return sorted(v for v in out if start <= v <= limit)


def powers_of_two(limit: int, start: int = 1) -> list[int]:
    out = {1 << i for i in range(limit.bit_length()) if start <= 1 << i <= limit}
    return sorted(out | ({limit} if limit >= start else set()))


Step = tuple  # (query_lens, context_lens), or (query_lens, context_lens, True): its verifies as draft trees


def warmup_shapes(limits: WarmupLimits) -> list[Step]:
    """The synthetic steps the warm-up probes, as ``(query_lens, context_lens)``, within ``limits``.

    - decode only: every batch-size level × every context level (split-KV counts and tile choices follow
      the batch and the longest context); with ``decode_threshold > 1`` the same for decodes of that many
      tokens (speculative decoding's verifies), and each verify graph's batch on the longest context;
    - prefill only: every length level × every request-count level that fits the token budget;
    - extend only: query lengths, cached contexts (one and several chunks) and request counts in powers of
      two that fit;
    - mixes of two or three classes, small and large members, so the launches that run beside each other
      (and pick their tiles for it) occur;
    - with ``draft_trees``, every step with verifies once more, its verifies as draft trees.
    """
    b_max, n_max, l_max = limits.max_num_seqs, limits.max_num_batched_tokens, limits.max_model_len
    dq = limits.decode_threshold
    steps: list[Step] = []
    ctx_levels = levels(max(1, l_max - dq))
    for b in levels(min(b_max, n_max)):
        for ctx in ctx_levels:
            steps.append(([1] * b, [ctx] * b))
    if dq > 1:   # verifies (speculative decoding): the decode path's multi-token kernel, its split counts
        for b in levels(min(b_max, n_max // dq)):
            for ctx in ctx_levels:
                steps.append(([dq] * b, [ctx] * b))
        for b in limits.verify_graph_sizes:   # each graph's own batch, its table as wide as max_model_len
            steps.append(([dq] * b, [max(1, l_max - dq)] * b))
    for n in levels(min(n_max, l_max)):
        for p in levels(min(b_max, n_max // n)):
            steps.append(([n] * p, [0] * p))
    extend_q = [q for q in powers_of_two(min(n_max, l_max - 1)) if q > dq]
    for q in extend_q:
        for ctx in powers_of_two(l_max - q):
            for e in powers_of_two(min(b_max, n_max // q)):
                steps.append(([q] * e, [ctx] * e))
    decodes = [[], [(1, max(1, min(64, l_max - dq)))], [(1, max(1, l_max - dq))] * min(b_max, 64)]
    if dq > 1:
        decodes.append([(dq, max(1, min(64, l_max - dq)))])
    extends = [[]] + [[(q, c)] for q, c in ((dq + 1, 16), (min(512, n_max // 4), max(1, l_max // 2)))
                      if q > dq and q + c <= l_max]
    prefills = [[]] + [[(n, 0)] for n in sorted({min(16, n_max), max(1, min(n_max // 4, l_max))})]
    for d in decodes:
        for e in extends:
            for p in prefills:
                if sum(1 for part in (d, e, p) if part) < 2:
                    continue
                members = d + e + p
                if len(members) > b_max or sum(q for q, _ in members) > n_max:
                    continue
                steps.append(([q for q, _ in members], [c for _, c in members]))
    if limits.draft_trees and dq > 1:
        steps += [(q, c, True) for q, c in steps if any(1 < n <= dq for n in q)]
    return steps


@dataclass
class WarmupReport:
    """What the warm-up did: ``variants`` (launch keys, :func:`tripath.triton_internals.launch_key`) its probes
    produced, how many steps it probed and ran, and the seconds it took."""

    variants: set = field(default_factory=set)
    steps_probed: int = 0
    steps_run: int = 0
    seconds: float = 0.0
    pool: PoolReport | None = None  # the compilations made ahead in child processes, if they were

    def summary(self) -> str:
        text = (f"{len(self.variants)} kernel variants from {self.steps_probed} probed steps, {self.steps_run} "
                f"run to compile them, in {self.seconds:.1f} s")
        if self.pool is not None:
            text += (f" ({self.pool.compiled} compiled ahead by {self.pool.workers} processes in "
                     f"{self.pool.seconds:.1f} s, {len(self.pool.failed)} failed)")
        return text


def record_attention_calls(runner: WarmupRunner, *, run_kernels: bool = True) -> list[AttentionCall]:
    """One forward of a :data:`RECORD_TOKENS`-token prompt through the model (its kernels captured, not run,
    unless ``run_kernels``), remembering each layer's attention call; the distinct ones (by
    :meth:`AttentionCall.signature`) in layer order."""
    backend, device = runner.backend, runner.device
    n = RECORD_TOKENS
    plan = backend.plan([n], [0])
    block_table, slot_mapping = synthetic_tables(plan, runner.block_size, runner.num_blocks, device)
    ctx = _RecordingContext(backend, backend.build_metadata(plan, block_table, slot_mapping), runner.caches)
    ids = torch.zeros(n, dtype=torch.int64, device=device)
    positions = torch.arange(n, dtype=torch.int64, device=device)
    with torch.inference_mode(), contextlib.nullcontext() if run_kernels else capture_launches():
        runner.model(ids, positions, ctx)
    distinct, seen = [], set()
    for call in ctx.calls:
        sig = call.signature()
        if sig not in seen:
            seen.add(sig)
            distinct.append(call)
    return distinct


def synthetic_tables(plan, block_size: int, num_blocks: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A block table as wide as the step's longest request (rows of block ids ``1, 2, …``, wrapping inside
    the cache) and a slot mapping of −1 (nothing written)."""
    width = max(blocks_needed(s, block_size) for s in plan.seq_lens)
    row = np.arange(width, dtype=np.int64) % max(1, num_blocks - 1) + 1
    table = np.broadcast_to(row.astype(np.int32), (plan.num_requests, width)).copy()
    slots = torch.full((plan.num_tokens,), -1, dtype=torch.int64)
    return torch.from_numpy(table).to(device), slots.to(device)


def step_metadata(runner: WarmupRunner, step: Step) -> tuple[object, object]:
    """The plan of a synthetic ``step`` and its metadata on :func:`synthetic_tables`; a draft-tree step's
    verifies carry tree masks (each a chain's: the same attention as causal, through the tree variant)."""
    plan = runner.backend.plan(step[0], step[1])
    tables = synthetic_tables(plan, runner.block_size, runner.num_blocks, runner.device)
    meta = runner.backend.build_metadata(plan, *tables)
    verify = meta.decode.verify if len(step) > 2 and meta.decode is not None else None
    if verify is not None:
        rows = plan.query_lens[verify.first_row:plan.num_decodes]
        bits = [b for q in rows for b in tree_mask_bits(chain_parents(q - 1))]
        verify.tree_mask = torch.tensor(bits, dtype=torch.int32, device=runner.device)
    return plan, meta


def probe(runner: WarmupRunner, calls: Sequence[AttentionCall], step: Step) -> tuple[object, set]:
    """The metadata of ``step`` and the variant keys its attention launches would use (nothing runs)."""
    backend = runner.backend
    plan, meta = step_metadata(runner, step)
    ctx = ForwardContext(backend, meta, runner.caches)
    with capture_launches(keep=launch_key) as keys, torch.inference_mode():  # no launch's tensors kept
        for call in calls:
            call.replay(ctx, plan.num_tokens, None)
    return meta, set(keys)


def runner_limits(runner: WarmupRunner) -> WarmupLimits:
    config = runner.config
    sizes = tuple(config.cuda_graph_batch_sizes()) if runner.captures_verify_graphs else ()
    speculation = config.speculative_config
    return WarmupLimits(config.max_num_seqs, config.max_num_batched_tokens, runner.max_model_len,
                        runner.spec.decode_threshold, sizes, speculation is not None and speculation.uses_trees)


def warm_up(runner: WarmupRunner, shapes: Iterable[Step] | None = None, *, run_kernels: bool = True,
            use_saved_plan: bool = True, pool: CompilePool | None = None) -> WarmupReport:
    """Probe ``shapes`` (default :func:`warmup_shapes` of the runner's limits) and, with ``run_kernels``,
    run each step that brings a new variant so it compiles. With ``use_saved_plan`` (and the default
    shapes) a plan saved by an earlier start with the same key replaces the probing. Without a saved plan
    (an empty or outdated Triton cache) and with a ``pool``, the compilations are first made there, in
    parallel (:mod:`tripath.triton_internals.compile_pool`). Returns the report."""
    start = time.perf_counter()
    plan_path = saved_plan_path(runner) if use_saved_plan and shapes is None and run_kernels else None
    saved = _load_plan(plan_path)
    ahead = pool is not None and run_kernels and saved is None
    report = WarmupReport()
    with collect_compilations() if ahead else contextlib.nullcontext([]) as compilations:
        calls = record_attention_calls(runner, run_kernels=run_kernels)
        to_run: list[Step] = []
        if saved is not None:
            to_run, report.steps_probed = saved["steps"], saved["steps_probed"]
            report.variants = {("saved", i) for i in range(saved["variants"])}
        else:
            for step in shapes if shapes is not None else warmup_shapes(runner_limits(runner)):
                _, keys = probe(runner, calls, step)
                report.steps_probed += 1
                if not keys <= report.variants:
                    report.variants |= keys
                    to_run.append(step)
        if ahead:  # launches that would compile launch nothing: this lists the compilations
            run_steps(runner, calls, to_run)
    if ahead:
        pool.compile(compilations)
        report.pool = pool.report
        calls = record_attention_calls(runner)  # for real now, its kernels from the cache
    if run_kernels:
        report.steps_run = run_steps(runner, calls, to_run)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
    if plan_path is not None and saved is None:
        _save_plan(plan_path, to_run, report)
    report.seconds = time.perf_counter() - start
    logger.info("warm-up: %s%s", report.summary(), " (saved plan)" if saved is not None else "")
    return report


def run_steps(runner: WarmupRunner, calls: Sequence[AttentionCall], steps: Iterable[Step]) -> int:
    """Replay ``calls`` on each of ``steps`` for real (random inputs, K/V written to slot −1: the caches are
    untouched), so their variants compile; returns how many steps ran."""
    generator = torch.Generator(device=runner.device).manual_seed(0)
    count = 0
    for step in steps:
        plan, meta = step_metadata(runner, step)
        ctx = ForwardContext(runner.backend, meta, runner.caches)
        with torch.inference_mode():
            for call in calls:
                call.replay(ctx, plan.num_tokens, generator)
        count += 1
    return count


def _source_digest() -> str:
    """A digest of the sources that decide which variants launch: the kernels, ops, attention and this file."""
    import tripath

    root = Path(tripath.__file__).resolve().parent   # wherever this module sits in the package
    digest = hashlib.sha256()
    for folder in ("kernels", "ops", "attention"):
        for path in sorted((root / folder).rglob("*.py")):
            digest.update(path.read_bytes())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()


def saved_plan_path(runner: WarmupRunner) -> Path:
    """Where the warm-up plan of this runner's configuration is saved (see the module doc)."""
    import triton

    platform = current_platform(runner.device)
    key = repr((runner.spec, runner.backend.name, runner.block_size, runner_limits(runner), platform,
                str(runner.device), triton.__version__, torch.__version__, _source_digest()))
    name = hashlib.sha256(key.encode()).hexdigest()[:32]
    return Path(_env.triton_cache_dir()) / "tripath-warmup" / f"{name}.json"


def _load_plan(path: Path | None) -> dict | None:
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return {"steps": [(list(q), list(c), *trees) for q, c, *trees in data["steps"]],
                "steps_probed": int(data["steps_probed"]),
                "variants": int(data["variants"])}
    except (OSError, ValueError, KeyError, TypeError):
        logger.warning("ignoring an unreadable warm-up plan at %s", path)
        return None


def _save_plan(path: Path, steps: list[Step], report: WarmupReport) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"steps": steps, "steps_probed": report.steps_probed,
                                   "variants": len(report.variants)}))
        tmp.replace(path)
    except OSError as err:  # a read-only cache directory only costs the next start its probing
        logger.warning("could not save the warm-up plan to %s: %s", path, err)
