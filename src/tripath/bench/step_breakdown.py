"""Where a step's time goes: host time inside each launch and the GPU's span of it, by kind of step.

:class:`StepBreakdown` wraps an engine's ``runner.launch`` (one rank) and records, for each launched step,
its kind, its new tokens, the host seconds the launch took (inputs, metadata, the graph replay or the eager
forward, sampling) and, on a GPU, the time between CUDA events recorded on the stream before and after it.
Kinds: ``decode (graph)`` (a decode-only step replayed from a CUDA graph), ``decode (eager)``, ``mixed``
(decodes beside prompt tokens) and ``prompt`` (prompt tokens only); a launch of ``k > 1`` model steps
(multi-step decoding) is its own kind, ``decode (graph) x k`` / ``decode (eager) x k``, whose times cover
all ``k`` steps.

The host time is split into phases: *inputs* (``runner.prepare``: the plan, the metadata integers, the step's
input arrays and their copies), *sample* (``runner._sample``: the logits or the fused draw, acceptance, the
tokens' copy to the host queued) and the rest (*forward*: the metadata objects, the graph replays or the eager
forward; a multi-step launch's draws are in it).

A GPU span close to the host time means the GPU waited for the host inside the step (host-bound); a span
well above it means the launch ran ahead of the GPU.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass


@dataclass
class _Record:
    kind: str
    num_tokens: int
    host_s: float
    events: tuple | None
    inputs_s: float = 0.0
    sample_s: float = 0.0


def step_kind(runner, scheduled, num_steps: int = 1) -> str:
    decodes = sum(1 for s in scheduled if s.num_new_tokens == 1 and s.num_computed_tokens > 0)
    if decodes == len(scheduled):
        kind = "decode (graph)" if runner.route(scheduled)[1] is not None else "decode (eager)"
        return kind if num_steps == 1 else f"{kind} x {num_steps}"
    return "mixed" if decodes else "prompt"


class StepBreakdown:
    """Records the launches of ``llm`` from :meth:`attach` until :meth:`detach`; :meth:`summary` reports."""

    def __init__(self, llm):
        from tripath.engine.runner.model_runner import ModelRunner

        if not isinstance(llm.runner, ModelRunner):
            raise ValueError("the step breakdown needs a one-rank engine (its runner a ModelRunner)")
        self.runner = llm.runner
        self._saved: dict | None = None   # while attached: the runner's own attributes it replaced
        self.records: list[_Record] = []
        self._phases = {"inputs": 0.0, "sample": 0.0}   # the launch in progress's host seconds by phase

    def attach(self) -> "StepBreakdown":
        import torch

        runner, real = self.runner, self.runner.launch
        on_gpu = runner.device.type == "cuda"

        def timed_launch(scheduled, previous=None, num_steps=1):
            kind = step_kind(runner, scheduled, num_steps)
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if on_gpu else None
            start = time.perf_counter()
            if events:
                events[0].record()
            self._phases.update(inputs=0.0, sample=0.0)
            launched = real(scheduled, previous, num_steps=num_steps)
            if events:
                events[1].record()
            self.records.append(_Record(kind, num_steps * sum(s.num_new_tokens for s in scheduled),
                                        time.perf_counter() - start, events, self._phases["inputs"],
                                        self._phases["sample"]))
            return launched

        self._saved = {name: runner.__dict__.get(name) for name in ("launch", "prepare", "_sample")}
        runner.launch = timed_launch
        runner.prepare = self._timed("inputs", runner.prepare)
        runner._sample = self._timed("sample", runner._sample)
        return self

    def _timed(self, phase: str, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._phases[phase] += time.perf_counter() - start
        return timed

    def detach(self) -> None:
        if self._saved is not None:
            for name, own in self._saved.items():   # what the runner had: the class's methods, or its own
                if own is None:
                    del self.runner.__dict__[name]
                else:
                    setattr(self.runner, name, own)
            self._saved = None

    def summary(self) -> dict[str, dict]:
        """``{kind: {steps, host_ms, inputs_ms, sample_ms, forward_ms, gpu_span_ms (None off a GPU), tokens}}``,
        means per step (``host_ms`` = inputs + sample + forward; waits for the GPU to finish the recorded
        steps)."""
        if any(r.events for r in self.records):
            import torch
            torch.cuda.synchronize(self.runner.device)
        by_kind: dict[str, list[_Record]] = defaultdict(list)
        for record in self.records:
            by_kind[record.kind].append(record)
        out = {}
        for kind, records in sorted(by_kind.items()):
            n = len(records)
            spans = [r.events[0].elapsed_time(r.events[1]) for r in records if r.events]
            host, inputs, sample = (1e3 * sum(getattr(r, f) for r in records) / n
                                    for f in ("host_s", "inputs_s", "sample_s"))
            out[kind] = {"steps": n, "host_ms": host, "inputs_ms": inputs, "sample_ms": sample,
                         "forward_ms": host - inputs - sample,
                         "gpu_span_ms": sum(spans) / len(spans) if spans else None,
                         "tokens": sum(r.num_tokens for r in records) / n}
        return out


def format_breakdown(backend: str, summary: dict[str, dict]) -> str:
    lines = [f"{backend}: per launched step, warm pass"]
    for kind, s in summary.items():
        span = "-" if s["gpu_span_ms"] is None else f"{s['gpu_span_ms']:.3f} ms"
        lines.append(f"  {kind:15s} {s['steps']:6d} steps  host in launch {s['host_ms']:.3f} ms (inputs "
                     f"{s['inputs_ms']:.3f}, forward {s['forward_ms']:.3f}, sample {s['sample_ms']:.3f})  "
                     f"GPU span {span}  {s['tokens']:.0f} new tokens")
    return "\n".join(lines)
